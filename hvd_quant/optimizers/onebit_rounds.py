"""What 1-bit Adam and 0/1 Adam share: their compressed rounds go through the two-stage
1-bit allreduce (:mod:`hvd_quant.core.onebit`) with error buffers kept per rank.

DeepSpeed's ``OnebitAdam.step`` and ``ZeroOneAdam.step`` (``runtime/fp16/onebit/adam.py``
and ``zoadam.py``) both call their communication backend's ``compressed_allreduce``
with a worker error and a server error per tensor. Here those buffers, and the server's
scales (its state is kept compensated, :func:`~hvd_quant.core.onebit.
compressed_allreduce_compensated`), are the group's extra slots, and one call serves every
tensor of a group. BinSGDM sends different bits (a randomized sign, no error feedback)
over another collective (:mod:`hvd_quant.core.hierarchical`), so it is not one of these.
"""

from ..core.onebit import compressed_allreduce_bytes, compressed_allreduce_compensated, padded_size
from .base import Rule, compressed_counts, full_precision_bytes, full_precision_mean, tensor_sizes
from .elementwise import adam_descend


class OnebitRoundsRule(Rule):
    """A :class:`~hvd_quant.optimizers.base.Rule` whose compressed rounds use the
    two-stage 1-bit allreduce.

    Subclasses set ``self.scales`` (``"tensor"``: one scale and one pair of error buffers
    per tensor, DeepSpeed's ``step()``; ``"group"``: one per group, as under its fp16
    optimizer) and name :attr:`error_slots` among their ``per_rank_slots``. Their step
    kinds are ``"full"`` (an fp32 average of the gradient), ``"onebit"`` and ``"init"``
    (one compressed allreduce) and ``"local"`` (no communication).
    """

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
        out, worker, server, server_scale, finite = compressed_allreduce_compensated(
            ctx.B, ctx.comm, value, ctx.writable_slot("worker_error"),
            ctx.writable_slot("server_error"), ctx.writable_slot("server_scale"),
            ctx.collective_name(phase), compressed_counts(self.scales, ctx.counts), out=into)
        # Kept whatever the verdict: a non-finite step returned the buffers unchanged.
        ctx.state.commit(True, {"worker_error": worker, "server_error": server,
                                "server_scale": server_scale})
        return out, finite

    def full_precision_round(self, ctx):
        """The fp32 average of the gradient over ranks (bit-identical on every rank),
        recorded as a ``"full"`` step: 1-bit Adam's warm-up, 0/1 Adam's variance rounds."""
        grad = full_precision_mean(ctx.B, ctx.comm, ctx.g, ctx.collective_name("grad"))
        ctx.state.count("full", self.wire_bytes("full", ctx.counts, ctx.comm.size))
        return grad

    def count_onebit_round(self, ctx):
        """Record this step as a 1-bit round, or, with one rank, as a local step (nothing
        is sent)."""
        if ctx.comm.size > 1:
            ctx.state.count("onebit", self.wire_bytes("onebit", ctx.counts, ctx.comm.size))
        else:
            ctx.state.count("local", 0.0)

    def adam_update(self, ctx, exp_avg, exp_avg_sq, ok):
        """DeepSpeed's parameter update of both optimizers, ``x - lr * (exp_avg /
        (sqrt(exp_avg_sq) + eps) + weight_decay * x)`` (no bias correction), written into
        the parameters themselves where the adapter allows and the step (verdict ``ok``)
        is kept."""
        into = ctx.into_x(ok)
        return adam_descend(ctx.B, ctx.x, exp_avg, exp_avg_sq, ctx.lr, ctx.hp["eps"], ctx.hp["weight_decay"],
                            into=into if into is not None else ctx.x_buffer())
