"""Horovod Elastic and TensorFlow: not supported by hvd_quant (yet); this says why.

Horovod 0.28.1's elastic states do not work with Keras 3, which TensorFlow 2.21 ships,
whatever the optimizer (checked on TF 2.21 / Keras 3.15):

* ``hvd.elastic.TensorFlowKerasState`` and ``horovod.tensorflow.keras.elastic.KerasState``
  call ``optimizer.variables()``; in Keras 3 ``variables`` is a list property, so they
  fail with ``TypeError: 'list' object is not callable``;
* ``hvd.elastic.TensorFlowState(variables=model.variables)`` broadcasts with
  ``hvd.broadcast_variables``, which fails on Keras 3 variables (upstream #4290).

Beyond Horovod's states, a reset would also have to retrace the compiled train step
(``model.fit`` bakes the world size into its graph) and resize the Keras optimizer
variables that hold world-size dependent compressor state (the ``onebit`` compressor's
padded buffers have fixed shapes; :mod:`hvd_quant.core.state` refuses a change of size).

What works instead: elastic training with torch (:mod:`hvd_quant.torch.elastic`), and for
TensorFlow, fault tolerance by restart from per-rank checkpoints (``model.save`` includes
the compressor state as optimizer variables; save one file per rank).

:class:`KerasState` and :class:`TensorFlowKerasState` exist only to raise this
explanation where a user would look for them.
"""

_MESSAGE = (
    "hvd_quant does not support Horovod Elastic with TensorFlow/Keras 3: Horovod 0.28.1's "
    "elastic states fail on Keras 3 ('list' object is not callable in "
    "TensorFlowKerasState/KerasState; hvd.broadcast_variables fails on Keras 3 variables, "
    "horovod #4290), and a reset would also need the compiled train step retraced for the "
    "new world size. Use hvd_quant.torch.elastic.TorchState with PyTorch, or restart "
    "TensorFlow jobs from per-rank checkpoints. See hvd_quant.tensorflow.elastic.")


class KerasState:
    """Not supported: raises ``NotImplementedError`` (module docstring)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(_MESSAGE)


TensorFlowKerasState = KerasState
TensorFlowState = KerasState
