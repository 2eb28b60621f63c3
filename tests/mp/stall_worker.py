"""Rank 1 dies or hangs at step 3 while the other ranks go on into hvd_quant's collectives.

``python stall_worker.py METHOD MODE`` with METHOD one of marsit (the ring), ef_sign,
global_qsgd, onebit_adam, zero_one_adam, binsgdm (torch), or keras_ef_sign (Keras 3
``model.fit`` with ``CollectiveWatchdog``), and MODE one of

* ``hang`` / ``die``: rank 1 stops before step 3, so the others wait in the step's first
  collective (for the ring and Global-QSGD that is the scale allgather or allreduce);
* ``hang_in_hop``: rank 1 runs step 3 up to its first ring hop (``sendrecv``) and stops
  there, after the scale allgather: the others wait inside a hop of the ring;
* ``hang_in_alltoall``: rank 1 stops at its first ``alltoall(_async)`` of step 3 (the 1-bit
  allreduce's exchange of signs and scales).

The job must end by itself (the deadline, or horovodrun reacting to the dead rank).
"""

import os
import sys
import time

METHOD, MODE = sys.argv[1], sys.argv[2]


def stop(where):
    hangs = MODE.startswith("hang")
    print(f"rank 1 {'hangs' if hangs else 'dies'} {where} at step 3, t={time.time():.3f}", flush=True)
    if hangs:
        time.sleep(3600)
    os._exit(3)


if METHOD.startswith("keras_"):
    import numpy as np
    import keras
    import horovod.tensorflow as hvd

    import hvd_quant.tensorflow as hq

    hvd.init()

    class StopAtThree(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 3 and hvd.rank() == 1:
                stop("before the batch")

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(8)])
    model.compile(optimizer=hq.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    compression=hq.Compression.get(METHOD[len("keras_"):])),
                  loss="mse")
    x, y = np.random.rand(16 * 1000, 64).astype("float32"), np.random.rand(16 * 1000, 8).astype("float32")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[StopAtThree(), hq.callbacks.CollectiveWatchdog()])
    print(f"rank {hvd.rank()} finished: the failure went unnoticed", flush=True)
    sys.exit(0)

import torch
import horovod.torch as hvd

import hvd_quant.torch as hq

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(64, 8)
if METHOD in ("onebit_adam", "zero_one_adam", "binsgdm"):
    opts = {"onebit_adam": dict(freeze_step=2), "zero_one_adam": dict(var_freeze_step=1, local_step_scaler=1000),
            "binsgdm": {}}[METHOD]
    opt = getattr(hq, {"onebit_adam": "OnebitAdam", "zero_one_adam": "ZeroOneAdam", "binsgdm": "BinSGDM"}[METHOD])(
        model.parameters(), lr=1e-3, named_parameters=model.named_parameters(), **opts)
else:
    opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  compression=hq.Compression.get(METHOD))
STEP = 0
if MODE in ("hang_in_hop", "hang_in_alltoall") and hvd.rank() == 1:
    # Stop inside step 3 at the first call of this collective: the collectives before it
    # in that step (the scale gathers) complete on every rank, so the peers are left
    # waiting in this one.
    from hvd_quant.torch.comm import HorovodTorchComm

    # The 1-bit allreduce issues its alltoall asynchronously (alltoall_async): stop at
    # whichever form of the collective comes first.
    methods = {"hang_in_hop": ["sendrecv"], "hang_in_alltoall": ["alltoall", "alltoall_async"]}[MODE]

    def stopping_at(method):
        issue = getattr(HorovodTorchComm, method)

        def stop_inside(self, *args, **kwargs):
            if STEP == 3:
                stop(f"in its {method}")
            return issue(self, *args, **kwargs)
        return stop_inside

    for method in methods:
        setattr(HorovodTorchComm, method, stopping_at(method))
for step in range(1000):
    STEP = step
    if step == 3 and hvd.rank() == 1 and MODE in ("hang", "die"):
        stop("before the step")
    loss = model(torch.randn(16, 64)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"rank {hvd.rank()} finished: the failure went unnoticed", flush=True)
