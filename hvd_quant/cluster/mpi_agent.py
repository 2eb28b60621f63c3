"""OpenMPI's remote shell agent for the emulated cluster (``plm_rsh_agent``; see
:mod:`hvd_quant.cluster.mpi`): what ssh does on a real cluster, for a host that is a
network namespace of this machine.

    python -m hvd_quant.cluster.mpi_agent --host=NAME@NETNS@CPUS ... HOST COMMAND...

mpirun calls it with the host and the daemon's command line; it pins itself to that host's
CPUs, sets ``HVDQ_CLUSTER_CPUS`` as the cluster does for its ranks, and becomes
``ip netns exec NETNS /bin/sh -c COMMAND``, so the daemon and the ranks it starts live in
the host's namespace, as this process's descendants. Kept apart from
:mod:`hvd_quant.cluster.mpi` so that ``-m`` runs it without the package importing it first.
"""

import os
import sys


def agent(argv):
    """The remote shell agent: ``--host=NAME@NETNS@CPUS ... HOST COMMAND...`` (see the
    module docstring). Exits 255, as ssh does, for a host it does not know."""
    hosts = {}
    while argv and argv[0].startswith("--host="):
        name, netns_name, cpus = argv.pop(0)[len("--host="):].split("@")
        hosts[name] = (netns_name, cpus)
    while argv and argv[0] not in hosts and argv[0].startswith("-"):
        argv.pop(0)  # an option OpenMPI gives its agents (none for ours, so far)
    if not argv or argv[0] not in hosts:
        print(f"hvd_quant.cluster.mpi_agent: unknown host in {argv[:1]}; hosts: {sorted(hosts)}", file=sys.stderr)
        return 255
    netns_name, cpus = hosts[argv[0]]
    if cpus:
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
        os.environ["HVDQ_CLUSTER_CPUS"] = cpus
    os.execvp("ip", ["ip", "netns", "exec", netns_name, "/bin/sh", "-c", " ".join(argv[1:])])


if __name__ == "__main__":
    sys.exit(agent(sys.argv[1:]))
