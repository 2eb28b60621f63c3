"""The 8-host rows of this folder (run.sh) against Horovod fp32 of 2026-12-03, whose curve
these runs did not repeat (fp32's sums at 8 ranks: ../ttq-8hosts-2026-12-03/), and beside the
same methods' rows of before (two 25 MB buckets; the folders below).

    python benchmarks/reference/ttq-8hosts-defaults-2026-12-07/table.py   # from the repository's root

fp32's step in this session is the mean of its two 25-step anchors (anchor-before/,
anchor-after/); its time to a loss is its step at which the loss falls (interpolated as the
harness does) times that step, its steps being all of one kind. The methods' times are
their own, from their first 25 steps on the cluster (time_to_quality.py --time-curves), or
from whole runs on the cluster (whole/, where a folder has one).

:func:`main` serves ../ttq-8hosts-defaults-rest-2026-12-07/table.py too."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/
import time_to_quality as T  # noqa: E402

KEY = ("8x1-1gbit", "constant", 0)
EARLIER = (150, 100)  # fp32's evaluations whose losses are the secondary targets
#: Each method's 8-rank curve of before, at the same defaults but for the buckets: (folder
#: under benchmarks/reference/, the setting it ran in).
BEFORE = {"global_qsgd": ("ttq-global-qsgd-block-2026-12-06/loss", "8x1-loopback"),
          "qsgd": ("ttq-qsgd-block-2026-12-06/library/8hosts/loss", "8x1-loopback"),
          "global_qsgd_exp": ("ttq-8hosts-2026-12-03/loss", "8x1-loopback")}


def runs(folder):
    return T.group_runs(T.load_runs(folder)).get(KEY, {})


def main(here, before, png):
    """Print the table and the curves against ``before``'s, and draw ``here/png``."""
    twin = runs(here.parent / "ttq-8hosts-2026-12-03")["horovod_fp32"]
    anchors = [runs(here / a)["horovod_fp32"]["step_time_s"] for a in ("anchor-before", "anchor-after")]
    fp32_step = sum(anchors) / len(anchors)
    final = twin["history"][-1]["val_loss"]
    targets = {"final": final, **{s: T.loss_at(twin, s) for s in EARLIER}}

    def fp32_time(target):
        return T.time_to_reach(twin, target) / twin["step_time_s"] * fp32_step

    print(f"Horovod fp32 ms/step this session: {', '.join(f'{1e3 * a:,.0f}' for a in anchors)} "
          f"(mean {1e3 * fp32_step:,.0f}; 2026-12-03: {1e3 * twin['step_time_s']:,.0f})\n")
    print("| method | loss at step 200 | vs fp32 | MB/step/rank | ms/step | vs fp32's step | "
          + " | ".join(f"time to fp32's loss at {k} ({v:.4f})" for k, v in targets.items()) + " |")
    print("|---|" + "---:|" * (5 + len(targets)))
    shortcut = runs(here)
    by = {**shortcut, **runs(here / "whole")}
    for name, r, step in [("horovod_fp32 (2026-12-03's curve)", twin, fp32_step)] + [
            (n, by[n], by[n]["step_time_s"]) for n in T.order(by)]:
        cells = []
        for target in targets.values():
            t = fp32_time(target) if r is twin else T.time_to_reach(r, target)
            cells.append("not reached" if t is None else f"{t:.0f} s ({fp32_time(target) / t:.2f}x)")
        loss = r["history"][-1]["val_loss"]
        print(f"| {name} | {loss:.4f} | {100 * (loss / final - 1):+.1f}% | {r['bytes_per_step'] / 1e6:.2f} "
              f"| {1e3 * step:,.0f} | {fp32_step / step:.2f}x | " + " | ".join(cells) + " |")

    print("\nThe curves against those of before (validation losses at each evaluation):\n")
    for name in T.order(by):
        now = (here / "loss", "8x1-loopback") if name in shortcut else (here / "whole", "8x1-1gbit")
        folder, setting = before[name]
        for when, (where, ran_in) in (("now", now), ("before", (here.parent / folder, setting))):
            curve = T.load(T.run_path(where, ran_in, name, 0, "constant"))
            if curve:
                print(f"{name:16s} {when:7s}" + " ".join(f"{h['val_loss']:.4f}" for h in curve["history"][1:]))

    fp32_here = {**twin, "history": [{**h, "train_time_s": h["step"] * fp32_step} for h in twin["history"]]}
    print(T.plot(KEY, {"horovod_fp32": fp32_here, **by}, here / png))


if __name__ == "__main__":
    main(HERE, BEFORE, "ttq-8x1-1gbit-defaults-with-fp32.png")
