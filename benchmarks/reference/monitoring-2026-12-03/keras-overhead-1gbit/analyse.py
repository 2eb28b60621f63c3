"""Issue 54 in Keras: what metrics cost, from keras_bench_worker.py's raw JSON. Each row's
mean step (the slowest rank per batch) over the interleaved fp32 baseline's mean in the
same rounds, so that a drift of the machine between rows cancels; the cost of a row with
metrics is its ratio over the ratio of the row without."""
import json, statistics, sys

raw = json.load(open(sys.argv[1]))
ranks = raw["per_rank"]
def slowest(per_rank):
    return [max(col) for col in zip(*per_rank)]
rows = {}
for label in ranks[0]:
    mine = [r[label] for r in ranks]
    t, f = slowest([m["times_s"] for m in mine]), slowest([m["fp32_s"] for m in mine])
    rows[label] = (statistics.mean(t), statistics.median(t), statistics.mean(f), len(t))
base = [l for l in rows if "@" not in l][0]
print(f"| row | steps timed | mean ms | median ms | cost against `{base}`, means | fp32 baseline's mean ms, same rounds | mean / baseline | cost against `{base}`, normalised |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for label, (mean, med, fmean, n) in rows.items():
    ratio = mean / fmean
    cost = ratio / (rows[base][0] / rows[base][2]) - 1
    direct = mean / rows[base][0] - 1
    print(f"| `{label}` | {n} | {1e3*mean:,.0f} | {1e3*med:,.0f} | {100*direct:+.1f}% | {1e3*fmean:,.0f} | {ratio:.3f} | {100*cost:+.1f}% |")
