"""Why is the 1-bit optimizers' fp32 round slower over Gloo than over Horovod? Time, on
the emulated cluster, one dist.all_reduce of 29.5 MB (as DistComm does it), the same in
25 MB + rest pieces (as DDP's buckets), and Horovod's allreduce of 29.5 MB."""
import os, sys, time, datetime
import torch, torch.distributed as dist
import horovod.torch as hvd
sys.path.insert(0, "benchmarks")
hvd.init()
from cluster_worker import init_torch_distributed
init_torch_distributed(hvd.rank(), hvd.size(), 300)
torch.set_num_threads(1)
n = 7_370_240
x = torch.randn(n)

def t(fn, reps=3):
    best = []
    for _ in range(reps):
        dist.barrier(); s = time.perf_counter(); fn(); best.append(time.perf_counter() - s)
    return min(best), sum(best) / reps

def whole(): dist.all_reduce(x.clone())
def pieces(k):
    def f():
        for c in torch.split(x.clone(), k): dist.all_reduce(c)
    return f
def horovod(): hvd.allreduce(x, op=hvd.Sum, name="probe")
res = {"gloo whole 29.5 MB": t(whole), "gloo 25 MB pieces": t(pieces(25 * 2**20 // 4)),
       "gloo 4 MB pieces": t(pieces(2**20)), "horovod 29.5 MB": t(horovod)}
if hvd.rank() == 0:
    for k, (b, m) in res.items():
        print(f"PROBE {k}: best {b*1e3:.0f} ms, mean {m*1e3:.0f} ms", flush=True)
dist.destroy_process_group()
