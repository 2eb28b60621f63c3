"""Horovod Elastic with TensorFlow / Keras 3: :class:`KerasState`, :func:`run`, :func:`function`.

Custom loop::

    import horovod.tensorflow as hvd
    import hvd_quant.tensorflow as hq
    from hvd_quant.tensorflow import elastic

    hvd.init()
    compression = hq.Compression.ef_sign
    state = elastic.KerasState(model, optimizer, compression=compression, step=0)

    @elastic.function                      # not tf.function: see "Retracing" below
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        tape = hq.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @elastic.run                           # not hvd.elastic.run: see below
    def train(state):
        while state.step < steps:
            train_step(*batch(state.step))
            state.step += 1
            state.commit()

``model.fit``: compile with ``hq.DistributedOptimizer(...)`` or a 1-bit optimizer, make
``state = elastic.KerasState(model, epoch=0)`` and, inside an ``@elastic.run`` function,
call ``model.fit(..., initial_epoch=state.epoch, callbacks=[elastic.CommitEpochCallback(state)])``.
An interrupted epoch starts again from its beginning.

Why not Horovod's own TF elastic API (checked in Horovod 0.28.1's source)
------------------------------------------------------------------------
* ``hvd.elastic.TensorFlowKerasState`` calls ``optimizer.variables()``: a list property
  in Keras 3 (``TypeError: 'list' object is not callable``); ``TensorFlowState``
  broadcasts with ``hvd.broadcast_variables``, which fails on Keras 3 variables
  (horovod #4290). Neither knows which variables are per rank.
* ``horovod.tensorflow.elastic.run`` turns a ``tf.errors.UnknownError`` into a reset only
  if its message names ``HorovodAllreduce``, ``HorovodAllgather`` or ``HorovodBroadcast``;
  any other ``UnknownError`` is caught and *swallowed* (its ``except`` clause has no
  ``raise`` for the other case), so the training function returns ``None`` as if it
  had finished. A peer that dies during an alltoall (``HorovodAlltoall``: the ``onebit``
  compressor, the ring compressors and the 1-bit optimizers use it) thus ends the
  survivors' training silently instead of resetting. :func:`run` resets on a failed
  Horovod collective of any kind and re-raises every other error.
* A traced ``tf.function`` (and ``model.fit``'s train function) keeps the world it was
  traced in: rank and size are Python constants in the graph, the communicators of the
  tapes are made at trace time, and resized state variables are new ``tf.Variable``s.

What happens on a reset (a rank failed, or hosts were added or removed)
-----------------------------------------------------------------------
Horovod restores the last commit (after a failure), then :func:`run` shuts Horovod down
and initialises it again, and :meth:`KerasState.reset`

1. forgets the torus/node process sets (:func:`hvd_quant.process_sets.forget_stale_sets`)
   and re-reads rank and size in every communicator;
2. re-validates every compressor and 1-bit method for the new size (``ValueError`` on
   every rank if it cannot work there: Marsit's ``torus_rows`` or BinSGDM's
   ``ranks_per_node`` must divide it, explicit Global-QSGD ``bits``/``levels`` must still
   be safe; Global-QSGD picks its safe levels for the new size by itself);
3. re-arms the agreement checks (same compressor, options, model and values), which run
   again on every rank, together with the ranks that joined;
4. resizes and zeroes the world-dependent Keras variables (below);
5. makes traced functions trace again: :func:`function` wrappers and the models'
   ``train_function``/``test_function``/``predict_function``.

Then, unless hosts were only removed, :meth:`KerasState.sync` broadcasts from rank 0.

Per-rank state (the rule; the same as :mod:`hvd_quant.torch.elastic`)
--------------------------------------------------------------------
* Error feedback of the compressors (``ef_sign``, Marsit's compensation...), per
  variable: **ranks that survive keep their residuals** (as of the last commit after a
  failure), **ranks that join start from zero**. It is never broadcast: error feedback
  only delays gradient mass that this rank has not sent yet.
* State whose size or meaning depends on the rank or the world size (the padded worker
  and server error buffers of the ``onebit`` compressor, 1-bit Adam and 0/1 Adam)
  **restarts from zero**, resized, on a rank whose ``(rank, size)`` changed (a warning
  says so for compressor buffers).
* Random-stream positions of stochastic compressors are per rank number and kept.
* Everything else is **made identical from rank 0** by the sync: model variables, the
  wrapped optimizer's state (momentum, Adam moments, ``iterations``, the loss scale) and
  the 1-bit optimizers' moments, accumulators, counters and master weights, so that every
  rank follows the same schedule. (When hosts were only removed Horovod skips the sync
  and every survivor keeps its own.)

Optimizers tell the state which of their variables stay per rank
(``elastic_local_variables()``) and adapt themselves on a reset (``elastic_reset()``);
``elastic_check()`` runs a pending agreement check at the sync.
"""

import functools
import re

import keras
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd
from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import HorovodInternalError

from ..core.runner import check_agreement, digest63
from ..process_sets import forget_stale_sets
from .compression import TFCompressor, variable_name
from .tape import broadcast_variables

__all__ = ["CommitEpochCallback", "KerasState", "TensorFlowKerasState", "TensorFlowState",
           "function", "generation", "is_horovod_failure", "run"]

_GENERATION = [0]

# A failed Horovod collective, as TensorFlow reports it: the op's name (eagerly
# "[Op:HorovodAlltoall]", in a graph "node HorovodAlltoall_...") or, for collectives
# queued when Horovod shut down after a peer failed, Horovod's shutdown message.
_HOROVOD_FAILURE = re.compile(r"Horovod(Grouped)?(Allreduce|Allgather|Broadcast|Alltoall|"
                              r"Reducescatter)|Horovod has been shut down")


def generation():
    """A counter that grows on every elastic reset of this process: graphs traced in an
    earlier generation hold the old world (see :func:`function`)."""
    return _GENERATION[0]


def _new_generation():
    _GENERATION[0] += 1


class _ElasticFunction:
    """A ``tf.function`` made again from the Python function after every reset."""

    def __init__(self, fn, options):
        self._fn, self._options = fn, dict(options)
        self._traced, self._generation = None, None
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if self._traced is None or self._generation != generation():
            self._traced = tf.function(self._fn, **self._options)
            self._generation = generation()
        return self._traced(*args, **kwargs)

    def __get__(self, obj, objtype=None):  # used as a method: bind, keep one cache
        return self if obj is None else functools.partial(self.__call__, obj)


def function(fn=None, **options):
    """``tf.function`` for elastic jobs: traced again after every elastic reset.

    A traced graph keeps the world it was traced in (rank and size as constants, the
    tapes' communicators, the state variables of that size), so a step traced before a
    reset must not run after it. Use like ``tf.function`` (``@function`` or
    ``@function(jit_compile=False, reduce_retracing=True)``); ``options`` go to
    ``tf.function``.
    """
    if fn is None:
        return lambda f: _ElasticFunction(f, options)
    return _ElasticFunction(fn, options)


def is_horovod_failure(error):
    """Whether ``error`` is a Horovod collective that failed (a peer died or Horovod shut
    down), which an elastic job recovers from; see the module docstring."""
    return isinstance(error, tf.errors.UnknownError) and bool(_HOROVOD_FAILURE.search(str(error)))


def run(func):
    """Decorator that runs ``func(state, ...)`` as Horovod Elastic's ``hvd.elastic.run``
    does, resetting on a failed Horovod collective of any kind (alltoall included) and
    re-raising every other error, which Horovod's TensorFlow ``run`` may swallow (module
    docstring). On a reset: Horovod is shut down and initialised again and graphs made
    by :func:`function` trace again; the state's ``reset`` adapts hvd_quant's objects."""
    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as e:
            if is_horovod_failure(e):
                raise HorovodInternalError(e) from e
            raise
    functools.update_wrapper(wrapper, func)
    return run_fn(wrapper, _reset)


def _reset():
    hvd.shutdown()
    hvd.init()
    _new_generation()


def _as_list(value):
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


class TensorFlowState(ObjectState):
    """Elastic state of plain TensorFlow/Keras variables and, optionally, of the
    compressor state of ``hvd_quant.tensorflow.DistributedGradientTape``.

    Parameters
    ----------
    variables : list of tf.Variable / keras.Variable
        Committed, restored and broadcast from rank 0 by the sync.
    compression : hvd_quant.tensorflow.Compression.<name>, or a list of them
        Handles used with ``hvd_quant.tensorflow.DistributedGradientTape``: the state
        they keep for every set of variables they reduced (error feedback,
        world-dependent buffers, random streams) is committed, restored and adapted on
        a reset, never broadcast.
    **kwargs
        Other values to commit and sync (``step=0``), as attributes of the state.
    """

    def __init__(self, variables=None, compression=None, **kwargs):
        self._variables = list(variables or [])
        self._handles = _as_list(compression)
        for h in self._handles:
            if not isinstance(h, TFCompressor):
                raise TypeError(f"compression= takes hvd_quant.tensorflow.Compression handles, got {h!r}")
        self._saved = []
        self._saved_runners = []
        self._save_tensors()
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)

    # --- what is committed -------------------------------------------------------------
    def _all_variables(self):
        """Every variable to commit and restore (per-rank ones included)."""
        return list(self._variables)

    def _shared_variables(self):
        """The variables the sync broadcasts from rank 0, in the same order on every rank."""
        return list(self._variables)

    def _runners(self):
        """The compressor runners of the tapes that used the handles (live owners)."""
        return [owned.runner for h in self._handles for owned in h._live_owners()]

    def _save_tensors(self):
        self._saved = [(v, np.array(v.numpy(), copy=True)) for v in self._all_variables()]
        self._saved_runners = [(r, r.state_dict(), r.rng_state()) for r in self._runners()]

    def _restore_tensors(self):
        for var, value in self._saved:
            # A variable resized for a new world since the commit keeps its zeros: that
            # state restarts from zero in a new world anyway (module docstring).
            if tuple(var.shape) == value.shape:
                var.assign(value)
        for runner, state, rng in self._saved_runners:
            runner.load_state_dict(state)
            runner.load_rng_state(rng)

    def save(self):
        self._save_tensors()
        super().save()

    def restore(self):
        self._restore_tensors()
        super().restore()

    def sync(self):
        self._prepare_sync()
        shared = self._shared_variables()
        _check_same_variables(shared)
        broadcast_variables(shared, root_rank=0)
        self._save_tensors()
        super().sync()

    def _prepare_sync(self):
        """Collectives every rank runs before the broadcast (subclasses)."""

    def reset(self):
        forget_stale_sets()
        _new_generation()  # also when used with Horovod's own run()
        rank, size = hvd.rank(), hvd.size()
        for h in self._handles:
            for owned in h._live_owners():
                if owned.comm is not None:  # cached by Horovod's stock tape (tf-keras)
                    owned.comm.refresh()
                owned.runner.adapt_world(rank, size)
        super().reset()


class KerasState(TensorFlowState):
    """Elastic state of a Keras 3 model and its optimizer, with hvd_quant's state.

    Parameters
    ----------
    model : keras.Model, or a list of them
        Must be built (e.g. made with ``keras.Input``), as for Horovod's own state.
    optimizer : keras optimizer, or a list (one per model), optional
        Default: each model's compiled optimizer. ``hvd_quant.tensorflow.DistributedOptimizer``,
        the 1-bit optimizers and plain Keras optimizers are all fine.
    compression : hvd_quant.tensorflow.Compression handle(s), optional
        Those used with ``DistributedGradientTape`` in a custom loop (see
        :class:`TensorFlowState`).
    **kwargs
        Values to commit and sync (``epoch=0``, ``step=0``).

    See the module docstring for the reset and for which state stays per rank.
    """

    def __init__(self, model, optimizer=None, compression=None, **kwargs):
        self.models = _as_list(model)
        if not self.models:
            raise ValueError("KerasState needs a model")
        for m in self.models:
            if not m.built:
                raise ValueError(f"model {m.name!r} must be built first (make it with keras.Input, "
                                 "or call model.build(input_shape))")
        optimizers = _as_list(optimizer)
        if not optimizers:
            optimizers = [getattr(m, "optimizer", None) for m in self.models]
            optimizers = [o for o in optimizers if o is not None]
        if len(optimizers) not in (0, len(self.models)):
            raise ValueError(f"give one optimizer per model ({len(self.models)}), got {len(optimizers)}")
        for opt in optimizers:
            _refuse_process_set(opt)
        self.optimizers = optimizers
        self.model = self.models[0]
        self.optimizer = optimizers[0] if optimizers else None
        super().__init__(variables=None, compression=compression, **kwargs)

    def _all_variables(self):
        out = [v for m in self.models for v in m.variables]
        seen = {id(v) for v in out}
        for opt in self.optimizers:
            out += [v for v in opt.variables if id(v) not in seen]
            seen.update(id(v) for v in opt.variables)
        return out

    def _shared_variables(self):
        local = {id(v) for opt in self.optimizers for v in _local_variables(opt)}
        return [v for v in self._all_variables() if id(v) not in local]

    def _prepare_sync(self):
        # Ranks that joined build their optimizers now (the 1-bit ones check agreement
        # while building), so that the variables to broadcast exist; survivors run the
        # check a reset re-armed at the same point.
        for model, opt in zip(self.models, self.optimizers):
            if not opt.built and model.trainable_variables:
                with keras.name_scope(opt.name, caller=opt):
                    opt.build(model.trainable_variables)
                opt.built = True
            check = getattr(opt, "elastic_check", None)
            if check is not None:
                check()

    def reset(self):
        super().reset()  # process sets, generation, tapes' compressors
        for opt in self.optimizers:
            hook = getattr(opt, "elastic_reset", None)
            if hook is not None:
                hook()
        for m in self.models:  # model.fit/evaluate/predict trace again for the new world
            m.train_function = m.test_function = m.predict_function = None


#: Horovod's name for the Keras state.
TensorFlowKerasState = KerasState


class CommitEpochCallback(keras.callbacks.Callback):
    """For ``model.fit`` in an elastic job: at the end of every epoch, sets
    ``state.epoch`` to the number of epochs done and commits ``state``. Pass
    ``initial_epoch=state.epoch`` to ``fit``."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1
        self.state.commit()


def _local_variables(optimizer):
    hook = getattr(optimizer, "elastic_local_variables", None)
    return list(hook()) if hook is not None else []


def _refuse_process_set(optimizer):
    """Elastic resets re-create only Horovod's global process set."""
    ps = getattr(optimizer, "process_set", None) or getattr(optimizer, "_hq_process_set", None)
    if ps is not None and ps is not hvd.global_process_set and ps.process_set_id != 0:
        raise ValueError("hvd_quant: elastic jobs need optimizers on the global process set: "
                         "after a reset Horovod re-creates only that one")


def _check_same_variables(variables):
    """Before broadcasting: every rank must hold the same list of variables (names,
    shapes, dtypes), or the broadcast would pair different variables. One allgather;
    :class:`~hvd_quant.core.runner.RankDisagreement` on every rank together."""
    row = np.array([digest63(*(f"{variable_name(v)}:{tuple(v.shape)}:{v.dtype}" for v in variables))],
                   dtype=np.int64)
    gathered = hvd.allgather(tf.constant(row[None, :]), name="hvd_quant.elastic.sync.check",
                             ignore_name_scope=True).numpy()
    check_agreement(gathered, ["the variables of the elastic state"],
                    ["Build the same model and optimizer on every rank, and pass them to the "
                     "state in the same order."])
