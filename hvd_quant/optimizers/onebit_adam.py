"""1-bit Adam: Adam during a full-precision warm-up, then the momentum at 1 bit.

Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam: Communication
Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021 (arXiv
2102.02888). Semantics follow DeepSpeed's ``deepspeed/runtime/fp16/onebit/adam.py``
(``OnebitAdam.step``), read from its source; the code here is ours.

Per parameter group, ``step`` counting every call including the first::

    step 1 (DeepSpeed's initialisation step): one compressed allreduce of the (zero)
        momentum; nothing else changes, the gradient is not used
    warm-up, while frozen is False (the engine averages g in fp32 first):
        m = beta1 m + (1 - beta1) g_avg
        v = beta2 v + (1 - beta2) g_avg**2
    after it (v frozen, no fp32 allreduce):
        m = beta1 m + (1 - beta1) g_local
        m = compressed_allreduce(m; worker and server error)     (n > 1 only)
        m = m * exp_avg_mask                                      (if given)
    update = m / (sqrt(v) + eps) + weight_decay * x               (bias_correction=False)
    update = m_hat / (sqrt(v_hat) + eps) + weight_decay * x       (bias_correction=True)
        in the warm-up, m_hat = m / (1 - beta1**t), v_hat = v / (1 - beta2**t), with
        t = step - 1 the number of moment updates so far (step 1 updated none)
    x      = x - lr * update
    frozen = True once step >= freeze_step (checked at the end of the step); with
        bias_correction=True the moments are stored as m_hat and v_hat at that step, so
        the variance frozen is the corrected one, and the compression stage is the same
        code either way

``bias_correction=False`` is DeepSpeed's code exactly (it accepts the argument and never
reads it); ``True``, the default here, is Adam's correction (Kingma & Ba, ICLR 2015),
which DeepSpeed leaves out: without it the variance frozen after ``k = freeze_step - 1``
updates is only ``1 - beta2**k`` warm and every later step is ``1 / sqrt(1 - beta2**k)``
times Adam's (see :mod:`hvd_quant.optimizers.compressed_rounds`). A ``non_freeze`` group,
whose moments were also updated on the initialisation step, has ``t = step`` and is
corrected on every step, as Adam is.

A param group with DeepSpeed's ``non_freeze=True`` never freezes. DeepSpeed's ``step()``
gives it a branch of its own wherever the others are compressed (``adam_freeze_key``,
which is also set on DeepSpeed's initialisation step): ``dist.all_reduce(grad)``,
``grad.mul_(1 / dist.get_world_size())``, both moments updated as in the warm-up, no
``exp_avg_mask``. So on the initialisation step its moments take the averaged gradient
(the parameters do not move), and every later step is the warm-up's fp32 Adam. Here
(``ctx.hp["non_freeze"]``): an fp32 round every step (step kind ``full``), counters
identical to the other groups'; the group's error buffers are allocated and stay zero,
as in DeepSpeed. One difference: on its initialisation step DeepSpeed averages a
gradient that its engine has averaged already; here it is averaged once (equal bits in
``tests/test_onebit_optimizers.py`` for 1 to 5 ranks, rounding apart in general).

A step whose averaged gradient (warm-up) or compressed momentum is not finite on any rank,
in any param group, changes nothing in any group, on every rank (one verdict per
optimizer step, see :mod:`hvd_quant.optimizers.base`); so does a warm-up step whose
``g_avg**2`` overflows float32 (``|g| > ~1.8e19``: plain Adam would store an infinite
``v`` and never move those elements again).

So steps ``2 .. freeze_step`` are Adam on averaged gradients and every later step sends
1 bit per element (:mod:`hvd_quant.core.compressed_allreduce`).

Deliberate departures from DeepSpeed, and why:

* ``load_state_dict`` restores everything. DeepSpeed's (``OnebitAdam.load_state_dict``)
  drops both error buffers (they restart at zero; it saves rank 0's only) and keeps
  ``step``, ``exp_avg`` and ``exp_avg_sq``. In a new process its next ``step()`` is the
  initialisation step again (``initialize`` is not saved): the gradient is not used, the
  parameters do not move, the loaded momentum is replaced by its compressed average; and
  when the checkpoint was past ``freeze_step``, the step after that takes the warm-up
  branch once on each rank's own gradient (the engine's allreduce is off), updating the
  variance with it, before compression resumes. Here checkpoints are per rank and a
  restored run continues bit-identically, as if never stopped.
* The warm-up's fp32 average is our own ring allreduce (identical bits on every rank; at
  2 ranks the transport's allreduce, the same bits: :func:`~.base.full_precision_mean`)
  rather than the engine's allreduce.
"""

from ..core.costmodel import MethodCost, onebit_memory_bytes, register_cost
from .base import keep_if, scales_option
from .elementwise import ema
from .compressed_rounds import (DEFAULT_VARIANCE_FLOOR, OnebitRoundsRule, compressed_round_collectives,
                                variance_floor_option)


class OnebitAdamRule(OnebitRoundsRule):
    """DeepSpeed's ``OnebitAdam`` update for one flat parameter group.

    Parameters
    ----------
    freeze_step : int
        Step (counting the initialisation step) after which the variance is frozen and
        the momentum is compressed. DeepSpeed's default is 100000; its tutorials warm
        up for 15-25% of the total steps.
    scales : {"tensor", "group"}
        ``"tensor"`` (default): one RMS scale and one pair of error buffers per tensor,
        as DeepSpeed's ``step()`` compresses each parameter tensor on its own (all
        tensors still go in one set of collectives). ``"group"``: one per parameter
        group, as under DeepSpeed's fp16 optimizer, which flattens each group.
    bias_correction : bool
        ``True`` (default): Adam's bias correction in the warm-up, and the corrected
        variance frozen. ``False``: DeepSpeed's code, which has none (module docstring).
    variance_floor : float
        The frozen variance of each element is at least this fraction of its tensor's mean
        frozen variance (:func:`~hvd_quant.optimizers.compressed_rounds.floored_variance`):
        an element with no gradient in the warm-up (a word not yet seen) would otherwise
        step by ``m / eps`` when it gets one. ``0``: none, as DeepSpeed (which, with
        ``bias_correction=False``, is its code exactly).
    """

    name = "onebit_adam"
    warm_up_advice = ""  # freeze_step - 1 updates
    param_slots = ("exp_avg", "exp_avg_sq")
    per_rank_slots = OnebitRoundsRule.error_slots
    non_freeze_refusal = None  # DeepSpeed's OnebitAdam.step reads group['non_freeze']

    def __init__(self, freeze_step=100000, scales="tensor", bias_correction=True,
                 variance_floor=DEFAULT_VARIANCE_FLOOR):
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 0:
            raise ValueError(f"freeze_step must be an int >= 0, got {freeze_step!r}")
        super().__init__(freeze_step=freeze_step, scales=scales_option(scales),
                         bias_correction=bool(bias_correction),
                         variance_floor=variance_floor_option(variance_floor))
        self.freeze_step = freeze_step
        self.scales = scales
        self.bias_correction = bool(bias_correction)
        self.variance_floor = float(variance_floor)

    @property
    def steady_after(self):
        """The warm-up's fp32 rounds end at ``freeze_step``: 1-bit rounds from then on."""
        return self.freeze_step

    def variance_updates(self, B, state):
        """Warm-up steps so far, ``step - 1`` (the initialisation step updates nothing;
        skipped steps advance no counter): both moments are updated on each."""
        return state.scalar("step") - 1

    def frozen_variance_updates(self):
        """The warm-up's steps: the first is step 2, the last ``max(freeze_step, 2)``."""
        return max(self.freeze_step, 2) - 1

    def scalars(self):
        """The group's scalar state, declared here and nowhere else: ``step`` (calls of
        :meth:`step`, the initialisation step included), ``initialized`` (1 once the
        initialisation step ran) and ``frozen`` (1 from the end of the step at which
        ``step >= freeze_step``: the variance is frozen and the momentum compressed)."""
        return {"step": 0, "initialized": 0, "frozen": 0}

    def step(self, ctx):
        """One step of the group: the initialisation step, then the warm-up's steps until
        the variance freezes, then the compression stage's (module docstring); a
        ``non_freeze`` group stays in the warm-up. Each stage is a branch of ``B.cond``,
        so that TensorFlow traces them into one graph; the predicates are the same on
        every rank, so every rank issues the same collectives."""
        B, state = ctx.B, ctx.state
        step = state.scalar("step") + 1
        initialized = state.scalar("initialized") > 0
        if ctx.hp.get("non_freeze", False):  # a Python bool (checked by the adapter)
            return B.cond(initialized, lambda: self._warm_up(ctx, step),
                          lambda: self._non_freeze_initialisation(ctx, step))

        def training_step():
            return B.cond(state.scalar("frozen") > 0, lambda: self._compression_stage(ctx, step),
                          lambda: self._warm_up(ctx, step))

        return B.cond(initialized, training_step, lambda: self._initialisation(ctx, step))

    def _initialisation(self, ctx, step):
        """DeepSpeed's first step: the zero momentum goes through the compressed
        allreduce once (it stays zero, so do both error buffers); no update."""
        state, world_size = ctx.state, ctx.comm.size
        exp_avg = state.slot("exp_avg")
        if world_size > 1:
            exp_avg = self.compressed_mean(ctx, exp_avg, "momentum")[0]
        state.count("init", self.wire_bytes("init", ctx.counts, world_size))
        state.commit(True, {"exp_avg": self._masked(ctx, exp_avg)}, {"step": step, "initialized": 1})
        return ctx.x

    def _non_freeze_initialisation(self, ctx, step):
        """DeepSpeed's first step takes a ``non_freeze`` group through its fp32 branch:
        both moments absorb the averaged gradient; no update."""
        exp_avg, exp_avg_sq, ok = self._full_precision_moments(ctx)
        ctx.state.commit(ok, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, {"step": step, "initialized": 1})
        return ctx.x

    def _full_precision_moments(self, ctx):
        """Both moments from the fp32 average of the gradient: ``(exp_avg, exp_avg_sq,
        finite)``."""
        B, state = ctx.B, ctx.state
        beta1, beta2 = ctx.hp["betas"]
        grad = self.full_precision_round(ctx)
        exp_avg = ema(B, state.slot("exp_avg"), grad, beta1, out=ctx.buffer("m"))
        exp_avg_sq = ema(B, state.slot("exp_avg_sq"), grad, beta2, square=True, out=ctx.buffer("v"))
        # v is finite iff g is and g**2 did not overflow float32 (|g| > ~1.8e19, where
        # plain Adam stores an infinite v): either way the step is skipped. v is the same
        # on every rank (from the bit-identical average), so is the verdict.
        return exp_avg, exp_avg_sq, B.all_finite(exp_avg_sq)

    def _warm_up(self, ctx, step):
        """A warm-up step: Adam on the fp32-averaged gradient, both moments updated. Also
        every step of a ``non_freeze`` group: DeepSpeed's frozen branch gives it an fp32
        average and keeps its variance updating (no ``exp_avg_mask``). Returns the new
        parameters (``ctx.x`` if skipped)."""
        B = ctx.B
        exp_avg, exp_avg_sq, ok = self._full_precision_moments(ctx)
        # Compression starts after the step at which step >= freeze_step.
        freezing = step >= self.freeze_step
        ctx.state.commit(ok, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
                         {"step": step, "frozen": B.select(freezing, 1, 0)})
        # Moment updates so far, this one included: a non_freeze group's initialisation
        # step updated them too.
        non_freeze = ctx.hp.get("non_freeze", False)
        t = step if non_freeze else step - 1
        m_hat, v_hat = self.bias_corrected(ctx, exp_avg, exp_avg_sq, t, t)
        if not non_freeze and (self.bias_correction or self.variance_floor > 0):
            # The freeze keeps the corrected moments, the variance floored (module docstring).
            B.cond(B.logical_and(ok, freezing),
                   lambda: ctx.state.commit(True, {"exp_avg": m_hat,
                                                   "exp_avg_sq": self.held_variance(ctx, v_hat)}),
                   lambda: None)
        return keep_if(B, ok, self.adam_update(ctx, m_hat, v_hat, ok), ctx.x)

    def _compression_stage(self, ctx, step):
        """A step after the warm-up: the momentum of this rank's gradient goes through the
        compressed allreduce (with one rank, it stays local), then ``exp_avg_mask``, and
        Adam's step uses it with the frozen variance. Returns the new parameters
        (``ctx.x`` if skipped)."""
        B, state = ctx.B, ctx.state
        exp_avg = ema(B, state.slot("exp_avg"), ctx.g, ctx.hp["betas"][0], out=ctx.buffer("m"))
        if ctx.comm.size > 1:
            exp_avg, ok = self.compressed_mean(ctx, exp_avg, "momentum", into=exp_avg)  # the step's own
        else:
            ok = B.all_finite(exp_avg)
        self.count_onebit_round(ctx)
        exp_avg = self._masked(ctx, exp_avg)
        state.commit(ok, {"exp_avg": exp_avg}, {"step": step})
        return keep_if(B, ok, self.adam_update(ctx, exp_avg, state.slot("exp_avg_sq"), ok), ctx.x)

    @staticmethod
    def _masked(ctx, exp_avg):
        """``exp_avg * exp_avg_mask`` where the group has a mask, with any number of ranks,
        as DeepSpeed does."""
        return exp_avg * ctx.mask if ctx.mask is not None else exp_avg


# For the cost model: a 1-bit step's collectives, and its passes: Adam's update over the
# parameters, momentum and frozen variance (7 float32 passes) plus the compressed allreduce's.
register_cost("onebit_adam", MethodCost(
    compressed_round_collectives, lambda numel, n: 7.0 * 4.0 * float(numel) + onebit_memory_bytes(numel, n),
    one_buffer=True))
