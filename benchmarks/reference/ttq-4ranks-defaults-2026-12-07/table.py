"""Marsit against cascading_sign at 4 ranks (run.sh), beside Horovod fp32: the curves at the
defaults of 2026-12-07 against those of ../ttq-4ranks-2026-12-03/ (two 25 MB buckets), and
the time each takes on 4 emulated hosts at 1 Gbit/s to reach fp32's losses.

    python benchmarks/reference/ttq-4ranks-defaults-2026-12-07/table.py   # from the repository's root

Every curve is its loopback run's (loss/); its times are its first steps timed on the cluster
(time_to_quality.py --time-curves, 4x1-1gbit/), fp32's included, one job after the other."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/
import time_to_quality as T  # noqa: E402

KEY = ("4x1-1gbit", "constant", 0)
BEFORE = HERE.parent / "ttq-4ranks-2026-12-03" / "4x1-loopback"
FP32_STEPS = (400, 300, 200, 100)  # fp32's evaluations whose losses are the targets


def main():
    timed = T.group_runs(T.load_runs(HERE)).get(KEY, {})
    twin = timed["horovod_fp32"]
    final = twin["history"][-1]["val_loss"]
    print("Validation loss at steps 100, 200, 300 and 400, now and with the two 25 MB buckets of "
          "2026-12-03:\n")
    for name in T.order(timed):
        for when, folder in (("now", HERE / "loss" / "4x1-loopback"), ("before", BEFORE)):
            run = T.load(folder / f"{name}_s0_constant.json")
            losses = [T.loss_at(run, s) for s in (100, 200, 300, 400)]
            print(f"{name:15s} {when:7s}" + " ".join(f"{v:.4f}" for v in losses)
                  + f"   {100 * (losses[-1] / final - 1):+.1f}% vs fp32")

    targets = {s: T.loss_at(twin, s) for s in FP32_STEPS}
    print("\n| method | loss at 400 | vs fp32 | MB/step/rank | ms/step | vs fp32's step | "
          + " | ".join(f"to fp32's loss at {s} ({v:.4f})" for s, v in targets.items()) + " |")
    print("|---|" + "---:|" * (5 + len(targets)))
    fp32_step = twin["step_time_s"]
    for name in T.order(timed):
        run = timed[name]
        cells = []
        for target in targets.values():
            t, fp32_t = T.time_to_reach(run, target), T.time_to_reach(twin, target)
            cells.append("not reached" if t is None else f"{t:.0f} s ({fp32_t / t:.2f}x)")
        loss = run["history"][-1]["val_loss"]
        print(f"| {name} | {loss:.4f} | {100 * (loss / final - 1):+.1f}% | {run['bytes_per_step'] / 1e6:.2f} "
              f"| {1e3 * run['step_time_s']:,.0f} | {fp32_step / run['step_time_s']:.2f}x | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
