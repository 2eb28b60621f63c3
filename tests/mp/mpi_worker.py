"""Runs inside every rank under MPI (``mpirun`` or ``horovodrun --mpi``) for the MPI jobs of
tests/test_multiprocess.py and tests/test_optimizers_mp.py.

``python mpi_worker.py FRAMEWORK OUTDIR``: one job per framework and rank count runs, in
the same processes one after the other, every check of tests/mp/worker.py (every
compressor) and of the framework's optimizer worker (tests/mp/optim_worker.py for torch,
tests/mp/optim_worker_tf.py for TensorFlow), and writes

* ``OUTDIR/launch/rank{r}.json``: what Horovod runs on (controller, CPU operations, the
  MPI launcher's rank), and how process sets behave under MPI (one registered at start,
  one added later);
* ``OUTDIR/worker/rank{r}.json`` and ``OUTDIR/optim/rank{r}.json``: the workers' results,
  which the tests judge exactly as they judge the Gloo jobs'.
"""

import json
import os
import runpy
import sys
from pathlib import Path

FRAMEWORK, OUT = sys.argv[1], Path(sys.argv[2])
HERE = Path(__file__).resolve().parent

if FRAMEWORK == "torch":
    import torch
    import horovod.torch as hvd

    def ones():
        return torch.ones(2)
else:
    import tensorflow as tf
    import horovod.tensorflow as hvd

    def ones():
        return tf.ones(2)

# Registered at start (hvd.init): every rank but the last (a set of the whole world is
# refused by Horovod 0.28.1, under Gloo too: "mismatching numbers of process sets"). The
# workers' own hvd.init() calls then do nothing (Horovod initialises once).
ALL_BUT_LAST = hvd.ProcessSet(list(range(int(os.environ["OMPI_COMM_WORLD_SIZE"]) - 1)))
hvd.init(process_sets=[ALL_BUT_LAST])
RANK, SIZE = hvd.rank(), hvd.size()


def process_sets():
    """A set registered at start reduces over its members only; one added later needs
    HOROVOD_DYNAMIC_PROCESS_SETS=1, under MPI as under Gloo."""
    out = {"registered": ALL_BUT_LAST.size() if ALL_BUT_LAST.included() else None}
    if ALL_BUT_LAST.included():
        out["registered_sum"] = float(hvd.allreduce(ones(), op=hvd.Sum, name="mpi.all_but_last",
                                                    process_set=ALL_BUT_LAST).numpy()[0])
    try:
        hvd.add_process_set([0])
        out["dynamic"] = "added"
    except Exception as exc:  # recorded for the test to judge
        out["dynamic"] = {"error": type(exc).__name__, "message": str(exc)}
    hvd.allreduce(ones(), name="mpi.sets_done")  # no rank leaves while a set reduces
    return out


launch = {"rank": RANK, "size": SIZE, "mpi_enabled": bool(hvd.mpi_enabled()),
          "gloo_enabled": bool(hvd.gloo_enabled()),
          "ompi_rank": os.environ.get("OMPI_COMM_WORLD_RANK"),
          "local": [hvd.local_rank(), hvd.local_size()], "process_sets": process_sets()}
(OUT / "launch").mkdir(parents=True, exist_ok=True)
(OUT / "launch" / f"rank{RANK}.json").write_text(json.dumps(launch))


def run_worker(script, *args):
    sys.argv = [str(HERE / script), *map(str, args)]
    runpy.run_path(str(HERE / script), run_name="__main__")


run_worker("worker.py", FRAMEWORK, OUT / "worker")
if FRAMEWORK == "torch":
    run_worker("optim_worker.py", "torch", OUT / "optim")
else:
    run_worker("optim_worker_tf.py", OUT / "optim")
