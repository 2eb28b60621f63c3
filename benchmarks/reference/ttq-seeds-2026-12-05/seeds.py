"""The seed table of the methods near the 3% target: validation loss at step 400 (constant
lr 5e-4, 2 ranks, loopback) on seeds 0 to 3, each against Horovod fp32 of its own seed.

    python3 benchmarks/reference/ttq-seeds-2026-12-05/seeds.py > benchmarks/reference/ttq-seeds-2026-12-05/table.md
"""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
REF = HERE.parent
METHODS = ("horovod_fp32", "binsgdm", "global_qsgd", "qsgd")
PLACES = (HERE / "runs", REF / "ttq-5e-4-2026-12-03" / "loss" / "2x1-loopback",
          REF / "ttq-lr-2026-12-03" / "seed1" / "lr5e-4")  # seeds 2-3 and qsgd's 1; seed 0 and 1; seed 1


def final(method, seed):
    for place in PLACES:
        path = place / f"{method}_s{seed}_constant.json"
        if path.exists():
            run = json.loads(path.read_text())
            assert run["config"]["lr"] == 5e-4 and run["config"]["steps"] == 400, path
            return run["history"][-1]["val_loss"] if run["status"] == "complete" else None
    return None


def main():
    seeds = range(4)
    print("| method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean gap | gaps' range |")
    print("|---|" + "---:|" * (len(seeds) + 2))
    for method in METHODS:
        cells, gaps = [], []
        for s in seeds:
            loss, twin = final(method, s), final("horovod_fp32", s)
            if loss is None or twin is None:
                cells.append("–")
                continue
            gap = 100 * (loss / twin - 1)
            gaps.append(gap)
            cells.append(f"{loss:.4f}" if method == "horovod_fp32" else f"{loss:.4f} ({gap:+.1f}%)")
        mean = f"{statistics.mean(gaps):+.1f}%" if gaps and method != "horovod_fp32" else ""
        spread = f"{min(gaps):+.1f} to {max(gaps):+.1f}%" if gaps and method != "horovod_fp32" else ""
        print(f"| {method} | " + " | ".join(cells) + f" | {mean} | {spread} |")


if __name__ == "__main__":
    main()
