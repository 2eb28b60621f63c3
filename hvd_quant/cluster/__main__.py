"""Command line of the emulated cluster.

    python -m hvd_quant.cluster check [--quick]
    python -m hvd_quant.cluster run --hosts 2 [--slots 1] [--rate 1gbit] [--delay 1ms]
                                    [--cpus split] [--timeout 600] [--launcher gloo|mpi|torchrun]
                                    [--no-horovod]
                                    -- python script.py ARGS
    python -m hvd_quant.cluster cleanup [--prefix hvdqc-] [--force]

``run`` creates the cluster, runs the command once per rank (Horovod's Gloo rendezvous;
OpenMPI's ``mpirun`` with ``--launcher mpi``, see :mod:`hvd_quant.cluster.mpi`; or plain
torch.distributed with ``--no-horovod``, its ranks started by one ``torchrun`` per host
with ``--launcher torchrun``), streams every rank's prefixed output,
removes the cluster and exits with the job's status (124 after a timeout). A bare
``python`` or ``python3`` after ``--`` means the interpreter running this module, as it
would with a virtual environment active (also under ``sudo``, which resets ``PATH``); a
rank that fails with ``ModuleNotFoundError`` is reported with the interpreter it ran.
Each host's ranks are pinned to that host's share of the CPUs (``--cpus split``, the
default; see :mod:`hvd_quant.cluster.emulated`). ``check``
says whether this machine can run it and, if not, why. ``cleanup`` removes what a
killed run left behind (clusters whose owner process is gone; ``--force``: all that
match the prefix).

Exit status: 0 success; the job's status for ``run``; 2 for bad arguments; 3 when the
cluster cannot run here (the message says why).
"""

import argparse
import re
import shutil
import sys

from . import netns
from .emulated import ClusterInterrupted, EmulatedCluster, resolve_interpreter, who_failed
from .launch import JobTimeout
from .mpi import mpi_problem
from .netns import ClusterError, ClusterUnavailable

EXIT_UNAVAILABLE = 3


def _check(args):
    problems, notes = (netns.requirement_problems(), []) if args.quick else netns.probe()
    if problems:
        print("cannot run an emulated cluster here:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    what = "root, ip, tc and network namespaces present" if args.quick else \
        "network namespaces, veth, bridge and tc tbf work"
    print(f"ok: {what}")
    for note in notes:
        print(f"note: {note}")
    problem = mpi_problem()
    print(f"note: --launcher mpi unavailable: {problem}" if problem else
          "ok: mpirun found (--launcher mpi also needs a Horovod built with MPI)")
    return 0


def _run(args):
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("run: give the command after '--', e.g. -- python script.py", file=sys.stderr)
        return 2
    if args.launcher == "mpi" and args.no_horovod:
        print("run: --launcher mpi starts a Horovod job; it cannot be combined with --no-horovod",
              file=sys.stderr)
        return 2
    if args.launcher == "torchrun":
        args.no_horovod = True  # torchrun starts torch.distributed jobs
    resolved = resolve_interpreter(command)
    if resolved[0] != command[0]:
        print(f"[cluster] {command[0]} -> {resolved[0]} (the interpreter running hvd_quant.cluster)",
              file=sys.stderr)
    command = resolved
    with EmulatedCluster(hosts=args.hosts, slots=args.slots, rate=args.rate, delay=args.delay,
                         mtu=args.mtu, cpus=args.cpus) as cluster:
        try:
            result = cluster.run(command, horovod=not args.no_horovod, timeout=args.timeout,
                                 stream=sys.stdout, launcher=args.launcher)
        except JobTimeout as exc:
            print(f"[cluster] {str(exc).splitlines()[0]}", file=sys.stderr)
            return 124
    if result.returncode != 0:
        print(f"[cluster] {who_failed(result.failed_rank, args.launcher)} failed with exit status {result.returncode}; "
              "the other ranks were stopped", file=sys.stderr)
        missing = missing_module(result.stdout)
        if missing:
            print(f"[cluster] the ranks ran {shutil.which(command[0]) or command[0]}, which has no "
                  f"module {missing!r}: give the interpreter of the environment that has it, e.g. "
                  f"-- {sys.executable} script.py", file=sys.stderr)
    return result.returncode if result.returncode >= 0 else 128 - result.returncode


def missing_module(output):
    """The module a rank's ``ModuleNotFoundError`` names in ``output``, or ``None``."""
    match = re.search(r"ModuleNotFoundError: No module named '([^']+)'", output)
    return match.group(1) if match else None


def _cleanup(args):
    netns.check_requirements()
    found = netns.leftover_clusters(args.prefix)
    if not found:
        print(f"nothing to clean up (no namespaces or records starting with {args.prefix!r})")
        return 0
    status = 0
    for prefix, owner in sorted(found.items()):
        if netns.owner_alive(owner) and not args.force:
            print(f"{prefix}*: in use by running process {owner}; left alone (--force removes it)")
            continue
        removed = netns.remove_cluster(prefix)
        left = [ns for ns in netns.list_namespaces() if ns.startswith(prefix)]
        if left:
            print(f"{prefix}*: could not remove {left}", file=sys.stderr)
            status = 1
        else:
            print(f"{prefix}*: removed {len(removed)} namespace(s) and their links")
    return status


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m hvd_quant.cluster",
                                description="An emulated cluster: hosts as network namespaces "
                                            "behind tc-shaped links, one Horovod job across them.")
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("check", help="can this machine run it? (exit 0: yes, 3: no, with why)")
    c.add_argument("--quick", action="store_true",
                   help="only look for root, ip, tc and netns; do not create a test link")
    r = sub.add_parser("run", help="run a command on every rank of a fresh cluster")
    r.add_argument("--hosts", type=int, default=2, help="emulated hosts (default 2)")
    r.add_argument("--slots", type=int, default=1, help="ranks per host (default 1)")
    r.add_argument("--rate", default="1gbit", help="each host's link rate, e.g. 100mbit, 1gbit, "
                                                   "10gbit, unlimited (default 1gbit)")
    r.add_argument("--delay", default=None, help="one-way host-to-host delay, e.g. 0.5ms (default none)")
    r.add_argument("--mtu", type=int, default=1500)
    r.add_argument("--cpus", choices=("split", "shared"), default="split",
                   help="split (default): each host gets its own share of this machine's CPUs, "
                        "its ranks pinned to it; shared: every rank may run on every CPU")
    r.add_argument("--timeout", type=float, default=600, help="hard limit for the job in seconds")
    r.add_argument("--launcher", choices=("gloo", "mpi", "torchrun"), default="gloo",
                   help="gloo (default): Horovod on Gloo, ranks started by this launcher; mpi: "
                        "OpenMPI's mpirun starts them, Horovod on MPI (needs OpenMPI and a Horovod "
                        "built with MPI); torchrun: one torchrun per host starts its ranks, a plain "
                        "torch.distributed job (DDP) without Horovod")
    r.add_argument("--no-horovod", action="store_true",
                   help="no Horovod rendezvous: a plain torch.distributed (env://) job")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    k = sub.add_parser("cleanup", help="remove namespaces and links left by a killed run")
    k.add_argument("--prefix", default=netns.NAME_PREFIX,
                   help=f"only clusters whose names start with this (default {netns.NAME_PREFIX})")
    k.add_argument("--force", action="store_true", help="also remove clusters whose owner still runs")
    args = p.parse_args(argv)
    try:
        return {"check": _check, "run": _run, "cleanup": _cleanup}[args.action](args)
    except ClusterUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, ClusterInterrupted) as exc:
        print(f"interrupted ({type(exc).__name__}); the cluster was removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
