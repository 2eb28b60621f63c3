"""Horovod's fp32 and fp16 allreduce of 1, 4 and 16 MB, per rank, best of 4, on loopback, and the
fp16 sum's cost beyond fp32's per byte summed, for fp16 values that are zeros, 0.1, or a fixed
normal draw times 0.01 (what Compression.auto's probe sums). Gloo's software fp16 conversion
(Horovod without Fix 9) is quicker on zeros. Output: fp16_values.txt.
Run: horovodrun -np N -H localhost:N --gloo python fp16_values.py {zeros,0.1,draw}"""
import sys
import time

import horovod.torch as hvd
import numpy as np
import torch

hvd.init()
KIND = sys.argv[1]


def fp16_values(n):
    if KIND == "zeros":
        return torch.zeros(n, dtype=torch.float16)
    if KIND == "0.1":
        return torch.full((n,), 0.1, dtype=torch.float16)
    return torch.from_numpy((np.random.default_rng(0).standard_normal(n) * 0.01).astype(np.float16))


def best(t, name):
    out = []
    for i in range(5):
        hvd.allreduce(torch.zeros(1), name=f"b{name}{i}")
        start = time.perf_counter()
        hvd.allreduce(t, name=name, op=hvd.Sum)
        out.append(time.perf_counter() - start)
    return min(out[1:])


n = hvd.size()
rows = [(mb, best(torch.zeros((mb << 20) // 4), f"f{mb}"), best(fp16_values((mb << 20) // 2), f"h{mb}"))
        for mb in (1, 4, 16)]
every = hvd.allgather_object(rows)
if hvd.rank() == 0:
    for i, (mb, _, _) in enumerate(rows):
        f32, f16 = (max(r[i][k] for r in every) for k in (1, 2))
        print(f"{KIND}, {n} ranks, {mb} MB: fp32 {1e3 * f32:.2f} ms, fp16 {1e3 * f16:.2f} ms, "
              f"fp16 sum +{1e9 * max(0.0, f16 - f32) / ((n - 1) / n * (mb << 20)):.1f} ns/byte", flush=True)
