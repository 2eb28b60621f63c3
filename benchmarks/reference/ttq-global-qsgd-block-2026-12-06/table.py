"""The README's tables from the JSON files under this folder: the library's global_qsgd with
one shared scale per 512 elements (block=512) against Horovod fp32 and the one-scale
global_qsgd of the same seed and setting. Run from the repository root:
``.venv/bin/python benchmarks/reference/ttq-global-qsgd-block-2026-12-06/table.py``."""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REF = HERE.parent
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/: the benchmark's own helpers
from time_to_quality import loss_at, seconds_per_kind, time_to_reach  # noqa: E402

TWO_HOSTS = {0: REF / "ttq-5e-4-2026-12-03" / "loss" / "2x1-loopback",
             2: REF / "ttq-seeds-2026-12-05" / "runs", 3: REF / "ttq-seeds-2026-12-05" / "runs"}
EIGHT_FP32 = REF / "ttq-8hosts-2026-12-03" / "8x1-1gbit" / "horovod_fp32_s0_constant.json"
EIGHT_ONE = REF / "ttq-8hosts-2026-12-03" / "loss" / "8x1-loopback" / "global_qsgd_s0_constant.json"
DIAGNOSTIC = REF / "ttq-qsgd-block-2026-12-06" / "global_qsgd_block512" / "8x1-loopback" / "global_qsgd_s0_constant.json"


def load(path):
    return json.loads(Path(path).read_text())


def gap(a, b):
    return f"{100 * (a / b - 1):+.1f}%"


def steady(timing_run):
    """``(seconds per step, first step's excess)`` of a timing run's one kind of step."""
    (pair,) = seconds_per_kind(timing_run["time_by_kind"]).values()
    return pair


def fp32_time(timing_run, steps):
    """fp32's training time to its loss at ``steps``, all of one kind (as the benchmark's
    combine charges it: the steady time per step, and the first step's excess once)."""
    per_step, excess = steady(timing_run)
    return steps * per_step + excess


def times(cluster_curve, fp32_timing, fp32_curve, steps):
    """Cells of the time to fp32's loss at each of ``steps``: ours, and the speed-up."""
    cells = []
    for step in steps:
        tf, tq = fp32_time(fp32_timing, step), time_to_reach(cluster_curve, loss_at(fp32_curve, step))
        cells.append(f"{tq:.0f} s (**{tf / tq:.2f}x**; fp32 {tf:.0f} s)" if tq else f"not reached (fp32 {tf:.0f} s)")
    return cells


print("2 hosts (loopback, 400 steps): validation loss at step 400\n")
print("| seed | Horovod fp32 | `global_qsgd` (one scale) | vs fp32 | `global_qsgd(block=512)` | vs fp32 "
      "| worst gap at an evaluation | MB/step/rank (one scale / blocks) |")
print("|---:|---:|---:|---:|---:|---:|---:|---|")
gaps = []
for seed, folder in TWO_HOSTS.items():
    path = HERE / "loss" / "2x1-loopback" / f"global_qsgd_s{seed}_constant.json"
    if not path.exists() or load(path)["status"] != "complete":
        continue
        fp32, one, blk = (load(p) for p in (folder / f"horovod_fp32_s{seed}_constant.json",
                                            folder / f"global_qsgd_s{seed}_constant.json", path))
        f, o, b = (loss_at(d, 400) for d in (fp32, one, blk))
        worst = max((loss_at(blk, r["step"]) / r["val_loss"] - 1 for r in fp32["history"] if r["step"] > 0), key=abs)
        gaps.append((o / f - 1, b / f - 1))
        print(f"| {seed} | {f:.4f} | {o:.4f} | {gap(o, f)} | {b:.4f} | {gap(b, f)} | {100 * worst:+.1f}% | "
              f"{one['bytes_per_step'] / 1e6:.2f} / {blk['bytes_per_step'] / 1e6:.2f} |")
    if gaps:
        mo, mb = (100 * sum(g[i] for g in gaps) / len(gaps) for i in (0, 1))
        print(f"| mean | | | **{mo:+.1f}%** | | **{mb:+.1f}%** | | |")

    print("\n8 hosts (loopback, 200 steps, seed 0): validation loss at each evaluation\n")
    curves = {"Horovod fp32 (cluster run)": load(EIGHT_FP32), "`global_qsgd` (one scale)": load(EIGHT_ONE),
              "`global_qsgd_block512` (diagnostic)": load(DIAGNOSTIC),
              "`global_qsgd(block=512)`": load(HERE / "loss" / "8x1-loopback" / "global_qsgd_s0_constant.json")}
    steps = [r["step"] for r in curves["Horovod fp32 (cluster run)"]["history"] if r["step"] > 0]
    print("| | " + " | ".join(str(s) for s in steps) + " | vs fp32 at 200 | MB/step/rank |")
    print("|---|" + "---:|" * (len(steps) + 2))
    fp = curves["Horovod fp32 (cluster run)"]
    for name, c in curves.items():
        print(f"| {name} | " + " | ".join(f"{loss_at(c, s):.4f}" for s in steps) +
              f" | {gap(loss_at(c, 200), loss_at(fp, 200))} | {c['bytes_per_step'] / 1e6:.2f} |")

    for T8 in (HERE / "timing-8hosts", HERE / "timing-broadcast" / "8hosts"):
        if not (T8 / "fp32").exists():
            continue
        print(f"\n8 hosts at 1 Gbit/s, seed 0 ({T8.relative_to(HERE)}): 25 steps timed in one session; the time "
              "to fp32's losses (fp32's curve of the cluster run, at its step time of this session)\n")
        anchor = load(T8 / "fp32" / "8x1-1gbit" / "horovod_fp32_s0_constant.json")
        one_t = load(T8 / "one_scale" / "timing" / "8x1-1gbit" / "global_qsgd_s0_constant.json")
        blk_t = load(T8 / "block512" / "timing" / "8x1-1gbit" / "global_qsgd_s0_constant.json")
        blk = load(T8 / "block512" / "8x1-1gbit" / "global_qsgd_s0_constant.json")
        print("| | ms/step | vs fp32's step | to fp32's loss at step 200 | at its step 150 | at its step 100 |")
        print("|---|---:|---:|---:|---:|---:|")
        base = 1e3 * steady(anchor)[0]
        print(f"| Horovod fp32 | {base:,.0f} | 1.00x | | | |")
        print(f"| `global_qsgd` (one scale) | {1e3 * steady(one_t)[0]:,.0f} | {base / (1e3 * steady(one_t)[0]):.2f}x "
              f"| | | |")
        print(f"| `global_qsgd(block=512)` | {1e3 * steady(blk_t)[0]:,.0f} | {base / (1e3 * steady(blk_t)[0]):.2f}x | "
              + " | ".join(times(blk, anchor, fp, (200, 150, 100))) + " |")

rounds = sorted(HERE.glob("timing-round*"))
if rounds:
    print("\n2 hosts, seed 0: 25 steps each, rounds taking turns; ms per step and the time to fp32's "
          "losses at steps 400, 300 and 200 (fp32's curve of seed 0 on loopback, at its step time of the round)\n")
    print("| setting | round | fp32 ms | one scale ms | block=512 ms | to fp32's loss at step 400 | at 300 | at 200 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    fp_curve = load(TWO_HOSTS[0] / "horovod_fp32_s0_constant.json")
    for setting in ("2x1-1gbit", "2x1-100mbit"):
        for base in rounds:
            t = base / "one_scale_and_fp32" / "timing" / setting
            fp_t, one_t = load(t / "horovod_fp32_s0_constant.json"), load(t / "global_qsgd_s0_constant.json")
            blk_t = load(base / "block512" / "timing" / setting / "global_qsgd_s0_constant.json")
            blk = load(base / "block512" / setting / "global_qsgd_s0_constant.json")
            ms = [1e3 * steady(r)[0] for r in (fp_t, one_t, blk_t)]
            print(f"| {setting} | {base.name[-1]} | " + " | ".join(f"{m:,.0f}" for m in ms) + " | " +
                  " | ".join(times(blk, fp_t, fp_curve, (400, 300, 200))) + " |")

T2 = HERE / "timing-broadcast" / "2hosts"
if (T2 / "block512").exists():
    print("\n2 hosts at 1 Gbit/s, seed 0 (timing-broadcast/2hosts): 25 steps each in one session\n")
    print("| fp32 ms | one scale ms | block=512 ms | to fp32's loss at step 400 | at 300 | at 200 |")
    print("|---:|---:|---:|---:|---:|---:|")
    t = T2 / "one_scale_and_fp32" / "timing" / "2x1-1gbit"
    fp_t, one_t = load(t / "horovod_fp32_s0_constant.json"), load(t / "global_qsgd_s0_constant.json")
    blk_t = load(T2 / "block512" / "timing" / "2x1-1gbit" / "global_qsgd_s0_constant.json")
    blk = load(T2 / "block512" / "2x1-1gbit" / "global_qsgd_s0_constant.json")
    fp_curve = load(TWO_HOSTS[0] / "horovod_fp32_s0_constant.json")
    print("| " + " | ".join(f"{1e3 * steady(r)[0]:,.0f}" for r in (fp_t, one_t, blk_t)) + " | " +
          " | ".join(times(blk, fp_t, fp_curve, (400, 300, 200))) + " |")
