"""Throughput of Global-QSGD's quantize + dequantize kernels on the torch backend.

One process, no communication: the encode and decode functions of
:mod:`hvd_quant.compressors.global_qsgd` and :mod:`hvd_quant.compressors.exp_dithering`
are called directly on one fp32 tensor, side by side with ``tensor.clone()`` (a memory
copy) and ``tensor.half().float()`` (the fp16 cast round trip Horovod's fp16 compression
pays). Reported: median time over the repeats, GB/s of fp32 input, and time relative
to clone (``t/t_clone``).

* ``gqsgd max`` / ``gqsgd l2``: local scale statistic (max|x| or ||x||^2), uniform draws,
  stochastic rounding to int8, dequantize of that tensor as if it were the sum.
* ``gqsgd exp``: max, uniform draws, uint8 power-of-two codes, decode.
* ``exp hop``: one per-hop stochastic sum of two code tensors (what each ring hop costs).

Example::

    .venv/bin/python benchmarks/bench_quantize.py --sizes 1M 16M --repeats 5
"""

import argparse
import statistics
import time

import torch

from hvd_quant.compressors.exp_dithering import combine_codes, exp_decode, exp_encode
from hvd_quant.compressors.global_qsgd import (
    finish_scale, linear_dequantize, linear_quantize, local_scale_stat, resolve_width_levels)
from hvd_quant.torch.backend import TorchBackend


def parse_size(text):
    """``"16M"`` -> 16 * 2**20, ``"1K"`` -> 1024, ``"1000"`` -> 1000."""
    units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def linear_round_trip(B, x, rng, norm, world_size):
    width, levels = resolve_width_levels(norm, world_size, bits=8)
    scale = finish_scale(B, local_scale_stat(B, x, norm), norm)
    q = linear_quantize(B, x, scale, levels, B.uniform(rng, B.numel(x)), f"int{width}")
    return linear_dequantize(B, q, scale, levels, world_size)


def exp_round_trip(B, x, rng, world_size):
    scale = finish_scale(B, local_scale_stat(B, x, "max"), "max")
    codes = exp_encode(B, x, scale, world_size, B.uniform(rng, B.numel(x)))
    return exp_decode(B, codes, scale, world_size)


def cases(B, x, rng, world_size):
    """(label, zero-argument callable) for every row of the table."""
    a = exp_encode(B, x, B.full(1, float(x.abs().max())), world_size, B.uniform(rng, B.numel(x)))
    b = a.flip(0).contiguous()
    return [
        ("clone", lambda: x.clone()),
        ("fp16 cast round trip", lambda: x.half().float()),
        ("gqsgd max (int8)", lambda: linear_round_trip(B, x, rng, "max", world_size)),
        ("gqsgd l2 (int8)", lambda: linear_round_trip(B, x, rng, "l2", world_size)),
        ("gqsgd exp (uint8)", lambda: exp_round_trip(B, x, rng, world_size)),
        ("exp hop combine", lambda: combine_codes(B, a, b, B.uniform(rng, B.numel(a)))),
    ]


def median_seconds(fn, repeats):
    fn()  # warm-up: allocator, kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["1M", "16M"],
                        help="fp32 elements per tensor (suffix K/M/G = 2**10/20/30)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4,
                        help="ranks assumed for the level count and the exp headroom")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    B = TorchBackend()
    rng = B.generator(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, world size "
          f"{args.world_size}, median of {args.repeats}")
    header = f"{'size':>6}  {'method':<22} {'ms':>9} {'GB/s fp32':>10} {'t/t_clone':>9}"
    print(header)
    print("-" * len(header))
    for size_text in args.sizes:
        numel = parse_size(size_text)
        x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
        clone_s = None
        for label, fn in cases(B, x, rng, args.world_size):
            seconds = median_seconds(fn, args.repeats)
            clone_s = seconds if clone_s is None else clone_s
            gbps = 4 * numel / seconds / 1e9
            print(f"{size_text:>6}  {label:<22} {seconds * 1e3:9.2f} {gbps:10.2f} "
                  f"{seconds / clone_s:9.2f}")


if __name__ == "__main__":
    main()
