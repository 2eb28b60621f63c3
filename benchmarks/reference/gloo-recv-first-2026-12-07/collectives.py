"""One job on 2 emulated hosts (1 Gbit/s): Horovod's Gloo allgather, alltoall and
allreduce, through torch or TensorFlow, at the sizes hvd_quant sends; the slower rank's
time, median of ``REPS`` calls (all calls printed), the sizes taking turns call by call.

    python -m hvd_quant.cluster run --hosts 2 --rate 1gbit -- .venv/bin/python collectives.py torch

Run once with Horovod built at patch level p6 (Gloo's ``alltoallv`` and ``allgatherv``
post each send before its receive) and once at p7 (each receive first:
``scripts/build_horovod.sh``, Fix 10). Rank 1 sleeps 20 ms before every call, so that one
rank arrives first, as in training.
"""

import statistics
import sys
import time

import numpy as np

FRAMEWORK = sys.argv[1]
REPS = 7
MB = 1e6
LATE_S = 0.02
# (label, collective, bytes each rank contributes): 58.7 MB to the peer is a probe of the
# 29.3M-parameter Keras model, 7.4 MB about a 2-rank qsgd/int8 wire of the 7.4M LM.
CASES = [("alltoall", 117_440_512), ("alltoall", 16_777_216), ("allgather", 7_372_800),
         ("allgather", 29_491_200), ("allreduce", 29_491_200)]

if FRAMEWORK == "torch":
    import torch
    import horovod.torch as hvd

    def make(nbytes):
        return torch.ones(nbytes // 4, dtype=torch.float32)

    def call(kind, x, name):
        fn = {"alltoall": hvd.alltoall, "allgather": hvd.allgather, "allreduce": hvd.allreduce}[kind]
        return fn(x, name=name) if kind != "allreduce" else fn(x, op=hvd.Sum, name=name)

    def slowest(ts):
        return hvd.allgather(torch.tensor([ts], dtype=torch.float64)).max(0).values.tolist()

    def barrier():
        hvd.allreduce(torch.zeros(1), name="barrier")
else:
    import tensorflow as tf
    import horovod.tensorflow as hvd

    def make(nbytes):
        return tf.ones([nbytes // 4], dtype=tf.float32)

    def call(kind, x, name):
        if kind == "allreduce":
            return hvd.allreduce(x, op=hvd.Sum, name=name)
        return {"alltoall": hvd.alltoall, "allgather": hvd.allgather}[kind](x, name=name)

    def slowest(ts):
        return hvd.allgather(tf.constant([ts], dtype=tf.float64)).numpy().max(0).tolist()

    def barrier():
        hvd.allreduce(tf.zeros([1]), name="barrier")

hvd.init()
bufs = [make(n) for _, n in CASES]
times = {i: [] for i in range(len(CASES))}
for i, (kind, _) in enumerate(CASES):  # warm-up: each collective once
    call(kind, bufs[i], f"warm{i}")
for r in range(REPS):
    for i, (kind, _) in enumerate(CASES):
        barrier()
        if hvd.rank() == 1:
            time.sleep(LATE_S)
        t = time.perf_counter()
        out = call(kind, bufs[i], f"c{i}.{r}")
        if FRAMEWORK == "tf":
            out.numpy()
        times[i].append(time.perf_counter() - t)
for i, (kind, nbytes) in enumerate(CASES):
    ts = slowest(times[i])
    peer = nbytes / 2 if kind != "allgather" else nbytes  # bytes each way at 2 ranks
    if kind == "allreduce":
        peer = nbytes  # a ring allreduce sends half, twice
    if hvd.rank() == 0:
        print(f"{FRAMEWORK} {kind:9s} {nbytes / MB:6.1f} MB a rank, {peer / MB:5.1f} MB each way: "
              f"median {1e3 * statistics.median(ts):7.1f} ms  bytes' time {peer * 8 / 1e9 * 1e3:6.1f} ms  "
              f"all {' '.join(f'{1e3 * t:.0f}' for t in ts)}", flush=True)
