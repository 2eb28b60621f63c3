"""Time 1-bit Adam's fp32 round (hvd_quant's ring, full_precision_mean as it was before
7faa8d1) against Horovod's allreduce of the same 29.5 MB, and its pieces: one ring hop (a
Horovod alltoall with one non-empty split), an even alltoall, the ring in 4 chunks, Horovod's
allreduce in 8 async pieces. A barrier before each repetition.

    .venv/bin/python -m hvd_quant.cluster run --hosts 2 --rate 100mbit -- \
        .venv/bin/python benchmarks/reference/ttq-fp32-round-2026-12-03/collective_probe.py

After 7faa8d1 full_precision_mean is an allreduce at 2 ranks: its row then times that.
"""
import statistics, time, sys
import torch, horovod.torch as hvd
from hvd_quant.torch.backend import TorchBackend
from hvd_quant.torch.comm import HorovodTorchComm
from hvd_quant.optimizers.base import full_precision_mean

torch.set_num_threads(1)
hvd.init()
B = TorchBackend(); comm = HorovodTorchComm()
numel = int(sys.argv[1]) if len(sys.argv) > 1 else 7370000
reps = 5
x = torch.randn(numel, generator=torch.Generator().manual_seed(hvd.rank()))
def timed(label, fn):
    ts = []
    for i in range(reps):
        hvd.allreduce(torch.zeros(1), name="barrier")
        t = time.perf_counter(); fn(i); ts.append(time.perf_counter() - t)
    if hvd.rank() == 0:
        print(f"{label:40s} median {1000*statistics.median(ts):8.1f} ms  all {[round(1000*v) for v in ts]}", flush=True)
timed("hvd.allreduce fp32 (whole)", lambda i: hvd.allreduce(x, op=hvd.Sum, name=f"ar{i}"))
timed("full_precision_mean (our ring)", lambda i: full_precision_mean(B, comm, x, f"fpm{i}"))
half = x[: numel // 2].clone()
timed("one sendrecv hop (half)", lambda i: comm.sendrecv(half, (hvd.rank()+1) % hvd.size(), (hvd.rank()-1) % hvd.size(), f"hop{i}"))
timed("hvd.alltoall even split (whole)", lambda i: hvd.alltoall(x, name=f"a2a{i}"))
# chunked: our ring on 4 pieces, async? sequential
def chunked(i, k=4):
    n = numel // k
    return [full_precision_mean(B, comm, x[j*n:(j+1)*n], f"c{i}.{j}") for j in range(k)]
timed("full_precision_mean in 4 chunks", chunked)
hs = []
def grouped(i, k=8):
    n = numel // k
    hs = [hvd.allreduce_async(x[j*n:(j+1)*n], op=hvd.Sum, name=f"g{i}.{j}") for j in range(k)]
    return [hvd.synchronize(h) for h in hs]
timed("hvd.allreduce_async 8 pieces", grouped)
