"""EF-SignSGD: scaled sign compression with error feedback.

Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes", ICML 2019 (arXiv 1901.09847), Algorithm 1 (EF-SIGNSGD).

Per rank and per parameter tensor (a *segment* of the buffer)::

    p     = g + e                     # compensate with the residual kept from last step
    scale = ||p||_1 / d               # mean |p| of the segment
    q     = scale * sign(p)           # what this rank contributes (sign(0) = +1)
    e     = p - q                     # residual, kept locally, keyed by parameter name

On the wire each rank sends its sign bits packed 8 per byte followed by one float32
scale per segment, in one allgather; every rank then decodes all ``n`` contributions and
averages them in rank order, so all ranks hold bit-identical results. Bytes sent per rank:
``(n-1) * (ceil(d/8) + 4*S)`` under the ring-allgather cost model, against
``2 (n-1)/n * 4d`` for an fp32 allreduce.

Phases: one pass over ``x`` and ``e`` gives the scale sums *and* the sign bits (a sign
does not depend on the scale); bits and scales are sent in one collective; then one
more pass decodes every contribution and writes the new residual (fused primitive
``unpack_sum_residual``). Two passes over the buffer, not three: a separate residual pass
while the bits were on the wire read ``x`` and ``e`` once more, and on a rank with one
core (several ranks per host) the CPU it used was the backward pass's, not idle time.

Non-finite input: a NaN or inf in ``p`` makes its segment's scale non-finite; the scales
arrive with the bits, before any residual is touched, so every rank sees it first. Such
a step returns NaN for the whole buffer on every rank and leaves every residual exactly
as it was (its bits are still sent, so that every rank issues the same collectives).
"""

from ..core.compressor import Compressor
from ..core.packing import packed_sign_bytes, split_scales, unpack_sum_residual, with_scales
from ..core.pipeline import start_allgather
from ..core.segments import compensate_sums_signs, segment_means


class EFSignCompressor(Compressor):
    """Scaled sign (``mean|p|`` per tensor) with local error feedback, bit-packed."""

    name = "ef_sign"
    stateful = True

    def reduce(self, x, ctx):
        B, comm = ctx.backend, ctx.comm
        d, n = B.numel(x), comm.size
        counts = [c for _, c in ctx.segments]
        residual = ctx.state.get("residual")

        # Phase 1: one scale per segment, mean |x + e| (float64 sums; non-finite if p is),
        # and the sign bits of p, in one pass.
        sums, bits = compensate_sums_signs(B, x, residual, counts)
        scales = segment_means(B, sums, counts)

        # Phase 2: one allgather carries every rank's bits with its scales after them
        # (as onebit's gathers do; two gathers of different dtypes ran one after the
        # other in Horovod, one more collective round per bucket). The scales say
        # whether every rank's step is finite before any residual changes.
        width = packed_sign_bytes(d)
        all_bits, all_scales = split_scales(
            B, start_allgather(comm, with_scales(B, B.reshape(bits, (1, width)), 1, scales),
                               ctx.collective_name("signs")).wait(), n, width, len(counts))
        finite = B.all_finite(all_scales)

        # Phase 3: decode every rank's contribution in rank order (into ctx.out where
        # given: it may be x) and, in the same pass, the new residual (kept only on a
        # finite step). Scales are divided by n before the sum, so values near the
        # float32 maximum do not overflow it.
        mean, residual = B.cond(
            finite,
            lambda: unpack_sum_residual(B, all_bits, B.divide(all_scales, float(n)), counts, d,
                                        x, residual, scales, out=ctx.out, resid_out=residual),
            lambda: (B.full(d, float("nan")), residual))
        ctx.state.set("residual", residual)
        return mean

    def wire_bytes(self, numel, world_size, segments=1):
        return float((world_size - 1) * (packed_sign_bytes(numel) + 4 * segments))

