"""The page's 8-host table (docs/benchmarks/time-to-quality.md): the harness's columns and the
time to fp32's loss at earlier evaluations (steps 150 and 100), from this folder's runs.
Usage: page_table.py FOLDER"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import time_to_quality as T

EARLIER = (150, 100)  # fp32's evaluations whose losses are the secondary targets
by = T.group_runs(T.load_runs(Path(sys.argv[1])))[("8x1-1gbit", "constant", 0)]
twin = T.twin_of(None, by)
final = twin["history"][-1]
targets = {"final": final["val_loss"], **{s: T.loss_at(twin, s) for s in EARLIER}}
print("| method | loss at step 200 | vs fp32 | MB/step/rank | rounds | ms/step | "
      + " | ".join(f"time to fp32's loss at {k} ({v:.4f})" for k, v in targets.items()) + " |")
print("|---|" + "---:|" * (5 + len(targets)))
for name in T.order(by):
    r = by[name]
    cells = []
    for target in targets.values():
        t, base = T.time_to_reach(r, target), T.time_to_reach(twin, target)
        cells.append("not reached" if t is None else f"{t:.0f} s ({base / t:.2f}x)")
    loss = r["history"][-1]["val_loss"]
    print(f"| {name} | {loss:.4f} | {100 * (loss / final['val_loss'] - 1):+.1f}% | {r['bytes_per_step'] / 1e6:.2f} "
          f"| {r['comm_rounds']} | {1e3 * r['step_time_s']:,.0f} | " + " | ".join(cells) + " |")
