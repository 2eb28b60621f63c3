"""A rank that dies or hangs inside hvd_quant's collectives ends the whole job in bounded time.

Each case runs tests/mp/stall_worker.py under horovodrun with 2 ranks and a 10 s
collective deadline (HVD_QUANT_COLLECTIVE_TIMEOUT): rank 1 stops at step 3 while rank 0
waits in a ring hop, an allgather, an optimizer's compressed round, or (Keras) a compiled
train step guarded by ``hvd_quant.tensorflow.callbacks.CollectiveWatchdog``. The
job must exit non-zero by itself, saying why, within :data:`BOUND` seconds of the
failure (the deadline plus horovodrun's reaction), measured from the moment rank 1 stops
(start-up time on a loaded machine varies and is not part of the guarantee).
"""

import re
import time

import pytest

from horovod_launch import HERE, run_horovod

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
DEADLINE = 10
BOUND = DEADLINE + 20  # seconds from the failure to the end of the job
# One case per kind of collective: ring hops, allgather of scales, the 1-bit optimizers'
# compressed rounds and hierarchical alltoall, and a compiled Keras train step.
CASES = [("marsit", "hang"), ("marsit", "die"), ("global_qsgd", "hang"), ("onebit_adam", "hang"),
         ("zero_one_adam", "hang"), ("binsgdm", "hang"), ("keras_ef_sign", "hang")]


@pytest.mark.parametrize("method,mode", CASES, ids=[f"{m}-{d}" for m, d in CASES])
def test_job_ends_within_the_bound(method, mode):
    result = run_horovod(HERE / "mp" / "stall_worker.py", 2, [method, mode], timeout=240,
                         env={"HVD_QUANT_COLLECTIVE_TIMEOUT": str(DEADLINE)}, check=False)
    ended = time.time()
    assert result.returncode != 0, result.stdout[-2000:]
    failed_at = float(re.search(r"at step 3, t=([0-9.]+)", result.stdout).group(1))
    assert ended - failed_at < BOUND, f"the job ended {ended - failed_at:.0f} s after the failure"
    assert "the failure went unnoticed" not in result.stdout
    if mode == "hang":
        assert "did not complete within 10 s; a peer rank is dead or hung" in result.stdout
