"""Seed 1 at 8 hosts (run.sh): fp32 and global_qsgd's losses on loopback and fp16's whole run on
the cluster, set against seed 0's (../ttq-8hosts-2026-12-03/ for fp32,
../ttq-8hosts-defaults-2026-12-07/ for global_qsgd, ../ttq-8hosts-defaults-rest-2026-12-07/ for fp16), and
global_qsgd's and fp16's times to fp32's losses on the cluster.

    python benchmarks/reference/ttq-8hosts-seed1-2026-12-07/table.py   # from the repository's root

fp32's step, set beside each method, is the mean of the two 25-step anchors timed on the
cluster right before and after that method (TIMED); its time to a loss is its step at which
the loss falls on its loopback curve (interpolated as the harness does) times that step. global_qsgd's times are its own, from its first 25 steps on the cluster
(time_to_quality.py --time-curves, 8x1-1gbit/); fp16's from its whole run there (whole/).

:func:`main` serves ../ttq-8hosts-seed1-rest-2026-12-07/table.py too."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/
import time_to_quality as T  # noqa: E402

EARLIER = (150, 100)


def curve(folder, setting, method, seed):
    return T.load(T.run_path(HERE.parent / folder, setting, method, seed, "constant"))


#: (method, seed): (folder under benchmarks/reference/, the setting it ran in), for the curves;
#: each seed's fp32 among them (seed 1's on loopback: every seed-1 method is set against it).
ROWS = {("horovod_fp32", 0): ("ttq-8hosts-2026-12-03", "8x1-1gbit"),
        ("global_qsgd", 0): ("ttq-8hosts-defaults-2026-12-07/loss", "8x1-loopback"),
        ("horovod_fp32", 1): (HERE.name + "/loss", "8x1-loopback"),
        ("global_qsgd", 1): (HERE.name + "/loss", "8x1-loopback"),
        ("fp16", 0): ("ttq-8hosts-defaults-rest-2026-12-07/whole", "8x1-1gbit"),
        ("fp16", 1): (HERE.name + "/whole", "8x1-1gbit")}
#: Each method timed on the cluster: (its folder, the folders of the fp32 anchors timed right
#: before and after it).
TIMED = {"global_qsgd": (HERE, (HERE / "anchor-before", HERE / "anchor-after")),
         "fp16": (HERE / "whole", (HERE / "anchor-after", HERE / "anchor-after-fp16"))}


def fp32_step_between(anchors):
    times = [T.load(T.run_path(a, "8x1-1gbit", "horovod_fp32", 1, "constant"))["step_time_s"] for a in anchors]
    return times, sum(times) / len(times)


def main(rows, timed):
    """Print each (method, seed)'s curve of ``rows`` (which holds each seed's fp32) against its
    seed's fp32, then each method of ``timed`` on the cluster against seed 1's fp32 at the mean
    of its anchors."""
    curves = {key: curve(folder, setting, *key) for key, (folder, setting) in rows.items()}
    print("Validation loss at each evaluation (steps 25 to 200):\n")
    for (name, seed), r in curves.items():
        fp32 = curves[("horovod_fp32", seed)]["history"][-1]["val_loss"]
        final = r["history"][-1]["val_loss"]
        print(f"{name:15s} seed {seed}  " + " ".join(f"{h['val_loss']:.4f}" for h in r["history"][1:])
              + f"   {100 * (final / fp32 - 1):+.2f}% vs fp32")

    twin = curves[("horovod_fp32", 1)]
    targets = {"final": twin["history"][-1]["val_loss"], **{s: T.loss_at(twin, s) for s in EARLIER}}
    for name, (folder, anchors) in timed.items():
        timed_run = T.load(T.run_path(folder, "8x1-1gbit", name, 1, "constant"))
        if timed_run is None:
            continue
        times, fp32_step = fp32_step_between(anchors)
        final = timed_run["history"][-1]["val_loss"]
        print(f"\nOn the cluster, seed 1: {name} ends at {final:.4f} ({100 * (final / targets['final'] - 1):+.2f}% "
              f"vs fp32); Horovod fp32 {', '.join(f'{1e3 * a:,.0f}' for a in times)} ms/step "
              f"(mean {1e3 * fp32_step:,.0f}), {name} {1e3 * timed_run['step_time_s']:,.0f} "
              f"({fp32_step / timed_run['step_time_s']:.2f}x)")
        for label, target in targets.items():
            fp32_t = T.time_to_reach(twin, target) / twin["step_time_s"] * fp32_step
            t = T.time_to_reach(timed_run, target)
            print(f"to fp32's loss at {label} ({target:.4f}): fp32 {fp32_t:.0f} s, {name} "
                  + ("not reached" if t is None else f"{t:.0f} s ({fp32_t / t:.2f}x)"))


if __name__ == "__main__":
    main(ROWS, TIMED)
