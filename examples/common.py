"""Shared by the examples: data, options and reporting (no framework imports here)."""

import argparse
import json
import time

import numpy as np


def parse_args(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--compression", default="none",
                   help="hvd_quant compressor name (see hvd_quant.available())")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="compressor option, e.g. --option norm=l2 (repeatable)")
    p.add_argument("--path", choices=["ours", "stock", "ddp", "ddp_powersgd"], default="ours",
                   help="hvd_quant's fused optimizer/tape, Horovod's stock one, or (torch only) "
                        "torch DDP over Gloo with an fp32 allreduce or PowerSGD (no --compression)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgdm",
                   help="sgdm/adam: wrapped in a DistributedOptimizer with --compression; "
                        "onebit_adam/zero_one_adam/binsgdm: hvd_quant's 1-bit optimizers "
                        "(they communicate by themselves; --compression must stay none)")
    p.add_argument("--opt-option", action="append", default=[], metavar="KEY=VALUE",
                   help="option of a 1-bit optimizer, e.g. --opt-option freeze_step=50 (repeatable)")
    p.add_argument("--hidden", type=int, default=128, help="width of the MLP's hidden layers")
    p.add_argument("--target-accuracy", type=float, default=0.95,
                   help="report the training time until the test accuracy first reaches this")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=None,
                   help="default: 0.05 for sgdm, 1e-3 for the Adam family and BinSGDM")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="rank 0 writes its results here")
    args = p.parse_args()
    if args.optimizer in ONE_BIT and args.compression != "none":
        p.error(f"--optimizer {args.optimizer} communicates by itself; leave --compression at none")
    if args.path.startswith("ddp") and (args.compression != "none" or args.optimizer in ONE_BIT):
        p.error(f"--path {args.path} is torch DDP's own reduction: no --compression or 1-bit optimizer")
    if args.lr is None:
        args.lr = 0.05 if args.optimizer == "sgdm" else 1e-3
    return args


#: --optimizer choices; the 1-bit ones map to hvd_quant.torch / hvd_quant.tensorflow classes.
ONE_BIT = {"onebit_adam": "OnebitAdam", "zero_one_adam": "ZeroOneAdam", "binsgdm": "BinSGDM"}
OPTIMIZERS = ("sgdm", "adam", *ONE_BIT)


def parse_options(pairs):
    """``["norm=l2", "bits=8", "compensation=false"]`` -> typed dict."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--option needs KEY=VALUE, got {pair!r}")
        low = value.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        elif low == "none":
            out[key] = None
        else:
            try:
                out[key] = int(value)
            except ValueError:
                try:
                    out[key] = float(value)
                except ValueError:
                    out[key] = value
    return out


def digits_split(rank, size, seed=0):
    """scikit-learn's bundled 8x8 digits (1797 images, no download), standardised.

    A fixed 80/20 split; each rank trains on its own shard ``rank::size`` of the training
    part and every rank evaluates on the whole test part.
    """
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(1234).permutation(len(x))
    x, y = x[order], y[order].astype(np.int64)
    cut = int(0.8 * len(x))
    mean, std = x[:cut].mean(0), x[:cut].std(0) + 1e-3
    x = (x - mean) / std
    return (x[:cut][rank::size], y[:cut][rank::size]), (x[cut:], y[cut:])


def powersgd_bytes(shapes, rank, n, min_compression_rate=2):
    """Bytes one rank sends per PowerSGD step (torch's ``powerSGD_hook``): a ring
    allreduce of the uncompressed tensors (1-D ones, and matrices PowerSGD finds not worth
    compressing: its ``_should_compress`` rule) and of the P (rows x r) and Q (cols x r)
    factors of the others."""
    floats = 0
    for shape in shapes:
        if len(shape) <= 1:
            floats += max(1, shape[0] if shape else 1)
            continue
        rows = shape[0]
        cols = 1
        for s in shape[1:]:
            cols *= s
        r = min(rows, cols, rank)
        compressed = (rows + cols) * r
        floats += compressed if compressed * min_compression_rate < rows * cols else rows * cols
    return 2.0 * (n - 1) / n * 4 * floats


def describe(compression, world_size):
    """One line on what goes on the wire, e.g. Global-QSGD's chosen width and levels."""
    text = f"compression: {compression!r}"
    resolve = getattr(compression.algorithm, "resolve", None)
    if resolve is not None:
        width, levels = resolve(world_size)
        text += f"; {world_size} ranks -> {width}-bit integers, {levels} levels per sign"
    return text


def one_bit_defaults(name, total_steps):
    """Options of the 1-bit optimizers for a short run on digits.

    DeepSpeed's defaults assume long trainings (variance frozen after 100000 steps). Here
    1-bit Adam's full-precision warm-up takes the first 15% of the steps, the low end of
    what DeepSpeed's 1-bit Adam tutorial suggests ("15-25% of the total training steps",
    then fewer if that works): on the demo, a quarter put its whole way to 95% inside the
    fp32 warm-up (1.98x sooner than Horovod fp32), 15% reached it in the same epoch with
    the last steps at 1 bit (2.14x), at the same final accuracy (2026-11-26). 0/1 Adam's
    variance updates take the first quarter.

    ``eps=1e-4``: some digits pixels are constant, so their first-layer weights never get
    a gradient and their variance stays 0; a 1-bit round still moves them by the buffer's
    RMS scale, divided by ``sqrt(v) + eps``, which at DeepSpeed's 1e-8 blew the model up
    (NaN within 3 epochs). DeepSpeed's ``exp_avg_mask`` is the other cure.
    """
    if name == "onebit_adam":
        return {"freeze_step": max(1, total_steps * 15 // 100), "eps": 1e-4}
    if name == "zero_one_adam":
        return {"var_freeze_step": max(1, total_steps // 4), "local_step_scaler": max(1, total_steps // 20),
                "eps": 1e-4}
    return {}


class Reporter:
    """Per-epoch lines on rank 0 and a JSON summary."""

    def __init__(self, args, rank, size, label):
        self.args, self.rank, self.size, self.label = args, rank, size, label
        self.history = []
        self.start = time.perf_counter()
        self.train_time = 0.0  # seconds of training steps (evaluation excluded)
        self.time_to_target, self.epochs_to_target = None, None

    def epoch(self, epoch, loss, acc, bytes_per_step, step_time, steps=0, rounds=None, kinds=None):
        """``rounds``: communication rounds so far (the 1-bit optimizers' ``comm_rounds``);
        ``kinds``: steps so far per kind (``{"full": 11, "onebit": 30, ...}``)."""
        row = {"epoch": epoch, "loss": loss, "test_accuracy": acc,
               "bytes_per_step": bytes_per_step, "step_time_ms": 1000 * step_time}
        if rounds is not None:
            row["comm_rounds"] = int(rounds)
        if kinds is not None:
            row["kind_counts"] = {k: int(v) for k, v in kinds.items() if v}
        self.train_time += step_time * steps
        row["train_time_s"] = self.train_time  # cumulative, evaluation excluded
        if self.time_to_target is None and acc >= self.args.target_accuracy:
            self.time_to_target = self.train_time
            self.epochs_to_target = epoch
        self.history.append(row)
        if self.rank == 0:
            print(f"[{self.label}] epoch {epoch:3d}  loss {loss:.4f}  test acc {acc:.4f}  "
                  f"bytes/step/rank {bytes_per_step:,.0f}  step {1000 * step_time:.2f} ms"
                  + (f"  comm rounds {int(rounds)}" if rounds is not None else "")
                  + (f"  steps {_kinds_text(row['kind_counts'])}" if kinds is not None else ""), flush=True)

    def finish(self, fp32_bytes_per_step, skipped_steps=None):
        """The run's summary (printed by rank 0, and written to ``--json``).
        ``skipped_steps``: steps a 1-bit optimizer left out because values were not
        finite (None for optimizers that never skip)."""
        summary = {"label": self.label, "ranks": self.size, "compression": self.args.compression,
                   "options": parse_options(self.args.option), "path": self.args.path,
                   "epochs": self.args.epochs, "seed": self.args.seed,
                   "optimizer": self.args.optimizer, "hidden": self.args.hidden,
                   "target_accuracy": self.args.target_accuracy,
                   "time_to_target_s": self.time_to_target, "epochs_to_target": self.epochs_to_target,
                   "train_time_s": self.train_time,
                   "comm_rounds": self.history[-1].get("comm_rounds"),
                   "kind_counts": self.history[-1].get("kind_counts"),
                   "final_test_accuracy": self.history[-1]["test_accuracy"],
                   "bytes_per_step": self.history[-1]["bytes_per_step"],
                   # the whole run (every epoch has the same steps): warm-ups included
                   "mean_bytes_per_step": float(np.mean([h["bytes_per_step"] for h in self.history])),
                   "fp32_allreduce_bytes_per_step": fp32_bytes_per_step,
                   "skipped_steps": None if skipped_steps is None else int(skipped_steps),
                   "mean_step_time_ms": float(np.mean([h["step_time_ms"] for h in self.history])),
                   # the second half of the epochs: no tracing, warm-ups mostly over
                   "late_step_time_ms": float(np.mean([h["step_time_ms"]
                                                       for h in self.history[len(self.history) // 2:]])),
                   "wall_time_s": time.perf_counter() - self.start, "history": self.history}
        if self.rank == 0:
            ratio = fp32_bytes_per_step / max(summary["bytes_per_step"], 1e-9)
            rounds = summary["comm_rounds"]
            print(f"[{self.label}] final test accuracy {summary['final_test_accuracy']:.4f}; "
                  f"{summary['bytes_per_step']:,.0f} bytes/step/rank in the last epoch "
                  f"({ratio:.1f}x fewer than an fp32 allreduce), {summary['mean_bytes_per_step']:,.0f} on average"
                  + (f"; {rounds} communication rounds" if rounds is not None else "")
                  + (f"; {skipped_steps} step(s) skipped (values not finite)" if skipped_steps else ""),
                  flush=True)
            if self.args.json:
                with open(self.args.json, "w") as f:
                    json.dump(summary, f, indent=1)
        return summary


def _kinds_text(kinds):
    return ",".join(f"{k}={v}" for k, v in kinds.items()) or "-"
