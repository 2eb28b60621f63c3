"""The page's table for this folder (docs/benchmarks/time-to-quality.md): each method's loss
at step 400 against Horovod fp32's, and per link rate its time per step and time to fp32's
final loss in both timing rounds, each against that round's Horovod fp32.
Usage: .venv/bin/python table.py FOLDER  (FOLDER holds round1/ and round2/)"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import time_to_quality as T

NAMES = {"horovod_fp32": "Horovod fp32", "horovod_fp16": "Horovod fp16", "auto": "`auto` (whole run)"}
RATES = ("2x1-1gbit", "2x1-100mbit")


def rounds(folder):
    out = []
    for name in ("round1", "round2"):
        groups = T.group_runs(T.load_runs(folder / name))
        out.append({s: groups.get((s, "constant", 0), {}) for s in RATES})
    return out


def cells(run, fp32):
    """ms per step over the run and time to fp32's final loss (speed-up), as text."""
    steps = run.get("steps_done") or run["history"][-1]["step"]
    ms = 1e3 * run["history"][-1]["train_time_s"] / steps
    t = T.time_to_reach(run, fp32["history"][-1]["val_loss"])
    speedup = "not reached" if t is None else f"{t:,.0f} s ({fp32['history'][-1]['train_time_s'] / t:.2f}x)"
    return f"{ms:,.0f}", speedup


def main(folder):
    by_round = rounds(Path(folder))
    fp32 = by_round[0]["2x1-1gbit"]["horovod_fp32"]
    names = T.order(set().union(*(set(r[s]) for r in by_round for s in RATES)))
    print("| method | loss at step 400 | vs fp32 | MB/step/rank | " + " | ".join(
        f"{s.split('-')[1]}: ms/step, round 1 / 2 | time to fp32's loss, round 1 / 2" for s in RATES) + " |")
    print("|---|---:|---:|---:|" + "---:|---:|" * len(RATES))
    for name in names:
        first = next(r[s][name] for r in by_round for s in RATES if name in r[s])
        last, steps = first["history"][-1], first.get("steps_done") or first["history"][-1]["step"]
        loss, ref = T.loss_at(first, 400), fp32["history"][-1]["val_loss"]
        if loss is None:  # not run to step 400 (stopped, or still running)
            print(f"| {NAMES.get(name, f'`{name}`')} | {first.get('status', 'unfinished')} |")
            continue
        row = [NAMES.get(name, f"`{name}`"), f"{loss:.4f}", f"{100 * (loss - ref) / ref:+.1f}%",
               f"{last['bytes_sent'] / steps / 1e6:.2f}"]
        for s in RATES:
            got = [cells(r[s][name], r[s]["horovod_fp32"]) if name in r[s] else ("–", "–") for r in by_round]
            row += [" / ".join(g[0] for g in got), " / ".join(g[1] for g in got)]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
