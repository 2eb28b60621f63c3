"""The SGD rows of this folder in one figure: validation loss against steps, 2 and 4 ranks.
Run from this folder: ../../../.venv/bin/python plot.py (writes marsit-vs-cascade-sgd.png)."""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
ROWS = {  # panel: [(folder, curve, label, style)]
    "2 ranks": [("2r-sgdm-lr0.1", "horovod_fp32", "fp32, SGD momentum 0.9, lr 0.1", "k-"),
                ("2r-sgd-lr0.5", "horovod_fp32", "fp32, SGD, lr 0.5", "k:"),
                ("2r-sgd-lr1.0", "cascading_sign", "cascading_sign, SGD, lr 1.0", "C1-"),
                ("2r-sgd-lr1.0", "marsit", "marsit, SGD, lr 1.0", "C0-"),
                ("2r-sgdm-lr0.1", "cascading_sign", "cascading_sign, momentum 0.9, lr 0.1", "C1--"),
                ("2r-sgdm-lr0.1", "marsit", "marsit, momentum 0.9, lr 0.1", "C0--")],
    "4 ranks": [("4r-sgdm-lr0.1", "horovod_fp32", "fp32, SGD momentum 0.9, lr 0.1", "k-"),
                ("4r-sgd-lr1.0", "cascading_sign", "cascading_sign, SGD, lr 1.0", "C1-"),
                ("4r-sgd-lr1.0", "marsit", "marsit, SGD, lr 1.0", "C0-"),
                ("4r-sgd-lr1.0-nocomp", "marsit", "marsit, compensation=False, SGD, lr 1.0", "C2-")],
}


def curve(folder, method):
    path = next((HERE / folder).glob(f"*/{method}_s0_constant.json"))
    history = json.loads(path.read_text())["history"]
    return [h["step"] for h in history], [h["val_loss"] for h in history]


fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
for ax, (title, rows) in zip(axes, ROWS.items()):
    for folder, method, label, style in rows:
        ax.plot(*curve(folder, method), style, label=label)
    ax.set_title(f"{title}, 400 steps, seed 0 (loopback)")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
axes[0].set_ylabel("validation loss (nats per token)")
axes[0].set_ylim(3.5, 6.0)
fig.suptitle("Marsit against cascading sign under SGD (time-to-quality LM, 7.37M parameters)")
fig.tight_layout()
fig.savefig(HERE / "marsit-vs-cascade-sgd.png", dpi=100)
