"""Gloo p2p exchange of 14.7 MB both ways: send-first vs recv-first posting."""
import sys, time
import torch, torch.distributed as dist
import horovod.torch as hvd
sys.path.insert(0, "benchmarks")
hvd.init()
from cluster_worker import init_torch_distributed
init_torch_distributed(hvd.rank(), hvd.size(), 300)
torch.set_num_threads(1)
n = 7_370_240 // 2
half = torch.randn(n)
peer = 1 - hvd.rank()
def t(fn, reps=5):
    r = []
    for _ in range(reps):
        dist.barrier(); s = time.perf_counter(); fn(); r.append(time.perf_counter() - s)
    return r
def batch(recv_first):
    def f():
        out = torch.empty_like(half)
        ops = [dist.P2POp(dist.isend, half, peer), dist.P2POp(dist.irecv, out, peer)]
        if recv_first: ops.reverse()
        for w in dist.batch_isend_irecv(ops): w.wait()
    return f
def plain(recv_first):
    def f():
        out = torch.empty_like(half)
        if recv_first:
            a = dist.irecv(out, peer); b = dist.isend(half, peer)
        else:
            b = dist.isend(half, peer); a = dist.irecv(out, peer)
        a.wait(); b.wait()
    return f
res = {"batch send-first": t(batch(False)), "batch recv-first": t(batch(True)),
       "plain send-first": t(plain(False)), "plain recv-first": t(plain(True)),
       "batch send-first again": t(batch(False)), "batch recv-first again": t(batch(True))}
if hvd.rank() == 0:
    for k, r in res.items():
        print(f"PROBE {k}: " + " ".join(f"{v*1e3:.0f}" for v in r) + " ms", flush=True)
dist.destroy_process_group()
