"""Time one gradient reduction per method, side by side in one run (PyTorch, Horovod).

    .venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/bench_allreduce.py

Compares Horovod's own fp32 and fp16 allreduce with each hvd_quant compressor on the same
fp32 buffer: median milliseconds per reduction (quantization included) and bytes sent per
rank. On one machine the "network" is loopback memory copies, so this measures the
compute cost of compression more than its network benefit; the bytes column is what a
bandwidth-bound link would carry.
"""

import argparse
import statistics
import time

import torch
import horovod.torch as hvd

import hvd_quant
from hvd_quant.core.runner import CompressorRunner
from hvd_quant.torch.backend import TorchBackend
from hvd_quant.torch.comm import HorovodTorchComm

METHODS = ["ef_sign", "marsit", "global_qsgd", "global_qsgd:norm=l2", "global_qsgd_exp", "onebit"]


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        hvd.allreduce(torch.zeros(1), name="barrier")  # start together
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000000,16000000", help="floats, comma separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank (ranks share the machine's cores)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hvd.init()
    n = hvd.size()
    B = TorchBackend()
    rows = []
    for numel in map(int, args.sizes.split(",")):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(hvd.rank()))
        ring = 2.0 * (n - 1) / n
        rows.append((numel, "horovod fp32 allreduce",
                     timed(lambda: hvd.allreduce(x, op=hvd.Sum, name="fp32"), args.repeats), ring * 4 * numel))
        rows.append((numel, "horovod fp16 allreduce",
                     timed(lambda: hvd.allreduce(x.half(), op=hvd.Sum, name="fp16").float(), args.repeats),
                     ring * 2 * numel))
        for config in METHODS:
            name, _, opt = config.partition(":")
            options = dict(kv.split("=") for kv in opt.split(",") if kv)
            runner = CompressorRunner(hvd_quant.get(name, **options), B)
            comm = HorovodTorchComm()
            segments = [("buffer", numel)]
            runner.reduce(x, comm, f"warm.{config}.{numel}", segments)  # first call: state, check
            comm.meter.reset()
            ms = timed(lambda: runner.reduce(x, comm, f"{config}.{numel}", segments), args.repeats)
            rows.append((numel, f"hvd_quant {config}", ms, comm.meter.bytes_sent / args.repeats))
    if hvd.rank() == 0:
        print(f"{n} ranks, median of {args.repeats}; bytes = sent per rank per reduction")
        print(f"{'floats':>10s}  {'method':32s} {'ms':>9s} {'vs fp32':>8s} {'MB sent':>9s} {'fewer bytes':>11s}")
        base = {}
        for numel, label, ms, sent in rows:
            base.setdefault(numel, (ms, sent))
            print(f"{numel:10d}  {label:32s} {ms:9.1f} {base[numel][0] / ms:7.2f}x "
                  f"{sent / 1e6:9.2f} {base[numel][1] / max(sent, 1):10.1f}x")


if __name__ == "__main__":
    main()
