import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


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
