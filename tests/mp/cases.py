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
    ("marsit_gather", "marsit", {"topology": "gather"}),  # auto's layout from 5 ranks, small buffers
    ("cascading_sign", "cascading_sign", {}),
    ("cascading_gather", "cascading_sign", {"topology": "gather"}),  # auto's from 5 ranks: shipped tie-breaks
    ("global_qsgd", "global_qsgd", {}),
    ("global_qsgd_l2", "global_qsgd", {"norm": "l2"}),
    ("global_qsgd_exp", "global_qsgd_exp", {}),
    ("qsgd", "qsgd", {}),  # allgather of per-rank levels and scales, decoded in rank order
    ("onebit", "onebit", {}),
    ("onebit_gather", "onebit", {"layout": "gather"}),   # likewise
]
# cascading_gather draws from each rank's seeded stream, the oracle's too: the same bits.
# qsgd likewise: each rank's draws and its own norm, decoded in rank order (no sum by Horovod).
DETERMINISTIC = {"none", "fp16", "ef_sign", "onebit", "onebit_gather", "marsit_gather", "cascading_gather",
                 "qsgd"}


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


# Worst cases for Global-QSGD run under Horovod: every rank at the maximum (where the
# reference code's 127/n levels wrap int8), all zeros, one non-zero element on one rank.
EXACT_COMPRESSORS = [("global_qsgd", {}), ("global_qsgd", {"norm": "l2"}), ("global_qsgd_exp", {})]
M = np.float32(0.75)


def exact_input(case, rank, size):
    if case == "at_max":
        return np.array([M, -M, M, 0, -M], np.float32)
    x = np.zeros(5, np.float32)
    if case == "single" and rank == size - 1:
        x[3] = -2.5
    return x


def run_exact_cases(reduce, to_numpy):
    """``{"name/norm/case": list}`` of ``reduce(name, options, numpy_input)`` results."""
    out = {}
    for name, options in EXACT_COMPRESSORS:
        for case in ("at_max", "zeros", "single"):
            key = f"{name}/{options.get('norm', 'max')}/{case}"
            out[key] = to_numpy(reduce(name, options, case)).astype(np.float64).tolist()
    return out
