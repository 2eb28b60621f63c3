"""Is BinSGDM's larger gap at 8 ranks the number of ranks or the global batch? Its losses at
8 ranks x 8 windows, at 2 ranks x 32 windows (the same global batch: ``batch4x/``,
``run5.sh``) and at 2 ranks x 8, each against Horovod fp32 (Adam) of the same layout, at a
constant lr 5e-4, seed 0, at steps 100, 150 and 200; then BinSGDM at its default beta
(0.8) against fp32 at step 200 on seeds 0, 1 and 2 in the two layouts of the same global
batch (``run6.sh``: seeds 1 and 2). Prints two markdown tables.
Usage: batch4x.py (from anywhere)."""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
REF = HERE.parent
ROWS = {  # layout -> {run: file}
    "8 ranks x 8 windows": {
        "fp32": REF / "ttq-8hosts-2026-12-03/8x1-1gbit/horovod_fp32_s0_constant.json",
        "BinSGDM 0.8": HERE / "loss/8x1-loopback/binsgdm_s0_constant.json",
        "BinSGDM 0.9": HERE / "runs/beta0.9/8x1-loopback/binsgdm_s0_constant.json",
        "no bits (0.9)": HERE / "nobits/8x1-loopback/horovod_fp32_s0_constant.json"},
    "2 ranks x 32 windows": {
        "fp32": HERE / "batch4x/loss/2x1-loopback/horovod_fp32_s0_constant.json",
        "BinSGDM 0.8": HERE / "batch4x/loss/2x1-loopback/binsgdm_s0_constant.json",
        "BinSGDM 0.9": HERE / "batch4x/beta0.9/2x1-loopback/binsgdm_s0_constant.json",
        "no bits (0.9)": HERE / "batch4x/nobits/2x1-loopback/horovod_fp32_s0_constant.json"},
    "2 ranks x 8 windows (400-step runs)": {
        "fp32": REF / "ttq-5e-4-2026-12-03/loss/2x1-loopback/horovod_fp32_s0_constant.json",
        "BinSGDM 0.8": REF / "binsgdm-default-beta-2026-12-06/loss/2x1-loopback/binsgdm_s0_constant.json",
        "BinSGDM 0.9": REF / "binsgdm-default-beta-2026-12-06/runs/constant-beta0.9/2x1-loopback/binsgdm_s0_constant.json",
        "no bits (0.9)": REF / "ttq-binsgdm-2026-12-05/runs/nobits/2x1-loopback/horovod_fp32_s0_constant.json"},
}
STEPS = (100, 150, 200)


def losses(path):
    return {h["step"]: h["val_loss"] for h in json.loads(Path(path).read_text())["history"]}


def main():
    print("| layout | run | " + " | ".join(f"loss at {s} (vs fp32)" for s in STEPS) + " |")
    print("|---|---|" + "---:|" * len(STEPS))
    for layout, runs in ROWS.items():
        fp32 = losses(runs["fp32"])
        for name, path in runs.items():
            mine = losses(path)
            cells = [f"{mine[s]:.4f}" + ("" if name == "fp32" else f" ({100 * (mine[s] / fp32[s] - 1):+.1f}%)")
                     for s in STEPS]
            print(f"| {layout} | {name} | " + " | ".join(cells) + " |")
    print()
    seed_table()


SEED_FILES = {  # layout -> (fp32, BinSGDM) of seed s
    "8 ranks x 8 windows": lambda s: (ROWS["8 ranks x 8 windows"]["fp32"], ROWS["8 ranks x 8 windows"]["BinSGDM 0.8"])
    if s == 0 else tuple(HERE / f"batch4x/seeds8/8x1-loopback/{m}_s{s}_constant.json" for m in ("horovod_fp32", "binsgdm")),
    "2 ranks x 32 windows": lambda s: tuple(HERE / f"batch4x/loss/2x1-loopback/{m}_s{s}_constant.json"
                                            for m in ("horovod_fp32", "binsgdm")),
}


def seed_table():
    seeds = (0, 1, 2)
    print("| layout | " + " | ".join(f"seed {s}: fp32, BinSGDM (vs fp32)" for s in seeds) + " | mean gap |")
    print("|---|" + "---:|" * (len(seeds) + 1))
    for layout, files in SEED_FILES.items():
        cells, gaps = [], []
        for s in seeds:
            fp32, bin_ = (losses(p)[200] for p in files(s))
            gaps.append(100 * (bin_ / fp32 - 1))
            cells.append(f"{fp32:.4f}, {bin_:.4f} ({gaps[-1]:+.1f}%)")
        print(f"| {layout} | " + " | ".join(cells) + f" | {sum(gaps) / len(gaps):+.1f}% |")


if __name__ == "__main__":
    main()
