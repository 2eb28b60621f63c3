"""Per-parameter (per-segment) scalars over a fused flat buffer.

A fused buffer concatenates several parameters' gradients (its *segments*); sign
compressors keep one scale per segment so that layers of different magnitude do not
share one. The scales' sums and the sign bits come from one pass over the buffer
(:func:`compensate_sums_signs`), so the sign packer is here too (:func:`pack_signs`);
:mod:`hvd_quant.core.packing` builds on this module and never the other way round.
"""

import numpy as np


def segment_bounds(counts):
    """int64 numpy array of segment offsets: ``[0, c0, c0 + c1, ..., sum(counts)]``."""
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)


def chunk_segments(counts, a, b):
    """``(segment indices, counts within [a, b))`` of the non-empty segments overlapping
    the element range ``[a, b)`` (a chunk of the buffer: the scales it decodes with)."""
    bounds = segment_bounds(counts)
    idx, sub = [], []
    for s in range(len(counts)):
        lo, hi = max(a, int(bounds[s])), min(b, int(bounds[s + 1]))
        if hi > lo:
            idx.append(s)
            sub.append(hi - lo)
    return idx, sub


def block_counts(numel, block):
    """The sizes of a buffer's blocks that each take a scale of their own: the whole buffer
    for ``block=None``, else ``block`` elements each, the last one shorter (one empty block
    for an empty buffer)."""
    numel = int(numel)
    if block is None or numel <= block:
        return [numel]
    return [block] * (numel // block) + ([numel % block] if numel % block else [])


def chunk_blocks(numel, block, a, b):
    """``(first block, counts within [a, b))`` of the blocks of :func:`block_counts`
    overlapping the element range ``[a, b)``: :func:`chunk_segments` for equal blocks,
    without a pass over every block of the buffer for every chunk."""
    size = int(numel) if block is None or numel <= block else block
    if b <= a:
        return 0, [0]
    first, stop = a // size, -(-b // size)
    return first, [min(b, (j + 1) * size) - max(a, j * size) for j in range(first, stop)]


def compensate_sums(B, x, e, counts, squares=False):
    """Per segment, the float64 sum of ``|p|`` (or of ``p**2`` with ``squares=True``),
    where ``p = x + e`` (``e`` may be ``None``: then ``p`` is ``x``).

    The sums accumulate in float64, so a scale computed from them neither overflows for
    values near the float32 maximum nor loses digits on large buffers. A non-finite
    element makes its segment's sum non-finite, which is how the sign methods learn of
    inf and NaN without a pass of their own. Fused primitive ``compensate_sums``.
    """
    fast = B.kernel("compensate_sums", x, e)
    if fast is not None:
        return fast(x, e, segment_bounds(counts), squares=squares)
    p = x if e is None else x + e  # the fast path never stores p (see sign_pack_residual)
    sums, offset = [], 0
    for n in counts:
        part = B.cast(B.slice(p, offset, offset + n), "float64")
        sums.append(B.reshape(B.sum(part * part if squares else B.abs(part)), (1,)))
        offset += n
    return B.concat(sums) if sums else B.zeros(0, "float64")


def compensate_sums_signs(B, x, e, counts, squares=False):
    """:func:`compensate_sums` and the packed sign bits of ``p = x + e`` (as
    :func:`hvd_quant.core.packing.pack_signs`), in one pass over ``x`` and ``e`` on the
    fast path (fused primitive ``compensate_sums_signs``; the same sums, bit for bit).
    The bits do not depend on the scale, so they can be sent while the residual is
    computed."""
    fast = B.kernel("compensate_sums_signs", x, e)
    if fast is not None:
        return fast(x, e, segment_bounds(counts), squares=squares)
    return compensate_sums(B, x, e, counts, squares), pack_signs(B, x if e is None else x + e)


def pack_signs(B, x):
    """Sign bits of the float tensor ``x`` (1 for ``x >= 0``), packed 8 per byte, least
    significant bit first (the layout of :mod:`hvd_quant.core.packing`, which also
    exports this function). Fused primitive ``sign_pack``."""
    fast = B.kernel("sign_pack", x)
    if fast is not None:
        return fast(x)
    d = B.numel(x)
    bits = B.cast(B.greater_equal(x, B.zeros(1)), "uint8")
    return B.packbits(B.pad(bits, (-d) % 8))


def segment_means(B, sums, counts):
    """float32 ``sums[s] / counts[s]`` (0 for empty segments)."""
    sizes = np.maximum(np.asarray(counts, np.float64), 1.0)
    return B.cast(B.divide(sums, sizes), "float32")


def expand_segments(B, per_segment, counts):
    """Each segment's value repeated over its elements; with one segment it stays a
    1-element tensor that broadcasts, saving a pass over the buffer."""
    return per_segment if len(counts) == 1 else B.repeat(per_segment, counts)


def by_blocks(B, x, counts, fn, *per_block):
    """``fn(x, *values)`` with each of ``per_block`` (one value per block of ``counts``)
    standing for its value repeated over its block's elements.

    For the blocks of :func:`block_counts` (equal, the last perhaps shorter) ``x`` is padded
    to whole blocks and viewed as rows, one per block, and each value is a column that
    broadcasts over its row: no per-element copy of the values, which
    :func:`expand_segments` makes (a torch ``repeat_interleave`` of a value per 512
    elements of a 7.37M-element buffer costs more than the quantizer's pass). Other
    layouts (a chunk that starts inside a block) take :func:`expand_segments`. The same
    element-wise arithmetic either way, so the same bits."""
    k, size, d = len(counts), counts[0], B.numel(x)
    if k == 1 or any(c != size for c in counts[:-1]) or counts[-1] > size:
        return fn(x, *(expand_segments(B, v, counts) for v in per_block))
    rows = B.reshape(B.pad(x, k * size - d), (k, size))
    out = fn(rows, *(B.reshape(v, (k, 1)) for v in per_block))
    return B.slice(B.reshape(out, (-1,)), 0, d)
