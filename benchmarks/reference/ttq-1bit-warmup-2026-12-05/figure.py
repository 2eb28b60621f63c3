"""The page's figure (docs/assets/ttq-1bit-warmup-freeze.png): validation loss against steps
under the warm-up schedule for Adam and the 1-bit Adams' variants, and how much smaller a
variance frozen at step 80 makes Adam's later steps (``--variance-from 80``).

    .venv/bin/python benchmarks/reference/ttq-1bit-warmup-2026-12-05/figure.py
"""
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
EARLIER = HERE.parent / "ttq-5e-4-2026-12-03" / "loss" / "2x1-loopback"  # the freeze-80 rows

CURVES = [  # (label, file, colour, style)
    ("Adam (Horovod fp32)", HERE / "variance" / "horovod_fp32_s0_warmup.json", "black", "-"),
    ("1-bit Adam, freeze 80", EARLIER / "onebit_adam_s0_warmup.json", "tab:blue", ":"),
    ("1-bit Adam, freeze 160", HERE / "freeze160" / "onebit_adam_s0_warmup.json", "tab:blue", "--"),
    ("1-bit Adam, freeze 240", HERE / "freeze240" / "onebit_adam_s0_warmup.json", "tab:blue", "-"),
    ("0/1 Adam, freeze 80", EARLIER / "zero_one_adam_s0_warmup.json", "tab:red", ":"),
    ("0/1 Adam, freeze 80, var_update_scaler 128", HERE / "zo-scaler128" / "zero_one_adam_s0_warmup.json",
     "tab:orange", "-"),
    ("0/1 Adam, freeze 160", HERE / "freeze160" / "zero_one_adam_s0_warmup.json", "tab:red", "--"),
    ("0/1 Adam, freeze 160, var_update_scaler 256", HERE / "zo-scaler256-freeze160" / "zero_one_adam_s0_warmup.json",
     "tab:orange", "--"),
    ("0/1 Adam, freeze 240", HERE / "freeze240" / "zero_one_adam_s0_warmup.json", "tab:red", "-"),
]


def main():
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for label, path, colour, style in CURVES:
        history = json.loads(path.read_text())["history"]
        left.plot([r["step"] for r in history[1:]], [r["val_loss"] for r in history[1:]],
                  color=colour, linestyle=style, label=f"{label}: {history[-1]['val_loss']:.4f}")
    left.set(xlabel="step", ylabel="validation loss", ylim=(3.15, 4.6),
             title="Warm-up (80 steps) and cosine decay, lr 5e-4, 2 ranks, seed 0")
    left.legend(fontsize=7.5)
    left.grid(alpha=0.3)
    rows = json.loads((HERE / "variance" / "horovod_fp32_s0_warmup.json").read_text())["variance_vs_frozen"]
    steps = [r["step"] for r in rows]
    for part, colour in (("blocks", "tab:green"), ("embedding", "tab:purple")):
        right.plot(steps, [r[part][1] for r in rows], color=colour, label=f"{part}: median")
        right.fill_between(steps, [r[part][0] for r in rows], [r[part][2] for r in rows], color=colour, alpha=0.15,
                           label=f"{part}: quartiles")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set(xlabel="step", ylabel="sqrt(v_hat(step) / v_hat(80))",
              title="A step with the variance frozen at 80, against Adam's")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.tight_layout()
    out = ROOT / "docs" / "assets" / "ttq-1bit-warmup-freeze.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
