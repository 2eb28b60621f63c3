"""What 1-bit Adam and 0/1 Adam share: their compressed rounds go through the two-stage
1-bit allreduce (:mod:`hvd_quant.core.compressed_allreduce`) with error buffers kept per rank.

DeepSpeed's ``OnebitAdam.step`` and ``ZeroOneAdam.step`` (``runtime/fp16/onebit/adam.py``
and ``zoadam.py``) both call their communication backend's ``compressed_allreduce``
with a worker error and a server error per tensor. Here those buffers, and the server's
scales (its state is kept compensated, :func:`~hvd_quant.core.compressed_allreduce.
compressed_allreduce_compensated`), are the group's extra slots, and one call serves every
tensor of a group. BinSGDM sends different bits (a randomized sign, no error feedback)
over another collective (:mod:`hvd_quant.core.hierarchical`), so it is not one of these.

Both also share Adam's bias correction (Kingma & Ba, "Adam: A Method for Stochastic
Optimization", ICLR 2015, Algorithm 1), which DeepSpeed's code leaves out: with
``bias_correction=True`` (the default, DeepSpeed's own argument, which its ``step()``
never reads) the full-precision stage updates with ``m / (1 - beta1**t)`` and ``v / (1 -
beta2**k)`` (``t`` and ``k`` the numbers of momentum and variance updates so far), and
the freeze stores those corrected moments, so that the frozen variance is an estimate of
the gradient's second moment instead of ``1 - beta2**k`` of it. Without the correction a
variance frozen after ``k`` updates makes every later step ``1 / sqrt(1 - beta2**k)`` times
Adam's (3.6x after 80 updates at ``beta2 = 0.999``), which diverged on a 5.8M-parameter
language model where Adam converged (docs/guide/optimizers.md). After the freeze nothing
changes: the momentum, corrected once, stays an average with weights summing to one
(``beta1 m + (1 - beta1) g`` of an unbiased ``m`` is unbiased), and the variance is
frozen. ``bias_correction=False`` is DeepSpeed's code, bit for bit.

Checkpoints need no new state: before the freeze the stored moments are the raw
averages under either setting, and ``t`` and ``k`` follow from the counters every
version saved (:meth:`OnebitRoundsRule.variance_updates`); after it the stored variance is
the frozen one, corrected or not as it was frozen, and is used as it is.
"""

import math

from ..core.compressed_allreduce import compressed_allreduce_bytes, compressed_allreduce_compensated, padded_size
from ..core.costmodel import even_sizes, onebit_collectives
from ..core.segments import compensate_sums, expand_segments, segment_means
from .base import Rule, compressed_counts, full_precision_bytes, full_precision_mean, tensor_sizes
from .elementwise import adam_descend


#: The warmth (``1 - beta2**k``) below which a variance frozen without bias correction
#: gets a warning: ``k < 2 / (1 - beta2)`` updates, 86% warm, later steps 1.08x Adam's.
WARM_ENOUGH = 1.0 - math.exp(-2.0)


#: The default ``variance_floor`` of 1-bit Adam and 0/1 Adam (:func:`floored_variance`),
#: chosen on the time-to-quality model (docs/guide/optimizers.md, "Large embeddings").
DEFAULT_VARIANCE_FLOOR = 0.01


def variance_floor_option(value):
    """``variance_floor`` checked: a finite float >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"variance_floor must be a finite number >= 0, got {value!r}")
    return float(value)


def floored_variance(B, exp_avg_sq, counts, ratio):
    """``max(v, ratio * mean(v))`` element-wise, the mean taken over each tensor of the
    group (``counts``): ``v`` itself when ``ratio`` is 0.

    Why: a variance held fixed while it is used (1-bit Adam's after its freeze, 0/1
    Adam's between its full-precision rounds and after its freeze) is 0 for every element
    that had no gradient while it was last updated: an embedding row of a word not yet
    seen. When that word turns up, Adam's own step is at most ``(1 - beta1) / sqrt(1 -
    beta2)`` (about 3.2) times ``lr``, because ``v`` takes the new gradient in the same
    step; with the fixed ``v`` the step is ``m / eps``, 1e7 times the gradient, and the
    model diverges (issue 51: 1-bit Adam with one rank, so no compression at all,
    diverged 20 steps after its freeze on a 16,384-word embedding). The floor bounds such
    a step by the tensor's typical second moment and leaves every element whose variance
    is at least ``ratio`` times its tensor's mean unchanged. A NaN stays NaN (the step is
    skipped anyway)."""
    if ratio == 0:
        return exp_avg_sq
    means = segment_means(B, compensate_sums(B, exp_avg_sq, None, counts), counts)
    floor = expand_segments(B, means * ratio, counts)
    return B.where(B.less(exp_avg_sq, floor), floor, exp_avg_sq)


def inverse_bias(B, beta, count):
    """``1 / (1 - beta**count)``, Adam's bias correction of an average of ``count``
    updates: a Python float for a Python count (eagerly), else a float32 scalar tensor
    (a TensorFlow counter), computed in float64 and rounded once."""
    if isinstance(count, (int, float)):
        return 1.0 / (1.0 - beta ** count)
    return B.cast(1.0 / (1.0 - beta ** B.cast(count, "float64")), "float32")


#: What the 1-bit optimizers' guard advises when training diverges (its exploding-scale
#: and non-finite warnings, hvd_quant.core.guard): the divergence of DeepSpeed's rule.
DIVERGENCE_HINT = (
    "With OnebitAdam or ZeroOneAdam and bias_correction=False (DeepSpeed's rule), a freeze_step "
    "(var_freeze_step) short against 1/(1 - beta2) freezes a variance that is barely warmed, so every later "
    "update is several times Adam's: on a 7.4M-parameter language model with freeze_step=40 this diverged to "
    "NaN 31 steps after the freeze. Keep bias_correction=True, freeze later (at least 2/(1 - beta2) variance "
    "updates), or warm the learning rate up over the first steps.")


class OnebitRoundsRule(Rule):
    """A :class:`~hvd_quant.optimizers.base.Rule` whose compressed rounds use the
    two-stage 1-bit allreduce.

    Subclasses set ``self.scales`` (``"tensor"``: one scale and one pair of error buffers
    per tensor, DeepSpeed's ``step()``; ``"group"``: one per group, as under its fp16
    optimizer) and name :attr:`error_slots` among their ``per_rank_slots``. Their step
    kinds are ``"full"`` (an fp32 average of the gradient), ``"onebit"`` and ``"init"``
    (one compressed allreduce) and ``"local"`` (no communication).
    """

    #: The compressed rounds carry what they threw away into the next (worker and server
    #: errors): the guard's default error bound is the error-feedback one (hvd_quant.core.guard).
    error_feedback = True
    #: Adam's bias correction before the freeze (module docstring); set by subclasses.
    bias_correction = True
    #: How the variance gets more updates before the freeze, for the warning.
    warm_up_advice = ""
    #: The held variance's floor, as a fraction of its tensor's mean (:func:`floored_variance`); set by subclasses.
    variance_floor = 0.0

    #: The allreduce's state: worker error, server state and server scales (per rank).
    error_slots = ("worker_error", "server_error", "server_scale")
    # A server error saved before the server scales existed is the compensated state
    # with zero scales: such a checkpoint continues exactly.
    zero_if_missing = ("server_scale",)

    def extra_slots(self, counts, world_size):
        tensors = compressed_counts(self.scales, counts)
        total = padded_size(tensors, world_size)
        return {"worker_error": total, "server_error": total // world_size,
                "server_scale": len(tensors)}

    def wire_bytes(self, kind, numel, world_size):
        if kind == "full":
            return full_precision_bytes(sum(tensor_sizes(numel)), world_size)
        if kind in ("onebit", "init"):
            return compressed_allreduce_bytes(compressed_counts(self.scales, numel), world_size)
        return 0.0

    def compressed_mean(self, ctx, value, phase, into=None):
        """The average over ranks of ``value`` (a flat float32 tensor of the group's size)
        at 1 bit per element, with the group's error buffers: ``(mean, finite)``.

        ``phase`` names the collectives (identical on every rank); the mean is decoded
        into ``into`` where the allreduce can (``value``'s own memory is allowed). On a
        step that is not finite on some rank the error buffers are left as they were and
        ``finite`` is False on every rank."""
        held = {}

        def reduce(comm):
            out, *held["state"] = compressed_allreduce_compensated(
                ctx.B, comm, value, ctx.writable_slot("worker_error"),
                ctx.writable_slot("server_error"), ctx.writable_slot("server_scale"),
                ctx.collective_name(phase), compressed_counts(self.scales, ctx.counts), out=into)
            return out

        # The worker error after the round is what the probe reports as the residual.
        out = ctx.measured(phase, value, reduce, residual=lambda: held["state"][0])
        if "state" not in held:  # the guard averaged this round in fp32: the buffers wait as they were
            return out, ctx.B.all_finite(out)
        worker, server, server_scale, finite = held["state"]
        # Kept whatever the verdict: a non-finite step returned the buffers unchanged.
        ctx.state.commit(True, {"worker_error": worker, "server_error": server,
                                "server_scale": server_scale})
        return out, finite

    def full_precision_round(self, ctx):
        """The fp32 average of the gradient over ranks (bit-identical on every rank),
        recorded as a ``"full"`` step: 1-bit Adam's warm-up, 0/1 Adam's variance rounds."""
        # Measured, never probed: the round is exact.
        grad = ctx.measured("grad", ctx.g, lambda comm: full_precision_mean(ctx.B, comm, ctx.g, ctx.collective_name("grad")),
                            probe=False)
        ctx.state.count("full", self.wire_bytes("full", ctx.counts, ctx.comm.size))
        return grad

    def count_onebit_round(self, ctx):
        """Record this step as a 1-bit round, or, with one rank, as a local step (nothing
        is sent)."""
        if ctx.comm.size > 1:
            ctx.state.count("onebit", self.wire_bytes("onebit", ctx.counts, ctx.comm.size))
        else:
            ctx.state.count("local", 0.0)

    def variance_updates(self, B, state):
        """How many times the variance was updated before this step (a Python int
        eagerly, else a tensor): what its bias correction divides by ``1 - beta2**k``
        for. Derived from counters every version of the state saved, so that an older
        checkpoint needs nothing new."""
        raise NotImplementedError

    def frozen_variance_updates(self):
        """The number of variance updates before the freeze, ``k`` (assuming no skipped
        steps): the variance is then ``1 - beta2**k`` warm without bias correction."""
        raise NotImplementedError

    def held_variance(self, ctx, exp_avg_sq):
        """``exp_avg_sq`` as it is stored to be used unchanged for several steps: floored
        at ``variance_floor`` times its tensor's mean (:func:`floored_variance`)."""
        return floored_variance(ctx.B, exp_avg_sq, ctx.counts, self.variance_floor)

    def bias_corrected(self, ctx, exp_avg, exp_avg_sq, t, k):
        """``(m / (1 - beta1**t), v / (1 - beta2**k))``, Adam's bias-corrected moments
        (new tensors), or ``(m, v)`` as they are when ``bias_correction`` is off."""
        if not self.bias_correction:
            return exp_avg, exp_avg_sq
        beta1, beta2 = ctx.hp["betas"]
        return (exp_avg * inverse_bias(ctx.B, beta1, t), exp_avg_sq * inverse_bias(ctx.B, beta2, k))

    def adam_update(self, ctx, exp_avg, exp_avg_sq, ok):
        """DeepSpeed's parameter update of both optimizers, ``x - lr * (exp_avg /
        (sqrt(exp_avg_sq) + eps) + weight_decay * x)`` (the moments as given: bias
        corrected by the caller, :meth:`bias_corrected`, or not), written into
        the parameters themselves where the adapter allows and the step (verdict ``ok``)
        is kept."""
        into = ctx.into_x(ok)
        return adam_descend(ctx.B, ctx.x, exp_avg, exp_avg_sq, ctx.lr, ctx.hp["eps"], ctx.hp["weight_decay"],
                            into=into if into is not None else ctx.x_buffer())


def compressed_round_collectives(numel, world_size, ranks_per_node, segments, options):
    """What one 1-bit round of 1-bit Adam or 0/1 Adam issues (for the cost model): the
    compressed allreduce of the group with DeepSpeed's per-tensor scales
    (``scales="tensor"``), every tensor padded on its own (``options["tensor_sizes"]``,
    or ``segments`` even ones)."""
    sizes = options.get("tensor_sizes") or even_sizes(numel, segments)
    return onebit_collectives(sizes, world_size)


def short_warm_up_warning(rule, betas):
    """The warning for DeepSpeed's rule (``bias_correction=False``) with a variance that
    freezes cold, ``1 - beta2**k`` below :data:`WARM_ENOUGH`; None otherwise. The
    adapters issue it at construction."""
    if rule.bias_correction:
        return None
    beta2 = float(betas[1])
    k = rule.frozen_variance_updates()
    warmth = 1.0 - beta2 ** k
    if warmth >= WARM_ENOUGH:
        return None
    option = "freeze_step" if rule.name == "onebit_adam" else "var_freeze_step"
    factor = float("inf") if warmth <= 0.0 else 1.0 / math.sqrt(warmth)
    enough = math.ceil(2.0 / (1.0 - beta2)) if beta2 < 1.0 else 0
    return (f"bias_correction=False (DeepSpeed's rule) freezes the variance after {k} update(s): "
            f"it is then only {100.0 * warmth:.1f}% warm (1 - beta2**{k}, beta2={beta2}), so every "
            f"later step is {factor:.2f}x Adam's (1/sqrt(1 - beta2**k)). Frozen at step 80 of 400 "
            "(constant lr 1e-3, 2 ranks), 1-bit Adam went to NaN and 0/1 Adam diverged this way on "
            f"a 5.8M-parameter language model where Adam converged. Keep bias_correction=True (the "
            f"default), or set {option} so that the variance is updated "
            f"at least ~2/(1 - beta2) = {enough} times before it freezes{rule.warm_up_advice}.")
