"""Global-QSGD, linear (standard) dithering: integers on one grid, summed by allreduce.

Xin, Canini, Richtárik, Horváth, "Global-QSGD: Practical Floatless Quantization for
Distributed Learning with Theoretical Guarantees", arXiv 2305.18627 (2023); reference
code https://github.com/sands-lab/global-qsgd (``gqsgd/ddphook.py``,
``standard_dithering_hook``). Written from the formulas, not from that code.

Per block of ``K = 512`` consecutive elements of the fused buffer (``block``; "Blocks"
below), with ``n`` ranks, ``s`` levels and rank ``i`` holding ``x_i`` in that block::

    S   = allreduce_max(max|x_i|)              norm="max"  (the reference code's choice)
        = sqrt(sum_i ||x_i||^2) * c            norm="l2"   (c = 1 + 2**-8, see below;
                                               the n scalars by allgather, summed in rank
                                               order, so every rank has the same grid)
    v_i = s * x_i / S                          |v_i| <= s
    q_i = floor(v_i) + [u < v_i - floor(v_i)], u ~ U[0, 1)   (E q_i = v_i: unbiased)
    Q   = allreduce_sum(q_i)                   integers, in ``w`` = 8 or 16 bits
    est = Q * S / (s * n)                      E est = mean_i x_i

One scalar collective and one integer allreduce; nothing is decoded before the sum. From 5
ranks on, a small wire is summed by one allgather and a local sum in rank order instead
(:func:`sum_levels`): the same integers, one collective that Gloo runs in fewer dependent
steps.

Level rule (why the integer sum never overflows). ``L = 2**(w-1) - 1``. Every partial
sum over any subset ``P`` of ``m <= n`` ranks must satisfy ``|sum_P q| <= L`` (Horovod
adds in any order, and lane packing needs it too). ``|q| <= ceil(|v|)`` by construction.

* max: ``|v_i| <= s`` so ``|sum_P q| <= m s <= n s``; take ``s = floor(L / n)``. The
  reference code scales by ``127 / n`` instead: 127 is prime, so ``127 / n`` is never an
  integer for ``n >= 2``, and when every rank holds ``+S`` at one coordinate the ranks can
  all round up to ``ceil(127 / n)``, whose sum ``n * ceil(127 / n) > 127`` wraps int8.
* l2: Cauchy-Schwarz per coordinate, ``sum_P |x_ij| <= sqrt(m) * ||x|| <= sqrt(m) S``, so
  ``sum_P |v| <= s sqrt(m)`` and ``sum_P |q| <= sum_P ceil|v| < s sqrt(m) + m``, i.e.
  ``<= ceil(s sqrt(n)) + n - 1`` (an integer below a bound increasing in ``m``). Also
  ``|x_ij| <= S`` gives the max bound ``n s``. The largest ``s`` with
  ``min(n s, ceil(s sqrt n) + n - 1) <= L`` is used: about ``sqrt(n)`` times more levels
  than max scaling, the paper's O(sqrt n) gain. The inflation ``c = 1 + 2**-8`` of ``S``
  covers float32 rounding of ``||x||^2`` (pairwise sums err by ~1e-6), so the computed
  ``S`` is never below the true one; ``|x / S|`` is also clamped to 1.

Blocks. The paper's reference code takes one scale per DDP bucket (``block=None`` here,
the default until 2026-12-06). At 8 ranks an 8-bit wire leaves 15 levels per sign, and a
layer whose gradients are far below the bucket's largest rounds to a level or two of the
largest's grid: on the time-to-quality LM (8 hosts, 200 steps) one scale per buffer ended
+6.9% above fp32, a scale per 512 elements +0.1%, at 2 hosts +1.5% and +0.8% (three
seeds), for 4 more bytes per block (0.8% at 8 bits;
``benchmarks/reference/ttq-global-qsgd-block-2026-12-06/``). Every block's scale is still
taken over every rank (one allreduce-max, or one allgather of the blocks' squared norms),
so every rank shares every block's grid, the integers are still summed by one allreduce,
and the level rule holds block by block. The fused kernels take each block's scale in the
passes of one scale (``block_absmax_finite``, ``quantize_*_blocks``,
``dequantize_*_blocks``: a rank's reduction of a 7.37M-element buffer costs what one
scale's does, 26-30 ms on one thread, against 47-125 ms when the blocks were scaled around
the one-scale kernels; ``benchmarks/reference/global-qsgd-block-kernels-2026-12-06/``).
The generic path divides the input by its blocks' scales (each broadcast over its block,
:func:`~hvd_quant.core.segments.by_blocks`), quantizes on a grid of 1, decodes with a
factor of 1, then multiplies by each block's factor: the same bits, those of the
per-element formula.

``bits=None`` picks 8 bits if at least one level (or the requested ``levels``) is safe,
else 16. Transport: the ``w``-bit integers go natively when the communicator sums
``int{w}`` (TensorFlow: int8; the thread simulation), otherwise packed into int32 lanes
(:func:`~hvd_quant.core.packing.pack_lanes`; torch's Horovod sums only int32/int64),
which is exact under the same bound.

Non-finite input: a rank whose input holds inf or NaN poisons the scale collective
(``+inf`` max, or a non-finite l2 sum), so every rank knows; that step returns NaN for the
whole buffer on every rank and the integers carry zeros. ``||x||^2`` is summed in float64
(no overflow), and an l2 scale above ``2**126`` is handled by an exact power-of-two
rescaling (:func:`finish_scale`). Stochastic rounding is exact up to the grid of
``U[0, 1)`` (``2**-24``).
"""

import math

from ..core.comm import identical_sum, rank_order_sum
from ..core.compressor import Compressor
from ..core.costmodel import Collective, level_memory_bytes
from ..core.packing import pack_lanes, packed_lane_words, unpack_lanes
from ..core.pipeline import pipelined, start_allreduce
from ..core.ring import gathers
from ..core.rng import hash_bits, uniform_from_bits
from ..core.segments import block_counts, by_blocks, chunk_blocks, compensate_sums

#: Smallest normal float32: the scale is raised to at least this, so all-zero buffers
#: (scale 0) give zeros instead of 0/0, with no branch on tensor values.
FLOAT32_TINY = 1.1754944e-38
FLOAT32_MAX = 3.4028234663852886e38  # float(np.finfo(np.float32).max), exactly
#: Inflation of the l2 scale that absorbs float32 rounding in ``sqrt(sum ||x_i||^2)``.
L2_SCALE_MARGIN = 1.0 + 2.0 ** -8
#: The ``pre`` of an l2 scale at or above ``2**126`` (:func:`finish_scale`), exact.
RESCALE = 2.0 ** -64
NORMS = ("max", "l2")
WIDTHS = (8, 16)


def sum_bound(norm, world_size, levels):
    """Largest ``|sum of q|`` over any subset of ``world_size`` ranks (module docstring)."""
    n, s = world_size, levels
    if norm == "max":
        return n * s
    ceil_s_sqrt_n = math.isqrt(s * s * n - 1) + 1 if s else 0  # exact ceil(s * sqrt(n))
    return min(n * s, ceil_s_sqrt_n + n - 1)


def max_levels(norm, world_size, width):
    """The largest level count whose integer sum fits ``width`` signed bits (0 if none)."""
    limit = 2 ** (width - 1) - 1
    if norm == "max":
        return limit // world_size
    lo, hi = 0, limit  # sum_bound is increasing in s: binary search the last safe s
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum_bound(norm, world_size, mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def resolve_width_levels(norm, world_size, bits=None, levels=None):
    """``(width, levels)`` for ``world_size`` ranks; ``ValueError`` if nothing is safe."""
    for width in (WIDTHS if bits is None else (bits,)):
        safe = max_levels(norm, world_size, width)
        if levels is None and safe >= 1:
            return width, safe
        if levels is not None and levels <= safe:
            return width, levels
    want = "any level" if levels is None else f"{levels} levels"
    raise ValueError(
        f"global_qsgd(norm={norm!r}, bits={bits}): {want} cannot be summed over "
        f"{world_size} ranks without integer overflow (at most "
        f"{max_levels(norm, world_size, bits or WIDTHS[-1])} levels fit); "
        f"use fewer levels, bits=16 or bits=None")


def absmax_finite(B, x):
    """``(max |x|, all finite)``: shape-(1,) float32 (the max over finite elements) and a
    boolean scalar. Fused primitive ``absmax_finite``."""
    fast = B.kernel("absmax_finite", x)
    if fast is not None:
        m, ok = fast(x)  # numbers, or scalar tensors in a TensorFlow graph
        return B.full(1, m), B.full(1, ok, "bool")
    return B.reshape(B.cast(B.max(B.abs(x)), "float32"), (1,)), B.all_finite(x)


def block_absmax(B, x, counts):
    """``max |x|`` per block of ``counts`` (:func:`~hvd_quant.core.segments.block_counts`:
    equal blocks, the last perhaps shorter), float32. The last block is padded with zeros,
    which no max of ``|x|`` can see; a non-finite element's block is not finite."""
    k, size = len(counts), counts[0]
    rows = B.reshape(B.pad(B.abs(x), k * size - B.numel(x)), (k, size))
    return B.max(rows, axis=1)


def block_absmax_finite(B, x, counts):
    """``(max |x| per block of counts, all finite)``: the blocks' maxima are
    :func:`block_absmax`'s wherever every element is finite (the only case they are used
    in). Fused primitive ``block_absmax_finite``: one pass, as :func:`absmax_finite`."""
    fast = B.kernel("block_absmax_finite", x)
    if fast is not None:
        m, ok = fast(x, counts[0])
        return m, B.full(1, ok, "bool")
    return block_absmax(B, x, counts), B.all_finite(x)


def local_scale_stat(B, x, norm, counts=None):
    """This rank's share of the global scale, one per block of ``counts`` (shape (1,) for
    the whole buffer, when ``None``): ``max|x|`` (float32; ``+inf`` in every block when
    ``x`` holds inf or NaN) or ``||x||^2`` (float64: it cannot overflow, since every
    float32 squared fits in float64 many times over)."""
    counts = counts or [B.numel(x)]
    if norm == "l2":
        return compensate_sums(B, x, None, counts, squares=True)
    m, ok = absmax_finite(B, x) if len(counts) == 1 else block_absmax_finite(B, x, counts)
    return B.where(ok, m, B.full(1, float("inf")))


def finish_scale(B, reduced, norm):
    """``(scale, pre)`` from the reduced statistic: the float32 global scale, raised to at
    least ``FLOAT32_TINY``, and the power of two ``pre`` the input is multiplied by
    before it is divided by the scale.

    ``pre`` is 1 except when an l2 norm exceeds ``2**126`` (inputs near the float32
    maximum): then both the norm and the input are scaled by ``2**-64``, exactly, so the
    scale stays a float32 and ``x * pre / scale`` is the same ratio. Elements below
    ``2**-85`` then flush to zero: less than ``2**-211`` of the scale.
    """
    if norm == "max":
        scale, pre = B.cast(reduced, "float32"), B.full(B.numel(reduced), 1.0)
    else:
        norm64 = B.sqrt(reduced) * L2_SCALE_MARGIN
        huge = B.greater_equal(norm64, B.full(1, 2.0 ** 126, "float64"))
        pre = B.where(huge, B.full(1, RESCALE), B.full(1, 1.0))
        scale = B.cast(norm64 * B.cast(pre, "float64"), "float32")
    tiny = B.full(1, FLOAT32_TINY)
    return B.where(B.less(scale, tiny), tiny, scale), pre


def global_scale(B, comm, x, norm, name, counts=None):
    """One small collective -> ``(scale, pre, finite)``, one value per block of ``counts``
    (one for the whole buffer when ``None``).

    ``max``: an allreduce-max of ``max|x|`` (exact in any order). ``l2``: an allgather of
    every rank's float64 ``||x||^2``, summed in rank order so every rank has the same
    grid. A rank whose input holds inf or NaN contributes ``+inf`` (max) or a non-finite
    sum (l2), so ``finite`` is False on every rank at once, with no collective of its own.
    """
    stat = local_scale_stat(B, x, norm, counts)
    reduced = comm.allreduce(stat, "max", name) if norm == "max" else identical_sum(B, comm, stat, name)
    scale, pre = finish_scale(B, reduced, norm)
    return scale, pre, B.all_finite(reduced)


def normalise(B, x, scale):
    """``x / scale`` clamped to [-1, 1]: exact arithmetic never clamps, but the clamp keeps
    the overflow proofs true even under a division that is not correctly rounded."""
    return B.clip(x / scale, -1.0, 1.0)


def stochastic_round(B, v, u):
    """``floor(v) + [u < frac(v)]``: unbiased, and never beyond ``ceil(|v|)`` in size
    (``floor(v + u)`` could round ``s + u`` up to ``s + 1`` in float32)."""
    low = B.floor(v)
    return low + B.cast(B.less(u, v - low), "float32")


def linear_quantize(B, x, scale, levels, u, dtype="int32"):
    """Integer levels ``q`` (in ``dtype``) with ``E q = levels * x / scale``, ``|q| <= levels``.

    Parameters
    ----------
    B : Backend
    x : float32 tensor
    scale : float32 tensor of shape (1,)
        Global scale (>= max|x|), e.g. from :func:`global_scale`.
    levels : int
    u : float32 tensor like ``x``
        Uniform samples on [0, 1), e.g. ``B.uniform(rng, B.numel(x))``.
    dtype : str
        Integer dtype of the result.
    """
    v = normalise(B, x, scale) * float(levels)
    return B.cast(stochastic_round(B, v, u), dtype)


def linear_dequantize(B, q_sum, scale, levels, count):
    """Mean estimate ``q_sum * scale / (levels * count)`` from the integer sum of
    ``count`` ranks' levels (float32)."""
    return B.cast(q_sum, "float32") * B.divide(scale, float(levels * count))


def blockwise(B, x, scale, pre, counts):
    """``(x, scale, pre)`` for the one-scale quantizer. With several blocks (``counts``;
    ``scale`` and ``pre`` hold one value per block, ``pre`` may be ``None`` for all ones):
    ``x * pre / scale`` block by block, on a grid of 1 (``(v * 1) / 1`` is ``v`` exactly,
    so the levels are the bits of the per-element formula). With one block, unchanged."""
    if len(counts) == 1:
        return x, scale, B.full(1, 1.0) if pre is None else pre
    one = B.full(1, 1.0)
    if pre is None:  # x * 1 is x: the max norm's pre, always 1, costs no pass
        return by_blocks(B, x, counts, lambda v, s: v / s, scale), one, one
    return by_blocks(B, x, counts, lambda v, p, s: (v * p) / s, pre, scale), one, one


def quantize(B, comm, x, scale, pre, levels, width, rng=None, key=None, first=0):
    """The wire tensor of ``x``'s levels: ``width``-bit integers, native when ``comm``
    sums ``int{width}``, else packed into int32 lanes (offset on rank 0 only).

    One pass with the fused primitives ``quantize_ints`` / ``quantize_lanes``; the
    generic path is :func:`linear_quantize` then :func:`~hvd_quant.core.packing.pack_lanes`,
    with the same random draws: one call of ``rng``, or the call ``key`` given, whose
    draws ``first ..`` quantize ``x`` (a chunk of a larger buffer starting at element
    ``first``, a multiple of the lanes per word: see :mod:`hvd_quant.core.pipeline`).
    """
    native = f"int{width}" in comm.allreduce_int_dtypes
    key = rng.next_key(B) if key is None else key
    fast = B.kernel("quantize_ints" if native else "quantize_lanes", x)
    if fast is not None:
        if native:
            return fast(x, B.kernel_scalar(pre), B.kernel_scalar(scale), levels, key, f"int{width}", first)
        return fast(x, B.kernel_scalar(pre), B.kernel_scalar(scale), levels, key, width, comm.rank == 0, first)
    u = uniform_from_bits(B, hash_bits(B, key, B.numel(x), offset=first))
    q = linear_quantize(B, x * pre, scale, levels, u, f"int{width}" if native else "int32")
    return q if native else pack_lanes(B, q, width, add_offset=comm.rank == 0)


def block_kernel(B, comm, name, width, block, counts, tensor):
    """The fused primitive ``name`` (``"quantize"`` or ``"dequantize"``) with a scale per
    block, ``{name}_ints_blocks`` or ``{name}_lanes_blocks``, for a piece of ``counts``
    blocks of ``block`` elements, or ``None``: for one block (the one-scale primitives
    serve it), for ``block=None`` (a caller that asks for the unfused path), where the
    backend has none, and for lanes, where the blocks do not fill whole int32 words (a
    block that is not a multiple of ``32 // width`` elements)."""
    native = f"int{width}" in comm.allreduce_int_dtypes
    if len(counts) == 1 or block is None or not (native or block % (32 // width) == 0):
        return None
    return B.kernel(f"{name}_{'ints' if native else 'lanes'}_blocks", tensor)


def quantize_blocks(B, comm, x, scale, pre, counts, block, levels, width, rng=None, key=None, first=0):
    """:func:`quantize` with a scale and a ``pre`` per block of ``block`` elements of the
    whole buffer (``x`` is elements ``first ..`` of it, ``counts`` its blocks' elements in
    it, ``scale`` and ``pre`` their values; ``pre`` may be ``None`` for all ones). The
    fused primitives ``quantize_ints_blocks`` / ``quantize_lanes_blocks`` divide and round
    in one pass; otherwise :func:`blockwise` divides first, then :func:`quantize` rounds on
    a grid of 1. The same bits: ``(x * 1) / s`` is ``x / s``, and ``(v * 1) / 1`` is ``v``."""
    fast = block_kernel(B, comm, "quantize", width, block, counts, x)
    if fast is None:
        return quantize(B, comm, *blockwise(B, x, scale, pre, counts), levels, width, rng, key, first)
    key = rng.next_key(B) if key is None else key
    pre = B.full(len(counts), 1.0) if pre is None else pre
    if f"int{width}" in comm.allreduce_int_dtypes:
        return fast(x, pre, scale, block, levels, key, f"int{width}", first)
    return fast(x, pre, scale, block, levels, key, width, comm.rank == 0, first)


def dequantize(B, comm, total, numel, scale, pre, levels, width, into=None, counts=None, block=None, first=0):
    """The mean estimate from the allreduced wire tensor of :func:`quantize` (fused
    primitives ``dequantize_ints`` / ``dequantize_lanes``, which write into ``into`` when
    given). With ``pre != 1`` the result is scaled back and saturates at the float32
    maximum instead of overflowing. With several blocks (``counts`` of ``block`` elements,
    the piece starting at element ``first`` of the buffer; ``scale`` and ``pre`` hold one
    value per block) each block's levels are multiplied by its own factor: in one pass by
    ``dequantize_ints_blocks`` / ``dequantize_lanes_blocks``, else read as floats (a factor
    of 1, exact), then multiplied. The per-element formula's bits either way."""
    counts = counts or [numel]
    native = f"int{width}" in comm.allreduce_int_dtypes
    factor = B.divide(scale, float(levels * comm.size))
    fused_blocks = block_kernel(B, comm, "dequantize", width, block, counts, total)
    if fused_blocks is not None:
        out = (fused_blocks(total, factor, block, first, out=into) if native
               else fused_blocks(total, numel, width, factor, block, first, out=into))
    else:
        blocks = len(counts) > 1
        unit, into = (B.full(1, 1.0), None) if blocks else (factor, into)
        fast = B.kernel("dequantize_ints" if native else "dequantize_lanes", total)
        if fast is not None:
            out = (fast(total, B.kernel_scalar(unit), out=into) if native
                   else fast(total, numel, width, B.kernel_scalar(unit), out=into))
        else:
            q = total if native else unpack_lanes(B, total, numel, width)
            out = B.cast(q, "float32") * unit
        if blocks:
            out = by_blocks(B, out, counts, lambda v, f: v * f, factor)
    return B.cond(rescaled(B, pre), lambda: scaled_back(B, out, pre, counts), lambda: out)


def scaled_back(B, out, pre, counts):
    """``out / pre`` block by block, saturated at the float32 maximum: the result of inputs
    rescaled near it. ``pre`` is 1 or ``RESCALE`` (:func:`finish_scale`), so ``out`` is
    multiplied by 1 or ``1 / RESCALE``, picked, not computed: inside ``tf.function``
    TensorFlow turns ``1.0 / pre`` into a vectorized reciprocal that is not exact (it was
    one ulp off for ``2**-64``)."""
    inverse = B.where(B.less(pre, B.full(1, 1.0)), B.full(1, 1.0 / RESCALE), B.full(1, 1.0))
    return by_blocks(B, out, counts, lambda v, r: B.clip(v * r, -FLOAT32_MAX, FLOAT32_MAX), inverse)


def rescaled(B, pres):
    """Whether any ``pre`` is below 1 (a scale rescaled near the float32 maximum), as a
    1-element boolean: ``max(-pre) > -1``."""
    return B.less(B.full(1, -1.0), B.reshape(B.max(pres * -1.0), (1,)))


def sum_levels(B, comm, wire, payload_bytes, name):
    """Every rank's wire tensor of levels summed over the ranks, identical on every rank.

    Horovod's allreduce, except from 5 ranks on for a small wire
    (:func:`~hvd_quant.core.ring.gathers`): one allgather, the ``n`` rows added in rank
    order. The level rule bounds every partial sum over any ranks in any order, so the
    integers, hence the bits, are the same either way; only the collective differs. At 16
    emulated ranks at 100 Mbit/s an allreduce of 16 KB took 109 ms (Gloo's ring: ``2 (n -
    1)`` dependent steps of 1 KB) and an allgather of 16 KB per rank 34 ms
    (docs/benchmarks/scaling.md).
    """
    if gathers(comm.size, payload_bytes):
        return rank_order_sum(B, comm.allgather(wire, name), comm.size)
    return comm.allreduce(wire, "sum", name)


def int_payload_bytes(numel, width, int_dtypes):
    """Bytes of the integer tensor allreduced for ``numel`` values of ``width`` bits."""
    if f"int{width}" in int_dtypes:
        return numel * width // 8
    return 4 * packed_lane_words(numel, width)


class GlobalQSGDCompressor(Compressor):
    """Global-QSGD with linear dithering (stateless, unbiased, no error feedback).

    Parameters
    ----------
    norm : {"max", "l2"}
        Global scale: max-abs over all ranks (reference code) or the l2 norm of the
        concatenation of all ranks' buffers (more levels for the same width).
    bits : {None, 8, 16}
        Width of the summed integers; ``None`` picks the narrowest safe one.
    levels : int or None
        Levels per sign; ``None`` takes the most that are safe for the world size.
    block : int or None
        Elements per shared scale: one scale per block of ``block`` consecutive elements of
        the fused buffer (512 by default, as QSGD's experiments bucket the gradient), each
        still shared by every rank, so the integers are still summed by one allreduce; or
        ``None`` for one scale per fused buffer, as the paper's reference code (the default
        until 2026-12-06). Module docstring, "Blocks".

    Raises
    ------
    ValueError
        For unknown options, and (from :meth:`validate` / :meth:`reduce`) when the
        requested width and levels could overflow for the world size.
    """

    name = "global_qsgd"
    chunkable = True

    def __init__(self, norm="max", bits=None, levels=None, block=512):
        if norm not in NORMS:
            raise ValueError(f"global_qsgd: norm must be one of {NORMS}, got {norm!r}")
        if bits is not None and bits not in WIDTHS:
            raise ValueError(f"global_qsgd: bits must be None, 8 or 16, got {bits!r}")
        if levels is not None and (isinstance(levels, bool) or not isinstance(levels, int)
                                   or levels < 1):
            raise ValueError(f"global_qsgd: levels must be None or an int >= 1, got {levels!r}")
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            raise ValueError(f"global_qsgd: block must be None or an int >= 1, got {block!r}")
        self.norm, self.bits, self.levels, self.block = norm, bits, levels, block

    def options(self):
        return {"norm": self.norm, "bits": self.bits, "levels": self.levels, "block": self.block}

    def _pre(self, pre):
        """``pre`` for :func:`blockwise`: ``None`` for the max norm, whose ``pre`` is 1."""
        return None if self.norm == "max" else pre

    def blocks(self, numel):
        """How many shared scales a buffer of ``numel`` elements takes
        (:func:`~hvd_quant.core.segments.block_counts`)."""
        return len(block_counts(numel, self.block))

    def resolve(self, world_size):
        """``(width, levels)`` used with ``world_size`` ranks."""
        return resolve_width_levels(self.norm, world_size, self.bits, self.levels)

    def validate(self, world_size):
        self.resolve(world_size)

    def reduce(self, x, ctx):
        B, comm = ctx.backend, ctx.comm
        d = B.numel(x)
        width, levels = self.resolve(comm.size)
        counts = block_counts(d, self.block)
        # Phase 1: the global scale, one per block (one small collective; it also says
        # whether any rank's input holds inf or NaN).
        scale, pre, finite = global_scale(B, comm, x, self.norm, ctx.collective_name("scale"), counts)
        ctx.sent_scales(scale / pre)  # the norm itself where it was rescaled (pre < 1)
        # Phase 2: stochastic rounding onto the shared grid; zeros on a non-finite step,
        # so no NaN is ever turned into an in-range integer (quantized on a grid of 1:
        # the shared scale itself may be NaN then, and 0 / NaN is NaN).
        one = B.full(1, 1.0)
        wire = B.cond(finite, lambda: quantize_blocks(B, comm, x, scale, self._pre(pre), counts, self.block,
                                                      levels, width, ctx.rng),
                      lambda: quantize(B, comm, B.zeros(d), one, one, levels, width, ctx.rng))
        # Phase 3: the integers summed over the ranks (an allreduce, or for a small wire at
        # many ranks an allgather summed here: sum_levels); every rank decodes the same sum.
        payload = int_payload_bytes(d, width, comm.allreduce_int_dtypes)
        total = sum_levels(B, comm, wire, payload, ctx.collective_name("levels"))
        return B.cond(finite, lambda: dequantize(B, comm, total, d, scale, pre, levels, width,
                                                 into=ctx.out, counts=counts, block=self.block),
                      lambda: B.full(d, float("nan")))

    def reduce_chunked(self, x, ctx, chunks):
        """:meth:`reduce` with the integer allreduce cut into ``chunks``: quantize chunk
        ``k + 1`` and dequantize chunk ``k - 1`` while chunk ``k``'s sum is on the wire.

        Bit-identical to :meth:`reduce`: the scale collective and the random call's key
        cover the whole buffer, and chunk ``k`` quantizes with the draws of its own
        element indices (chunk bounds are multiples of 8 elements, so of the lanes per
        int32 word), so every level, and the sum, is the same. With blocks, a chunk takes
        the scales of the blocks it overlaps (a block may span two chunks)."""
        B, comm = ctx.backend, ctx.comm
        d = B.numel(x)
        width, levels = self.resolve(comm.size)
        counts = block_counts(d, self.block)
        # Phase 1 over the whole buffer, as unchunked: the scales and the finite verdict.
        scale, pre, finite = global_scale(B, comm, x, self.norm, ctx.collective_name("scale"), counts)
        ctx.sent_scales(scale / pre)  # the norm itself where it was rescaled (pre < 1)
        key = ctx.rng.next_key(B)  # the unchunked method's one call, bad step or not
        if not bool(B.to_numpy(finite)):
            return B.full(d, float("nan"))  # every rank has the same verdict: no chunk is sent
        # Phases 2-3, chunk by chunk: quantize, sum, dequantize. Chunks are dequantized
        # straight into ctx.out when the fused kernels write there (one scale, or blocks
        # with their fused kernel) and no rescaling follows (no pre < 1, i.e. nothing near
        # the float32 maximum).
        native = f"int{width}" in comm.allreduce_int_dtypes
        fused = (B.kernel("dequantize_ints" if native else "dequantize_lanes", x) is not None
                 and (len(counts) == 1 or block_kernel(B, comm, "dequantize", width, self.block, counts, x)
                      is not None))
        out = ctx.out if (ctx.out is not None and fused and not bool(B.to_numpy(rescaled(B, pre)))) else None
        pieces = []

        def chunk_scales(a, b):  # the chunk's blocks: their counts within it, scales, pres
            first, sub = chunk_blocks(d, self.block, a, b)
            return sub, B.slice(scale, first, first + len(sub)), B.slice(pre, first, first + len(sub))

        def start(k):
            a, b = chunks[k]
            sub, s, p = chunk_scales(a, b)
            wire = quantize_blocks(B, comm, B.slice(x, a, b), s, self._pre(p), sub, self.block, levels, width,
                                   key=key, first=a)
            return start_allreduce(comm, wire, "sum", ctx.collective_name(f"levels.c{k}"))

        def finish(k, handle):
            a, b = chunks[k]
            sub, s, p = chunk_scales(a, b)
            into = B.slice(out, a, b) if out is not None else None
            piece = dequantize(B, comm, handle.wait(), b - a, s, p, levels, width, into=into, counts=sub,
                               block=self.block, first=a)
            if out is None:  # otherwise the piece is already in place
                pieces.append(piece)

        pipelined(len(chunks), start, finish)
        return out if out is not None else B.concat(pieces)

    def wire_bytes(self, numel, world_size, segments=1, int_dtypes=("int32", "int64")):
        """Bytes sent per rank: the integers by allreduce (by allgather for a small wire
        from 5 ranks on: :func:`sum_levels`), plus the fp32 scale (allreduce for ``max``,
        allgather for ``l2``, see :func:`global_scale`).

        ``int_dtypes`` are the integer dtypes the communicator sums natively; the default
        (torch's Horovod) means lane-packed int32 words.
        """
        width, _ = self.resolve(world_size)
        ring = 2.0 * (world_size - 1) / world_size
        scale = ring * 4 if self.norm == "max" else (world_size - 1) * 8.0  # float64 l2 sum
        scale *= self.blocks(numel)
        payload = int_payload_bytes(numel, width, int_dtypes)
        levels = (world_size - 1) * payload if gathers(world_size, payload) else ring * payload
        return levels + scale if world_size > 1 else 0.0

    def collectives(self, numel, world_size, ranks_per_node=None, segments=1, rank=0):
        """The scales (:func:`global_scale`, one per block), then the levels
        (:func:`sum_levels`), as lane-packed int32 words (torch's Horovod)."""
        n, k = world_size, float(self.blocks(numel))
        width, _ = self.resolve(n)
        scale = (Collective("allreduce", 4.0 * k, n) if self.norm == "max"
                 else Collective("allgather", 8.0 * k, n))
        payload = float(int_payload_bytes(numel, width, ("int32", "int64")))
        return [scale, Collective("allgather" if gathers(n, payload) else "allreduce", payload, n)]

    def memory_bytes(self, numel, world_size, ranks_per_node=None, segments=1):
        """:func:`~hvd_quant.core.costmodel.level_memory_bytes`: the fused kernels take a
        scale per block in the same passes as one scale (``block_absmax_finite``,
        ``quantize_*_blocks``, ``dequantize_*_blocks``). Where lane-packed blocks would
        split a word (``block`` not a multiple of ``32 // width``), the generic path divides
        the input by its blocks' scales (read and written, ``2F``; for ``l2`` also
        multiplied by their ``pre``, ``2F`` more) and multiplies the decoded sum by their
        factors (``2F``); the blocks' maxima stay fused."""
        F = 4.0 * float(numel)
        width, _ = self.resolve(world_size)
        split = self.blocks(numel) > 1 and self.block % (32 // width) != 0
        extra = 4.0 * F if self.norm == "max" else 6.0 * F
        return level_memory_bytes(numel, world_size) + (extra if split else 0.0)
