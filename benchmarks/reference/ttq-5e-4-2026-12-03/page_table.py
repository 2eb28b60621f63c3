"""The page's tables (docs/benchmarks/time-to-quality.md): both link rates side by side, per
(schedule, seed), from a folder's combined runs. Usage: page_table.py FOLDER"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import time_to_quality as T

out = Path(sys.argv[1])
groups = T.group_runs(T.load_runs(out))
NAMES = {"horovod_fp32": "Horovod fp32", "horovod_fp16": "Horovod fp16", "ddp_fp32": "DDP fp32",
         "ddp_powersgd": "DDP PowerSGD (rank 4)", "onebit_adam": "1-bit Adam", "zero_one_adam": "0/1 Adam",
         "binsgdm": "BinSGDM"}
for schedule in ("constant", "warmup"):
    for seed in (0, 1):
        rates = {s: groups.get((s, schedule, seed), {}) for s in ("2x1-1gbit", "2x1-100mbit")}
        if not any(rates.values()):
            continue
        print(f"\n### {schedule}, seed {seed}\n")
        print("| method | loss at step 400 | vs fp32 | MB/step/rank | rounds | 1 Gbit/s: ms/step | time to fp32's loss "
              "| 100 Mbit/s: ms/step | time to fp32's loss |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        names = T.order(set(rates["2x1-1gbit"]) | set(rates["2x1-100mbit"]))
        for name in names:
            cells, base = [], None
            for s in ("2x1-1gbit", "2x1-100mbit"):
                by = rates[s]
                r, twin = by.get(name), T.twin_of(None, by)
                if r is None or twin is None or r.get("status") == "mismatch":
                    cells.append(("–", "–", r and r.get("status")))
                    continue
                steps = r.get("steps_done") or r["history"][-1]["step"]
                last = r["history"][-1]
                base = base or (r, twin)
                ms = 1e3 * last["train_time_s"] / steps
                t = T.time_to_reach(r, twin["history"][-1]["val_loss"])
                tt = twin["history"][-1]["train_time_s"]
                cells.append((f"{ms:,.0f}", "not reached" if t is None else f"{t:,.0f} s (**{tt / t:.2f}x**)", None))
            if base is None:  # no fp32 run of this seed here (seed 1's is in ../ttq-lr-2026-12-03/)
                r = rates["2x1-1gbit"].get(name) or rates["2x1-100mbit"][name]
                print(f"| {NAMES.get(name, '`' + name + '`')} | {r['history'][-1]['val_loss']:.4f} | no fp32 twin here | "
                      "| | | | | |")
                continue
            r, twin = base
            last, tl = r["history"][-1], twin["history"][-1]["val_loss"]
            steps = r.get("steps_done") or last["step"]
            loss = T.loss_at(r, twin["history"][-1]["step"])
            pct = f"{100 * (loss - tl) / tl:+.1f}%" if loss is not None else "–"
            print(f"| {NAMES.get(name, '`' + name + '`')} | {loss:.4f} | {pct} | {last['bytes_sent'] / steps / 1e6:.2f} | "
                  f"{last.get('comm_rounds')} | {cells[0][0]} | {cells[0][1]} | {cells[1][0]} | {cells[1][1]} |")
