"""The pairs of pairs.sh: each 1-bit compressor with the default bucket (five of this model)
and with bucket_size_mb=25 (two), 30 steps each, back to back; time per step with each run's
first step left out, and the step's wait for the reduction (sync_s, mean over the run).

    python3 pairs_table.py     # pairs/<setting>/r<round>/<default|mb25>/<setting>/<method>_s0_constant.json
"""
import collections
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
FIRST = {"r1": "default", "r2": "mb25"}  # pairs.sh: round 1 ran the default first, round 2 25 MB first


def steady_and_sync(path):
    d = json.load(open(path))
    kinds = list(d["time_by_kind"].values())
    steady = (sum(k["total_s"] for k in kinds) - kinds[0]["first_s"]) / (d["steps_done"] - 1)
    return 1e3 * steady, 1e3 * (d.get("metrics") or {}).get("sync_s.mean", float("nan"))


runs = collections.defaultdict(dict)
for f in sorted(glob.glob(os.path.join(HERE, "pairs", "*", "r*", "*", "*", "*.json"))):
    setting, rnd, size = f.split(os.sep)[-5:-2]
    runs[(setting, os.path.basename(f).split("_s0")[0])][(rnd, size)] = steady_and_sync(f)
for setting in sorted({s for s, _ in runs}, reverse=True):
    print(f"\n### {setting}\n")
    print("| method | round (first) | default: ms/step | 25 MB: ms/step | default against 25 MB | step waits, default | 25 MB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (s, method), v in sorted(runs.items()):
        if s != setting:
            continue
        for rnd in sorted({r for r, _ in v}):
            if (rnd, "default") not in v or (rnd, "mb25") not in v:
                continue
            (d, dw), (m, mw) = v[(rnd, "default")], v[(rnd, "mb25")]
            print(f"| `{method}` | {rnd} ({FIRST[rnd]}) | {d:,.0f} | {m:,.0f} | {100 * (d - m) / m:+.1f}% | {dw:,.0f} | {mw:,.0f} |")
