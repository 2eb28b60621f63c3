"""One rank of the TensorFlow custom-loop Horovod Elastic job of tests/test_elastic.py.

``python elastic_worker_tf.py OUTDIR STEPS KILL_STEP MARKER``

Trains several tiny Keras regression models at once in one ``hvd_quant.tensorflow.elastic.function``
step, all in one ``KerasState`` committed after every step:

* ``exact``: ``DistributedGradientTape`` without compression + plain SGD. Every rank's
  shard of a step's global batch has the same size, so the average over ranks is the
  global batch's gradient whatever the world: the elastic run must equal plain
  single-process SGD on the global batches (computed here too, as ``reference``);
* ``ef_sign``: the tape with ``ef_sign`` (per-rank error feedback, kept by survivors);
* ``qsgd``: the tape with Global-QSGD (its safe levels depend on the number of ranks);
* ``onebit_tape``: the tape with the ``onebit`` compressor (alltoall; padded buffers that
  depend on the world, made by the tape's state store);
* ``onebit_opt``: ``hq.DistributedOptimizer(SGD, compression=onebit)`` (the same buffers
  as fixed-shape Keras variables, resized on the reset);
* ``zeroone``: ``hq.ZeroOneAdam`` (1-bit rounds, padded error buffers as Keras variables).
  Its expected result is the numpy oracle of the same rule replayed as the elastic rule
  says: 3 simulated ranks up to the commit, then 2 ranks that start from rank 0's state
  with zeroed error buffers (``zeroone_reference``). (0/1 Adam barely trains this toy
  problem in 10 steps; at larger learning rates its 1-bit steps make the loss grow, with
  or without elastic.)

The worker whose host is ``127.0.0.1`` writes ``MARKER`` and dies with ``os._exit(1)``
when it reaches step ``KILL_STEP``; the survivors restore the last commit, reset and
finish at 2 ranks. Each rank that finishes writes ``OUTDIR/rank{r}.json``.
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import tensorflow as tf
import keras
import horovod.tensorflow as hvd

import hvd_quant.tensorflow as hq
from hvd_quant.tensorflow import elastic
from worker_common import kill_second_host_at

OUT, STEPS, KILL_STEP, MARKER = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
HOST = os.environ.get("HOROVOD_HOSTNAME", "")
D_IN, D_OUT, BATCH = 8, 2, 24
LR = {"exact": 0.1, "ef_sign": 0.05, "qsgd": 0.1, "onebit_tape": 0.05, "onebit_opt": 0.05}

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
W_TRUE = np.random.default_rng(0).standard_normal((D_IN, D_OUT)).astype("float32")
EVAL_X = np.random.default_rng(123).standard_normal((256, D_IN)).astype("float32")
EVAL_Y = EVAL_X @ W_TRUE


def global_batch(step):
    x = np.random.default_rng(1000 + step).standard_normal((BATCH, D_IN)).astype("float32")
    return x, x @ W_TRUE


def batch(step):
    """This rank's share of the global batch of ``step`` (depends on rank and size)."""
    x, y = global_batch(step)
    return tf.constant(x[hvd.rank()::hvd.size()]), tf.constant(y[hvd.rank()::hvd.size()])


def make_model(seed):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((D_IN,))
    return keras.Model(inp, keras.layers.Dense(D_OUT)(inp))


def eval_loss(model):
    return float(np.mean((model(EVAL_X).numpy() - EVAL_Y) ** 2))


NAMES = ["exact", "ef_sign", "qsgd", "onebit_tape", "onebit_opt", "zeroone"]
models = {name: make_model(i) for i, name in enumerate(NAMES)}
initial_weights = {k: [w.copy() for w in m.get_weights()] for k, m in models.items()}
tapes = {"exact": hq.Compression.none, "ef_sign": hq.Compression.ef_sign,
         "qsgd": hq.Compression.global_qsgd(bits=8), "onebit_tape": hq.Compression.onebit}
opts = {k: keras.optimizers.SGD(LR[k]) for k in tapes}
opts["onebit_opt"] = hq.DistributedOptimizer(keras.optimizers.SGD(LR["onebit_opt"]),
                                             compression=hq.Compression.onebit)
# DeepSpeed's rule (bias_correction=False, variance_floor=0): the job checks the elastic path, and its loss
# bound was set with that rule's larger early steps.
ZEROONE = dict(var_freeze_step=1000, var_update_scaler=1, bias_correction=False, variance_floor=0)
opts["zeroone"] = hq.ZeroOneAdam(learning_rate=0.003, **ZEROONE)
initial = {k: eval_loss(m) for k, m in models.items()}
state = elastic.KerasState([models[k] for k in NAMES], [opts[k] for k in NAMES],
                           compression=list(tapes.values()), step=0)


@elastic.function
def train_step(x, y):
    for name in NAMES:
        model, opt = models[name], opts[name]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        if name in tapes:
            tape = hq.DistributedGradientTape(tape, compression=tapes[name])
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))


resets, kinds = [], []


def on_reset():
    """Runs after hvd_quant's reset, before the sync: what each rank kept."""
    ef = tapes["ef_sign"].state_dict(models["ef_sign"].trainable_variables)
    onebit_tape = tapes["onebit_tape"].state_dict(models["onebit_tape"].trainable_variables)
    dist = opts["onebit_opt"].compression_state_dict()
    z = opts["zeroone"]._hq_slots
    resets.append({
        "size": hvd.size(), "rank": hvd.rank(), "step": state.step, "generation": elastic.generation(),
        "ef_residual_abs": float(sum(np.abs(v).sum() for k, v in ef.items() if k.endswith("/residual"))),
        "onebit_tape_buffers": sorted(k for k in onebit_tape if k.startswith("hvd_quant.buffer/")),
        "onebit_opt_worker_error": [(k, int(np.size(v)), float(np.abs(v).sum()))
                                    for k, v in dist.items() if k.endswith("worker_error")],
        "zeroone_worker_error_abs": float(np.abs(z["worker_error"].numpy()).sum()),
        "zeroone_worker_error_numel": int(np.prod(z["worker_error"].shape)),
        "zeroone_recheck": bool(opts["zeroone"]._hq_recheck),
        "qsgd_levels": list(tapes["qsgd"].algorithm.resolve(hvd.size())),
    })


state.register_reset_callbacks([on_reset])


@elastic.run
def train(state):
    while state.step < STEPS:
        kill_second_host_at(state.step, KILL_STEP, MARKER)
        print(f"[{time.time():.1f}] rank {hvd.rank()}/{hvd.size()} step {state.step}", flush=True)
        train_step(*batch(state.step))
        kinds.append(opts["zeroone"].last_step_kind)
        state.step += 1
        state.commit()


train(state)


def reference():
    """Plain SGD on the global batches, one process: what ``exact`` must equal."""
    model = make_model(0)
    model.set_weights(initial_weights["exact"])
    opt = keras.optimizers.SGD(LR["exact"])
    for step in range(STEPS):
        x, y = global_batch(step)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model


def zeroone_reference():
    """The 0/1 Adam rule on numpy (hvd_quant's oracle) over simulated ranks: 3 ranks up to
    the commit before the kill, then 2 that start from rank 0's state (the sync) with
    the world-dependent error buffers from zero. Returns the eval loss."""
    from hvd_quant.core.simulate import ThreadWorld
    from hvd_quant.optimizers import ZeroOneAdamRule
    from hvd_quant.optimizers.base import adam_hyperparameters
    from hvd_quant.optimizers.oracle import OracleOptimizer

    hp = adam_hyperparameters((0.9, 0.999), 1e-8, 0.0)

    def grad(x, step, r, n):
        xb, y = global_batch(step)
        xb, y = xb[r::n], y[r::n]
        e = xb @ x[:D_IN * D_OUT].reshape(D_IN, D_OUT) + x[D_IN * D_OUT:] - y
        return np.concatenate([(2 * xb.T @ e / e.size).reshape(-1), 2 * e.sum(0) / e.size])

    def phase(n, start, stop, init):
        def body(comm):
            opt = OracleOptimizer(ZeroOneAdamRule(**ZEROONE), init["x"], comm, hp,
                                  counts=[D_IN * D_OUT, D_OUT])  # kernel, bias
            for k, v in init.get("slots", {}).items():
                if k not in ("worker_error", "server_error", "server_scale"):  # restart from zero (the world changed)
                    opt.state.slots[k] = v.copy()
            opt.state.scalars.update(init.get("scalars", {}))
            for step in range(start, stop):
                opt.step(grad(opt.x, step, comm.rank, n).astype(np.float32), 0.003)
            return {"x": opt.x, "slots": dict(opt.state.slots), "scalars": dict(opt.state.scalars)}
        return ThreadWorld(n).run(body)

    x0 = np.concatenate([w.reshape(-1) for w in initial_weights["zeroone"]])
    x = phase(2, KILL_STEP, STEPS, phase(3, 0, KILL_STEP, {"x": x0})[0])[0]["x"]
    k, b = x[:D_IN * D_OUT].reshape(D_IN, D_OUT), x[D_IN * D_OUT:]
    return float(np.mean((EVAL_X @ k + b - EVAL_Y) ** 2))


ref = reference()
result = {
    "rank": hvd.rank(), "size": hvd.size(), "host": HOST, "steps": state.step,
    "resets": resets, "initial": initial, "generation": elastic.generation(),
    "final": {k: eval_loss(m) for k, m in models.items()},
    "weights": {k: [w.reshape(-1).tolist() for w in m.get_weights()] for k, m in models.items()},
    "reference_loss": eval_loss(ref),
    "reference_weights": [w.reshape(-1).tolist() for w in ref.get_weights()],
    "zeroone_kinds": kinds, "zeroone_reference_loss": zeroone_reference(),
    "onebit_tape_buffers": sorted(k for k in tapes["onebit_tape"].state_dict(
        models["onebit_tape"].trainable_variables) if k.startswith("hvd_quant.buffer/")),
    "qsgd_levels": list(tapes["qsgd"].algorithm.resolve(hvd.size())),
}
(OUT / f"rank{hvd.rank()}.json").write_text(json.dumps(result))
