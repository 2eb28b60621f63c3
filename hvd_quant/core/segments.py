"""Per-parameter (per-segment) scalars over a fused flat buffer.

A fused buffer concatenates several parameters' gradients (its *segments*); sign
compressors keep one scale per segment so that layers of different magnitude do not
share one.
"""


def segment_abs_mean(B, x, segments):
    """float32 tensor of ``mean(|x|)`` over each segment (0 for empty segments)."""
    means, offset = [], 0
    for _, n in segments:
        part = B.slice(x, offset, offset + n)
        means.append(B.reshape(B.sum(B.abs(part)) / float(max(n, 1)), (1,)))
        offset += n
    return B.cast(B.concat(means), "float32")


def expand_segments(B, per_segment, counts):
    """Each segment's value repeated over its elements; with one segment it stays a
    1-element tensor that broadcasts, saving a pass over the buffer."""
    return per_segment if len(counts) == 1 else B.repeat(per_segment, counts)
