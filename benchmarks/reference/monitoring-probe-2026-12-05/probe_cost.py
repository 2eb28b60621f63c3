"""Issue 54: what a probe step costs in Keras (``python probe_cost.py RESULT.json...``).

Per row the mean and median step, the cost against metrics off normalised by the
interleaved fp32 baseline, and the probe steps' excess over the row's
median (the probe steps are the slowest; a row with a probe every N steps of T timed
holds T / N of them)."""
import json
import statistics
import sys


def rows(path):
    data = json.load(open(path))
    per_rank = data["per_rank"]
    out = {}
    for label in per_rank[0]:
        # the slower rank's step (the ranks wait for each other; take the max per step)
        times = [max(r[label]["times_s"][i] for r in per_rank) for i in range(len(per_rank[0][label]["times_s"]))]
        fp32 = [max(r[label]["fp32_s"][i] for r in per_rank) for i in range(len(per_rank[0][label]["fp32_s"]))]
        out[label] = (times, fp32, per_rank[0][label]["loss"])
    return out


def report(path):
    r = rows(path)
    base_t, base_f, _ = r["ef_sign"]
    base = statistics.mean(base_t) / statistics.mean(base_f)
    print(f"\n{path}\n| row | steps | mean ms | median ms | fp32 mean ms | cost, normalised | probe steps | their mean excess over the median, ms | loss, train / held-out |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for label, (t, f, loss) in r.items():
        cost = (statistics.mean(t) / statistics.mean(f)) / base - 1
        every = int(label.split("@probe")[1]) if "@probe" in label else 0
        k = len(t) // every if every else 0
        med = statistics.median(t)
        excess = statistics.mean(sorted(t)[-k:]) - med if k else float("nan")
        print(f"| `{label}` | {len(t)} | {1e3 * statistics.mean(t):,.0f} | {1e3 * med:,.0f} | "
              f"{1e3 * statistics.mean(f):,.0f} | {100 * cost:+.1f}% | {k or '-'} | "
              f"{'-' if not k else f'{1e3 * excess:,.0f}'} | {loss['train_loss']:.4f} / {loss['val_loss']:.4f} |")


for p in sys.argv[1:]:
    report(p)
