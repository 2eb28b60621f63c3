"""One rank enters each collective SKEW seconds late (alternately rank 0 and rank 1); the late
rank's time for a ring hop, an even alltoall, an allreduce, an allgather and a reducescatter,
each moving 14.7 MB per rank each way (the allreduce twice that).

    .venv/bin/python -m hvd_quant.cluster run --hosts 2 --rate 100mbit -- \
        .venv/bin/python benchmarks/reference/ttq-fp32-round-2026-12-03/skew_probe.py 0.3
"""
import statistics, time, sys
import torch, horovod.torch as hvd
from hvd_quant.torch.comm import HorovodTorchComm
torch.set_num_threads(1)
hvd.init()
comm = HorovodTorchComm()
r, n = hvd.rank(), hvd.size()
half = torch.randn(3685120); whole = torch.randn(2 * 3685120)
reps = 6
skew = float(sys.argv[1]) if len(sys.argv) > 1 else 0.3
def timed(label, fn):
    ts = []
    for i in range(reps):
        hvd.allreduce(torch.zeros(1), name="barrier")
        late = (i % 2 == 0) == (r == 1)   # alternate which rank is late
        if late: time.sleep(skew)
        t = time.perf_counter(); fn(i); d = time.perf_counter() - t
        if late: ts.append(d)
    got = hvd.allgather_object(ts)
    if r == 0:
        allts = [v for g in got for v in g]
        print(f"{label:34s} late rank's time: median {1000*statistics.median(allts):6.0f} all {[round(1000*v) for v in allts]}", flush=True)
timed("hop (alltoall splits) 14.7MB", lambda i: comm.sendrecv(half, (r+1) % n, (r-1) % n, f"h{i}"))
timed("hvd.alltoall even 29.5MB", lambda i: hvd.alltoall(whole, name=f"a{i}"))
timed("hvd.allreduce 29.5MB", lambda i: hvd.allreduce(whole, op=hvd.Sum, name=f"ar{i}"))
timed("hvd.allgather 14.7MB", lambda i: hvd.allgather(half, name=f"ag{i}"))
try:
    timed("hvd.reducescatter 29.5MB", lambda i: hvd.reducescatter(whole, op=hvd.Sum, name=f"rs{i}"))
except Exception as e:
    print("reducescatter:", e)
