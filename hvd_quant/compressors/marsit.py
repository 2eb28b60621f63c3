"""Marsit: 1-bit signs on a multi-hop (ring / 2D torus) allreduce, without cascading.

Wu, He, Guo, Qu, Wang, Zhuang, Zhang, "Sign Bit is Enough: A Learning Synchronization
Framework for Multi-hop All-reduce with Ultimate Compression", DAC 2022 (arXiv 2204.06787).

The problem: cascading compression
    On a ring or torus allreduce every hop reduces a received chunk with a local one and
    forwards the result. With plain signSGD the forwarded chunk must be 1 bit again, so
    each hop decompresses, adds and re-signs (:class:`CascadingSign`). The re-signing
    repeats at every hop, later ranks outweigh earlier ones exponentially, and the result
    is a biased estimate of the mean sign (4 ranks with signs ``+ + + -`` in ring order
    give 0 in expectation instead of 0.5). The paper calls this cascading compression.

Marsit's answer, as implemented here
    * Unbiased bitwise aggregation (:class:`MarsitSelect`): when a chunk standing for
      ``k`` ranks meets a chunk standing for ``m``, each bit is taken from the local chunk
      with probability ``m / (k + m)``, else from the received one. By induction each
      rank's bit survives with probability ``1 / n``, so the ±1 result is an unbiased
      estimate of the mean sign, and every hop stays at 1 bit per element with nothing
      decompressed.
    * Compensation (error feedback) at the *global* scale ``alpha``. Two readings are
      offered: ``"global"``, ``e = p - alpha * s_hat`` against the aggregated result, so
      the ranks' average residual is exactly the deviation of the aggregated update;
      and ``"local"`` (default), ``e = p - alpha * sign(p)``, whose average equals that
      deviation in expectation (the selection is unbiased) while each rank's residual
      stays bounded. See :class:`MarsitCompressor` for why and what was measured.

Per step, per rank::

    p     = x + e                         # e = residual ("residual" state), 0 at first
    bits  = pack_signs(p)                 # 1 bit per element (x >= 0 -> 1)
    s_hat = unpack(ring_allreduce(bits, MarsitSelect))   # identical on every rank; a torus
                                                         # along the hosts where they are known,
                                                         # one alltoall + one allgather from 5 ranks
    alpha = mean over ranks of mean|p| per parameter  (one small float32 allgather,
            summed in rank order so every rank gets the same bits)
            or a constant (no float on the wire)
    out   = alpha * s_hat                 # returned as the mean-gradient estimate
    e     = p - alpha * sign(p)           # compensation="local" (default)
          = p - out                       # compensation="global"

Caveat: the paper's Algorithm 1 was not available to us (only the abstract). The per-hop
selection rule, the compensation ``e = p - alpha * s_hat`` and the choices of ``alpha`` are
our reading of the paper, documented in the project notes (methods.md, sections 3.3-3.4);
the selection rule is provably unbiased and tested to be so. Momentum, periodic
full-precision synchronisation or layer-wise details of the original are not reproduced.

Wire: ``2 (n - 1) / n * ceil(d / 8)`` bytes per rank for the signs (the ring's cost, at
1 bit per element on every hop; the direct layout pads the bits to a multiple of ``n``
bytes), plus one float32 scale per parameter from every rank when ``scale="mean_abs"``
(``(n - 1) * 4`` bytes per parameter: an allgather, or inside the direct layout's
alltoall), or a 4-byte allreduce (the non-finite check) with a constant scale.
"""

import math

from ..core.comm import all_ranks_finite, rank_order_sum
from ..core.compressor import Compressor
from ..core.costmodel import Collective, HostLayout, ring_hops, sign_feedback_memory_bytes
from ..core.hops import HopOperator
from ..core.packing import (bytes_float, float_bytes, pack_signs, packed_sign_bytes, sign_pack_residual,
                            split_scales, unpack_scaled_sum, unpack_signs, unpack_sum_residual, with_scales)
from ..core.pipeline import start_allgather
from ..core.ring import (DIRECT_FROM, butterfly_allreduce, chunk_bounds, direct_allreduce, direct_padded_numel, gathers,
                         is_power_of_two, ring_allreduce, torus_allreduce, tree_fold)
from ..core.rng import dyadic_bits, select_bits
from ..core.segments import compensate_sums, compensate_sums_signs, segment_means


class MarsitSelect(HopOperator):
    """Unbiased per-hop aggregation of packed sign bits by random selection.

    ``out = (own & mask) | (received & ~mask)`` on packed bytes, where each bit of
    ``mask`` is 1 with probability ``own_count / (own_count + received_count)``. Only the
    mask is built; ``own`` and ``received`` are never unpacked. Padding bits of the last
    byte stay 0 on both sides, hence in the output.

    The mask is drawn in one of two ways, the same Bernoulli bits in distribution:

    * the probability in lowest terms is ``a / 2**L`` (hop ``s`` of a ring keeps its own
      bit with probability ``1 / (s + 2)``: ``1/2`` at the first hop, so at every hop of a
      2-rank ring and of a 2 x 2 torus, ``1/4`` at the third): exactly, from ``L`` random bit
      planes read as an ``L``-bit number ``j`` per element, the mask bit ``j < a``
      (:func:`~hvd_quant.core.rng.dyadic_bits`; ``32 / L`` elements per 32-bit draw);
    * otherwise, float32 uniforms compared with the threshold (a draw per element, the
      fused ``marsit_select`` kernel where there is one); the probability is off by at
      most one float32 step (~6e-8), far below any statistical effect.
    """

    name = "marsit"
    unit = 1  # one byte = 8 whole elements, so any byte boundary is a valid cut

    def combine(self, B, own, own_count, received, received_count, rng):
        divisor = math.gcd(own_count, received_count)
        a, total = own_count // divisor, (own_count + received_count) // divisor
        if total & (total - 1) == 0:
            mask = dyadic_bits(B, rng.next_key(B), a, total.bit_length() - 1, B.numel(own))
            return select_bits(B, own, received, mask)
        keep_own = own_count / float(own_count + received_count)
        fast = B.kernel("marsit_select", own, received)
        if fast is not None:
            return fast(own, received, keep_own, rng.next_key(B))
        draws = B.uniform(rng, 8 * B.numel(own))
        mask = B.packbits(B.cast(B.less(draws, B.full(1, keep_own)), "uint8"))
        return select_bits(B, own, received, mask)


class CascadingSign(HopOperator):
    """The baseline Marsit fixes: signSGD at every hop ("cascading compression").

    Decompress both chunks to ±1, add, and take the sign again, breaking ties (``+1`` vs
    ``-1``) at random with probability 1/2 each, so a single hop is unbiased for the
    sum's sign. Counts are ignored, as plain signSGD has nothing to weight with. Composed
    over a ring, the value after hop ``k`` has mean ``(mu_k + s) / 2``: the last ranks
    dominate and the result is biased for the mean sign. (Bitwise this equals
    :class:`MarsitSelect` with a fixed keep probability of 1/2; it is written the long
    way to show the decompress / re-compress it costs.)
    """

    name = "cascade"
    unit = 1

    def combine(self, B, own, own_count, received, received_count, rng):
        total = unpack_signs(B, own, 8 * B.numel(own)) + unpack_signs(B, received, 8 * B.numel(received))
        # total is -2, 0 or 2; adding +-0.5 at random decides only the ties.
        tie = B.cast(B.less(B.uniform(rng, 8 * B.numel(own)), B.full(1, 0.5)), "float32") - 0.5
        bits = B.cast(B.greater_equal(total + tie, B.zeros(1)), "uint8")
        return B.packbits(bits)


class _ShippedTies(HopOperator):
    """:class:`CascadingSign`'s rule with the tie-breaks drawn by the ranks that sent
    them: combine ``k`` of a fold takes the ``k``-th mask, ``(own & mask) | (received &
    ~mask)`` bitwise (where the two signs agree either gives the same bit; where they
    differ the mask's fair coin decides, as the re-signing's random half does)."""

    name = "cascade"
    unit = 1

    def __init__(self, masks):
        self.masks = iter(masks)

    def combine(self, B, own, own_count, received, received_count, rng):
        return select_bits(B, own, received, next(self.masks))


def cascade_tie_mask(B, rng, nbytes):
    """``nbytes`` of fair coin flips (each bit 1 with probability 1/2; one random plane),
    what a rank ships for :func:`fold_gathered_cascade`."""
    return dyadic_bits(B, rng.next_key(B), 1, 1, nbytes)


def fold_gathered_cascade(B, rows, masks):
    """Cascading signs over gathered rows, the same on every rank: the pairwise fold of
    the direct layout (:func:`~hvd_quant.core.ring.tree_fold`: ``(0, 1), (2, 3), ...``,
    then pairs of pairs) over every rank's whole row, combine ``k`` breaking its ties with
    rank ``k``'s shipped mask. Each rank's stream thus decides some ties, as it does on a
    ring, and no rank needs another's stream."""
    return tree_fold(B, rows, [1] * len(rows), _ShippedTies(masks), None)[0]


_HOPS = {"marsit": MarsitSelect, "cascade": CascadingSign}

#: The ``topology`` option's values.
TOPOLOGIES = ("auto", "ring", "torus", "butterfly", "direct", "gather")


def auto_layout(n, ranks_per_node=None):
    """The layout ``topology="auto"`` runs on ``n`` ranks, ``ranks_per_node`` per host
    (``None``: unknown or one): as :meth:`MarsitCompressor.layout` returns it.

    Up to 4 ranks, a torus with one row per host where the hosts are known, else a ring
    (2, 4 or 6 hops: what these sizes ran before 2026-11-28, bit for bit). From
    :data:`~hvd_quant.core.ring.DIRECT_FROM` ranks on, ``"direct"``: under Horovod every hop is a collective of
    its own, negotiated by every rank's background thread, and at 16 ranks on the emulated
    cluster a ring's 30 hops took 2.5-4.2 s a step against 0.26-0.42 s for the direct
    layout's two collectives, with the same bytes (docs/benchmarks/scaling.md)."""
    k = ranks_per_node
    if n >= DIRECT_FROM:
        return "direct"
    if k and 1 < k < n and n % k == 0:
        return n // k  # one row per host: the row rings stay on the host
    return None


class MarsitCompressor(Compressor):
    """Marsit: sign bits aggregated hop by hop on a ring or torus, with global compensation.

    Parameters
    ----------
    compensation : "local" (default), "global", True or False
        ``"global"`` (also ``True``): keep the residual ``e = p - alpha * s_hat``, the
        deviation from the aggregated result every rank shares (our first reading of
        the paper's global compensation). ``"local"``: ``e = p - alpha * sign(p)``, the
        deviation of what this rank put on the ring, at the shared global ``alpha``;
        since the ring's selection is unbiased, the ranks' mean residual equals the
        global deviation ``mean(p) - alpha * s_hat`` in expectation, and each residual
        stays bounded. With ``"global"`` each rank's residual also accumulates
        ``sum_t (g_i - mean_j g_j)``, a random walk that swamps the signs: on the digits
        example (2 ranks, 30 epochs, seed 0) it reached 92.5% test accuracy against
        96.7% uncompressed, while ``"local"`` reached 97.2%. ``False``: plain sign of
        ``x``, stateless. State key ``"residual"``, per parameter.
    scale : "mean_abs" or float
        ``"mean_abs"``: ``alpha`` per parameter is the mean over ranks of ``mean|p|``
        (one float32 allgather of one value per parameter). A float: constant ``alpha``
        (learning-rate style; no float on the wire). The optimizer's learning rate
        multiplies the returned ``alpha * s_hat`` either way.
    topology : "auto" (default), "ring", "torus", "butterfly" or "direct"
        How the sign bits travel; every layout sends the same bytes per rank (``direct``
        up to padding the bits to a multiple of ``n`` bytes) and gives every element one
        rank's bit, that rank chosen uniformly (the unbiased selection), but the random
        choices, hence the bits, differ between layouts.

        * ``"ring"``: ``2 (n - 1)`` hops.
        * ``"torus"`` (with ``torus_rows``): ``2 (C - 1) + 2 (R - 1)`` hops on ``R`` rows
          of ``C`` ranks. With ``k`` ranks per host and one row per host, only the column
          hops cross hosts and each host link carries ``2 (R - 1) / R`` of the bits
          instead of ``2 (n - 1) / n`` (4 ranks on 2 hosts: 4 hops instead of 6, 1
          instead of 1.5 times the bits; measured in docs/benchmarks/cluster.md).
        * ``"butterfly"`` (``n`` a power of two): recursive halving and doubling,
          ``2 log2 n`` hops, every selection at odds 1/2.
        * ``"direct"``: the reduce-scatter as one alltoall (chunk ``j`` of every rank to
          rank ``j``, which folds the ``n`` chunks pairwise with the same selection), the
          scales riding in it, then one allgather: two collectives whatever ``n``.
        * ``"gather"``: one allgather of every rank's bits with its scales, ``(n - 1)``
          times the bits per rank. There is no hop to select at: every rank decodes the
          exact mean ``alpha * mean_r sign_r``, which the selection estimates without
          bias (so the same expectation, with less variance, and not a ±1 vector). With
          ``hop="cascade"`` each rank also sends as many bits of fair coin flips, and
          every rank folds the rows pairwise as the direct layout folds its chunks, fold
          ``k`` breaking its ties with rank ``k``'s flips (:func:`fold_gathered_cascade`):
          the same cascading rule, ``2 (n - 1)`` times the bits per rank.
        * ``"auto"``: up to 4 ranks a torus with one row per host when the communicator
          knows that every host holds the same number ``k > 1`` of ranks, numbered host
          by host (:meth:`Communicator.ranks_per_node`; Horovod's ``local_size`` and
          ``cross_size`` on the global process set), else a ring, as before 2026-11-28;
          from 5 ranks on ``"direct"`` (:func:`auto_layout`): each hop is one Horovod
          collective, and their latency, not the bytes, made the 30-hop ring of 16 ranks
          slow (docs/benchmarks/scaling.md); and there, for a buffer small enough that one
          collective's latency outweighs the extra bytes, ``"gather"``
          (:func:`~hvd_quant.core.ring.gathers`, :meth:`buffer_layout`).
    torus_rows : int
        Number of torus rows (e.g. nodes) for ``topology="torus"``; must divide the
        number of ranks. Rank ``r`` is at row ``r // cols``; rows come from
        :meth:`Communicator.subgroups`.
    hop : "marsit" or "cascade"
        Per-hop operator: :class:`MarsitSelect` (unbiased) or :class:`CascadingSign`
        (the cascading-compression baseline).
    check_finite : bool
        Only with a constant ``scale``: agree on whether any rank's input holds inf or
        NaN with one 4-byte allreduce per step (default). With ``scale="mean_abs"`` the
        scale allgather carries that information for free and this option is unused.
        Without the check, a non-finite input still returns NaN only where the constant
        scale cannot reveal it: nothing, so such a step would pass silently.

    Notes
    -----
    Non-finite input: if any rank's ``x + e`` holds inf or NaN, every rank returns NaN
    for the whole buffer and no residual changes.
    """

    multi_hop = True
    name = "marsit"
    stateful = True

    def __init__(self, compensation="local", scale="mean_abs", topology="auto", torus_rows=None,
                 hop="marsit", check_finite=True):
        if scale != "mean_abs":
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
                raise ValueError(f"scale must be 'mean_abs' or a positive number, got {scale!r}")
            scale = float(scale)
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {', '.join(map(repr, TOPOLOGIES))}, got {topology!r}")
        if topology == "torus" and (not isinstance(torus_rows, int) or torus_rows < 1):
            raise ValueError("topology='torus' needs torus_rows, a positive int")
        if hop not in _HOPS:
            raise ValueError(f"hop must be one of {sorted(_HOPS)}, got {hop!r}")
        if compensation is True:
            compensation = "global"
        if compensation not in ("global", "local", False):
            raise ValueError(f"compensation must be 'global', 'local', True or False, got {compensation!r}")
        self.compensation = compensation
        self.scale = scale
        self.topology = topology
        self.torus_rows = torus_rows if topology == "torus" else None
        self.hop = hop
        self.op = _HOPS[hop]()
        self.check_finite = bool(check_finite)
        # Without compensation there is nothing to keep: no state store, no stable names.
        self.stateful = bool(self.compensation)
        self.error_feedback = self.stateful  # its compensation is error feedback

    def options(self):
        return {"compensation": self.compensation, "scale": self.scale,
                "topology": self.topology, "torus_rows": self.torus_rows, "hop": self.hop,
                "check_finite": self.check_finite}

    def validate(self, world_size):
        if self.topology == "torus" and world_size % self.torus_rows:
            raise ValueError(f"torus_rows={self.torus_rows} does not divide {world_size} ranks")
        if self.topology == "butterfly" and not is_power_of_two(world_size):
            raise ValueError(f"topology='butterfly' needs a power-of-two number of ranks, got {world_size}")

    def layout(self, comm):
        """What this rank runs on ``comm``: the torus rows (an int), ``None`` for a ring,
        ``"butterfly"``, ``"direct"`` or ``"gather"`` (with ``topology="auto"``, small
        buffers may still go by ``"gather"``: :meth:`buffer_layout`)."""
        if self.topology == "torus":
            return self.torus_rows
        if self.topology in ("butterfly", "direct", "gather"):
            return self.topology
        k = comm.ranks_per_node() if self.topology == "auto" else None
        return auto_layout(comm.size, k) if self.topology == "auto" else None

    def buffer_layout(self, comm, numel, segments=1):
        """:meth:`layout` for one buffer of ``numel`` elements in ``segments`` tensors:
        ``"auto"``'s direct layout becomes ``"gather"`` where
        :func:`~hvd_quant.core.ring.gathers` says one allgather of :meth:`gather_row_bytes`
        is the cheaper. The same on every rank."""
        layout = self.layout(comm)
        if (layout == "direct" and self.topology == "auto"
                and gathers(comm.size, self.gather_row_bytes(numel, segments))):
            return "gather"
        return layout

    def gather_row_bytes(self, numel, segments=1):
        """What each rank sends in the gather layout: its sign bits, with ``hop="cascade"``
        as many bits of tie-breaks, and its scales with ``scale="mean_abs"``."""
        bits = packed_sign_bytes(numel) * (2 if self.hop == "cascade" else 1)
        return bits + (4 * segments if self.scale == "mean_abs" else 0)

    def reduce(self, x, ctx):
        """Marsit's step: the scale, the signs, the multi-hop aggregation of the sign bits,
        the decode and the compensation, each a phase below; the collectives are issued
        here and in :meth:`_aggregate`.

        With ``scale="mean_abs"`` (the default) the scales ride: their allgather is
        started before the sign collectives and waited for after them, or they travel
        inside the direct layout's alltoall or the gather layout's allgather. The default
        (``mean_abs``, local compensation) also packs the bits in the same pass as the
        scale sums (fused)."""
        B, comm = ctx.backend, ctx.comm
        d, n = B.numel(x), comm.size
        counts = [c for _, c in (ctx.segments or [("", d)])]
        residual = ctx.state.get("residual") if self.compensation else None
        ride = self.scale == "mean_abs"
        fused = ride and self.compensation == "local"
        layout = self.buffer_layout(comm, d, len(counts))

        # Phase 1, the scale: this rank's alpha per segment (with the bits when fused),
        # or the constant alpha and the agreed finite flag.
        local, bits, alpha, finite = self._scale_phase(B, comm, ctx, x, residual, counts, fused)
        scale_handle = None
        if ride and layout not in ("direct", "gather"):
            scale_handle = start_allgather(comm, B.divide(local, float(n)), ctx.collective_name("scale"))

        # Phase 2, the signs (when not fused): the bits of p = x + e, and with local
        # compensation the new residual.
        p = None
        if not fused:
            bits, residual, p = self._sign_phase(B, ctx, x, residual, alpha, finite, counts)

        # Phase 3, multi-hop aggregation: 1 bit per element on every hop.
        agg, gathered = self._aggregate(B, comm, ctx, bits, d, layout, B.divide(local, float(n)) if ride else None,
                                        len(counts))

        # Phase 4, decode: alpha (the ranks' scales, summed in rank order), then
        # alpha * s_hat, and on the fused path the new residual in the same pass.
        if ride:
            alpha = rank_order_sum(B, gathered if scale_handle is None else scale_handle.wait(), n)
            ctx.sent_scales(alpha)
            finite = B.all_finite(alpha)
        out = self._decode_phase(B, ctx, x, residual, agg, alpha, finite, counts, layout, fused)

        # Phase 5, global compensation: against the aggregated result every rank shares.
        if self.compensation == "global":
            ctx.state.set("residual", B.cond(finite, lambda: p - out, lambda: residual))
        return out

    def _scale_phase(self, B, comm, ctx, x, residual, counts, fused):
        """``(local, bits, alpha, finite)``. With ``scale="mean_abs"``: ``local``, the
        mean ``|x + e|`` per segment (float64 sums; its values double as the non-finite
        flag once gathered), and when fused the sign bits from the same pass; alpha and
        finite come with the gathered scales (phase 4). A constant alpha sends no float:
        the flag costs one 4-byte allreduce of its own, unless ``check_finite=False``."""
        if fused:
            sums, bits = compensate_sums_signs(B, x, residual, counts)
            return segment_means(B, sums, counts), bits, None, None
        if self.scale == "mean_abs":
            return segment_means(B, compensate_sums(B, x, residual, counts), counts), None, None, None
        alpha = B.full(len(counts), self.scale)
        finite = (all_ranks_finite(B, comm, x, ctx.collective_name("finite")) if self.check_finite
                  else B.all_finite(alpha))
        return None, None, alpha, finite

    def _sign_phase(self, B, ctx, x, residual, alpha, finite, counts):
        """``(bits, residual, p)``: the sign bits of ``p = x + e``; with local compensation
        the new residual ``p - alpha * sign(p)`` in the same pass (kept only on a finite
        step, stored at once), else ``p`` for the global compensation."""
        if self.compensation == "local":
            bits, residual = B.cond(
                finite, lambda: sign_pack_residual(B, x, residual, alpha, counts, out=residual),
                lambda: (B.zeros(packed_sign_bytes(B.numel(x)), "uint8"), residual))
            ctx.state.set("residual", residual)
            return bits, residual, None
        p = x if residual is None else x + residual
        return pack_signs(B, p), residual, p

    def _aggregate(self, B, comm, ctx, bits, numel, layout, scales, nseg):
        """The multi-hop allreduce of the sign bits in ``layout``: ``(s_hat's bits, the
        ranks' scales)``, the scales where they rode in the layout's collective (gather,
        direct with ``scales``), else ``None``."""
        name = ctx.collective_name("signs")
        if layout == "gather":
            return self._gather_layout(B, comm, ctx, bits, packed_sign_bytes(numel), scales, nseg, name)
        if layout == "butterfly":
            return butterfly_allreduce(B, comm, bits, self.op, name, ctx.rng), None
        if layout == "direct" and scales is not None:
            agg, gathered = direct_allreduce(B, comm, bits, self.op, name, ctx.rng, extra=float_bytes(B, scales))
            return agg, bytes_float(B, gathered)
        if layout == "direct":
            return direct_allreduce(B, comm, bits, self.op, name, ctx.rng), None
        if layout is not None:
            row_comm, col_comm = comm.subgroups(layout)
            return torus_allreduce(B, row_comm, col_comm, bits, self.op, name, ctx.rng), None
        return ring_allreduce(B, comm, bits, self.op, name, ctx.rng), None

    def _gather_layout(self, B, comm, ctx, bits, nbytes, scales, nseg, name):
        """Every rank's row by one allgather: its bits (with ``hop="cascade"`` followed by
        its tie-breaks) and its scales. Marsit decodes the ``n`` rows with ``alpha / n``
        each; the cascade folds them into one, as the direct layout would, the same on
        every rank."""
        n = comm.size
        cascade = self.hop == "cascade"
        width = 2 * nbytes if cascade else nbytes
        row = B.concat([bits, cascade_tie_mask(B, ctx.rng, nbytes)]) if cascade else bits
        row = B.reshape(row, (1, width))
        gathered = None
        if scales is not None:
            agg, gathered = split_scales(B, start_allgather(comm, with_scales(B, row, 1, scales),
                                                            f"{name}.gather").wait(), n, width, nseg)
        else:
            agg = B.reshape(start_allgather(comm, row, f"{name}.gather").wait(), (-1,))
        if cascade:
            agg = fold_gathered_cascade(B, [B.slice(agg, r * width, r * width + nbytes) for r in range(n)],
                                        [B.slice(agg, r * width + nbytes, (r + 1) * width) for r in range(n)])
        return agg, gathered

    def _decode_phase(self, B, ctx, x, residual, agg, alpha, finite, counts, layout, fused):
        """``alpha * s_hat`` (into ``ctx.out`` where given: it may be ``x``), NaN on a
        non-finite step. Fused, the new residual ``p - alpha * sign(p)`` is written in the
        same pass (primitive ``unpack_sum_residual``) and kept only on a finite step: one
        read of ``x`` and ``e``, where a residual pass beside the hops read them once more
        with the CPU of the backward pass on a rank that has one core."""
        d, n = B.numel(x), ctx.comm.size
        row_scales = (B.concat([B.divide(alpha, float(n))] * n) if layout == "gather" and self.hop == "marsit"
                      else alpha)
        if not fused:
            return B.cond(finite, lambda: unpack_scaled_sum(B, agg, row_scales, counts, d, out=ctx.out),
                          lambda: B.full(d, float("nan")))
        out, residual = B.cond(
            finite,
            lambda: unpack_sum_residual(B, agg, row_scales, counts, d, x, residual, alpha, out=ctx.out,
                                        resid_out=residual),
            lambda: (B.full(d, float("nan")), residual))
        ctx.state.set("residual", residual)
        return out

    def wire_bytes(self, numel, world_size, segments=1, layout=None):
        """Bytes one rank sends; ``layout`` as :meth:`buffer_layout` returns it (``"direct"``
        pads the bits to a multiple of ``n`` bytes; ``"gather"`` sends them, with the
        cascade's tie-breaks, to every other rank; the others move the same bytes)."""
        n = world_size
        # A constant scale sends no float: the non-finite flag's 4-byte allreduce instead.
        flag = 2.0 * (n - 1) / n * 4 if self.scale != "mean_abs" and self.check_finite else 0
        if layout == "gather":
            return (n - 1) * self.gather_row_bytes(numel, segments) + flag
        nbytes = packed_sign_bytes(numel)
        if layout == "direct":
            nbytes = direct_padded_numel(nbytes, n)
        scales = (n - 1) * 4 * segments if self.scale == "mean_abs" else 0  # their allgather
        return 2.0 * (n - 1) / n * nbytes + scales + flag


    # --- the cost model ----------------------------------------------------------------
    def collectives(self, numel, world_size, ranks_per_node=None, segments=1, rank=0):
        """What rank ``rank`` issues in :meth:`buffer_layout`'s layout, with the scales of
        ``scale="mean_abs"`` (the default of both methods): inside the gather layout's
        allgather or the direct layout's alltoall, else an allgather started before the
        hops and waited for after them (``overlapped``)."""
        d, n, S = numel, world_size, segments
        layout = self.buffer_layout(HostLayout(n, ranks_per_node), d, S)
        W = packed_sign_bytes(d)
        if layout == "gather":  # the scales (and the cascade's tie-breaks) ride with the bits
            return [Collective("allgather", float(self.gather_row_bytes(d, S)), n)]
        if layout == "direct":
            per = direct_padded_numel(W, n) // n
            return [Collective("alltoall", n * (per + 4.0 * S), n), Collective("allgather", float(per), n)]
        scales = [Collective("allgather", 4.0 * S, n, overlapped=True)]
        if layout == "butterfly":
            return scales + _butterfly_hops(W, n, rank)
        if layout is None:
            return scales + ring_hops(W, n, n, rank)
        return scales + _torus_hops(W, n, layout, rank)

    def memory_bytes(self, numel, world_size, ranks_per_node=None, segments=1):
        return sign_feedback_memory_bytes(numel, world_size)


def _butterfly_hops(W, n, rank):
    """The butterfly's hops of ``W`` bytes from rank ``rank``: recursive halving (send the
    half given away), then recursive doubling (send what is held, the kept half of the
    same step, in reverse)."""
    sent, lo, hi, m = [], 0, W, 1
    while m < n:
        mid = chunk_bounds(hi - lo, 2, 1)[0][1] + lo
        if rank & m == 0:  # keep the lower half, send the upper one
            sent.append((float(hi - mid), float(mid - lo)))
            hi = mid
        else:
            sent.append((float(mid - lo), float(hi - mid)))
            lo = mid
        m *= 2
    return [Collective("sendrecv", b, n) for b, _ in sent] + \
        [Collective("sendrecv", held, n) for _, held in reversed(sent)]


def _torus_hops(W, n, rows, rank):
    """The torus's hops of ``W`` bytes from rank ``rank`` on ``rows`` rows: the row ring's
    reduce-scatter, the column ring over the chunk held, the row ring's allgather."""
    cols = n // rows
    row, col = divmod(rank, cols)
    bounds = chunk_bounds(W, cols)
    row_hops = ring_hops(W, cols, n, col)
    held = bounds[(col + 1) % cols]
    col_hops = ring_hops(held[1] - held[0], rows, n, row) if rows > 1 else []
    return row_hops[:cols - 1] + col_hops + row_hops[cols - 1:]


#: One element of a combine of :class:`CascadingSign`, in bytes of a copy: the time a copy
#: at the memory bandwidth takes to move this many bytes. Measured, not counted. Its passes
#: add up to about 62 bytes per element (both chunks decoded to float32, their sum, a
#: uniform per element for the ties, the re-signing and packing), but the uniform draws and
#: the table lookups are compute. On one core (issue 42, 2026-11-29), the direct layout's
#: fold of a 3.7M buffer at 4, 8 and 16 ranks took 8.5-11.6 ns per element combined, 130-250
#: bytes of a copy at 12-21 GB/s (``bench_quantize.py``'s "cascading-sign fold of 16
#: chunks": 29-30 ``copy_`` of the buffer, 250 bytes); 200 is their middle. Marsit's bitwise
#: selection of the same chunks took 1/30 of it.
CASCADE_COMBINE_BYTES = 200.0


def cascade_fold_bytes(numel, world_size, ranks_per_node=None, segments=1, options=None):
    """What one rank's combines of ``cascading_sign`` (at ``options``' ``topology`` and
    ``torus_rows``) cost for one buffer, in bytes of a copy
    (:meth:`CascadingSignCompressor.fold_bytes`)."""
    options = options or {}
    comp = CascadingSignCompressor(topology=options.get("topology", "auto"), torus_rows=options.get("torus_rows"))
    return comp.fold_bytes(numel, world_size, ranks_per_node, segments)


class CascadingSignCompressor(MarsitCompressor):
    """Baseline: signSGD on the same ring / torus, re-signing at every hop.

    :class:`MarsitCompressor` with ``hop="cascade"``. Compensation defaults to off, which
    is plain signSGD over a multi-hop allreduce (the setting the paper says breaks);
    pass ``compensation=True`` to compare hop rules with everything else equal.
    """

    name = "cascading_sign"

    def __init__(self, compensation=False, scale="mean_abs", topology="auto", torus_rows=None,
                 check_finite=True):
        super().__init__(compensation=compensation, scale=scale, topology=topology,
                         torus_rows=torus_rows, hop="cascade", check_finite=check_finite)

    def options(self):
        opts = super().options()
        del opts["hop"]
        return opts

    def fold_bytes(self, numel, world_size, ranks_per_node=None, segments=1):
        """What one rank's combines cost for one buffer, in bytes of a copy.

        Every layout that reduces chunks (ring, torus, butterfly, direct) has each rank
        combine ``(n - 1) / n`` of the buffer's elements once, through
        :class:`CascadingSign`'s float32 rule (:data:`CASCADE_COMBINE_BYTES` each); the
        gather layout folds ``n`` whole rows of packed bits bitwise instead, ``n - 1``
        selections reading two rows and a mask and writing one (counted; on small buffers
        their Python overhead is more)."""
        d, n = int(numel), int(world_size)
        if n <= 1:
            return 0.0
        if self.buffer_layout(HostLayout(n, ranks_per_node), d, segments) == "gather":
            return 4.0 * (n - 1) * packed_sign_bytes(d)
        return CASCADE_COMBINE_BYTES * d * (n - 1) / n

    def memory_bytes(self, numel, world_size, ranks_per_node=None, segments=1):
        """The sums and bits of ``g + e``, the ring bits, and the folds
        (:meth:`fold_bytes`)."""
        n = int(world_size)
        return 4.0 * float(numel) * (3.0 + n / 32.0) + self.fold_bytes(numel, n, ranks_per_node, segments)
