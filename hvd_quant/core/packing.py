"""Wire formats, written once against :class:`~hvd_quant.core.backend.Backend`.

Sign bits
    One bit per element, 8 per byte, least significant bit first. Bit 1 means the element
    is ``>= 0`` (so zero travels as ``+1``, as in 1-bit Adam's compressed allreduce).
    ``ceil(d / 8)`` bytes for ``d`` elements.

Integer lanes
    Horovod's torch allreduce has no int8 or int16 (horovod issue #3661), so small signed
    integers are packed into int32 words, ``32 // width`` lanes per word, such that the
    word-wise *sum* over ranks decodes to the lane-wise sums, exactly:

    * every lane holds the signed value ``v``; the word is ``sum_j v_j * 2**(width*j)``;
    * exactly one rank (``add_offset=True``) also adds ``2**(width-1)`` to every lane but
      the top one, so each lower lane of the *final* sum lies in ``[0, 2**width)`` and is
      read back with a mask, while the top lane stays signed and is read back with an
      arithmetic shift. Borrows between lanes in partial sums cancel out, because the sum
      is linear.

    Exact whenever ``|sum over ranks of v| <= 2**(width-1) - 1`` for every lane and for
    every subset of ranks (partial sums), which is the condition under which a native
    signed ``width``-bit sum cannot overflow either. Partial sums then also stay inside
    int32, so no rank ever relies on integer wrap-around.
"""

import math

import numpy as np

# pack_signs lives in segments, beside compensate_sums_signs, which packs the same bits
# in its pass over the buffer; it is this module's public name as well.
from .segments import compensate_sums_signs, expand_segments, pack_signs, segment_bounds  # noqa: F401


def packed_sign_bytes(numel):
    """Bytes used by :func:`pack_signs` for ``numel`` elements."""
    return (numel + 7) // 8


def sign_pack_residual(B, x, e, scales, counts, out=None):
    """With ``p = x + e`` (``e`` may be ``None``), the packed sign bits of ``p`` and the
    error-feedback residual ``p - scale * sign(p)``, one float32 scale per segment
    (``counts`` elements each). Fused primitive ``sign_pack_residual``: one pass, where
    the generic path makes several.

    ``out`` (typically ``e``, the state buffer) may receive the residual in place on the
    fast path; callers must use the returned residual either way.
    """
    fast = B.kernel("sign_pack_residual", x, e, scales)
    if fast is not None:
        return fast(x, e, scales, segment_bounds(counts), out=out)
    p = x if e is None else x + e
    scale = expand_segments(B, scales, counts)
    return pack_signs(B, p), p - B.where(B.greater_equal(p, B.zeros(1)), scale, -scale)


def sign_residual(B, x, e, scales, counts, out=None):
    """The error-feedback residual ``p - scale * sign(p)`` of ``p = x + e`` alone, for a
    method whose bits were packed by :func:`~hvd_quant.core.segments.compensate_sums_signs`
    (so they could go on the wire before this pass). Fused primitive ``sign_residual``;
    ``out`` (typically ``e``) may receive it in place on the fast path."""
    fast = B.kernel("sign_residual", x, e, scales)
    if fast is not None:
        return fast(x, e, scales, segment_bounds(counts), out=out)
    p = x if e is None else x + e
    scale = expand_segments(B, scales, counts)
    return p - B.where(B.greater_equal(p, B.zeros(1)), scale, -scale)


# Row b holds the 8 signs (+1/-1, least significant bit first) of the byte value b.
SIGN_TABLE = np.where((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1, 1.0, -1.0).astype(np.float32)


def unpack_signs(B, packed, numel):
    """Packed sign bits back to float32 ``+1`` / ``-1`` of length ``numel``.

    One table lookup per byte gives its 8 signs, so decoding is a single pass (no
    shift, mask and cast passes over ``8 * len(packed)`` elements)."""
    return B.slice(B.reshape(B.lookup(SIGN_TABLE, packed), (-1,)), 0, numel)


def unpack_scaled_sum(B, packed, scales, counts, numel, base=None, out=None, base_scales=None):
    """``sum_r scales[r, seg(i)] * sign_r(i)`` over the ``R`` rows of packed sign bits.

    Parameters
    ----------
    packed : uint8 tensor of ``R * ceil(numel / 8)`` bytes (e.g. an allgather of packed signs)
    scales : float32 tensor of ``R * len(counts)`` scales, row-major
    counts : list of int
        Segment sizes (summing to ``numel``).
    base : float32 tensor of ``numel`` elements or None
        Added after the sum (a server-side residual, say).
    base_scales : float32 tensor of ``len(counts)`` scales or None
        With ``base``: add the residual ``base - where(base >= 0, scale, -scale)`` of
        ``base``'s segments instead (as :func:`sign_pack_residual` computes it, the same
        floats), so that a state kept as compensated values and their scale is folded
        in without a pass that writes the residual (onebit's server stage).
    out : float32 tensor of ``numel`` elements or None
        Written with the result on the fast path (no fresh buffer); it may be ``base``
        itself. The generic path ignores it. Use the returned tensor either way.

    Notes
    -----
    The rows are summed in row order in float32, so every rank that decodes the same
    rows gets bit-identical results. Fused primitive ``unpack_scaled_sum``.
    """
    nbytes, nseg = packed_sign_bytes(numel), len(counts)
    rows = B.numel(packed) // nbytes if nbytes else 0
    fast = B.kernel("unpack_scaled_sum", packed, scales)
    if fast is not None:
        return fast(packed, scales, segment_bounds(counts), numel, base=base, out=out,
                    base_scales=base_scales)
    total = None
    for r in range(rows):
        signs = unpack_signs(B, B.slice(packed, r * nbytes, (r + 1) * nbytes), numel)
        part = expand_segments(B, B.slice(scales, r * nseg, (r + 1) * nseg), counts) * signs
        total = part if total is None else total + part
    if total is None:
        total = B.zeros(numel)
    if base is not None and base_scales is not None:
        base = sign_residual(B, base, None, base_scales, counts)
    return total if base is None else total + base


def unpack_sums_signs(B, packed, scales, counts, numel, base=None, base_scales=None, out=None,
                      squares=False):
    """:func:`unpack_scaled_sum` (arguments as there), then the segments' float64 sums
    and the packed sign bits of the result (:func:`~hvd_quant.core.segments.
    compensate_sums_signs` with no ``e``): ``(sum, sums, bits)``.

    For a stage that decodes its compensated values and then re-signs them at once:
    onebit's server (:mod:`hvd_quant.core.compressed_allreduce`). The fast path sums and signs each
    block while it is still in the cache from its decode, one pass over memory instead of
    a write and a read-back; the same floats, sums and bits as the two calls. Fused
    primitive ``unpack_sums_signs``; ``out`` may be ``base``.
    """
    fast = B.kernel("unpack_sums_signs", packed, scales, base)
    if fast is not None:
        return fast(packed, scales, segment_bounds(counts), numel, base=base,
                    base_scales=base_scales, out=out, squares=squares)
    total = unpack_scaled_sum(B, packed, scales, counts, numel, base=base, out=out,
                              base_scales=base_scales)
    return (total,) + tuple(compensate_sums_signs(B, total, None, counts, squares=squares))


def unpack_sum_residual(B, packed, scales, counts, numel, x, e, own_scales, out=None,
                        resid_out=None):
    """:func:`unpack_scaled_sum` of the rows (no base) and this rank's residual
    :func:`sign_residual` of ``p = x + e`` with its own scales, together.

    For a method that decodes after its bits have arrived and has not written its
    residual yet (ef_sign, marsit, onebit's worker): the fast path does both in one pass
    over memory, which reads ``x`` once instead of twice when the result goes into ``x``
    itself. The same floats as the two calls. Fused primitive ``unpack_sum_residual``;
    ``out`` may be ``x`` and ``resid_out`` may be ``e`` on the fast path. Returns
    ``(sum, residual)``.
    """
    fast = B.kernel("unpack_sum_residual", packed, scales, x, e, own_scales)
    if fast is not None:
        return fast(packed, scales, segment_bounds(counts), numel, x, e, own_scales, out=out,
                    resid_out=resid_out)
    residual = sign_residual(B, x, e, own_scales, counts, out=resid_out)  # reads x: first
    return unpack_scaled_sum(B, packed, scales, counts, numel, out=out), residual


def with_scales(B, rows, k, scales):
    """What one collective carries for sign methods: each of the ``k`` rows of packed
    signs (uint8, ``k x width``) followed by the bytes of the float32 ``scales`` (4 per
    scale, native order), flat.

    The scales ride with the signs instead of in a collective of their own: two
    collectives of different dtypes ran one after the other in Horovod, and the second
    added 1-2 ms to every bucket on the emulated 10 Gbit/s link (profiled 2026-11-26).
    Non-finite scales keep their bits, so a receiver still sees a NaN step."""
    scale_rows = B.reshape(B.concat([float_bytes(B, scales)] * k), (k, -1))
    return B.reshape(B.concat_columns([rows, scale_rows]), (-1,))


def split_scales(B, received, n, width, count):
    """Inverse of :func:`with_scales` for ``n`` rows of ``width`` sign bytes and ``count``
    scales: the signs (flat, row after row) and the scales (flat, ``n`` rows of ``count``)."""
    table = B.reshape(received, (n, width + 4 * count))
    signs = B.reshape(B.slice_columns(table, 0, width), (-1,))
    scales = B.reshape(B.slice_columns(table, width, width + 4 * count), (-1,))
    return signs, bytes_float(B, scales)


def float_bytes(B, x):
    """The bytes of the float32 tensor ``x`` (4 per element, native order) as uint8."""
    return B.reshape(B.bitcast(x, "uint8"), (-1,))


def bytes_float(B, b):
    """Inverse of :func:`float_bytes`."""
    return B.reshape(B.bitcast(B.reshape(b, (-1, 4)), "float32"), (-1,))


def lanes_per_word(width):
    """How many ``width``-bit lanes fit in one int32 word."""
    if width not in (2, 4, 8, 16):
        raise ValueError(f"lane width must be 2, 4, 8 or 16 bits, got {width}")
    return 32 // width


def packed_lane_words(numel, width):
    """int32 words used by :func:`pack_lanes` for ``numel`` values."""
    return math.ceil(numel / lanes_per_word(width))


def pack_lanes(B, values, width, add_offset):
    """Pack signed integers (any int dtype) into int32 words, ``32 // width`` per word.

    ``add_offset`` must be True on exactly one of the ranks whose words are summed (and
    True for a tensor that is unpacked without summing). See the module docstring.
    """
    lanes = lanes_per_word(width)
    d = B.numel(values)
    v = B.reshape(B.pad(B.cast(values, "int32"), (-d) % lanes), (-1, lanes))
    # Multiplication, not shifts: shifting negative numbers left is undefined in some
    # kernels, while these products provably stay inside int32.
    weights = np.array([1 << (width * j) for j in range(lanes)], dtype=np.int64)
    words = B.sum(v * B.reshape(B.constant(weights, "int32"), (1, lanes)), axis=1)
    words = B.cast(words, "int32")
    if add_offset and lanes > 1:
        offset = sum((1 << (width - 1)) << (width * j) for j in range(lanes - 1))
        words = words + B.full(1, offset, "int32")
    return words


def unpack_lanes(B, words, numel, width):
    """Lane values (int32, length ``numel``) of int32 ``words`` packed by
    :func:`pack_lanes`, or of a sum of such words."""
    lanes = lanes_per_word(width)
    words = B.cast(words, "int32")
    mask = B.full(1, (1 << width) - 1, "int32")
    half = B.full(1, 1 << (width - 1), "int32")
    parts = []
    for j in range(lanes - 1):
        lane = B.bitwise_and(B.right_shift(words, B.full(1, width * j, "int32")), mask)
        parts.append(B.reshape(lane - half, (-1, 1)))
    top = B.right_shift(words, B.full(1, width * (lanes - 1), "int32"))  # arithmetic shift
    parts.append(B.reshape(top, (-1, 1)))
    stacked = B.reshape(B.concat_columns(parts), (-1,))
    return B.slice(stacked, 0, numel)
