"""Cluster tests: hvd_quant's image, 3 containers, compressed Horovod jobs across them.

Needs podman (with runc, as on this project's machines) or Docker; skipped with the reason
where neither is usable, and failed instead when HVD_QUANT_REQUIRE_CLUSTER=1 (CI sets it).
The image is built by docker/build.sh under a tag of this session and removed at the end.
What stays, by design, so that a warm run builds in seconds: the dependency stage, tagged
localhost/hvd-quant-deps:latest (build.sh replaces it when the dependencies change), the
engine's build cache mounts and, with podman, build.sh's debootstrap base image
localhost/hvd-quant-base:bookworm. Every container, network and volume a test starts is
removed on every exit path, and the tests check that none is left.
"""

import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

from horovod_launch import HERE, load_rank_results, run_horovod

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]
ROOT = HERE.parent
DOCKER = ROOT / "docker"
JOB = "tests/containers/train_job.py"
COMPRESSIONS = ["marsit", "global_qsgd"]  # and onebit_adam where hvd_quant has 1-bit Adam
EPOCHS = 4
SESSION = f"hvdqt{os.getpid()}"
IMAGE = f"localhost/hvd-quant:test-{os.getpid()}"  # removed at the end
DEPS_IMAGE = "localhost/hvd-quant-deps:latest"     # kept: the dependency layers, for warm runs
BUILD_TIMEOUT = 1500   # cold, with a Horovod compile in the image; warm builds take seconds
JOB_TIMEOUT = 600      # one cluster job, start to finish (~1-2 min on an idle 2-core machine)
KILL_BOUND = 60        # a job must end this soon after one of its containers is killed


def sh(cmd, timeout, env=None):
    """Run ``cmd``; kill its whole process group at ``timeout`` (then fail with the output)."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} exceeded {timeout}s:\n{tail(out)}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def tail(out, lines=60):
    noise = ("I0000", "absl::InitializeLog", "cudart_stub", "port.cc", "failed to connect to syslog")
    return "\n".join([l for l in (out or "").splitlines() if not any(n in l for n in noise)][-lines:])


def engine_env(engine, **extra):
    env = dict(os.environ, CONTAINER_ENGINE=engine, IMAGE=IMAGE, **extra)
    if engine == "podman" and "CONTAINERS_CONF" not in os.environ and shutil.which("runc"):
        env["CONTAINERS_CONF"] = str(DOCKER / "containers.conf")  # as docker/engine.sh does
    return env


def find_engine():
    """(engine, None) for the first usable engine, else (None, why not)."""
    why = []
    wanted = os.environ.get("CONTAINER_ENGINE")
    for name in [wanted] if wanted else ["podman", "docker"]:
        if not shutil.which(name):
            why.append(f"{name} is not installed")
            continue
        try:
            info = subprocess.run([name, "info"], capture_output=True, text=True, timeout=60,
                                  env=engine_env(name))
        except subprocess.TimeoutExpired:
            why.append(f"'{name} info' did not answer in 60 s")
            continue
        if info.returncode != 0:
            why.append(f"'{name} info' failed: {tail(info.stderr, 2)}")
            continue
        if name == "podman" and not os.environ.get("BASE") and not (
                shutil.which("debootstrap") and os.geteuid() == 0):
            has_base = subprocess.run(["podman", "image", "exists", "localhost/hvd-quant-base:bookworm"],
                                      env=engine_env(name), timeout=60).returncode == 0
            if not has_base:
                why.append("podman has no base image and cannot make one (needs root and debootstrap, or BASE)")
                continue
        return name, None
    return None, "; ".join(why)


@pytest.fixture(scope="module")
def engine():
    name, why = find_engine()
    if name is None:
        message = f"no usable container engine ({why}); apt-get install podman runc debootstrap"
        if os.environ.get("HVD_QUANT_REQUIRE_CLUSTER") == "1":
            pytest.fail(message + " [HVD_QUANT_REQUIRE_CLUSTER=1]")
        pytest.skip(message)
    return name


@pytest.fixture(scope="module")
def image(engine, pytestconfig):
    start = time.monotonic()
    try:
        result = sh([DOCKER / "build.sh"], BUILD_TIMEOUT, engine_env(engine, DEPS_IMAGE=DEPS_IMAGE))
        assert result.returncode == 0, f"docker/build.sh failed:\n{tail(result.stdout)}"
        report(pytestconfig, f"{engine}: built {IMAGE} in {time.monotonic() - start:.0f} s")
        yield IMAGE
    finally:
        subprocess.run([engine, "rmi", "-f", IMAGE], capture_output=True, timeout=300,
                       env=engine_env(engine))


def report(pytestconfig, line):
    """A line on the terminal even under -q (timings for the record)."""
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"[cluster] {line}")


def leftovers(engine, cluster):
    """What of ``cluster`` still exists: containers, network, volume."""
    env = engine_env(engine)
    left = subprocess.run([engine, "ps", "-aq", "--filter", f"label=hvdq.cluster={cluster}"],
                          capture_output=True, text=True, env=env, timeout=60).stdout.split()
    for kind, name in (("network", f"{cluster}-net"), ("volume", f"{cluster}-keys")):
        if subprocess.run([engine, kind, "inspect", name], capture_output=True, env=env,
                          timeout=60).returncode == 0:
            left.append(f"{kind} {name}")
    return left


def cluster_sh(engine, cluster, *args, timeout, **env):
    return sh([DOCKER / "cluster.sh", *args], timeout, engine_env(engine, CLUSTER=cluster, **env))


def down(engine, cluster):
    cluster_sh(engine, cluster, "down", timeout=180)


def methods():
    import hvd_quant.torch as hq
    return COMPRESSIONS + (["onebit_adam"] if hasattr(hq, "OnebitAdam") else [])


def test_compressed_job_across_containers_matches_local_ranks(engine, image, tmp_path, pytestconfig):
    cluster, cdir = f"{SESSION}a", tmp_path / "cluster"
    names = methods()
    args = ["python", JOB, "--compression", ",".join(names), "--epochs", EPOCHS]
    start = time.monotonic()
    try:
        run = cluster_sh(engine, cluster, "job", *args, "--out", "/cluster/results",
                         timeout=JOB_TIMEOUT + 60, CLUSTER_DIR=str(cdir), JOB_TIMEOUT=str(JOB_TIMEOUT))
        assert run.returncode == 0, f"cluster job failed:\n{tail(run.stdout)}"
        assert leftovers(engine, cluster) == []
    finally:
        down(engine, cluster)
    report(pytestconfig, f"3-container job ({', '.join(names)}) in {time.monotonic() - start:.0f} s")
    ranks = load_rank_results(cdir / "results", 3)
    assert [r["container"] for r in ranks] == ["w1", "w2", "w3"]  # one rank per container

    run_horovod(ROOT / JOB, 3, [*args[2:], "--out", tmp_path / "local"], timeout=JOB_TIMEOUT)
    local = load_rank_results(tmp_path / "local", 3)
    for name in names:
        digests = {r["runs"][name]["weights_sha256"] for r in ranks}
        assert len(digests) == 1, f"{name}: containers ended with different weights"
        losses = ranks[0]["runs"][name]["losses"]
        assert losses[-1] < 0.5 * losses[0], f"{name}: loss did not fall: {losses}"
        for r, l in zip(ranks, local):
            # Seeded per rank: the same inputs give the same bits over any network.
            assert r["runs"][name] == l["runs"][name], f"{name}, rank {r['rank']}: cluster != local"


def test_killed_container_ends_job_with_clear_error_and_leaves_nothing(engine, image, tmp_path):
    cluster = f"{SESSION}k"
    cmd = [DOCKER / "cluster.sh", "job", "python", JOB, "--compression", "global_qsgd",
           "--epochs", "100000", "--out", "/cluster/results"]
    env = engine_env(engine, CLUSTER=cluster, CLUSTER_DIR=str(tmp_path / "cluster"),
                     JOB_TIMEOUT=str(JOB_TIMEOUT), LINK_RATE="200mbit")  # and the shaper works
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    lines, training = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "[train_job] global_qsgd epoch 2 " in line:
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert training.wait(timeout=JOB_TIMEOUT), f"job never trained:\n{tail(''.join(lines))}"
        qdisc = sh([engine, "exec", f"{cluster}-w1", "tc", "qdisc", "show", "dev", "eth0"], 60, env)
        assert "tbf" in qdisc.stdout and "200Mbit" in qdisc.stdout, qdisc.stdout
        killed = time.monotonic()
        sh([engine, "kill", f"{cluster}-w2"], 60, env)
        try:
            proc.wait(timeout=KILL_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"job still running {KILL_BOUND}s after w2 was killed:\n{tail(''.join(lines))}")
        ended = time.monotonic() - killed
        reader.join(timeout=10)
        out = "".join(lines)
        assert proc.returncode != 0
        assert "exited with non-zero status" in out, tail(out)
        assert "job failed" in out and "unreachable workers: w2" in out, tail(out)
        assert ended < KILL_BOUND
        # cluster.sh job removed everything on its way out.
        assert leftovers(engine, cluster) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        down(engine, cluster)


def test_compose_file_runs_a_job(engine, image, tmp_path):
    """docker/compose.yaml under podman-compose (or docker compose): workers found by DNS,
    the job launched with LAUNCHER=mpi (OpenMPI's mpirun, its daemons over the workers'
    ssh; Horovod on MPI). The other two tests launch with horovodrun --gloo."""
    if engine == "docker":
        compose = ["docker", "compose"]
        if subprocess.run(compose + ["version"], capture_output=True, timeout=60).returncode != 0:
            pytest.skip("docker has no compose plugin")
    elif shutil.which("podman-compose"):
        compose = ["podman-compose"]
    else:
        pytest.skip("podman-compose is not installed (apt-get install podman-compose)")
    project = f"{SESSION}c"
    base = compose + ["-p", project, "-f", DOCKER / "compose.yaml"]
    env = engine_env(engine, EPOCHS="1", JOB_TIMEOUT=str(JOB_TIMEOUT), LAUNCHER="mpi")
    try:
        run = sh(base + ["run", "--rm", "launcher"], JOB_TIMEOUT + 60, env)
        out = run.stdout
        assert run.returncode == 0, tail(out)
        assert "final test accuracy" in out and "mpirun -np 3 -H " in out, tail(out)
    finally:
        sh(base + ["down", "-v"], 180, env)
        # podman-compose 1.0.3 leaves the network behind.
        subprocess.run([engine, "network", "rm", f"{project}_hvd"], capture_output=True,
                       env=env, timeout=60)
    left = subprocess.run([engine, "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
                          capture_output=True, text=True, env=env, timeout=60).stdout.split()
    assert left == []
