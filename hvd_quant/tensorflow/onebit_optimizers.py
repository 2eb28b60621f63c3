"""Keras 3 optimizers that own their communication: 1-bit Adam, 0/1 Adam, BinSGDM.

Thin adapters around the rules of :mod:`hvd_quant.optimizers` (the same code the torch
optimizers run). They work in ``model.compile(optimizer=...)`` + ``model.fit(...)`` and in
custom loops, eagerly and inside ``tf.function``; no ``DistributedOptimizer`` or
distributed tape is needed (or wanted) around them::

    hvd.init()
    opt = hvd_quant.tensorflow.ZeroOneAdam(learning_rate=1e-3, var_freeze_step=1000)
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hvd_quant.tensorflow.callbacks.BroadcastGlobalVariablesCallback(0)])

All trainable variables form one flat float32 group, in the order Keras passes them.
There are no param groups here (a Keras optimizer has one list of variables, and a call
on a subset counts the others' gradients as zeros), so two things the torch optimizers
do across groups do not arise: a skipped step is this one group's verdict, which is the
whole step's (the torch optimizers combine their groups' verdicts, see
:func:`hvd_quant.optimizers.base.step_groups`), and DeepSpeed's ``non_freeze`` param
groups (1-bit Adam) cannot be expressed (use the torch ``OnebitAdam`` for them).
Variables without a gradient count as zeros (DeepSpeed skips them; see
:mod:`hvd_quant.optimizers.base` for why we do not). Sparse gradients
(``tf.IndexedSlices``: a Keras ``Embedding``'s always is) are made dense
(``sparse_as_dense=True``, the default): the rules work on the whole flat group, so the
table's rows that a batch does not touch get a zero gradient (their moments decay and,
once compressed, a 1-bit round gives them plus or minus the scale: see
``exp_avg_mask``), at the cost of a float32 buffer the size of the table per step.
``sparse_as_dense=False`` raises on a sparse gradient. Variables that are not float32
are updated through a float32 master copy. Every piece of state (moments, error buffers,
counters, the sum of learning rates, the random stream's position, master weights) is a
Keras optimizer variable, so ``model.save`` and ``ModelCheckpoint`` keep it; it is this
rank's own: save one checkpoint per rank. 0/1 Adam's sum of learning rates (Γ) is a
float64 variable, as DeepSpeed's Python float; the learning rate itself is Keras' float32.

``exp_avg_mask`` (DeepSpeed's, on :class:`OnebitAdam` and :class:`ZeroOneAdam`): a dict
from a variable's path (``variable.path``, e.g. ``"sequential/embedding/embeddings"``)
to a mask of that variable's shape, or a list of ``(variable, mask)`` pairs; the 1-bit
results are multiplied by it (variables not named: ones), as DeepSpeed multiplies by a
param group's mask. 1-bit compression cannot represent exact zeros, so elements whose
momentum should stay zero (embedding rows that never occur) accumulate compression error
unless masked with 0. The mask is not optimizer state: it is never saved (nor in
``get_config``), and a restored optimizer uses the mask it was constructed with, as
DeepSpeed's ``load_state_dict`` keeps the training script's mask over the checkpoint's.

0/1 Adam's ranks hold different parameters between syncs (local steps):
:meth:`ZeroOneAdam.final_sync`, or ``hvd_quant.tensorflow.callbacks.FinalSyncCallback`` in
``fit``, ends training with one model.

The schedule runs on counters held in variables, with ``tf.cond``: every rank takes the
same branch, so collectives inside a branch are issued in the same order everywhere.
What each step did is in ``bytes_sent``, ``comm_rounds``, ``kind_counts`` (per kind of
step), ``last_step_kind`` and ``skipped_steps`` (variables; read them with ``float()``
or ``int()``), and :class:`StepKindRecorder` keeps the per-step list during ``fit``.
"""

import sys
import time

import keras
import numpy as np
import tensorflow as tf
from keras.optimizers import LossScaleOptimizer

from ..core.guard import checked_guard
from ..core.metrics import DEFAULT_PROBE_EVERY, DEFAULT_REPORT_AFTER, OwnerMetrics, PaysReport, check_probe_every
from ..core.runner import check_agreement, digest63
from ..optimizers import KINDS, BinSGDMRule, OnebitAdamRule, ZeroOneAdamRule
from ..optimizers.base import GroupState, StepContext, adam_hyperparameters, initial_state
from ..optimizers.binsgdm import DEFAULT_BETA, single_beta
from ..optimizers.compressed_rounds import DEFAULT_VARIANCE_FLOOR, DIVERGENCE_HINT, short_warm_up_warning
from . import kernels
from .backend import TFBackend
from .compression import variable_name
from .monitoring import guard_config
from .tape import flatten_gradients
from .xla_step import refuse_xla


class _VariableGroupState(GroupState):
    """A GroupState whose slots, counters and meters are Keras optimizer variables."""

    def __init__(self, B, opt):
        self.B, self.opt = B, opt

    def slot(self, name):
        return tf.convert_to_tensor(self.opt._hq_slots[name].value)

    def set_slot(self, name, value):
        self.opt._hq_slots[name].value.assign(value)

    def scalar(self, name):
        return tf.convert_to_tensor(self.opt._hq_scalars[name].value)

    def set_scalar(self, name, value):
        var = self.opt._hq_scalars[name].value
        var.assign(tf.cast(tf.reshape(value, []), var.dtype))

    def commit(self, ok, slots=None, scalars=None):
        def store():
            for name, value in (slots or {}).items():
                self.set_slot(name, value)
            for name, value in (scalars or {}).items():
                self.set_scalar(name, value)

        def skip():
            self.opt._hq_meters["skipped"].value.assign_add(1)
            self.opt._hq_meters["last_finite"].value.assign(0)

        if ok is True:  # nothing to decide (error buffers updated by a guarded collective)
            store()
        else:
            self.B.cond(ok, store, skip)

    def advance(self, scalars):
        # One group: nothing waits for another group's verdict (GroupState.deferred).
        for name, value in scalars.items():
            self.set_scalar(name, value)

    def count(self, kind, nbytes):
        meters = self.opt._hq_meters
        meters["bytes_sent"].value.assign_add(float(nbytes))
        meters["comm_rounds"].value.assign_add(0 if kind == "local" else 1)
        meters[f"steps_{kind}"].value.assign_add(1)
        meters["last_kind"].value.assign(KINDS.index(kind))


class RuleOptimizer(keras.optimizers.Optimizer):
    """Base of the Keras optimizers below: runs a rule on all trainable variables.

    Mixed precision: under the ``mixed_float16`` policy Keras' ``compile`` wraps an
    optimizer in a ``LossScaleOptimizer``, which tests each rank's *local* gradients and
    could skip the step (and its collectives) on some ranks only. Pass
    ``hvd_quant.tensorflow.DistributedOptimizer(opt)`` instead: it does the dynamic loss
    scaling from this optimizer's own all-rank verdict. A plain ``LossScaleOptimizer``
    around this one is refused on every rank while tracing, before any collective.

    Metrics (``metrics=True``, off by default; ``probe_every``, ``guard``): what the
    rounds do, as the torch optimizers measure it (``opt.metrics()``,
    ``hvd_quant.tensorflow.callbacks.MetricsCallback``, docs/guide/monitoring.md). The
    figures are measured in Python around each collective, and a ``tf.function`` runs
    Python only when it traces, so with metrics on the step's rule runs as one
    ``tf.py_function`` when the graph runs: the eager code, with the same bits (the
    reason it is asked for, as on ``hvd_quant.tensorflow.DistributedOptimizer``). The
    guard (:mod:`hvd_quant.core.guard`) reads the probes of the 1-bit rounds and the
    rounds' finiteness; its state is saved with :meth:`guard_state_dict`. With metrics on,
    rank 0 logs whether the 1-bit rounds pay against fp32 on this link, ``report_after``
    steps after the warm-up (``freeze_step``, ``var_freeze_step``; none for BinSGDM), as the
    torch optimizers do.
    """

    # hvd_quant.tensorflow.DistributedOptimizer: do not reduce the gradients again.
    _hvd_quant_communicates = True

    def __init__(self, rule, learning_rate, hp, name, process_set=None, exp_avg_mask=None,
                 sparse_as_dense=True, metrics=False, probe_every=DEFAULT_PROBE_EVERY, guard=False,
                 report_after=DEFAULT_REPORT_AFTER, **kwargs):
        measured = _rule_metrics(rule, metrics, probe_every, guard)  # bad arguments refused first
        # "Does it pay here?" after the warm-up (rule.steady_after) and report_after steps
        # more, when metrics are on: the rounds against an fp32 allreduce, timed then.
        report = PaysReport(report_after, INSTEAD, start=rule.steady_after)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self._hq_report, self._report_after = report, report_after
        self._hq_metrics = measured
        self._metrics_on, self._probe_every, self._guard_option = metrics, probe_every, guard
        self._hq_sparse_as_dense = bool(sparse_as_dense)
        self._hq_rule = rule
        self._hq_mask_spec = _mask_spec(exp_avg_mask)
        self._hq_mask = None  # the flat mask, made at build time
        self._hq_hp = dict(hp)
        self._hq_process_set = process_set
        self._hq_comm = None
        self._hq_recheck = False  # set by elastic_reset: run _check_ranks again

    # --- state ------------------------------------------------------------------------
    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        # Keras may build inside a traced function: set initial values and run the
        # one-off agreement check eagerly, or they would become ops of every step.
        with tf.init_scope():
            self._build_state(var_list)

    def _build_state(self, var_list):
        kernels.prepare_kernels()  # loaded at set-up, under this host's thread policy
        comm = self._comm()
        self._hq_rule.validate(comm.size)
        counts = [int(np.prod(v.shape)) for v in var_list]
        numel = sum(counts)
        self._hq_rule.check_scale(comm, numel)
        slots, scalars = initial_state(self._hq_rule, counts, comm.size)
        self._hq_slots = {name: self.add_variable((value.size,), "zeros", "float32", name=f"hvd_quant_{name}")
                          for name, value in slots.items()}
        if any(v.dtype != "float32" for v in var_list):
            master = self.add_variable((numel,), "zeros", "float32", name="hvd_quant_master")
            master.assign(_flat_values(var_list))
            self._hq_slots["master"] = master
        # Sums (0/1 Adam's Γ) in float64, as DeepSpeed's Python floats.
        self._hq_scalars = {name: self.add_variable((), "zeros", "int64" if isinstance(value, int) else "float64",
                                                    name=f"hvd_quant_{name}")
                            for name, value in scalars.items()}
        for name, value in scalars.items():
            self._hq_scalars[name].assign(value)
        meters = {"bytes_sent": "float32", "comm_rounds": "int64", "skipped": "int64", "last_kind": "int64",
                  "last_finite": "int64"}
        meters.update({f"steps_{k}": "int64" for k in KINDS})
        self._hq_meters = {name: self.add_variable((), "zeros", dtype, name=f"hvd_quant_{name}")
                           for name, dtype in meters.items()}
        # A constant, not a variable: checkpoints never carry it (see the module docstring).
        self._hq_mask = _flat_mask(self._hq_mask_spec, var_list)
        self._check_ranks(var_list)

    def _comm(self):
        if self._hq_comm is None:
            import horovod.tensorflow as hvd

            from .comm import HorovodTFComm
            self._hq_comm = HorovodTFComm(self._hq_process_set or hvd.global_process_set)
        return self._hq_comm

    def _check_ranks(self, var_list):
        """At build time (eagerly): every rank must use the same method, options,
        hyper-parameters and variable structure. Values are broadcast later (by
        BroadcastGlobalVariablesCallback), so they are not compared here."""
        lr = self._learning_rate
        lr_repr = (repr(keras.saving.serialize_keras_object(lr)) if isinstance(
            lr, keras.optimizers.schedules.LearningRateSchedule) else repr(float(np.asarray(lr))))
        fingerprint = digest63(repr(self._hq_rule), repr(sorted(self._hq_hp.items())), lr_repr)
        structure = digest63(*(f"{variable_name(v)}:{tuple(v.shape)}:{v.dtype}" for v in var_list))
        gathered = self._comm().allgather(tf.constant([fingerprint, structure], tf.int64),
                                          "hvd_quant.optimizer.check")
        check_agreement(np.asarray(gathered).reshape(self._comm().size, 2),
                            ["the optimizer, its options or its hyper-parameters (learning rates included)",
                             "the model's variable names/shapes/dtypes"],
                            [f"This rank uses {self._hq_rule!r} with {self._hq_hp}, learning rate "
                             f"{lr_repr}; construct the optimizer the same way on every rank.",
                             "Build the same model on every rank."])

    @property
    def per_rank_variables(self):
        """Variables whose values differ between ranks by design (error buffers, moments
        of local gradients): ``BroadcastGlobalVariablesCallback`` leaves them alone."""
        if not self.built:
            return []
        return [self._hq_slots[name] for name in self._hq_rule.per_rank_slots if name in self._hq_slots]

    # --- Horovod Elastic (see hvd_quant.tensorflow.elastic) ----------------------------
    def _world_slots(self):
        """Names of the slots whose size or meaning depends on the world (the padded
        error buffers of the compressed allreduce: worker and server error)."""
        return sorted(set(self._hq_rule.extra_slots(1, 1)) & set(self._hq_rule.per_rank_slots))

    def elastic_local_variables(self):
        """Variables that an elastic sync leaves alone on every rank: the world-dependent
        error buffers. Everything else (moments, accumulators, counters, master weights,
        meters) is made identical from the root, as the model is, so that every rank
        follows the same schedule."""
        if not self.built:
            return []
        return [self._hq_slots[name] for name in self._world_slots() if name in self._hq_slots]

    def elastic_reset(self):
        """Adapt to the world after Horovod was initialised again (an elastic reset).

        Re-reads rank and size, re-validates the method for the new size (``ValueError``
        if, e.g., BinSGDM's ``ranks_per_node`` no longer divides it; an automatic
        ``ranks_per_node`` is recomputed), restarts from zero the error buffers whose size
        or chunk depends on the world when this rank's ``(rank, size)`` changed (resizing
        the Keras variables), and makes the agreement check run again (:meth:`elastic_check`).
        No collective: only the surviving ranks reset."""
        comm = self._comm()
        old = (comm.rank, comm.size)
        comm.refresh()
        new = (comm.rank, comm.size)
        if getattr(self, "_hq_auto_ranks_per_node", False):
            self._hq_rule = BinSGDMRule(ranks_per_node=comm.ranks_per_node(), seed=self._hq_rule.seed)
        self._hq_rule.validate(new[1])
        if not self.built:
            return
        sizes = self._hq_rule.extra_slots([int(np.prod(v.shape)) for v in self._trainable_variables], new[1])
        for name in self._world_slots():
            var = self._hq_slots.get(name)
            if var is not None and (old != new or int(np.prod(var.shape)) != sizes[name]):
                resize_keras_variable(var, (sizes[name],))
        self._hq_recheck = True

    def elastic_check(self):
        """Run the agreement check again if a reset asked for it (a collective: every
        rank calls this at the same point; the elastic sync does, ranks that joined build
        the optimizer there, which checks). Otherwise the next ``apply`` does."""
        if self.built and self._hq_recheck:
            with tf.init_scope():
                self._check_ranks(list(self._trainable_variables))
        self._hq_recheck = False

    @property
    def step_was_finite(self):
        """Variable: 1 when the last step was applied, 0 when every rank skipped it
        because some rank's gradient was not finite (the count of skipped steps is
        ``skipped_steps``)."""
        return self._hq_meters["last_finite"]

    # --- the step ---------------------------------------------------------------------
    def apply(self, grads, trainable_variables=None):
        refuse_xla()  # the step's collectives cannot be XLA-compiled (JitCompileCallback)
        _refuse_plain_loss_scaling(self)
        if self._hq_recheck:  # after an elastic reset whose sync was skipped
            self.elastic_check()
        return super().apply(grads, trainable_variables)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        variables = list(self._trainable_variables)
        given = {self._var_key(v): g for g, v in zip(grads, trainable_variables)}
        # No gradient this step: zeros; sparse ones dense (sparse_as_dense). Into a kept
        # buffer where the kernels run (hvd_quant.tensorflow.kernels.flatten).
        g = flatten_gradients([given.get(self._var_key(v)) for v in variables], variables,
                              self._hq_sparse_as_dense, type(self).__name__)
        B = TFBackend()
        self._hq_meters["last_finite"].assign(1)  # a skipped commit sets 0
        master = self._hq_slots.get("master")
        x = tf.convert_to_tensor(master.value) if master is not None else _flat_values(variables)
        counts = [int(np.prod(v.shape)) for v in variables]

        def rule_step(g, x, lr, metrics=None):
            ctx = StepContext(B, self._comm(), _VariableGroupState(B, self), g, x, lr, self._hq_hp, "opt.g0",
                              counts=counts, mask=self._hq_mask, metrics=metrics)
            return self._hq_rule.step(ctx)

        lr = tf.cast(learning_rate, tf.float32)

        def step_ended():  # every rank, after the step: the "does it pay" line once
            self._hq_report.step_ended(self._hq_metrics, self._hq_rule.name, B, self._comm(),
                                       fp32_buckets=lambda: [sum(counts)])

        if self._hq_metrics is None:
            new_x = rule_step(g, x, lr)
        else:
            new_x = _measured_step(rule_step, self._hq_metrics, g, x, lr, step_ended)
        self._write_back(variables, new_x)

    def _write_back(self, variables, new_x):
        master = self._hq_slots.get("master")
        if master is not None:
            master.assign(new_x)
        offset = 0
        for v in variables:
            n = int(np.prod(v.shape))
            v.assign(tf.cast(tf.reshape(new_x[offset:offset + n], v.shape), v.dtype))
            offset += n

    # --- what it did ------------------------------------------------------------------
    @property
    def bytes_sent(self):
        return self._meter("bytes_sent")

    @property
    def comm_rounds(self):
        return self._meter("comm_rounds")

    @property
    def skipped_steps(self):
        return self._meter("skipped")

    @property
    def kind_counts(self):
        return {k: int(self._meter(f"steps_{k}")) for k in KINDS}

    @property
    def last_step_kind(self):
        return KINDS[int(self._meter("last_kind"))]

    def _meter(self, name):
        if not self.built:
            return 0
        return self._hq_meters[name].numpy()

    def metrics(self):
        """What the rounds did, as the torch optimizers' ``metrics()`` gives it (a dict of
        plain numbers, ``None`` where not measured yet; ``{}`` without ``metrics=True``).
        Each kind of round is a bucket: ``opt.g0.grad`` (fp32), ``opt.g0.momentum``
        (1-bit Adam's), 0/1 Adam's compressed rounds, BinSGDM's ``opt.g0.signs``."""
        return self._hq_metrics.snapshot() if self._hq_metrics is not None else {}

    def guard_state_dict(self):
        """The guard's state (plain numbers) for a checkpoint; ``{}`` without a guard."""
        guard = self._hq_metrics.guard if self._hq_metrics is not None else None
        return guard.state_dict() if guard is not None else {}

    def load_guard_state_dict(self, state):
        """Restore :meth:`guard_state_dict`'s output."""
        guard = self._hq_metrics.guard if self._hq_metrics is not None else None
        if guard is None:
            raise ValueError("load_guard_state_dict: this optimizer has no guard (pass metrics=True, guard=True)")
        if state:
            guard.load_state_dict(state)

    def get_config(self):
        config = super().get_config()
        config.update(self._hq_rule.options())
        config.update(self._hq_hp)
        config["sparse_as_dense"] = self._hq_sparse_as_dense
        config.update(metrics=self._metrics_on, probe_every=self._probe_every,
                      guard=guard_config(self._guard_option), report_after=self._report_after)
        return config


#: The "does it pay" line's advice when the 1-bit rounds do not pay (PaysReport).
INSTEAD = ("Use the Keras optimizer with hvd_quant.tensorflow.DistributedOptimizer here "
           "(compression=hq.Compression.none for fp32), or hq.Compression.auto(), which measures the link "
           "and chooses per bucket.")

#: The guard's advice when the rounds' averages stay non-finite (hvd_quant.core.guard).
NONFINITE_HINT = (
    "With hvd_quant.tensorflow.DistributedOptimizer's loss scaling the scale was halved at each of these "
    "steps and no step came out finite. Without it, the first such step already made the variables or the "
    "moments inf or NaN. " + DIVERGENCE_HINT)


def _rule_metrics(rule, metrics, probe_every, guard):
    """The :class:`~hvd_quant.core.metrics.OwnerMetrics` that ``metrics=True`` asks for
    (``None`` when off), its arguments checked at construction (``ValueError``)."""
    check_probe_every(probe_every)
    guard = checked_guard(metrics, guard, rule, probe_every, NONFINITE_HINT, DIVERGENCE_HINT)
    return OwnerMetrics(probe_every, ranges=tf.profiler.experimental.Trace, guard=guard) if metrics else None


def _measured_step(rule_step, metrics, g, x, lr, step_ended):
    """``rule_step(g, x, lr, metrics)`` measured: eagerly at once, in a graph as one
    ``tf.py_function`` run when the graph runs (its rounds then run eagerly, with the
    same bits), then the step recorded (:meth:`OwnerMetrics.rule_step_ended`) and
    ``step_ended()`` called."""
    def run(g, x, lr):
        started, before = time.perf_counter(), metrics.reduction_seconds()
        new_x = rule_step(g, x, lr, metrics)
        metrics.rule_step_ended(started, before)
        step_ended()
        return new_x

    if tf.executing_eagerly():
        return run(g, x, lr)
    new_x = tf.py_function(run, [g, x, lr], tf.float32, name="hvd_quant_rule_step")
    new_x.set_shape(x.shape)
    return new_x


def _warn_short_warm_up(cls_name, rule, betas):
    """Warn at construction when DeepSpeed's rule (``bias_correction=False``) will freeze a
    variance far from warm (:func:`~hvd_quant.optimizers.compressed_rounds.short_warm_up_warning`),
    as ``hvd_quant.torch`` does."""
    import warnings

    message = short_warm_up_warning(rule, tuple(betas))
    if message is not None:
        warnings.warn(f"hvd_quant.tensorflow.{cls_name}: {message}", UserWarning, stacklevel=3)


@keras.saving.register_keras_serializable(package="hvd_quant")
class OnebitAdam(RuleOptimizer):
    """1-bit Adam (DeepSpeed's ``OnebitAdam``) as a Keras 3 optimizer; see
    :mod:`hvd_quant.optimizers.onebit_adam` and ``hvd_quant.torch.OnebitAdam``.

    ``bias_correction=True`` (default): Adam's bias correction (Kingma & Ba, ICLR 2015)
    in the warm-up, and the corrected variance frozen. ``False``: DeepSpeed's code, which
    has none, so a variance frozen after ``k = freeze_step - 1`` updates makes every later
    step ``1 / sqrt(1 - beta2**k)`` times Adam's (3.6x at step 80, which diverged on a
    language model where Adam converged); it warns at construction when ``k < 2 / (1 -
    beta2)``. A configuration saved before this option existed loads with the default:
    until the freeze the state is the same under both, after it the frozen variance is
    used as it was saved.

    ``variance_floor=0.01``: the frozen variance of each element is at least that fraction
    of its tensor's mean (``0``: DeepSpeed's rule); see ``hvd_quant.torch.OnebitAdam``."""

    def __init__(self, learning_rate=1e-3, freeze_step=100000, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, process_set=None, name="onebit_adam", scales="tensor",
                 exp_avg_mask=None, sparse_as_dense=True, bias_correction=True,
                 variance_floor=DEFAULT_VARIANCE_FLOOR, **kwargs):
        rule = OnebitAdamRule(freeze_step=freeze_step, scales=scales, bias_correction=bias_correction,
                              variance_floor=variance_floor)
        _warn_short_warm_up("OnebitAdam", rule, betas)
        super().__init__(rule, learning_rate,
                         adam_hyperparameters(betas, eps, weight_decay), name, process_set,
                         exp_avg_mask, sparse_as_dense, **kwargs)


@keras.saving.register_keras_serializable(package="hvd_quant")
class ZeroOneAdam(RuleOptimizer):
    """0/1 Adam (DeepSpeed's ``ZeroOneAdam``) as a Keras 3 optimizer; see
    :mod:`hvd_quant.optimizers.zero_one_adam` and ``hvd_quant.torch.ZeroOneAdam``.

    ``bias_correction``: as in :class:`OnebitAdam`, for Phase A, whose variance is
    updated only on its full-precision rounds (40 of them by step 80 with DeepSpeed's
    ``var_update_scaler=16``: 5x Adam's steps afterwards without the correction).
    ``var_update_scaler`` defaults to 64, not DeepSpeed's 16, and ``variance_floor`` to
    0.01, not DeepSpeed's none: see the torch class."""

    def __init__(self, learning_rate=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 var_freeze_step=100000, var_update_scaler=64, local_step_scaler=32678,
                 local_step_clipper=16, exact_sync=False, process_set=None, name="zero_one_adam",
                 scales="tensor", exp_avg_mask=None, sparse_as_dense=True, bias_correction=True,
                 variance_floor=DEFAULT_VARIANCE_FLOOR, **kwargs):
        rule = ZeroOneAdamRule(var_freeze_step=var_freeze_step, var_update_scaler=var_update_scaler,
                               local_step_scaler=local_step_scaler, local_step_clipper=local_step_clipper,
                               exact_sync=exact_sync, scales=scales, bias_correction=bias_correction,
                               variance_floor=variance_floor)
        _warn_short_warm_up("ZeroOneAdam", rule, betas)
        super().__init__(rule, learning_rate, adam_hyperparameters(betas, eps, weight_decay), name,
                         process_set, exp_avg_mask, sparse_as_dense, **kwargs)

    def final_sync(self):
        """Synchronise what the local steps since the last sync left on each rank, so that
        training ends with one model (ours; DeepSpeed has none). Eager only; call it on
        every rank at the same point after the last step, or let
        ``hvd_quant.tensorflow.callbacks.FinalSyncCallback`` call it when ``fit`` ends.

        Runs :meth:`~hvd_quant.optimizers.zero_one_adam.ZeroOneAdamRule.final_sync` when
        there were local steps since the last sync, else does nothing (no collective).
        With ``exact_sync=True`` every rank then holds bit-identical weights. Counters
        and the schedule are untouched, so training may continue. ``bytes_sent`` and
        ``comm_rounds`` count it; ``kind_counts`` and ``last_step_kind`` do not.

        Returns
        -------
        bool
            True when it synced (the same on every rank).
        """
        if not tf.executing_eagerly():
            raise RuntimeError("ZeroOneAdam.final_sync runs eagerly: call it outside tf.function")
        if not self.built:
            return False
        B = TFBackend()
        st = _VariableGroupState(B, self)
        if not bool(self._hq_rule.sync_pending(B, st)):
            return False
        variables = list(self._trainable_variables)
        counts = [int(np.prod(v.shape)) for v in variables]
        master = self._hq_slots.get("master")
        x = tf.convert_to_tensor(master.value) if master is not None else _flat_values(variables)
        ctx = StepContext(B, self._comm(), st, None, x, tf.constant(0.0), self._hq_hp, "opt.g0",
                          counts=counts, mask=self._hq_mask)
        self._write_back(variables, self._hq_rule.final_sync(ctx))
        size = self._comm().size
        if size > 1:
            self._hq_meters["bytes_sent"].assign_add(self._hq_rule.wire_bytes("onebit", counts, size))
            self._hq_meters["comm_rounds"].assign_add(1)
        return True


@keras.saving.register_keras_serializable(package="hvd_quant")
class BinSGDM(RuleOptimizer):
    """BinSGDM / Birder as a Keras 3 optimizer (a reconstruction); see
    :mod:`hvd_quant.optimizers.binsgdm` and ``hvd_quant.torch.BinSGDM``. Its one beta is
    0.8 by default since 2026-12-06 (0.9 before: pass ``beta=0.9`` for it)."""

    def __init__(self, learning_rate=1e-3, betas=(DEFAULT_BETA,), beta=None, weight_decay=0.0,
                 ranks_per_node=None, seed=0, process_set=None, name="binsgdm", sparse_as_dense=True,
                 **kwargs):
        beta = single_beta(betas, beta)
        auto = ranks_per_node is None
        if auto:  # the layout of the ranks this optimizer reduces over, not of the world
            from .comm import HorovodTFComm
            ranks_per_node = HorovodTFComm(process_set).ranks_per_node()
        super().__init__(BinSGDMRule(ranks_per_node=ranks_per_node, seed=seed), learning_rate,
                         {"betas": (beta,), "eps": 0.0, "weight_decay": weight_decay}, name,
                         process_set, sparse_as_dense=sparse_as_dense, **kwargs)
        self._hq_auto_ranks_per_node = auto  # recomputed after an elastic reset


def _refuse_plain_loss_scaling(optimizer):
    """Raise when Keras' own ``LossScaleOptimizer`` is applying ``optimizer`` (it decides
    from local gradients whether to call it, so ranks could issue different collectives).
    Called while tracing, on every rank alike."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return
        outer = frame.f_locals.get("self")
        if (isinstance(outer, LossScaleOptimizer) and outer is not optimizer
                and not getattr(outer, "_hvd_quant_loss_scaling", False)):
            raise TypeError(
                f"hvd_quant: Keras' LossScaleOptimizer wraps {type(optimizer).__name__} (the "
                "mixed_float16 policy does this in compile), and it would skip steps on some ranks "
                "only, leaving the others waiting in a collective. Compile with "
                f"hvd_quant.tensorflow.DistributedOptimizer({type(optimizer).__name__}(...)): it does "
                "the loss scaling from the all-rank verdict.")
        frame = frame.f_back


class StepKindRecorder(keras.callbacks.Callback):
    """Appends the kind of every training step (``"init"``, ``"full"``, ``"onebit"``,
    ``"local"``) to ``self.kinds`` during ``fit``."""

    def __init__(self):
        super().__init__()
        self.kinds = []

    def on_train_batch_end(self, batch, logs=None):
        self.kinds.append(self.model.optimizer.last_step_kind)


def resize_keras_variable(var, shape):
    """Give the Keras 3 variable ``var`` the shape ``shape``, filled with zeros.

    Keras variables have fixed shapes (``assign`` refuses another), but the error
    buffers of the 1-bit methods change size with the world. This swaps the
    ``tf.Variable`` behind ``var`` for a new one and updates the shape Keras records:
    Keras internals (``_value``, ``_shape``, ``_ndim``; checked on Keras 3.15's
    TensorFlow backend). The Keras object stays the same, so the optimizer's variable
    list, ``model.save`` and checkpoints see it; graphs traced before hold the old
    ``tf.Variable`` and must be traced again (elastic resets do that). Returns ``var``."""
    shape = tuple(int(d) for d in shape)
    if tuple(var.shape) == shape:
        var.assign(tf.zeros(shape, var._dtype))
        return var
    old = var._value
    if not isinstance(old, tf.Variable) or not hasattr(var, "_shape"):
        raise RuntimeError("hvd_quant: cannot resize this Keras variable (Keras internals "
                           "changed); rebuild the optimizer for the new world")
    with tf.init_scope():
        new = tf.Variable(tf.zeros(shape, old.dtype), trainable=old.trainable,
                          name=old.name.split(":")[0], aggregation=old.aggregation)
    var._value = new
    var._shape = shape
    var._ndim = len(shape)
    return var


def _mask_spec(exp_avg_mask):
    """``exp_avg_mask`` as a list of ``(variable or path, float32 array)`` pairs."""
    if exp_avg_mask is None:
        return []
    items = exp_avg_mask.items() if isinstance(exp_avg_mask, dict) else exp_avg_mask
    return [(key, np.asarray(mask, np.float32)) for key, mask in items]


def _flat_mask(spec, var_list):
    """The flat float32 mask over ``var_list`` (ones where no mask is given), or None."""
    if not spec:
        return None
    parts, used = [], set()
    for v in var_list:
        part = np.ones(int(np.prod(v.shape)), np.float32)
        for i, (key, mask) in enumerate(spec):
            if key is v or (isinstance(key, str) and key == variable_name(v)):
                if mask.size != part.size:
                    raise ValueError(f"exp_avg_mask for {variable_name(v)} has {mask.size} elements, the "
                                     f"variable has {part.size} (shape {tuple(v.shape)})")
                part = mask.reshape(-1)
                used.add(i)
        parts.append(part)
    unused = [key if isinstance(key, str) else variable_name(key) for i, (key, _) in enumerate(spec)
              if i not in used]
    if unused:
        raise ValueError(f"exp_avg_mask names {unused}, which the optimizer does not update; its "
                         f"variables are {[variable_name(v) for v in var_list]}")
    with tf.init_scope():
        return tf.constant(np.concatenate(parts) if parts else np.zeros(0, np.float32))


def _flat_values(variables):
    if not variables:
        return tf.zeros([0])
    values = [tf.convert_to_tensor(v) for v in variables]
    fast = kernels.flatten(values, [tuple(v.shape) for v in variables])  # a kept buffer, one copy
    if fast is not None:
        return fast
    return tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in values], 0)
