"""QSGD against Global-QSGD at equal bits: bytes per rank, and the variance of the mean.

Issue 51, item 4: Global-QSGD (Xin et al. 2023) claims to be unbiased and
allreduce-compatible with up to O(sqrt n) more compression than QSGD (Alistarh et al.
2017). This measures the two on a real gradient, in one process, deterministically:

* **The gradient.** The byte-level transformer LM of ``examples/lm_torch.py``
  (``ByteTransformer``: 2 blocks, width 128, context 128; 0.45M parameters, one fused
  buffer) on the standard library's source (``examples/stdlib_text.py``), trained with
  Adam (lr 1e-3) for ``--warm-steps`` steps on one process from seed 0, then each of 16
  ranks takes the gradient of its own batch (``TrainBatches`` seeded by ``(0, rank)``, 16
  windows). Rank ``r`` of an ``n``-rank world holds gradient ``r``; ``g`` is their mean.
* **Bytes** per rank per step: each compressor's ``wire_bytes`` (the wire meter's ring
  cost model), torch's Horovod (int32 lanes for global_qsgd) and TF's (native int8).
* **Variance**: ``E ||g_hat - g||^2 / ||g||^2`` over ``--seeds`` seeds (rank ``r`` draws
  from stream ``seed + 1_000_003 r``, as the runner seeds it), with the standard error of
  that mean.

The estimates are computed from the compressors' own functions, rank by rank, as their
``reduce`` computes them (one decoder instead of ``n`` identical ones); the script first
checks that this equals ``reduce`` on a thread world, bit for bit, at 2 and 4 ranks.

    .venv/bin/python benchmarks/qsgd_vs_global.py --out benchmarks/reference/qsgd-vs-global-DATE
"""

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

import hvd_quant  # noqa: E402
from hvd_quant.compressors import global_qsgd as gq  # noqa: E402
from hvd_quant.compressors import qsgd as qs  # noqa: E402
from hvd_quant.core.backend import NumpyKernelBackend  # noqa: E402
from hvd_quant.core.compressor import ReduceContext  # noqa: E402
from hvd_quant.core.rng import CounterRNG  # noqa: E402
from hvd_quant.core.segments import block_counts, by_blocks  # noqa: E402
from hvd_quant.core.simulate import ThreadWorld  # noqa: E402

B = NumpyKernelBackend()
WORLDS = (2, 4, 8, 16)
#: (label, registry name, options): every method at 8 bits per element, then 16.
METHODS = [("qsgd", "qsgd", {}), ("qsgd_buffer", "qsgd", {"block": None}), ("global_qsgd", "global_qsgd", {}),
           ("global_qsgd_buffer", "global_qsgd", {"block": None}), ("global_qsgd_l2", "global_qsgd", {"norm": "l2"}),
           ("qsgd_16", "qsgd", {"bits": 16}), ("global_qsgd_l2_16", "global_qsgd", {"norm": "l2", "bits": 16})]


def gradients(ranks, warm_steps, context=128, batch=16):
    """``ranks`` float32 gradients (flat, one fused buffer) of the LM after ``warm_steps``
    Adam steps, each on its own rank's batch; and a description."""
    import torch
    import torch.nn.functional as F
    from lm_torch import ByteTransformer
    from stdlib_text import TrainBatches, load_corpus
    torch.manual_seed(0)
    torch.set_num_threads(1)
    corpus = load_corpus()
    model = ByteTransformer(context)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    warm = TrainBatches(corpus.train, context, batch, seed=1, rank=0)

    def loss_of(x, y):
        logits = model(torch.from_numpy(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y).reshape(-1))

    losses = []
    for _ in range(warm_steps):
        opt.zero_grad()
        loss = loss_of(*warm.next())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    grads = []
    for r in range(ranks):
        model.zero_grad()
        loss_of(*TrainBatches(corpus.train, context, batch, seed=0, rank=r).next()).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().astype(np.float32))
    numel = grads[0].size
    info = {"model": f"ByteTransformer(context={context}, d_model=128, heads=4, layers=2)",
            "parameters": int(numel), "corpus": corpus.summary() if hasattr(corpus, "summary") else None,
            "warm_steps": warm_steps, "batch_per_rank": batch, "warm_loss_first_last": [losses[0], losses[-1]]
            if losses else None,
            "grad_digest": hashlib.sha256(b"".join(g.tobytes() for g in grads)).hexdigest()[:16]}
    return grads, info


def stream_key(seed, rank):
    return CounterRNG(seed + 1_000_003 * rank).next_key()


def qsgd_estimate(comp, xs, seed):
    """What every rank of ``qsgd``'s reduce returns (hvd_quant.compressors.qsgd), with one
    decoder: each rank's own norms (one per block) and levels, the rows added in rank
    order."""
    width, s = comp.resolve()
    n, total = len(xs), None
    for r, x in enumerate(xs):
        counts = block_counts(x.size, comp.block)
        scale, pre, _ = qs.own_scale(B, x, counts)
        q = qs.quantize_levels(B, x, scale, pre, s, width, stream_key(seed, r), counts)
        part = qs.decode_row(B, q, B.divide(scale, float(s * n)), pre, counts)
        total = part if total is None else total + part
    return total


def global_estimate(comp, xs, seed):
    """What every rank of ``global_qsgd``'s reduce returns (native integers): the shared
    scales (one per block), each rank's levels on them, their integer sum, decoded once."""
    n = len(xs)
    width, s = comp.resolve(n)
    counts = block_counts(xs[0].size, comp.block)
    stats = [gq.local_scale_stat(B, x, comp.norm, counts) for x in xs]
    reduced = stats[0]
    for st in stats[1:]:  # max in any order; l2 sums in rank order, as identical_sum
        reduced = np.maximum(reduced, st) if comp.norm == "max" else reduced + st
    scale, pre = gq.finish_scale(B, reduced, comp.norm)
    total = None
    for r, x in enumerate(xs):
        v, sc, pr = gq.blockwise(B, x, scale, pre, counts)
        fast = B.kernel("quantize_ints", v)
        q = fast(v, float(pr[0]), float(sc[0]), s, stream_key(seed, r), f"int{width}", 0).astype(np.int64)
        total = q if total is None else total + q
    factor = B.divide(scale, float(s * n))
    out = by_blocks(B, total.astype(np.float32), counts, lambda v, f: v * f, factor)
    if float(np.min(pre)) >= 1.0:
        return out
    return np.clip(out * np.repeat(1.0 / pre, counts), -gq.FLOAT32_MAX, gq.FLOAT32_MAX)


def estimate(comp, xs, seed):
    return qsgd_estimate(comp, xs, seed) if comp.name == "qsgd" else global_estimate(comp, xs, seed)


def check_against_reduce(grads):
    """The one-decoder estimates equal every rank's ``reduce`` on a thread world."""
    for label, name, opts in METHODS:
        comp = hvd_quant.get(name, **opts)
        for n in (2, 4):
            xs = grads[:n]
            world = ThreadWorld(n)

            def body(comm, comp=comp, xs=xs):
                comm.allreduce_int_dtypes = ("int8", "int16", "int32", "int64")
                ctx = ReduceContext(B, comm, "g", [("w", xs[0].size)], rng=B.generator(5 + 1_000_003 * comm.rank))
                return comp.reduce(xs[comm.rank], ctx)
            got = world.run(body)
            want = estimate(comp, xs, 5)
            for g in got:
                if not np.array_equal(g, want):
                    raise AssertionError(f"{label} at {n} ranks: the one-decoder estimate differs from reduce")


def measure(grads, seeds):
    rows = []
    for n in WORLDS:
        xs = grads[:n]
        g = np.mean(np.asarray(xs, np.float64), axis=0)
        gg = float(np.sum(g * g))
        for label, name, opts in METHODS:
            comp = hvd_quant.get(name, **opts)
            t0 = time.perf_counter()
            errs = np.array([float(np.sum((estimate(comp, xs, 1000 + k).astype(np.float64) - g) ** 2)) / gg
                             for k in range(seeds)])
            if comp.name == "qsgd":
                width, s = comp.resolve()
                torch_bytes = tf_bytes = comp.wire_bytes(xs[0].size, n)
            else:
                width, s = comp.resolve(n)
                torch_bytes = comp.wire_bytes(xs[0].size, n)
                tf_bytes = comp.wire_bytes(xs[0].size, n, int_dtypes=("int8", "int32", "int64"))
            rows.append({"ranks": n, "method": label, "bits": width, "levels": s,
                         "bytes_per_rank_torch": torch_bytes, "bytes_per_rank_tf": tf_bytes,
                         "fp32_allreduce_bytes": 2.0 * (n - 1) / n * 4 * xs[0].size,
                         "rel_var": float(errs.mean()), "rel_var_stderr": float(errs.std(ddof=1) / np.sqrt(seeds)),
                         "seconds": time.perf_counter() - t0})
            print(f"n={n:2d} {label:18s} w={width:2d} s={s:5d} bytes={torch_bytes:12.0f} "
                  f"var={errs.mean():.5g} ± {errs.std(ddof=1) / np.sqrt(seeds):.2g}", flush=True)
    return rows


def table(rows, numel):
    by = {(r["ranks"], r["method"]): r for r in rows}
    lines = ["| ranks | method | bits | levels s | bytes per rank (torch) | (TF) | fp32 allreduce's bytes ÷ these | "
             "E‖ĝ−g‖²/‖g‖² | variance ÷ qsgd's (same bits) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        q = by[(r["ranks"], "qsgd" if r["bits"] == 8 else "qsgd_16")]
        lines.append(f"| {r['ranks']} | `{r['method']}` | {r['bits']} | {r['levels']} | "
                     f"{r['bytes_per_rank_torch']:,.0f} | {r['bytes_per_rank_tf']:,.0f} | "
                     f"{r['fp32_allreduce_bytes'] / r['bytes_per_rank_torch']:.2f} | "
                     f"{r['rel_var']:.4g} ± {r['rel_var_stderr']:.1g} | {r['rel_var'] / q['rel_var']:.3g} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--warm-steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    grads, info = gradients(max(WORLDS), args.warm_steps)
    print(json.dumps(info), flush=True)
    check_against_reduce(grads)
    print("one-decoder estimates equal reduce on a thread world (2 and 4 ranks): ok", flush=True)
    rows = measure(grads, args.seeds)
    md = table(rows, info["parameters"])
    print(md)
    result = {"info": info, "seeds": args.seeds, "rows": rows, "python": platform.python_version(),
              "numpy": np.__version__, "seconds": time.perf_counter() - t0}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
        (args.out / "table.md").write_text(md + "\n")
    return result


if __name__ == "__main__":
    main()
