"""Launch a script under ``horovodrun --gloo`` from pytest, with a hard time limit.

Every multi-process test goes through :func:`run_horovod`. The job runs in its own process
group; if it outlives ``timeout`` the whole group is killed and :class:`JobTimeout` is
raised, so a hanging rank fails the test in bounded time instead of hanging CI. Gloo's own
timeout is shortened too, so a rank stuck in a collective errors out by itself.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


class JobTimeout(AssertionError):
    pass


def horovod_env(extra=None):
    env = dict(os.environ)
    env.update({
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": env.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "60"),
        "PYTHONPATH": os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


def run_horovod(script, np_, args=(), timeout=300, env=None, check=True):
    """Run ``python script args`` on ``np_`` local ranks; return ``CompletedProcess``.

    Raises :class:`JobTimeout` after ``timeout`` seconds (the job is killed), and
    ``AssertionError`` with the job's output tail when ``check`` and it failed.
    """
    cmd = [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
           str(BIN / "python"), str(script), *map(str, args)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=horovod_env(env), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise JobTimeout(f"horovodrun job exceeded {timeout}s and was killed: {' '.join(cmd)}\n"
                         + _tail(out))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a finished job
        except ProcessLookupError:
            pass
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    result.elapsed = time.monotonic() - start
    log_job(f"horovodrun -np {np_} {Path(script).name}", result.elapsed, args)
    if check and proc.returncode != 0:
        raise AssertionError(f"horovodrun job failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                             + _tail(out))
    return result


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
