"""The learning-rate choice's table and figure, from this folder's runs:
``.venv/bin/python benchmarks/reference/ttq-lr-2026-12-03/seed1/plot.py`` (from the repository root)."""
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
FAMILIES = {"horovod_fp32": "adam (chosen by Horovod fp32)", "onebit_adam": "onebit_adam",
            "zero_one_adam": "zero_one_adam", "binsgdm": "binsgdm"}
runs = {}
for path in sorted(HERE.glob("lr*/*.json")):
    d = json.loads(path.read_text())
    runs[(d["config"]["method"], d["config"]["lr"])] = d
lrs = sorted({lr for _, lr in runs})
print("| family | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen |")
print("|---|" + "---:|" * len(lrs) + "---|")
fig, axes = plt.subplots(1, len(FAMILIES), figsize=(4 * len(FAMILIES), 3.4), sharey=True)
for ax, (method, family) in zip(axes, FAMILIES.items()):
    finals = {lr: runs[(method, lr)]["final_val_loss"] for lr in lrs if (method, lr) in runs}
    best = min(finals, key=finals.get)
    print(f"| {family} | " + " | ".join(f"**{finals[lr]:.4f}**" if lr == best else f"{finals[lr]:.4f}"
                                       for lr in lrs) + f" | {best:g} |")
    for lr in lrs:
        h = [e for e in runs[(method, lr)]["history"] if e.get("val_loss") is not None]
        ax.plot([e["step"] for e in h], [e["val_loss"] for e in h], label=f"lr {lr:g}")
    ax.set_title(family, fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylim(3.0, 5.5)
    ax.grid(alpha=0.3)
axes[0].set_ylabel("validation loss")
axes[0].legend(fontsize=8)
fig.suptitle("Learning rate per family, seed 1, 2 ranks, constant schedule", fontsize=10)
fig.tight_layout()
fig.savefig(HERE / "lr-per-family-s1.png", dpi=110)
