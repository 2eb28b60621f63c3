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
        x -= lr * (m / (sqrt(v) + eps) + weight_decay * x)
        variance schedule: after a full round var_counter += 1; when it reaches
        var_update_scaler (kappa): var_counter = 0, var_interval *= 2. So the gaps
        between full rounds are 1 (kappa times), 2 (kappa times), 4, ...

    at the end of the first step with step > var_freeze_step: frozen, and both error
    buffers are zeroed once (they now compensate a different quantity).

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

No bias correction; weight decay enters the update as above (so it also enters u).

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
* Parameters without a gradient count as zeros (see :mod:`hvd_quant.optimizers.base`);
  DeepSpeed's ``step()`` skips such a tensor.

Γ (``lrs``) is a float64 sum, as DeepSpeed's Python float ``state['lrs'] +=
group['lr']``; the sync divides by it in float32, as torch does with a Python scalar
(DeepSpeed's ``comm_buffer / state['lrs']``). Keras keeps it in a float64 variable and
widens its float32 learning rates exactly before adding them.
"""

from .base import full_precision_mean, keep_if, scales_option, tensor_sizes
from .elementwise import (adam_descend, ema, precondition, zero_one_sync_input,
                          zero_one_sync_result)
from .onebit_rounds import OnebitRoundsRule


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
    """

    name = "zero_one_adam"
    param_slots = ("exp_avg", "exp_avg_sq", "momentum_accumulator")
    # Momentum and accumulator follow each rank's gradients between syncs.
    per_rank_slots = ("exp_avg", "momentum_accumulator") + OnebitRoundsRule.error_slots
    non_freeze_refusal = (
        "DeepSpeed's ZeroOneAdam.step (runtime/fp16/onebit/zoadam.py) never reads the flag "
        "(only OnebitAdam.step in onebit/adam.py does), so such a group would be frozen like any "
        "other; drop the flag, or use OnebitAdam")

    def __init__(self, var_freeze_step=100000, var_update_scaler=16, local_step_scaler=32678,
                 local_step_clipper=16, exact_sync=False, scales="tensor"):
        if isinstance(var_freeze_step, bool) or not isinstance(var_freeze_step, int) or var_freeze_step < 0:
            raise ValueError(f"var_freeze_step must be an int >= 0, got {var_freeze_step!r}")
        super().__init__(var_freeze_step=var_freeze_step,
                         var_update_scaler=_positive_int("var_update_scaler", var_update_scaler),
                         local_step_scaler=_positive_int("local_step_scaler", local_step_scaler),
                         local_step_clipper=_positive_int("local_step_clipper", local_step_clipper),
                         exact_sync=bool(exact_sync), scales=scales_option(scales))
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.exact_sync = bool(exact_sync)
        self.scales = scales

    def extra_slots(self, counts, world_size):
        slots = super().extra_slots(counts, world_size)
        if self.exact_sync:
            slots["synced_params"] = sum(tensor_sizes(counts))
        return slots

    def scalars(self):
        return {"step": 0, "initialized": 0, "frozen": 0,
                "var_interval": 1, "var_counter": 0,
                "local_step_interval": 1, "local_step_counter": 0, "lrs": 0.0}

    def step(self, ctx):
        B, st, comm = ctx.B, ctx.state, ctx.comm
        n = comm.size
        beta1, beta2 = ctx.hp["betas"]
        eps, wd = ctx.hp["eps"], ctx.hp["weight_decay"]
        step = st.scalar("step") + 1

        def compress(value, phase, into=None):
            return self._compress(ctx, value, phase, into)

        def initialisation():
            u = st.slot("momentum_accumulator")
            if n > 1:  # the zero accumulator through the compressed allreduce, once
                u = compress(u, "sync")[0]
            st.count("init", self.wire_bytes("init", ctx.counts, n))
            st.commit(True, {"momentum_accumulator": u}, {"step": step, "initialized": 1})
            return ctx.x

        # --- Phase A: full-precision rounds at exponentially sparser steps, 1-bit between.
        def phase_a():
            var_step = step % st.scalar("var_interval") == 0

            def full_round():
                g = full_precision_mean(B, comm, ctx.g, ctx.collective_name("grad"))
                st.count("full", self.wire_bytes("full", ctx.counts, n))
                v = ema(B, st.slot("exp_avg_sq"), g, beta2, square=True, out=ctx.buffer("v"))
                # Finite v: g finite and g**2 within float32 (as in 1-bit Adam's warm-up).
                return g, v, B.all_finite(v)

            def onebit_round():
                if n > 1:
                    g, ok = compress(ctx.g, "grad_onebit")
                    st.count("onebit", self.wire_bytes("onebit", ctx.counts, n))
                else:  # one rank: local Adam (DeepSpeed skips the momentum update here)
                    g, ok = ctx.g, B.all_finite(ctx.g)
                    st.count("local", 0.0)
                return g, st.slot("exp_avg_sq"), ok

            g, v, ok = B.cond(var_step, full_round, onebit_round)
            m = ema(B, st.slot("exp_avg"), g, beta1, out=ctx.buffer("m"))
            # DeepSpeed's step: x - lr * (m / (sqrt(v) + eps) + weight_decay * x)
            into = ctx.into_x(ok)
            x = adam_descend(B, ctx.x, m, v, ctx.lr, eps, wd,
                             into=into if into is not None else ctx.x_buffer())
            # Variance schedule: kappa full rounds per interval, then the interval doubles.
            count = B.select(var_step, st.scalar("var_counter") + 1, st.scalar("var_counter"))
            doubled = count == self.var_update_scaler
            scalars = {"step": step, "var_counter": B.select(doubled, 0, count),
                       "var_interval": B.select(doubled, st.scalar("var_interval") * 2,
                                                st.scalar("var_interval"))}
            st.commit(ok, {"exp_avg": m, "exp_avg_sq": v}, scalars)
            # At the end of the first step past var_freeze_step: freeze, and zero both
            # error buffers once (they will compensate a different quantity).
            B.cond(B.logical_and(ok, step > self.var_freeze_step), lambda: freeze(x), lambda: None)
            return keep_if(B, ok, x, ctx.x)

        def freeze(x):
            slots = {name: B.zeros(B.numel(st.slot(name)))
                     for name in ("worker_error", "server_error", "server_scale")}
            if self.exact_sync:  # Phase B starts from these (identical) parameters
                slots["synced_params"] = x
            st.commit(True, slots, {"frozen": 1})

        # --- Phase B: local steps; every local_step_interval steps, a 1-bit sync.
        def phase_b():
            lrs = _plus_lr(B, st.scalar("lrs"), ctx.lr)  # DeepSpeed: state['lrs'] += group['lr']

            def moment_and_step(in_place):
                """The same step as Phase A's; the accumulator collects it (u -= delta).
                ``in_place``: a local step that is kept writes m, x and u over the old
                ones (no 100 MB temporaries), where the adapter allows it."""
                into = ctx.into_x(in_place)  # None while the verdict is open (several groups)
                acc = st.slot("momentum_accumulator")
                if into is not None:
                    m = ema(B, st.slot("exp_avg"), ctx.g, beta1, in_place=True)
                    return (m, *adam_descend(B, ctx.x, m, st.slot("exp_avg_sq"), ctx.lr, eps, wd,
                                             acc=acc, into=into, acc_into=acc))
                m = ema(B, st.slot("exp_avg"), ctx.g, beta1, out=ctx.buffer("m"))
                return (m, *adam_descend(B, ctx.x, m, st.slot("exp_avg_sq"), ctx.lr, eps, wd, acc=acc,
                                         into=ctx.buffer("x"), acc_into=ctx.buffer("u")))
            # Local-step schedule: the interval doubles every local_step_scaler steps, up
            # to local_step_clipper. It advances on every rank, finite or not, so that all
            # ranks agree on which step syncs.
            count = st.scalar("local_step_counter") + 1
            doubled = count == self.local_step_scaler
            interval = st.scalar("local_step_interval")
            schedule = {"local_step_counter": B.select(doubled, 0, count),
                        "local_step_interval": B.select(
                            doubled, B.minimum(interval * 2, self.local_step_clipper), interval)}

            def local():
                st.count("local", 0.0)
                ok = B.all_finite(ctx.g)  # this rank's own: no collective on a local step
                m, x, u = moment_and_step(ok)
                # Gamma advances with the schedule on every rank: the sync divides the
                # ranks' average by it, so all ranks keep the same momentum afterwards (a
                # skipped local step counts as a zero update from that rank).
                st.advance(dict(schedule, step=step, lrs=lrs))
                st.commit(ok, {"exp_avg": m, "momentum_accumulator": u})
                return keep_if(B, ok, x, ctx.x)

            def sync():
                # The same step as a local one, but only what the sync needs of it: the
                # last sync's parameters x' - u' and w = u' * (sqrt(v) + eps), in one pass
                # (the new momentum, x' and u' are not kept: the sync replaces them).
                base, w = zero_one_sync_input(
                    B, ctx.x, st.slot("exp_avg"), ctx.g, st.slot("exp_avg_sq"),
                    st.slot("momentum_accumulator"), beta1, ctx.lr, eps, wd,
                    out=(ctx.buffer("x"), ctx.buffer("w")))
                if n > 1:
                    st.count("onebit", self.wire_bytes("onebit", ctx.counts, n))
                else:
                    st.count("local", 0.0)
                return self._sync(ctx, base, None, w, lrs, "sync", dict(schedule, step=step, lrs=0.0))

            return B.cond(step % interval == 0, sync, local)

        def train_step():
            return B.cond(st.scalar("frozen") > 0, phase_b, phase_a)

        return B.cond(st.scalar("initialized") > 0, train_step, initialisation)

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
        B, st = ctx.B, ctx.state

        def final():
            u = st.slot("momentum_accumulator")
            w = precondition(B, u, st.slot("exp_avg_sq"), ctx.hp["eps"], out=ctx.buffer("w"))
            return self._sync(ctx, ctx.x, u, w, st.scalar("lrs"), "final_sync", {"lrs": 0.0})
        return B.cond(self.sync_pending(B, st), final, lambda: ctx.x)

    def _sync(self, ctx, base, u, w, lrs, phase, scalars):
        """A sync (DeepSpeed's ``zoadam.py`` ``step()``, the branch under ``state['step'] %
        state['local_step_interval'] == 0``) of ``w = u * (sqrt(v) + eps)``, the
        preconditioned accumulator, which is this step's own temporary: through the
        compressed allreduce, then back to the parameters of the last sync, ``base - u``
        (``base`` alone when ``u`` is None), plus the average; the accumulator is reset;
        ``scalars`` are committed with it. Returns the synced parameters (``ctx.x`` on a
        non-finite step)."""
        B, st = ctx.B, ctx.state
        v, eps = st.slot("exp_avg_sq"), ctx.hp["eps"]
        if ctx.comm.size > 1:
            w, ok = self._compress(ctx, w, phase, into=w)
        else:
            ok = B.all_finite(w)
        # DeepSpeed's x - u undoes the local steps up to rounding, which differs per rank;
        # exact_sync keeps the last sync's parameters instead, so ranks agree bit for bit.
        # synced = base + w / (sqrt(v) + eps), new momentum -(w / lrs). A kept step writes
        # them straight into the parameters and the momentum where the adapter allows it
        # (its commit then copies nothing), else into kept buffers.
        if self.exact_sync:
            base, u = st.slot("synced_params"), None
        # (A final sync reads the parameters themselves: the result goes elsewhere.)
        synced_into = ctx.into_x(ok) if base is not ctx.x else None
        momentum_into = ctx.into_slot("exp_avg", ok)
        out = (ctx.buffer("synced") if synced_into is None else synced_into,
               ctx.buffer("momentum") if momentum_into is None else momentum_into)
        synced, momentum = zero_one_sync_result(B, base, u, w, v, eps, _divisor(B, lrs), out=out)
        extra = {"synced_params": synced} if self.exact_sync else {}
        st.commit(ok, {"exp_avg": momentum, "momentum_accumulator": ctx.zeros(), **extra}, scalars)
        return keep_if(B, ok, synced, ctx.x)
