"""QSGD: each worker quantizes with its own norm; every rank decodes every worker.

Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding", NeurIPS 2017 (arXiv 1610.02132), Section 3.1 (the
quantization function ``Q_s``). The baseline that Global-QSGD (Xin et al. 2023,
:mod:`hvd_quant.compressors.global_qsgd`) measures itself against.

Per block of ``K = 512`` consecutive elements of the fused buffer (``block``; below), with
``n`` ranks, ``s`` levels and rank ``i`` holding ``x_i`` in that block::

    S_i = ||x_i||_2 * c                        this rank's own norm (c = 1 + 2**-8, as
                                               global_qsgd's l2 scale: it absorbs float32
                                               rounding, so |x_ij| / S_i never exceeds 1)
    v_i = s * x_i / S_i                        |v_i| <= s
    q_i = floor(v_i) + [u < v_i - floor(v_i)], u ~ U[0, 1)   (E q_i = v_i: unbiased)
    allgather (q_i, S_i) of every rank         w = 8 or 16 bit signed integers + 2 floats
                                               per block
    est = sum_i q_i * S_i / (s * n)            rank order; E est = mean_i x_i

The paper writes ``Q_s(v_j) = ||v|| sgn(v_j) xi_j(v, s)`` with ``xi_j`` the stochastic
rounding of ``s |v_j| / ||v||`` to a neighbouring level ``l / s``; a signed integer
``sgn * l`` in ``w`` bits is the same information, with ``s = 2**(w-1) - 1`` levels by
default (sign and level in one byte at ``w = 8``). The paper's Elias coding of the levels
is not used: the wire is fixed-width, as every other compressor's here, so the bytes per
element are ``w / 8`` whatever the gradient.

Why allgather. Each rank's integers are on its own grid (step ``S_i / s``), so their sum
means nothing: an allreduce cannot add them. Every rank instead gathers every rank's
integers and scale and decodes the ``n`` rows itself, adding them in rank order in float32,
so every rank holds the same bits. The price is the allgather's ``(n - 1) d w / 8`` bytes
per rank against the allreduce's ``2 (n - 1) / n d w / 8`` that Global-QSGD pays for its
shared grid; in return every rank keeps all ``s`` levels at any world size (no headroom
for a sum), and nothing can overflow.

A norm per block, as the paper's experiments cut the gradient into buckets of a few
hundred elements, each with its own norm: ``block=512`` by default, the last block of a
buffer shorter, ``block=None`` for one norm per fused buffer (the default until
2026-12-06, as the other compressors here). A block costs 8 bytes per rank on the wire (its
scale and ``pre``: 1.6% at 8 bits and 512 elements) and bounds the variance by
``min(K / s**2, sqrt(K) / s)`` times each block's squared norm instead of the buffer's
``d``, for ``d`` of millions about 20 at ``s = 127``, for 512 about 0.03. On the
time-to-quality LM (7.37M parameters, 2 hosts, 400 steps) one norm per buffer ended +5.6%
above fp32 over three seeds, a norm per 512 elements -0.2%
(``benchmarks/reference/ttq-qsgd-block-2026-12-06/``).

Non-finite input: a rank whose input holds inf or NaN has a non-finite norm, which
travels with its integers (zeros, so no NaN becomes an integer), so every rank sees it in
the gathered scales; that step returns NaN for the whole buffer on every rank. A norm at
or above ``2**126`` (inputs near the float32 maximum) is carried as the norm times
``2**-64`` with the power of two beside it (:func:`~hvd_quant.compressors.global_qsgd.
finish_scale`); such a row's values are scaled back and saturate at the float32 maximum.
"""

from ..core.compressor import Compressor
from ..core.costmodel import Collective
from ..core.packing import split_scales, with_scales
from ..core.rng import hash_bits, uniform_from_bits
from ..core.segments import block_counts, by_blocks, compensate_sums
from .global_qsgd import FLOAT32_MAX, blockwise, finish_scale, linear_quantize, rescaled, scaled_back

WIDTHS = (8, 16)


def resolve_width_levels(bits=None, levels=None):
    """``(width, levels)``: the default levels fill the width (``2**(w-1) - 1``: sign and
    level in ``w`` bits); ``bits=None`` takes the narrowest width that holds ``levels``.
    No world size enters: a rank's integers are never summed with another's."""
    for width in (WIDTHS if bits is None else (bits,)):
        limit = 2 ** (width - 1) - 1
        if levels is None:
            return width, limit
        if levels <= limit:
            return width, levels
    raise ValueError(f"qsgd(bits={bits}): {levels} levels do not fit a signed "
                     f"{bits or WIDTHS[-1]}-bit integer (at most {2 ** ((bits or WIDTHS[-1]) - 1) - 1})")


def own_scale(B, x, counts=None):
    """``(scale, pre, finite)`` of this rank alone, one per block of ``counts`` (the whole
    buffer when ``None``): the float32 norm ``||x|| * c``
    (:func:`~hvd_quant.compressors.global_qsgd.finish_scale` with ``norm="l2"``: the same
    margin and the same exact rescaling near the float32 maximum), the power of two
    ``pre`` the input is multiplied by, and whether ``x`` is finite (its float64 sums of
    squares are, exactly when every element is)."""
    sumsq = compensate_sums(B, x, None, counts or [B.numel(x)], squares=True)
    scale, pre = finish_scale(B, sumsq, "l2")
    return scale, pre, B.all_finite(sumsq)


def quantize_levels(B, x, scale, pre, levels, width, key, counts=None):
    """Signed ``width``-bit levels of ``x * pre / scale`` (``|q| <= levels``, ``E q =
    levels * x * pre / scale``) with the draws of the call ``key``: global_qsgd's fused
    ``quantize_ints`` where there is one, else its generic
    :func:`~hvd_quant.compressors.global_qsgd.linear_quantize` (the same bits). With
    several blocks (``counts``: equal, the last perhaps shorter), ``scale`` and ``pre``
    hold one value per block: ``quantize_ints_blocks`` in one pass where there is one."""
    counts = counts or [B.numel(x)]
    fast = B.kernel("quantize_ints_blocks", x) if len(counts) > 1 else None
    if fast is not None:
        return fast(x, pre, scale, counts[0], levels, key, f"int{width}", 0)
    x, scale, pre = blockwise(B, x, scale, pre, counts)
    fast = B.kernel("quantize_ints", x)
    if fast is not None:
        return fast(x, B.kernel_scalar(pre), B.kernel_scalar(scale), levels, key, f"int{width}", 0)
    u = uniform_from_bits(B, hash_bits(B, key, B.numel(x)))
    return linear_quantize(B, x * pre, scale, levels, u, f"int{width}")


def level_bytes(B, q):
    """The bytes of the integer levels ``q`` (native order), flat uint8."""
    return B.reshape(B.bitcast(q, "uint8"), (-1,))


def bytes_levels(B, b, width):
    """Inverse of :func:`level_bytes` for ``width``-bit integers."""
    if width == 8:
        return B.bitcast(b, "int8")
    return B.reshape(B.bitcast(B.reshape(b, (-1, 2)), "int16"), (-1,))


def decode_row(B, q, factor, pre, counts=None):
    """One worker's contribution ``q * factor`` (float32; global_qsgd's fused
    ``dequantize_ints`` where there is one), scaled back by ``1 / pre`` and saturated at
    the float32 maximum when the worker's norm was rescaled (``pre < 1``). With several
    blocks (``counts``), ``factor`` and ``pre`` hold one value per block."""
    counts = counts or [B.numel(q)]
    if len(counts) == 1:
        fast = B.kernel("dequantize_ints", q)
        part = fast(q, B.kernel_scalar(factor)) if fast is not None else B.cast(q, "float32") * factor
    else:
        fast = B.kernel("dequantize_ints_blocks", q)
        part = (fast(q, factor, counts[0]) if fast is not None
                else by_blocks(B, B.cast(q, "float32"), counts, lambda v, f: v * f, factor))
    return B.cond(rescaled(B, pre), lambda: scaled_back(B, part, pre, counts), lambda: part)


def row_bytes(numel, width, blocks=1):
    """Bytes one rank contributes to the allgather: its levels, then each block's scale and
    ``pre`` (two float32 per block)."""
    return numel * width // 8 + 8 * blocks


class QSGDCompressor(Compressor):
    """QSGD (Alistarh et al. 2017): per-worker l2 norm, ``s`` levels, stochastic rounding,
    by allgather (stateless, unbiased, no error feedback).

    Parameters
    ----------
    bits : {None, 8, 16}
        Width of each signed level on the wire; ``None`` takes 8 unless ``levels`` needs 16.
    levels : int or None
        Levels per sign, ``s``; ``None`` fills the width (127 at 8 bits, 32767 at 16).
    block : int or None
        Elements per norm: one norm per block of ``block`` consecutive elements of the
        fused buffer (512 by default, as the paper's experiments cut the gradient into
        buckets; 8 bytes per block on the wire), or ``None`` for one per buffer (module
        docstring).

    Raises
    ------
    ValueError
        For unknown options, levels that do not fit the width, or a block that is not a
        positive int.
    """

    name = "qsgd"

    def __init__(self, bits=None, levels=None, block=512):
        if bits is not None and bits not in WIDTHS:
            raise ValueError(f"qsgd: bits must be None, 8 or 16, got {bits!r}")
        if levels is not None and (isinstance(levels, bool) or not isinstance(levels, int)
                                   or levels < 1):
            raise ValueError(f"qsgd: levels must be None or an int >= 1, got {levels!r}")
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            raise ValueError(f"qsgd: block must be None or an int >= 1, got {block!r}")
        self.bits, self.levels, self.block = bits, levels, block
        self.width, self.s = resolve_width_levels(bits, levels)

    def options(self):
        return {"bits": self.bits, "levels": self.levels, "block": self.block}

    def blocks(self, numel):
        """How many norms a buffer of ``numel`` elements takes (:func:`block_counts`)."""
        return len(block_counts(numel, self.block))

    def resolve(self, world_size=None):
        """``(width, levels)``, the same at every world size."""
        return self.width, self.s

    def reduce(self, x, ctx):
        B, comm = ctx.backend, ctx.comm
        d, n, width, levels = B.numel(x), comm.size, self.width, self.s
        counts = block_counts(d, self.block)
        k = len(counts)
        # Phase 1: this rank's norm per block (one pass, float64 sums of squares).
        scale, pre, finite = own_scale(B, x, counts)
        # Phase 2: stochastic rounding onto this rank's grid; zeros (on a grid of 1) when
        # the input is not finite, so no NaN is turned into an integer. One random call
        # either way, so the stream advances alike on every step.
        key = ctx.rng.next_key(B)
        ones = B.full(k, 1.0)
        q = B.cond(finite, lambda: quantize_levels(B, x, scale, pre, levels, width, key, counts),
                   lambda: quantize_levels(B, B.zeros(d), ones, ones, levels, width, key, counts))
        # Phase 3: one allgather of every rank's levels with its scales and pres behind
        # them (a non-finite scale travels as it is: every rank learns of it).
        nbytes = d * width // 8
        row = B.reshape(level_bytes(B, q), (1, nbytes))
        gathered = comm.allgather(with_scales(B, row, 1, B.concat([scale, pre])),
                                  ctx.collective_name("levels"))
        rows, floats = split_scales(B, gathered, n, nbytes, 2 * k)
        table = B.reshape(floats, (n, 2 * k))  # each rank's k scales, then its k pres
        ctx.sent_scales(B.slice_columns(table, 0, k) / B.slice_columns(table, k, 2 * k))  # the norms
        # Phase 4: every rank decodes the n rows and adds them in rank order (the same
        # floats on every rank); each scale is divided by s * n first, as global_qsgd's.
        return B.cond(B.all_finite(floats), lambda: self._decode(B, rows, floats, d, n, nbytes, counts),
                      lambda: B.full(d, float("nan")))

    def _decode(self, B, rows, floats, d, n, nbytes, counts):
        k, total = len(counts), None
        for r in range(n):
            q = bytes_levels(B, B.slice(rows, r * nbytes, (r + 1) * nbytes), self.width)
            scale = B.slice(floats, 2 * k * r, 2 * k * r + k)
            pre = B.slice(floats, 2 * k * r + k, 2 * k * (r + 1))
            part = decode_row(B, q, B.divide(scale, float(self.s * n)), pre, counts)
            total = part if total is None else total + part
        # Rows near the float32 maximum can add up beyond it: saturate, as a row does.
        pres = B.slice_columns(B.reshape(floats, (n, 2 * k)), k, 2 * k)
        return B.cond(rescaled(B, pres), lambda: B.clip(total, -FLOAT32_MAX, FLOAT32_MAX), lambda: total)

    def wire_bytes(self, numel, world_size, segments=1, int_dtypes=None):
        """Bytes sent per rank: one allgather of ``numel * w / 8`` bytes of levels and 8
        bytes of scale and ``pre`` per block (ring cost model: ``(n - 1)`` times the row).
        ``int_dtypes`` is accepted for the same call as global_qsgd's and ignored: the
        levels go as bytes."""
        return float((world_size - 1) * row_bytes(numel, self.width, self.blocks(numel)))

    def collectives(self, numel, world_size, ranks_per_node=None, segments=1, rank=0):
        """One allgather of this rank's row (levels, then each block's scale and ``pre``)."""
        return [Collective("allgather", float(row_bytes(numel, self.width, self.blocks(numel))), world_size)]

    def memory_bytes(self, numel, world_size, ranks_per_node=None, segments=1):
        """The norm pass and the quantize pass read the buffer (``2F``) and write the
        levels (``b``); decoding reads the ``n`` gathered rows and, per row, reads and
        writes the float32 sum (``2F`` each but the first, which only writes). A norm per
        block costs no pass of its own: the fused kernels (``quantize_ints_blocks``,
        ``dequantize_ints_blocks``) take each block's scale in the same passes."""
        F, b, n = 4.0 * float(numel), float(numel) * self.width / 8.0, float(world_size)
        return 2.0 * F + b + n * b + (2.0 * n - 1.0) * F
