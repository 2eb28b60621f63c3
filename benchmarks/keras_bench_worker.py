"""What each rank runs in ``benchmarks/bench_keras.py``: Keras 3 ``model.fit`` per batch,
every method, with the fp32 allreduce and the compute floor measured beside each one.

    python -m hvd_quant.cluster run --hosts 2 --rate 1gbit -- \\
        .venv/bin/python benchmarks/keras_bench_worker.py --out r.json
    .venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/keras_bench_worker.py

The model (:func:`build_model`, 29,334,272 parameters): ``Embedding(32000, 384)``, four
residual MLP blocks (``384 -> 1536 -> 384``, ReLU) and a 32000-way head on every token,
trained with sparse categorical cross-entropy to predict the next token, ``--batch``
sequences of ``--seq`` tokens per rank and step. The embedding's gradient is a
``tf.IndexedSlices``, made dense by hvd_quant (``sparse_as_dense``, the default).

Data (``--data stdlib``, the default): word-level tokens of the Python standard library's
source (``examples/stdlib_text.py``, ``load_word_text``: the vocabulary is the model's, built
from the training files). Each rank draws its own stream of windows (``TrainBatches``,
seeded by ``(seed, rank)``), all of it before any timing; every method, the baseline and
the floor each walk through that same sequence, a new batch every step. After its timed
rounds each method's loss on fixed held-out windows is measured (untimed) and recorded
with its last training loss. ``--data random`` is the earlier workload: one fixed set of
uniform random tokens (inputs and targets independent) reused every call, whose loss only
measures memorisation. The raw JSON's ``config.data`` records the source and the corpus
and vocabulary digests.

Methods (all with their users' defaults, apart from the 1-bit optimizers' schedules,
which are set so that every timed step communicates at 1 bit):

* ``fp32``: ``hq.DistributedOptimizer(Adam, compression=Compression.none)``, Horovod's fp32
  allreduce of the fused gradient: the baseline;
* ``floor``: Keras' ``Adam`` with no communication at all: the compute floor;
* every compressor through ``hq.DistributedOptimizer(Adam, compression=...)``;
* ``opt=onebit_adam`` (``freeze_step=2``: 1-bit from step 3), ``opt=zero_one_adam``
  (``var_freeze_step=1``: a 1-bit sync at every step, its most expensive step) and
  ``opt=binsgdm``;
* ``tape:<name>``: a custom loop, ``tf.function`` around ``hq.DistributedGradientTape``
  and ``Adam.apply_gradients``;
* ``<compressor>@probe<N>``: the compressor row with ``metrics=True, probe_every=N``
  (``report_after=0``, as ``benchmarks/monitoring_overhead.py`` sets it): what issue 54's
  metrics cost in Keras, against the same row without ``@`` (metrics off, the default);
* ``<compressor>@pyfunc``: a diagnosis, not a user's setting: metrics off, but the
  reduction built as metrics on built it until 2026-12-08 (and still does on probe
  steps), one ``tf.py_function`` per step running the eager code
  (:func:`hvd_quant.tensorflow.tape.reduce_when_the_graph_runs`), with nothing measured.

Timing protocol: the baseline and the floor are built once and live for the whole job.
Each method in turn is built, warmed up (tracing, first-step checks, the optimizers'
warm-up phases) and then timed for ``--repeats`` rounds; a round runs ``--chunk`` batches
of the method, the baseline and the floor, in an order rotated by one per round, each
chunk one ``fit`` call (or loop) after a barrier. A batch's time is the time from Keras'
``on_train_batch_begin`` to ``on_train_batch_end`` (the step of a custom loop) on the
slowest rank. Then the method is freed before the next is built, so memory holds the
baseline, the floor and one method at a time.

``--paired LABEL`` builds one more row once, like the baseline, and runs its chunk next to
each method's in every round (after it in even rounds, before it in odd ones). This
machine's step moves between modes some 15% apart for tens of steps at a time, in every
row (issue 54, ``benchmarks/reference/keras-metrics-paired-2026-12-07/``), so rows timed
minutes apart cannot resolve a cost of 1-2%; a method against its paired twin (say
``ef_sign@probe100`` against ``ef_sign``) chunk by chunk can.

Threads: TensorFlow's intra-op and inter-op pools are set to this rank's share of the
host's usable cores (``hvd_quant.kernels.threads``: affinity and cgroup quota, divided by
the ranks on this host), which is what the README recommends; nothing else is set.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # hvd_quant from this checkout

sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "examples"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

import stdlib_text  # noqa: E402  (the word-level stdlib text the model trains on)
from hvd_quant.kernels import threads as kernel_threads  # noqa: E402

VOCAB, DIM, FF, BLOCKS = 32000, 384, 1536, 4
#: Compressor configurations timed (``name`` or ``name:option=value``).
COMPRESSORS = ("fp16", "ef_sign", "marsit", "cascading_sign", "global_qsgd", "global_qsgd:norm=l2",
               "global_qsgd_exp", "onebit")
OPTIMIZERS = ("opt=onebit_adam", "opt=zero_one_adam", "opt=binsgdm")
TAPES = ("tape:none", "tape:ef_sign", "tape:marsit", "tape:onebit", "tape:global_qsgd")
DEFAULT_METHODS = COMPRESSORS + OPTIMIZERS + TAPES


def build_model(keras, seq, seed=0, vocab=VOCAB):
    """The 29.3M-parameter token model (see the module docstring; ``vocab`` tokens, 32000
    by default); the same weights on every rank and for every method (one seed)."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(vocab, DIM, name="embedding")(tokens)
    for i in range(BLOCKS):
        up = keras.layers.Dense(FF, activation="relu", name=f"block{i}_up")(h)
        h = keras.layers.Add(name=f"block{i}_add")([h, keras.layers.Dense(DIM, name=f"block{i}_down")(up)])
    return keras.Model(tokens, keras.layers.Dense(vocab, name="head")(h), name="tokens")


def parse_config(config):
    name, _, text = config.partition(":")
    return name, dict(kv.split("=", 1) for kv in text.split(",") if kv)


def metrics_options(suffix):
    """``DistributedOptimizer``'s monitoring arguments for a label's ``@`` suffix:
    ``probe<N>`` is ``metrics=True, probe_every=N`` without the "does it pay" line; none
    is metrics off (the default)."""
    if not suffix or suffix == "pyfunc":
        return {}
    if not suffix.startswith("probe") or not suffix[len("probe"):].isdigit():
        raise SystemExit(f"keras_bench_worker: unknown suffix @{suffix} (expected @probe<N>, e.g. @probe0)")
    return {"metrics": True, "probe_every": int(suffix[len("probe"):]), "report_after": 0}


def py_function_reduction(hq):
    """``hq.DistributedOptimizer`` whose compiled step reduces as ``metrics=True`` did until
    2026-12-08 (one ``tf.py_function`` running the eager reduction) with metrics off: the ``@pyfunc``
    diagnosis. Every variable is shared and there is no loss scaling in these rows."""
    from hvd_quant.tensorflow.tape import check_agreement_once, reduce_when_the_graph_runs

    class PyFunctionReduction(hq.DistributedOptimizer):
        def _reduce(self, grads, variables, scaling):
            if tf.executing_eagerly() or scaling or len(self._shared(variables)) != len(variables):
                return super()._reduce(grads, variables, scaling)
            check_agreement_once(self._runner, self._comm, variables, self._fuse_groups)
            return reduce_when_the_graph_runs(self._reduce_shared, grads, variables, self._fuse_groups,
                                              self._sparse_as_dense, "DistributedOptimizer", owner=self)
    return PyFunctionReduction


class BatchTimer:
    """Keras callback: the seconds of every training batch (begin to end)."""

    def __init__(self, keras):
        class Timer(keras.callbacks.Callback):
            def on_train_batch_begin(inner, batch, logs=None):
                inner.start = time.perf_counter()

            def on_train_batch_end(inner, batch, logs=None):
                self.times.append(time.perf_counter() - inner.start)
        self.times = []
        self.callback = Timer()


class Method:
    """One timed configuration: ``run(batches)`` returns that many batch times, training
    on the next ``batches`` batches of the pre-drawn pool (its own cursor, from the start)."""

    def __init__(self, label, args, keras, data):
        import hvd_quant.tensorflow as hq

        self.label, self.args, self.keras = label, args, keras
        self.x, self.y = data
        self.cursor = 0  # batches of the pool used so far
        self.last_loss = None
        self.model = build_model(keras, args.seq, vocab=args.vocab)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.loss_fn = loss
        self.opt, self.tape_fn, self.tape = None, None, None
        self.warmup = 2
        if label.startswith("tape:"):
            self._tape(hq, loss, label[len("tape:"):])
            return
        if label == "floor":
            opt = keras.optimizers.Adam(args.lr)
        elif label == "fp32":
            opt = hq.DistributedOptimizer(keras.optimizers.Adam(args.lr), compression=hq.Compression.none)
        elif label.startswith("opt="):
            name = label[len("opt="):]
            lr = args.onebit_adam_lr
            opt = {"onebit_adam": lambda: hq.OnebitAdam(lr, freeze_step=2),
                   "zero_one_adam": lambda: hq.ZeroOneAdam(lr, var_freeze_step=1),
                   "binsgdm": lambda: hq.BinSGDM(args.lr)}[name]()
            self.warmup = {"onebit_adam": 4, "zero_one_adam": 3, "binsgdm": 2}[name]
        else:
            config, _, measured = label.partition("@")
            name, options = parse_config(config)
            cls = py_function_reduction(hq) if measured == "pyfunc" else hq.DistributedOptimizer
            opt = cls(keras.optimizers.Adam(args.lr), compression=hq.Compression.get(name, **options),
                      **metrics_options(measured))
        self.opt = opt
        self.model.compile(optimizer=opt, loss=loss, jit_compile=False)

    def _tape(self, hq, loss_fn, config):
        name, options = parse_config(config)
        compression = hq.Compression.get(name, **options)
        model, opt = self.model, self.keras.optimizers.Adam(self.args.lr)
        self.opt = opt

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            tape = hq.DistributedGradientTape(tape, compression=compression)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            self.tape = tape
            return loss
        self.tape_fn = step

    def next_batches(self, batches):
        """The next ``batches`` batches of the pool (wrapping at its end), as arrays of
        ``batches * batch`` rows: sliced here, before any timing."""
        b, pool = self.args.batch, len(self.x) // self.args.batch
        start = 0 if self.args.data == "random" else self.cursor  # random: the same batches every call
        rows = (np.arange(start, start + batches) % pool)[:, None] * b + np.arange(b)
        self.cursor += batches
        rows = rows.reshape(-1)
        return self.x[rows], self.y[rows]

    def run(self, batches):
        b = self.args.batch
        x, y = self.next_batches(batches)
        if self.tape_fn is not None:
            times = []
            for i in range(batches):
                xb, yb = tf.constant(x[i * b:(i + 1) * b]), tf.constant(y[i * b:(i + 1) * b])
                t = time.perf_counter()  # timed: the step alone (the batch is on hand already)
                loss = self.tape_fn(xb, yb).numpy()
                times.append(time.perf_counter() - t)
            self.last_loss = float(loss)
            return times
        # Timed: each batch from Keras' on_train_batch_begin to on_train_batch_end (the
        # arrays were sliced above; fit's own per-batch slicing happens outside that span).
        timer = BatchTimer(self.keras)
        history = self.model.fit(x, y, batch_size=b, epochs=1, verbose=0, shuffle=False,
                                 callbacks=[timer.callback])
        self.last_loss = float(history.history["loss"][-1])  # fit's mean over these batches
        return timer.times

    def validation_loss(self, val):
        """Mean loss on the held-out windows (untimed, no update)."""
        vx, vy = val
        return float(self.loss_fn(vy, self.model(vx, training=False)))

    def losses(self, val):
        return {"train_loss": self.last_loss, "val_loss": self.validation_loss(val), "steps": self.cursor}

    def bytes_sent(self):
        if self.tape is not None:  # counted once per trace: bytes per step
            return float(self.tape.bytes_sent)
        return float(getattr(self.opt, "bytes_sent", 0.0) or 0.0)

    def kind(self):
        kind = getattr(self.opt, "last_step_kind", None)
        return kind if isinstance(kind, str) else ""

    def skipped(self):
        """Steps the optimizer skipped so far (values not finite: such a step does less
        work, so timed ones are reported); 0 for optimizers that never skip."""
        count = getattr(self.opt, "skipped_steps", None)
        return int(float(count)) if count is not None else 0


def barrier():
    hvd.allreduce(tf.constant(0.0), name="bench.barrier", op=hvd.Sum)


def log(msg):
    if hvd.rank() == 0:
        print(f"[keras-bench] {msg}", flush=True)


def set_threads():
    """TensorFlow's pools sized to this rank's share of the host (the README's advice)."""
    cores, cores_why = kernel_threads.usable_cores()
    local, local_why = kernel_threads.local_ranks()
    share = max(1, cores // max(1, local))
    tf.config.threading.set_intra_op_parallelism_threads(share)
    tf.config.threading.set_inter_op_parallelism_threads(share)
    return {"tf_intra_op": share, "tf_inter_op": share, "cores": cores, "cores_why": cores_why,
            "local_ranks": local, "local_ranks_why": local_why}


def pool_batches(args):
    """Batches to pre-draw: the baseline and the floor run 2 warm-up batches and
    ``--chunk`` per round with every method; a method at most 5 (warm-up and the bytes
    step) and its rounds; the ``--paired`` twin its warm-up, one untimed batch after each
    method is built and the rounds. No walk reaches the end of the pool (it would wrap)."""
    return 8 + max(1, len(args.methods)) * (args.repeats * args.chunk + 1)


def load_data(args, rank):
    """``((x, y), (val_x, val_y), description)``: this rank's pool of training batches,
    ``pool_batches(args) * batch`` rows of ``seq`` tokens (targets: the next tokens), the
    held-out windows, and what the data is (JSON)."""
    if args.data == "random":
        # The earlier workload: the same uniform tokens every call, inputs and targets
        # independent (nothing to learn but the batch itself).
        rng = np.random.default_rng(1000 + rank)
        n = args.batch * max(args.chunk, 8)
        data = (rng.integers(0, args.vocab, (n, args.seq)).astype("int32"),
                rng.integers(0, args.vocab, (n, args.seq)).astype("int32"))
        rng = np.random.default_rng(2000)
        val = tuple(rng.integers(0, args.vocab, (args.val_windows, args.seq)).astype("int32") for _ in "xy")
        return data, val, {"data": "random", "vocab_size": args.vocab}
    text = stdlib_text.load_word_text_once_per_host(hvd.local_rank() == 0, barrier, args.vocab, args.seq,
                                                   args.batch, max_bytes=args.corpus_bytes)
    x, y = stdlib_text.TrainBatches(text.train, args.seq, args.batch, args.seed, rank).take(pool_batches(args))
    vx, vy = stdlib_text.validation_windows(text.val, args.seq, args.val_windows)
    return ((x.astype("int32"), y.astype("int32")), (vx.astype("int32"), vy.astype("int32")),
            text.summary())


def measure(args):
    threads = set_threads()  # before TensorFlow's runtime starts
    hvd.init()
    import keras
    from hvd_quant import kernels
    from hvd_quant.kernels.buffers import RESULTS

    rank, size = hvd.rank(), hvd.size()
    threads["kernels"] = kernel_threads.describe()
    log(f"{size} ranks; TensorFlow intra-op {threads['tf_intra_op']}, inter-op {threads['tf_inter_op']} "
        f"thread(s) per rank ({threads['cores']} usable cores: {threads['cores_why']}; "
        f"{threads['local_ranks']} rank(s) on this host: {threads['local_ranks_why']}); {threads['kernels']}")
    data, val, data_info = load_data(args, rank)
    log("data: " + ", ".join(f"{k} {v}" for k, v in data_info.items()))
    from hvd_quant.tensorflow.kernels import prepare_kernels
    prepare_kernels()  # kernels loaded, thread policy applied, before any timing

    t0 = time.perf_counter()
    reference = {name: Method(name, args, keras, data) for name in ("fp32", "floor")}
    for m in reference.values():
        barrier()
        m.run(2)
    log(f"baseline and floor built and warmed up ({time.perf_counter() - t0:.1f} s); "
        f"{reference['fp32'].model.count_params():,} parameters, batch {args.batch} x {args.seq} tokens")
    signatures = kernels.loaded_signatures()

    paired = None
    if args.paired:  # built once, like the baseline, and run beside every row (--paired)
        paired = Method(args.paired, args, keras, data)
        for _ in range(paired.warmup + 1):
            barrier()
            paired.run(1)
        log(f"paired row {args.paired} built and warmed up")

    results = {}
    for label in args.methods:
        t0 = time.perf_counter()
        method = Method(label, args, keras, data)
        for _ in range(method.warmup):
            barrier()
            method.run(1)
        before = method.bytes_sent()
        barrier()
        method.run(1)
        sent = method.bytes_sent() - before if method.tape is None else method.bytes_sent()
        if paired is not None:  # untimed: its first step after a row was freed took 0.7-1.6 s
            barrier()
            paired.run(1)
        log(f"{label}: built and warmed up in {time.perf_counter() - t0:.1f} s; "
            f"{sent / 1e6:.2f} MB sent per step; last step {method.kind() or '-'}")
        times = {label: [], "fp32": [], "floor": [], "paired": []}
        kinds = set()
        skipped_before = method.skipped()
        for rep in range(args.repeats):
            order = [label, "fp32", "floor"]
            order = order[rep % 3:] + order[:rep % 3]
            if paired is not None:  # next to the row, first every other round
                at = order.index(label)
                order[at:at + 1] = [label, "paired"] if rep % 2 == 0 else ["paired", label]
            for name in order:
                runner = method if name == label else paired if name == "paired" else reference[name]
                barrier()
                times[name] += runner.run(args.chunk)
                if name == label and method.kind():
                    kinds.add(method.kind())
            log(f"  round {rep + 1}/{args.repeats}: " + ", ".join(
                f"{name} {1e3 * statistics.median(times[name][-args.chunk:]):.0f} ms"
                for name in (label, "fp32", "floor") + (("paired",) if paired is not None else ())))
        skipped = method.skipped() - skipped_before
        if skipped:
            log(f"{label}: {skipped} timed step(s) skipped (values not finite): not comparable")
        results[label] = {"times_s": times[label], "fp32_s": times["fp32"], "floor_s": times["floor"],
                          "sent_bytes": sent, "kinds": sorted(kinds), "skipped_steps": skipped,
                          "loss": method.losses(val)}
        if paired is not None:
            results[label]["paired_s"] = times["paired"]
        log(f"{label}: loss {results[label]['loss']['train_loss']:.3f} (last batches), held-out "
            f"{results[label]['loss']['val_loss']:.3f} after {method.cursor} steps")
        del method
        gc.collect()
        RESULTS.release()

    fp32_sent = reference["fp32"].bytes_sent() / max(1, int(reference["fp32"].opt.iterations.numpy()))
    gathered = hvd.allgather_object(results, name="bench.results")
    config = {"ranks": size, "hosts": int(os.environ.get("HVDQ_CLUSTER_HOSTS", 0)) or None,
              "rate_bps": float(os.environ.get("HVDQ_CLUSTER_RATE_BPS", 0)) or None,
              "batch": args.batch, "seq": args.seq, "chunk": args.chunk, "repeats": args.repeats,
              "paired": args.paired or None,
              "parameters": int(reference["fp32"].model.count_params()), "threads": threads,
              "fp32_sent_bytes": fp32_sent, "data": data_info,
              "reference_loss": {name: m.losses(val) for name, m in reference.items()},
              "new_kernel_signatures_while_timing": kernels.loaded_signatures() - signatures}
    return rank, {"config": config, "per_rank": gathered}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated labels")
    p.add_argument("--repeats", type=int, default=4, help="rounds per method")
    p.add_argument("--chunk", type=int, default=2, help="batches per method per round")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per batch")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=VOCAB, help="tokens in the embedding and the head "
                                                              "(a smaller model for a quick look)")
    p.add_argument("--lr", type=float, default=1e-4)
    stdlib_text.add_data_arguments(p, "one fixed set of random tokens reused every call")
    p.add_argument("--seed", type=int, default=0, help="the batch streams' seed (with the rank)")
    # Their variance is frozen after one or two steps (so that every timed step is a 1-bit
    # one), and Adam's step is then many times the learning rate: with --chunk 3, 15 of 15
    # timed steps were skipped (values not finite) at 1e-4, 9 at 1e-5, none at 1e-7
    # (2026-11-26). A skipped step does less work; the job reports any. See also
    # cluster_worker.ONEBIT_ADAM_LR.
    p.add_argument("--onebit-adam-lr", type=float, default=1e-7,
                   help="learning rate of OnebitAdam and ZeroOneAdam (default 1e-7)")
    p.add_argument("--paired", default="", metavar="LABEL",
                   help="a row built once and run next to every method in each round (paired_s in the "
                        "JSON): the cost of an option against its twin without it, on the same machine state")
    p.add_argument("--out", default="", help="rank 0 writes the raw results here (JSON)")
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    rank, result = measure(args)
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
