"""2 ranks (issue 54, the probe's exchange): time Horovod's collectives on a 117 MB fp32 buffer (the Keras model's), the
ways a probe could get each rank its half of the sum."""
import statistics, time, sys
import torch
import horovod.torch as hvd
hvd.init()
d = 29_334_272
x = torch.randn(d)
half = x[: d // 2].clone()
def timed(label, fn, reps=5):
    ts = []
    for i in range(reps):
        hvd.allreduce(torch.zeros(1), name=f"bar.{label}.{i}")
        t = time.perf_counter(); fn(f"{label}.{i}"); ts.append(time.perf_counter() - t)
    ts = hvd.allgather(torch.tensor([ts])).max(0).values.tolist()
    if hvd.rank() == 0:
        print(f"{label:14s} median {1e3*statistics.median(ts):7.0f} ms  all " + " ".join(f"{1e3*v:.0f}" for v in ts), flush=True)
timed("allreduce", lambda n: hvd.allreduce(x, op=hvd.Sum, name=n))
timed("alltoall", lambda n: hvd.alltoall(x, name=n))
timed("allgather-half", lambda n: hvd.allgather(half, name=n))
timed("reducescatter", lambda n: hvd.reducescatter(x, op=hvd.Sum, name=n))
timed("alltoall", lambda n: hvd.alltoall(x, name=n + "b"))
timed("allgather-half", lambda n: hvd.allgather(half, name=n + "b"))
