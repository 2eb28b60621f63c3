"""Runs inside every rank for tests/test_mixed_precision.py: fp16/bf16 parameters and
gradients with every compressor, and loss scaling whose overflowing step is skipped on
every rank.

``python mixed_worker.py MODE OUTDIR``; MODE is ``torch`` (``model.half()``/``bfloat16``,
autocast + ``GradScaler``, through Horovod's stock optimizer and ours), ``keras3``
(``mixed_float16``/``mixed_bfloat16`` policies with our Keras ``DistributedOptimizer``, and
float16/bfloat16 *variables* through our tape and our Keras ``DistributedOptimizer``),
``keras3_ring`` (the float16/bfloat16 variable cases for the ring and chunked compressors
only, meant for 3 ranks: an odd world size over a buffer of 83 elements, which divides
neither by 3 nor by 8) or ``legacy`` (tf-keras ``mixed_float16`` and ``mixed_bfloat16``
with Horovod's own Keras optimizer).

The overflow: on rank 1 only, one input of batch ``OVERFLOW_STEP`` is 1e30 (inf once cast
to fp16). The compressors propagate it to every rank's reduced gradient, so every rank's
loss scaler must skip that step.
"""

import os
import sys
import time
from pathlib import Path

import numpy as np

import worker_common

MODE, OUT = sys.argv[1], Path(sys.argv[2])
ALL = ["none", "fp16", "ef_sign", "marsit", "cascading_sign", "global_qsgd", "global_qsgd:norm=l2",
       "global_qsgd_exp", "onebit"]
STOCK_TF = ["none", "fp16", "ef_sign", "global_qsgd", "global_qsgd:norm=l2", "onebit"]  # no ring methods
# Ring hops (marsit, cascading_sign, global_qsgd_exp) and alltoall chunks (onebit) are where
# an odd world size and a buffer that does not split evenly matter: the keras3_ring mode.
RING = ["marsit", "cascading_sign", "global_qsgd_exp", "onebit"]
# tf-keras mixed_bfloat16: one of each collective (plain, sign allgather, integer allreduce,
# 1-bit alltoall); every tf-keras fit costs a few seconds of tracing.
STOCK_BF16 = ["none", "ef_sign", "global_qsgd", "onebit"]
STEPS, BATCH, OVERFLOW_STEP = 5, 8, 2
# hvd_quant's 1-bit optimizers (they reduce by themselves), with schedules short enough
# that the overflow (step 3) is a 1-bit round (0/1 Adam: Phase A, whose ranks stay identical).
ONEBIT = {"onebit_adam": dict(freeze_step=1), "zero_one_adam": dict(var_freeze_step=100, var_update_scaler=1),
          "binsgdm": dict()}
results = worker_common.Results(message_chars=2000, trace_chars=3000)
record = results.record


def attempt(fn, *args):
    """One case: its result, or its error recorded for the test to judge (the other
    cases still run)."""
    start = time.perf_counter()
    try:
        result = fn(*args)
        result["seconds"] = time.perf_counter() - start
        return result
    except Exception as exc:  # recorded for the test to judge
        return worker_common.failure(exc, 2000, 3000)


def digest(arrays):
    return worker_common.digest(arrays, np.float64)


def split(config):
    name, _, opts = config.partition(":")
    return name, dict(kv.split("=") for kv in opts.split(",") if kv)


def inputs(rank, overflow):
    rng = np.random.default_rng(50 + rank)
    xs = [rng.standard_normal((BATCH, 6)).astype("float32") for _ in range(STEPS)]
    ys = [rng.integers(0, 3, BATCH) for _ in range(STEPS)]
    if overflow and rank == 1:
        xs[OVERFLOW_STEP][0, 0] = 1e30
    return xs, ys


# --- torch ---------------------------------------------------------------------------------------
def torch_mode():
    import torch
    import horovod.torch as hvd
    import hvd_quant.torch as hq

    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()

    def net(dtype=torch.float32):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).to(dtype)

    def wrap(path, model, config, lr=0.1):
        name, options = split(config)
        cls = hq.DistributedOptimizer if path == "ours" else hvd.DistributedOptimizer
        return cls(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                   named_parameters=model.named_parameters(), compression=hq.Compression.get(name, **options))

    def low_precision_parameters():
        """model.half() / bfloat16: gradients reduced in fp32 inside, returned in the
        parameters' dtype, identical on every rank."""
        out = {}
        xs, ys = inputs(rank, overflow=False)
        for dtype in (torch.float16, torch.bfloat16):
            for path in ("ours", "stock"):
                for config in ALL:
                    model = net(dtype)
                    opt = wrap(path, model, config)
                    grad_dtypes = set()
                    for x, y in zip(xs, ys):
                        opt.zero_grad()
                        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x).to(dtype)).float(),
                                                                 torch.from_numpy(y))
                        loss.backward()
                        opt.synchronize()
                        grad_dtypes |= {str(p.grad.dtype) for p in model.parameters()}
                        with opt.skip_synchronize():
                            opt.step()
                    params = [p.detach().float() for p in model.parameters()]
                    out[f"{dtype}/{path}/{config}"] = {
                        "digest": digest(params), "finite": all(bool(torch.isfinite(p).all()) for p in params),
                        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                        "grad_dtypes": sorted(grad_dtypes), "loss": float(loss.detach())}
        return out

    def scaled_backward(model, opt, scaler, x, y):
        """Gradients zeroed, the forward pass under fp16 autocast, the scaled loss's backward."""
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(logits.float(), torch.from_numpy(y))
        scaler.scale(loss).backward()

    def autocast_grad_scaler():
        """fp32 parameters, fp16 autocast, GradScaler, Horovod's pattern: reduce, unscale,
        step without a second reduction. The overflow on rank 1 is skipped by every rank."""
        out = {}
        xs, ys = inputs(rank, overflow=True)
        for path in ("ours", "stock"):
            for config in ALL:
                model = net()
                opt = wrap(path, model, config, lr=0.05)
                scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
                after, scales = [], []
                for x, y in zip(xs, ys):
                    scaled_backward(model, opt, scaler, x, y)
                    opt.synchronize()
                    scaler.unscale_(opt)
                    with opt.skip_synchronize():
                        scaler.step(opt)
                    scaler.update()
                    after.append(digest([p.detach() for p in model.parameters()]))
                    scales.append(float(scaler.get_scale()))
                out[f"{path}/{config}"] = {"after_step": after, "scales": scales,
                                           "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}
        return out

    def onebit_grad_scaler():
        """hvd_quant's 1-bit optimizers under a GradScaler: they unscale themselves and skip
        the overflowing step on every rank. ``hq.GradScaler`` then backs off on every rank;
        the stock one (``stock/NAME``) only where the overflow was."""
        out = {}
        xs, ys = inputs(rank, overflow=True)
        classes = {"onebit_adam": hq.OnebitAdam, "zero_one_adam": hq.ZeroOneAdam, "binsgdm": hq.BinSGDM}
        runs = [(name, hq.GradScaler, options) for name, options in ONEBIT.items()]
        runs.append(("stock/binsgdm", torch.amp.GradScaler, ONEBIT["binsgdm"]))
        for name, scaler_cls, options in runs:
            model = net()
            opt = classes[name.split("/")[-1]](model.parameters(), lr=0.01,
                                               named_parameters=model.named_parameters(), **options)
            scaler = scaler_cls("cpu", init_scale=2.0 ** 10, growth_interval=1000)
            after, scales = [], []
            for x, y in zip(xs, ys):
                scaled_backward(model, opt, scaler, x, y)
                scaler.step(opt)
                scaler.update()
                after.append(digest([p.detach() for p in model.parameters()]))
                scales.append(float(scaler.get_scale()))
            out[name] = {"after_step": after, "scales": scales, "skipped": opt.skipped_steps,
                         "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}
        return out

    record("low_precision", low_precision_parameters)
    record("grad_scaler", autocast_grad_scaler)
    record("onebit_grad_scaler", onebit_grad_scaler)
    return rank


# --- TensorFlow ----------------------------------------------------------------------------------
def keras_model(keras):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu", name="hidden"),
                             keras.layers.Dense(3, name="logits"),
                             keras.layers.Activation("linear", dtype="float32", name="out")], name="net")


def fit_with_overflow(keras, model, opt, overflow, rank):
    """``model.fit`` over STEPS batches; per batch: weights digest, loss scale, and whether
    the loss was finite."""
    class PerBatch(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.after, self.scales = [], []

        def on_train_batch_end(self, batch, logs=None):
            self.after.append(digest([v.numpy() for v in self.model.trainable_variables]))
            scale = getattr(self.model.optimizer, "dynamic_scale", None)
            if scale is None:  # tf-keras' LossScaleOptimizer
                scale = getattr(self.model.optimizer, "loss_scale", None)
            self.scales.append(float(scale.numpy()) if scale is not None else None)

    xs, ys = inputs(rank, overflow)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    per = PerBatch()
    before = digest([v.numpy() for v in model.trainable_variables])
    model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=BATCH, epochs=1, verbose=0,
              shuffle=False, callbacks=[per])
    weights = [v.numpy() for v in model.trainable_variables]
    return {"before": before, "after_step": per.after, "scales": per.scales,
            "optimizer": type(model.optimizer).__name__,
            "iterations": int(model.optimizer.iterations.numpy()),
            "variable_dtypes": sorted({str(v.dtype) for v in model.trainable_variables}),
            "finite": all(bool(np.isfinite(w).all()) for w in weights)}


def fit_per_config(keras, distributed, policy, overflow, configs, rank, more=None):
    """:func:`fit_with_overflow` per compressor config under the global ``policy`` (float32
    again after each), through ``distributed(SGD, compression=...)``; ``more(model)``
    adds to each config's result."""
    import hvd_quant.tensorflow as hq

    out = {}
    for config in configs:
        keras.mixed_precision.set_global_policy(policy)
        try:
            name, options = split(config)
            model = keras_model(keras)
            opt = distributed(keras.optimizers.SGD(0.05, momentum=0.9), compression=hq.Compression.get(name, **options))
            out[config] = fit_with_overflow(keras, model, opt, overflow, rank)
            out[config].update(more(model) if more else {})
        finally:
            keras.mixed_precision.set_global_policy("float32")
    return out


def keras3_mode():
    tf, hvd = worker_common.tf_setup()
    import keras
    import hvd_quant.tensorflow as hq

    rank = hvd.rank()

    def run(policy, overflow, configs):
        return fit_per_config(keras, hq.DistributedOptimizer, policy, overflow, configs, rank)

    def run_onebit():
        """The 1-bit optimizers under mixed_float16: wrapped in our DistributedOptimizer
        (loss scaling from their all-rank verdict) they skip the overflow on every rank;
        left to Keras' own LossScaleOptimizer they are refused, on every rank, no hang."""
        classes = {"onebit_adam": hq.OnebitAdam, "zero_one_adam": hq.ZeroOneAdam, "binsgdm": hq.BinSGDM}
        out = {}
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            for name, options in ONEBIT.items():
                model = keras_model(keras)
                opt = hq.DistributedOptimizer(classes[name](learning_rate=0.01, **options))
                result = fit_with_overflow(keras, model, opt, True, rank)
                result["skipped"] = int(opt.inner_optimizer.skipped_steps)
                out[name] = result
            try:
                fit_with_overflow(keras, keras_model(keras), hq.ZeroOneAdam(learning_rate=0.01), True, rank)
                out["plain_compile"] = "trained"
            except TypeError as exc:
                out["plain_compile"] = str(exc)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        return out

    record("mixed_float16", lambda: run("mixed_float16", True, ALL))
    record("mixed_bfloat16", lambda: run("mixed_bfloat16", False, ALL))
    record("onebit_mixed_float16", run_onebit)
    # The ring and alltoall methods' low-precision variables run at 3 ranks (keras3_ring).
    record("low_precision_variables",
           lambda: low_precision_variables(tf, hvd, keras, hq, [c for c in ALL if c not in RING]))
    return rank


def low_precision_variables(tf, hvd, keras, hq, configs):
    """float16 and bfloat16 *variables* (layers built with ``dtype="float16"``: the
    gradients arrive in that dtype), global policy float32 so no loss scaling. For each
    compressor, through our tape in a ``tf.function`` custom loop (``DTYPE/tape/CONFIG``)
    and through our Keras ``DistributedOptimizer`` in ``model.fit`` (``DTYPE/optimizer/CONFIG``):
    the dtypes going in and coming out, the weights after every step, and, for the tape,
    how close the first step's reduced gradient is to the exact fp32 mean of the ranks'
    local gradients."""
    rank = hvd.rank()
    xs, ys = inputs(rank, overflow=False)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    class RecordingSGD(keras.optimizers.SGD):
        """Records the dtypes of the gradients handed to it (at trace time)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen = set()

        def apply(self, grads, trainable_variables=None):
            grads = list(grads)
            self.seen |= {g.dtype.name for g in grads if g is not None}
            return super().apply(grads, trainable_variables)

    def model_in(dtype):
        keras.utils.set_random_seed(0)  # the same initial weights on every rank
        return keras.Sequential([keras.Input((6,)),
                                 keras.layers.Dense(8, activation="relu", dtype=dtype, name="hidden"),
                                 keras.layers.Dense(3, dtype=dtype, name="logits"),
                                 keras.layers.Activation("linear", dtype="float32", name="out")], name="net")

    def numel(model):
        return sum(int(np.prod(v.shape)) for v in model.trainable_variables)

    def flat32(grads):
        return np.concatenate([np.asarray(tf.cast(g, tf.float32)).ravel() for g in grads])

    def tape_case(dtype, config):
        name, options = split(config)
        model = model_in(dtype)
        compression = hq.Compression.get(name, **options)
        opt = keras.optimizers.SGD(0.05, momentum=0.9)

        @tf.function
        def step(x, y):
            with tf.GradientTape(persistent=True) as tape:
                loss = loss_fn(y, model(x, training=True))
            local = tape.gradient(loss, model.trainable_variables)
            grads = hq.DistributedGradientTape(tape, compression=compression).gradient(
                loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return local, grads

        after, local_dtypes, grad_dtypes = [], set(), set()
        for i, (x, y) in enumerate(zip(xs, ys)):
            local, grads = step(tf.constant(x), tf.constant(y))
            local_dtypes |= {g.dtype.name for g in local}
            grad_dtypes |= {g.dtype.name for g in grads}
            if i == 0:  # the exact mean of the ranks' local gradients, in fp32, in rank order
                every = hvd.allgather(tf.constant(flat32(local)[None, :]), name=f"lp.{dtype}.{config}").numpy()
                exact, reduced = every.mean(axis=0, dtype=np.float64), flat32(grads).astype(np.float64)
                cosine = float(reduced @ exact / (np.linalg.norm(reduced) * np.linalg.norm(exact)))
                rel_err = float(np.max(np.abs(reduced - exact)) / np.max(np.abs(exact)))
            after.append(digest([v.numpy() for v in model.trainable_variables]))
        return {"after_step": after, "local_grad_dtypes": sorted(local_dtypes),
                "grad_dtypes": sorted(grad_dtypes), "cosine": cosine, "rel_err": rel_err,
                "variable_dtypes": sorted({v.dtype for v in model.trainable_variables}),
                "numel": numel(model),
                "finite": all(bool(np.isfinite(v.numpy().astype(np.float32)).all())
                              for v in model.trainable_variables)}

    def optimizer_case(dtype, config):
        name, options = split(config)
        model = model_in(dtype)
        inner = RecordingSGD(0.05, momentum=0.9)
        opt = hq.DistributedOptimizer(inner, compression=hq.Compression.get(name, **options))
        result = fit_with_overflow(keras, model, opt, False, rank)
        result.update(grad_dtypes=sorted(inner.seen), numel=numel(model), loss_scaling=opt._loss_scaling(),
                      bytes=opt.bytes_sent)
        return result

    out = {}
    for dtype in ("float16", "bfloat16"):
        for config in configs:
            for path, case in (("tape", tape_case), ("optimizer", optimizer_case)):
                out[f"{dtype}/{path}/{config}"] = attempt(case, dtype, config)
    return out


def keras3_ring_mode():
    tf, hvd = worker_common.tf_setup()
    import keras
    import hvd_quant.tensorflow as hq

    record("low_precision_variables", lambda: low_precision_variables(tf, hvd, keras, hq, RING))
    return hvd.rank()


def legacy_mode():
    tf, hvd = worker_common.tf_setup()
    import horovod.tensorflow.keras as hvdk

    keras = tf.keras
    rank = hvd.rank()

    def dtypes(model):
        return {"compute_dtype": model.get_layer("hidden").compute_dtype,
                "variable_dtype_names": sorted({tf.as_dtype(v.dtype).name for v in model.trainable_variables})}

    def run(policy, overflow, configs):
        return fit_per_config(keras, hvdk.DistributedOptimizer, policy, overflow, configs, rank, dtypes)

    assert os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    record("stock_mixed_float16", lambda: run("mixed_float16", True, STOCK_TF))
    # bfloat16 needs no loss scaling: tf-keras wraps nothing, Horovod's optimizer reduces.
    record("stock_mixed_bfloat16", lambda: run("mixed_bfloat16", False, STOCK_BF16))
    return rank


rank = {"torch": torch_mode, "keras3": keras3_mode, "keras3_ring": keras3_ring_mode,
        "legacy": legacy_mode}[MODE]()
results.write(OUT, rank)
