"""Time our ring fp32 mean (the 1-bit optimizers' warm-up round) over DistComm (Gloo p2p)
and over Horovod, plus raw sendrecv of half the buffer, on the emulated cluster."""
import sys, time
import torch, torch.distributed as dist
import horovod.torch as hvd
sys.path.insert(0, "benchmarks")
hvd.init()
from cluster_worker import init_torch_distributed
init_torch_distributed(hvd.rank(), hvd.size(), 300)
torch.set_num_threads(1)
from hvd_quant.torch.dist_comm import DistComm
from hvd_quant.torch.comm import HorovodTorchComm
from hvd_quant.torch.backend import TorchBackend
from hvd_quant.optimizers.base import full_precision_mean
n = 7_370_240
x = torch.randn(n)
B = TorchBackend()
dc = DistComm(None)
hc = HorovodTorchComm()
peer = 1 - hvd.rank()
def t(fn, reps=3):
    r = []
    for _ in range(reps):
        dist.barrier(); s = time.perf_counter(); fn(); r.append(time.perf_counter() - s)
    return min(r), sum(r) / reps
half = x[: n // 2].clone()
def sr_dist(): dc.sendrecv(half, peer, peer, "p")
def sr_hvd(): hc.sendrecv(half, peer, peer, "p")
def send_only():
    if hvd.rank() == 0: dist.send(half, 1)
    else:
        o = torch.empty_like(half); dist.recv(o, 0)
res = {"ring mean DistComm": t(lambda: full_precision_mean(B, dc, x, "a")),
       "ring mean Horovod": t(lambda: full_precision_mean(B, hc, x, "b")),
       "sendrecv 14.7MB DistComm": t(sr_dist), "sendrecv 14.7MB Horovod": t(sr_hvd),
       "send one way 14.7MB gloo": t(send_only)}
if hvd.rank() == 0:
    for k, (b, m) in res.items():
        print(f"PROBE {k}: best {b*1e3:.0f} ms, mean {m*1e3:.0f} ms", flush=True)
dist.destroy_process_group()
