"""Training checks for the TensorFlow worker: our tape (Keras 3 or tf-keras, eager and
tf.function) and, under tf-keras, Horovod's stock tape; checkpoints; bad models."""

import os

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import hvd_quant.tensorflow as hq
from hvd_quant.core.runner import RankDisagreement
from logged import captured_warnings

keras = tf.keras
LEGACY = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
COMPRESSORS = ("ef_sign", "marsit", "global_qsgd", "onebit")


def make_model(seed=0):
    # Explicit names: compressor state is keyed by variable path, and Keras' automatic
    # names (dense_7, ...) change with every model built in a process.
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(6, activation="relu", name="hidden"),
                             keras.layers.Dense(3, name="out")], name="net")


def batches(n, seed_base=0):
    rng = np.random.default_rng(seed_base + hvd.rank())
    return [(rng.standard_normal((8, 10)).astype("float32"), rng.integers(0, 3, 8)) for _ in range(n)]


def make_step(model, opt, compression, path, compiled):
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        wrap = hq.DistributedGradientTape if path == "ours" else hvd.DistributedGradientTape
        tape = wrap(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return tf.function(step) if compiled else step


def flat(model):
    return np.concatenate([v.numpy().reshape(-1) for v in model.trainable_variables]).tolist()


def fused_vs_stock():
    out = {}
    data = batches(3)
    for name in COMPRESSORS:
        # Horovod's stock tape cannot order ring hops: it must refuse marsit (see below).
        paths = ["ours", "stock"] if LEGACY and name != "marsit" else ["ours"]
        for path in paths:
            for compiled in (False, True):
                model = make_model()
                step = make_step(model, keras.optimizers.SGD(0.1), hq.Compression.get(name), path, compiled)
                for x, y in data:
                    step(x, y)
                out[f"{name}/{path}/{'fn' if compiled else 'eager'}"] = flat(model)
    return out


def checkpoint_roundtrip(name="ef_sign"):
    data = batches(4, seed_base=50)
    model = make_model()
    comp = hq.Compression.get(name)
    step = make_step(model, keras.optimizers.SGD(0.1), comp, "ours", True)
    for x, y in data[:2]:
        step(x, y)
    weights = [v.numpy() for v in model.trainable_variables]
    state = comp.state_dict(model.trainable_variables)  # the state belongs to these variables
    for x, y in data[2:]:
        step(x, y)
    uninterrupted = flat(model)

    model2 = make_model(seed=123)
    for v, w in zip(model2.trainable_variables, weights):
        v.assign(w)
    comp2 = hq.Compression.get(name)
    comp2.load_state_dict(state, model2.trainable_variables)
    step2 = make_step(model2, keras.optimizers.SGD(0.1), comp2, "ours", True)
    for x, y in data[2:]:
        step2(x, y)
    return {"uninterrupted": uninterrupted, "restored": flat(model2), "state_keys": sorted(state)}


def params_differ():
    """Ranks that never broadcast: strict (HVD_QUANT_STRICT=1) raises on every rank at
    the first step; the default trains on (as Horovod) and rank 0 warns once, at the
    second eager step."""
    out = {}
    for strict in (True, False):
        model = make_model(seed=hvd.rank())
        step = make_step(model, keras.optimizers.SGD(0.1), hq.Compression.ef_sign, "ours", False)
        os.environ["HVD_QUANT_STRICT"] = "1" if strict else "0"
        try:
            with captured_warnings() as messages:
                try:
                    for x, y in batches(3):
                        step(x, y)
                    out[f"strict={strict}"] = {"error": None}
                except RankDisagreement as exc:
                    out[f"strict={strict}"] = {"error": "RankDisagreement", "message": str(exc)}
        finally:
            del os.environ["HVD_QUANT_STRICT"]
        out[f"strict={strict}"]["warnings"] = [m for m in messages if "different values" in m]
    return out


def stock_refuses_multi_hop():
    if not LEGACY:
        return "skipped"
    model = make_model()
    step = make_step(model, keras.optimizers.SGD(0.1), hq.Compression.marsit, "stock", False)
    x, y = batches(1)[0]
    try:
        step(x, y)
    except Exception as exc:  # TF may wrap it
        return {"error": type(exc).__name__, "message": str(exc)}
    return "no error"
