"""The tables of this folder's README and of the time-to-quality page's 8-host BinSGDM rows:
BinSGDM at its default beta since 2026-12-06 (0.8) against 0.9 and Horovod fp32, 8 hosts at
1 Gbit/s, 200 steps, seed 0, at a constant rate and under the warm-up schedule.
Usage: tables.py [FIGURE_200.png FIGURE_400.png] (from anywhere; it reads this folder and
../ttq-8hosts-2026-12-03/, and draws the curves of 200 and of 400 steps into the figures)."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/
import time_to_quality as T

EARLIER = {200: 150, 400: 300}  # by run length, fp32's evaluation whose loss is the secondary target


def runs(folder, setting="8x1-1gbit"):
    """``{(schedule, method): run}`` of ``folder``'s combined or whole runs at ``setting``."""
    return {(s, m): r for (st, s, _), by in T.group_runs(T.load_runs(folder)).items() if st == setting
            for m, r in by.items()}


def row(name, run, fp32, fp32_ms):
    """A table row: ``run`` against ``fp32``'s curve, fp32's times at ``fp32_ms`` per step."""
    final = fp32["history"][-1]["val_loss"]
    loss = run["history"][-1]["val_loss"]
    cells = []
    for target in (final, T.loss_at(fp32, EARLIER[fp32["history"][-1]["step"]])):
        t, base = T.time_to_reach(run, target), steps_to_reach(fp32, target) * fp32_ms / 1e3
        cells.append("not reached" if t is None else f"{t:.0f} s ({base / t:.2f}x)")
    return (f"| {name} | {loss:.4f} | {100 * (loss / final - 1):+.1f}% | {run['bytes_per_step'] / 1e6:.2f} "
            f"| {1e3 * run['step_time_s']:,.0f} | " + " | ".join(cells) + " |")


def steps_to_reach(run, target):
    """The step (linear between evaluations) at which ``run`` first reaches ``target``."""
    steps = {"history": [dict(r, train_time_s=float(r["step"])) for r in run["history"]]}
    return T.time_to_reach(steps, target)


def retimed(run, ms_per_step):
    """``run`` with its training times at ``ms_per_step``."""
    return dict(run, step_time_s=ms_per_step / 1e3,
                history=[dict(r, train_time_s=r["step"] * ms_per_step / 1e3) for r in run["history"]])


def plot(curves, title, path):
    """``curves``: ``[(label, style, run)]``, drawn against training time and against steps,
    from step 50 on (the first evaluations squeeze the end, where the runs part)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for label, style, run in curves:
        hist = [r for r in run["history"] if r["step"] >= 50]
        for ax, x in zip(axes, ("train_time_s", "step")):
            ax.plot([r[x] for r in hist], [r["val_loss"] for r in hist], style, lw=1.8, label=label)
    axes[0].set_xlabel("training time, slowest rank (s)")
    axes[1].set_xlabel("step")
    axes[0].set_ylabel("validation loss (nats per token)")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    now, before = runs(HERE), runs(HERE.parent / "ttq-8hosts-2026-12-03")
    fp32_warmup = now[("warmup", "horovod_fp32")]
    fp32_ms = 1e3 * fp32_warmup["step_time_s"]  # today's fp32 step; the schedule does not change its work
    header = {steps: (f"| run | loss at step {steps} | vs fp32 | MB/step/rank | ms/step | time to fp32's loss "
                      f"| time to fp32's loss at step {earlier} |\n|---|---:|---:|---:|---:|---:|---:|")
              for steps, earlier in EARLIER.items()}
    fp32_before = before[("constant", "horovod_fp32")]
    print(f"Constant rate: fp32's curve of 2026-12-03, its times at today's {fp32_ms:,.0f} ms per step "
          f"(2026-12-03: {1e3 * fp32_before['step_time_s']:,.0f})\n\n{header[200]}")
    print(row("Horovod fp32 (2026-12-03's curve)", retimed(fp32_before, fp32_ms), fp32_before, fp32_ms))
    print(row("BinSGDM, beta 0.9 (2026-12-03) *", before[("constant", "binsgdm")], fp32_before,
              1e3 * fp32_before["step_time_s"]))
    print(row("BinSGDM, beta 0.8", now[("constant", "binsgdm")], fp32_before, fp32_ms))
    print("\n* timed on 2026-12-03: its times are against that day's fp32 step")
    print(f"\nWarm-up schedule (40 steps, then a cosine to a tenth), both today\n\n{header[200]}")
    print(row("Horovod fp32", fp32_warmup, fp32_warmup, fp32_ms))
    print(row("BinSGDM, beta 0.8", now[("warmup", "binsgdm")], fp32_warmup, fp32_ms))
    longer = runs(HERE / "s400")
    fp32_400 = longer[("constant", "horovod_fp32")]
    print(f"\n400 steps (warm-up 80 steps): BinSGDM under the warm-up schedule against fp32 at a constant rate, "
          f"both today\n\n{header[400]}")
    print(row("Horovod fp32, constant", fp32_400, fp32_400, 1e3 * fp32_400["step_time_s"]))
    print(row("BinSGDM, beta 0.8, warm-up", longer[("warmup", "binsgdm")], fp32_400, 1e3 * fp32_400["step_time_s"]))
    if len(sys.argv) > 2:
        plot([("Horovod fp32, constant (2026-12-03's curve at today's step)", "k-", retimed(fp32_before, fp32_ms)),
              ("BinSGDM, constant", "C0-", now[("constant", "binsgdm")]),
              ("Horovod fp32, warm-up", "k--", fp32_warmup),
              ("BinSGDM, warm-up", "C0--", now[("warmup", "binsgdm")])],
             "BinSGDM (beta 0.8) and Horovod fp32, 8 hosts at 1 Gbit/s, 200 steps, seed 0, both schedules",
             sys.argv[1])
        plot([("Horovod fp32, constant", "k-", fp32_400), ("BinSGDM, warm-up", "C0--", longer[("warmup", "binsgdm")])],
             "BinSGDM (beta 0.8, warm-up schedule) and Horovod fp32 (constant), 8 hosts at 1 Gbit/s, 400 steps, seed 0",
             sys.argv[2])


if __name__ == "__main__":
    main()
