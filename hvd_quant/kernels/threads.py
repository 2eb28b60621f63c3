"""How many threads the fused kernels use: the usable cores divided by the ranks on this host.

The usual layout puts several ranks on one host (one per GPU, socket or core group). If
every rank's kernels took every core, ranks that share a host would oversubscribe it:
``benchmarks/bench_threads.py``, 2 processes at once on this project's 2-core machine,
the kernel work of one step of a 31.7M-parameter LM (52 tensors): 77-87 ms with one
serial thread per rank, 151-268 ms with each rank's numba pool on both cores on an
otherwise quiet machine, 1326 ms while other work ran too (OpenMP threads spin while they
wait for a core another process holds). A real training step was slower than plain
Horovod that way (ef_sign's LM step on 2 ranks: 3384 ms, against 478 ms with this
policy). So, by default, each rank gets

    threads = max(1, usable cores // ranks on this host)

* **usable cores**: the CPU affinity mask (``os.sched_getaffinity``; what ``taskset``,
  ``numactl`` or a launcher's binding leave to the process) and the cgroup CPU quota
  (``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us / cpu.cfs_period_us`` in v1: what a
  container's ``--cpus`` or a Kubernetes CPU limit sets), whichever is smaller, the quota
  rounded down (at least 1).
* **ranks on this host**: ``hvd.local_size()`` once Horovod is initialised (torch or
  TensorFlow), else what the launcher exported (``HOROVOD_LOCAL_SIZE`` from
  ``horovodrun``, Open MPI's ``OMPI_COMM_WORLD_LOCAL_SIZE``, MPICH's ``MPI_LOCALNRANKS``,
  MVAPICH's ``MV2_COMM_WORLD_LOCAL_SIZE``, ``torchrun``'s ``LOCAL_WORLD_SIZE``), else 1. A rank that reduces over a process set
  still shares the host with every other local rank, so it is the host's count that counts.

**One thread means serial kernels.** With one thread per rank, the kernels run compiled
without a parallel region at all (the same loop bodies compiled with ``parallel=False``):
measured with ``benchmarks/bench_threads.py``, the parallel twins on a pool of one thread
took 1.3-1.4x the serial twins' time in total (2 processes at once, quiet machine), most of
it in Global-QSGD's stochastic rounding (62 ms against 21), whose parallel compilation
vectorises worse; the other kernels were within noise of their serial twins. With more threads the parallel kernels run on numba's pool,
which is sized to the chosen count (``NUMBA_NUM_THREADS`` is set before numba is first
imported, so the pool never holds more threads than the rank's share).

**An explicit setting wins**, in this order: :func:`set_threads` (an hvd_quant option,
e.g. ``hvd_quant.kernels.set_threads(4)``), the ``HVD_QUANT_THREADS`` environment
variable, and numba's own ``NUMBA_NUM_THREADS`` set by the user. The choice is logged
once per process by the ``hvd_quant`` logger (rank 0 at INFO, other ranks at DEBUG), and
:func:`describe` returns the same line.

What it does not do: set torch's or TensorFlow's intra-op threads. Those are the user's,
as in Horovod; the documentation (docs/guide/tuning.md, "Threads per rank") says what
they should be per rank (the same share, :func:`threads_per_rank`), and the adapters log a
warning once when they oversubscribe the host.
"""

import logging
import math
import os
import sys
import threading
from dataclasses import dataclass

log = logging.getLogger("hvd_quant")

#: Launchers' variables for the number of ranks on this host, in the order they are tried.
LOCAL_SIZE_VARS = ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                   "MV2_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE")
#: Launchers' variables for this process's global rank (for the log level only).
RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "RANK")

#: Set next to NUMBA_NUM_THREADS whenever this module sets it: the value it set. Child
#: processes inherit the environment (a launcher script that imported hvd_quant, pytest, a
#: notebook), and a rank must not take its parent's policy choice for a user's setting: the
#: parent's share of the cores is not the rank's.
_OWN_MARK = "HVD_QUANT_SET_NUMBA_THREADS"


def _user_numba_threads(environ):
    """NUMBA_NUM_THREADS as the user set it, or None: unset, or the value an hvd_quant
    parent process set (``_OWN_MARK`` holds it; a user's later change differs from it)."""
    value = environ.get("NUMBA_NUM_THREADS")
    if value is not None and value == environ.get(_OWN_MARK):
        return None
    return value


# Read before this module ever sets NUMBA_NUM_THREADS itself.
_USER_NUMBA_THREADS = _user_numba_threads(os.environ)


@dataclass(frozen=True)
class Choice:
    """The threads the kernels use in this process, and why."""
    threads: int
    source: str          # "set_threads()", "HVD_QUANT_THREADS", "NUMBA_NUM_THREADS" or "policy"
    cores: int           # usable cores
    cores_why: str       # how they were found
    local_size: int      # ranks on this host
    local_size_why: str  # where that came from

    @property
    def serial(self):
        """One thread: the kernels compiled without a parallel region."""
        return self.threads == 1

    def describe(self):
        how = "serial kernels" if self.serial else "parallel kernels"
        if self.source == "policy":
            why = (f"{self.cores} usable cores ({self.cores_why}) / {self.local_size} ranks on "
                   f"this host ({self.local_size_why})")
        else:
            why = f"set by {self.source}"
        return (f"hvd_quant kernels: {self.threads} thread{'s' * (self.threads != 1)} per rank "
                f"({how}): {why}")


# --- usable cores ---------------------------------------------------------------------------
def affinity_cores():
    """CPUs this process may run on (its affinity mask), or ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_dirs(mount, rel):
    """The process's cgroup directory under ``mount`` and its ancestors up to the mount
    (a limit on any ancestor applies). Inside a container the path in /proc/self/cgroup
    may not exist under the container's mount: then the mount itself is the cgroup."""
    rel = rel.strip("/")
    leaf = os.path.join(mount, rel) if rel else mount
    if not os.path.isdir(leaf):
        return [mount]
    dirs = []
    while True:
        dirs.append(leaf)
        if os.path.normpath(leaf) == os.path.normpath(mount) or not rel:
            return dirs
        rel = os.path.dirname(rel)
        leaf = os.path.join(mount, rel) if rel else mount


def cgroup_cpu_limit(root="/sys/fs/cgroup", proc_cgroup="/proc/self/cgroup"):
    """The cgroup CPU quota in CPUs (a float), or ``None`` when there is none.

    cgroup v2: ``cpu.max`` (``"max 100000"`` or ``"<quota> <period>"``); v1: the ``cpu``
    controller's ``cpu.cfs_quota_us`` (``-1``: none) over ``cpu.cfs_period_us``. The
    smallest limit on the process's cgroup or any ancestor.
    """
    text = _read(proc_cgroup) or ""
    limits = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # cgroup v2 (unified)
            for mount in (root, os.path.join(root, "unified")):
                if os.path.exists(os.path.join(mount, "cgroup.controllers")):
                    for d in _cgroup_dirs(mount, rel):
                        fields = (_read(os.path.join(d, "cpu.max")) or "").split()
                        if len(fields) == 2 and fields[0] != "max":
                            limits.append(int(fields[0]) / int(fields[1]))
                    break
        elif "cpu" in controllers.split(","):
            for name in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                mount = os.path.join(root, name)
                if os.path.isdir(mount):
                    for d in _cgroup_dirs(mount, rel):
                        quota = _read(os.path.join(d, "cpu.cfs_quota_us"))
                        period = _read(os.path.join(d, "cpu.cfs_period_us"))
                        if quota and period and int(quota) > 0 and int(period) > 0:
                            limits.append(int(quota) / int(period))
                    break
    return min(limits) if limits else None


def usable_cores():
    """``(cores, why)``: the affinity mask's CPUs, capped by the cgroup quota (rounded
    down, at least 1)."""
    cores = affinity_cores()
    why = f"affinity {cores}"
    try:
        quota = cgroup_cpu_limit()
    except (OSError, ValueError):  # an unreadable or odd cgroup file: no quota known
        quota = None
    if quota is None:
        return cores, why + ", no cgroup CPU quota"
    capped = max(1, min(cores, math.floor(quota)))
    return capped, why + f", cgroup CPU quota {quota:g}"


# --- ranks on this host -----------------------------------------------------------------------
def _horovod_modules():
    """Horovod framework modules already imported in this process (never imports one)."""
    return [sys.modules[m] for m in ("horovod.torch", "horovod.tensorflow") if m in sys.modules]


def local_ranks():
    """``(ranks on this host, where that came from)``."""
    for hvd in _horovod_modules():
        try:
            if hvd.is_initialized():
                return int(hvd.local_size()), "hvd.local_size()"
        except (AttributeError, ValueError, RuntimeError):
            pass
    for var in LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value), var
    return 1, "no launcher found: 1"


def this_rank():
    for hvd in _horovod_modules():
        try:
            if hvd.is_initialized():
                return int(hvd.rank())
        except (AttributeError, ValueError, RuntimeError):
            pass
    for var in RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


# --- the choice ------------------------------------------------------------------------------
_lock = threading.Lock()
_explicit = {"threads": None}
_state = {"choice": None, "logged": False}
_local = threading.local()


def _positive_int(value, name):
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return n


def decide():
    """The :class:`Choice` for this process now (explicit settings first, then the policy)."""
    cores, cores_why = usable_cores()
    local, local_why = local_ranks()
    if _explicit["threads"] is not None:
        threads, source = _explicit["threads"], "set_threads()"
    elif os.environ.get("HVD_QUANT_THREADS"):
        threads = _positive_int(os.environ["HVD_QUANT_THREADS"], "HVD_QUANT_THREADS")
        source = "HVD_QUANT_THREADS"
    elif _USER_NUMBA_THREADS:
        threads = _positive_int(_USER_NUMBA_THREADS, "NUMBA_NUM_THREADS")
        source = "NUMBA_NUM_THREADS"
    else:
        threads, source = max(1, cores // max(1, local)), "policy"
    return Choice(threads, source, cores, cores_why, local, local_why)


def choice():
    """The choice in effect (made on first use)."""
    if _state["choice"] is None:
        configure()
    return _state["choice"]


def apply_to(cpu):
    """Run ``cpu``'s (:mod:`hvd_quant.kernels.cpu`, just imported) serial or parallel twins
    as the choice in effect says, under the lock :func:`configure` changes it under, so
    that a choice made while the module was importing is not undone by an older one."""
    if _state["choice"] is None:
        configure()
    with _lock:
        cpu.use_serial(_state["choice"].serial)


def describe():
    """One line: the threads per rank and why."""
    return choice().describe()


def configure(log_choice=True):
    """Make (or remake) the choice and apply it: numba's pool size when numba is not yet
    imported, and which kernel flavour runs. Called by :mod:`hvd_quant.kernels` before the
    kernels are first loaded, and again by the adapters once Horovod is initialised (the
    ranks on this host are known for certain then). Logs the choice once per process,
    and again only if it changes."""
    with _lock:
        new = decide()
        if sys.modules.get("numba") is None:  # not imported (or blocked: None)
            # The pool is created with NUMBA_NUM_THREADS threads at numba's import: size it to
            # this rank's share so that no parallel region ever spreads over other ranks' cores.
            os.environ["NUMBA_NUM_THREADS"] = os.environ[_OWN_MARK] = str(new.threads)
        else:
            pool = _numba_pool()
            if new.threads > pool:  # numba was imported (by the user) with a smaller pool
                new = Choice(pool, new.source + f" (capped at numba's pool of {pool})", new.cores,
                             new.cores_why, new.local_size, new.local_size_why)
        old, _state["choice"] = _state["choice"], new
        # The kernels' module may be in sys.modules half imported, by another thread (the
        # ranks of a ThreadWorld preparing at once): it then has no use_serial yet, and
        # hvd_quant.kernels applies the choice itself once the import is done (apply_to).
        use_serial = getattr(sys.modules.get("hvd_quant.kernels.cpu"), "use_serial", None)
        if use_serial is not None:
            use_serial(new.serial)
        _local.__dict__.clear()  # every thread re-applies the count on its next call
        if log_choice and (not _state["logged"] or old != new):
            _state["logged"] = True
            log.log(logging.INFO if this_rank() == 0 else logging.DEBUG, new.describe())
    return new


def set_threads(n):
    """Use ``n`` kernel threads per rank from now on (the explicit option; wins over the
    environment and the policy). ``None`` goes back to the environment and the policy."""
    _explicit["threads"] = None if n is None else _positive_int(n, "threads")
    return configure()


def _numba_pool():
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)


def apply_in_thread():
    """Give the calling thread the chosen count for its parallel regions (numba's count is
    per thread; a new thread starts at the pool size). Cheap after the first call."""
    c = _state["choice"] or choice()
    if getattr(_local, "threads", None) != c.threads:
        if not c.serial:
            import numba

            numba.set_num_threads(min(c.threads, _numba_pool()))
        _local.threads = c.threads


_warned = set()


def warn_oversubscribed(framework, intra_op_threads, advice):
    """One warning per framework and process (rank 0 only, the others would repeat it)
    when ``framework``'s intra-op threads per rank exceed the rank's share of the usable
    cores (with more ranks than cores, one thread each is not warned about). ``advice`` is the call that fixes it, with ``{share}`` for the cores per
    rank."""
    c = choice()
    share = max(1, c.cores // c.local_size)
    # More ranks than cores: one thread each is the least there is, so nothing to advise.
    if framework in _warned or c.local_size <= 1 or intra_op_threads <= share:
        return False
    _warned.add(framework)
    if this_rank() == 0:
        log.warning("hvd_quant: %s uses %d intra-op threads per rank with %d ranks on this host "
                    "and %d usable cores: the ranks oversubscribe the cores and every step slows "
                    "down. Call %s in each rank before training (as Horovod's examples do).",
                    framework, intra_op_threads, c.local_size, c.cores, advice.format(share=share))
    return True


def threads_per_rank():
    """What each rank's framework should use for its own intra-op threads: the usable
    cores divided by the ranks on this host (at least 1), the same share the kernels get.

    ``torch.set_num_threads(hvd_quant.threads_per_rank())`` after ``hvd.init()``, or
    ``tf.config.threading.set_intra_op_parallelism_threads(...)`` before TensorFlow runs
    anything, as Horovod's examples set one thread per rank on a CPU host.
    """
    cores, _ = usable_cores()
    local, _ = local_ranks()
    return max(1, cores // max(1, local))
