import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Horovod in pytest's own process (tests that call hvd.init() here) runs on Gloo, as it did
# before Horovod had MPI: a Horovod built with MPI starts an MPI singleton in a process no
# launcher started, and MPI cannot start again after hvd.shutdown(), so a test that shuts
# Horovod down would abort the next test's hvd.init() (seen: "MPI_Query_thread() was called
# after MPI_FINALIZE"). Launched jobs are unaffected: horovodrun --gloo sets the same, and
# the MPI launches (tests/horovod_launch.py, hvd_quant.cluster's mpi launcher, the
# documented-commands check's needs=mpi blocks) remove both.
os.environ.setdefault("HOROVOD_CONTROLLER", "gloo")
os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "gloo")


@pytest.fixture(scope="module")
def can_run():
    """Skip (or fail under HVD_QUANT_REQUIRE_CLUSTER=1, as CI sets it) where no emulated
    cluster (network namespaces, veth, tc) can be built on this machine."""
    from hvd_quant.cluster import netns

    problems, _ = netns.probe()
    if problems:
        message = "emulated cluster unavailable: " + "; ".join(problems)
        if os.environ.get("HVD_QUANT_REQUIRE_CLUSTER") == "1":
            pytest.fail(message)
        pytest.skip(message)


def pytest_runtest_logreport(report):
    """With ``HVD_QUANT_TIMING=<file>``, every phase of every test as a JSON line (the
    suite's timing table: ``python tests/suite_timing.py <file>``)."""
    path = os.environ.get("HVD_QUANT_TIMING")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": report.nodeid, "when": report.when,
                                "seconds": round(report.duration, 3), "outcome": report.outcome}) + "\n")


# --- the documented-commands check, started early, beside the single-process tests ----------
DOCS_CHECK_TEST = "test_every_documented_command_runs"
DOCS_CHECK_TIMEOUT = 880
LAUNCHING_MARKS = ("multiprocess", "cluster", "slow")  # tests that start processes or jobs
_docs_check = None  # (Popen, output file) of a check started at collection


def _start_docs_check():
    out = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent.parent / "scripts" / "check_docs.py")],
                            stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, out


def _early_docs_check(items):
    return os.environ.get("HVD_QUANT_DOCS_CHECK_EARLY") == "1" and any(
        item.name == DOCS_CHECK_TEST for item in items)


def pytest_collection_modifyitems(session, config, items):
    """With the check started early (``HVD_QUANT_DOCS_CHECK_EARLY=1``: ``scripts/test.sh``
    sets it in both tiers), the single-process tests run first, then the check's test (which
    waits for it), then everything that launches processes: the check overlaps only the
    single-process tests, never the jobs whose collective deadlines and timings a second
    busy core would disturb. The order within each part is pytest's, so a module's
    launched tests stay together and its ``horovodrun`` job runs once."""
    if not _early_docs_check(items):
        return
    launches = [any(item.get_closest_marker(m) for m in LAUNCHING_MARKS) for item in items]
    check = [item for item in items if item.name == DOCS_CHECK_TEST]
    single = [item for item, launched in zip(items, launches) if not launched and item not in check]
    launched = [item for item, launched in zip(items, launches) if launched and item not in check]
    items[:] = single + check + launched


def pytest_collection_finish(session):
    """Start ``scripts/check_docs.py`` at collection when it runs early (above). Its blocks
    are mostly process start-up (one core each), so it runs in the other core's idle time
    while the single-process tests run; its test then only collects the result."""
    global _docs_check
    import horovod_launch
    horovod_launch.MPI_JOBS_SELECTED = (any(item.get_closest_marker("mpi") for item in session.items)
                                        and horovod_launch.mpi_problem() is None)
    if session.config.option.collectonly:
        return
    if _early_docs_check(session.items):
        _docs_check = _start_docs_check()


def pytest_sessionfinish(session):
    if _docs_check is not None and _docs_check[0].poll() is None:  # the session ended first (-x)
        os.killpg(_docs_check[0].pid, signal.SIGTERM)


@pytest.fixture
def documented_commands():
    """``(returncode, output)`` of ``scripts/check_docs.py`` over README.md and docs/: the run
    started at collection (``scripts/test.sh``), else one started now."""
    global _docs_check
    (proc, out), _docs_check = _docs_check or _start_docs_check(), None
    try:
        proc.wait(timeout=DOCS_CHECK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out.seek(0)
    return proc.returncode, out.read()
