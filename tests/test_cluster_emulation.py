"""The emulated cluster (hvd_quant.cluster): clean-up on every exit path, clear refusals,
real rate limits, process sets across hosts, and results identical to loopback.

Tests that build namespaces need root and iproute2; where the machine cannot, they skip
with the reason (``HVD_QUANT_REQUIRE_CLUSTER=1``, set by CI, turns that skip into a
failure). Every job has a hard time limit, and every test a pytest-timeout.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvd_quant.cluster import (ClusterUnavailable, EmulatedCluster, JobFailed, JobTimeout, netns,
                               parse_delay, parse_rate, requirement_problems)
from hvd_quant.cluster.emulated import host_cpu_sets, resolve_interpreter

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

pytestmark = pytest.mark.multiprocess


def leftovers(prefix):
    """Namespaces, /etc/netns directories and state files of ``prefix`` still present."""
    found = [ns for ns in netns.list_namespaces() if ns.startswith(prefix)]
    if netns.ETC_NETNS.is_dir():
        found += [str(d) for d in netns.ETC_NETNS.iterdir() if d.name.startswith(prefix)]
    if netns.state_file(prefix).exists():
        found.append(str(netns.state_file(prefix)))
    return found


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def quiet(msg):
    pass


# --- no root needed ------------------------------------------------------------------------------
@pytest.mark.quick
def test_rates_and_delays_parse():
    assert parse_rate("100mbit") == 1e8
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("10Gbit") == 1e10
    assert parse_rate("125mbps") == 1e9  # tc's bps is bytes per second
    assert parse_rate(None) is None and parse_rate("unlimited") is None
    assert parse_delay("0.5ms") == pytest.approx(5e-4)
    assert parse_delay("200us") == pytest.approx(2e-4)
    assert parse_delay(None) == 0.0
    for bad in ("fast", "-1gbit", "0gbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    with pytest.raises(ValueError):
        parse_delay("soon")
    with pytest.raises(ValueError):
        EmulatedCluster(hosts=0)


@pytest.mark.quick
@pytest.mark.timeout(60)
def test_refuses_clearly_without_ip_and_tc(tmp_path, monkeypatch):
    """A PATH without ip/tc: a ClusterUnavailable naming them, and the CLI exits 3."""
    monkeypatch.setenv("PATH", str(tmp_path))
    problems = requirement_problems()
    assert any("'ip' not found" in p for p in problems) and any("'tc' not found" in p for p in problems)
    with pytest.raises(ClusterUnavailable, match="iproute2"):
        EmulatedCluster(hosts=2, log=quiet).start()
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(ROOT)}
    for args in (["check"], ["run", "--hosts", "2", "--", PY, "-c", "pass"], ["cleanup"]):
        proc = subprocess.run([PY, "-m", "hvd_quant.cluster", *args], env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 3, (args, proc.stdout, proc.stderr)
        assert "'ip' not found" in proc.stderr, proc.stderr


@pytest.mark.quick
def test_refuses_clearly_when_not_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterUnavailable, match="not root"):
        EmulatedCluster(hosts=2, log=quiet).start()


@pytest.mark.quick
def test_hosts_get_their_own_cpus_and_python_means_this_interpreter(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert host_cpu_sets(2) == [[0, 1], [2, 3]]  # equal contiguous shares; CPU 4 left idle
    assert host_cpu_sets(5) == [[0], [1], [2], [3], [4]]
    assert host_cpu_sets(7) == [[0], [1], [2], [3], [4], [0], [1]]  # more hosts than CPUs: shared
    assert host_cpu_sets(3, "shared") is None
    assert host_cpu_sets(2, [[3], [1, 0]]) == [[3], [0, 1]]
    with pytest.raises(ValueError, match="one non-empty CPU list per host"):
        host_cpu_sets(2, [[0]])
    assert resolve_interpreter(["python", "x.py"]) == [sys.executable, "x.py"]
    assert resolve_interpreter(["python3", "-c", "pass"]) == [sys.executable, "-c", "pass"]
    assert resolve_interpreter(["/usr/bin/python3", "x.py"]) == ["/usr/bin/python3", "x.py"]
    assert resolve_interpreter(["bash", "-c", "python"]) == ["bash", "-c", "python"]


@pytest.mark.quick
def test_mpi_launch_stays_on_the_cluster_links_and_keeps_rank_labels(monkeypatch):
    """--launcher mpi, without a cluster: mpirun's command (transports and OpenMPI's own
    channel on eth0 only, the namespace agent with every host's CPUs, --allow-run-as-root
    only as root), its environment (no Gloo settings), its tagged output relabelled per
    rank, and the agent's refusal of a host it does not know (exit 255, as ssh)."""
    from types import SimpleNamespace
    from hvd_quant.cluster import mpi

    hosts = [netns.Host(i, f"h{i}", f"hvdqc-abcdef-h{i}", f"10.9.9.{i + 1}", f"p{i}") for i in range(2)]
    fake = SimpleNamespace(hosts=hosts, slots=2, size=4, host_cpus=[[0], [1]], ranks_outnumber_cpus=lambda: True,
                           rank_env=lambda rank, unbuffered=True: {
                               "HOROVOD_CONTROLLER": "gloo", "HOROVOD_RANK": "0", "RANK": "0", "KEEP": "1",
                               **({"PYTHONUNBUFFERED": "1"} if unbuffered else {})})
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    cmd = mpi.mpirun_command(fake, ["python", "x.py"])
    text = " ".join(cmd)
    assert cmd[:5] == ["mpirun", "-np", "4", "-H", "h0:2,h1:2"] and cmd[-2:] == ["python", "x.py"]
    for option in ("btl self,tcp", "btl_tcp_if_include eth0", "oob_tcp_if_include eth0", "--allow-run-as-root"):
        assert option in text, text
    agent = cmd[cmd.index("plm_rsh_agent") + 1]
    assert agent.endswith("-m hvd_quant.cluster.mpi_agent --host=h0@hvdqc-abcdef-h0@0 --host=h1@hvdqc-abcdef-h1@1")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "--allow-run-as-root" not in mpi.mpirun_command(fake, ["python", "x.py"])
    # Two ranks per one-CPU host: OpenMPI is told to yield while it waits, unless the user said.
    assert mpi.mpi_env(fake, {"EXTRA": "2"}) == {"KEEP": "1", "EXTRA": "2", "OMPI_MCA_mpi_yield_when_idle": "1"}
    monkeypatch.setenv("OMPI_MCA_mpi_yield_when_idle", "0")
    assert mpi.mpi_env(SimpleNamespace(**{**vars(fake), "rank_env": lambda rank, unbuffered=True: dict(os.environ)}))[
        "OMPI_MCA_mpi_yield_when_idle"] == "0"
    mine = len(os.sched_getaffinity(0))
    for hosts_, slots, cpus, expected in [(2, 1, [[0], [1]], False), (2, 2, [[0, 1], [2, 3]], False),
                                          (2, 1, [[0, 1], [0, 1]], True), (1, 3, [[0, 1]], True),
                                          (1, mine + 1, "shared", True), (1, 1, "shared", False)]:
        layout = EmulatedCluster(hosts=hosts_, slots=slots, cpus=cpus)  # no namespaces until started
        assert layout.ranks_outnumber_cpus() is expected, (hosts_, slots, cpus)
    labels = ["r0@h0", "r1@h0", "r2@h1", "r3@h1"]
    assert mpi.retag("[mpirun] [1,2]<stdout>:loss 0.5", labels) == ["[r2@h1] loss 0.5"]
    assert mpi.retag("[mpirun] [1,0]<stdout>:a[1,3]<stderr>:b[1,3]<stdout>:", labels) == ["[r0@h0] a", "[r3@h1] b"]
    assert mpi.retag("[mpirun] Primary job terminated", labels) == ["[mpirun] Primary job terminated"]
    agent_run = subprocess.run([PY, "-m", "hvd_quant.cluster.mpi_agent", "--host=h1@ns@1", "h7", "orted"],
                               capture_output=True, text=True, timeout=60)
    assert agent_run.returncode == 255 and "unknown host in ['h7']" in agent_run.stderr
    refused = subprocess.run([PY, "-m", "hvd_quant.cluster", "run", "--launcher", "mpi", "--no-horovod", "--", "true"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "cannot be combined with --no-horovod" in refused.stderr, refused.stderr


@pytest.mark.quick
@pytest.mark.timeout(120)
def test_cli_runs_python_as_typed_with_each_host_on_its_cpus(can_run):
    """The README's command shape, typed as a user would: a bare ``python`` after ``--``
    runs this interpreter (under sudo PATH would find the system's), every rank is pinned
    to its host's CPU share, and a missing module is reported with the interpreter."""
    script = ("import os, hvd_quant; print('cpus', sorted(os.sched_getaffinity(0)), os.environ['HVDQ_CLUSTER_CPUS'], "
              "'threads', hvd_quant.threads_per_rank())")
    proc = subprocess.run([PY, "-m", "hvd_quant.cluster", "run", "--hosts", "2", "--slots", "2", "--rate", "1gbit",
                           "--", "python", "-c", script], capture_output=True, text=True, timeout=110,
                          env={**os.environ, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})  # sudo's: no venv
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"python -> {sys.executable}" in proc.stderr
    shares = host_cpu_sets(2)
    for rank in range(4):
        cpus = shares[rank // 2]
        line = next(l for l in proc.stdout.splitlines() if l.startswith(f"[r{rank}@"))
        assert f"cpus {cpus} {','.join(map(str, cpus))} threads {max(1, len(cpus) // 2)}" in line, proc.stdout
    missing = subprocess.run([PY, "-m", "hvd_quant.cluster", "run", "--hosts", "2", "--", PY, "-c",
                              "import hvd_quant_no_such_module"], capture_output=True, text=True, timeout=110)
    assert missing.returncode != 0
    assert f"the ranks ran {PY}, which has no module 'hvd_quant_no_such_module'" in missing.stderr, missing.stderr


# --- clean-up on every exit path ------------------------------------------------------------------
@pytest.mark.quick
@pytest.mark.timeout(60)
def test_success_leaves_nothing_and_each_rank_sees_its_host(can_run):
    script = ("import os, socket; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], "
              "'on', socket.gethostbyname(socket.gethostname()), 'h1 is', socket.gethostbyname('h1'))")
    with EmulatedCluster(hosts=2, slots=2, rate="1gbit", log=quiet) as c:
        prefix = c.prefix
        assert leftovers(prefix)  # it exists while open
        result = c.run_torch([PY, "-c", script], timeout=30, check=True)
        addresses = [h.address for h in c.hosts]
    assert leftovers(prefix) == []
    lines = result.stdout.splitlines()
    assert len(lines) == 4
    for rank in range(4):
        host = rank // 2
        expected = f"[r{rank}@h{host}] rank {rank} of 4 on {addresses[host]} h1 is {addresses[1]}"
        assert expected in lines, result.stdout


@pytest.mark.timeout(60)
def test_failing_rank_ends_the_job_promptly(can_run):
    script = ("import os, sys, time\n"
              "if os.environ['RANK'] == '1':\n"
              "    sys.exit('rank 1: deliberate failure')\n"
              "time.sleep(60)\n")
    with EmulatedCluster(hosts=2, log=quiet) as c:
        prefix = c.prefix
        start = time.monotonic()
        result = c.run_torch([PY, "-c", script], timeout=50)
        took = time.monotonic() - start
        with pytest.raises(JobFailed, match="rank 1 failed"):
            c.run_torch([PY, "-c", script], timeout=50, check=True)
    assert took < 15, f"the job took {took:.1f}s after rank 1 failed"
    assert result.returncode == 1 and result.failed_rank == 1
    assert "[r1@h1] rank 1: deliberate failure" in result.stdout
    assert result.rank_returncodes[0] != 0  # rank 0 was stopped, not left sleeping
    assert leftovers(prefix) == []


TORN_LINES = 1000
TORCHRUN_SCRIPT = ("import os, socket, torch, torch.distributed as dist\n"
                   "dist.init_process_group('gloo')\n"
                   "t = torch.tensor([float(dist.get_rank())]); dist.all_reduce(t)\n"
                   "print('rank', dist.get_rank(), 'of', dist.get_world_size(), 'local', os.environ['LOCAL_RANK'], "
                   "'on', socket.gethostbyname(socket.gethostname()), 'sum', int(t.item()), "
                   "'master', os.environ['MASTER_ADDR'], flush=True)\n"
                   "dist.destroy_process_group()\n"
                   # Many lines of many pieces: unbuffered, torchrun's tee split some of them
                   # among a host's ranks (about 8 of these 4,000 lines in a run).
                   f"for i in range({TORN_LINES}):\n"
                   "    print('line', os.environ['RANK'], i, *range(40), 'end', flush=True)\n")


@pytest.mark.timeout(180)
def test_torchrun_starts_each_hosts_ranks_and_a_failure_ends_the_job(can_run):
    """``--launcher torchrun`` (issue 55): one torchrun agent per host starts that host's
    ranks, numbered host by host; they meet at host 0's address, over the shaped links,
    and allreduce. A rank that fails ends the job on every host promptly."""
    proc = subprocess.run([PY, "-m", "hvd_quant.cluster", "run", "--launcher", "torchrun", "--hosts", "2",
                           "--slots", "2", "--timeout", "100", "--", PY, "-c", TORCHRUN_SCRIPT],
                          capture_output=True, text=True, timeout=130)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # "[h<host>] [default<local rank>]:rank <r> of 4 ...": the host's prefix, then torchrun's
    lines = {int(l.split("]:rank ")[1].split()[0]): l for l in proc.stdout.splitlines() if " sum " in l}
    assert sorted(lines) == [0, 1, 2, 3], proc.stdout
    master = lines[0].split(" on ")[1].split()[0]
    for rank, line in lines.items():
        assert line.startswith(f"[h{rank // 2}] [default{rank % 2}]:rank {rank} of 4 local {rank % 2} on "), line
        assert line.endswith(f"sum 6 master {master}"), line
    assert lines[2].split(" on ")[1].split()[0] != master  # host 1's ranks live at another address
    # Every line whole, under its own rank's prefixes: the ranks' output is buffered and
    # flushed line by line, not written piece by piece (PYTHONUNBUFFERED) for tee to split.
    whole = re.compile(r"\[h(\d)\] \[default(\d)\]:line (\d) \d+ " + " ".join(map(str, range(40))) + " end")
    printed = [l for l in proc.stdout.splitlines() if ":line " in l or l.endswith(" end")]
    assert len(printed) == 4 * TORN_LINES, [l for l in printed if not whole.fullmatch(l)][:5]
    for line in printed:
        match = whole.fullmatch(line)
        assert match and [int(g) for g in match.groups()] == [
            int(match[3]) // 2, int(match[3]) % 2, int(match[3])], line
    failing = ("import os, sys, time\n"
               "if os.environ['RANK'] == '3':\n"
               "    sys.exit('rank 3: deliberate failure')\n"
               "time.sleep(90)\n")
    with EmulatedCluster(hosts=2, slots=2, log=quiet) as c:
        prefix = c.prefix
        with pytest.raises(ValueError, match="horovod=False"):
            c.run([PY, "-c", "pass"], launcher="torchrun")
        start = time.monotonic()
        with pytest.raises(JobFailed, match="host 1's torchrun failed"):
            c.run_torch([PY, "-c", failing], timeout=80, check=True, launcher="torchrun")
        took = time.monotonic() - start
    assert took < 40, f"the job took {took:.1f}s after rank 3 failed"
    assert leftovers(prefix) == []


@pytest.mark.timeout(60)
def test_timeout_kills_every_rank(can_run):
    script = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"
    with EmulatedCluster(hosts=2, log=quiet) as c:
        prefix = c.prefix
        start = time.monotonic()
        with pytest.raises(JobTimeout) as info:
            c.run_torch([PY, "-c", script], timeout=3)
        took = time.monotonic() - start
    assert took < 15
    result = info.value.result
    assert result.timed_out and result.returncode == 124
    pids = [int(line.split()[-1]) for line in result.stdout.splitlines() if " pid " in line]
    assert len(pids) == 2 and not any(alive(p) for p in pids)
    assert leftovers(prefix) == []


@pytest.mark.timeout(30)
def test_exception_in_the_with_block_cleans_up(can_run):
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(hosts=2, log=quiet) as c:
            prefix = c.prefix
            raise RuntimeError("boom")
    assert leftovers(prefix) == []


HOLDER = """
import signal, sys, time
# Ctrl-C must raise KeyboardInterrupt here even when pytest itself was started in the
# background of a non-interactive shell, whose children inherit SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {root!r})
from hvd_quant.cluster import EmulatedCluster
with EmulatedCluster(hosts=2, log=lambda m: None) as c:
    print("prefix", c.prefix, flush=True)
    c.run_torch([sys.executable, "-c", "import os, time; print('pid', os.getpid(), flush=True); time.sleep(120)"],
                timeout=100, stream=sys.stdout)
"""


def start_holder():
    """A process that opens a cluster and runs a sleeping job; returns (proc, prefix, rank pids)."""
    proc = subprocess.Popen([PY, "-c", HOLDER.format(root=str(ROOT))], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    prefix, pids = None, []
    deadline = time.monotonic() + 30
    while (prefix is None or len(pids) < 2) and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("prefix "):
            prefix = line.split()[1]
        elif " pid " in line:
            pids.append(int(line.split()[-1]))
    assert prefix and len(pids) == 2, "the holder did not start its job"
    return proc, prefix, pids


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_cleans_up(can_run, sig):
    proc, prefix, pids = start_holder()
    try:
        proc.send_signal(sig)
        proc.wait(timeout=30)
        assert leftovers(prefix) == []
        assert not any(alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        netns.remove_cluster(prefix)


@pytest.mark.timeout(90)
def test_cleanup_command_removes_what_a_killed_run_left(can_run):
    proc, prefix, pids = start_holder()
    try:
        proc.send_signal(signal.SIGKILL)  # no chance to clean up
        proc.wait(timeout=30)
        assert leftovers(prefix)
        cli = subprocess.run([PY, "-m", "hvd_quant.cluster", "cleanup", "--prefix", prefix],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert cli.returncode == 0, cli.stderr
        assert "removed" in cli.stdout
        assert leftovers(prefix) == []
        time.sleep(0.2)
        assert not any(alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        netns.remove_cluster(prefix)


@pytest.mark.timeout(30)
def test_delay_needs_netem_and_says_so(can_run):
    """Kernels without sch_netem (this project's VMs) refuse a delay clearly and leave
    nothing behind; where netem exists, a delayed cluster starts."""
    _, notes = netns.probe()
    cluster = EmulatedCluster(hosts=2, rate="1gbit", delay="1ms", log=quiet)
    if netns.NETEM_MISSING in notes:
        with pytest.raises(ClusterUnavailable, match="netem"):
            cluster.start()
    else:
        with cluster:
            assert "one-way delay 1 ms" in cluster.describe_link()
    assert leftovers(cluster.prefix) == []


# --- the link model -------------------------------------------------------------------------------
SHAPING = """
import os, socket, sys, time
rank, senders, nbytes = int(os.environ["RANK"]), int(sys.argv[1]), int(sys.argv[2])
receiver = int(os.environ["WORLD_SIZE"]) - 1
if rank == receiver:
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 5001)); srv.listen(8)
    conns = [srv.accept()[0] for _ in range(senders)]
    total, first = 0, None
    for conn in conns:
        conn.setblocking(False)
    import selectors
    sel = selectors.DefaultSelector()
    for conn in conns:
        sel.register(conn, selectors.EVENT_READ)
    while sel.get_map():
        for key, _ in sel.select(timeout=20):
            data = key.fileobj.recv(1 << 20)
            if first is None:
                first = time.perf_counter()
            if data:
                total += len(data)
            else:
                sel.unregister(key.fileobj)
    print(f"received {total} bytes in {time.perf_counter() - first:.4f} s", flush=True)
elif rank < senders:
    for _ in range(200):
        try:
            s = socket.create_connection((f"h{receiver}", 5001), timeout=5)
            break
        except OSError:
            time.sleep(0.05)
    s.sendall(b"x" * nbytes)
    s.close()
"""


@pytest.mark.timeout(90)
def test_shaping_limits_both_directions_of_each_link(can_run):
    """One sender alone is held to its upload rate; three senders into one host together
    are held to that host's download rate (an unshaped download would take a third)."""
    rate, total = 100e6, 6_000_000
    ideal = total * 8 / rate  # 0.48 s
    with EmulatedCluster(hosts=4, rate="100mbit", log=quiet) as c:
        for senders in (1, 3):
            result = c.run_torch([PY, "-c", SHAPING, str(senders), str(total // senders)], timeout=40,
                                 check=True)
            line = [l for l in result.stdout.splitlines() if "received" in l][0]
            got, seconds = int(line.split()[2]), float(line.split()[5])
            assert got == total
            assert 0.7 * ideal <= seconds < 10 * ideal, \
                f"{senders} sender(s): {total} bytes in {seconds:.3f}s at 100 Mbit/s (ideal {ideal:.3f}s)"


# --- Horovod across hosts -------------------------------------------------------------------------
PROCESS_SETS = """
import horovod.torch as hvd, torch
even = hvd.ProcessSet([0, 2])
hvd.init(process_sets=[even])
x = torch.full((4,), float(hvd.rank() + 1))
total = hvd.allreduce(x, op=hvd.Sum, name="all")
if hvd.rank() in (0, 2):
    print("even", hvd.allreduce(x, op=hvd.Sum, name="even", process_set=even).tolist(), flush=True)
print("all", total.tolist(), "local", hvd.local_rank(), hvd.local_size(), "cross", hvd.cross_rank(), flush=True)
# A rank that exits shuts Horovod down for all: rank 1 must not leave while 0 and 2
# are still in the process-set allreduce (seen in CI as a race).
hvd.allreduce(torch.zeros(1), name="done")
"""


@pytest.mark.timeout(150)
def test_horovod_process_sets_across_hosts(can_run):
    """Process-set Gloo contexts resolve the machine's hostname (Horovod 0.28.1); the
    per-namespace hosts file makes them connect across the emulated hosts."""
    with EmulatedCluster(hosts=3, rate="1gbit", log=quiet) as c:
        result = c.run_horovod([PY, "-c", PROCESS_SETS], timeout=120, check=True,
                               env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "60"})
    for rank in range(3):
        assert f"[r{rank}@h{rank}] all [6.0, 6.0, 6.0, 6.0] local 0 1 cross {rank}" in result.stdout, result.stdout
    for rank in (0, 2):
        assert f"[r{rank}@h{rank}] even [4.0, 4.0, 4.0, 4.0]" in result.stdout, result.stdout


IDENTITY = """
import hashlib, json, sys
import torch
import horovod.torch as hvd
import hvd_quant.torch as hq

hvd.init()
torch.set_num_threads(1)
rank, numel, out = hvd.rank(), int(sys.argv[2]), {}
for config in ["none", "ef_sign", "marsit", "global_qsgd", "global_qsgd:norm=l2", "global_qsgd_exp",
               "onebit"]:
    name, _, opts = config.partition(":")
    options = dict(kv.split("=") for kv in opts.split(",") if kv)
    w = torch.nn.Parameter(torch.zeros(numel))
    opt = hq.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), named_parameters=[("w", w)],
                                  compression=hq.Compression.get(name, **options))
    digests = []
    for step in range(2):
        w.grad = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank))
        opt.synchronize()
        digests.append(hashlib.sha256(w.grad.numpy().tobytes()).hexdigest())
    out[config] = digests
x = torch.randn(numel, generator=torch.Generator().manual_seed(99 + rank))
out["horovod_fp32"] = hashlib.sha256(hvd.allreduce(x, op=hvd.Sum, name="fp32").numpy().tobytes()).hexdigest()
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(out, f)
"""


IDENTITY_NUMEL = 750_000


@pytest.fixture(scope="module")
def identity_loopback(tmp_path_factory):
    """The IDENTITY job under horovodrun --gloo on loopback: ``(script, rank results)``."""
    from horovod_launch import load_rank_results, run_horovod

    tmp_path = tmp_path_factory.mktemp("identity")
    script = tmp_path / "identity.py"
    script.write_text(IDENTITY)
    (tmp_path / "loopback").mkdir()
    run_horovod(script, 2, [tmp_path / "loopback", IDENTITY_NUMEL], timeout=150,
                env={"PYTHONPATH": str(ROOT)})
    loopback = load_rank_results(tmp_path / "loopback", 2)
    assert loopback[0] == loopback[1]  # every rank holds the same reduced values
    assert set(loopback[0]) == {"none", "ef_sign", "marsit", "global_qsgd", "global_qsgd:norm=l2",
                                "global_qsgd_exp", "onebit", "horovod_fp32"}
    return script, loopback


@pytest.mark.timeout(360)  # two jobs of up to 150 s each, plus the cluster's set-up
def test_compressed_reduction_identical_to_loopback(can_run, identity_loopback, tmp_path):
    """CI cluster test: 2 hosts at 1 Gbit/s, 750k floats (3 MB): every compressor's reduced
    gradients over two steps are bit-identical to the same job under horovodrun on
    loopback (and on both ranks)."""
    from horovod_launch import load_rank_results

    script, loopback = identity_loopback
    with EmulatedCluster(hosts=2, rate="1gbit", log=quiet) as c:
        c.run_horovod([PY, script, tmp_path, IDENTITY_NUMEL], timeout=150, check=True,
                      env={"PYTHONPATH": str(ROOT), "HOROVOD_GLOO_TIMEOUT_SECONDS": "60"})
    assert load_rank_results(tmp_path, 2) == loopback


def sent_bytes(cluster, host):
    """Bytes host ``host``'s shaped link (its eth0's tbf) has sent."""
    out = cluster.exec(host, ["tc", "-s", "-j", "qdisc", "show", "dev", netns.HOST_DEV],
                       capture_output=True, text=True, check=True).stdout
    return sum(q.get("bytes", 0) for q in json.loads(out))


@pytest.mark.mpi
@pytest.mark.timeout(360)
def test_mpirun_across_hosts_uses_the_shaped_links(can_run, identity_loopback, tmp_path):
    """``launcher="mpi"``: OpenMPI's mpirun starts the ranks on the emulated hosts (its
    daemon through the namespace agent) and Horovod runs on MPI; the same results as Gloo
    on loopback, bit for bit, and the data went over the hosts' shaped links: each host's
    eth0 sent at least the 3 MB of the fp32 allreduce (on loopback it would send nothing)."""
    from horovod_launch import load_rank_results, require_mpi

    require_mpi()
    script, loopback = identity_loopback
    with EmulatedCluster(hosts=2, rate="1gbit", log=quiet) as c:
        before = [sent_bytes(c, h) for h in range(2)]
        c.run_horovod([PY, script, tmp_path, IDENTITY_NUMEL], launcher="mpi", timeout=150, check=True,
                      env={"PYTHONPATH": str(ROOT)})
        sent = [sent_bytes(c, h) - b for h, b in zip(range(2), before)]
    assert load_rank_results(tmp_path, 2) == loopback
    assert all(s >= 4 * IDENTITY_NUMEL for s in sent), sent


MARSIT_HOSTS = """
import hashlib, json, sys
import torch
import horovod.torch as hvd
import hvd_quant.torch as hq

three = hvd.ProcessSet([0, 1, 2])  # 2 ranks of host 0, 1 of host 1: no even layout
hvd.init(process_sets=[three])
torch.set_num_threads(1)
out = {"ranks_per_node": hq.HorovodTorchComm().ranks_per_node()}
for label, options in [("default", {}), ("torus", {"topology": "torus", "torus_rows": 2}),
                       ("ring", {"topology": "ring"})]:
    w = torch.nn.Parameter(torch.zeros(10_000))
    opt = hq.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), named_parameters=[("w", w)],
                                  compression=hq.Compression.marsit(seed=3, **options))
    w.grad = torch.randn(10_000, generator=torch.Generator().manual_seed(hvd.rank()))
    opt.synchronize()
    out[label] = hashlib.sha256(w.grad.numpy().tobytes()).hexdigest()
w = torch.nn.Parameter(torch.zeros(10_000))
out["binsgdm_global"] = hq.BinSGDM([w], lr=0.1)._rule.ranks_per_node
if three.included():  # the automatic layout is the set's (flat), not the world's 2 per host
    opt = hq.BinSGDM([w], lr=0.1, named_parameters=[("w", w)], process_set=three)
    w.grad = torch.randn(10_000, generator=torch.Generator().manual_seed(hvd.rank()))
    opt.step()
    out["binsgdm_set"] = [opt._rule.ranks_per_node,
                          hashlib.sha256(w.detach().numpy().tobytes()).hexdigest()]
hvd.allreduce(torch.zeros(1), name="done")  # rank 3 must not leave while the set works
with open(f"{sys.argv[1]}/rank{hvd.rank()}.json", "w") as f:
    json.dump(out, f)
"""


@pytest.mark.timeout(180)
def test_marsit_follows_the_hosts(can_run, tmp_path):
    """2 hosts x 2 ranks: Horovod's local and cross sizes give 2 ranks per host, and
    Marsit's default topology is the torus of the hosts (the same bits as
    ``topology="torus", torus_rows=2``, not the ring's), identical on every rank. BinSGDM's
    automatic hierarchy follows the hosts too, but only on the global process set."""
    from horovod_launch import load_rank_results

    script = tmp_path / "marsit_hosts.py"
    script.write_text(MARSIT_HOSTS)
    with EmulatedCluster(hosts=2, slots=2, rate="1gbit", log=quiet) as c:
        c.run_horovod([PY, script, tmp_path], timeout=150, check=True,
                      env={"PYTHONPATH": str(ROOT), "HOROVOD_GLOO_TIMEOUT_SECONDS": "60"})
    ranks = load_rank_results(tmp_path, 4)
    assert "binsgdm_set" not in ranks[3]
    ranks[3]["binsgdm_set"] = ranks[0].get("binsgdm_set")
    assert all(r == ranks[0] for r in ranks), ranks
    assert ranks[0]["ranks_per_node"] == 2
    assert ranks[0]["default"] == ranks[0]["torus"] != ranks[0]["ring"]
    # BinSGDM's automatic layout: the hosts on the global set; flat on a set of 3 ranks
    # that spans the hosts unevenly (it once took the world's 2 and refused: 3 % 2 != 0).
    assert ranks[0]["binsgdm_global"] == 2
    assert ranks[0]["binsgdm_set"][0] is None
