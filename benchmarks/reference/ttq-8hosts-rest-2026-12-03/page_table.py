"""The page's table for the 8-host rows this folder adds (docs/benchmarks/time-to-quality.md),
set against Horovod fp32 of the first 8-host run, whose curve this run did not repeat.
Usage: page_table.py FOLDER [TWIN_FOLDER]   (TWIN_FOLDER: default ../ttq-8hosts-2026-12-03)

fp32's step in this session comes from FOLDER/anchor (25 steps on the same cluster); fp32's
time to a loss is then its step at which the loss falls (interpolated as the harness does)
times that step: fp32's step is the same kind throughout, so its time scales with the
machine. The methods' times are this session's own."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import time_to_quality as T

KEY = ("8x1-1gbit", "constant", 0)
EARLIER = (150, 100)  # fp32's evaluations whose losses are the secondary targets
folder = Path(sys.argv[1])
twin_folder = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parent.parent / "ttq-8hosts-2026-12-03"
twin = T.group_runs(T.load_runs(twin_folder))[KEY]["horovod_fp32"]
anchor = T.group_runs(T.load_runs(folder / "anchor"))[KEY]
fp32_step = anchor["horovod_fp32"]["step_time_s"]
by = T.group_runs(T.load_runs(folder))[KEY]
final = twin["history"][-1]
targets = {"final": final["val_loss"], **{s: T.loss_at(twin, s) for s in EARLIER}}


def fp32_time(target):
    """fp32's time to ``target`` at this session's step: its interpolated step times the step."""
    t = T.time_to_reach(twin, target)
    return None if t is None else t / twin["step_time_s"] * fp32_step


print(f"fp32 ms/step: first run {1e3 * twin['step_time_s']:,.0f}, this session {1e3 * fp32_step:,.0f}; "
      f"compute floor this session {1e3 * anchor['local']['step_time_s']:,.0f}" if "local" in anchor else "")
print("| method | loss at step 200 | vs fp32 | MB/step/rank | rounds | ms/step | vs fp32's step | "
      + " | ".join(f"time to fp32's loss at {k} ({v:.4f})" for k, v in targets.items()) + " |")
print("|---|" + "---:|" * (6 + len(targets)))
rows = [("horovod_fp32 (first run; step this session)", twin, fp32_step)] + [
    (name, by[name], by[name]["step_time_s"]) for name in T.order(by)]
for name, r, step in rows:
    cells = []
    for target in targets.values():
        t = fp32_time(target) if r is twin else T.time_to_reach(r, target)
        cells.append("not reached" if t is None else f"{t:.0f} s ({fp32_time(target) / t:.2f}x)")
    hist = [h for h in r["history"] if h["val_loss"] == h["val_loss"]]
    loss = hist[-1]["val_loss"] if hist else float("nan")
    state = "" if r.get("status") == "complete" else f" ({r.get('status')} at step {hist[-1]['step'] if hist else 0})"
    print(f"| {name}{state} | {loss:.4f} | {100 * (loss / final['val_loss'] - 1):+.1f}% | {r['bytes_per_step'] / 1e6:.2f} "
          f"| {r['comm_rounds']} | {1e3 * step:,.0f} | {fp32_step / step:.2f}x | " + " | ".join(cells) + " |")

# The figure: this run's rows with fp32's curve on this session's time (its step times the
# anchor's), drawn by the harness's own plot.
fp32_here = {**twin, "history": [{**h, "train_time_s": h["step"] * fp32_step} for h in twin["history"]]}
print(T.plot(KEY, {"horovod_fp32": fp32_here, **by}, folder / "ttq-8x1-1gbit-rest-with-fp32.png"))
