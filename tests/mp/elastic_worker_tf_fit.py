"""One rank of the Keras ``model.fit`` Horovod Elastic job of tests/test_elastic.py.

``python elastic_worker_tf_fit.py OUTDIR EPOCHS KILL_EPOCH MARKER METHOD``

``model.fit`` inside ``@hvd_quant.tensorflow.elastic.run``, with a ``KerasState`` committed
at the end of every epoch (``CommitEpochCallback``). ``METHOD``:

* ``onebit``: ``hq.DistributedOptimizer(SGD(momentum), compression=onebit)``: alltoall
  collectives and world-dependent error buffers held as Keras optimizer variables;
* ``zero_one_adam``: ``hq.ZeroOneAdam`` passed to ``compile`` directly.

Each epoch is the same 48 samples; rank ``r`` of ``n`` fits ``x[r::n]`` in batches of
``24 / n`` without shuffling, so every step's global batch is the same 24 samples at 3
ranks and at 2. The worker on host ``127.0.0.1`` dies when epoch ``KILL_EPOCH`` begins;
the survivors restore the last commit, reset (``model.fit`` traces again) and finish the
remaining epochs at 2 ranks. Each rank that finishes writes ``OUTDIR/rank{r}.json``.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf
import keras
import horovod.tensorflow as hvd

import hvd_quant.tensorflow as hq
from hvd_quant.tensorflow import elastic
from worker_common import kill_second_host_at

OUT, EPOCHS, KILL_EPOCH, MARKER = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
METHOD = sys.argv[5]
HOST = os.environ.get("HOROVOD_HOSTNAME", "")
D_IN, D_OUT, N, GLOBAL_BATCH = 8, 2, 48, 24

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
W_TRUE = np.random.default_rng(0).standard_normal((D_IN, D_OUT)).astype("float32")
X = np.random.default_rng(1).standard_normal((N, D_IN)).astype("float32")
Y = X @ W_TRUE

keras.utils.set_random_seed(0)
inp = keras.Input((D_IN,))
model = keras.Model(inp, keras.layers.Dense(D_OUT)(inp))
if METHOD == "onebit":
    optimizer = hq.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5),
                                        compression=hq.Compression.onebit)
else:
    # DeepSpeed's rule, as this job's loss bound was set with (the elastic path is what it checks)
    optimizer = hq.ZeroOneAdam(learning_rate=0.02, var_freeze_step=1000, var_update_scaler=1,
                               bias_correction=False, variance_floor=0)
model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
state = elastic.KerasState(model, epoch=0)
initial = float(np.mean((model(X).numpy() - Y) ** 2))
resets, epochs_run = [], []


def world_buffers():
    """``[(name, numel, abs sum)]`` of the optimizer's world-dependent error buffers."""
    return [(v.path, int(np.prod(v.shape)), float(np.abs(v.numpy()).sum()))
            for v in optimizer.elastic_local_variables() if "error" in v.path]


def on_reset():
    resets.append({"size": hvd.size(), "rank": hvd.rank(), "epoch": state.epoch,
                   "train_function": model.train_function is not None,
                   "buffers": world_buffers()})


state.register_reset_callbacks([on_reset])


class Die(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        epochs_run.append((epoch, hvd.size()))
        kill_second_host_at(epoch, KILL_EPOCH, MARKER)


@elastic.run
def train(state):
    r, n = hvd.rank(), hvd.size()
    model.fit(X[r::n], Y[r::n], batch_size=GLOBAL_BATCH // n, epochs=EPOCHS, initial_epoch=state.epoch,
              shuffle=False, verbose=0, callbacks=[Die(), elastic.CommitEpochCallback(state)])


train(state)

result = {
    "rank": hvd.rank(), "size": hvd.size(), "host": HOST, "epoch": state.epoch, "resets": resets,
    "epochs_run": epochs_run, "initial": initial, "final": float(np.mean((model(X).numpy() - Y) ** 2)),
    "weights": [w.reshape(-1).tolist() for w in model.get_weights()],
    "buffers": world_buffers(), "iterations": int(optimizer.iterations.numpy()),
}
(OUT / f"rank{hvd.rank()}.json").write_text(json.dumps(result))
