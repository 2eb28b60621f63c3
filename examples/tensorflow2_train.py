"""Data-parallel training of a small MLP on scikit-learn's digits with hvd_quant (TensorFlow).

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow2_train.py --compression ef_sign
    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow2_train.py --optimizer zero_one_adam

A custom loop under ``tf.function`` (``examples/keras_fit.py`` does the same with ``model.fit``).
With ``--optimizer onebit_adam|zero_one_adam|binsgdm`` the gradients go straight to
hvd_quant's Keras 1-bit optimizer, which averages over ranks by itself (no tape wrapper);
rank 0 prints per epoch the bytes sent per step, the communication rounds so far and how
many steps of each kind (full / 1-bit / local) ran.

Runs with TF 2.21's Keras 3 through ``hvd_quant.tensorflow.DistributedGradientTape``.
``--path stock`` uses Horovod's own ``hvd.DistributedGradientTape``, which needs Keras 2:
set ``TF_USE_LEGACY_KERAS=1`` (tf-keras installed).
"""

import os
import time

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import hvd_quant.tensorflow as hq
from common import ONE_BIT, Reporter, describe, digits_split, one_bit_defaults, parse_args, parse_options


def main():
    args = parse_args(__doc__.splitlines()[0])
    if args.path == "stock" and os.environ.get("TF_USE_LEGACY_KERAS") != "1":
        raise SystemExit("--path stock needs Keras 2: run with TF_USE_LEGACY_KERAS=1 "
                         "(Horovod's stock tape fails on Keras 3 variables)")
    hvd.init()
    keras = tf.keras
    keras.utils.set_random_seed(args.seed)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    (x_train, y_train), (x_test, y_test) = digits_split(hvd.rank(), hvd.size())

    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(args.hidden, activation="relu", name="fc1"),
                              keras.layers.Dense(64, activation="relu", name="fc2"),
                              keras.layers.Dense(10, name="logits")], name="mlp")
    hq.broadcast_variables(model.variables, root_rank=0)
    compression = hq.Compression.get(args.compression, seed=args.seed, **parse_options(args.option))
    steps = int(hvd.allreduce(tf.constant(len(x_train) // args.batch_size), op=hvd.Min, name="steps"))
    one_bit = args.optimizer in ONE_BIT
    if one_bit:
        options = {**one_bit_defaults(args.optimizer, steps * args.epochs), **parse_options(args.opt_option)}
        opt = getattr(hq, ONE_BIT[args.optimizer])(learning_rate=args.lr, **options)
    elif args.optimizer == "adam":
        opt = keras.optimizers.Adam(args.lr)
    else:
        opt = keras.optimizers.SGD(args.lr, momentum=0.9)
    wrap = hq.DistributedGradientTape if args.path == "ours" else hvd.DistributedGradientTape
    tapes = []

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        if not one_bit:
            tape = wrap(tape, compression=compression)
            tapes.append(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    numel = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    fp32_bytes = 2.0 * (hvd.size() - 1) / hvd.size() * 4 * numel
    label = (f"tf/{args.optimizer}" if one_bit else
             f"tf/{args.path}/{args.optimizer}/{args.compression}" + "".join(f",{o}" for o in args.option))
    report = Reporter(args, hvd.rank(), hvd.size(), label)
    if hvd.rank() == 0 and not one_bit:
        print(describe(compression, hvd.size()), flush=True)
    rng = np.random.default_rng(args.seed + hvd.rank())
    sent_before = 0.0
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(x_train))
        losses, start = [], time.perf_counter()
        for i in range(steps):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            losses.append(float(train_step(x_train[idx], y_train[idx])))
        step_time = (time.perf_counter() - start) / steps
        if one_bit:  # the optimizer's meters count every executed step
            total = float(opt.bytes_sent)
            sent, sent_before = (total - sent_before) / steps, total
            rounds, kinds = int(opt.comm_rounds), opt.kind_counts
        else:
            # Bytes are counted when the reduction is traced (once); that count is per step.
            sent = (tapes[0].bytes_sent if args.path == "ours" else compression.bytes_sent) - _check_bytes(args)
            rounds, kinds = None, None
        logits = model(x_test, training=False)
        acc = float(np.mean(np.argmax(logits, 1) == y_test))
        loss = float(hvd.allreduce(tf.constant(np.mean(losses)), name=f"loss{epoch}"))
        report.epoch(epoch, loss, acc, sent, step_time, steps, rounds, kinds)
    report.finish(fp32_bytes, int(float(opt.skipped_steps)) if one_bit else None)


def _check_bytes(args):
    """The one-off agreement check (an allgather of 3 int64) counted in the first trace."""
    n = hvd.size()
    return (n - 1) * 24.0 if args.path == "ours" else 0.0


if __name__ == "__main__":
    main()
