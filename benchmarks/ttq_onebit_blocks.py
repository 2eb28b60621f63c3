"""Diagnosis for issue 51 (not a method): importing this module makes the 1-bit
optimizers' ``scales="tensor"`` take one scale per block of ``TTQ_ONEBIT_BLOCK``
consecutive elements of each tensor (default 256: one row of the time-to-quality model's
tied embedding and of its ``d_model``-input matrices) instead of one per tensor.

    ttq_worker.py --method onebit_adam --import ttq_onebit_blocks ...

It replaces the tensor sizes the two-stage compressed allreduce keeps apart
(:func:`hvd_quant.optimizers.base.compressed_counts`, as the rules read it), so the error
buffers, the padding and the scales all follow; one more float32 scale per block travels in
each of the allreduce's two collectives.
"""

import os

from hvd_quant.optimizers import compressed_rounds
from hvd_quant.optimizers.base import tensor_sizes

BLOCK = int(os.environ.get("TTQ_ONEBIT_BLOCK", "256"))


def blocked_counts(scales, counts):
    sizes = tensor_sizes(counts)
    if scales != "tensor":
        return [sum(sizes)]
    return [min(BLOCK, c - start) for c in sizes for start in range(0, c, BLOCK)]


compressed_rounds.compressed_counts = blocked_counts
