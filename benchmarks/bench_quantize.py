"""Every fused kernel against ``clone()`` and ``copy_()``, in one run (torch, CPU, one process).

The hot paths of every method (:mod:`hvd_quant.kernels`), each called through the same
entry point the methods use, on one fp32 buffer, side by side with two memory baselines:
``x.clone()`` (allocates and faults in new pages, what an unfused op chain pays per
temporary) and ``dst.copy_(x)`` into a preallocated buffer (one honest pass over memory).
Reported: the median over repeats, and the time as a multiple of each baseline.

Also reported: the same calls on the generic path (``HVD_QUANT_KERNELS=0`` semantics:
plain framework operations) for the speed-up the kernels bring, and the one-off cost of
compiling the kernels (numba) or loading them from its on-disk cache.

The issue's targets, single thread, 25M floats: sign + pack and unpack x scale at most
1x ``clone()``, a Marsit hop at most 1.5x, Global-QSGD quantize + dequantize at most 2x.

    .venv/bin/python benchmarks/bench_quantize.py --numel 25000000 --threads 1 --json out.json
"""

import argparse
import json
import statistics
import sys
import time

import torch

from hvd_quant import kernels
from hvd_quant.compressors import exp_dithering as ed
from hvd_quant.compressors import global_qsgd as gq
from hvd_quant.compressors.marsit import CascadingSign, MarsitSelect
from hvd_quant.core.hierarchical import select_rows, threshold_rows
from hvd_quant.core.compressed_allreduce import padded_size, rms_scale
from hvd_quant.core.packing import pack_signs, sign_pack_residual, unpack_scaled_sum, unpack_sums_signs
from hvd_quant.core.ring import tree_fold
from hvd_quant.core.rng import CounterRNG, random_bytes
from hvd_quant.core.segments import block_counts, compensate_sums
from hvd_quant.optimizers import elementwise as ew
from hvd_quant.optimizers.binsgdm import binary_randomize
from hvd_quant.torch.backend import TorchBackend

TARGETS = {"sign + pack": 1.0, "unpack x scale": 1.0, "Marsit hop": 1.5,
           "Global-QSGD quantize + dequantize": 2.0}


class _Comm:  # what quantize/dequantize read from a communicator
    rank, size, allreduce_int_dtypes = 0, 2, ("int32", "int64")


class GenericTorch(TorchBackend):
    """The torch backend with the kernels switched off (the generic, unfused path)."""

    def kernel(self, name, *tensors):
        return None


def cases(B, x, e):
    """``{label: callable}``: each fused primitive as the methods call it."""
    d = x.numel()
    scale, pre = torch.full((1,), float(x.abs().max())), torch.ones(1)
    bits = pack_signs(B, x)
    two_rows = torch.cat([bits, pack_signs(B, e)])
    scales2 = torch.tensor([0.5, 0.25])
    words = gq.quantize(B, _Comm, x, scale, pre, 63, 8, CounterRNG(1))
    blocks = block_counts(d, 512)  # global_qsgd's default: a shared scale per 512 elements
    block_scale = gq.block_absmax(B, x, blocks)
    block_pre = torch.ones(len(blocks))
    codes = ed.encode(B, x, scale, 2, CounterRNG(2))
    m, b = e.clone(), e.abs() + 0.1
    padded = padded_size(d, 2)
    # Outputs go where the methods put them: decoded results into the gradient's memory
    # (ReduceContext.out), residuals over the residual, a kept 0/1 Adam local step over
    # its parameters, moment and accumulator; the other calls allocate as the methods do.
    out, resid = torch.empty_like(x), e.clone()
    xs, ms, us, server = x.clone(), m.clone(), e.clone(), e.clone()
    return {
        "sign + pack": lambda: pack_signs(B, x),
        "unpack x scale": lambda: unpack_scaled_sum(B, bits, torch.tensor([0.5]), [d], d, out=out),
        "unpack x scale, 2 ranks summed": lambda: unpack_scaled_sum(B, two_rows, scales2, [d], d, out=out),
        "error feedback: sum |x + e|": lambda: compensate_sums(B, x, e, [d]),
        "error feedback: sign + pack + residual": lambda: sign_pack_residual(
            B, x, resid, torch.tensor([0.5]), [d], out=resid),
        "1-bit allreduce worker stage (RMS + signs + residual)": lambda: sign_pack_residual(
            B, x, resid, torch.reshape(rms_scale(B, x, resid, padded), (1,)), [d], out=resid),
        "1-bit allreduce server stage (decode over c_s + sums + signs)": lambda: unpack_sums_signs(
            B, two_rows, scales2, [d], d, base=server, base_scales=torch.tensor([0.1]), out=server,
            squares=True),
        "Marsit hop": lambda: MarsitSelect().combine(B, bits, 1, two_rows[d // 8 + (d % 8 > 0):], 1, CounterRNG(3)),
        "Marsit hop, odds 1/3 (a draw per element)": lambda: MarsitSelect().combine(
            B, bits, 1, two_rows[d // 8 + (d % 8 > 0):], 2, CounterRNG(3)),
        "cascading-sign hop (decode both, add, re-sign: the baseline Marsit replaces)": lambda: CascadingSign().combine(
            B, bits, 1, two_rows[d // 8 + (d % 8 > 0):], 1, CounterRNG(5)),
        "cascading-sign fold of 16 chunks (the direct layout at 16 ranks)": lambda: tree_fold(
            B, list(bits[:bits.numel() // 16 * 16].reshape(16, -1)), [1] * 16, CascadingSign(), CounterRNG(5)),
        "BinSGDM hierarchy re-binarisation, 2 rows (a random row)": lambda: select_rows(
            B, two_rows[:2 * (d // 8)], 2, 7),
        "BinSGDM hierarchy re-binarisation, 3 rows (a draw per element)": lambda: threshold_rows(
            B, torch.cat([bits[:d // 8]] * 3), 3, 7),
        "Global-QSGD max|x|": lambda: gq.absmax_finite(B, x),
        "Global-QSGD quantize + dequantize": lambda: gq.dequantize(
            B, _Comm, gq.quantize(B, _Comm, x, scale, pre, 63, 8, CounterRNG(1)), d, scale, pre, 63, 8,
            into=out),
        "Global-QSGD dequantize": lambda: gq.dequantize(B, _Comm, words, d, scale, pre, 63, 8, into=out),
        "Global-QSGD max|x| per block of 512": lambda: gq.local_scale_stat(B, x, "max", blocks),
        "  the same, unfused (the blocks' maxima, then the finite check)": lambda: (
            gq.block_absmax(B, x, blocks), B.all_finite(x)),
        "Global-QSGD quantize + dequantize, a scale per block of 512": lambda: gq.dequantize(
            B, _Comm, gq.quantize_blocks(B, _Comm, x, block_scale, None, blocks, 512, 63, 8, CounterRNG(1)), d,
            block_scale, block_pre, 63, 8, into=out, counts=blocks, block=512),
        "  the same, unfused (blocks scaled around the one-scale kernels)": lambda: gq.dequantize(
            B, _Comm, gq.quantize(B, _Comm, *gq.blockwise(B, x, block_scale, None, blocks), 63, 8, CounterRNG(1)), d,
            block_scale, block_pre, 63, 8, counts=blocks),
        "exponential encode": lambda: ed.encode(B, x, scale, 2, CounterRNG(2)),
        "exponential per-hop sum": lambda: ed.ExpDitheringSum().combine(B, codes, 1, codes, 1, CounterRNG(4)),
        "exponential decode": lambda: ed.exp_decode(B, codes, scale, 2, into=out),
        "BinSGDM moments + binary randomization": lambda: binary_randomize(B, x, m, b, 0.9, 5),
        "uniform draws": lambda: B.uniform(CounterRNG(6), d),
        "random bytes (8 random bits per byte)": lambda: random_bytes(B, 8, d // 8),
        "all finite": lambda: B.all_finite(x),
        "Adam moment (ema)": lambda: ew.ema(B, m, x, 0.9),
        "Adam step (adam_descend)": lambda: ew.adam_descend(B, x, m, b, 1e-3, 1e-8, 0.0),
        "0/1 Adam local step (ema + adam_descend + accumulator, in place)": lambda: ew.adam_descend(
            B, xs, ew.ema(B, ms, x, 0.9, in_place=True), b, 1e-3, 1e-8, 0.0, acc=us, into=xs, acc_into=us),
        "0/1 Adam sync: precondition": lambda: ew.precondition(B, e, b, 1e-8),
        "0/1 Adam sync: result": lambda: ew.zero_one_sync_result(B, x, e, m, b, 1e-8, 0.01),
        "BinSGDM step (descend)": lambda: ew.descend(B, x, e, 1e-3, 0.0),
    }


#: What a call's time is measured with: wall-clock time, or the CPU time of the process (all
#: its threads), which a busy machine's other work hardly changes when one thread runs.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn, repeats, clock=time.perf_counter):
    fn()  # warm-up: first touch, caches
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=25_000_000, help="floats in the buffer")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch and kernel threads (hvd_quant.kernels.set_threads; 1 runs the serial twins)")
    p.add_argument("--generic", action="store_true", help="also time the generic (unfused) path")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: elapsed time (default); cpu: the process's CPU time, for a machine "
                        "that other work shares (with --threads 1)")
    args = p.parse_args()
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    kernels.set_threads(args.threads)  # a kernel microbenchmark: its own count (1: the serial twins)
    if not kernels.enabled():
        sys.exit(f"the kernels are off: {kernels.why_disabled()}")
    compile_s = kernels.warm_up()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.numel, generator=gen)
    e = torch.randn(args.numel, generator=gen) * 0.1
    dst = torch.empty_like(x)
    clone = timed(lambda: x.clone(), args.repeats, clock)
    copy = timed(lambda: dst.copy_(x), args.repeats, clock)
    print(f"{args.numel:,} floats ({4 * args.numel / 1e6:.0f} MB), {args.threads} thread(s), "
          f"median of {args.repeats} ({args.clock} time); kernels compiled or loaded in {compile_s:.2f} s")
    print(f"clone() {1e3 * clone:.1f} ms, copy_() {1e3 * copy:.1f} ms\n")
    print(f"| {'kernel':54s} | {'ms':>7s} | {'x clone':>7s} | {'x copy_':>7s} | target | "
          + ("generic ms | speed-up |" if args.generic else ""))
    print("|" + "---|" * (5 + 2 * args.generic))
    rows = []
    fast = cases(TorchBackend(), x, e)
    slow = cases(GenericTorch(), x, e) if args.generic else {}
    for label, fn in fast.items():
        t = timed(fn, args.repeats, clock)
        row = {"kernel": label, "ms": 1e3 * t, "x_clone": t / clone, "x_copy": t / copy,
               "target_x_clone": TARGETS.get(label)}
        target = f"<= {row['target_x_clone']}x {'met' if t / clone <= TARGETS[label] else 'MISSED'}" \
            if label in TARGETS else ""
        line = f"| {label:54s} | {row['ms']:7.1f} | {row['x_clone']:7.2f} | {row['x_copy']:7.2f} | {target} |"
        if args.generic:
            g = timed(slow[label], max(1, args.repeats // 2), clock)
            row.update(generic_ms=1e3 * g, speedup=g / t)
            line += f" {1e3 * g:10.1f} | {g / t:7.1f}x |"
        print(line, flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": args.numel, "threads": args.threads, "clock": args.clock, "clone_ms": 1e3 * clone,
                       "copy_ms": 1e3 * copy, "compile_s": compile_s, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
