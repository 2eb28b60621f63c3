"""Launch a job across the emulated hosts with OpenMPI's ``mpirun`` (``--launcher mpi``).

``mpirun`` runs in host 0's namespace, pinned to host 0's CPUs, and starts host 0's ranks
itself. On every other host OpenMPI starts its daemon (``orted``), which starts that host's
ranks, through a *remote shell agent* (``ssh`` by default; the MCA parameter
``plm_rsh_agent``). Here the agent is :mod:`hvd_quant.cluster.mpi_agent`::

    python -m hvd_quant.cluster.mpi_agent --host=h1@NS@CPUS ... h1 ORTED_COMMAND_LINE

It pins itself to the host's CPUs and runs the daemon's command line with ``/bin/sh -c``
inside the host's namespace (``ip netns exec``), as ssh would run it in the remote login
shell; its process stays the daemon's parent, as ssh stays while the remote command runs.

Traffic stays on the emulated links: OpenMPI's out-of-band channel (``oob_tcp_if_include``)
and its byte-transfer layer (``btl_tcp_if_include``) use only ``eth0``, the host's shaped
veth, and the only transports are TCP and ``self``. The shared-memory transport (``vader``)
is left out: every namespace shares the machine's hostname, and vader names its segment
files by hostname and local rank, so host 0's and host 1's first ranks would open the same
file. Ranks on one host then talk TCP over that host's own address, unshaped (the kernel
delivers it locally), as Gloo's ranks on one host do over loopback.

Horovod needs no variables of its own under ``mpirun``: it takes rank, size and the host
layout from MPI (``MPI_Comm_split_type``: ranks of one OpenMPI node are one Horovod host),
and its controller and CPU operations default to MPI in a build with MPI
(``scripts/build_horovod.sh``). The Gloo settings of the caller's environment are removed.
"""

import os
import re
import shutil
import subprocess
import sys

from .launch import JobResult, JobTimeout, run_ranks
from .netns import HOST_DEV, ClusterUnavailable

#: Variables that would pin Horovod to the Gloo controller or to another job's layout.
GLOO_VARS = ("HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
             "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_IFACE", "HOROVOD_HOSTNAME", "HOROVOD_RANK",
             "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
             "HOROVOD_CROSS_SIZE")
# mpirun --tag-output: "[<job>,<rank>]<stdout>:<text>"
_TAG = re.compile(r"^\[\d+,(\d+)\]<(?:stdout|stderr|stddiag)>:(.*)$")
_SPLIT = re.compile(r"\[\d+,(\d+)\]<(?:stdout|stderr|stddiag)>:")
# mpirun's report of a failed rank: "Process name: [[<job>,<n>],<rank>]"
_FAILED = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]")


def mpi_problem():
    """Why an MPI launch cannot work here, or ``None``. (Whether Horovod was built with
    MPI is the ranks' business: this module does not import Horovod.)"""
    if shutil.which("mpirun") is None:
        return ("no mpirun: install an MPI (Debian: apt-get install openmpi-bin libopenmpi-dev) "
                "and rebuild Horovod with it (scripts/bootstrap.sh)")
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
    if "Open MPI" not in version.stdout + version.stderr:
        return f"mpirun is not OpenMPI's ({(version.stdout or version.stderr).strip().splitlines()[:1]}); --launcher mpi needs OpenMPI"
    return None


def agent_spec(cluster):
    """The ``plm_rsh_agent`` value: the agent module, with every host's namespace and CPUs.
    OpenMPI splits it on whitespace and treats ``:`` as a list of alternatives, so the
    values hold neither."""
    parts = [sys.executable, "-m", "hvd_quant.cluster.mpi_agent"]
    for host in cluster.hosts:
        cpus = cluster.host_cpus[host.index] if cluster.host_cpus is not None else []
        parts.append(f"--host={host.name}@{host.netns}@{','.join(map(str, cpus))}")
    spec = " ".join(parts)
    if ":" in spec:
        raise ClusterUnavailable(f"the interpreter's path {sys.executable!r} holds a ':', which "
                                 "OpenMPI's plm_rsh_agent cannot take")
    return spec


def mpirun_command(cluster, command):
    """``mpirun`` for one rank per slot on every host, then ``command``."""
    hosts = ",".join(f"{h.name}:{cluster.slots}" for h in cluster.hosts)
    cmd = ["mpirun", "-np", str(cluster.size), "-H", hosts, "--map-by", "slot", "--bind-to", "none",
           "--tag-output",
           "--mca", "plm_rsh_agent", agent_spec(cluster),
           "--mca", "pml", "ob1", "--mca", "btl", "self,tcp",
           "--mca", "btl_tcp_if_include", HOST_DEV, "--mca", "oob_tcp_if_include", HOST_DEV]
    if os.geteuid() == 0:  # OpenMPI refuses to run as root without it
        cmd.append("--allow-run-as-root")
    return cmd + list(command)


def mpi_env(cluster, extra=None):
    """mpirun's environment (every daemon and rank inherits it): this process's, without
    Gloo's variables, with the cluster's description and host 0's CPUs (the agent sets
    each other host's), plus ``extra``."""
    # Ranks write to a pseudo-terminal under mpirun, so Python buffers their output by line;
    # unbuffered, each print would be two writes, two tags and a torn line.
    env = {k: v for k, v in cluster.rank_env(0, unbuffered=False).items() if k not in GLOO_VARS}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(name, None)  # per rank, and not torch.distributed's job: MPI has them
    if cluster.ranks_outnumber_cpus() and "OMPI_MCA_mpi_yield_when_idle" not in env:
        # OpenMPI polls for messages without yielding unless it sees more ranks than slots,
        # and it trusts the slots given with -H: where a host's ranks outnumber its CPUs,
        # a polling rank takes the CPU its peer needs to send (3 ranks on 2 CPUs: the
        # tests' TensorFlow MPI job took 287 s polling, 145 s yielding).
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    env.update(extra or {})
    return env


class _Retag:
    """A stream that rewrites mpirun's tagged lines to the cluster's ``[r<rank>@h<host>]``."""

    def __init__(self, stream, labels):
        self.stream, self.labels = stream, labels

    def write(self, text):
        for line in text.splitlines():
            for out in retag(line, self.labels):
                self.stream.write(out + "\n")

    def flush(self):
        self.stream.flush()


def retag(line, labels):
    """``"[mpirun] [1,3]<stdout>:x"`` -> ``["[r3@h1] x"]``; other lines unchanged. mpirun
    tags every write, so a write that ends without a newline leaves the next write's tag,
    maybe another rank's, inside the line: the line is split there (empty pieces dropped)."""
    head, _, rest = line.partition("] ")
    if head != "[mpirun" or not _TAG.match(rest):
        return [line]
    pieces = _SPLIT.split(rest)  # "", rank, text, rank, text, ...
    out = [f"[{labels[int(r)]}] {text}" for r, text in zip(pieces[1::2], pieces[2::2])
           if int(r) < len(labels) and (text or len(pieces) == 3)]
    return out or [line]


def run_mpi(cluster, command, timeout, env=None, stream=None):
    """Run ``command`` on every rank of ``cluster`` under mpirun; a :class:`JobResult`
    whose lines carry the cluster's rank labels (mpirun's own lines: ``[mpirun]``)."""
    problem = mpi_problem()
    if problem:
        raise ClusterUnavailable(problem)
    labels = [f"r{r}@{cluster.rank_host(r).name}" for r in range(cluster.size)]
    cmd = cluster._pinned(0) + ["ip", "netns", "exec", cluster.hosts[0].netns,
                                *mpirun_command(cluster, command)]
    try:
        result = run_ranks([cmd], [mpi_env(cluster, env)], ["mpirun"], timeout,
                           stream=_Retag(stream, labels) if stream is not None else None)
    except JobTimeout as exc:
        raise JobTimeout(str(exc), _per_rank(exc.result, labels)) from None
    finally:
        # Daemons and ranks that outlived mpirun (killed by the time limit) go too.
        for host in cluster.hosts:
            from .netns import kill_namespace_processes
            kill_namespace_processes(host.netns, grace=0.5)
    return _per_rank(result, labels)


def _per_rank(result, labels):
    lines = [out for line in result.stdout.splitlines() for out in retag(line, labels)]
    per_rank = [[] for _ in labels]
    for line in lines:
        head, _, text = line.partition("] ")
        if head[1:] in labels:
            per_rank[labels.index(head[1:])].append(text)
    failed = _FAILED.search(result.stdout) if result.returncode else None
    return JobResult(result.args, result.returncode, "\n".join(lines) + ("\n" if lines else ""),
                     ["\n".join(r) for r in per_rank], [None] * len(labels),
                     int(failed.group(1)) if failed else None, result.timed_out, result.elapsed)
