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


# fp16 sums under Horovod (Gloo or MPI on the CPU): pairs whose sum ties between two fp16
# values (round to nearest even decides), overflows to inf at 65520, or is subnormal,
# then random values over eleven decades. Ranks beyond the second add zeros to the pairs.
FP16_PAIRS = [(1.0, 2.0 ** -11), (1.0 + 2.0 ** -10, 2.0 ** -11), (-1.0 - 2.0 ** -10, -(2.0 ** -11)),
              (2048.0, 1.0), (2049.0 + 1.0, 1.0), (65504.0, 16.0), (65504.0, 8.0), (-65504.0, -16.0),
              (2.0 ** -24, 2.0 ** -24), (2.0 ** -24, -(2.0 ** -24)), (6.1e-05, 2.0 ** -24), (0.1, 0.2)]


def fp16_sum_inputs(size, numel=1000):
    """Every rank's fp16 input for the sum check, ``(size, len(FP16_PAIRS) + numel)``."""
    rng = np.random.default_rng(11)
    rand = rng.standard_normal((size, numel)) * 10.0 ** rng.uniform(-7, 4, (size, numel))
    pairs = np.zeros((size, len(FP16_PAIRS)))
    pairs[:2] = np.array(FP16_PAIRS).T[:size]
    return np.concatenate([pairs, rand], axis=1).astype(np.float16)


def fp16_sums(inputs):
    """The sums an allreduce may return for each element: fp16 additions in any order of the
    ranks (a ring starts each chunk at another rank), each correctly rounded as numpy adds
    fp16. Up to 3 ranks."""
    n = len(inputs)
    if n == 2:
        return [inputs[0] + inputs[1]]
    return [(inputs[0] + inputs[1]) + inputs[2], (inputs[1] + inputs[2]) + inputs[0],
            (inputs[2] + inputs[0]) + inputs[1]]


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
