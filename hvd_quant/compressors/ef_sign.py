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

Chunked (:meth:`EFSignCompressor.reduce_chunked`, the torch optimizer's
``pipeline_chunk_mb``): the scales of the whole buffer first, by an allgather of their
own, then the sign allgather cut into chunks, chunk ``k + 1`` packed and chunk ``k - 1``
decoded while chunk ``k`` travels. Bit-identical to the unchunked method: the
per-segment scales come from the whole buffer, chunk boundaries fall on multiples of 8
elements so the packed bytes are the same bytes, and encoding and decoding are
element-wise.
"""

import numpy as np

from ..core.compressor import Compressor
from ..core.costmodel import Collective, sign_feedback_memory_bytes
from ..core.packing import (packed_sign_bytes, sign_pack_residual, split_scales, unpack_scaled_sum,
                            unpack_sum_residual, with_scales)
from ..core.pipeline import pipelined, start_allgather
from ..core.segments import (chunk_segments, compensate_sums, compensate_sums_signs, segment_bounds,
                             segment_means)


class EFSignCompressor(Compressor):
    """Scaled sign (``mean|p|`` per tensor) with local error feedback, bit-packed."""

    name = "ef_sign"
    stateful = True
    error_feedback = True
    chunkable = True

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
        ctx.sent_scales(all_scales)
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

    def reduce_chunked(self, x, ctx, chunks):
        """:meth:`reduce` with the sign allgather cut into ``chunks`` (module docstring)."""
        B, comm = ctx.backend, ctx.comm
        d, n = B.numel(x), comm.size
        counts = [c for _, c in ctx.segments]
        residual = ctx.state.get("residual")

        # Phases 1-2 over the whole buffer: per-segment scales, then every rank's scales
        # by allgather (the finite verdict comes with them).
        scales = segment_means(B, compensate_sums(B, x, residual, counts), counts)
        all_scales = comm.allgather(scales, ctx.collective_name("scales"))
        ctx.sent_scales(all_scales)
        if not bool(B.to_numpy(B.all_finite(all_scales))):
            return B.full(d, float("nan"))  # every rank sees the same scales: residual kept

        # Phase 3, chunk by chunk: pack the signs and the residual, gather, decode.
        own = B.to_numpy(scales)
        rows = B.to_numpy(all_scales).reshape(n, len(counts)) / np.float32(n)  # as unchunked: scale / n
        in_place = B.kernel("sign_pack_residual", x, residual, scales) is not None
        decode = B.kernel("unpack_scaled_sum", B.zeros(0, "uint8"), scales)
        out = (ctx.out if ctx.out is not None else B.zeros(d)) if decode is not None else None
        pieces, new_residual = [], []

        def encode(k):
            a, b = chunks[k]
            idx, sub = chunk_segments(counts, a, b)
            r_slice = B.slice(residual, a, b)
            bits, res = sign_pack_residual(B, B.slice(x, a, b), r_slice,
                                           B.constant(own[idx], "float32"), sub, out=r_slice)
            if not in_place:
                new_residual.append(res)
            return start_allgather(comm, bits, ctx.collective_name(f"signs.c{k}")), idx, sub

        def finish(k, pending):
            handle, idx, sub = pending
            a, b = chunks[k]
            all_bits = handle.wait()
            chunk_scales = B.constant(np.ascontiguousarray(rows[:, idx]).reshape(-1), "float32")
            if decode is not None:
                decode(all_bits, chunk_scales, segment_bounds(sub), b - a, out=B.slice(out, a, b))
            else:
                pieces.append(unpack_scaled_sum(B, all_bits, chunk_scales, sub, b - a))

        pipelined(len(chunks), encode, finish)
        ctx.state.set("residual", residual if in_place else B.concat(new_residual))
        return out if out is not None else B.concat(pieces)

    def wire_bytes(self, numel, world_size, segments=1):
        return float((world_size - 1) * (packed_sign_bytes(numel) + 4 * segments))

    def collectives(self, numel, world_size, ranks_per_node=None, segments=1, rank=0):
        return [Collective("allgather", packed_sign_bytes(numel) + 4.0 * segments, world_size)]

    def memory_bytes(self, numel, world_size, ranks_per_node=None, segments=1):
        return sign_feedback_memory_bytes(numel, world_size)

