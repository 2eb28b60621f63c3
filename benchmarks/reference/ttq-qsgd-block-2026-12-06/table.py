"""The README's tables from the JSON files under this folder, each run against Horovod fp32
and the library's method of the same seed and setting (the 5e-4 matrix, its seeds 2 and 3,
and the 8-host runs). Run from the repository root:
``.venv/bin/python benchmarks/reference/ttq-qsgd-block-2026-12-06/table.py``."""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
REF = HERE.parent
TWO_HOSTS = {0: REF / "ttq-5e-4-2026-12-03" / "loss" / "2x1-loopback",
             2: REF / "ttq-seeds-2026-12-05" / "runs", 3: REF / "ttq-seeds-2026-12-05" / "runs"}
EIGHT_HOSTS_FP32 = REF / "ttq-8hosts-2026-12-03" / "8x1-1gbit" / "horovod_fp32_s0_constant.json"
EIGHT_HOSTS = REF / "ttq-8hosts-2026-12-03" / "loss" / "8x1-loopback"


def load(path):
    return json.loads(Path(path).read_text())


def at(data, step):
    return next((row["val_loss"] for row in data["history"] if row["step"] == step), float("nan"))


def gap(a, b):
    return f"{100 * (a / b - 1):+.1f}%"


print("2 hosts (loopback, 400 steps): validation loss at step 400\n")
print("| seed | Horovod fp32 | `qsgd` | vs fp32 | `qsgd_block512` | vs fp32 | MB/step/rank (`qsgd` / blocks) |")
print("|---:|---:|---:|---:|---:|---:|---|")
gaps = []
for seed, folder in TWO_HOSTS.items():
    fp32 = load(folder / f"horovod_fp32_s{seed}_constant.json")
    qsgd = load(folder / f"qsgd_s{seed}_constant.json")
    block = load(HERE / "qsgd_block512" / "2x1-loopback" / f"qsgd_s{seed}_constant.json")
    f, q, b = (at(d, 400) for d in (fp32, qsgd, block))
    gaps.append((q / f - 1, b / f - 1))
    print(f"| {seed} | {f:.4f} | {q:.4f} | {gap(q, f)} | {b:.4f} | {gap(b, f)} | "
          f"{qsgd['bytes_per_step'] / 1e6:.3f} / {block['bytes_per_step'] / 1e6:.3f} |")
mq, mb = (100 * sum(g[i] for g in gaps) / len(gaps) for i in (0, 1))
print(f"| mean | | | **{mq:+.1f}%** | | **{mb:+.1f}%** | |")

print("\n8 hosts (loopback, 200 steps, seed 0): validation loss at step 200\n")
print("| Horovod fp32 (cluster run) | `global_qsgd` | vs fp32 | `global_qsgd_block512` | vs fp32 |")
print("|---:|---:|---:|---:|---:|")
fp32 = load(EIGHT_HOSTS_FP32)
glob = load(EIGHT_HOSTS / "global_qsgd_s0_constant.json")
path = HERE / "global_qsgd_block512" / "8x1-loopback" / "global_qsgd_s0_constant.json"
if path.exists():
    block = load(path)
    f, g, b = at(fp32, 200), at(glob, 200), at(block, 200)
    print(f"| {f:.4f} | {g:.4f} | {gap(g, f)} | {b:.4f} | {gap(b, f)} |")
