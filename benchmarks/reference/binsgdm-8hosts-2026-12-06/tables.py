"""The tables of this folder's README and of the time-to-quality page's 8-host BinSGDM rows:
BinSGDM at its default beta since 2026-12-06 (0.8) against 0.9 and Horovod fp32, 8 hosts at
1 Gbit/s, 200 steps, seed 0, at a constant rate and under the warm-up schedule.
Usage: tables.py [FIGURE.png] (from anywhere; it reads this folder and
../ttq-8hosts-2026-12-03/, and draws the four curves against time and steps into FIGURE)."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/
import time_to_quality as T

EARLIER = 150  # fp32's evaluation whose loss is the secondary target, as on the page


def runs(folder, setting="8x1-1gbit"):
    """``{(schedule, method): run}`` of ``folder``'s combined or whole runs at ``setting``."""
    return {(s, m): r for (st, s, _), by in T.group_runs(T.load_runs(folder)).items() if st == setting
            for m, r in by.items()}


def row(name, run, fp32, fp32_ms):
    """A table row: ``run`` against ``fp32``'s curve, fp32's times at ``fp32_ms`` per step."""
    final = fp32["history"][-1]["val_loss"]
    loss = run["history"][-1]["val_loss"]
    cells = []
    for target in (final, T.loss_at(fp32, EARLIER)):
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


def plot(curves, path):
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
    fig.suptitle("BinSGDM (beta 0.8) and Horovod fp32, 8 hosts at 1 Gbit/s, seed 0, both schedules")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    now, before = runs(HERE), runs(HERE.parent / "ttq-8hosts-2026-12-03")
    fp32_warmup = now[("warmup", "horovod_fp32")]
    fp32_ms = 1e3 * fp32_warmup["step_time_s"]  # today's fp32 step; the schedule does not change its work
    header = ("| run | loss at step 200 | vs fp32 | MB/step/rank | ms/step | time to fp32's loss "
              f"| time to fp32's loss at step {EARLIER} |\n|---|---:|---:|---:|---:|---:|---:|")
    fp32 = before[("constant", "horovod_fp32")]
    print(f"Constant rate: fp32's curve of 2026-12-03, its times at today's {fp32_ms:,.0f} ms per step "
          f"(2026-12-03: {1e3 * fp32['step_time_s']:,.0f})\n\n{header}")
    print(row("Horovod fp32 (2026-12-03's curve)", retimed(fp32, fp32_ms), fp32, fp32_ms))
    print(row("BinSGDM, beta 0.9 (2026-12-03) *", before[("constant", "binsgdm")], fp32, 1e3 * fp32["step_time_s"]))
    print(row("BinSGDM, beta 0.8", now[("constant", "binsgdm")], fp32, fp32_ms))
    print("\n* timed on 2026-12-03: its times are against that day's fp32 step")
    print(f"\nWarm-up schedule (40 steps, then a cosine to a tenth), both today\n\n{header}")
    print(row("Horovod fp32", fp32_warmup, fp32_warmup, fp32_ms))
    print(row("BinSGDM, beta 0.8", now[("warmup", "binsgdm")], fp32_warmup, fp32_ms))
    if len(sys.argv) > 1:
        plot([("Horovod fp32, constant (2026-12-03's curve at today's step)", "k-", retimed(fp32, fp32_ms)),
              ("BinSGDM, constant", "C0-", now[("constant", "binsgdm")]),
              ("Horovod fp32, warm-up", "k--", fp32_warmup),
              ("BinSGDM, warm-up", "C0--", now[("warmup", "binsgdm")])], sys.argv[1])


if __name__ == "__main__":
    main()
