"""The README's table from the JSON files under this folder (run from the repository root:
``.venv/bin/python benchmarks/reference/ttq-gap-2026-12-01/table.py``)."""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def at(data, step):
    for row in data["history"]:
        if row["step"] == step:
            return row["val_loss"]
    return float("nan")


runs = []
for path in sorted(HERE.glob("*/2x1-loopback/*.json")):
    d = json.loads(path.read_text())
    c = d["config"]
    runs.append((path.parent.parent.name, c["method"], c.get("method_options", {}), c.get("base_optimizer", "adam"),
                 c["lr"], d))
# A diagnostic base optimizer ("module:factory") is compared with Adam's fp32 run.
def diagnostic(base):
    return isinstance(base, str) and ":" in base


runs = [(cfg, m, o, "adam" if diagnostic(base) and m != "horovod_fp32" else base, lr, d)
        for cfg, m, o, base, lr, d in runs]
twins = {(cfg, str(base), lr): d for cfg, m, _, base, lr, d in runs if m == "horovod_fp32" and not diagnostic(base)}
twins_by_opt = {}
for (cfg, base, lr), d in twins.items():
    twins_by_opt.setdefault((base, lr), d)
print("| config | method | options | base optimizer | lr | val@100 | val@200 | fp32 twin @100 | @200 | gap @100 | gap @200 | MB/step/rank |")
print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for cfg, m, opts, base, lr, d in runs:
    key = "adam" if diagnostic(base) else str(base)
    # No fp32 run at this lr (the lr sweep): compared with fp32 at the benchmark's 1e-3.
    twin = twins.get((cfg, key, lr)) or twins_by_opt.get((key, lr)) or twins_by_opt.get((key, 1e-3))
    v1, v2 = at(d, 100), at(d, 200)
    if d["status"] == "diverged":
        last = d["history"][-1]
        print(f"| {cfg} | {m} | defaults | {base} | {lr:g} | diverged at step {last['step']} "
              f"(val {last['val_loss']:.1f}) | | | | | | |")
        continue
    t1, t2 = (at(twin, 100), at(twin, 200)) if twin else (float("nan"),) * 2
    g1, g2 = 100 * (v1 / t1 - 1), 100 * (v2 / t2 - 1)
    o = ", ".join(f"{k}={v}" for k, v in opts.items()) or "defaults"
    print(f"| {cfg} | {m} | {o} | {base} | {lr:g} | {v1:.4f} | {v2:.4f} | {t1:.4f} | {t2:.4f} | {g1:+.1f}% | {g2:+.1f}% | "
          f"{d.get('bytes_per_step', float('nan')) / 1e6:.3f} |")
