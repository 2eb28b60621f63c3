"""Keras 3 ``model.fit`` with compressed gradient reduction: :class:`DistributedOptimizer`.

Horovod's Keras integration does not work with Keras 3 (horovod #4290); this module is
its counterpart for hvd_quant::

    import horovod.tensorflow as hvd
    import hvd_quant.tensorflow as hq

    hvd.init()
    opt = hq.DistributedOptimizer(keras.optimizers.Adam(1e-3), compression=hq.Compression.ef_sign)
    model.compile(optimizer=opt, loss=..., metrics=[...])
    model.fit(x, y, callbacks=[hq.callbacks.BroadcastGlobalVariablesCallback(0),
                               hq.callbacks.MetricAverageCallback()])

How it fits Keras
-----------------
* ``apply()`` (what ``model.fit`` and ``apply_gradients`` call) averages the gradients
  over ranks with the compressor (:func:`~hvd_quant.tensorflow.tape.reduce_gradients`:
  fp32, fused, non-finite on any rank makes the result non-finite on every rank), then
  hands them to the wrapped optimizer.
* Compressor state (error feedback, random-stream positions) is held in Keras optimizer
  variables, created in ``build()``: ``optimizer.variables``, ``model.save`` and
  ``keras.callbacks.ModelCheckpoint`` include it. It is per rank: save one file per rank
  (``f"ckpt-{hvd.rank()}.keras"``) and load each rank's own.
* Mixed precision. Keras wraps the optimizer in a ``LossScaleOptimizer`` under a
  ``mixed_float16`` policy; that wrapper checks the *local* gradients for inf/NaN and
  skips the inner optimizer on its own, so ranks could disagree and leave the others
  waiting in a collective. This class therefore *is* a ``LossScaleOptimizer`` (Keras does
  not wrap it again) that reduces first and checks after: gradients are unscaled,
  reduced, and the step is applied or skipped on every rank alike, from the reduced
  values. ``loss_scale="auto"`` follows the global dtype policy (``mixed_float16`` ->
  dynamic loss scaling, as Keras' ``compile`` would); ``True``/``False`` force it.
  Passing a ``LossScaleOptimizer`` as ``optimizer`` adopts its settings.
* ``jit_compile=True``: Horovod's collectives are custom TensorFlow ops that XLA cannot
  compile (this Horovod build has no XLA ops), and Keras compiles the whole train step.
  Pass :class:`~hvd_quant.tensorflow.callbacks.JitCompileCallback` to ``fit``: XLA then
  compiles the forward and backward pass and the reduction runs outside it
  (:mod:`hvd_quant.tensorflow.xla_step`). Without it, the first trace raises a
  :class:`RuntimeError` saying so on every rank, before any collective.
"""

import sys

import keras
import tensorflow as tf
import horovod.tensorflow as hvd
from keras.optimizers import LossScaleOptimizer
from keras.src.utils import tracking

from ..core import adaptive_check
from ..core.metrics import DEFAULT_PROBE_EVERY, DEFAULT_REPORT_AFTER
from ..process_sets import includes_this_rank
from . import monitoring
from .comm import HorovodTFComm
from .compression import Compression
from .onebit_optimizers import resize_keras_variable
from .tape import (check_agreement_once, divide_gradient, group_segments, keras_layers,
                   note_sparse_reduced_dense, reduce_gradients, reduce_when_the_graph_runs)
from .xla_step import refuse_xla

_LSO_FRAMES = ("_stateful_handle_finite_grads", "_common_apply", "_tf_apply", "apply_fn")


def _adaptive_optimizers():
    """Keras' adaptive optimizers: a per-element second moment or accumulator, which a
    compressor's error feedback flattens (hvd_quant.core.adaptive_check says why)."""
    names = ("Adam", "AdamW", "Adamax", "Nadam", "Adagrad", "Adadelta", "RMSprop", "Adafactor", "Lamb")
    return tuple(getattr(keras.optimizers, n) for n in names if hasattr(keras.optimizers, n))


@keras.saving.register_keras_serializable(package="hvd_quant")
class DistributedOptimizer(LossScaleOptimizer):
    """Wrap a Keras 3 optimizer so that ``apply()`` first averages the gradients over
    ranks with ``compression``. A rank outside ``process_set`` reduces nothing and
    applies its own gradients, as under Horovod.

    Parameters
    ----------
    optimizer : keras.optimizers.Optimizer
        Any Keras 3 optimizer, or a ``LossScaleOptimizer`` (its settings are adopted).
        hvd_quant's 1-bit optimizers communicate themselves: pass them to ``compile``
        directly, or wrap them here without ``compression`` for mixed precision (this
        class then only does the loss scaling, from their all-rank verdict).
    compression : hvd_quant.tensorflow.Compression.<name>
        Configuration only; this optimizer keeps its own state.
    name : str, optional
    op : hvd.Average or hvd.Sum
    num_groups, groups : int, list of lists of variables
        Number of fused buffers (default one), or Horovod's ``groups``: the variables of
        each inner list in a buffer of their own, the rest in one more.
    process_set : horovod process set
    loss_scale : "auto", bool
        Dynamic loss scaling as Keras' ``LossScaleOptimizer`` does it, but decided from the
        reduced gradients (see the module docstring). ``"auto"``: on under the
        ``mixed_float16`` global policy.
    initial_scale, dynamic_growth_steps : as ``keras.optimizers.LossScaleOptimizer``.
    sparse_as_dense : bool
        Default True: a sparse gradient (``tf.IndexedSlices``: a Keras ``Embedding``'s
        always is) is reduced as a dense gradient of its variable's full size, as
        Horovod's ``sparse_as_dense=True`` does. It costs a float32 buffer of the whole
        table per step (49 MB for ``Embedding(32000, 384)``), the compressor's passes over
        it, and a dense update of the table by the wrapped optimizer. ``False`` (Horovod's
        default, a sparse allreduce there) is reduced the same way, since hvd_quant
        compresses dense buffers only, and rank 0 says so once.
    device_dense, device_sparse, gradient_predivide_factor :
        Accepted for compatibility with Horovod's signature (averaging is exact).
    backward_passes_per_step, average_aggregated_gradients :
        As Horovod's Keras optimizer: gradients are summed on each rank over that many
        passes (``apply`` calls), then reduced and applied once (divided by the number of
        passes with ``average_aggregated_gradients``). The sums are per-rank optimizer
        variables.
    scale_local_gradients : bool
        Variables registered with :meth:`register_local_var` (or through
        :func:`PartialDistributedOptimizer`) keep their own gradients, divided by the
        number of ranks when True (Horovod's default).
    strict : bool or None
        ``True``: ranks whose variable values differ at the first step raise
        :class:`~hvd_quant.core.runner.RankDisagreement` together; ``False``: training goes
        on, as under Horovod, and rank 0 warns once if they still differ at the next trace.
        ``None``: ``HVD_QUANT_STRICT`` (unset: ``False``).
    metrics : bool
        ``True``: measure what compression does (:meth:`metrics`, read in ``fit`` by
        :class:`~hvd_quant.tensorflow.callbacks.MetricsCallback`): the figures of the torch
        ``hq.DistributedOptimizer.metrics()``. In ``fit``'s compiled step the reduction
        stays compiled and the graph times its collectives; probe steps (and the guard's
        fp32 steps) run the eager code in a ``tf.py_function``, with the same bits
        (:mod:`hvd_quant.tensorflow.monitoring`; what it costs: docs/guide/monitoring.md).
        Default False.
    probe_every, guard, report_after :
        As the torch ``hq.DistributedOptimizer``'s, with ``metrics=True``: a probe step
        (one extra fp32 reduce-scatter) every ``probe_every`` reductions of a buffer; the guard
        that sends a buffer whose compressed mean stays far from the exact one to fp32
        (``None``: on for ``auto``; :meth:`guard_state_dict` for checkpoints); rank 0's
        "does it pay here?" line after ``report_after`` steps (``0``: none).
    """

    # The 1-bit optimizers accept this LossScaleOptimizer around them (see apply).
    _hvd_quant_loss_scaling = True

    def __init__(self, optimizer, compression=Compression.none, name=None, op=hvd.Average,
                 num_groups=0, groups=None, process_set=hvd.global_process_set, loss_scale="auto",
                 initial_scale=2.0 ** 15, dynamic_growth_steps=2000, device_dense="",
                 device_sparse="", sparse_as_dense=True, gradient_predivide_factor=1.0,
                 backward_passes_per_step=1, average_aggregated_gradients=False,
                 scale_local_gradients=True, strict=None, metrics=False,
                 probe_every=DEFAULT_PROBE_EVERY, guard=None, report_after=DEFAULT_REPORT_AFTER):
        if keras.backend.backend() != "tensorflow":
            raise RuntimeError("hvd_quant.tensorflow.DistributedOptimizer needs Keras' TensorFlow "
                               f"backend (KERAS_BACKEND=tensorflow), not {keras.backend.backend()!r}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("the optimizer is already an hvd_quant DistributedOptimizer")
        compression = Compression.adopt(compression, hvd.Compression)
        communicates = bool(getattr(optimizer, "_hvd_quant_communicates", False))
        if communicates and getattr(compression, "name", None) != "none":
            raise TypeError(f"{type(optimizer).__name__} averages over ranks by itself, so "
                            "compression does not apply to it: pass it to model.compile directly, "
                            "or wrap it without compression= for loss scaling only")
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "hvd_quant.tensorflow.DistributedOptimizer wraps Keras 3 optimizers, got "
                f"{type(optimizer).__module__}.{type(optimizer).__name__}. Under tf-keras "
                "(TF_USE_LEGACY_KERAS=1) use Horovod's own hvd.keras.DistributedOptimizer(opt, "
                "compression=hvd_quant.tensorflow.Compression.<name>) (horovod.tensorflow.keras).")
        compression = Compression.require(compression, hvd.Compression,
                                          "hvd_quant.tensorflow.DistributedOptimizer", "Horovod's optimizers")
        # An adaptive optimizer (Adam and kin) may get another method from a compressor that
        # chooses (auto: none with error feedback). Rank 0 says it when error feedback feeds
        # one (a Keras optimizer may be built before hvd.init(): then this process).
        adaptive = isinstance(optimizer, _adaptive_optimizers())
        adaptive_check.warn_once(compression.algorithm_for(adaptive),
                                 type(optimizer).__name__, adaptive, hvd.rank() if hvd.is_initialized() else 0)
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("hvd_quant.tensorflow.DistributedOptimizer supports op=hvd.Average or hvd.Sum")
        monitoring.check_options(metrics, probe_every, guard, report_after, compression, adaptive)
        if gradient_predivide_factor != 1.0 and op != hvd.Average:
            raise ValueError("gradient_predivide_factor only applies to op=hvd.Average")
        if (isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int)
                or backward_passes_per_step < 1):
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        if loss_scale not in ("auto", True, False):
            raise ValueError(f"loss_scale must be 'auto', True or False, got {loss_scale!r}")
        if isinstance(optimizer, LossScaleOptimizer):
            initial_scale, dynamic_growth_steps = optimizer.initial_scale, optimizer.dynamic_growth_steps
            optimizer, loss_scale = optimizer.inner_optimizer, True
        inner_factor = optimizer.loss_scale_factor  # LossScaleOptimizer.__init__ clears it
        super().__init__(optimizer, initial_scale=initial_scale,
                         dynamic_growth_steps=dynamic_growth_steps,
                         name=name or f"distributed_{optimizer.name}")
        self._inner_loss_scale_factor = inner_factor
        self._inner_communicates = communicates
        self._compression = compression
        self._hq_adaptive = adaptive
        self._op = op
        self._fuse_groups = groups if groups is not None else int(num_groups or 0)
        self.process_set = process_set
        self._loss_scale_option = loss_scale
        self._sparse_as_dense = bool(sparse_as_dense)
        self._strict = strict
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self._aggregated = None  # (counter, sums per variable): backward_passes_per_step > 1
        self.scale_local_gradients = bool(scale_local_gradients)
        self._local_vars = {}  # id -> variable (held, so that the id stays its own)
        self._loss_scale_on = None  # resolved on first use
        self._runner = None
        self._comm = None
        self._per_rank = []
        self._metrics_on, self._probe_every, self._guard_option = metrics, probe_every, guard
        self._report_after = report_after
        self._monitor = None  # made with the runner (build)
        with tf.init_scope():
            self._bytes = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="hvd_quant_bytes_sent")

    # --- loss scaling -----------------------------------------------------------------------
    def _loss_scaling(self):
        if self._loss_scale_on is None:
            on = self._loss_scale_option
            if on == "auto":
                on = keras.config.dtype_policy().name == "mixed_float16"
            self._loss_scale_on = bool(on)
            # Keras' LossScaleOptimizer disabled the inner optimizer's own factor; give it
            # back when this optimizer does no dynamic scaling.
            self.inner_optimizer.loss_scale_factor = None if on else self._inner_loss_scale_factor
        return self._loss_scale_on

    def scale_loss(self, loss):
        if self._loss_scaling():
            return super().scale_loss(loss)
        return self.inner_optimizer.scale_loss(loss)

    # --- state ------------------------------------------------------------------------------
    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        if self._loss_scaling():
            super().build(var_list)  # step_counter, dynamic_scale; builds the inner optimizer
        else:
            self.inner_optimizer.build(var_list)
            super(LossScaleOptimizer, self).build(var_list)  # skip the loss-scale variables
        if self.backward_passes_per_step > 1:
            self._aggregated = (self._per_rank_variable("hvd_quant_passes", (), "int64"),
                                [self._per_rank_variable(f"hvd_quant_sum_{i}", tuple(v.shape), "float32")
                                 for i, v in enumerate(var_list)])
        if self._inner_communicates:
            return
        # Made on every rank, so that owners are numbered alike everywhere (their collective
        # names); a rank outside the process set reduces nothing and keeps no state.
        runner = self._compression.make_runner(make_variable=self._make_state_variable,
                                               strict=self._strict, adaptive=self._hq_adaptive)
        if not includes_this_rank(self.process_set):
            return
        self._compression.prepare()  # Horovod is initialised now: the ranks on this host are known
        self._comm = HorovodTFComm(self.process_set)
        self._runner = runner
        self._runner.build(self._comm.rank, group_segments(self._shared(var_list), self._fuse_groups),
                           size=self._comm.size)
        if self._metrics_on:
            self._monitor = monitoring.make_monitor(self._runner, self._comm, self._compression,
                                                    self._probe_every, self._guard_option,
                                                    self._report_after, self._hq_adaptive)

    # --- model parallelism (Horovod's register_local_var) ---------------------------------
    def register_local_var(self, var):
        """Keep ``var``'s gradient local: it is not reduced over ranks (Horovod's
        ``DistributedOptimizer.register_local_var``), for a model-parallel part. Register
        before the first step: the fused buffers are laid out when the optimizer is built."""
        if self._runner is not None:
            raise RuntimeError("hvd_quant: register_local_var() after the optimizer was built "
                               "(its first step); register local variables before training")
        self._local_vars[id(var)] = var

    def _is_local(self, var):
        return self._local_vars.get(id(var)) is var

    def _shared(self, variables):
        return [v for v in variables if not self._is_local(v)]

    def _per_rank_variable(self, name, shape, dtype):
        var = self.add_variable(shape=shape, initializer="zeros", dtype=dtype, aggregation="none", name=name)
        self._per_rank.append(var)
        return var

    def _make_state_variable(self, name, initial):
        var = self.add_variable(shape=initial.shape, initializer="zeros", dtype=initial.dtype.name,
                                aggregation="none", name=f"hvd_quant_{name}")
        var.assign(initial)
        self._per_rank.append(var)
        backing = var.value  # the tf.Variable behind it (no autocast scope while building)
        if not isinstance(backing, tf.Variable):
            raise RuntimeError("hvd_quant: could not reach the tf.Variable behind a Keras variable")
        return backing

    @property
    def per_rank_variables(self):
        """Variables that differ between ranks by design (compressor state, random-stream
        positions, and the wrapped optimizer's own): never broadcast them from one rank;
        :class:`~hvd_quant.tensorflow.callbacks.BroadcastGlobalVariablesCallback` skips them."""
        return list(self._per_rank) + list(getattr(self.inner_optimizer, "per_rank_variables", []))

    # --- Horovod Elastic (see hvd_quant.tensorflow.elastic) --------------------------------
    def elastic_local_variables(self):
        """Variables that an elastic sync leaves alone on every rank: the compressor's
        state and random-stream positions (error feedback is kept by ranks that survive,
        and starts from zero on ranks that join), and those of a wrapped hvd_quant
        optimizer. The wrapped optimizer's own state (momentum, Adam moments) and the
        loss scale are made identical from the root."""
        inner = getattr(self.inner_optimizer, "elastic_local_variables", None)
        return list(self._per_rank) + (list(inner()) if inner is not None else [])

    def elastic_check(self):
        """Run a wrapped hvd_quant optimizer's pending agreement check (a collective, see
        ``RuleOptimizer.elastic_check``). The compressor's own check runs on the next step,
        on every rank (:meth:`elastic_reset` re-armed it)."""
        inner = getattr(self.inner_optimizer, "elastic_check", None)
        if inner is not None:
            inner()

    def elastic_reset(self):
        """Adapt to the world after Horovod was initialised again (an elastic reset):
        re-read rank and size, re-validate the compressor for the new size (``ValueError``
        when its options cannot work there), re-arm the agreement check, and restart from
        zero (resized) the compressor state whose size depends on the world when this
        rank's ``(rank, size)`` changed. No collective: only the surviving ranks reset."""
        inner = getattr(self.inner_optimizer, "elastic_reset", None)
        if inner is not None:
            inner()
        if self._runner is None:  # not built yet, or the inner optimizer communicates
            return
        self._comm.refresh()
        self._runner.adapt_world(self._comm.rank, self._comm.size, resize=self._resize_state_variable)

    def _resize_state_variable(self, backing, size):
        """The runner's resize hook: it holds the tf.Variable behind one of our Keras
        variables; resize the Keras variable and hand back its new tf.Variable."""
        for var in self._per_rank:
            if var.value is backing:
                return resize_keras_variable(var, (size,)).value
        raise KeyError("hvd_quant: compressor state that this optimizer did not make")

    @property
    def bytes_sent(self):
        """Bytes this rank has sent for gradient reduction, counted per executed step
        (cost model of :class:`~hvd_quant.core.comm.WireMeter`). Around a 1-bit optimizer
        (which communicates by itself) that optimizer's own count."""
        if self._inner_communicates:
            return float(self.inner_optimizer.bytes_sent)
        return float(self._bytes.numpy())

    def compression_state_dict(self):
        """This rank's compressor state as numpy arrays, ``{"variable/key": array}`` (also
        saved by ``model.save`` as optimizer variables)."""
        if self._runner is None:
            return {}
        out = dict(self._runner.state_dict())
        for rank, calls in self._runner.rng_state().items():
            out[f"hvd_quant.rng/{rank}/calls"] = calls
        return out

    # --- monitoring -------------------------------------------------------------------------
    def metrics(self):
        """What compression did, as the torch ``hq.DistributedOptimizer.metrics()`` gives it
        (a dict of plain numbers, ``None`` where not measured yet; ``{}`` without
        ``metrics=True`` or before the first step). The figures:
        :mod:`hvd_quant.core.metrics` and docs/guide/monitoring.md."""
        return self._monitor.snapshot() if self._monitor is not None else {}

    def guard_state_dict(self):
        """The guard's state (plain numbers) for a checkpoint; ``{}`` without a guard."""
        return self._monitor.guard_state_dict() if self._monitor is not None else {}

    def load_guard_state_dict(self, state):
        """Restore :meth:`guard_state_dict`'s output (once the optimizer is built)."""
        if self._monitor is None:
            raise ValueError("load_guard_state_dict: the guard exists once the optimizer is built "
                             "(model.optimizer.build(model.trainable_variables)) with metrics=True")
        self._monitor.load_guard_state_dict(state)

    # --- the step ---------------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        refuse_xla()
        self._refuse_being_wrapped()
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        variables = trainable_variables if trainable_variables is not None else self._trainable_variables
        if self._aggregated is not None:
            self._apply_aggregated(grads, trainable_variables, variables)
            return
        self._apply_now(grads, trainable_variables, variables)

    def _apply_aggregated(self, grads, trainable_variables, variables):
        """``backward_passes_per_step`` > 1, as Horovod's Keras optimizer: add this pass's
        gradients to per-rank sums; every ``backward_passes_per_step``-th pass reduce the
        sums (divided by that number with ``average_aggregated_gradients``), apply them and
        start again from zero. The pass count is the same on every rank, so every rank
        takes the same branch and issues the same collectives."""
        passes, sums = self._aggregated
        for total, g in zip(sums, grads):
            if g is not None:
                total.assign_add(tf.cast(tf.convert_to_tensor(g), tf.float32))
        passes.assign_add(1)
        n = self.backward_passes_per_step

        def reduce_and_apply():
            factor = 1.0 / n if self.average_aggregated_gradients else 1.0
            summed = [None if g is None else tf.cast(total * factor, g.dtype) for g, total in zip(grads, sums)]
            self._apply_now(summed, trainable_variables, variables)
            for total in sums:
                total.assign(tf.zeros_like(total))

        keras.ops.cond(tf.equal(passes % n, 0), reduce_and_apply, lambda: None)

    def _apply_now(self, grads, trainable_variables, variables):
        scaling = self._loss_scaling()
        if self._inner_communicates:
            self._apply_communicating(grads, trainable_variables, variables, scaling)
            return
        if self._runner is None:  # outside the process set: this rank's own gradients
            reduced, finite = self._local_gradients(grads, scaling, 1.0)
        else:
            reduced, finite = self._reduce(grads, variables, scaling)
        # Keras drops variables without a gradient; so do we (after reducing zeros for them,
        # so that the fused layout never changes).
        reduced = [None if g is None else r for g, r in zip(grads, reduced)]
        if not scaling:
            self.inner_optimizer.apply(reduced, trainable_variables)
        else:
            # Every rank sees the same reduced values, so every rank takes the same branch.
            keras.ops.cond(finite, lambda: self._apply_finite(reduced, trainable_variables),
                           self._stateful_handle_non_finite_grads)
        if self._monitor is not None:
            monitoring.step_ended(self._monitor, after=finite)

    def _reduce(self, grads, variables, scaling):
        """The gradients of the shared variables averaged over ranks, those of the local
        ones (:meth:`register_local_var`) kept; and whether all are finite on every rank."""
        shared = [i for i, v in enumerate(variables) if not self._is_local(v)]
        shared_vars = [variables[i] for i in shared]
        shared_grads = [grads[i] for i in shared]
        check_agreement_once(self._runner, self._comm, shared_vars, self._fuse_groups)
        if not self._sparse_as_dense:
            note_sparse_reduced_dense(shared_grads, shared_vars, "DistributedOptimizer", self._comm.rank)
        scale = [self.dynamic_scale] if scaling else []
        if self._monitor is None:
            reduced, finite = self._reduce_shared(shared_grads, shared_vars, self._fuse_groups, *scale)
        elif tf.executing_eagerly():
            reduced, finite = self._monitor.reduce(self._reduce_shared, shared_grads, shared_vars,
                                                   self._fuse_groups, *scale)
        else:  # compiled and timed by the graph; probe and fallback steps eagerly (monitoring)
            reduced, finite = monitoring.reduce_in_graph(
                self._monitor,
                lambda measured: self._reduce_shared(shared_grads, shared_vars, self._fuse_groups, *scale,
                                                     measured=measured),
                lambda: reduce_when_the_graph_runs(
                    lambda *args: self._monitor.reduce(self._reduce_shared, *args), shared_grads, shared_vars,
                    self._fuse_groups, self._sparse_as_dense, "DistributedOptimizer", owner=self, extra=scale))
        if len(shared) == len(variables):
            return reduced, finite
        divisor = float(self._comm.size) if self.scale_local_gradients else 1.0
        out, local_finite = self._local_gradients(grads, scaling, divisor)
        for i, g in zip(shared, reduced):
            out[i] = g
        # Local gradients differ between ranks: their verdict must be shared, or ranks
        # would skip different steps under loss scaling.
        if scaling:
            flag = tf.reshape(tf.where(local_finite, 0.0, 1.0), [1])
            some_rank_not_finite = self._comm.allreduce(flag, "max", "hvd_quant.local_finite")
            finite = tf.logical_and(finite, some_rank_not_finite[0] < 0.5)
        return out, finite

    def _reduce_shared(self, grads, variables, groups, scale=None, measured=None):
        """:func:`reduce_gradients` of the shared variables, its bytes counted."""
        before = self._comm.meter.bytes_sent
        out = reduce_gradients(self._runner, self._comm, grads, variables, groups, self._op, scale=scale,
                               measured=measured)
        self._bytes.assign_add(self._comm.meter.bytes_sent - before)
        return out

    def _local_gradients(self, grads, scaling, divisor):
        """This rank's own gradients (unscaled from the loss scale, divided by
        ``divisor``) and whether they are all finite."""
        scale = tf.cast(self.dynamic_scale, tf.float32) * divisor if scaling else (
            divisor if divisor != 1.0 else None)
        out = [g if g is None or scale is None else divide_gradient(g, scale) for g in grads]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(
            g.values if isinstance(g, tf.IndexedSlices) else g)) for g in out if g is not None]
            or [tf.constant(True)])
        return out, finite

    def _apply_communicating(self, grads, trainable_variables, variables, scaling):
        """Loss scaling around an optimizer that reduces by itself (1-bit Adam, 0/1 Adam,
        BinSGDM): it always runs on every rank, and its own all-rank verdict on the
        gradients' finiteness (``step_was_finite``) drives the scale."""
        if scaling:
            grads = [g if g is None or self._overwrite_variable_with_gradient(v)
                     else g / tf.cast(self.dynamic_scale, g.dtype) for g, v in zip(grads, variables)]
        self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)
        if scaling:
            keras.ops.cond(tf.equal(self.inner_optimizer.step_was_finite, 1), self._grow_scale,
                           self._stateful_handle_non_finite_grads)

    def _apply_finite(self, grads, trainable_variables):
        self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)
        self._grow_scale()

    def _grow_scale(self):
        def upscale():
            self.step_counter.assign(0)
            self.dynamic_scale.assign(self.dynamic_scale * 2.0)

        def increment():
            self.step_counter.assign_add(1)

        keras.ops.cond(keras.ops.equal(self.step_counter, self.dynamic_growth_steps - 1),
                       upscale, increment)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError("hvd_quant.tensorflow.DistributedOptimizer runs on Keras' "
                                  "TensorFlow backend only (no stateless_apply)")

    def _refuse_being_wrapped(self):
        """A LossScaleOptimizer around this one would test the local gradients and skip
        the reduction on some ranks only: refuse it on every rank, while tracing."""
        frame = sys._getframe(2)
        for _ in range(12):
            if frame is None:
                return
            outer = frame.f_locals.get("self")
            if (frame.f_code.co_name in _LSO_FRAMES and isinstance(outer, LossScaleOptimizer)
                    and outer is not self):
                raise TypeError(
                    "hvd_quant: a LossScaleOptimizer wraps hvd_quant's DistributedOptimizer, so "
                    "ranks could skip different steps and wait forever. Put the loss scaling "
                    "inside: hq.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt), ...) "
                    "or hq.DistributedOptimizer(opt, loss_scale=True).")
            frame = frame.f_back

    # --- serialization ----------------------------------------------------------------------
    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "compression": self._compression.config(),
            "op": int(self._op),
            # Groups given as variables cannot be saved: a restored optimizer fuses their
            # gradients into one buffer (the same reduction for per-parameter scales).
            "num_groups": self._fuse_groups if isinstance(self._fuse_groups, int) else 0,
            "sparse_as_dense": self._sparse_as_dense,
            "scale_local_gradients": self.scale_local_gradients,
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            # Once resolved, the choice itself: it decides which variables a checkpoint has.
            "loss_scale": self._loss_scale_option if self._loss_scale_on is None else self._loss_scale_on,
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
            "metrics": self._metrics_on,
            "probe_every": self._probe_every,
            "guard": monitoring.guard_config(self._guard_option),
            "report_after": self._report_after,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                      custom_objects=custom_objects)
        comp = config.pop("compression")
        compression = Compression.get(comp["name"], seed=comp["seed"], **comp["options"])
        op = {int(hvd.Average): hvd.Average, int(hvd.Sum): hvd.Sum}[int(config.pop("op"))]
        return cls(inner, compression=compression, op=op, **config)


def PartialDistributedOptimizer(optimizer, name=None, compression=Compression.none, op=hvd.Average,
                                num_groups=0, groups=None, process_set=hvd.global_process_set,
                                local_layers=None, scale_local_gradients=True, **kwargs):
    """A :class:`DistributedOptimizer` whose ``local_layers`` keep their gradients local
    (Horovod's Keras ``PartialDistributedOptimizer``, working on Keras 3 layers): every
    trainable variable of those layers is registered with
    :meth:`~DistributedOptimizer.register_local_var`. Other arguments as
    :class:`DistributedOptimizer`."""
    layers = keras_layers(local_layers, "PartialDistributedOptimizer")
    opt = DistributedOptimizer(optimizer, compression=compression, name=name, op=op,
                               num_groups=num_groups, groups=groups, process_set=process_set,
                               scale_local_gradients=scale_local_gradients, **kwargs)
    for layer in layers:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt
