"""Launch a script on local ranks from pytest, with a hard time limit.

Every multi-process test goes through :func:`run_horovod`: under ``horovodrun --gloo`` by
default, or under MPI (``launcher="mpi"``: ``horovodrun --mpi``; ``launcher="mpirun"``:
OpenMPI's ``mpirun`` itself, as HPC users launch). The job runs in its own session; if it
outlives ``timeout`` every process of it is killed (its session, its process group and
every descendant, wherever a launcher moved them) and :class:`JobTimeout` is raised, so a
hanging rank fails the test in bounded time instead of hanging CI. Gloo's own timeout is
shortened too, so a rank stuck in a collective errors out by itself.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
LAUNCHERS = ("gloo", "mpi", "mpirun")
# What pins a job to one controller: an MPI job must not inherit the Gloo settings of its
# caller (a Gloo controller without a rendezvous makes every rank a world of one).
_CONTROLLER_VARS = ("HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
                    "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_RANK", "HOROVOD_SIZE")


class JobTimeout(AssertionError):
    pass


def horovod_env(extra=None, launcher="gloo", np_=None):
    env = dict(os.environ)
    if launcher != "gloo":
        for var in _CONTROLLER_VARS:
            env.pop(var, None)
        if np_ is not None and np_ > (os.cpu_count() or 1):
            # More ranks than CPUs, which OpenMPI cannot tell from -H localhost:N: without
            # this its ranks poll without yielding (hvd_quant.cluster.mpi.mpi_env does the same).
            env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.update({
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": env.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "60"),
        "PYTHONPATH": os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    })
    if launcher != "gloo":
        # mpirun gives ranks a pseudo-terminal: Python buffers by line there, while unbuffered
        # each print is two writes that mpirun tags separately (torn lines).
        del env["PYTHONUNBUFFERED"]
    env.update(extra or {})
    return env


def mpirun_command(np_):
    """OpenMPI's ``mpirun`` for ``np_`` ranks on this machine, with the options
    ``horovodrun --mpi`` passes (no binding: the thread policy sizes each rank; TCP and
    shared memory, never InfiniBand's openib) and ``--allow-run-as-root`` only when running
    as root, where OpenMPI refuses to start without it."""
    cmd = ["mpirun", "-np", str(np_), "-H", f"localhost:{np_}", "--bind-to", "none",
           "--map-by", "slot", "--mca", "pml", "ob1", "--mca", "btl", "^openib"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def launch_command(launcher, np_):
    """The launcher's part of a local job's command line."""
    if launcher == "gloo":
        return [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo"]
    if launcher == "mpi":  # horovodrun adds --allow-run-as-root itself
        return [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--mpi"]
    if launcher == "mpirun":
        return mpirun_command(np_)
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")


def mpi_problem():
    """Why MPI jobs cannot run here, or ``None`` when they can."""
    if not shutil.which("mpirun"):
        return ("no MPI installed (mpirun not found; Debian: apt-get install openmpi-bin "
                "libopenmpi-dev, then scripts/bootstrap.sh builds Horovod with MPI)")
    import horovod.torch as hvd
    if not hvd.mpi_built():
        return "Horovod was built without MPI (scripts/bootstrap.sh rebuilds it now that MPI is installed)"
    return None


def require_mpi():
    """Skip the calling test where MPI jobs cannot run; fail instead under
    ``HVD_QUANT_REQUIRE_MPI=1`` (set by .ci/run, which installs OpenMPI)."""
    import pytest
    why = mpi_problem()
    if why:
        if os.environ.get("HVD_QUANT_REQUIRE_MPI") == "1":
            pytest.fail(f"{why} [HVD_QUANT_REQUIRE_MPI=1]")
        pytest.skip(why)


def run_horovod(script, np_, args=(), timeout=300, env=None, check=True, launcher="gloo"):
    """Run ``python script args`` on ``np_`` local ranks; return ``CompletedProcess``.

    ``launcher``: ``"gloo"`` (``horovodrun --gloo``), ``"mpi"`` (``horovodrun --mpi``) or
    ``"mpirun"``. Raises :class:`JobTimeout` after ``timeout`` seconds (the job is killed),
    and ``AssertionError`` with the job's output tail when ``check`` and it failed.
    """
    cmd = [*launch_command(launcher, np_), str(BIN / "python"), str(script), *map(str, args)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=horovod_env(env, launcher, np_), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc.pid, tree=True)  # the launcher still runs: its descendants are its own
        out, _ = proc.communicate()
        raise JobTimeout(f"{cmd[0]} job exceeded {timeout}s and was killed: {' '.join(cmd)}\n"
                         + _tail(out))
    finally:
        kill_job(proc.pid)  # stragglers of a finished job
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    result.elapsed = time.monotonic() - start
    name = {"gloo": "horovodrun", "mpi": "horovodrun --mpi", "mpirun": "mpirun"}[launcher]
    log_job(f"{name} -np {np_} {Path(script).name}", result.elapsed, args)
    if check and proc.returncode != 0:
        raise AssertionError(f"{Path(cmd[0]).name} job failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                             + _tail(out))
    return result


def kill_job(leader, tree=False):
    """SIGKILL every process of the job started as session leader ``leader``: its session
    and its process group, and with ``tree`` (only while the leader runs: a reaped pid may
    be reused) its descendants, found first (a dead parent's children are re-parented).
    A launcher may give ranks process groups of their own; they stay in the session."""
    victims = {leader, *_descendants(leader)} if tree else set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == leader:  # the session id (kept while any member lives)
            victims.add(int(stat.parent.name))
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(leader, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _wait_gone(victims)


def _wait_gone(pids, limit=10.0):
    """Return once none of ``pids`` runs any more (gone, or a zombie waiting to be reaped),
    or after ``limit`` seconds. SIGKILL is delivered asynchronously: on a loaded machine a
    killed rank still ran for a moment after kill_job returned (seen once in CI, where a
    test then found the "killed" job's processes alive)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in ("Z", "X"):
                alive.append(pid)
        if not alive:
            return
        pids = alive
        time.sleep(0.05)


def _descendants(pid):
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def log_job(label, seconds, args=()):
    """Record one launched job (``HVD_QUANT_TIMING``: a JSON-lines file; see
    tests/suite_timing.py): what ran, for how long, under which test."""
    path = os.environ.get("HVD_QUANT_TIMING")
    if not path:
        return
    row = {"job": label, "args": [str(a)[:40] for a in args if not str(a).startswith(("/", "[["))][:6],
           "seconds": round(seconds, 3), "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _tail(out, lines=60):
    keep = [l for l in (out or "").splitlines()
            if "I0000" not in l and "absl::InitializeLog" not in l and "cpu_feature_guard" not in l]
    return "\n".join(keep[-lines:])


def load_rank_results(directory, np_):
    """``[dict]`` of ``rank{r}.json`` written by each rank of a worker script."""
    out = []
    for r in range(np_):
        path = Path(directory) / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results ({path})"
        out.append(json.loads(path.read_text()))
    return out


def rank_results_fixture(worker, mode, np_=2, timeout=600, env=None):
    """A module-scoped pytest fixture (assign it to the fixture's name in the test module):
    one job of ``worker`` run as ``worker MODE OUTDIR`` on ``np_`` ranks (``env`` added to
    its environment), and its :func:`load_rank_results`. The job runs in the fixture's
    set-up, which pytest-timeout counts against the first test using it."""
    import pytest

    @pytest.fixture(scope="module")
    def job(tmp_path_factory):
        out = tmp_path_factory.mktemp(f"{Path(worker).stem}-{mode}")
        run_horovod(worker, np_, [mode, out], timeout=timeout, env=env)
        return load_rank_results(out, np_)
    return job


# --- the MPI jobs: one per framework and rank count, shared by two test modules -------------
MPI_WORKER = HERE / "mp" / "mpi_worker.py"
#: How each framework's MPI job is launched: both ways users launch under MPI are covered.
MPI_LAUNCHER = {"torch": "mpirun", "tf": "mpi"}
_mpi_jobs = {}


#: Set by tests/conftest.py when collection ends: this session runs the MPI jobs (tests
#: marked ``mpi`` are selected, and MPI can run here).
MPI_JOBS_SELECTED = False


def skip_gloo_twin(framework, np_):
    """Skip a Gloo job whose every check this session's MPI job of the same framework and
    rank count runs (tests/mp/mpi_worker.py: worker.py and the optimizer worker).

    The full tier, where MPI is installed (CI), then runs those checks once, under MPI,
    instead of twice: the MPI jobs cost about what the Gloo jobs they replace cost. Gloo
    still runs every compressor and optimizer in the full tier's other jobs (the awkward
    inputs' sweep, torch at 2 and 3 ranks and TensorFlow at 3, Keras, mixed precision, the
    failure bounds), and the
    quick tier, which never selects the MPI jobs, runs these under Gloo. ``-m "not mpi"``
    runs them under Gloo in any session.
    """
    import pytest
    if MPI_JOBS_SELECTED:
        pytest.skip(f"the MPI job of {framework} at {np_} ranks runs these checks in this session "
                    "(-m 'not mpi' runs them under Gloo)")


#: An MPI job runs two workers, each given up to 600 s in its own Gloo job.
MPI_JOB_TIMEOUT = 1200
#: pytest-timeout for tests whose fixture may run an MPI job (its set-up counts against them).
MPI_TEST_TIMEOUT = MPI_JOB_TIMEOUT + 60


def mpi_job(framework, np_, tmp_path_factory, timeout=MPI_JOB_TIMEOUT):
    """Output directory of the MPI job of ``framework`` at ``np_`` ranks
    (tests/mp/mpi_worker.py: every check of tests/mp/worker.py and of the framework's
    optimizer worker in one job). Run once per session; test_multiprocess.py and
    test_optimizers_mp.py both read it. Skips (or fails, under ``HVD_QUANT_REQUIRE_MPI=1``)
    where MPI jobs cannot run."""
    require_mpi()
    key = (framework, np_)
    if key not in _mpi_jobs:
        out = tmp_path_factory.mktemp(f"mpi-{framework}{np_}")
        try:
            run_horovod(MPI_WORKER, np_, [framework, out], timeout=timeout, launcher=MPI_LAUNCHER[framework])
            _mpi_jobs[key] = out
        except AssertionError as exc:  # the second module gets the same failure, not a rerun
            _mpi_jobs[key] = exc
    if isinstance(_mpi_jobs[key], AssertionError):
        raise _mpi_jobs[key]
    return _mpi_jobs[key]
