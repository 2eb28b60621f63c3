"""Inputs shared by the multi-process worker and the numpy oracle in the tests."""

import numpy as np

SIZES = (0, 1, 7, 1001)
STEPS = 2
# (label, registry name, options)
COMPRESSORS = [
    ("none", "none", {}),
    ("fp16", "fp16", {}),
    ("ef_sign", "ef_sign", {}),
    ("marsit", "marsit", {}),
    ("marsit_nocomp", "marsit", {"compensation": False}),
    ("cascading_sign", "cascading_sign", {}),
    ("global_qsgd", "global_qsgd", {}),
    ("global_qsgd_l2", "global_qsgd", {"norm": "l2"}),
    ("global_qsgd_exp", "global_qsgd_exp", {}),
]
DETERMINISTIC = {"none", "fp16", "ef_sign"}


def rank_input(rank, numel, step):
    rng = np.random.default_rng(1000 * rank + 17 * step + numel)
    return rng.standard_normal(numel).astype(np.float32)


def rank_ints(rank, numel):
    rng = np.random.default_rng(99 + rank)
    return rng.integers(-1000, 1000, numel).astype(np.int32)


def segments(numel):
    """Two named segments (one empty when numel < 2) to exercise per-segment state."""
    first = numel // 3
    return [("layer.a", first), ("layer.b", numel - first)]
