"""The README's cluster tables from the JSON files under this folder: global_qsgd(block=512)
with the fused kernels for a scale per block, beside Horovod fp32 and the one-scale
global_qsgd (block=None) timed in the same session. Run from the repository root:
``.venv/bin/python benchmarks/reference/global-qsgd-block-kernels-2026-12-06/table.py``."""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REF = HERE.parent
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/: the benchmark's own helpers
from time_to_quality import loss_at, seconds_per_kind, time_to_reach  # noqa: E402

FP32_2 = REF / "ttq-5e-4-2026-12-03" / "loss" / "2x1-loopback" / "horovod_fp32_s0_constant.json"
FP32_8 = REF / "ttq-8hosts-2026-12-03" / "8x1-1gbit" / "horovod_fp32_s0_constant.json"


def load(path):
    return json.loads(Path(path).read_text())


def steady_ms(timing_run):
    (pair,) = seconds_per_kind(timing_run["time_by_kind"]).values()
    return 1e3 * pair[0]


def times(curve, fp32_timing, fp32_curve, steps):
    """Cells: the combined curve's training time to fp32's loss at each of ``steps``, and the
    speed-up against fp32's steady step of the same session (its first step's excess once)."""
    (per_step, excess), = seconds_per_kind(fp32_timing["time_by_kind"]).values()
    cells = []
    for step in steps:
        tf, tq = step * per_step + excess, time_to_reach(curve, loss_at(fp32_curve, step))
        cells.append(f"{tq:.0f} s (**{tf / tq:.2f}x**; fp32 {tf:.0f} s)" if tq else f"not reached (fp32 {tf:.0f} s)")
    return cells


print("2 hosts, seed 0: 25 steps each, two rounds taking turns (steady ms per step), and the time to "
      "fp32's losses at steps 300 and 200 (fp32's curve of seed 0 on loopback, at its step time of the round)\n")
print("| setting | round | fp32 | one scale | a scale per 512 | combined bit for bit | to fp32's loss at step 300 "
      "| at 200 |")
print("|---|---:|---:|---:|---:|---|---:|---:|")
fp_curve = load(FP32_2)
for setting in ("2x1-1gbit", "2x1-100mbit"):
    for base in sorted(HERE.glob("round*")):
        t = base / "one_scale_and_fp32" / "timing" / setting
        fp_t, one_t = load(t / "horovod_fp32_s0_constant.json"), load(t / "global_qsgd_s0_constant.json")
        blk_t = load(base / "block512" / "timing" / setting / "global_qsgd_s0_constant.json")
        blk = load(base / "block512" / setting / "global_qsgd_s0_constant.json")
        print(f"| {setting} | {base.name[-1]} | " + " | ".join(f"{steady_ms(r):,.0f}" for r in (fp_t, one_t, blk_t))
              + f" | {'yes' if blk['status'] == 'complete' else blk['status']} | "
              + " | ".join(times(blk, fp_t, fp_curve, (300, 200))) + " |")

for E in (HERE / "8hosts", HERE / "8hosts-round2"):
    print(f"\n8 hosts at 1 Gbit/s, seed 0 ({E.name}): 25 steps each in one session, and the time to fp32's "
          "losses (fp32's curve of the cluster run, at its step time of this session)\n")
    anchor = load(E / "fp32" / "8x1-1gbit" / "horovod_fp32_s0_constant.json")
    one_t = load(E / "one_scale" / "timing" / "8x1-1gbit" / "global_qsgd_s0_constant.json")
    blk_t = load(E / "block512" / "timing" / "8x1-1gbit" / "global_qsgd_s0_constant.json")
    blk = load(E / "block512" / "8x1-1gbit" / "global_qsgd_s0_constant.json")
    base = steady_ms(anchor)
    print("| | ms/step | vs fp32's step | to fp32's loss at step 200 | at its step 150 | at its step 100 |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| Horovod fp32 | {base:,.0f} | 1.00x | | | |")
    print(f"| `global_qsgd(block=None)` (one scale) | {steady_ms(one_t):,.0f} | {base / steady_ms(one_t):.2f}x | | | |")
    print(f"| `global_qsgd` (a scale per 512) | {steady_ms(blk_t):,.0f} | {base / steady_ms(blk_t):.2f}x | "
          + " | ".join(times(blk, anchor, load(FP32_8), (200, 150, 100))) + " |")
