"""The byte-level transformer language model of ``lm_torch.py`` in Keras 3 (TensorFlow
backend), trained data-parallel under Horovod: hvd_quant's 1-bit Keras optimizers through
``model.compile`` + ``model.fit``, the fp32 baselines (Adam, SGD with momentum) through a
custom loop with ``hvd_quant.tensorflow.DistributedGradientTape``.

    horovodrun -np 2 -H localhost:2 --gloo python examples/lm_keras.py --optimizer adam
    horovodrun -np 2 -H localhost:2 --gloo python examples/lm_keras.py --optimizer onebit_adam

Same options, data (``stdlib_text.py``), architecture, learning-rate schedule and summary
as ``lm_torch.py``. Differences: the initial weights (Keras' random streams); Keras' SGD
puts the learning rate inside the momentum buffer (the same update at a constant rate);
``--weight-decay`` with the Keras baselines is decoupled (AdamW-style), not L2.
"""

import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# One compute thread per rank (the ranks share the cores); see lm_torch.py.
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
from keras import ops  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

import hvd_quant.tensorflow as hq  # noqa: E402
from stdlib_text import (BASELINES, VOCAB_SIZE, LMReport, TrainBatches, lm_arguments,  # noqa: E402
                         load_corpus, validation_windows, weights_digest)


def _normal(std):
    return keras.initializers.RandomNormal(stddev=std)


class CausalSelfAttention(keras.layers.Layer):
    def __init__(self, d_model, heads, layers, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.d_model = heads, d_model
        self.qkv = keras.layers.Dense(3 * d_model, kernel_initializer=_normal(0.02), name="qkv")
        # GPT-2's depth-scaled init of projections into the residual stream (as in torch).
        self.proj = keras.layers.Dense(d_model, kernel_initializer=_normal(0.02 / math.sqrt(2 * layers)),
                                       name="proj")

    def call(self, x):
        b, t = ops.shape(x)[0], ops.shape(x)[1]
        hd = self.d_model // self.heads
        q, k, v = ops.split(self.qkv(x), 3, axis=-1)
        q, k, v = (ops.transpose(ops.reshape(z, (b, t, self.heads, hd)), (0, 2, 1, 3)) for z in (q, k, v))
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) / math.sqrt(hd)
        causal = ops.tril(ops.ones((t, t), dtype="bool"))
        scores = ops.where(causal, scores, ops.full_like(scores, -1e9))
        y = ops.matmul(ops.softmax(scores, axis=-1), v)
        return self.proj(ops.reshape(ops.transpose(y, (0, 2, 1, 3)), (b, t, self.d_model)))


class Block(keras.layers.Layer):
    """Pre-LayerNorm transformer block (GPT-2 layout), as ``lm_torch.Block``."""

    def __init__(self, d_model, heads, layers, **kwargs):
        super().__init__(**kwargs)
        self.ln1 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln1")
        self.attn = CausalSelfAttention(d_model, heads, layers, name="attn")
        self.ln2 = keras.layers.LayerNormalization(epsilon=1e-5, name="ln2")
        self.fc = keras.layers.Dense(4 * d_model, kernel_initializer=_normal(0.02), name="fc")
        self.proj = keras.layers.Dense(d_model, kernel_initializer=_normal(0.02 / math.sqrt(2 * layers)),
                                       name="proj")

    def call(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(ops.gelu(self.fc(self.ln2(x)), approximate=False))


class ByteTransformer(keras.Model):
    """Decoder-only transformer over bytes; the output layer shares the embedding."""

    def __init__(self, context, d_model=128, heads=4, layers=2, vocab=VOCAB_SIZE, **kwargs):
        super().__init__(**kwargs)
        self.vocab = vocab
        self.tok = self.add_weight(shape=(vocab, d_model), initializer=_normal(0.02), name="tok")
        self.pos = self.add_weight(shape=(context, d_model), initializer=_normal(0.02), name="pos")
        self.blocks = [Block(d_model, heads, layers, name=f"block{i}") for i in range(layers)]
        self.ln_f = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")

    def call(self, idx):
        # Looked up by one-hot product and slice rather than a gather: a gather's gradient
        # is sparse (IndexedSlices), which hvd_quant's 1-bit optimizers do not take.
        tokens = ops.matmul(ops.one_hot(idx, self.vocab), self.tok)
        x = tokens + self.pos[:ops.shape(idx)[1]]
        for block in self.blocks:
            x = block(x)
        return ops.matmul(self.ln_f(x), ops.transpose(self.tok))


@keras.saving.register_keras_serializable(package="hvd_quant_examples")
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """``stdlib_text.lr_at`` in graph ops: linear warm-up, then cosine decay or constant."""

    def __init__(self, peak, warmup, steps, decay="cosine", min_lr_ratio=0.1):
        self.peak, self.warmup, self.steps = float(peak), int(warmup), int(steps)
        self.decay, self.min_lr_ratio = decay, float(min_lr_ratio)

    def __call__(self, step):
        s = ops.cast(step, "float32")
        warm = self.peak * (s + 1.0) / self.warmup
        if self.decay == "constant":
            after = ops.full_like(s, self.peak)
        else:
            progress = ops.clip((s - self.warmup) / max(1, self.steps - self.warmup), 0.0, 1.0)
            low = self.min_lr_ratio * self.peak
            after = low + 0.5 * (self.peak - low) * (1.0 + ops.cos(math.pi * progress))
        return ops.where(s < self.warmup, warm, after)

    def get_config(self):
        return {"peak": self.peak, "warmup": self.warmup, "steps": self.steps, "decay": self.decay,
                "min_lr_ratio": self.min_lr_ratio}


def make_optimizer(args, schedule):
    """The optimizer named by ``--optimizer`` (Keras 3)."""
    if args.optimizer == "adam":
        return keras.optimizers.Adam(schedule, beta_1=args.beta, beta_2=args.beta2, epsilon=args.eps,
                                     weight_decay=args.weight_decay or None)
    if args.optimizer == "sgdm":
        return keras.optimizers.SGD(schedule, momentum=args.beta, weight_decay=args.weight_decay or None)
    cls = getattr(hq, {"onebit_adam": "OnebitAdam", "zero_one_adam": "ZeroOneAdam",
                       "binsgdm": "BinSGDM"}[args.optimizer], None)
    if cls is None:
        raise SystemExit(f"--optimizer {args.optimizer}: this hvd_quant has no Keras implementation "
                         "of it yet (hvd_quant.tensorflow lacks the class); use adam or sgdm")
    if args.optimizer == "onebit_adam":
        return cls(learning_rate=schedule, freeze_step=args.freeze_step, betas=(args.beta, args.beta2),
                   eps=args.eps, weight_decay=args.weight_decay, scales=args.scales)
    if args.optimizer == "zero_one_adam":
        return cls(learning_rate=schedule, betas=(args.beta, args.beta2), eps=args.eps,
                   weight_decay=args.weight_decay, var_freeze_step=args.var_freeze_step, var_update_scaler=args.var_update_scaler,
                   local_step_scaler=args.local_step_scaler, local_step_clipper=args.local_step_clipper,
                   scales=args.scales)
    return cls(learning_rate=schedule, betas=(args.beta,), weight_decay=args.weight_decay, seed=args.seed)


def token_loss(y, logits):
    return ops.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))


def make_evaluator(model, chunk=64):
    @tf.function
    def summed(x, y):
        logits = model(x, training=False)
        return tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))

    def evaluate(x, y):
        """Mean next-byte cross-entropy (nats) over the validation windows."""
        total = sum(float(summed(x[i:i + chunk], y[i:i + chunk])) for i in range(0, len(x), chunk))
        return total / y.size

    return evaluate


class FitLoop:
    """hvd_quant's Keras optimizers: ``model.compile`` + one ``model.fit`` per evaluation
    interval (Keras keeps the traced train function between calls)."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        model.compile(optimizer=opt, loss=token_loss, jit_compile=False)
        self.callbacks = [hq.callbacks.BroadcastGlobalVariablesCallback(root_rank=0)]

    def run(self, x, y, batch):
        history = self.model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                                 callbacks=self.callbacks)
        self.callbacks = []  # broadcast once, at the start of training
        return float(history.history["loss"][-1])

    def bytes_sent(self, steps):
        return float(self.opt.bytes_sent)

    def comm_rounds(self, steps):
        return int(self.opt.comm_rounds)

    def kind_counts(self, steps):
        return {k: v for k, v in self.opt.kind_counts.items() if v}


class TapeLoop:
    """The fp32 baselines: a custom loop with ``hq.DistributedGradientTape``."""

    def __init__(self, model, opt):
        self.model, self.opt, self.tapes = model, opt, []
        hq.broadcast_variables(model.variables, root_rank=0)  # Keras 3 variables: ours, not hvd's
        # One compressor object for every trace: its state (and random-stream variable) is
        # created on the first trace and must be reused, not recreated, by a re-trace.
        compression = hq.Compression.none

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = token_loss(y, model(x, training=True))
            tape = hq.DistributedGradientTape(tape, compression=compression)
            self.tapes.append(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        self.train_step = train_step

    def run(self, x, y, batch):
        losses = [float(self.train_step(x[i:i + batch], y[i:i + batch])) for i in range(0, len(x), batch)]
        return float(np.mean(losses))

    def bytes_sent(self, steps):
        # The tape counts when the reduction is traced (once), so its meter holds one
        # step's bytes plus the one-off agreement check (an allgather of 3 int64).
        per_step = self.tapes[0].bytes_sent - 24.0 * (hvd.size() - 1)
        return per_step * steps

    def comm_rounds(self, steps):
        return steps

    def kind_counts(self, steps):
        return {"full": steps}


def main():
    args = lm_arguments(__doc__.splitlines()[0])
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tf.config.threading.set_inter_op_parallelism_threads(1)  # ranks share the machine's cores
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(args.seed)
    corpus = load_corpus(args.corpus_bytes)
    batches = TrainBatches(corpus.train, args.context, args.batch, args.seed, rank)
    x_val, y_val = validation_windows(corpus.val, args.context, args.val_windows)

    model = ByteTransformer(args.context, args.d_model, args.heads, args.layers, name="byte_transformer")
    model(np.zeros((1, args.context), np.int64))  # build, so variables exist to broadcast
    schedule = WarmupDecay(args.lr, args.warmup, args.steps, args.decay, args.min_lr_ratio)
    opt = make_optimizer(args, schedule)
    loop = (TapeLoop if args.optimizer in BASELINES else FitLoop)(model, opt)
    evaluate = make_evaluator(model)
    numel = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    report = LMReport(args, "keras", rank, size, numel, corpus, hvd.allgather_object)

    done, train_time = 0, 0.0
    while done < args.steps:
        chunk = min(args.eval_every, args.steps - done)
        x, y = batches.take(chunk)
        begin = time.perf_counter()
        train_loss = loop.run(x, y, args.batch)
        train_time += time.perf_counter() - begin
        if not math.isfinite(train_loss):
            raise SystemExit(f"rank {rank}: training loss is {train_loss} by step {done + chunk}; "
                             f"lower --lr (now {args.lr})")
        done += chunk
        lr = float(schedule(done - 1))
        report.evaluation(done, lr, train_loss, evaluate(x_val, y_val), loop.bytes_sent(done),
                          loop.comm_rounds(done), train_time / done)
    digest = weights_digest([v.numpy() for v in model.trainable_variables])
    report.finish(loop.kind_counts(args.steps), digest, int(getattr(opt, "skipped_steps", 0)))


if __name__ == "__main__":
    main()
