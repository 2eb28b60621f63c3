"""The Triton kernels under Triton's interpreter, in a process of their own.

``tests/gpu_interpreter.py`` holds the tests (every GPU primitive on CPU tensors against
the numba kernels and the numpy oracle, bit for bit; the generic call sites through the
interpreted kernels; the dispatch, the layout cache, the PTX check). It runs in its own
process with Triton on its path (``tests/triton_env.py`` says why Triton stays off the
suite's path: TensorFlow and Triton cannot share a process in that order), and this test
fails with its report when any of them fails. To run them directly:

    PYTHONPATH=.venv/triton:. .venv/bin/python -m pytest tests/gpu_interpreter.py
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from triton_env import ROOT, triton_env

CASES = Path(__file__).resolve().parent / "gpu_interpreter.py"


@pytest.mark.full
@pytest.mark.timeout(1800)
def test_the_gpu_kernels_under_the_interpreter():
    env = triton_env()
    if env is None:
        pytest.skip("Triton is not installed (scripts/test.sh installs it: scripts/bootstrap.sh --with-triton)")
    run = subprocess.run([sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider", "-rfEs"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    report = run.stdout[-8000:] + run.stderr[-3000:]
    assert run.returncode == 0, report
    last = run.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", last) and "failed" not in last and "error" not in last, report
    print(last)
