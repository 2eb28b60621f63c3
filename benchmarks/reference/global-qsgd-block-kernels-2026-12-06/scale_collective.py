"""The scale collective of global_qsgd alone: Horovod's allreduce of the blocks' maxima (op
max) at the time-to-quality LM's size, 14,395 float32 (a scale per 512 of 7.37M elements),
against one float32 (one scale) and against an allgather of the same maxima, medians of 15
after a barrier. Run on the emulated cluster (timing.sh's second part)."""
import statistics
import time

import horovod.torch as hvd
import torch

hvd.init()
torch.set_num_threads(1)
blocks = torch.rand(14395)
one = torch.rand(1)


def timed(fn, name, repeats=15):
    fn(f"{name}.warm")
    times = []
    for i in range(repeats):
        hvd.allreduce(torch.zeros(1), name=f"barrier.{name}.{i}")
        start = time.perf_counter()
        fn(f"{name}.{i}")
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


rows = [("allreduce max, 1 float", timed(lambda n: hvd.allreduce(one, op=hvd.Max, name=n), "one")),
        ("allreduce max, 14,395 floats", timed(lambda n: hvd.allreduce(blocks, op=hvd.Max, name=n), "max")),
        ("allreduce sum, 14,395 floats", timed(lambda n: hvd.allreduce(blocks, op=hvd.Sum, name=n), "sum")),
        ("allgather, 14,395 floats a rank", timed(lambda n: hvd.allgather(blocks, name=n), "gather"))]
if hvd.rank() == 0:
    for label, ms in rows:
        print(f"{hvd.size()} ranks | {label} | {ms:.1f} ms", flush=True)
