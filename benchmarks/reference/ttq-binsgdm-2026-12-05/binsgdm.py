"""BinSGDM's gap to Adam, taken apart (issue 51): the tables of README.md and the figure
docs/assets/ttq-binsgdm-gap.png. Losses on loopback, 2 ranks, 400 steps, lr 5e-4.

    .venv/bin/python benchmarks/reference/ttq-binsgdm-2026-12-05/binsgdm.py
"""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
REF = HERE.parent
ROOT = HERE.parents[2]
RUNS = HERE / "runs"
EARLIER = [REF / "ttq-seeds-2026-12-05" / "runs", REF / "ttq-5e-4-2026-12-03" / "loss" / "2x1-loopback",
           REF / "ttq-lr-2026-12-03" / "seed1" / "lr5e-4"]
#: The rows of the seed-2 and seed-0 ablation: (label, folder under runs/ or None, method).
ABLATION = [
    ("Adam (Horovod fp32)", None, "horovod_fp32"),
    ("BinSGDM (default: beta 0.9)", None, "binsgdm"),
    ("BinSGDM, beta 0.8", "beta0.8", "binsgdm"),
    ("BinSGDM, beta 0.95", "beta0.95", "binsgdm"),
    ("BinSGDM, beta 0.99", "beta0.99", "binsgdm"),
    ("BinSGDM's rule without bits (m / b of the mean gradient)", "nobits", "horovod_fp32"),
    ("the same, b over Adam's memory (beta_b 0.999)", "nobits-longb", "horovod_fp32"),
]


def run(folder, method, seed, schedule):
    """The recorded run, from runs/<folder>/ or, for the defaults, the earlier folders."""
    places = ([RUNS / folder / "2x1-loopback"] if folder
              else [RUNS / "warmup" / "2x1-loopback"] * (schedule == "warmup") + EARLIER)
    for place in places:
        path = place / f"{method}_s{seed}_{schedule}.json"
        if path.exists():
            data = json.loads(path.read_text())
            assert data["config"]["lr"] == 5e-4 and data["config"]["steps"] == 400, path
            return data if data["status"] == "complete" else None
    return None


def final(data):
    return data["history"][-1]["val_loss"] if data else None


def cell(loss, twin):
    if loss is None:
        return "–"
    return f"{loss:.4f}" if twin is None else f"{loss:.4f} ({100 * (loss / twin - 1):+.1f}%)"


def schedules_table():
    lines = ["| seed | Adam, constant | BinSGDM, constant | Adam, warm-up | BinSGDM, warm-up |", "|---|---:|---:|---:|---:|"]
    gaps = {"constant": [], "warmup": []}
    for seed in range(4):
        row = []
        for schedule in ("constant", "warmup"):
            twin, ours = final(run(None, "horovod_fp32", seed, schedule)), final(run(None, "binsgdm", seed, schedule))
            row += [cell(twin, None), cell(ours, twin)]
            if twin and ours:
                gaps[schedule].append(100 * (ours / twin - 1))
        lines.append(f"| {seed} | " + " | ".join(row) + " |")
    means = [f"{statistics.mean(g):+.1f}%" if g else "–" for g in gaps.values()]
    lines.append(f"| mean gap | | **{means[0]}** | | **{means[1]}** |")
    return "\n".join(lines)


def beta_table():
    """BinSGDM at beta 0.8 on every seed at a constant lr, and under the warm-up schedule."""
    lines = ["| seed | Adam, constant | BinSGDM beta 0.9 (default) | BinSGDM beta 0.8 | Adam, warm-up | "
             "BinSGDM beta 0.9, warm-up | BinSGDM beta 0.8, warm-up |", "|---|---:|---:|---:|---:|---:|---:|"]
    gaps = [[] for _ in range(4)]  # (default, 0.8) x (constant, warm-up), over the seeds run
    for seed in range(4):
        row = []
        for k, schedule in enumerate(("constant", "warmup")):
            twin = final(run(None, "horovod_fp32", seed, schedule))
            folder = "beta0.8" if schedule == "constant" else "beta0.8-warmup"
            default, lower = final(run(None, "binsgdm", seed, schedule)), final(run(folder, "binsgdm", seed, schedule))
            row += [cell(twin, None), cell(default, twin), cell(lower, twin)]
            for j, loss in enumerate((default, lower)):
                if loss and twin:
                    gaps[2 * k + j].append(100 * (loss / twin - 1))
        lines.append(f"| {seed} | " + " | ".join(row) + " |")
    means = [f"{statistics.mean(g):+.1f}% ({len(g)})" if g else "–" for g in gaps]
    lines.append(f"| mean gap (seeds) | | {means[0]} | {means[1]} | | {means[2]} | {means[3]} |")
    return "\n".join(lines)


def ablation_table():
    lines = ["| run | seed 2 | seed 0 |", "|---|---:|---:|"]
    for label, folder, method in ABLATION:
        cells = []
        for seed in (2, 0):
            twin = final(run(None, "horovod_fp32", seed, "constant"))
            loss = final(run(folder, method, seed, "constant"))
            cells.append(cell(loss, None if (folder is None and method == "horovod_fp32") else twin))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6))
    colours = ["black", "tab:blue", "tab:green", "tab:cyan", "tab:purple", "tab:red", "tab:orange"]
    for (label, folder, method), colour in zip(ABLATION, colours):
        data = run(folder, method, 2, "constant")
        if data:
            hist = data["history"][1:]
            left.plot([h["step"] for h in hist], [h["val_loss"] for h in hist], color=colour, label=label,
                      linestyle="--" if folder and "nobits" in folder else "-")
    left.set(title="seed 2, constant lr 5e-4", xlabel="step", ylabel="validation loss (nats per token)", ylim=(3.0, 4.6))
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for seed, colour in zip(range(4), colours):
        for method, style in (("horovod_fp32", "-"), ("binsgdm", "--")):
            data = run(None, method, seed, "warmup")
            if data:
                hist = data["history"][1:]
                right.plot([h["step"] for h in hist], [h["val_loss"] for h in hist], style, color=colour,
                           label=f"{'Adam' if method == 'horovod_fp32' else 'BinSGDM'}, seed {seed}")
    right.set(title="warm-up (80 steps) and cosine decay to a tenth, peak 5e-4", xlabel="step", ylim=(3.0, 4.6))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("BinSGDM against Adam: 7.4M-parameter LM on the standard library's source, 2 ranks")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    print("Schedules, seeds 0 to 3 (each against Adam of its seed and schedule):\n")
    print(schedules_table())
    print("\nThe ablation at a constant lr (each against Adam of its seed):\n")
    print(ablation_table())
    print("\nBeta 0.8 on every seed (each against Adam of its seed and schedule):\n")
    print(beta_table())
    figure(ROOT / "docs" / "assets" / "ttq-binsgdm-gap.png")


if __name__ == "__main__":
    main()
