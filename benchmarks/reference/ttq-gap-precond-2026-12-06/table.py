"""The README's table from the JSON files under this folder, each variant against Horovod
fp32 with Adam of the 5e-4 matrix (same model, data, seed and schedule). Run from the
repository root: ``.venv/bin/python benchmarks/reference/ttq-gap-precond-2026-12-06/table.py``."""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
MATRIX = HERE.parent / "ttq-5e-4-2026-12-03" / "loss" / "2x1-loopback"


def at(data, step):
    return next((row["val_loss"] for row in data["history"] if row["step"] == step), float("nan"))


def tail(data):
    """The mean of the last four evaluations (steps 325-400): one evaluation moves by up to
    3% from the next on these curves, so single points rank close variants by chance."""
    return sum(at(data, s) for s in (325, 350, 375, 400)) / 4


fp32 = json.loads((MATRIX / "horovod_fp32_s0_constant.json").read_text())
rows = [(f"{m} (the 5e-4 matrix)", json.loads((MATRIX / f"{m}_s0_constant.json").read_text()))
        for m in ("ef_sign", "marsit", "cascading_sign", "onebit")]
for path in sorted(HERE.glob("*/2x1-loopback/*_s0_constant.json")):
    rows.append((path.parent.parent.name, json.loads(path.read_text())))

print("| variant (folder) | val@200 | gap @200 | val@400 | gap @400 | mean 325-400 | gap | MB/step/rank |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
print(f"| Horovod fp32 | {at(fp32, 200):.4f} | | {at(fp32, 400):.4f} | | {tail(fp32):.4f} | | "
      f"{fp32['bytes_per_step'] / 1e6:.3f} |")
for name, d in rows:
    v2, v4 = at(d, 200), at(d, 400)
    print(f"| {name} | {v2:.4f} | {100 * (v2 / at(fp32, 200) - 1):+.1f}% | {v4:.4f} | "
          f"{100 * (v4 / at(fp32, 400) - 1):+.1f}% | {tail(d):.4f} | {100 * (tail(d) / tail(fp32) - 1):+.1f}% | "
          f"{d['bytes_per_step'] / 1e6:.3f} |")
