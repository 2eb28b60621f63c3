"""Wire formats, written once against :class:`~hvd_quant.core.backend.Backend`.

Sign bits
    One bit per element, 8 per byte, least significant bit first. Bit 1 means the element
    is ``>= 0`` (so zero travels as ``+1``, as in 1-bit Adam's compressed allreduce).
    ``ceil(d / 8)`` bytes for ``d`` elements.

Integer lanes
    Horovod's torch allreduce has no int8 or int16 (horovod issue #3661), so small signed
    integers are packed into int32 words, ``32 // width`` lanes per word, such that the
    word-wise *sum* over ``n`` ranks equals the lane-wise sum, exactly, with no carry from
    one lane into the next and no int32 overflow:

    * lanes below the top one hold ``v + bound`` (non-negative), so their sum over ``n``
      ranks is at most ``2 * n * bound``;
    * the top lane holds ``v`` itself, signed, so the word stays inside int32 and the top
      lane's sum is read back by an arithmetic shift.

    Both are safe exactly when ``n * bound <= 2**(width - 1) - 1``, the same condition under
    which a native signed ``width``-bit sum cannot overflow (see :func:`lane_sum_is_safe`).
"""

import math

import numpy as np


def packed_sign_bytes(numel):
    """Bytes used by :func:`pack_signs` for ``numel`` elements."""
    return (numel + 7) // 8


def pack_signs(B, x):
    """Sign bits of the float tensor ``x`` (1 for ``x >= 0``), packed 8 per byte."""
    d = B.numel(x)
    bits = B.cast(B.greater_equal(x, B.zeros(1)), "uint8")
    return B.packbits(B.pad(bits, (-d) % 8))


def unpack_bits(B, packed, numel):
    """The first ``numel`` bits of a packed uint8 tensor, as uint8 0/1."""
    return B.slice(B.unpackbits(packed), 0, numel)


def unpack_signs(B, packed, numel):
    """Packed sign bits back to float32 ``+1`` / ``-1`` of length ``numel``."""
    bits = B.cast(unpack_bits(B, packed, numel), "float32")
    return bits * 2.0 - 1.0


def lanes_per_word(width):
    """How many ``width``-bit lanes fit in one int32 word."""
    if width not in (2, 4, 8, 16):
        raise ValueError(f"lane width must be 2, 4, 8 or 16 bits, got {width}")
    return 32 // width


def lane_sum_is_safe(width, bound, n):
    """True when summing ``n`` lanes holding values in ``[-bound, bound]`` cannot overflow."""
    return n * bound <= 2 ** (width - 1) - 1


def packed_lane_words(numel, width):
    """int32 words used by :func:`pack_lanes` for ``numel`` values."""
    return math.ceil(numel / lanes_per_word(width))


def pack_lanes(B, values, width, bound):
    """Pack integers in ``[-bound, bound]`` (any int dtype) into int32 words.

    See the module docstring for the layout. ``values`` is padded with zeros to a whole
    number of words.
    """
    lanes = lanes_per_word(width)
    d = B.numel(values)
    v = B.reshape(B.pad(B.cast(values, "int32"), (-d) % lanes), (-1, lanes))
    offsets = np.full(lanes, bound, dtype=np.int64)
    offsets[-1] = 0  # the top lane is stored signed
    weights = np.array([1 << (width * j) for j in range(lanes)], dtype=np.int64)
    # Multiplication, not shifts: shifting negative numbers left is undefined in some
    # kernels, while the products below provably stay inside int32.
    shifted = (v + B.reshape(B.constant(offsets, "int32"), (1, lanes))) * B.reshape(
        B.constant(weights, "int32"), (1, lanes))
    return B.cast(B.sum(shifted, axis=1), "int32")


def unpack_lanes(B, words, numel, width, bound, n_summed=1):
    """Lane values of int32 ``words`` that are the sum of ``n_summed`` packed tensors.

    Returns int32 of length ``numel``: the lane-wise sums of the original values.
    """
    lanes = lanes_per_word(width)
    words = B.cast(words, "int32")
    mask = B.full(1, (1 << width) - 1, "int32")
    parts = []
    for j in range(lanes - 1):
        lane = B.bitwise_and(B.right_shift(words, B.full(1, width * j, "int32")), mask)
        parts.append(B.reshape(lane - n_summed * bound, (-1, 1)))
    top = B.right_shift(words, B.full(1, width * (lanes - 1), "int32"))  # arithmetic shift
    parts.append(B.reshape(top, (-1, 1)))
    stacked = B.reshape(B.concat_columns(parts), (-1,))
    return B.slice(stacked, 0, numel)
