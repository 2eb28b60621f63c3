"""BinSGDM and the hierarchical 1-bit allreduce on simulated ranks (numpy oracle)."""

import numpy as np
import pytest

from hvd_quant import kernels
from hvd_quant.core.backend import NumpyBackend, NumpyKernelBackend
from hvd_quant.core.hierarchical import hierarchical_bytes, node_layout, sign_mean
from hvd_quant.core.packing import pack_signs, unpack_signs
from hvd_quant.core.rng import call_key, stream_key
from hvd_quant.core.simulate import ThreadWorld
from hvd_quant.optimizers import BinSGDMRule
from hvd_quant.optimizers.binsgdm import binary_randomize
from hvd_quant.optimizers.oracle import OracleOptimizer

B = NumpyBackend()
LAYOUTS = [(2, None), (3, None), (5, None), (4, 2), (6, 3), (6, 2), (4, 1), (3, 3)]
LAYOUT_IDS = [f"n{n}-k{k}" for n, k in LAYOUTS]


def run_sign_mean(signs, k, seed=0, split_meters=False):
    """sign_mean of each rank's +-1 row over a ThreadWorld; returns (means, oks, meters)."""
    n, d = signs.shape

    def body(comm):
        bits = pack_signs(B, signs[comm.rank])
        key = call_key(stream_key(seed + 1_000_003 * comm.rank), 0)
        return sign_mean(B, comm, bits, d, k, key, "h")

    world = ThreadWorld(n)
    out = world.run(body)
    for mean, _ in out[1:]:
        np.testing.assert_array_equal(mean, out[0][0])  # identical on every rank
    return [o[0] for o in out], [bool(o[1]) for o in out], world.meters


@pytest.mark.parametrize("n,k", LAYOUTS, ids=LAYOUT_IDS)
def test_sign_mean_is_unbiased_and_bounded(n, k):
    """Every +-1 pattern over the ranks, many trials: the mean of the estimate is the mean
    sign within 5 standard errors (its variance is at most 1 per element), |q_bar| <= 1."""
    patterns = 2 ** n
    reps = max(1, 4096 // patterns)
    codes = np.repeat(np.arange(patterns), reps)
    signs = np.stack([np.where((codes >> r) & 1, 1.0, -1.0) for r in range(n)]).astype(np.float32)
    truth = signs.mean(axis=0)
    trials = 40
    total = np.zeros_like(truth, dtype=np.float64)
    for t in range(trials):
        means, oks, _ = run_sign_mean(signs, k, seed=t)
        assert all(oks)
        assert np.all(np.abs(means[0]) <= 1.0)
        total += means[0]
    est = total / trials
    # Per element, var(q_bar) <= 1 - truth^2 (+-1 draws); pool elements of equal truth.
    for m in np.unique(truth):
        sel = truth == m
        se = np.sqrt(max(1.0 - m * m, 1.0 / n) / (trials * sel.sum()))
        assert abs(est[sel].mean() - m) <= 5 * se + 1e-12, (m, est[sel].mean(), se)


@pytest.mark.parametrize("n,k", [(2, None), (3, None), (4, 1), (3, 3)])
def test_flat_layouts_are_exact(n, k):
    signs = np.where(np.random.default_rng(n).random((n, 1001)) < 0.5, 1.0, -1.0).astype(np.float32)
    means, _, _ = run_sign_mean(signs, k)
    np.testing.assert_array_equal(means[0], (signs.sum(axis=0) / n).astype(np.float32))


@pytest.mark.parametrize("n,k", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("d", [1, 7, 100, 1001])
def test_byte_counts_per_phase(n, k, d):
    """Bytes per rank equal the documented cost model; the intra-node and inter-node parts
    are counted on separate meters."""
    nodes, per = node_layout(n, k)
    signs = np.ones((n, d), np.float32)

    def body(comm):
        if nodes > 1 and per > 1:  # watch the two kinds of groups separately
            node, cross = comm.subgroups(nodes)
            from hvd_quant.core.comm import WireMeter
            node.meter, cross.meter = WireMeter(), WireMeter()
        mean, _ = sign_mean(B, comm, pack_signs(B, signs[comm.rank]), d, k, 0, "h")
        if nodes > 1 and per > 1:
            return node.meter.bytes_sent, cross.meter.bytes_sent
        return comm.meter.bytes_sent, None

    expected = hierarchical_bytes(d, n, k)
    for intra, inter in ThreadWorld(n).run(body):
        if inter is None:
            assert intra == pytest.approx(expected["intra"] + expected["inter"])
        else:
            assert intra == pytest.approx(expected["intra"])
            assert inter == pytest.approx(expected["inter"])
    if nodes > 1 and per > 1:  # the slow network carries k times less than a flat allgather
        flat = hierarchical_bytes(d, n, None)["intra"]
        assert expected["inter"] <= flat / per + 2 * nodes


def test_ranks_per_node_must_divide_the_world():
    with pytest.raises(ValueError, match="ranks_per_node=3 must .* divides the number of ranks \\(4\\)"):
        BinSGDMRule(ranks_per_node=3).validate(4)
    with pytest.raises(ValueError, match="positive int"):
        BinSGDMRule(ranks_per_node=0)


def test_binary_randomization_is_unbiased_and_moments_follow_the_rule():
    rng = np.random.default_rng(0)
    d = 20000
    g = rng.standard_normal(d).astype(np.float32)
    m0 = (rng.standard_normal(d) * 0.1).astype(np.float32)
    b0 = (np.abs(m0) + rng.random(d).astype(np.float32)).astype(np.float32)
    beta = 0.9
    m, b, bits = binary_randomize(B, g, m0, b0, beta, 12345)
    np.testing.assert_array_equal(m, m0 * beta + g * (1.0 - beta))
    np.testing.assert_array_equal(b, b0 * beta + np.abs(g) * (1.0 - beta))
    assert np.all(np.abs(m) <= b * (1 + 1e-6))
    z = np.clip(m / b, -1, 1)
    q = unpack_signs(B, bits, d)
    # E[q] = z: pooled z-score over all elements.
    zscore = np.sum(q - z) / np.sqrt(np.sum(1 - z * z))
    assert abs(zscore) < 5
    # 0 / 0 -> z = 0 -> +1 with probability 1/2; z = +-1 -> deterministic.
    zeros = np.zeros(4000, np.float32)
    _, _, bits = binary_randomize(B, zeros, zeros, zeros, beta, 7)
    frac = (unpack_signs(B, bits, 4000) > 0).mean()
    assert abs(frac - 0.5) < 5 * np.sqrt(0.25 / 4000)
    ones = np.ones(16, np.float32)
    _, _, bits = binary_randomize(B, ones, ones, ones, beta, 7)
    assert np.all(unpack_signs(B, bits, 16) == 1)
    _, _, bits = binary_randomize(B, -ones, -ones, ones, beta, 7)
    assert np.all(unpack_signs(B, bits, 16) == -1)


@pytest.mark.skipif(not kernels.enabled(), reason="kernels off")
def test_binary_randomization_kernel_equals_generic():
    K = NumpyKernelBackend()
    rng = np.random.default_rng(1)
    for d in (0, 1, 9, 1001, 200003):
        g, m, b = (rng.standard_normal(d).astype(np.float32) for _ in range(3))
        b = np.abs(b)
        b[: d // 3] = 0.0  # 0/0 cases
        m[: d // 3] = 0.0
        for got, want in zip(binary_randomize(K, g, m, b, 0.9, 42), binary_randomize(B, g, m, b, 0.9, 42)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n,k", [(2, None), (3, None), (4, 2), (6, 3)])
def test_binsgdm_ranks_agree_and_train(n, k):
    """A least-squares problem: every rank ends with identical parameters and the loss
    falls from step 0, with no warm-up."""
    d, steps = 64, 150
    target = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    hp = {"betas": (0.9,), "eps": 0.0, "weight_decay": 0.0}

    def body(comm):
        opt = OracleOptimizer(BinSGDMRule(ranks_per_node=k), np.zeros(d, np.float32), comm, hp)
        noise = np.random.default_rng(comm.rank)
        for s in range(steps):
            g = (opt.x - target) + 0.3 * noise.standard_normal(d).astype(np.float32)
            opt.step(g, 0.02 * (1 - s / steps))
        return opt

    opts = ThreadWorld(n).run(body)
    for o in opts[1:]:
        np.testing.assert_array_equal(o.x, opts[0].x)
    assert np.mean((opts[0].x - target) ** 2) < 0.05 * np.mean(target ** 2)
    assert opts[0].state.kinds == ["onebit"] * steps
    assert opts[0].state.bytes_sent == pytest.approx(steps * BinSGDMRule(k).wire_bytes("onebit", d, n))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_binsgdm_non_finite_step_leaves_no_trace(bad):
    n, d = 4, 30
    hp = {"betas": (0.9,), "eps": 0.0, "weight_decay": 0.01}
    grads = [[np.random.default_rng(10 * r + s).standard_normal(d).astype(np.float32) for s in range(5)]
             for r in range(n)]

    def run(poison):
        def body(comm):
            opt = OracleOptimizer(BinSGDMRule(ranks_per_node=2), np.ones(d, np.float32), comm, hp)
            for s in range(5):
                if poison and s == 2:
                    g = grads[comm.rank][s].copy()
                    if comm.rank == 3:
                        g[4] = bad
                    opt.step(g, 0.01)
                opt.step(grads[comm.rank][s], 0.01)
            return opt
        return ThreadWorld(n).run(body)

    for a, b in zip(run(False), run(True)):
        np.testing.assert_array_equal(a.x, b.x)
        assert b.state.skipped == 1 and a.state.skipped == 0
        np.testing.assert_array_equal(a.state.slots["exp_avg"], b.state.slots["exp_avg"])
