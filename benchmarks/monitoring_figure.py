"""The Monitoring page's figure: the probe's relative error, the error-feedback residual
against the gradient, and the validation loss over a time-to-quality run of each method.

The runs are ``benchmarks/ttq_worker.py`` rows with probes on and recorded::

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/ttq_worker.py --method ef_sign \\
        --steps 400 --optimizer-options '{"probe_every": 10}' --record-probes --out RUN.json

    python benchmarks/monitoring_figure.py RUN.json [RUN.json ...] --png FIG.png --md TABLE.md
"""

import argparse
import json
from pathlib import Path


def load(path):
    run = json.loads(Path(path).read_text())
    if not run.get("probes"):
        raise SystemExit(f"{path}: no probes recorded (run ttq_worker.py with --record-probes and probe_every > 0)")
    return run


def label(run):
    return run["config"]["method"]


def plot(runs, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in runs:
        steps = [p["step"] for p in run["probes"]]
        axes[0].plot(steps, [p["probe_rel_error"] for p in run["probes"]], label=label(run))
        ratio = [p["residual_ratio"] for p in run["probes"]]
        if any(r is not None for r in ratio):
            axes[1].plot(steps, [float("nan") if r is None else r for r in ratio], label=label(run))
        axes[2].plot([h["step"] for h in run["history"]], [h["val_loss"] for h in run["history"]], label=label(run))
    axes[0].axhline(1.0, color="grey", linestyle=":", linewidth=1)
    axes[0].set(title="probe: ||ĝ - g|| / ||g|| (1 = sending nothing)", xlabel="step", ylabel="relative error")
    axes[1].set(title="error-feedback residual / gradient (RMS over ranks)", xlabel="step", ylabel="ratio")
    axes[2].set(title="validation loss", xlabel="step", ylabel="cross-entropy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    cfg = runs[0]["config"]
    fig.suptitle(f"{cfg['model']['parameters'] / 1e6:.1f}M-parameter LM on the standard library's source, "
                 f"{cfg['ranks']} ranks, Adam lr {cfg['lr']:g}, a probe every "
                 f"{runs[0]['probes'][1]['step'] - runs[0]['probes'][0]['step']} steps")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def table(runs):
    lines = ["| method | probes | relative error: first, median, last | cosine: median | residual / gradient: "
             "first, last | val loss at the end |", "|---|---:|---|---:|---|---:|"]
    for run in runs:
        probes = run["probes"]
        errs = sorted(p["probe_rel_error"] for p in probes)
        cos = sorted(p["probe_cosine"] for p in probes)
        ratio = [p["residual_ratio"] for p in probes]
        res = "–" if ratio[0] is None else f"{ratio[0]:.2f}, {ratio[-1]:.2f}"
        lines.append(f"| `{label(run)}` | {len(probes)} | {probes[0]['probe_rel_error']:.3f}, "
                     f"{errs[len(errs) // 2]:.3f}, {probes[-1]['probe_rel_error']:.3f} | {cos[len(cos) // 2]:.3f} | "
                     f"{res} | {run['final_val_loss']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--png", required=True)
    p.add_argument("--md", default="")
    args = p.parse_args(argv)
    runs = [load(r) for r in args.runs]
    plot(runs, args.png)
    text = table(runs)
    if args.md:
        Path(args.md).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
