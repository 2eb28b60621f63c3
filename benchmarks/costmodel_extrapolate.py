"""Extrapolate the cost model on paper: which method wins where, out to 1,024 ranks.

    .venv/bin/python benchmarks/costmodel_extrapolate.py --out-dir benchmarks/results/extrapolation \\
        [--calibration benchmarks/results/calibration/calibration.json [--shares-from 100mbit]]

For a 124M-parameter model (GPT-2 small's tensors) and a 1.3B-parameter one (24 layers of
width 2048), at 1, 10 and 100 Gbit/s, the predicted time per step of each method's
gradient reduction (:func:`hvd_quant.core.costmodel.predict`: its collectives, per
25 MB bucket for the compressors, one group for the 1-bit optimizers, one bucket for DDP
PowerSGD, plus its passes over memory). The compute of the step is left out: it is the
same for every method, so it moves no crossover. Link figures: real hosts, one rank each
(:meth:`~hvd_quant.core.costmodel.LinkModel.datacenter`: assumed per-message and
per-collective latencies, a per-rank memory bandwidth; the shares of the link rate each
collective kind reaches as calibrated on the emulated links when ``--calibration`` is
given: the median over its rates, or those of one rate with ``--shares-from``, where the
wire rather than the emulating machine's CPUs bounded the calibration). These are
predictions, not measurements: the assumptions are printed with them.

Output: ``extrapolation.md`` (per model and rate, the predicted ms at 64, 256 and 1,024
ranks, the winner, and every method's crossover ``n``: the first number of ranks from
which it is slower than Horovod's fp32 allreduce, or faster where it starts slower),
``extrapolation.json`` and ``extrapolation.png`` (speed-up against fp32 versus ranks, one
panel per model and rate, the winner's band shaded).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from hvd_quant.core import costmodel  # noqa: E402
from hvd_quant.core.costmodel import LinkModel  # noqa: E402

METHODS = ("horovod_fp32", "ddp_powersgd", "fp16", "ef_sign", "marsit", "global_qsgd", "onebit",
           "onebit_adam", "zero_one_adam", "binsgdm")
RATES = (1e9, 10e9, 100e9)
RANKS = (64, 256, 1024)
SWEEP = tuple(sorted({int(round(2 ** (e / 4))) for e in range(4, 4 * 14 + 1)}))  # 2 .. 16384


def gpt_shapes(vocab, ctx, dim, layers):
    """Parameter shapes of a GPT-2-style model (tied output embedding)."""
    shapes = [(vocab, dim), (ctx, dim)]
    for _ in range(layers):
        shapes += [(dim,), (dim,), (dim, 3 * dim), (3 * dim,), (dim, dim), (dim,),
                   (dim,), (dim,), (dim, 4 * dim), (4 * dim,), (4 * dim, dim), (dim,)]
    return shapes + [(dim,), (dim,)]


MODELS = {
    "124M": gpt_shapes(50257, 1024, 768, 12),
    "1.3B": gpt_shapes(50257, 2048, 2048, 24),
}


def numel(shapes):
    total = 0
    for s in shapes:
        p = 1
        for x in s:
            p *= x
        total += p
    return total


def step_s(method, shapes, n, link, ranks_per_node=None):
    d = numel(shapes)
    options = {"shapes": shapes} if method == "ddp_powersgd" else None
    buckets = None
    if method == "horovod_fp32":
        buckets = costmodel.bucket_numels(d, 64)  # Horovod's 64 MB fusion buffer
    return costmodel.predict(method, d, n, link, ranks_per_node=ranks_per_node, segments=len(shapes),
                             buckets=buckets, options=options)["total_s"]


def crossover(method, shapes, link, ranks_per_node=None):
    """``(n, direction)``: the first ``n`` of the sweep where ``method`` changes sides
    against Horovod fp32 (``"slower from"`` or ``"faster from"``), or ``(None, side)``."""
    first = None
    for n in SWEEP:
        faster = step_s(method, shapes, n, link, ranks_per_node) < step_s("horovod_fp32", shapes, n, link,
                                                                          ranks_per_node)
        if first is None:
            first = faster
        elif faster != first:
            return n, "slower from" if first else "faster from"
    return None, "faster everywhere" if first else "slower everywhere"


def links(calibration, message_s, horovod_s, memory_bps, flops, shares_from=""):
    """The assumed link at every rate of :data:`RATES`, with the calibration's shares of the
    link rate: those of rate ``shares_from`` (e.g. ``"100mbit"``), or the median over its
    rates."""
    eff = None
    if calibration:
        models = calibration["models"]
        if shares_from:
            if shares_from not in models:
                raise SystemExit(f"--shares-from: the calibration has {', '.join(models)}, not {shares_from!r}")
            models = {shares_from: models[shares_from]}
        effs = {}
        for m in models.values():
            for k, v in m["efficiency"].items():
                effs.setdefault(k, []).append(v)
        eff = {k: statistics.median(v) for k, v in effs.items()} or None
    return {rate: LinkModel.datacenter(rate, message_s, horovod_s, memory_bps, eff, flops) for rate in RATES}


def run(args):
    calibration = json.loads(Path(args.calibration).read_text()) if args.calibration else None
    link_of = links(calibration, args.message_us * 1e-6, args.horovod_ms * 1e-3, args.memory_gbps * 1e9,
                    args.gflops * 1e9, args.shares_from)
    k = args.ranks_per_node if args.ranks_per_node > 1 else None
    out = {"assumptions": {f"{r / 1e9:g}gbit":
                           link_of[r].to_dict() for r in RATES},
           "ranks_per_node": args.ranks_per_node, "models": {}}
    for model, shapes in MODELS.items():
        per_rate = {}
        for rate in RATES:
            link = link_of[rate]
            table = {m: {n: step_s(m, shapes, n, link, k) for n in RANKS} for m in METHODS}
            winners = {n: min(METHODS, key=lambda m: table[m][n]) for n in RANKS}
            cross = {m: crossover(m, shapes, link, k) for m in METHODS if m != "horovod_fp32"}
            sweep = {m: [step_s(m, shapes, n, link, k) for n in SWEEP] for m in METHODS}
            per_rate[f"{rate / 1e9:g}gbit"] = {"ms": {m: {str(n): 1e3 * t for n, t in v.items()}
                                                      for m, v in table.items()},
                                               "winner": {str(n): w for n, w in winners.items()},
                                               "crossover": {m: {"n": c[0], "side": c[1]} for m, c in cross.items()},
                                               "sweep_ms": {m: [1e3 * t for t in v] for m, v in sweep.items()}}
        out["models"][model] = {"parameters": numel(shapes), "tensors": len(shapes), "rates": per_rate}
    out["sweep_ranks"] = list(SWEEP)
    return out


def markdown(result, args):
    lines = [f"Assumed per rank: {args.message_us:g} us per Gloo message, {args.horovod_ms:g} ms of Horovod "
             f"negotiation per collective, {args.memory_gbps:g} GB/s memory, "
             f"{args.gflops:g} GFLOP/s for PowerSGD's products, "
             f"{result['ranks_per_node']} rank(s) per host; the shares of the link rate per kind "
             + (f"as calibrated on the emulated links ({args.shares_from or 'median over the calibrated rates'})."
                if args.calibration else
                "measured on the emulated links (costmodel.EMULATED_EFFICIENCY).")
             + " Compute excluded (the same for every method).", ""]
    for model, m in result["models"].items():
        lines += [f"### {model} parameters ({m['parameters']:,} in {m['tensors']} tensors)", ""]
        for rate, r in m["rates"].items():
            head = " | ".join(f"{n} ranks" for n in RANKS)
            lines += [f"**{rate}**", "", f"| method | {head} | crossover vs Horovod fp32 |",
                      "|---|" + "---:|" * len(RANKS) + "---|"]
            for meth in METHODS:
                cells = []
                for n in RANKS:
                    ms = r["ms"][meth][str(n)]
                    best = r["winner"][str(n)] == meth
                    cells.append(f"**{ms:,.0f}**" if best else f"{ms:,.0f}")
                c = r["crossover"].get(meth)
                cross = "–" if c is None else (f"{c['side']} n = {c['n']}" if c["n"] else c["side"])
                lines.append(f"| {meth} | " + " | ".join(cells) + f" | {cross} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    rates = list(next(iter(result["models"].values()))["rates"])
    fig, axes = plt.subplots(len(models), len(rates), figsize=(5.2 * len(rates), 4.2 * len(models)),
                             squeeze=False)
    ranks = result["sweep_ranks"]
    for i, model in enumerate(models):
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            sweep = result["models"][model]["rates"][rate]["sweep_ms"]
            base = sweep["horovod_fp32"]
            for c, meth in enumerate(METHODS):
                if meth == "horovod_fp32":
                    continue
                ax.plot(ranks, [b / t for b, t in zip(base, sweep[meth])], label=meth, color=f"C{c % 10}",
                        linestyle="--" if meth == "ddp_powersgd" else "-")
            winners = [min(METHODS, key=lambda m: sweep[m][q]) for q in range(len(ranks))]
            for q in range(len(ranks) - 1):
                ax.axvspan(ranks[q], ranks[q + 1], color=f"C{METHODS.index(winners[q]) % 10}", alpha=0.08, lw=0)
            for n in RANKS:
                ax.axvline(n, color="grey", linewidth=0.6, linestyle=":")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{model}, {rate} (band: the winner)")
            ax.set_xlabel("ranks")
            ax.set_ylabel("predicted speed-up vs Horovod fp32")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", default="", help="calibration.json (its shares of the link rate)")
    p.add_argument("--shares-from", default="",
                   help="take the shares of the link rate from this calibrated rate only, e.g. 100mbit: where "
                        "the wire, not the CPUs, bounds the calibration's collectives (default: the median "
                        "over every calibrated rate)")
    p.add_argument("--message-us", type=float, default=25.0, help="assumed latency of one Gloo message")
    p.add_argument("--horovod-ms", type=float, default=1.0, help="assumed Horovod negotiation per collective")
    p.add_argument("--memory-gbps", type=float, default=20.0, help="assumed memory bandwidth per rank")
    p.add_argument("--gflops", type=float, default=50.0, help="assumed GFLOP/s per rank (PowerSGD's products)")
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--out-dir", default="", help="where extrapolation.{md,json,png} go (default: print)")
    args = p.parse_args(argv)
    result = run(args)
    text = markdown(result, args)
    print(text)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "extrapolation.md").write_text(text)
        (out / "extrapolation.json").write_text(json.dumps(result, indent=1))
        plot(result, out / "extrapolation.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
