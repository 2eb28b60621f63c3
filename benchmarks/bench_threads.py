"""Kernel threads when ranks share a host: the evidence behind the default thread policy.

    .venv/bin/python benchmarks/bench_threads.py                 # 1 and `cores` processes
    .venv/bin/python benchmarks/bench_threads.py --procs 1 2 3 --numel 31700000 --json out.json

Each configuration starts ``P`` processes at once (as ``P`` ranks on this host would run)
and times, in every process, the kernel work of one reduction or optimizer step on a
buffer laid out like the 31.7M-parameter transformer LM of ``bench_cluster.py``'s model
case (52 tensors, the scale sums per tensor). Reported per configuration: the median ms of
each case over repeats (the slowest process's), and the total.

Configurations (``C`` = usable cores, from :mod:`hvd_quant.kernels.threads`):

``policy``
    hvd_quant's default: nothing set; the processes see ``HOROVOD_LOCAL_SIZE=P``, as
    ``horovodrun`` sets it. ``max(1, C // P)`` threads each; serial kernels at one thread.
``serial``
    ``HVD_QUANT_THREADS=1``: the serial twins.
``parallel, 1 thread``
    the parallel twins on a pool of one thread (``NUMBA_NUM_THREADS=1``): what a parallel
    region costs when it has nothing to spread over. Internal: forces the flavour.
``parallel, C threads``
    the parallel twins on ``C`` threads in every process: the old default, where each
    rank's numba pool took every core.
``parallel, pool C, set to 1``
    a pool of ``C`` threads but ``numba.set_num_threads(1)`` in the calling thread: the old
    default when torch was set to one thread per rank.

Run it on an otherwise idle machine: the processes of one configuration compete with each
other, which is the point, and with nothing else.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: The LM of bench_cluster's model case (vocab 32000, width 384, context 32, 4 encoder
#: layers with MLP 1536, a vocabulary head with bias): 52 tensors, 31.7M floats, in
#: registration order.
_LAYER = [3 * 384 * 384, 3 * 384, 384 * 384, 384, 1536 * 384, 1536, 384 * 1536, 384, 384, 384, 384, 384]
LM_SIZES = [32000 * 384, 32 * 384] + _LAYER * 4 + [32000 * 384, 32000]


def layout(numel):
    """Tensor sizes summing to ``numel``: the LM's, scaled (at least one element each)."""
    total = sum(LM_SIZES)
    sizes = [max(1, round(s * numel / total)) for s in LM_SIZES]
    sizes[0] += numel - sum(sizes)
    return sizes


def cases(numel):
    import numpy as np

    from hvd_quant import kernels
    from hvd_quant.compressors import global_qsgd as gq
    from hvd_quant.core.backend import NumpyKernelBackend
    from hvd_quant.core.packing import sign_pack_residual, unpack_scaled_sum
    from hvd_quant.core.rng import CounterRNG
    from hvd_quant.core.segments import compensate_sums_signs
    from hvd_quant.optimizers import elementwise as ew

    class _Comm:
        rank, size, allreduce_int_dtypes = 0, 2, ("int32", "int64")

    B = NumpyKernelBackend()
    counts = layout(numel)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(numel, dtype=np.float32)
    e = (rng.standard_normal(numel, dtype=np.float32) * 0.1)
    m, v = e.copy(), np.abs(e) + 0.1
    xs, us = x.copy(), e.copy()
    out = np.empty_like(x)
    scales = np.full(len(counts), 0.5, np.float32)
    bits, _ = sign_pack_residual(B, x, None, scales, counts)
    rows = np.concatenate([bits, bits])
    scale, pre = np.array([float(np.abs(x).max())], np.float32), np.ones(1, np.float32)
    return {
        "ef_sign: scale sums + signs, per tensor": lambda: compensate_sums_signs(B, x, e, counts),
        "ef_sign: sign + pack + residual": lambda: sign_pack_residual(B, x, e, scales, counts, out=e),
        "unpack x scale, 2 ranks summed": lambda: unpack_scaled_sum(B, rows, np.concatenate([scales, scales]),
                                                                    counts, numel, out=out),
        "Global-QSGD quantize + dequantize": lambda: gq.dequantize(
            B, _Comm, gq.quantize(B, _Comm, x, scale, pre, 63, 8, CounterRNG(1)), numel, scale, pre, 63, 8,
            into=out),
        "0/1 Adam local step (in place)": lambda: ew.adam_descend(
            B, xs, ew.ema(B, m, x, 0.9, in_place=True), v, 1e-3, 1e-8, 0.0, acc=us, into=xs, acc_into=us),
    }


def worker(args):
    """One process of a configuration: time every case, print one JSON line."""
    from hvd_quant import kernels

    kernels.enabled()  # the policy applied and the kernels imported: now override it
    if args.force_parallel:
        kernels.cpu_module().use_serial(False)
    if args.set_one:
        import numba

        numba.set_num_threads(1)
    load_s = kernels.warm_up()
    work = cases(args.numel)
    times = {}
    for name, fn in work.items():
        fn()
        times[name] = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    import numba

    print(json.dumps({"times": times, "load_s": load_s, "choice": kernels.threads.describe(),
                      "serial": kernels.cpu_module()._SERIAL[0], "pool": numba.config.NUMBA_NUM_THREADS}))


def configurations(cores):
    return {
        "policy": ({}, []),
        "serial": ({"HVD_QUANT_THREADS": "1"}, []),
        "parallel, 1 thread": ({"NUMBA_NUM_THREADS": "1"}, ["--force-parallel"]),
        f"parallel, {cores} threads": ({"NUMBA_NUM_THREADS": str(cores)}, ["--force-parallel"]),
        f"parallel, pool {cores}, set to 1": ({"NUMBA_NUM_THREADS": str(cores)}, ["--force-parallel", "--set-one"]),
    }


def run_config(env_extra, flags, procs, args):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_NUM_THREADS", "HVD_QUANT_THREADS", "HOROVOD_LOCAL_SIZE")}
    env.update(env_extra, HOROVOD_LOCAL_SIZE=str(procs), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, __file__, "--worker", "--numel", str(args.numel), "--repeats", str(args.repeats)] + flags
    ps = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    outs = []
    for p in ps:
        out, _ = p.communicate(timeout=args.timeout)
        if p.returncode:
            raise SystemExit(f"a worker failed ({p.returncode}): {' '.join(cmd)}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    names = list(outs[0]["times"])
    medians = {n: statistics.median(max(o["times"][n][r] for o in outs) for r in range(args.repeats))
               for n in names}
    return {"medians_ms": {n: 1e3 * t for n, t in medians.items()}, "total_ms": 1e3 * sum(medians.values()),
            "choice": outs[0]["choice"], "serial": outs[0]["serial"], "pool": outs[0]["pool"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, nargs="+", default=None,
                   help="processes per configuration (default: 1 and the usable cores)")
    p.add_argument("--numel", type=int, default=31_700_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--force-parallel", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--set-one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from hvd_quant.kernels import threads

    cores, why = threads.usable_cores()
    procs = args.procs or sorted({1, cores})
    print(f"{cores} usable cores ({why}); {args.numel:,} floats in {len(LM_SIZES)} tensors; "
          f"median of {args.repeats}, the slowest process's time", flush=True)
    results = {"cores": cores, "numel": args.numel, "repeats": args.repeats, "runs": {}}
    for n in procs:
        print(f"\n{n} process{'es' * (n > 1)} at once\n")
        rows = {}
        for label, (env, flags) in configurations(cores).items():
            t = time.perf_counter()
            rows[label] = run_config(env, flags, n, args)
            r = rows[label]
            print(f"  {label:32s} {r['total_ms']:9.1f} ms   ({'serial' if r['serial'] else 'parallel'} "
                  f"kernels, pool {r['pool']}; {time.perf_counter() - t:.0f} s)", flush=True)
        results["runs"][str(n)] = rows
        names = list(next(iter(rows.values()))["medians_ms"])
        print("\n| case | " + " | ".join(rows) + " |")
        print("|---|" + "---|" * len(rows))
        for name in names + ["total"]:
            cells = [rows[c]["total_ms"] if name == "total" else rows[c]["medians_ms"][name] for c in rows]
            print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
