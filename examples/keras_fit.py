"""Keras 3 ``model.fit`` on scikit-learn's digits with hvd_quant's DistributedOptimizer.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_fit.py --compression ef_sign
    horovodrun -np 3 -H localhost:3 --gloo python examples/keras_fit.py \
        --compression global_qsgd:norm=l2 --optimizer adam
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_fit.py --policy mixed_float16

``--compression NAME[:KEY=VALUE,...]`` picks the compressor; ``--optimizer`` the Keras
optimizer it wraps (``sgd``, ``adam``), or one of hvd_quant's 1-bit optimizers
(``onebit_adam``, ``zero_one_adam``, ``binsgdm``), which communicate by themselves and
take no ``--compression`` (their options go by ``--opt-option KEY=VALUE``; the defaults
scale their schedules to the run's length, as in the other digits examples). Rank 0
prints per epoch the loss (averaged over ranks), the
test accuracy, bytes sent per step per rank and the step time; ``--json`` writes the
summary with a digest of every rank's final weights (identical weights, identical digest).
"""

import argparse
import hashlib
import json
import time

import numpy as np
import tensorflow as tf
import keras
import horovod.tensorflow as hvd

import hvd_quant.tensorflow as hq
from common import ONE_BIT, digits_split, one_bit_defaults, parse_options

# --optimizer name -> default learning rate
DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3, "onebit_adam": 1e-3, "zero_one_adam": 1e-3, "binsgdm": 1e-3}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", default="none", help="NAME or NAME:KEY=VALUE,KEY=VALUE")
    p.add_argument("--optimizer", default="sgd", choices=sorted(DEFAULT_LR))
    p.add_argument("--opt-option", action="append", default=[], metavar="KEY=VALUE",
                   help="option of a 1-bit optimizer, e.g. --opt-option freeze_step=100 (repeatable)")
    p.add_argument("--lr", type=float, default=None, help="default: 0.05 for sgd, 1e-3 otherwise")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--policy", default="float32", choices=["float32", "mixed_float16", "mixed_bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jit-compile", action="store_true",
                   help="XLA-compile the forward and backward pass (hq.callbacks.JitCompileCallback)")
    p.add_argument("--json", default=None, help="rank 0 writes its results here")
    return p.parse_args()


def make_optimizer(args, total_steps):
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    name, _, opts = args.compression.partition(":")
    options = parse_options(filter(None, opts.split(",")))
    if args.optimizer in ONE_BIT:
        cls = getattr(hq, ONE_BIT[args.optimizer], None)
        if cls is None:
            raise SystemExit(f"hvd_quant.tensorflow.{ONE_BIT[args.optimizer]} is not available in this version")
        if name != "none":
            raise SystemExit(f"--optimizer {args.optimizer} communicates by itself: leave --compression out")
        # 0/1 Adam: exact_sync and FinalSyncCallback (in main) end the run with one model.
        exact = {"exact_sync": True} if args.optimizer == "zero_one_adam" else {}
        options = {**one_bit_defaults(args.optimizer, total_steps), **exact, **parse_options(args.opt_option)}
        opt = cls(learning_rate=lr, **options)
        if args.policy == "mixed_float16":
            # Keras' own LossScaleOptimizer (what compile adds) would skip steps per rank and
            # is refused; ours scales the loss from the optimizer's all-rank verdict.
            opt = hq.DistributedOptimizer(opt)
        return opt, None
    if args.opt_option:
        raise SystemExit("--opt-option is for hvd_quant's 1-bit optimizers")
    base = (keras.optimizers.SGD(lr, momentum=0.9) if args.optimizer == "sgd"
            else keras.optimizers.Adam(lr))
    compression = hq.Compression.get(name, seed=args.seed, **options)
    return hq.DistributedOptimizer(base, compression=compression), compression


class Report(keras.callbacks.Callback):
    """Per-epoch line on rank 0 (after MetricAverageCallback: averaged values)."""

    def __init__(self, steps):
        super().__init__()
        self.steps, self.history = steps, []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()
        self.bytes_before = sent_bytes(self.model.optimizer)

    def on_train_batch_end(self, batch, logs=None):
        self.train_end = time.perf_counter()  # the last one: before validation

    def on_epoch_end(self, epoch, logs=None):
        step_ms = 1000 * (self.train_end - self.start) / self.steps
        per_step = (sent_bytes(self.model.optimizer) - self.bytes_before) / self.steps
        row = {"epoch": epoch + 1, "loss": float(logs["loss"]), "test_accuracy": float(logs["val_accuracy"]),
               "bytes_per_step": per_step, "step_time_ms": step_ms}
        self.history.append(row)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:3d}  loss {row['loss']:.4f}  test acc {row['test_accuracy']:.4f}  "
                  f"bytes/step/rank {per_step:,.0f}  step {step_ms:.2f} ms", flush=True)


def sent_bytes(optimizer):
    return float(getattr(optimizer, "bytes_sent", 0.0))


def weights_digest(model):
    h = hashlib.sha256()
    for v in model.weights:
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return h.hexdigest()[:16]


def main():
    args = parse_args()
    hvd.init()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(args.seed)
    keras.mixed_precision.set_global_policy(args.policy)
    (x_train, y_train), (x_test, y_test) = digits_split(hvd.rank(), hvd.size())
    # The same number of full batches on every rank: ranks must run the same steps.
    steps = (1437 // hvd.size()) // args.batch_size
    x_train, y_train = x_train[:steps * args.batch_size], y_train[:steps * args.batch_size]

    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(128, activation="relu", name="fc1"),
                              keras.layers.Dense(64, activation="relu", name="fc2"),
                              keras.layers.Dense(10, name="logits"),
                              keras.layers.Activation("linear", dtype="float32", name="out")], name="mlp")
    opt, compression = make_optimizer(args, steps * args.epochs)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=args.jit_compile)
    if hvd.rank() == 0:
        what = f"compression {compression!r}" if compression is not None else f"optimizer {type(opt).__name__}"
        print(f"keras {keras.__version__}, {hvd.size()} ranks, {what}, policy {args.policy}", flush=True)
    report = Report(steps)
    start = time.perf_counter()
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=0,
              validation_data=(x_test, y_test), shuffle=True,
              callbacks=[hq.callbacks.BroadcastGlobalVariablesCallback(0),
                         hq.callbacks.JitCompileCallback(),  # no-op unless --jit-compile
                         hq.callbacks.MetricAverageCallback(), report,
                         hq.callbacks.FinalSyncCallback()])  # 0/1 Adam's last local steps
    wall = time.perf_counter() - start

    mine = np.frombuffer(bytes.fromhex(weights_digest(model)), dtype=np.int64)
    digests = hvd.allgather(tf.constant(mine), name="weights_digest").numpy()
    digests = [int(d).to_bytes(8, "little", signed=True).hex() for d in digests]
    numel = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    summary = {"ranks": hvd.size(), "compression": args.compression, "optimizer": args.optimizer,
               "policy": args.policy, "epochs": args.epochs, "seed": args.seed,
               "final_test_accuracy": report.history[-1]["test_accuracy"],
               "bytes_per_step": report.history[-1]["bytes_per_step"],
               "fp32_allreduce_bytes_per_step": 2.0 * (hvd.size() - 1) / hvd.size() * 4 * numel,
               "weights_digest_per_rank": digests, "identical_weights": len(set(digests)) == 1,
               "wall_time_s": wall, "history": report.history}
    if hvd.rank() == 0:
        print(f"final test accuracy {summary['final_test_accuracy']:.4f}; "
              f"{summary['bytes_per_step']:,.0f} bytes/step/rank; weights identical on every rank: "
              f"{summary['identical_weights']}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
