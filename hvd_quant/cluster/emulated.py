"""``EmulatedCluster``: N hosts on one machine, each a network namespace behind a shaped link.

    with EmulatedCluster(hosts=2, slots=1, rate="1gbit", delay="0.5ms") as cluster:
        result = cluster.run_horovod([sys.executable, "train.py"], timeout=600)
        print(result.stdout)

What is shaped (the link model)
-------------------------------
Every host has one full-duplex NIC of ``rate`` bit/s, plugged into an ideal switch:

* host -> switch: a token bucket (tc-tbf(8)) on the host's ``eth0`` egress;
* switch -> host: a token bucket on the switch port's egress (the host's download);
* ``delay``: a netem delay (tc-netem(8)) on the host's ``eth0`` egress only, so one
  delay is the one-way latency between any two hosts and a round trip takes twice it.
  Kernels built without ``sch_netem`` (this project's VMs: ``CONFIG_NET_SCH_NETEM`` is
  off, tbf is in) refuse a non-zero delay with :class:`ClusterUnavailable`;
  ``python -m hvd_quant.cluster check`` says which.

The bridge itself is unshaped. So a host can send ``rate`` and receive ``rate`` at the
same time, and ``k`` hosts sending to one host share that host's download, as on a real
switch. Ranks on the same host (``slots > 1``) talk over that namespace's loopback,
unshaped, as ranks on one machine would. Rates count link-layer bytes (Ethernet header
included), so with the default 1500-byte MTU TCP payload peaks near 95% of ``rate``.

Cores
-----
Each host gets its own CPUs, as a real host has: by default (``cpus="split"``) the CPUs
this process may use are dealt out to the hosts in equal contiguous shares (host ``i`` of
``H`` on a machine with ``C >= H`` CPUs gets ``C // H`` of them; with more hosts than CPUs,
host ``i`` gets CPU ``i mod C`` and shares it), and every rank of a host is pinned to its
host's set (its affinity mask). Software that sizes itself by the cores it may use
(hvd_quant's kernel threads, torch's and OpenMP's defaults) then sees a host's share, not
the whole machine: without it, two emulated hosts on a 2-core machine each took both
cores and oversubscribed them. ``cpus="shared"`` leaves every rank on every CPU.

Where hosts must share CPUs (more hosts than CPUs), a rank that busy-waits for a
collective takes the CPU from the other hosts' ranks, which a host of its own would not:
the ranks then get ``HVD_QUANT_WAIT=sleep`` (unless it is set already), so that
hvd_quant's collectives wait by sleeping (:func:`hvd_quant.torch.comm.wait_mode`).
Horovod's own ``hvd.synchronize`` (its stock ``DistributedOptimizer``) still spins.

Launching
---------
``run_horovod(..., launcher="mpi")`` hands the job to OpenMPI's ``mpirun`` instead, which
starts the ranks on the hosts through an agent that enters their namespaces
(:mod:`hvd_quant.cluster.mpi`). By default (Gloo),
``run_horovod`` starts Horovod's Gloo rendezvous server in the switch namespace and one
process per slot with the environment ``horovodrun --gloo`` would give it
(``HOROVOD_RANK``, ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` ...; ``horovod/runner/gloo_run.py``),
plus ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``GLOO_SOCKET_IFNAME`` so that ``torch.distributed.init_process_group("gloo")`` works in
the same processes. ``run_torch`` starts the same processes without Horovod's rendezvous.
Ranks fill hosts in order: rank ``r`` runs on host ``r // slots``.

Safety and clean-up
-------------------
Nothing is created in the machine's own network namespace; the cluster's subnet is a
random private ``10.x.y.0/24`` checked against every route and address in use, and the
hosts have no route out of it, so jobs can only reach the cluster's own addresses.
Everything is removed when the ``with`` block ends, on an exception, on SIGINT/SIGTERM
(turned into :class:`ClusterInterrupted` while the cluster is open) and at interpreter
exit; after a SIGKILL, ``python -m hvd_quant.cluster cleanup`` removes the leftovers.
"""

import atexit
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from . import netns
from .launch import JobFailed, run_ranks
from .mpi import run_mpi
from .netns import ClusterError, ClusterUnavailable, format_rate, parse_delay, parse_rate

#: Port of torch.distributed's TCPStore on host 0 (a fresh namespace: nothing else there).
TORCH_MASTER_PORT = 29500


class ClusterInterrupted(BaseException):
    """SIGTERM/SIGHUP arrived while a cluster was open (raised so clean-up runs)."""


def who_failed(failed_rank, launcher):
    """Who a failed job's ``failed_rank`` names: a rank, or under ``launcher="torchrun"``
    (one agent per host) a host's torchrun; ``"a rank"`` when it is not known."""
    if failed_rank is None:
        return "a rank"
    return f"host {failed_rank}'s torchrun" if launcher == "torchrun" else f"rank {failed_rank}"


class EmulatedCluster:
    """``hosts`` network namespaces on one switch, links shaped to ``rate`` and ``delay``.

    Parameters
    ----------
    hosts : int
        Number of emulated hosts (>= 1).
    slots : int
        Ranks per host (>= 1).
    cpus : ``"split"``, ``"shared"`` or a list of CPU lists
        Each host's CPUs (see "Cores" above): ``"split"`` (default) deals this process's
        CPUs out to the hosts, ``"shared"`` gives every host every CPU, or one list of CPU
        numbers per host.
    rate : str, float or None
        Each host's link rate: ``"100mbit"``, ``"1gbit"``, ``"10gbit"``, bits per second,
        or ``None``/``"unlimited"`` for unshaped veth links.
    delay : str, float or None
        One-way host-to-host latency: ``"0.5ms"``, ``"200us"``, seconds, or ``None``.
    mtu : int
        MTU of the emulated links (1500 as on common Ethernet; 9000 for jumbo frames).
    log : callable or None
        Called with progress strings (set-up, shaping, clean-up); default: stderr.

    Raises
    ------
    ClusterUnavailable
        When entering, if the machine cannot run it (message says why).
    """

    def __init__(self, hosts=2, slots=1, rate=None, delay=None, mtu=1500, log=None, cpus="split"):
        if not isinstance(hosts, int) or isinstance(hosts, bool) or hosts < 1:
            raise ValueError(f"hosts must be an int >= 1, got {hosts!r}")
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        if not isinstance(mtu, int) or not 576 <= mtu <= 65535:
            raise ValueError(f"mtu must be an int in [576, 65535], got {mtu!r}")
        self.num_hosts, self.slots, self.mtu = hosts, slots, mtu
        self.host_cpus = host_cpu_sets(hosts, cpus)
        self.rate_bps, self.delay_s = parse_rate(rate), parse_delay(delay)
        self._log = log if log is not None else (lambda msg: print(f"[cluster] {msg}", file=sys.stderr, flush=True))
        self.prefix = None
        self.hosts = []
        self.switch_netns = None
        self.bridge_address = None
        self.subnet = None
        self._open = False
        self._closing = False
        self._lock = threading.Lock()
        self._old_handlers = {}

    # --- life cycle ---------------------------------------------------------------------
    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def start(self):
        """Create namespaces, links, addresses, hosts files and shaping. Idempotent."""
        if self._open:
            return self
        netns.check_requirements()
        self.prefix = netns.new_prefix()
        self._open = True
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            ours = [ns for ns in netns.list_namespaces() if ns.startswith(netns.NAME_PREFIX)]
            self.subnet = netns.pick_subnet(netns.networks_in_use(ours))
            netns.record_owner(self.prefix, {"hosts": self.num_hosts, "subnet": str(self.subnet)})
            self.switch_netns, self.bridge_address, self.hosts = netns.create_topology(
                self.prefix, self.num_hosts, self.subnet, self.mtu)
            hostname = socket.gethostname()
            for host in self.hosts:
                netns.write_hosts_file(host, self.hosts, hostname)
            self.set_link(self.rate_bps, self.delay_s)
        except BaseException:
            self.close()
            raise
        self._log(f"{self.num_hosts} hosts x {self.slots} slots on {self.subnet} "
                  f"({self.prefix}*): {self.describe_link()}; {self.describe_cpus()}")
        return self

    def close(self):
        """Kill everything running in the cluster and remove it. Safe to call twice."""
        with self._lock:
            if not self._open:
                return
            self._open = False
            self._closing = True  # a second SIGTERM must not interrupt the clean-up
        try:
            removed = netns.remove_cluster(self.prefix)
            leftovers = [ns for ns in netns.list_namespaces() if ns.startswith(self.prefix)]
            if leftovers:
                self._log(f"warning: could not remove {leftovers}; run "
                          f"'python -m hvd_quant.cluster cleanup --force --prefix {self.prefix}'")
            elif removed:
                self._log(f"removed {len(removed)} namespaces ({self.prefix}*)")
        finally:
            self._restore_signal_handlers()
            self._closing = False
            try:
                atexit.unregister(self.close)
            except Exception:
                pass

    @property
    def is_open(self):
        return self._open

    def _install_signal_handlers(self):
        # SIGINT already raises KeyboardInterrupt; SIGTERM/SIGHUP would kill the process
        # without unwinding, leaving namespaces behind. Only the main thread may do this.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self):
        for sig, handler in self._old_handlers.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError, TypeError):
                pass
        self._old_handlers = {}

    def _on_signal(self, signum, frame):
        if self._closing:
            self._log(f"{signal.Signals(signum).name} during clean-up: finishing the clean-up first")
            return
        raise ClusterInterrupted(f"received {signal.Signals(signum).name}; cleaning up the cluster")

    # --- links --------------------------------------------------------------------------
    def set_link(self, rate=None, delay=None):
        """(Re)shape every host's link: ``rate`` both ways, ``delay`` one way (see module
        docstring). Can be called between jobs to sweep rates on the same cluster."""
        self._require_open()
        self.rate_bps, self.delay_s = parse_rate(rate), parse_delay(delay)
        for host in self.hosts:
            netns.shape_link(host.netns, netns.HOST_DEV, self.rate_bps, self.delay_s)  # upload (+delay)
            netns.shape_link(self.switch_netns, host.port, self.rate_bps, 0.0)         # download

    def describe_link(self):
        delay = f", one-way delay {self.delay_s * 1e3:g} ms" if self.delay_s else ""
        return (f"each host one full-duplex {format_rate(self.rate_bps)} link "
                f"(tbf on both ends of its veth){delay}, MTU {self.mtu}")

    def describe_cpus(self):
        if self.host_cpus is None:
            return "every host on every CPU"
        return "CPUs per host: " + ", ".join(f"h{i} {_cpu_list(c)}" for i, c in enumerate(self.host_cpus))

    # --- jobs ---------------------------------------------------------------------------
    @property
    def size(self):
        return self.num_hosts * self.slots

    def rank_host(self, rank):
        return self.hosts[rank // self.slots]

    def cpus_shared_by_hosts(self):
        """True when some CPU serves more than one host: more hosts than CPUs (split), or
        more ranks than CPUs with every host on every CPU (shared)."""
        if self.host_cpus is None:
            return self.num_hosts > 1 and self.size > len(os.sched_getaffinity(0))
        cpus = [c for host in self.host_cpus for c in host]
        return len(cpus) != len(set(cpus))

    def ranks_outnumber_cpus(self):
        """True when some CPU runs more than one rank: hosts share CPUs, or a host has more
        slots than CPUs (every host on every CPU: more ranks than CPUs). OpenMPI must then
        be told to yield while it waits (:func:`hvd_quant.cluster.mpi.mpi_env`)."""
        if self.host_cpus is None:
            return self.size > len(os.sched_getaffinity(0))
        return self.cpus_shared_by_hosts() or any(self.slots > len(host) for host in self.host_cpus)

    def rank_env(self, rank, horovod_rendezvous_port=None, extra=None, unbuffered=True):
        """The environment of ``rank``: this process's, plus torch.distributed's and (when a
        rendezvous port is given) Horovod's Gloo variables, plus ``extra``.

        ``unbuffered``: ``PYTHONUNBUFFERED=1``, for ranks whose own pipe is read line by line
        (:func:`run_ranks`), so their lines arrive as they are printed. ``False`` drops it,
        unless ``extra`` sets it, for launchers that relay a rank's output through a tagger
        (mpirun, torchrun's ``--tee``): unbuffered, Python writes a ``print`` piece by
        piece, and a tagger can tear the line between pieces."""
        host = self.rank_host(rank)
        env = dict(os.environ)
        env.pop("PYTHONUNBUFFERED", None)
        if unbuffered:
            env["PYTHONUNBUFFERED"] = "1"
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(self.size),
            "LOCAL_RANK": str(rank % self.slots), "LOCAL_WORLD_SIZE": str(self.slots),
            "GROUP_RANK": str(host.index), "MASTER_ADDR": self.hosts[0].address,
            "MASTER_PORT": str(TORCH_MASTER_PORT), "GLOO_SOCKET_IFNAME": netns.HOST_DEV,
            "HVDQ_CLUSTER_PREFIX": self.prefix, "HVDQ_CLUSTER_HOSTS": str(self.num_hosts),
            "HVDQ_CLUSTER_SLOTS": str(self.slots),
            "HVDQ_CLUSTER_RATE_BPS": str(self.rate_bps or 0),
            "HVDQ_CLUSTER_RATE": format_rate(self.rate_bps),
            "HVDQ_CLUSTER_DELAY_S": repr(self.delay_s),
            "HVDQ_CLUSTER_CPUS": "" if self.host_cpus is None else _cpu_list(self.host_cpus[host.index]),
        })
        if self.cpus_shared_by_hosts() and "HVD_QUANT_WAIT" not in os.environ:
            # A rank that busy-waits takes the CPU of the other hosts pinned to it, which a
            # host of its own would not: hvd_quant's collectives wait by sleeping here.
            env["HVD_QUANT_WAIT"] = "sleep"
        if horovod_rendezvous_port is not None:
            env.update({
                "HOROVOD_GLOO_RENDEZVOUS_ADDR": self.bridge_address,
                "HOROVOD_GLOO_RENDEZVOUS_PORT": str(horovod_rendezvous_port),
                "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_GLOO_IFACE": netns.HOST_DEV,
                "HOROVOD_HOSTNAME": host.name,
                "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(self.size),
                "HOROVOD_LOCAL_RANK": str(rank % self.slots), "HOROVOD_LOCAL_SIZE": str(self.slots),
                "HOROVOD_CROSS_RANK": str(host.index), "HOROVOD_CROSS_SIZE": str(self.num_hosts),
            })
        env.update(extra or {})
        return env

    def run(self, command, horovod=True, timeout=600, env=None, check=False, stream=None,
            launcher="gloo"):
        """Run ``command`` (an argument list) once per rank, inside the ranks' hosts.

        Parameters
        ----------
        command : list of str
            E.g. ``[sys.executable, "script.py", "--flag"]``; the same on every rank.
        horovod : bool
            Start Horovod's Gloo rendezvous and set Horovod's variables (``run_horovod``);
            without it only torch.distributed's variables are set (``run_torch``).
        launcher : ``"gloo"``, ``"mpi"`` or ``"torchrun"``
            ``"gloo"`` (default): this launcher starts every rank, Horovod on Gloo.
            ``"mpi"``: OpenMPI's ``mpirun`` starts them (:mod:`hvd_quant.cluster.mpi`),
            Horovod on MPI; needs OpenMPI and a Horovod built with MPI, and ``horovod``.
            ``"torchrun"``: one ``torchrun`` agent per host starts that host's ranks, as on
            a real cluster (:meth:`_torchrun_commands`); a torch.distributed job, so
            ``horovod=False``. Output and ``failed_rank`` are then per host (labels
            ``h<i>``), the ranks' lines prefixed by torchrun (``[default<local rank>]:``).
        timeout : float
            Hard limit in seconds: past it every rank is killed and
            :class:`~hvd_quant.cluster.launch.JobTimeout` is raised.
        env : dict or None
            Extra environment for every rank.
        check : bool
            Raise :class:`~hvd_quant.cluster.launch.JobFailed` if a rank fails.
        stream : file-like or None
            Echo each rank's prefixed output lines there as they arrive.

        Returns
        -------
        JobResult
            A ``subprocess.CompletedProcess`` with the prefixed output of all ranks.
        """
        self._require_open()
        command = resolve_interpreter([str(c) for c in command])
        if launcher not in ("gloo", "mpi", "torchrun"):
            raise ValueError(f"launcher must be 'gloo', 'mpi' or 'torchrun', got {launcher!r}")
        if launcher == "torchrun" and horovod:
            raise ValueError("launcher='torchrun' starts a torch.distributed job: it needs horovod=False "
                             "(run_torch)")
        if launcher == "mpi":
            if not horovod:
                raise ValueError("launcher='mpi' starts a Horovod job: it needs horovod=True")
            result = run_mpi(self, command, timeout, env=env, stream=stream)
            if check and result.returncode != 0:
                raise JobFailed(f"mpirun job failed (exit {result.returncode}, rank {result.failed_rank}): "
                                f"{' '.join(command)}\n" + result.tail(), result)
            return result
        rendezvous = None
        try:
            port = None
            if horovod:
                rendezvous, port = self._start_rendezvous()
            if launcher == "torchrun":
                commands, envs, labels = self._torchrun_commands(command, env)
            else:
                commands = [self._pinned(r) + ["ip", "netns", "exec", self.rank_host(r).netns, *command]
                            for r in range(self.size)]
                envs = [self.rank_env(r, port, env) for r in range(self.size)]
                labels = [f"r{r}@{self.rank_host(r).name}" for r in range(self.size)]
            result = run_ranks(commands, envs, labels, timeout, stream=stream)
        finally:
            if rendezvous is not None:
                self._stop_rendezvous(rendezvous)
        if check and result.returncode != 0:
            raise JobFailed(f"{who_failed(result.failed_rank, launcher)} failed (exit {result.returncode}): "
                            f"{' '.join(command)}\n" + result.tail(), result)
        return result

    #: What torchrun sets for the ranks it starts: a host's agent must not pass ours on.
    _TORCHRUN_SETS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT")

    def _torchrun_commands(self, command, extra):
        """One ``torchrun`` agent per host (``python -m torch.distributed.run``), in the
        host's namespace and pinned to its CPUs, each starting ``slots`` ranks of
        ``command`` (``--no-python``: the command names its interpreter). The agents meet
        by torchrun's static rendezvous at host 0's address, so the job's traffic between
        hosts goes over the shaped links as with the other launchers; ``--max-restarts 0``:
        a failed rank fails the job, which stops every host (:func:`run_ranks`).

        The ranks' output is buffered, as under torchrun on real hosts: ``--tee`` tails each
        rank's log file and prefixes what it reads, so an unbuffered rank, which Python
        makes write a ``print`` piece by piece, can have its line split among its host's
        ranks. ``PYTHONUNBUFFERED`` is dropped unless ``extra`` sets it (:meth:`rank_env`);
        a rank flushes (``print(..., flush=True)``) what should show at once. The agent
        itself runs unbuffered (``-u``, not inherited), so the lines it passes on arrive as
        they come."""
        commands, envs, labels = [], [], []
        for host in self.hosts:
            first_rank = host.index * self.slots
            agent = [sys.executable, "-u", "-m", "torch.distributed.run", "--nnodes", str(self.num_hosts),
                     "--nproc-per-node", str(self.slots), "--node-rank", str(host.index),
                     "--master-addr", self.hosts[0].address, "--master-port", str(TORCH_MASTER_PORT),
                     "--max-restarts", "0", "--tee", "3", "--no-python", *command]
            commands.append(self._pinned(first_rank) + ["ip", "netns", "exec", host.netns, *agent])
            env = self.rank_env(first_rank, None, extra, unbuffered=False)
            for name in self._TORCHRUN_SETS:
                env.pop(name, None)
            envs.append(env)
            labels.append(host.name)
        return commands, envs, labels

    def _pinned(self, rank):
        """The prefix that pins ``rank`` to its host's CPUs (inherited across exec)."""
        if self.host_cpus is None:
            return []
        return [sys.executable, "-c", _PIN, _cpu_list(self.host_cpus[self.rank_host(rank).index])]

    def run_horovod(self, command, **kwargs):
        """:meth:`run` of one Horovod job, one rank per slot: on Gloo with this launcher's
        rendezvous, or under ``mpirun`` with ``launcher="mpi"``."""
        return self.run(command, horovod=True, **kwargs)

    def run_torch(self, command, **kwargs):
        """:meth:`run` without Horovod: a plain torch.distributed (Gloo, ``env://``) job,
        its ranks started by this launcher, or by a ``torchrun`` per host with
        ``launcher="torchrun"``."""
        return self.run(command, horovod=False, **kwargs)

    def exec(self, host, command, timeout=60, **kwargs):
        """Run one command in host ``host``'s namespace (``subprocess.run``, bounded)."""
        self._require_open()
        return subprocess.run(["ip", "netns", "exec", self.hosts[host].netns, *map(str, command)],
                              timeout=timeout, **kwargs)

    def _start_rendezvous(self):
        hosts_spec = ",".join(f"{h.name}:{self.slots}" for h in self.hosts)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.switch_netns, sys.executable, "-m",
             "hvd_quant.cluster.rendezvous", hosts_spec],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, env={**os.environ, "PYTHONPATH": _package_root_path()})
        port = None
        deadline = time.monotonic() + 60
        try:
            while port is None:
                # The server prints one line; wait for it with a bound (select), so a server
                # that neither prints nor exits cannot hang the launcher.
                ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
                line = proc.stdout.readline() if ready else ""
                if line.startswith("port "):
                    port = int(line.split()[1])
                elif not line:
                    proc.kill()
                    raise ClusterError("Horovod's rendezvous server did not start within 60 s:\n"
                                       + proc.stderr.read())
        except BaseException:
            self._stop_rendezvous(proc)
            raise
        return proc, port

    def _stop_rendezvous(self, proc):
        try:
            proc.stdin.close()  # the server exits at EOF
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=5)
        for pipe in (proc.stdout, proc.stderr):
            try:
                pipe.close()
            except OSError:
                pass

    def _require_open(self):
        if not self._open:
            raise ClusterError("the cluster is not running: use 'with EmulatedCluster(...) as c:' "
                               "or call start() first")


def host_cpu_sets(hosts, cpus="split"):
    """One sorted list of CPU numbers per host, or ``None`` for "every host on every CPU"
    (see "Cores" in the module docstring)."""
    if cpus == "shared":
        return None
    if cpus == "split":
        mine = sorted(os.sched_getaffinity(0))
        if len(mine) >= hosts:
            share = len(mine) // hosts
            return [mine[i * share:(i + 1) * share] for i in range(hosts)]
        return [[mine[i % len(mine)]] for i in range(hosts)]
    sets = [sorted(int(c) for c in host) for host in cpus]
    if len(sets) != hosts or not all(sets):
        raise ValueError(f"cpus must be 'split', 'shared' or one non-empty CPU list per host "
                         f"({hosts}), got {cpus!r}")
    return sets


# Set the affinity, then become the command: what ``taskset -c LIST CMD`` does, without
# needing util-linux.
_PIN = ("import os, sys; os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(',')]); "
        "os.execvp(sys.argv[2], sys.argv[2:])")


def _cpu_list(cpus):
    return ",".join(str(c) for c in cpus)


#: Command names that mean "the Python that runs this launcher" after ``--``.
PYTHON_NAMES = ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}")


def resolve_interpreter(command):
    """``command`` with a bare ``python``/``python3`` first word replaced by the interpreter
    running this process: the rule users of ``horovodrun`` rely on with a virtual
    environment active, kept under ``sudo``, which resets ``PATH`` to the system's."""
    if not command:
        raise ValueError("empty command")
    if command[0] in PYTHON_NAMES and sys.executable:
        return [sys.executable, *command[1:]]
    return command


def _package_root_path():
    """PYTHONPATH that makes ``hvd_quant`` importable for the helper processes."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)


__all__ = ["ClusterError", "ClusterInterrupted", "ClusterUnavailable", "EmulatedCluster"]
