"""A rank that dies or hangs inside hvd_quant's collectives ends the whole job in bounded time.

Each case runs tests/mp/stall_worker.py under horovodrun with 2 or 3 ranks and a 6 s
collective deadline (HVD_QUANT_COLLECTIVE_TIMEOUT; 10 s for Keras, whose ranks trace
``fit`` at different speeds): rank 1 stops at step 3 while the
other ranks wait in the step's first collective (the scale allgather of the ring and of
Global-QSGD, an optimizer's compressed round, or, for Keras, a compiled train step
guarded by ``hvd_quant.tensorflow.callbacks.CollectiveWatchdog``), or, with 3 ranks,
rank 1 stops part-way through step 3 so that the others wait inside a ring hop or inside
the 1-bit allreduce's alltoall. The job must exit non-zero by itself, saying why (and,
for the hangs inside a step, naming that collective), within the deadline plus
:data:`REACTION` seconds (horovodrun's reaction) of the failure, measured from the moment rank 1
stops (start-up time on a loaded machine varies and is not part of the guarantee). The
ring's hang and a dead rank are run under ``mpirun`` too: there mpirun, not horovodrun,
ends the job when the watchdog ends a rank (exit code 124) or a rank dies.
"""

import re
import time

import pytest

from horovod_launch import HERE, require_mpi, run_horovod

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
DEADLINE = 6
KERAS_DEADLINE = 10
REACTION = 20  # seconds past the deadline for the job to end
# One case per kind of collective at 2 ranks: the step's first collective of the ring
# (scale allgather), Global-QSGD (max allreduce), each 1-bit optimizer's round (the
# 1-bit allreduce's alltoall: 0/1 Adam's; BinSGDM's flat allgather), a compiled Keras
# train step, and a dead rank. At 3 ranks (the peers of the hung rank then wait on different
# neighbours) the hangs part-way through a step: inside a ring hop and inside the 1-bit
# allreduce's alltoall; the watchdog's message names the collective.
CASES = [("marsit", "hang", 2), ("marsit", "die", 2), ("global_qsgd", "hang", 2),
         ("zero_one_adam", "hang", 2), ("binsgdm", "hang", 2),
         ("keras_ef_sign", "hang", 2),
         ("marsit", "hang_in_hop", 3), ("onebit_adam", "hang_in_alltoall", 3)]
MPI_CASES = [("marsit", "hang", 2), ("marsit", "die", 2)]
WAITED_IN = {"hang_in_hop": r"ring hop '[^']*\.rs0'",
             "hang_in_alltoall": r"alltoall 'hvd_quant\.opt\.g0\.momentum\.worker_signs'"}


@pytest.mark.parametrize("method,mode,ranks,launcher",
                         [(*c, "gloo") for c in CASES] + [pytest.param(*c, "mpirun", marks=pytest.mark.mpi)
                                                          for c in MPI_CASES],
                         ids=[f"{m}-{d}-{n}" for m, d, n in CASES] + [f"{m}-{d}-{n}-mpi" for m, d, n in MPI_CASES])
def test_job_ends_within_the_bound(method, mode, ranks, launcher):
    if launcher != "gloo":
        require_mpi()
    deadline = KERAS_DEADLINE if method.startswith("keras") else DEADLINE
    result = run_horovod(HERE / "mp" / "stall_worker.py", ranks, [method, mode], timeout=240,
                         env={"HVD_QUANT_COLLECTIVE_TIMEOUT": str(deadline)}, check=False,
                         launcher=launcher)
    ended = time.time()
    assert result.returncode != 0, result.stdout[-2000:]
    failed_at = float(re.search(r"at step 3, t=([0-9.]+)", result.stdout).group(1))
    assert ended - failed_at < deadline + REACTION, f"the job ended {ended - failed_at:.0f} s after the failure"
    assert "the failure went unnoticed" not in result.stdout
    if mode.startswith("hang"):
        assert f"did not complete within {deadline} s; a peer rank is dead or hung" in result.stdout
    if mode in WAITED_IN:  # the peers waited in that collective, past the ones before it
        assert re.search(WAITED_IN[mode] + rf" did not complete within {deadline} s", result.stdout), \
            result.stdout[-2000:]
