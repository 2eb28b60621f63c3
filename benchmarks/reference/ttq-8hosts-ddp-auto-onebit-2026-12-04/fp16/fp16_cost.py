"""Where fp16's extra compute goes at 8 ranks (issue 51): on this machine, per rank, time
(a) the two casts of the time-to-quality LM's 7,370,240 gradient elements (fp32 -> fp16 -> fp32)
and (b) Horovod's allreduce of that many elements in fp32 and in fp16, on loopback.
Run: horovodrun -np N -H localhost:N --gloo python fp16_cost.py"""
import statistics
import time

import horovod.torch as hvd
import torch

N = 7_370_240
REPEATS = 7
hvd.init()
torch.manual_seed(hvd.rank())
grad = torch.randn(N)


def timed(fn):
    out = []
    for _ in range(REPEATS):
        hvd.allreduce(torch.zeros(1), name="barrier")  # start together
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out[1:])  # the first pays for allocation and negotiation


casts = timed(lambda: grad.half().float())
fp32 = timed(lambda: hvd.allreduce(grad, name="g32", op=hvd.Sum))
half = grad.half()
fp16 = timed(lambda: hvd.allreduce(half, name="g16", op=hvd.Sum))
rows = hvd.allgather_object((casts, fp32, fp16))
if hvd.rank() == 0:
    slowest = [max(r[i] for r in rows) for i in range(3)]
    print(f"{hvd.size()} ranks, {N:,} elements, median of {REPEATS - 1}, slowest rank: "
          f"casts {1e3 * slowest[0]:.1f} ms, fp32 allreduce {1e3 * slowest[1]:.1f} ms, "
          f"fp16 allreduce {1e3 * slowest[2]:.1f} ms", flush=True)
