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


def optimizer(run):
    """The run's base optimizer and learning rate, e.g. "Adam lr 0.0005" or "SGD lr 1"."""
    cfg = run["config"]
    base = cfg.get("base_optimizer", "adam")
    if isinstance(base, dict) and "sgd_momentum" in base:
        name = "SGD" + (f" momentum {base['sgd_momentum']:g}" if base["sgd_momentum"] else "")
    else:
        name = "Adam" if base == "adam" else str(base)
    return f"{name} lr {cfg['lr']:g}"


def label(run, runs=(), code=False):
    """The method (in backticks with ``code``), with its optimizer where the runs do not
    all share one."""
    mixed = len({optimizer(r) for r in runs}) > 1
    method = run["config"]["method"]
    return (f"`{method}`" if code else method) + (f", {optimizer(run)}" if mixed else "")


def plot(runs, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in runs:
        name = label(run, runs)
        steps = [p["step"] for p in run["probes"]]
        axes[0].plot(steps, [p["probe_rel_error"] for p in run["probes"]], label=name)
        ratio = [p["residual_ratio"] for p in run["probes"]]
        if any(r is not None for r in ratio):
            axes[1].plot(steps, [float("nan") if r is None else r for r in ratio], label=name)
        axes[2].plot([h["step"] for h in run["history"]], [h["val_loss"] for h in run["history"]], label=name)
    axes[0].axhline(1.0, color="grey", linestyle=":", linewidth=1)
    axes[0].set(title="probe: ||ĝ - g|| / ||g|| (1 = sending nothing)", xlabel="step", ylabel="relative error")
    axes[1].set(title="error-feedback residual / gradient (RMS over ranks)", xlabel="step", ylabel="ratio")
    axes[2].set(title="validation loss", xlabel="step", ylabel="cross-entropy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    cfg = runs[0]["config"]
    shared = "" if len({optimizer(r) for r in runs}) > 1 else f"{optimizer(runs[0])}, "
    fig.suptitle(f"{cfg['model']['parameters'] / 1e6:.1f}M-parameter LM on the standard library's source, "
                 f"{cfg['ranks']} ranks, {shared}a probe every "
                 f"{runs[0]['probes'][1]['step'] - runs[0]['probes'][0]['step']} steps")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def table(runs):
    lines = ["| method | probes | relative error: first, median, last | cosine: median | residual / gradient: "
             "first, median, largest, last | val loss at the end |", "|---|---:|---|---:|---|---:|"]
    for run in runs:
        probes = run["probes"]
        errs = sorted(p["probe_rel_error"] for p in probes)
        cos = sorted(p["probe_cosine"] for p in probes)
        ratio = [p["residual_ratio"] for p in probes]
        middle = sorted(ratio)[len(ratio) // 2] if ratio[0] is not None else None
        res = "–" if ratio[0] is None else f"{ratio[0]:.2f}, {middle:.2f}, {max(ratio):.2f}, {ratio[-1]:.2f}"
        lines.append(f"| {label(run, runs, code=True)} | {len(probes)} | {probes[0]['probe_rel_error']:.3f}, "
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
