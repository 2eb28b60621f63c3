"""The README's tables from the JSON files under this folder, each run against Horovod fp32
and the library's method of the same seed and setting (the 5e-4 matrix, its seeds 2 and 3,
and the 8-host runs). Run from the repository root:
``.venv/bin/python benchmarks/reference/ttq-qsgd-block-2026-12-06/table.py``."""
import json
import sys
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

# --- The library's qsgd with a norm per 512 elements (its default since 2026-12-06) -------------
LIB = HERE / "library"
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/: the benchmark's own time_to_reach
from time_to_quality import time_to_reach  # noqa: E402


def steady_ms(timing_json):
    """Mean ms per step of a timing run's one kind of step, its first step left out."""
    (t,) = timing_json["time_by_kind"].values()
    return 1000 * (t["total_s"] - t["first_s"]) / (t["steps"] - 1)


def fp32_time(timing_json, steps):
    """fp32's training time to its final loss: its steps at the steady time, plus its first
    step's excess once (as time_to_quality.combine charges it)."""
    (t,) = timing_json["time_by_kind"].values()
    steady = (t["total_s"] - t["first_s"]) / (t["steps"] - 1)
    return steps * steady + (t["first_s"] - steady)


print("\nThe library's `qsgd` (block=512), 2 hosts (loopback, 400 steps): validation loss at step 400\n")
print("| seed | Horovod fp32 | `qsgd(block=None)` | vs fp32 | `qsgd` (block=512) | vs fp32 | worst gap at an evaluation |")
print("|---:|---:|---:|---:|---:|---:|---:|")
gaps = []
for seed, folder in TWO_HOSTS.items():
    fp32 = load(folder / f"horovod_fp32_s{seed}_constant.json")
    one = load(folder / f"qsgd_s{seed}_constant.json")
    lib = load(LIB / "loss" / "2x1-loopback" / f"qsgd_s{seed}_constant.json")
    f, o, b = (at(d, 400) for d in (fp32, one, lib))
    worst = max((at(lib, r["step"]) / r["val_loss"] - 1 for r in fp32["history"] if r["step"] > 0),
                key=abs)
    gaps.append(b / f - 1)
    print(f"| {seed} | {f:.4f} | {o:.4f} | {gap(o, f)} | {b:.4f} | {gap(b, f)} | {100 * worst:+.1f}% |")
print(f"| mean | | | | | **{100 * sum(gaps) / len(gaps):+.1f}%** | |")

print("\nTimed on the cluster, seed 0 (25 steps each, two rounds; ms per step, and the training time "
      "to fp32's final loss)\n")
print("| setting | round | fp32 ms | `qsgd(block=None)` ms | `qsgd` ms | fp32 to its loss | `qsgd` to it | speed-up |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
target = at(load(TWO_HOSTS[0] / "horovod_fp32_s0_constant.json"), 400)
for setting in ("2x1-1gbit", "2x1-100mbit"):
    for r in (1, 2):
        base = LIB / f"timing-round{r}"
        fp = load(base / "one_norm_and_fp32" / "timing" / setting / "horovod_fp32_s0_constant.json")
        one = load(base / "one_norm_and_fp32" / "timing" / setting / "qsgd_s0_constant.json")
        blk_t = load(base / "block512" / "timing" / setting / "qsgd_s0_constant.json")
        blk = load(base / "block512" / setting / "qsgd_s0_constant.json")  # curve on the cluster's time
        tf, tq = fp32_time(fp, 400), time_to_reach(blk, target)
        print(f"| {setting} | {r} | {steady_ms(fp):,.0f} | {steady_ms(one):,.0f} | {steady_ms(blk_t):,.0f} | "
              f"{tf:.0f} s | {tq:.0f} s | {tf / tq:.2f}x |")

print("\n8 hosts at 1 Gbit/s, seed 0, 200 steps: `qsgd` at block=512 (loss from loopback, 25 steps timed), "
      "against fp32's curve of the cluster run and fp32's step timed in the same session\n")
print("| | loss at step 200 | vs fp32 | MB/step/rank | ms/step | vs fp32's step | to fp32's loss at step 200 | "
      "at its step 150 | at its step 100 |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
fp_curve = load(EIGHT_HOSTS_FP32)
anchor = load(LIB / "8hosts" / "anchor" / "8x1-1gbit" / "horovod_fp32_s0_constant.json")
q_t = load(LIB / "8hosts" / "timing" / "8x1-1gbit" / "qsgd_s0_constant.json")
q = load(LIB / "8hosts" / "8x1-1gbit" / "qsgd_s0_constant.json")
cells = []
for step in (200, 150, 100):
    tf, tq = fp32_time(anchor, step), time_to_reach(q, at(fp_curve, step))
    cells.append(f"{tq:.0f} s ({tf / tq:.2f}x; fp32 {tf:.0f} s)" if tq else f"not reached (fp32 {tf:.0f} s)")
f, b = at(fp_curve, 200), at(q, 200)
print(f"| `qsgd` | {b:.4f} | {gap(b, f)} | {q['bytes_per_step'] / 1e6:.2f} | {steady_ms(q_t):,.0f} | "
      f"{steady_ms(anchor) / steady_ms(q_t):.2f}x | " + " | ".join(cells) + " |")
print(f"\nfp32 in this session: {steady_ms(anchor):,.0f} ms per step (25 steps)")
