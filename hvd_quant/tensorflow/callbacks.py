"""Keras 3 callbacks for ``model.fit`` across Horovod ranks, in place of Horovod's
``hvd.keras.callbacks`` (which need Keras 2).

* :class:`BroadcastGlobalVariablesCallback`: rank ``root_rank``'s model and optimizer
  variables to every rank when training starts (skipping per-rank compressor state).
* :class:`MetricAverageCallback`: epoch metrics averaged over ranks.
* :class:`CollectiveWatchdog`: ends the process when one training batch outlives a
  deadline (a peer rank dead or hung inside a collective of the compiled train step).
* :class:`LearningRateWarmupCallback`: the learning rate ramps from ``lr / size`` to
  ``lr`` over the first epochs (Goyal et al., "Accurate, Large Minibatch SGD: Training
  ImageNet in 1 Hour", 2017, section 2.2, gradual warmup), as Horovod's callback does.
* :class:`FinalSyncCallback`: when ``fit`` ends, 0/1 Adam synchronises the local steps
  since its last sync, so every rank ends with the same model.
* :class:`JitCompileCallback`: ``jit_compile=True`` works: XLA compiles the forward and
  backward pass, the collectives run outside it.
* :class:`MetricsCallback`: what compression does (an optimizer made with
  ``metrics=True``) added to ``logs``, for the progress bar, ``History``, ``CSVLogger``
  and Keras's ``TensorBoard`` callback.

Put :class:`MetricAverageCallback` and :class:`MetricsCallback` before callbacks that read
the logs (``ModelCheckpoint(monitor=...)``, ``EarlyStopping``, ``TensorBoard``,
``CSVLogger``), so that they see what these add; Keras appends its progress bar and
``History`` after the user's callbacks.
"""

import keras
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

from ..core.runner import check_agreement, digest63
from ..core.watchdog import WATCHDOG
from .monitoring import TAG
from .tape import broadcast_variables


def per_rank_variables(optimizer):
    """Variables of ``optimizer`` (and of the optimizers it wraps) that differ between
    ranks by design: compressor residuals, random-stream positions. Optimizers declare
    them in a ``per_rank_variables`` attribute."""
    out, seen = [], set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        out += list(getattr(optimizer, "per_rank_variables", []) or [])
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return out


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's variables and the optimizer's shared variables from
    ``root_rank`` when training starts, so that every rank starts from the same point
    (a fresh model, or a checkpoint loaded on ``root_rank`` only).

    Keras builds the optimizer lazily; this callback builds it first (eagerly, on every
    rank) when the model is built, so its variables exist to be broadcast. Per-rank
    variables (:func:`per_rank_variables`) are left alone: each rank keeps its own
    compressor state. A model that is not built when training starts (no ``keras.Input``)
    is broadcast after the first batch, as Horovod does; hvd_quant's first-step agreement
    check then fails unless every rank initialised it identically (seed every rank with
    ``keras.utils.set_random_seed``), so build the model first.
    """

    def __init__(self, root_rank=0, process_set=hvd.global_process_set):
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if not self.broadcast_done and self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    def _broadcast(self):
        optimizer = getattr(self.model, "optimizer", None)
        variables = list(self.model.variables)
        if optimizer is not None:
            if not optimizer.built and self.model.trainable_variables:
                with keras.name_scope(optimizer.name, caller=optimizer):
                    optimizer.build(self.model.trainable_variables)
                optimizer.built = True
            skip = {id(v) for v in per_rank_variables(optimizer)}
            variables += [v for v in optimizer.variables if id(v) not in skip]
        broadcast_variables(variables, root_rank=self.root_rank, process_set=self.process_set)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each numeric epoch metric in the logs by its average over ranks.

    Every rank must log the same metric names (checked first, with one small allgather:
    ranks that differ raise :class:`~hvd_quant.core.runner.RankDisagreement` together).
    The values travel by allgather and are averaged in rank order, so every rank ends
    with the same numbers.
    """

    def __init__(self, process_set=hvd.global_process_set):
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        head = np.array([digest63(len(keys), *keys)], dtype=np.int64)
        gathered = hvd.allgather(tf.constant(head[None, :]), name=f"hvd_quant.metrics.keys.{epoch}",
                                 ignore_name_scope=True, process_set=self.process_set).numpy()
        check_agreement(gathered, ["the names of the epoch metrics"],
                        ["Log the same metrics on every rank."])
        if not keys:
            return
        values = np.array([[float(logs[k]) for k in keys]], dtype=np.float64)
        rows = hvd.allgather(tf.constant(values), name=f"hvd_quant.metrics.values.{epoch}",
                             ignore_name_scope=True, process_set=self.process_set).numpy()
        mean = np.zeros(len(keys))
        for row in rows:  # rank order: identical on every rank
            mean += row
        mean /= len(rows)
        for k, v in zip(keys, mean):
            logs[k] = float(v)


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over the first
    ``warmup_epochs`` epochs, adjusted every batch.

    After ``e`` epochs (fractional) the rate is ``initial_lr / size * (e * (size - 1) /
    warmup_epochs + 1)``, with ``e`` counted at the end of each batch, so the last batch
    of the warmup uses ``initial_lr`` exactly (Horovod's schedule).

    ``momentum_correction`` (Goyal et al., section 2.1) is not offered: Keras 3 bakes the
    momentum into the compiled train step, so changing it per batch has no effect.
    """

    def __init__(self, initial_lr, warmup_epochs=5, steps_per_epoch=None, verbose=0,
                 momentum_correction=False, size=None):
        super().__init__()
        if momentum_correction:
            raise ValueError("momentum_correction is not supported with Keras 3: the momentum "
                             "is a constant of the compiled train step")
        if warmup_epochs <= 0:
            raise ValueError("warmup_epochs must be positive")
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.size = size
        self.current_epoch = 0

    def multiplier(self, epoch):
        size = self.size or hvd.size()
        return (epoch * (size - 1) / self.warmup_epochs + 1) / size

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.steps_per_epoch:
            raise ValueError("LearningRateWarmupCallback needs steps_per_epoch (Keras did not "
                             "report the number of steps per epoch)")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if epoch == self.warmup_epochs:
            self._set(self.initial_lr)

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch >= self.warmup_epochs:
            return
        progress = self.current_epoch + (batch + 1) / self.steps_per_epoch
        self._set(self.initial_lr * self.multiplier(min(progress, self.warmup_epochs)))

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1 and self.verbose and hvd.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self.initial_lr:g}.")

    def _set(self, value):
        self.model.optimizer.learning_rate = value


def _is_number(value):
    if isinstance(value, (bool, str)):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return np.ndim(value) == 0


class CollectiveWatchdog(keras.callbacks.Callback):
    """A deadline on every training batch, for collectives inside the compiled step.

    ``model.fit`` runs the train step as a ``tf.function``: its collectives wait inside
    TensorFlow, where the per-collective deadline of :mod:`hvd_quant.core.watchdog`
    cannot see them. This callback arms that watchdog when a batch begins and disarms it
    when the batch ends; a batch that takes longer than ``timeout`` seconds (default
    ``HVD_QUANT_COLLECTIVE_TIMEOUT``, 600 s) prints which rank timed out and ends the
    process with exit code 124, so that ``horovodrun`` ends the job. The first batch
    also traces and compiles the step: ``first_batch_timeout`` (default three times
    ``timeout``) bounds it.
    """

    def __init__(self, timeout=None, first_batch_timeout=None):
        super().__init__()
        self.timeout = timeout
        self.first_batch_timeout = first_batch_timeout
        self._token, self._first = None, True

    def on_train_batch_begin(self, batch, logs=None):
        from ..core.watchdog import default_timeout

        timeout = default_timeout() if self.timeout is None else float(self.timeout)
        if self._first:
            timeout = 3 * timeout if self.first_batch_timeout is None else float(self.first_batch_timeout)
        self._token = WATCHDOG.arm(f"training batch {batch}", timeout)

    def on_train_batch_end(self, batch, logs=None):
        WATCHDOG.disarm(self._token)
        self._token, self._first = None, False

    def on_train_end(self, logs=None):
        WATCHDOG.disarm(self._token)
        self._token = None


class FinalSyncCallback(keras.callbacks.Callback):
    """When training ends, make 0/1 Adam's ranks hold one model: calls the optimizer's
    ``final_sync()`` (``hvd_quant.tensorflow.ZeroOneAdam``, also inside
    ``hvd_quant.tensorflow.DistributedOptimizer``), which synchronises the local steps
    since the last sync and does nothing when the last step was a sync. With
    ``ZeroOneAdam(exact_sync=True)`` the ranks then end with bit-identical weights.
    Optimizers without ``final_sync`` are left alone, so the callback can stay in a
    script that switches optimizers.

    Every rank must run it (it may issue a collective). Put it before callbacks that save
    or evaluate the final model in ``on_train_end``. ``synced`` tells whether the last
    ``fit`` ended with a sync.
    """

    def __init__(self):
        super().__init__()
        self.synced = False

    def on_train_end(self, logs=None):
        optimizer, seen = getattr(self.model, "optimizer", None), set()
        while optimizer is not None and id(optimizer) not in seen:
            seen.add(id(optimizer))
            if callable(getattr(optimizer, "final_sync", None)):
                self.synced = bool(optimizer.final_sync())
                return
            optimizer = getattr(optimizer, "inner_optimizer", None)
        self.synced = False


class JitCompileCallback(keras.callbacks.Callback):
    """``model.compile(..., jit_compile=True)`` with hvd_quant: XLA compiles the forward and
    backward pass, the gradient reduction and the optimizer step run outside XLA.

    Horovod's collectives cannot be XLA-compiled, and Keras compiles the whole train step
    (optimizer included) under ``jit_compile=True``, so without this callback the first
    step raises. When ``fit`` starts on a model compiled with ``jit_compile=True``, this
    callback replaces its train step with :func:`hvd_quant.tensorflow.xla_step.split_train_step`
    (the same computation as Keras' default step, in two functions) and restores the
    model when ``fit`` ends. With ``jit_compile=False`` or ``run_eagerly=True`` it does
    nothing. It applies to ``fit`` only (``train_on_batch`` runs no callbacks).
    """

    def __init__(self):
        super().__init__()
        self._split = False  # this fit's train step was split (restore it when fit ends)

    def on_train_begin(self, logs=None):
        from .xla_step import split_train_step

        model = self.model
        self._split = bool(model.jit_compile) and not model.run_eagerly
        if not self._split:
            return
        model.train_step = split_train_step(model)
        model.jit_compile = False  # the outer step: a plain tf.function
        model.make_train_function(force=True)

    def on_train_end(self, logs=None):
        if not self._split:
            return
        model = self.model
        model.__dict__.pop("train_step", None)
        model.jit_compile = True
        model.train_function = None  # the next fit builds (and splits) it again
        self._split = False


#: What :class:`MetricsCallback` adds by default: the last step's figures, summed over the
#: optimizer's buffers, that say most at a glance (``opt.metrics()`` has them all).
DEFAULT_LOGGED = ("compression_ratio", "encode_s", "wait_s", "decode_s", "step_s",
                  "probe_rel_error", "probe_cosine", "residual_ratio", "scale_max", "skipped_steps", "fallbacks")


class MetricsCallback(keras.callbacks.Callback):
    """Add the optimizer's compression metrics to ``logs`` as ``hvd_quant/<figure>``, so
    that Keras's own callbacks after this one show them: the progress bar, ``History``,
    ``CSVLogger`` and ``TensorBoard`` (epoch logs; batch logs with its ``update_freq``).

    Parameters
    ----------
    figures : sequence of str
        Names of ``optimizer.metrics()`` (default :data:`DEFAULT_LOGGED`; e.g.
        ``"bucket0/probe_rel_error"`` or ``"wait_s.mean"`` also work). A figure not
        measured yet is NaN, so that every epoch has the same columns (``CSVLogger``
        fixes them at the first epoch).
    every : int
        Add them to the batch logs every ``every`` batches (0: only at the end of each
        epoch). Reading them costs a few microseconds, without a collective.
    optimizer : hvd_quant.tensorflow.DistributedOptimizer, OnebitAdam, ZeroOneAdam, BinSGDM or None
        Default: the model's (made with ``metrics=True``; else a ``ValueError`` when
        training starts).
    """

    def __init__(self, figures=DEFAULT_LOGGED, every=1, optimizer=None):
        super().__init__()
        if isinstance(figures, str) or not all(isinstance(f, str) for f in figures) or not figures:
            raise ValueError(f"figures must be a non-empty sequence of metric names, got {figures!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"every must be a whole number >= 0 (0: epoch logs only), got {every!r}")
        if optimizer is not None:
            _metrics_of(optimizer)
        self.figures, self.every, self._optimizer = tuple(figures), every, optimizer

    def on_train_begin(self, logs=None):
        if self._optimizer is None:
            _metrics_of(self.model.optimizer)

    def _add(self, logs):
        if logs is None:
            return
        snapshot = _metrics_of(self._optimizer or self.model.optimizer)()
        for name in self.figures:
            value = snapshot.get(name)
            logs[f"{TAG}/{name}"] = float("nan") if value is None else float(value)

    def on_train_batch_end(self, batch, logs=None):
        if self.every and (batch + 1) % self.every == 0:
            self._add(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._add(logs)


def _metrics_of(optimizer):
    """``optimizer.metrics`` of an hvd_quant optimizer made with ``metrics=True``, or the
    ``ValueError`` that says what to pass."""
    measured = getattr(optimizer, "_metrics_on", None)
    if measured is None:
        raise ValueError("MetricsCallback reads the metrics of an hvd_quant.tensorflow.DistributedOptimizer "
                         f"or 1-bit optimizer, got {type(optimizer).__name__}")
    if not measured:
        raise ValueError("MetricsCallback: the optimizer measures nothing; make it with metrics=True "
                         "(hq.DistributedOptimizer(..., metrics=True), hq.OnebitAdam(..., metrics=True))")
    return optimizer.metrics
