"""Runs inside every rank for tests/test_keras.py: Keras 3 ``model.fit`` with
``hvd_quant.tensorflow.DistributedOptimizer`` and the callbacks, or (``legacy``, under
``TF_USE_LEGACY_KERAS=1``) tf-keras ``model.fit`` with Horovod's own
``hvd.keras.DistributedOptimizer`` and our compressors.

``python keras_worker.py MODE OUTDIR`` writes ``OUTDIR/rank{r}.json``. Checks that are
expected to raise record the error instead.
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import hvd_quant.tensorflow as hq
from logged import captured_warnings

MODE, OUT = sys.argv[1], Path(sys.argv[2])
COMPRESSORS = ["none", "fp16", "ef_sign", "marsit", "cascading_sign", "global_qsgd",
               "global_qsgd:norm=l2", "global_qsgd_exp", "onebit"]
STEPS, BATCH = 6, 16

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
results = {"rank": RANK, "size": SIZE}


def record(key, fn):
    started = time.perf_counter()
    try:
        results[key] = fn()
    except Exception as exc:  # recorded for the test to judge
        results[key] = {"error": type(exc).__name__, "message": str(exc)[:2000]}
    if RANK == 0:  # where a slow job's time goes (printed in a failing test's output)
        print(f"keras_worker: {key} {time.perf_counter() - started:.1f} s", flush=True)


def compression(config):
    name, _, opts = config.partition(":")
    options = dict(kv.split("=") for kv in opts.split(",") if kv)
    return hq.Compression.get(name, **options)


def data(seed=0, n=STEPS * BATCH):
    """This rank's shard of a fixed 3-class problem (different on every rank)."""
    rng = np.random.default_rng(1000 + 17 * RANK + seed)
    x = rng.standard_normal((n, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5).astype("int64")
    return x, y


def digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
    return h.hexdigest()[:16]


def weights(model):
    return [v.numpy() for v in model.trainable_variables]


# --- Keras 3 -----------------------------------------------------------------------------------
def keras3():
    import keras
    return keras


def make_model(keras, seed=0, name="net"):
    # Explicit names: state is keyed by variable path within the optimizer.
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="hidden"),
                             keras.layers.Dense(3, name="out")], name=name)


def compile_model(keras, model, comp, lr=0.1, **kwargs):
    opt = hq.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9), compression=comp)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **kwargs)
    return opt


def fit_every_compressor():
    """Each compressor: a few fit steps; weights identical on every rank, loss goes down."""
    keras = keras3()
    x, y = data()
    out = {}
    for config in COMPRESSORS:
        model = make_model(keras, seed=RANK)  # different on purpose: the callback broadcasts
        opt = compile_model(keras, model, compression(config), jit_compile=False)
        hist = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
                         callbacks=[hq.callbacks.BroadcastGlobalVariablesCallback(0),
                                    hq.callbacks.MetricAverageCallback()])
        out[config] = {"digest": digest(weights(model)), "loss": hist.history["loss"],
                       "bytes": opt.bytes_sent, "finite": bool(all(np.isfinite(w).all() for w in weights(model))),
                       "iterations": int(opt.iterations.numpy())}
    return out


def checkpoint_resumes_exactly():
    """ModelCheckpoint per rank after epoch 1; a model loaded from it continues exactly
    like the uninterrupted run (compressor residuals and random streams restored)."""
    keras = keras3()
    x, y = data(seed=5)
    out = {}
    for config in ("ef_sign", "marsit", "global_qsgd", "onebit"):
        path = str(OUT / f"ckpt-{config}-rank{RANK}-epoch{{epoch}}.keras")
        model = make_model(keras)
        compile_model(keras, model, compression(config))
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                  callbacks=[keras.callbacks.ModelCheckpoint(path)])
        uninterrupted = weights(model)
        state_vars = [v.path for v in model.optimizer.variables if "hvd_quant" in v.path]
        restored = keras.models.load_model(path.format(epoch=1))
        restored.fit(x, y, batch_size=BATCH, epochs=2, initial_epoch=1, verbose=0, shuffle=False)
        out[config] = {"equal": all(np.array_equal(a, b) for a, b in zip(uninterrupted, weights(restored))),
                       "state_variables": state_vars,
                       "optimizer": type(restored.optimizer).__name__,
                       "compression": repr(restored.optimizer._compression)}
    return out


def jit_compile_refused():
    keras = keras3()
    x, y = data()
    model = make_model(keras)
    compile_model(keras, model, hq.Compression.ef_sign, jit_compile=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    return "no error"


def jit_compile_refused_onebit():
    keras = keras3()
    x, y = data()
    model = make_model(keras)
    model.compile(optimizer=hq.OnebitAdam(1e-2, freeze_step=2), jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    return "no error"


def jit_compile_split():
    """jit_compile=True with JitCompileCallback: XLA runs forward and backward, the
    reduction runs outside. Same losses as jit_compile=False, ranks identical."""
    keras = keras3()
    x, y = data()
    out = {}
    optimizers = {"ef_sign": lambda: hq.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                            compression=hq.Compression.ef_sign),
                  "marsit": lambda: hq.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                           compression=hq.Compression.marsit),
                  "onebit_adam": lambda: hq.OnebitAdam(3e-3, freeze_step=6)}
    for name, make_opt in optimizers.items():
        for jit in (False, True):
            model = make_model(keras, seed=RANK)
            model.compile(optimizer=make_opt(), jit_compile=jit, metrics=["accuracy"],
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            hist = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
                             callbacks=[hq.callbacks.BroadcastGlobalVariablesCallback(0),
                                        hq.callbacks.JitCompileCallback()])
            out[f"{name}/{'jit' if jit else 'plain'}"] = {
                "digest": digest(weights(model)), "loss": hist.history["loss"],
                "accuracy": hist.history["accuracy"], "jit_compile_after": bool(model.jit_compile),
                "bytes": float(model.optimizer.bytes_sent)}
    return out


def loss_scale_outside_refused():
    """LossScaleOptimizer(DistributedOptimizer(...)) would check local gradients: refused."""
    keras = keras3()
    x, y = data()
    model = make_model(keras)
    inner = hq.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hq.Compression.ef_sign)
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(inner),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    return "no error"


def callbacks_behave():
    """Broadcast (per-rank state kept), metric averaging, learning-rate warmup."""
    keras = keras3()
    x, y = data(seed=9)

    class RankMetric(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["rank_metric"] = float(RANK)

    class Capture(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.lrs, self.logs = [], []

        def on_train_batch_begin(self, batch, logs=None):
            self.lrs.append(float(self.model.optimizer.learning_rate.numpy()))

        def on_epoch_end(self, epoch, logs=None):
            self.logs.append(dict(logs))

    model = make_model(keras, seed=100 + RANK)
    opt = compile_model(keras, model, hq.Compression.ef_sign, lr=0.2)
    capture = Capture()
    model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
              callbacks=[hq.callbacks.BroadcastGlobalVariablesCallback(0),
                         hq.callbacks.LearningRateWarmupCallback(0.2, warmup_epochs=2),
                         RankMetric(), hq.callbacks.MetricAverageCallback(), capture])
    residual = [v.numpy() for v in opt.per_rank_variables if "residual" in v.path]
    shared = [v.numpy() for v in opt.variables
              if all(v is not p for p in opt.per_rank_variables)]
    return {"weights": digest(weights(model)), "residual": digest(residual),
            "shared_optimizer_variables": digest(shared), "lrs": capture.lrs,
            "rank_metric": [l["rank_metric"] for l in capture.logs],
            "loss": [l["loss"] for l in capture.logs], "steps": STEPS}


def fit_embedding():
    """A Keras Embedding (its gradient is always tf.IndexedSlices) in model.fit, with a
    compressor (also with metrics on, where the reduction runs in a py_function) and with
    each 1-bit optimizer: made dense by default (sparse_as_dense), identical weights on
    every rank; with sparse_as_dense=False (Horovod's default) the same, and one warning
    on rank 0."""
    keras = keras3()
    rng = np.random.default_rng(70 + RANK)
    tokens = rng.integers(0, 40, (STEPS * BATCH, 5)).astype("int32")
    y = (tokens[:, 0] % 3).astype("int64")
    optimizers = {"ef_sign": lambda: hq.DistributedOptimizer(keras.optimizers.Adam(3e-2),
                                                             compression=hq.Compression.ef_sign),
                  # measured: the reduction runs in a py_function, the rows handed in as slices
                  "ef_sign@metrics": lambda: hq.DistributedOptimizer(keras.optimizers.Adam(3e-2),
                                                                     compression=hq.Compression.ef_sign,
                                                                     metrics=True, report_after=0),
                  "onebit_adam": lambda: hq.OnebitAdam(3e-3, freeze_step=4),
                  "zero_one_adam": lambda: hq.ZeroOneAdam(3e-3, var_freeze_step=4, exact_sync=True),
                  "binsgdm": lambda: hq.BinSGDM(3e-2)}
    out = {}
    for name, make in optimizers.items():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(40, 8, name="emb"),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3, name="out")])
        model.compile(optimizer=make(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        hist = model.fit(tokens, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
                         callbacks=[hq.callbacks.FinalSyncCallback()])
        out[name] = {"digest": digest(weights(model)), "loss": hist.history["loss"]}
    # sparse_as_dense=False (Horovod's default): reduced as dense all the same, with the
    # same weights as the default; rank 0 says so once.
    with captured_warnings() as messages:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(40, 8, name="emb"),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3, name="out")])
        model.compile(optimizer=hq.DistributedOptimizer(keras.optimizers.Adam(3e-2), compression=hq.Compression.ef_sign,
                                                        sparse_as_dense=False),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        hist = model.fit(tokens, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
                         callbacks=[hq.callbacks.FinalSyncCallback()])
    out["sparse_as_dense=False"] = {"digest": digest(weights(model)), "loss": hist.history["loss"],
                                    "warnings": [m for m in messages if "sparse_as_dense=False" in m]}
    return out


def local_sources():
    """Model parallelism on Keras 3 (Horovod's own tapes fail there, horovod #4290): an
    embedding whose gradient stays local, the rest averaged. Every compressor, through
    ``register_local_source`` eagerly and ``PartialDistributedGradientTape`` in a
    ``tf.function``; per run the local gradient as given and as computed, and the
    shared gradients beside those of a tape over the shared variables alone (a twin model
    with the same values: its own compressor state)."""
    keras = keras3()
    rng = np.random.default_rng(80 + RANK)
    tokens = rng.integers(0, 20, (BATCH, 4)).astype("int32")
    y = (tokens[:, 0] % 3).astype("int64")

    def build():
        keras.utils.set_random_seed(5)
        emb = keras.layers.Embedding(20, 6, name="emb")
        model = keras.Sequential([keras.Input((4,), dtype="int32"), emb, keras.layers.GlobalAveragePooling1D(),
                                  keras.layers.Dense(3, name="out")], name="mp")
        return model, emb

    def loss_of(model):
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(tokens), from_logits=True))

    out = {}
    for config in COMPRESSORS:
        for kind, compiled in (("register", False), ("partial", True)):
            comp = compression(config)
            model, emb = build()
            twin, twin_emb = build()
            shared = [v for v in model.trainable_variables if v is not emb.embeddings]
            twin_shared = [v for v in twin.trainable_variables if v is not twin_emb.embeddings]

            def step():
                with tf.GradientTape(persistent=True) as tape:
                    loss = loss_of(model)
                raw = tape.gradient(loss, emb.embeddings)
                if kind == "register":
                    dist = hq.DistributedGradientTape(tape, compression=comp)
                    dist.register_local_source(emb.embeddings)
                else:
                    dist = hq.PartialDistributedGradientTape(tape, compression=comp, local_layers=[emb])
                grads = dist.gradient(loss, model.trainable_variables)
                with tf.GradientTape() as tape2:
                    loss2 = loss_of(twin)
                twin_grads = hq.DistributedGradientTape(tape2, compression=comp).gradient(loss2, twin_shared)
                return raw, grads, twin_grads

            raw, grads, twin_grads = (tf.function(step) if compiled else step)()
            by_var = {id(v): g for v, g in zip(model.trainable_variables, grads)}
            local = tf.convert_to_tensor(by_var[id(emb.embeddings)]).numpy()
            out[f"{config}/{kind}"] = {
                "local": local.tolist(),
                "local_expected": (tf.convert_to_tensor(raw).numpy() / np.float32(SIZE)).tolist(),
                "shared": digest([tf.convert_to_tensor(by_var[id(v)]).numpy() for v in shared]),
                "shared_alone": digest([tf.convert_to_tensor(g).numpy() for g in twin_grads])}
    return out


def partial_optimizer_fit():
    """``PartialDistributedOptimizer`` in ``model.fit``: the embedding trains on each rank's
    own gradients (its weights end different), the dense layer on the averaged ones (the
    same on every rank). ``register_local_var`` after the first step is refused."""
    keras = keras3()
    rng = np.random.default_rng(90 + RANK)
    tokens = rng.integers(0, 20, (STEPS * BATCH, 4)).astype("int32")
    y = (tokens[:, 0] % 3).astype("int64")
    keras.utils.set_random_seed(6)
    emb = keras.layers.Embedding(20, 6, name="emb")
    dense = keras.layers.Dense(3, name="out")
    model = keras.Sequential([keras.Input((4,), dtype="int32"), emb, keras.layers.GlobalAveragePooling1D(), dense])
    opt = hq.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), compression=hq.Compression.ef_sign,
                                         local_layers=[emb])
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(tokens, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    try:
        opt.register_local_var(dense.kernel)
        late = "no error"
    except RuntimeError as exc:
        late = str(exc)
    return {"emb": digest([emb.embeddings.numpy()]), "dense": digest([v.numpy() for v in dense.trainable_variables]),
            "loss": hist.history["loss"], "late": late}


def aggregated_passes():
    """``backward_passes_per_step=2`` with ``average_aggregated_gradients``, as Horovod's
    Keras optimizer: one reduction and one update per two batches. With exact compression
    and plain SGD that is one step on the two batches together (checked against batches
    twice the size, to float rounding); with ef_sign every rank ends the same."""
    keras = keras3()
    x, y = data(seed=4)
    out = {}
    for config, passes, batch in (("none", 2, BATCH), ("none", 1, 2 * BATCH), ("ef_sign", 2, BATCH)):
        model = make_model(keras, seed=12)
        opt = hq.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression(config),
                                      backward_passes_per_step=passes, average_aggregated_gradients=True)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        out[f"{config}/{passes}"] = {"weights": [w.tolist() for w in weights(model)],
                                     "iterations": int(opt.iterations.numpy())}
    return out


def outside_the_process_set():
    """The tape and the Keras optimizer over the even ranks' process set (registered at
    start): the even ranks average among themselves, an odd rank keeps its own gradients."""
    keras = keras3()
    x, y = data(seed=3)
    out = {}
    even = hvd.add_process_set(list(range(0, SIZE, 2)))  # HOROVOD_DYNAMIC_PROCESS_SETS=1
    for kind in ("tape", "keras"):
        model = make_model(keras, seed=11)
        if kind == "tape":
            opt = keras.optimizers.SGD(0.1)
            for i in range(2):
                with tf.GradientTape() as tape:
                    logits = model(x[i * BATCH:(i + 1) * BATCH])
                    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                        y[i * BATCH:(i + 1) * BATCH], logits, from_logits=True))
                dist = hq.DistributedGradientTape(tape, compression=hq.Compression.ef_sign, process_set=even)
                grads = dist.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
        else:
            opt = hq.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hq.Compression.ef_sign,
                                          process_set=even)
            model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(x[:2 * BATCH], y[:2 * BATCH], batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        out[kind] = {"weights": digest(weights(model)), "included": bool(even.included())}
    hvd.remove_process_set(even)
    return out


# --- tf-keras (Keras 2) ------------------------------------------------------------------------
class Layer(tf.Module):
    """A layer as PartialDistributedGradientTape reads one (``trainable_weights``), without
    Keras: its one variable is made in whatever graph is current."""

    def __init__(self, values, name):
        super().__init__(name=name)
        self.w = tf.Variable(values.astype(np.float32), name=name)

    @property
    def trainable_weights(self):
        return [self.w]


def graph_tapes():
    """The model-parallel and partial tapes while a TF1-style graph is built (Horovod's
    ``graph_mode`` tests: inside ``tf.Graph().as_default()``, directly and in a
    ``tf.function``), run by a session twice. Per run: the local gradient against the raw
    one divided by the ranks, the shared one beside what the same tape gives eagerly (a
    fresh compression object: the same state from the start); and, with per-rank values,
    the value check: a warning at the second run, or with ``strict`` an error at the first."""
    start = np.random.default_rng(90)
    emb0, dense0 = start.normal(size=(5, 3)), start.normal(size=(3, 2))
    x = np.random.default_rng(100 + RANK).normal(size=(4, 5)).astype(np.float32)

    def loss_of(emb, dense):
        return tf.reduce_sum(tf.matmul(tf.tanh(tf.matmul(x, emb.w)), dense.w) ** 2)

    def tapes(kind, comp, emb, dense, strict=None):
        with tf.GradientTape(persistent=True) as tape:
            loss = loss_of(emb, dense)
        raw = tape.gradient(loss, [emb.w, dense.w])
        if kind == "register":
            dist = hq.DistributedGradientTape(tape, compression=comp, strict=strict)
            dist.register_local_source(emb.w)
        else:
            dist = hq.PartialDistributedGradientTape(tape, compression=comp, local_layers=[emb],
                                                     strict=strict)
        return raw, dist.gradient(loss, [emb.w, dense.w])

    def in_graph(kind, comp, where, dense_init=dense0, strict=None, runs=2):
        graph = tf.Graph()
        with graph.as_default():
            emb, dense = Layer(emb0, "emb"), Layer(dense_init, "dense")
            build = lambda: tapes(kind, comp, emb, dense, strict)  # noqa: E731
            raw, reduced = tf.function(build)() if where == "function" else build()
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                return [sess.run([raw, reduced]) for _ in range(runs)]

    def eagerly(kind, comp, runs=2):
        emb, dense = Layer(emb0, "emb"), Layer(dense0, "dense")
        return [[[g.numpy() for g in part] for part in tapes(kind, comp, emb, dense)] for _ in range(runs)]

    out = {}
    for config in ("none", "ef_sign"):
        for kind in ("register", "partial"):
            expected = eagerly(kind, compression(config))
            for where in ("graph", "function"):
                with captured_warnings() as messages:
                    runs = in_graph(kind, compression(config), where)
                out[f"{config}/{kind}/{where}"] = {
                    "local": [r[1][0].tolist() for r in runs],
                    "local_expected": [(r[0][0] / np.float32(SIZE)).tolist() for r in runs],
                    "shared": [digest([r[1][1]]) for r in runs],
                    "shared_eager": [digest([e[1][1]]) for e in expected],
                    "warnings": [m for m in messages if "different values" in m]}
    per_rank = start.normal(size=(3, 2)) + RANK
    for where in ("graph", "function"):
        with captured_warnings() as messages:
            in_graph("register", compression("ef_sign"), where, dense_init=per_rank)
        out[f"differ/{where}"] = {"warnings": [m for m in messages if "different values" in m]}
        try:
            in_graph("partial", compression("ef_sign"), where, dense_init=per_rank, strict=True, runs=1)
            out[f"strict/{where}"] = {"error": None}
        except tf.errors.OpError as exc:
            out[f"strict/{where}"] = {"error": type(exc).__name__, "message": exc.message[-4000:]}
    # A tf.function of an eager program with metrics on: its reduction is compiled, and
    # the check reads the variables when the function is traced, as without metrics.
    emb, dense = Layer(emb0, "emb"), Layer(per_rank, "dense")

    @tf.function
    def measured():
        with tf.GradientTape() as tape:
            loss = loss_of(emb, dense)
        dist = hq.DistributedGradientTape(tape, compression=compression("ef_sign"), strict=True, metrics=True,
                                          report_after=0)
        return dist.gradient(loss, [emb.w, dense.w])
    try:
        measured()
        out["strict/measured"] = {"error": None}
    except Exception as exc:  # raised while tracing: AutoGraph's StagingError carries it
        out["strict/measured"] = {"error": type(exc).__name__, "message": str(exc)[-4000:]}
    return out


class _PathCounter:
    """Counts the reductions a ``Monitor`` measured eagerly (``reduce``: probe and
    fallback steps, in a py_function) and those compiled into the graph
    (``record_compiled``), and each step's phase figures."""

    def __init__(self, opt):
        from hvd_quant.tensorflow import monitoring
        self.opt, self.monitoring, self.counts, self.steps = opt, monitoring, {"eager": 0, "compiled": 0}, []
        self.saved = monitoring.Monitor.reduce, monitoring.Monitor.record_compiled

    def __enter__(self):
        eager, compiled = self.saved
        counts = self.counts

        def reduce(monitor, *args):
            counts["eager"] += 1
            return eager(monitor, *args)

        def record_compiled(monitor, *args):
            counts["compiled"] += 1
            return compiled(monitor, *args)

        self.monitoring.Monitor.reduce, self.monitoring.Monitor.record_compiled = reduce, record_compiled
        return self

    def __exit__(self, *exc):
        self.monitoring.Monitor.reduce, self.monitoring.Monitor.record_compiled = self.saved

    def callback(self, keras):
        counter = self

        class PerStep(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                m = counter.opt.metrics()
                counter.steps.append({k: m[k] for k in ("probes", "encode_s", "wait_s", "decode_s", "bytes_sent")})
        return PerStep()


def metrics_behave():
    """Issue 54 on TensorFlow. ``model.fit`` with ``metrics=True`` (the reduction compiled
    and timed by the graph, probe steps in a ``py_function``; ``counted``: how many ran
    each way, and each step's figures) ends with the weights of ``metrics=False``; ``MetricsCallback`` puts
    the figures into ``History`` and a ``CSVLogger``; a guard with a bound no probe can
    meet falls back on every rank. A tape run eagerly measures the relative error that an
    exact Horovod allreduce of the same gradients gives, under a profiler that records its
    ranges; a tape in a ``tf.function`` writes ``tf.summary`` scalars, read back."""
    keras = keras3()
    x, y = data(seed=3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    OUT.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, options in (("plain", {}), ("measured", dict(metrics=True, probe_every=2, report_after=4)),
                          ("guarded", dict(metrics=True, probe_every=1, report_after=0,
                                           guard={"error_bound": 1e-9, "patience": 1, "fallback_steps": 2}))):
        model = make_model(keras)
        opt = hq.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), compression=hq.Compression.ef_sign,
                                      **options)
        model.compile(optimizer=opt, loss=loss_fn, jit_compile=False)
        csv = OUT / f"{name}{RANK}.csv"
        callbacks = [hq.callbacks.MetricsCallback(), keras.callbacks.CSVLogger(str(csv))] if options else []
        with captured_warnings() as messages, _PathCounter(opt) as counter:
            hist = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                             callbacks=callbacks + ([counter.callback(keras)] if options else []))
        snap = opt.metrics()
        out[name] = {"digest": digest(weights(model)),
                     "history": {k: v for k, v in hist.history.items() if k.startswith("hvd_quant/")},
                     "metrics": {k: v for k, v in snap.items() if not k.startswith("bucket")},
                     "csv_header": csv.read_text().splitlines()[0] if csv.exists() else "",
                     "guard_state": opt.guard_state_dict(), "bytes": opt.bytes_sent,
                     "counted": counter.counts, "per_step": counter.steps,
                     "messages": [m for m in messages if "hvd_quant" in m][:5]}

    # A tape, eagerly, probing every step, under the profiler.
    model = make_model(keras)
    variables = model.trainable_variables
    comp = hq.Compression.ef_sign
    logdir = OUT / f"profile{RANK}"
    tf.profiler.experimental.start(str(logdir))
    for step in range(2):
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        with tf.GradientTape() as plain:
            local = plain.gradient(loss_fn(yb, model(xb)), variables)
        with hq.DistributedGradientTape(tf.GradientTape(), compression=comp, metrics=True,
                                        probe_every=1) as tape:
            loss = loss_fn(yb, model(xb))
        reduced = tape.gradient(loss, variables)
        for v, g in zip(variables, reduced):
            v.assign_sub(0.1 * g)
    tf.profiler.experimental.stop()
    exact = np.concatenate([hvd.allreduce(g, op=hvd.Average, name=f"exact{i}").numpy().ravel()
                            for i, g in enumerate(local)]).astype(np.float64)
    estimate = np.concatenate([g.numpy().ravel() for g in reduced]).astype(np.float64)
    traces = b"".join(p.read_bytes() for p in logdir.rglob("*.pb"))
    snap = tape.metrics()
    out["tape"] = {"rel_error": float(np.linalg.norm(estimate - exact) / np.linalg.norm(exact)),
                   "probe_rel_error": snap["probe_rel_error"], "steps": snap["steps"], "probes": snap["probes"],
                   "ranges": sorted(r for r in ("hvd_quant/encode", "hvd_quant/wait", "hvd_quant/decode",
                                                "hvd_quant/probe") if r.encode() in traces)}

    # A tape in a tf.function, writing summaries every 2 steps under the default writer;
    # probing at step 3 (eagerly), its other steps compiled.
    model = make_model(keras)
    variables = model.trainable_variables
    comp, made = hq.Compression.ef_sign, []

    @tf.function
    def step(xb, yb):
        tape = hq.DistributedGradientTape(tf.GradientTape(), compression=comp, metrics=True, probe_every=3,
                                          summary_every=2)
        made.append(tape)
        with tape:
            loss = loss_fn(yb, model(xb))
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.1 * g)

    writer = tf.summary.create_file_writer(str(OUT / f"tb{RANK}"))
    with writer.as_default(), _PathCounter(None) as counter:
        for i in range(4):
            step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
    writer.flush()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(OUT / f"tb{RANK}"), size_guidance={"tensors": 0})
    events.Reload()
    tags = [t for t in events.Tags()["tensors"] if t.startswith("hvd_quant/")]
    read = {t: [[e.step, float(tf.make_ndarray(e.tensor_proto))] for e in events.Tensors(t)] for t in tags}
    out["summaries"] = {"traces": len(made), "steps": made[-1].metrics()["steps"], "read": read,
                        "counted": counter.counts}
    return out


def legacy_fit():
    """tf-keras model.fit with Horovod's own Keras DistributedOptimizer and our compressors."""
    import horovod.tensorflow.keras as hvdk
    keras = tf.keras
    x, y = data()
    out = {}
    for config in ("ef_sign", "global_qsgd", "none"):
        keras.utils.set_random_seed(RANK)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="hidden"),
                                  keras.layers.Dense(3, name="out")], name="net")
        comp = compression(config)
        opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), compression=comp)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        hist = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
                         callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
        out[config] = {"digest": digest(weights(model)), "loss": hist.history["loss"],
                       "state_keys": sorted(comp.state_dict(model.trainable_variables)),
                       "bytes": comp.bytes_sent}
    return out


if MODE == "keras3":
    record("fit", fit_every_compressor)
    record("checkpoint", checkpoint_resumes_exactly)
    record("jit", jit_compile_refused)
    record("jit_onebit", jit_compile_refused_onebit)
    record("jit_split", jit_compile_split)
    record("loss_scale_outside", loss_scale_outside_refused)
    record("callbacks", callbacks_behave)
    record("embedding", fit_embedding)
    record("local_sources", local_sources)
    record("partial_fit", partial_optimizer_fit)
    record("process_set", outside_the_process_set)
    record("aggregated", aggregated_passes)
    record("graph_tapes", graph_tapes)
    record("metrics", metrics_behave)
elif MODE == "keras3_fit":  # 3 ranks: fit, the tapes in TF1-style graphs, the metrics
    record("fit", fit_every_compressor)
    record("graph_tapes", graph_tapes)
    record("metrics", metrics_behave)
elif MODE == "metrics":  # the metrics alone, for a quick look at them
    record("metrics", metrics_behave)
elif MODE == "legacy":
    assert os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    record("legacy_fit", legacy_fit)
    # Our tape beside Horovod's stock tape under tf-keras: the part of tests/mp/worker.py
    # that depends on the Keras version (its other checks run under Keras 3 at 2 and 3 ranks).
    import train_tf
    record("legacy_tape", train_tf.fused_vs_stock)
    record("stock_multi_hop", train_tf.stock_refuses_multi_hop)
else:
    raise SystemExit(f"unknown mode {MODE}")

OUT.mkdir(parents=True, exist_ok=True)
(OUT / f"rank{RANK}.json").write_text(json.dumps(results))
print(f"rank {RANK}: wrote {OUT / f'rank{RANK}.json'}")
