"""0/1 Adam: variance freezing and 1-bit synchronisation of accumulated local updates.

Lu, Li, Zhang, De Sa, He, "Maximizing Communication Efficiency for Large-scale Training
via 0/1 Adam", ICLR 2023 (arXiv 2202.06009). Semantics follow DeepSpeed's
``deepspeed/runtime/fp16/onebit/zoadam.py`` (``ZeroOneAdam.step``), read from its source;
the code here is ours. Notation: ``m = exp_avg``, ``v = exp_avg_sq``,
``u = momentum_accumulator``, ``lrs`` (Γ) the sum of learning rates since the last sync.

Per parameter group, ``step`` counting every call including the first::

    step 1 (initialisation): the zero accumulator goes through the compressed allreduce
        once; nothing else changes and the gradient is not used.

    Phase A (not frozen; no local steps):
        if step % var_interval == 0:            (a full-precision round: fp32 average of g)
            v = beta2 v + (1 - beta2) g_avg**2;  m = beta1 m + (1 - beta1) g_avg
        else:                                   (a 1-bit round: the gradient is compressed)
            m = beta1 m + (1 - beta1) compressed_allreduce(g) [* exp_avg_mask]
        x -= lr * (m / (sqrt(v) + eps) + weight_decay * x)          (bias_correction=False)
        x -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * x)  (bias_correction=True)
            m_hat = m / (1 - beta1**t), t = step - 1 (every Phase-A step updates m);
            v_hat = v / (1 - beta2**k), k = the full rounds so far (only they update v)
        variance schedule: after a full round var_counter += 1; when it reaches
        var_update_scaler (kappa): var_counter = 0, var_interval *= 2. So the gaps
        between full rounds are 1 (kappa times), 2 (kappa times), 4, ...

    at the end of the first step with step > var_freeze_step: frozen, and both error
    buffers are zeroed once (they now compensate a different quantity); with
    bias_correction=True m and v are stored as m_hat and v_hat then, so the frozen
    variance is the corrected one and Phase B is the same code either way.

    Phase B (frozen v; no collective except at syncs):
        m = beta1 m + (1 - beta1) g_local;   lrs += lr
        delta = lr * (m / (sqrt(v) + eps) + weight_decay * x);  x -= delta;  u -= delta
        if step % local_step_interval == 0:     (a sync: 1-bit round of the accumulation)
            x -= u                               (back to x at the last sync)
            u  = compressed_allreduce(u * (sqrt(v) + eps)) [* exp_avg_mask]
            m  = -(u / lrs)                      (momentum re-estimated from the average)
            x += u / (sqrt(v) + eps)
            u = 0;  lrs = 0
        local-step schedule: local_step_counter += 1 every Phase-B step; when it reaches
        local_step_scaler: local_step_counter = 0 and
        local_step_interval = min(local_step_clipper, 2 * local_step_interval).

``bias_correction=False`` is DeepSpeed's code exactly (no bias correction: it accepts the
argument and never reads it). ``True``, the default here, is Adam's correction (Kingma &
Ba, ICLR 2015) in Phase A: without it a variance frozen after ``k`` full rounds is only
``1 - beta2**k`` warm, and every Phase-B step is ``1 / sqrt(1 - beta2**k)`` times Adam's
(see :mod:`hvd_quant.optimizers.compressed_rounds`). ``k`` is derived from the variance
schedule, ``var_update_scaler * log2(var_interval) + var_counter``, so checkpoints of
earlier versions need no new counter. Weight decay enters the update as above (so it
also enters u).

A round whose averaged values are not finite on any rank, in any param group (a full
round's ``v`` included: ``g_avg**2`` overflows float32 for ``|g| > ~1.8e19``), changes
nothing in any group on any rank; a local step whose gradient is not finite (in any
group) changes nothing on that rank, in every group, but the counters and ``lrs``, which
advance on every rank so that all ranks sync on the same step with the same Γ (see
:mod:`hvd_quant.optimizers.base`).

DeepSpeed's ``non_freeze`` param groups are refused (``ValueError``): ``ZeroOneAdam.step``
never reads the flag (only 1-bit Adam's does, ``onebit/adam.py``), so DeepSpeed freezes
such a group like any other.

Deliberate departures from DeepSpeed, and why:

* World size 1: DeepSpeed skips the momentum update on Phase-A 1-bit rounds when there
  is one rank (the update sits inside its ``size > 1`` branch). Here the momentum is
  updated with the local gradient, so one rank is plain local Adam with the same
  schedule, as a user would expect.
* ``load_state_dict`` restores everything; checkpoints are per rank, and a restored run
  continues bit-identically. DeepSpeed's ``ZeroOneAdam.load_state_dict`` drops
  ``worker_error``, ``server_error`` and ``momentum_accumulator`` (and re-arms the one-off
  zeroing of the error buffers, ``reinitial_error_buffer = False``); finding
  ``worker_error`` missing, its next ``step()`` re-runs its state initialisation:
  ``var_interval = 1``, ``var_counter = 0``, ``local_step_interval = 1``,
  ``local_step_counter = 0``, ``lrs = 0``, zero error buffers and accumulator; only
  ``step``, ``exp_avg`` and ``exp_avg_sq`` survive. So the variance schedule (Phase A) or
  the local-step schedule (Phase B) starts over, and the local updates since the last
  sync stay in the loaded parameters unaveraged (the next sync subtracts only the
  accumulator built after loading). In a new process DeepSpeed's first ``step()`` after
  loading is moreover its initialisation step again (gradient unused, parameters
  unmoved), and past ``var_freeze_step`` the step after it takes the Phase-A branch once
  (``freeze_key`` is reset; ``load_state_dict`` sets a ``var_freeze_key`` that ``step()``
  never reads) with the engine's allreduce off, so each rank updates the variance with
  its own gradient before freezing again.
* Phase A's fp32 average is our ring allreduce (identical bits on every rank) instead of
  the engine's allreduce.
* :meth:`ZeroOneAdamRule.final_sync` is ours (DeepSpeed has no such call): a sync of
  what the local steps since the last sync left behind, so that a run can end with one
  model. Under DeepSpeed's rule the ranks' parameters differ after every local step, and
  a run that stops between syncs keeps them different.
* ``exact_sync=True`` is an option of ours (see :class:`ZeroOneAdamRule`).
* A sync with Γ = 0 (every local step since the last sync had learning rate 0, e.g. a
  schedule that starts or ends at 0 after ``var_freeze_step``) keeps the momentum.
  DeepSpeed's ``-(u / lrs)`` is 0/0 there, or ±inf when the error feedback of earlier
  syncs is in ``u``: its momentum stops being finite, and every later step here would
  have been skipped as non-finite. Wherever DeepSpeed's momentum is finite the two agree.
  A Γ that is tiny against the learning rates before it (a warm-up's first steps, the
  tail of a decay to 0) still multiplies the error feedback of earlier syncs by their
  ratio in the re-estimated momentum, as in DeepSpeed.
* Parameters without a gradient count as zeros (see :mod:`hvd_quant.optimizers.base`);
  DeepSpeed's ``step()`` skips such a tensor.

Γ (``lrs``) is a float64 sum, as DeepSpeed's Python float ``state['lrs'] +=
group['lr']``; the sync divides by it in float32, as torch does with a Python scalar
(DeepSpeed's ``comm_buffer / state['lrs']``). Keras keeps it in a float64 variable and
widens its float32 learning rates exactly before adding them.
"""

from ..core.costmodel import MethodCost, onebit_memory_bytes, register_cost
from .base import keep_if, scales_option, tensor_sizes
from .elementwise import adam_descend, ema, precondition, zero_one_sync_input, zero_one_sync_result
from .compressed_rounds import (DEFAULT_VARIANCE_FLOOR, OnebitRoundsRule, compressed_round_collectives,
                                variance_floor_option)


def _plus_lr(B, total, lr):
    """Γ + lr in float64. Eagerly both are Python floats (DeepSpeed's ``state['lrs'] +=
    group['lr']``); Keras' learning rate is a float32 tensor, widened exactly to be added
    to its float64 Γ."""
    if isinstance(lr, (int, float)):
        return total + lr
    return total + B.cast(lr, "float64")


def _divisor(B, lrs):
    """Γ as the sync divides by it: a Python float as is (torch and numpy divide a float32
    tensor by it in float32), a float64 tensor cast to float32, which is the same value."""
    return lrs if isinstance(lrs, (int, float)) else B.cast(lrs, "float32")


def _log2(B, power_of_two):
    """log2 of a power of two: ``var_interval``, a Python int eagerly (exact), else an
    integer tensor, whose float32 exponent field is the answer (exact up to 2**127)."""
    if isinstance(power_of_two, int):
        return power_of_two.bit_length() - 1
    bits = B.bitcast(B.cast(power_of_two, "float32"), "int32")
    return B.cast(B.right_shift(bits, 23) - 127, "float64")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class ZeroOneAdamRule(OnebitRoundsRule):
    """DeepSpeed's ``ZeroOneAdam`` update for one flat parameter group.

    Parameters (DeepSpeed's names and defaults)
    ----------
    var_freeze_step : int
        The last step of variance updates (``max T_v``), usually the end of the learning
        rate warm-up (default 100000).
    var_update_scaler : int
        kappa: full-precision rounds per interval before the interval doubles (16).
    local_step_scaler : int
        Phase-B steps between doublings of the local-step interval (32678).
    local_step_clipper : int
        H: the largest local-step interval (16).
    exact_sync : bool
        Our option, off by default. DeepSpeed returns to the last sync's parameters as
        ``x - u``, which undoes the local steps only up to float rounding, and that
        rounding differs per rank: after a sync the ranks agree to a few ulps, not bit
        for bit. With ``exact_sync=True`` those parameters are kept (one more parameter
        sized buffer) and every sync leaves all ranks with identical parameters.
    scales : {"tensor", "group"}
        ``"tensor"`` (default): one RMS scale and one pair of error buffers per tensor,
        as DeepSpeed's ``step()`` compresses each parameter tensor on its own (all
        tensors still go in one set of collectives). ``"group"``: one per parameter
        group, as under DeepSpeed's fp16 optimizer, which flattens each group. In Phase
        A raw gradients are compressed, and with one scale per group the tensors with
        small gradients (LayerNorm, biases) are swamped by the group's scale.
    bias_correction : bool
        ``True`` (default): Adam's bias correction in Phase A, and the corrected
        variance frozen. ``False``: DeepSpeed's code, which has none (module docstring).
    variance_floor : float
        The variance as Phase A's 1-bit rounds use it (the last full round's) and as it is
        frozen is at least this fraction of its tensor's mean
        (:func:`~hvd_quant.optimizers.compressed_rounds.floored_variance`); full rounds use
        their own fresh variance, as Adam does, and the stored average is not changed
        until the freeze. An element with no gradient in the last full round (a word not
        yet seen) would otherwise step by ``m / eps`` when it gets one. ``0``: none, as DeepSpeed (which, with
        ``bias_correction=False``, is its code exactly).
    """

    name = "zero_one_adam"
    warm_up_advice = (" (only the full rounds update it: var_update_scaler of them before "
                      "each doubling of their interval)")
    param_slots = ("exp_avg", "exp_avg_sq", "momentum_accumulator")
    # Momentum and accumulator follow each rank's gradients between syncs.
    per_rank_slots = ("exp_avg", "momentum_accumulator") + OnebitRoundsRule.error_slots
    non_freeze_refusal = (
        "DeepSpeed's ZeroOneAdam.step (runtime/fp16/onebit/zoadam.py) never reads the flag "
        "(only OnebitAdam.step in onebit/adam.py does), so such a group would be frozen like any "
        "other; drop the flag, or use OnebitAdam")

    def __init__(self, var_freeze_step=100000, var_update_scaler=64, local_step_scaler=32678,
                 local_step_clipper=16, exact_sync=False, scales="tensor", bias_correction=True,
                 variance_floor=DEFAULT_VARIANCE_FLOOR):
        if isinstance(var_freeze_step, bool) or not isinstance(var_freeze_step, int) or var_freeze_step < 0:
            raise ValueError(f"var_freeze_step must be an int >= 0, got {var_freeze_step!r}")
        super().__init__(var_freeze_step=var_freeze_step,
                         var_update_scaler=_positive_int("var_update_scaler", var_update_scaler),
                         local_step_scaler=_positive_int("local_step_scaler", local_step_scaler),
                         local_step_clipper=_positive_int("local_step_clipper", local_step_clipper),
                         exact_sync=bool(exact_sync), scales=scales_option(scales),
                         bias_correction=bool(bias_correction),
                         variance_floor=variance_floor_option(variance_floor))
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.exact_sync = bool(exact_sync)
        self.scales = scales
        self.bias_correction = bool(bias_correction)
        self.variance_floor = float(variance_floor)

    def variance_updates(self, B, state):
        """Full rounds so far, from the variance schedule: ``var_counter`` restarts
        after ``var_update_scaler`` of them, each time ``var_interval`` doubles, so ``k =
        var_update_scaler * log2(var_interval) + var_counter`` (skipped rounds advance
        neither). Exact, and held by every version's checkpoints."""
        counter = state.scalar("var_counter")
        if not isinstance(counter, int):  # a TensorFlow counter: float64, as _log2's
            counter = B.cast(counter, "float64")
        return self.var_update_scaler * _log2(B, state.scalar("var_interval")) + counter

    @property
    def steady_after(self):
        """Past ``var_freeze_step`` the variance is frozen: local steps and 1-bit syncs
        from then on (the rounds before it, fp32 variance rounds among them, end)."""
        return self.var_freeze_step

    def frozen_variance_updates(self):
        """The full rounds of steps 2 .. ``var_freeze_step + 1`` (the freeze follows the
        first step past ``var_freeze_step``), counted on the schedule; the count stops
        early at ``2**20``, far past any warmth that matters."""
        interval, counter, k = 1, 0, 0
        for step in range(2, max(self.var_freeze_step + 1, 2) + 1):
            if step % interval == 0:
                k, counter = k + 1, counter + 1
                if counter == self.var_update_scaler:
                    counter, interval = 0, interval * 2
                if k >= 2 ** 20:
                    break
        return k

    def extra_slots(self, counts, world_size):
        slots = super().extra_slots(counts, world_size)
        if self.exact_sync:
            slots["synced_params"] = sum(tensor_sizes(counts))
        return slots

    def scalars(self):
        """The group's scalar state, declared here and nowhere else (DeepSpeed's ``state``
        keys where it has one):

        ``step``: calls of :meth:`step`, the initialisation step included.
        ``initialized``: 1 once the initialisation step ran.
        ``frozen``: 1 from the end of the first step past ``var_freeze_step``: the variance
        is frozen and the steps are Phase B's (DeepSpeed's ``freeze_key``).
        ``var_interval``: Phase A's gap between full-precision rounds (the steps of the
        paper's T_v are its multiples).
        ``var_counter``: full-precision rounds since ``var_interval`` last doubled.
        ``local_step_interval``: Phase B's gap between syncs (the steps of the paper's T_u
        are its multiples); at most ``local_step_clipper`` (H).
        ``local_step_counter``: Phase-B steps since ``local_step_interval`` last doubled.
        ``lrs``: Γ, the sum of the learning rates since the last sync (float64).
        """
        return {"step": 0, "initialized": 0, "frozen": 0,
                "var_interval": 1, "var_counter": 0,
                "local_step_interval": 1, "local_step_counter": 0, "lrs": 0.0}

    def step(self, ctx):
        """One step of the group: the initialisation step, then Phase A's steps until the
        variance freezes, then Phase B's (module docstring). Each phase is a branch of
        ``B.cond``, so that TensorFlow traces all three into one graph; the predicates
        are the same on every rank, so every rank issues the same collectives."""
        B, state = ctx.B, ctx.state
        step = state.scalar("step") + 1

        def training_step():
            return B.cond(state.scalar("frozen") > 0,
                          lambda: self._phase_b(ctx, step), lambda: self._phase_a(ctx, step))

        return B.cond(state.scalar("initialized") > 0, training_step,
                      lambda: self._initialisation(ctx, step))

    def _initialisation(self, ctx, step):
        """DeepSpeed's first step: the zero accumulator goes through the compressed
        allreduce once (it stays zero, so do the error buffers); the gradient is unused
        and the parameters do not move."""
        state, world_size = ctx.state, ctx.comm.size
        accumulator = state.slot("momentum_accumulator")
        if world_size > 1:
            accumulator = self._compress(ctx, accumulator, "sync")[0]
        state.count("init", self.wire_bytes("init", ctx.counts, world_size))
        state.commit(True, {"momentum_accumulator": accumulator}, {"step": step, "initialized": 1})
        return ctx.x

    # --- Phase A: full-precision rounds at exponentially sparser steps, 1-bit between.
    def _phase_a(self, ctx, step):
        """A step of Phase A: a full-precision round on the steps of T_v (``step %
        var_interval == 0``), a 1-bit round of the gradient otherwise; then Adam's step
        with the new momentum, the variance schedule, and the freeze after the first step
        past ``var_freeze_step``. Returns the new parameters (``ctx.x`` if skipped)."""
        B, state = ctx.B, ctx.state
        full_round = step % state.scalar("var_interval") == 0
        grad, exp_avg_sq, ok = B.cond(full_round, lambda: self._variance_round(ctx),
                                      lambda: self._gradient_onebit_round(ctx))
        exp_avg = ema(B, state.slot("exp_avg"), grad, ctx.hp["betas"][0], out=ctx.buffer("m"))
        m_hat, v_hat = exp_avg, exp_avg_sq
        if self.bias_correction:  # t = step - 1 momentum updates, k variance updates
            done = self.variance_updates(B, state)
            k = B.select(full_round, done + 1, done)
            m_hat, v_hat = self.bias_corrected(ctx, exp_avg, exp_avg_sq, step - 1, k)
        v_used = v_hat
        if self.variance_floor > 0:  # a 1-bit round uses the last full round's variance: floored
            v_used = B.cond(full_round, lambda: v_hat, lambda: self.held_variance(ctx, v_hat))
        x = self.adam_update(ctx, m_hat, v_used, ok)
        scalars = {"step": step, **self._variance_schedule(B, state, full_round)}
        state.commit(ok, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, scalars)
        B.cond(B.logical_and(ok, step > self.var_freeze_step),
               lambda: self._freeze(ctx, x, m_hat, v_hat), lambda: None)
        return keep_if(B, ok, x, ctx.x)

    def _variance_round(self, ctx):
        """Phase A's full-precision round: the fp32 average of the gradient, which also
        updates the variance. Returns ``(averaged gradient, new variance, finite)``."""
        grad = self.full_precision_round(ctx)
        exp_avg_sq = ema(ctx.B, ctx.state.slot("exp_avg_sq"), grad, ctx.hp["betas"][1], square=True,
                         out=ctx.buffer("v"))
        # Finite v: g finite and g**2 within float32 (as in 1-bit Adam's warm-up).
        return grad, exp_avg_sq, ctx.B.all_finite(exp_avg_sq)

    def _gradient_onebit_round(self, ctx):
        """Phase A's 1-bit round: the gradient through the compressed allreduce (and
        ``exp_avg_mask``); the variance stays. Returns ``(averaged gradient, variance,
        finite)``. With one rank, the local gradient: DeepSpeed skips the momentum update
        there, but plain local Adam with the same schedule is what a user expects."""
        if ctx.comm.size > 1:
            grad, ok = self._compress(ctx, ctx.g, "grad_onebit")
        else:
            grad, ok = ctx.g, ctx.B.all_finite(ctx.g)
        self.count_onebit_round(ctx)
        return grad, ctx.state.slot("exp_avg_sq"), ok

    def _variance_schedule(self, B, state, full_round):
        """The variance schedule after a Phase-A step: ``var_counter`` counts the full
        rounds; at ``var_update_scaler`` (kappa) of them it restarts and ``var_interval``
        doubles, so the gaps between full rounds are 1 (kappa times), 2 (kappa times), 4..."""
        counter = B.select(full_round, state.scalar("var_counter") + 1, state.scalar("var_counter"))
        doubled = counter == self.var_update_scaler
        return {"var_counter": B.select(doubled, 0, counter),
                "var_interval": B.select(doubled, state.scalar("var_interval") * 2,
                                         state.scalar("var_interval"))}

    def _freeze(self, ctx, x, exp_avg, exp_avg_sq):
        """The end of Phase A (at the end of the first step past ``var_freeze_step``): the
        variance freezes, and both error buffers are zeroed once, since from now on they
        compensate the accumulator's compression instead of the gradient's. With
        ``bias_correction`` the moments are stored corrected (``exp_avg``, ``exp_avg_sq``:
        this step's ``m_hat`` and ``v_hat``)."""
        B, state = ctx.B, ctx.state
        slots = {name: B.zeros(B.numel(state.slot(name)))
                 for name in ("worker_error", "server_error", "server_scale")}
        if self.bias_correction:
            slots.update(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        if self.variance_floor > 0:  # frozen for good: floored (variance_floor)
            slots["exp_avg_sq"] = self.held_variance(ctx, exp_avg_sq)
        if self.exact_sync:  # Phase B starts from these (identical) parameters
            slots["synced_params"] = x
        state.commit(True, slots, {"frozen": 1})

    # --- Phase B: local steps; every local_step_interval steps, a 1-bit sync.
    def _phase_b(self, ctx, step):
        """A step of Phase B: a sync on the steps of T_u (``step % local_step_interval ==
        0``), a local step otherwise. Γ and the local-step schedule advance on every rank
        whatever its gradient, so that all ranks sync on the same steps with the same Γ.
        Returns the new parameters (``ctx.x`` if skipped)."""
        B, state = ctx.B, ctx.state
        lrs = _plus_lr(B, state.scalar("lrs"), ctx.lr)  # DeepSpeed: state['lrs'] += group['lr']
        interval = state.scalar("local_step_interval")
        schedule = self._local_step_schedule(B, state, interval)
        return B.cond(step % interval == 0,
                      lambda: self._sync_step(ctx, step, lrs, schedule),
                      lambda: self._local_step(ctx, step, lrs, schedule))

    def _local_step_schedule(self, B, state, interval):
        """The local-step schedule after a Phase-B step: ``local_step_counter`` counts the
        steps; at ``local_step_scaler`` of them it restarts and the ``interval`` between
        syncs doubles, up to ``local_step_clipper`` (H)."""
        counter = state.scalar("local_step_counter") + 1
        doubled = counter == self.local_step_scaler
        return {"local_step_counter": B.select(doubled, 0, counter),
                "local_step_interval": B.select(
                    doubled, B.minimum(interval * 2, self.local_step_clipper), interval)}

    def _local_step(self, ctx, step, lrs, schedule):
        """Phase B between syncs: Adam's step on this rank's own gradient with the frozen
        variance, collected in the accumulator; no collective (so the verdict is this
        rank's own). Γ advances with the schedule on every rank: the sync divides the
        ranks' average by it, so all ranks keep the same momentum afterwards (a skipped
        local step counts as a zero update from that rank)."""
        B, state = ctx.B, ctx.state
        state.count("local", 0.0)
        ok = B.all_finite(ctx.g)
        exp_avg, x, accumulator = self._accumulated_adam_step(ctx, ok)
        state.advance(dict(schedule, step=step, lrs=lrs))
        state.commit(ok, {"exp_avg": exp_avg, "momentum_accumulator": accumulator})
        return keep_if(B, ok, x, ctx.x)

    def _accumulated_adam_step(self, ctx, in_place):
        """Phase A's Adam step on the local gradient, also collected in the accumulator
        (``u -= delta``): ``(momentum, parameters, accumulator)``. ``in_place``: a local
        step that is kept writes them over the old ones (no 100 MB temporaries), where
        the adapter allows it."""
        B, state = ctx.B, ctx.state
        beta1, eps, weight_decay = ctx.hp["betas"][0], ctx.hp["eps"], ctx.hp["weight_decay"]
        into = ctx.into_x(in_place)  # None while the verdict is open (several groups)
        accumulator = state.slot("momentum_accumulator")
        if into is not None:
            exp_avg = ema(B, state.slot("exp_avg"), ctx.g, beta1, in_place=True)
            return (exp_avg, *adam_descend(B, ctx.x, exp_avg, state.slot("exp_avg_sq"), ctx.lr, eps,
                                           weight_decay, acc=accumulator, into=into, acc_into=accumulator))
        exp_avg = ema(B, state.slot("exp_avg"), ctx.g, beta1, out=ctx.buffer("m"))
        return (exp_avg, *adam_descend(B, ctx.x, exp_avg, state.slot("exp_avg_sq"), ctx.lr, eps,
                                       weight_decay, acc=accumulator, into=ctx.buffer("x"),
                                       acc_into=ctx.buffer("u")))

    def _sync_step(self, ctx, step, lrs, schedule):
        """Phase B on the steps of T_u: the local step, then the 1-bit sync of the
        accumulated updates (:meth:`_sync`), which resets Γ."""
        state = ctx.state
        # The same step as a local one, but only what the sync needs of it: the last
        # sync's parameters x' - u' and u' * (sqrt(v) + eps), in one pass (the new
        # momentum, x' and u' are not kept: the sync replaces them).
        last_sync_params, preconditioned = zero_one_sync_input(
            ctx.B, ctx.x, state.slot("exp_avg"), ctx.g, state.slot("exp_avg_sq"),
            state.slot("momentum_accumulator"), ctx.hp["betas"][0], ctx.lr, ctx.hp["eps"],
            ctx.hp["weight_decay"], out=(ctx.buffer("x"), ctx.buffer("w")))
        self.count_onebit_round(ctx)
        return self._sync(ctx, last_sync_params, None, preconditioned, lrs, "sync",
                          dict(schedule, step=step, lrs=0.0))

    def _compress(self, ctx, value, phase, into=None):
        """DeepSpeed's ``compressed_allreduce`` of ``value`` with the group's error buffers
        (decoded into ``into`` where possible), then ``exp_avg_mask``: ``(average, finite)``."""
        out, finite = self.compressed_mean(ctx, value, phase, into)
        return (out * ctx.mask if ctx.mask is not None else out), finite

    def sync_pending(self, B, st):
        """Whether :meth:`final_sync` has work (a boolean scalar): Phase B, and Γ > 0,
        i.e. local steps since the last sync. Γ advances with the counters on every rank
        (skipped steps included), so every rank gives the same answer."""
        return B.logical_and(st.scalar("frozen") > 0, st.scalar("lrs") > 0)

    def final_sync(self, ctx):
        """Synchronise the local steps since the last sync now, e.g. when training ends.

        Ours: DeepSpeed's ``zoadam.py`` has no such call, and a run that stops between
        syncs leaves its ranks with different parameters. This is the sync branch of
        :meth:`step` (DeepSpeed's ``ZeroOneAdam.step``, the block under ``if
        state['step'] % state['local_step_interval'] == 0 and self.freeze_key``) on the
        current accumulator ``u`` and Γ, without a step: back to the last sync's
        parameters, ``w = u * (sqrt(v) + eps)`` through the compressed allreduce (error
        buffers and ``exp_avg_mask`` as in a sync), parameters ``x_sync + w / (sqrt(v) +
        eps)``, momentum ``-(w / Γ)``, then ``u = 0`` and Γ ``= 0``. No gradient is used
        and the step counters and schedule are left alone, so training may go on after it
        (the next sync then covers the steps after this one).

        Nothing happens (``ctx.x`` comes back, no collective) unless
        :meth:`sync_pending`: in Phase A, right after a sync, or when every local step
        since had a zero learning rate (those leave the parameters where the sync put
        them). With ``exact_sync=True`` every rank ends with identical parameters, bit
        for bit; otherwise up to DeepSpeed's rounding of ``x - u``. Every rank must call
        it at the same point (it is a collective when there is something to sync).

        Returns
        -------
        The new flat parameters (float32).
        """
        B, state = ctx.B, ctx.state

        def final():
            accumulator = state.slot("momentum_accumulator")
            preconditioned = precondition(B, accumulator, state.slot("exp_avg_sq"), ctx.hp["eps"],
                                          out=ctx.buffer("w"))
            return self._sync(ctx, ctx.x, accumulator, preconditioned, state.scalar("lrs"), "final_sync",
                              {"lrs": 0.0})
        return B.cond(self.sync_pending(B, state), final, lambda: ctx.x)

    def _sync(self, ctx, params, accumulator, preconditioned, lrs, phase, scalars):
        """A sync (DeepSpeed's ``zoadam.py`` ``step()``, the branch under ``state['step'] %
        state['local_step_interval'] == 0``) of ``preconditioned = u * (sqrt(v) + eps)``,
        the preconditioned accumulator, which is this step's own temporary: through the
        compressed allreduce, then back to the parameters of the last sync, ``params -
        accumulator`` (``params`` alone when ``accumulator`` is None), plus the average;
        the accumulator is reset; ``scalars`` are committed with it. Returns the synced
        parameters (``ctx.x`` on a non-finite step)."""
        B, state = ctx.B, ctx.state
        exp_avg_sq, eps = state.slot("exp_avg_sq"), ctx.hp["eps"]
        if ctx.comm.size > 1:
            preconditioned, ok = self._compress(ctx, preconditioned, phase, into=preconditioned)
        else:
            ok = B.all_finite(preconditioned)
        # DeepSpeed's x - u undoes the local steps up to rounding, which differs per rank;
        # exact_sync keeps the last sync's parameters instead, so ranks agree bit for bit.
        # synced = params + average / (sqrt(v) + eps), new momentum -(average / lrs). A
        # kept step writes them straight into the parameters and the momentum where the
        # adapter allows it (its commit then copies nothing), else into kept buffers.
        if self.exact_sync:
            params, accumulator = state.slot("synced_params"), None
        # Γ = 0 (every local step since the last sync had lr 0): -(average / Γ) would be
        # 0/0 or, with the error feedback of earlier syncs in the average, ±inf; the
        # momentum keeps its value then (a departure from DeepSpeed only where its momentum
        # is not finite). Dividing by 1 instead keeps the fused primitive free of NaN.
        estimated = lrs > 0
        # (A final sync reads the parameters themselves: the result goes elsewhere.)
        synced_into = ctx.into_x(ok) if params is not ctx.x else None
        momentum_into = ctx.into_slot("exp_avg", B.logical_and(ok, estimated))
        out = (ctx.buffer("synced") if synced_into is None else synced_into,
               ctx.buffer("momentum") if momentum_into is None else momentum_into)
        synced, momentum = zero_one_sync_result(B, params, accumulator, preconditioned, exp_avg_sq, eps,
                                                B.select(estimated, _divisor(B, lrs), 1.0), out=out)
        momentum = B.select(estimated, momentum, state.slot("exp_avg"))
        extra = {"synced_params": synced} if self.exact_sync else {}
        state.commit(ok, {"exp_avg": momentum, "momentum_accumulator": ctx.zeros(), **extra}, scalars)
        return keep_if(B, ok, synced, ctx.x)


# For the cost model: a sync step's collectives (the 1-bit round), and its passes: the
# accumulators, the sync's inputs and results and Adam's update (19 float32 passes), plus
# the compressed allreduce's.
register_cost("zero_one_adam", MethodCost(
    compressed_round_collectives, lambda numel, n: 19.0 * 4.0 * float(numel) + onebit_memory_bytes(numel, n),
    one_buffer=True))
