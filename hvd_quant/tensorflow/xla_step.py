"""``jit_compile=True`` with collectives: XLA compiles the model's forward and backward pass,
the gradient reduction and the optimizer step run outside it.

Horovod's collectives are custom TensorFlow ops with no XLA kernel (Horovod's XLA ops
exist only for CUDA builds with ``HOROVOD_ENABLE_XLA_OPS``), and Keras 3 compiles the
whole train step, optimizer included, as one XLA function under ``jit_compile=True``:
``tf2xla conversion failed ... HorovodAllreduce``. Splitting the step keeps what XLA is
good at (the model's arithmetic, fused) and leaves the communication, which XLA cannot
speed up anyway, in the ordinary graph::

    one train step (a tf.function, not XLA)
      forward + loss + backward      <- tf.function(jit_compile=True)
      optimizer.apply_gradients      <- reduction over ranks, then the update
      compiled metrics

:func:`refuse_xla` is what the communicating optimizers call first: a clear error where
the step was not split. :class:`hvd_quant.tensorflow.callbacks.JitCompileCallback`
installs :func:`split_train_step` when ``fit`` starts.
"""

import tensorflow as tf

try:
    from tensorflow.python.framework import ops as _ops
    from tensorflow.python.ops import control_flow_util as _control_flow_util
except ImportError:  # private TF modules moved: XLA will refuse the Horovod ops itself
    _ops = _control_flow_util = None


def in_xla_context():
    """True while tracing a function that XLA compiles (``jit_compile=True``, or nested in
    one). False eagerly, and where TensorFlow's private modules moved (XLA then refuses
    what it cannot compile itself)."""
    if tf.executing_eagerly() or _control_flow_util is None:
        return False
    return bool(_control_flow_util.GraphOrParentsInXlaContext(_ops.get_default_graph()))


def refuse_xla():
    """Raise while tracing an XLA-compiled function (``jit_compile=True``): the collectives
    of the step that follows cannot be compiled. Called on every step: eager steps return
    at the first check."""
    if in_xla_context():
        raise RuntimeError(
            "hvd_quant: the gradient reduction runs Horovod collectives, custom TensorFlow ops "
            "that XLA cannot compile (this Horovod build has no XLA ops), and Keras compiles "
            "the whole train step under jit_compile=True. Pass "
            "hvd_quant.tensorflow.callbacks.JitCompileCallback() to fit() so that XLA compiles "
            "the forward and backward pass and the reduction runs outside it, or compile the "
            "model with jit_compile=False (Keras' jit_compile='auto' picks False on CPU-only "
            "machines, True on GPUs).")


def _keras_train_step_parts():
    """Keras 3 (TensorFlow backend) pieces of the default train step, or an error naming
    what is missing (they are private and may move)."""
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
        from keras.src.losses import loss as loss_module
        from keras.src.trainers.data_adapters import data_adapter_utils
    except ImportError as exc:  # pragma: no cover - depends on the installed Keras
        raise RuntimeError(f"hvd_quant: this Keras version's train step cannot be split ({exc}); "
                           "compile with jit_compile=False") from exc
    return TensorFlowTrainer.train_step, loss_module, data_adapter_utils


def split_train_step(model):
    """Return a train step for ``model`` equivalent to Keras 3's default one, with its
    forward and backward pass compiled by XLA and ``optimizer.apply_gradients`` (and so
    every collective) outside XLA.

    It mirrors ``keras.src.backend.tensorflow.trainer.TensorFlowTrainer.train_step``:
    the loss (with the model's added losses), the loss tracker, the optimizer's loss
    scaling, the gradients, then the update and the compiled metrics. A model that
    overrides ``train_step`` is refused: only its author knows where its collectives are.
    """
    default_step, loss_module, unpack = _keras_train_step_parts()
    if type(model).train_step is not default_step:
        raise ValueError(
            f"hvd_quant: {type(model).__name__} overrides train_step, so JitCompileCallback "
            "cannot split it. Compile with jit_compile=False, or put the forward and backward "
            "pass of your train_step in a tf.function(jit_compile=True) and call "
            "optimizer.apply_gradients outside it.")

    @tf.function(jit_compile=True, reduce_retracing=True)
    def forward_backward(x, y, sample_weight):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                       training=True)
            batch = tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]
            model._loss_tracker.update_state(loss_module.unscale_loss_for_distribution(loss),
                                             sample_weight=batch)
            if model.optimizer is not None:
                loss = model.optimizer.scale_loss(loss)
        return y_pred, tape.gradient(loss, model.trainable_weights)

    def train_step(data):
        x, y, sample_weight = unpack.unpack_x_y_sample_weight(data)
        y_pred, gradients = forward_backward(x, y, sample_weight)
        if model.trainable_weights:
            model.optimizer.apply_gradients(zip(gradients, model.trainable_weights))
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return train_step
