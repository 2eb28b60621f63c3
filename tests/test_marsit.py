"""Marsit (sign bits on a ring / torus with unbiased per-hop selection) against numpy."""

import numpy as np
import pytest

from solo_comm import FrameworkComm, SoloComm

import hvd_quant
from hvd_quant.compressors.marsit import (CascadingSign, CascadingSignCompressor,
                                          MarsitCompressor, MarsitSelect, cascade_tie_mask)
from hvd_quant.core.backend import NumpyBackend
from hvd_quant.core.packing import pack_signs, packed_sign_bytes, unpack_signs
from hvd_quant.core.ring import (GATHER_EXTRA_BYTES, butterfly_allreduce, chunk_bounds, direct_allreduce,
                                 ring_allreduce, torus_allreduce)
from hvd_quant.core.rng import bits_below
from hvd_quant.core.hierarchical import ranks_per_node_of
from hvd_quant.core.runner import CompressorRunner, RankDisagreement
from hvd_quant.core.simulate import ThreadWorld

B = NumpyBackend()
SEGMENTS = [("w1", 37), ("w2", 100), ("b", 3)]
D = sum(n for _, n in SEGMENTS)


def pattern_signs(n, reps):
    """Every +-1 pattern over ``n`` ranks, ``reps`` elements each: (n, 2**n * reps)."""
    codes = np.repeat(np.arange(2 ** n), reps)
    return np.stack([np.where((codes >> r) & 1, 1.0, -1.0) for r in range(n)]).astype(np.float32)


def assert_unbiased(agg, signs, n_sigma=5.0):
    """Each column of ``agg`` (trials x elements, +-1) averages to the mean sign of that
    element within ``n_sigma`` standard errors of the Bernoulli variance ``1 - mu^2``."""
    mu = signs.mean(axis=0)
    agg = np.asarray(agg).reshape(-1, mu.size)
    # Elements with the same true mean are independent draws: pool them per distinct mean.
    for m in np.unique(mu):
        vals = agg[:, mu == m].ravel()
        se = np.sqrt((1.0 - m * m) / vals.size)
        assert abs(vals.mean() - m) <= n_sigma * se + 1e-12, (m, vals.mean(), se)


def ring_signs(signs, op, seed=0, rows=None, topology=None):
    """Allreduce of the packed signs of ``signs[r]`` over a thread world; decoded +-1."""
    n, d = signs.shape

    def body(c):
        rng = B.generator(seed * 7919 + c.rank)
        bits = pack_signs(B, signs[c.rank])
        if topology == "butterfly":
            agg = butterfly_allreduce(B, c, bits, op, "m", rng)
        elif topology == "direct":
            agg = direct_allreduce(B, c, bits, op, "m", rng)
        elif rows is None:
            agg = ring_allreduce(B, c, bits, op, "m", rng)
        else:
            row, col = c.subgroups(rows)
            agg = torus_allreduce(B, row, col, bits, op, "m", rng)
        return unpack_signs(B, agg, d)

    outs = ThreadWorld(n).run(body)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])  # every rank holds the same signs
    return outs[0]


# --- the hop operator -------------------------------------------------------------------

# (1, 1), (1, 3), (3, 1), (6, 2), (5, 3), (1, 7): random bit planes (a / 2**L in lowest
# terms); (1, 2), (2, 4): a draw per element against the threshold.
@pytest.mark.parametrize("own_count,received_count",
                         [(1, 1), (1, 3), (2, 4), (3, 1), (1, 2), (6, 2), (5, 3), (1, 7)])
def test_select_takes_each_bit_from_one_side_with_the_right_probability(own_count, received_count):
    rng = np.random.default_rng(1)
    own = rng.integers(0, 256, 20000).astype(np.uint8)
    received = rng.integers(0, 256, 20000).astype(np.uint8)
    out = MarsitSelect().combine(B, own, own_count, received, received_count, B.generator(2))
    assert out.dtype == np.uint8 and out.shape == own.shape
    o, r, x = (np.unpackbits(a, bitorder="little") for a in (own, received, out))
    assert ((x == o) | (x == r)).all()
    differ = o != r
    p = own_count / (own_count + received_count)
    frac = (x[differ] == o[differ]).mean()
    assert abs(frac - p) <= 5 * np.sqrt(p * (1 - p) / differ.sum())


@pytest.mark.parametrize("levels", [1, 2, 3, 4])
def test_select_mask_is_j_below_a_for_every_j(levels):
    """``core.rng.bits_below``, Marsit's mask at odds a / 2**L: for every L-bit number j
    (element e holds j = e mod 2**L, plane 0 its top bit) and every 0 < a < 2**L, the
    mask bit is exactly j < a."""
    d = 8 * 2 ** levels
    j = np.arange(d) % 2 ** levels
    planes = [np.packbits(((j >> (levels - 1 - p)) & 1).astype(np.uint8), bitorder="little")
              for p in range(levels)]
    for a in range(1, 2 ** levels):
        got = np.unpackbits(bits_below(B, planes, a), bitorder="little")
        np.testing.assert_array_equal(got, (j < a).astype(np.uint8), err_msg=f"a={a}")


def test_select_handles_empty_chunks():
    empty = np.zeros(0, np.uint8)
    assert MarsitSelect().combine(B, empty, 1, empty, 1, B.generator(0)).size == 0


# --- unbiasedness -------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_marsit_is_unbiased(n):
    reps = 4096 // 2 ** n * 8  # ~32k elements in all
    signs = pattern_signs(n, reps)
    agg = ring_signs(signs, MarsitSelect(), seed=n)
    assert set(np.unique(agg)) <= {-1.0, 1.0}
    assert_unbiased(agg, signs)


@pytest.mark.parametrize("rows,cols", [(2, 2), (2, 3), (3, 2)])
def test_torus_marsit_is_unbiased(rows, cols):
    signs = pattern_signs(rows * cols, 512)
    agg = ring_signs(signs, MarsitSelect(), seed=rows, rows=rows)
    assert_unbiased(agg, signs)


@pytest.mark.parametrize("topology,n", [("butterfly", 2), ("butterfly", 4), ("butterfly", 8),
                                        ("direct", 3), ("direct", 5), ("direct", 6)])
def test_butterfly_and_direct_marsit_are_unbiased(topology, n):
    reps = max(8, 4096 // 2 ** n * 8)
    signs = pattern_signs(n, reps)
    agg = ring_signs(signs, MarsitSelect(), seed=n + 100, topology=topology)
    assert set(np.unique(agg)) <= {-1.0, 1.0}
    assert_unbiased(agg, signs)


def test_64_ranks_direct_hop_chain_is_unbiased():
    """The reduce path of one chunk on a 64-rank ring, in a shuffled rank order, simulated
    directly with the operator (no threads): 63 hops, received count k at hop k."""
    n, trials = 64, 1000
    base = np.stack([np.where(np.arange(65) > r, 1.0, -1.0) for r in range(n)])  # 65 means
    signs = np.tile(base, (1, trials)).astype(np.float32)  # trials x 65 elements per rank
    order = np.random.default_rng(3).permutation(n)
    rng, op = B.generator(4), MarsitSelect()
    acc = pack_signs(B, signs[order[0]])
    for k, r in enumerate(order[1:], start=1):
        acc = op.combine(B, pack_signs(B, signs[r]), 1, acc, k, rng)
    agg = unpack_signs(B, acc, signs.shape[1])
    assert_unbiased(agg.reshape(trials, 65), base)


def test_64_ranks_threaded_ring_is_unbiased_and_agrees():
    signs = pattern_signs(2, 1).repeat(64 // 2, axis=0)  # 64 ranks, 4 patterns, means 1,0,0,-1
    signs = np.tile(signs, (1, 2048))
    agg = ring_signs(signs, MarsitSelect(), seed=64)
    assert_unbiased(agg, signs)


def cascade_chunk_means(signs_in_ring_order):
    """Expected +-1 value after re-signing hop by hop: mu <- (mu + s) / 2 at each hop."""
    mu = signs_in_ring_order[0]
    for s in signs_in_ring_order[1:]:
        mu = (mu + s) / 2.0
    return mu


def test_cascading_sign_is_biased_where_marsit_is_not():
    n, per_chunk = 4, 8 * 2000  # elements per ring chunk (a whole number of bytes)
    rank_signs = np.array([1.0, 1.0, 1.0, -1.0])  # mean sign 0.5
    signs = np.tile(rank_signs[:, None], (1, n * per_chunk)).astype(np.float32)
    marsit = ring_signs(signs, MarsitSelect(), seed=11)
    cascade = ring_signs(signs, CascadingSign(), seed=12)
    assert_unbiased(marsit, signs)
    # Chunk j is reduced along ranks j, j+1, ..., j+n-1 (mod n).
    bounds = chunk_bounds(packed_sign_bytes(signs.shape[1]), n)
    se = np.sqrt(1.0 / per_chunk)
    for j, (a, _) in enumerate(bounds):
        part = cascade[8 * a: 8 * a + per_chunk]
        expected = cascade_chunk_means(np.roll(rank_signs, -j))
        assert abs(part.mean() - expected) <= 5 * se
    chunk0 = cascade[:per_chunk].mean()  # ranks in order 0,1,2,3: expectation 0, not 0.5
    assert abs(chunk0 - 0.5) > 10 * se


# --- the compressor -----------------------------------------------------------------

def run_compressor(compressor, xs, steps=1, runners=None, seed=0):
    """Run ``steps`` reductions on every rank; xs[step][rank]. Returns (outs, runners, meters)."""
    n = len(xs[0])
    if runners is None:
        runners = [CompressorRunner(compressor, B, seed=seed) for _ in range(n)]
    outs = []
    for step in range(steps):
        world = ThreadWorld(n)
        outs.append(world.run(lambda c: runners[c.rank].reduce(xs[step][c.rank], c, "g", SEGMENTS)))
    return outs, runners, world.meters


def random_xs(n, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(D).astype(np.float32) for _ in range(n)] for _ in range(steps)]


def segment_mean_abs(p):
    out, off = [], 0
    for _, k in SEGMENTS:
        out.append(np.full(k, np.abs(p[off:off + k]).mean() if k else 0.0))
        off += k
    return np.concatenate(out).astype(np.float32)


@pytest.mark.parametrize("topology,rows", [("ring", None), ("torus", 2), ("gather", None)])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("mode", ["global", "local"])
def test_compensation_follows_its_rule(topology, rows, n, mode):
    """Every rank gets the same result: alpha * s_hat, one rank's sign per element on the
    hop layouts; on the gather layout alpha * mean_r sign(p_r), the exact value the
    selection estimates without bias. The residual follows its rule."""
    comp = MarsitCompressor(topology=topology, torus_rows=rows, compensation=mode)
    xs = random_xs(n, 3, seed=n)
    runners = [CompressorRunner(comp, B, seed=5) for _ in range(n)]
    residual = [np.zeros(D, np.float32) for _ in range(n)]
    for step in range(3):
        outs, _, meters = run_compressor(comp, [xs[step]], runners=runners)
        outs = outs[0]
        p = [xs[step][r] + residual[r] for r in range(n)]
        alpha = np.mean([segment_mean_abs(q) for q in p], axis=0)
        for r in range(n):
            np.testing.assert_array_equal(outs[r], outs[0])
        if topology == "gather":
            mean_sign = np.mean([np.where(q >= 0, 1.0, -1.0) for q in p], axis=0)
            np.testing.assert_allclose(outs[0], alpha * mean_sign, rtol=1e-5, atol=1e-7)
            # Allgathers only (local: the bits with the scales in one; global: the scales'
            # allgather first, as on every layout), the bytes of the cost model.
            want = comp.wire_bytes(D, n, len(SEGMENTS), layout="gather")
            assert all(set(m.by_kind) == {"allgather"} and m.bytes_sent == pytest.approx(want)
                       for m in meters)
        else:
            np.testing.assert_allclose(np.abs(outs[0]), alpha, rtol=1e-6)
        for r in range(n):
            state = runners[r].state_dict()
            assert sorted(state) == ["b/residual", "w1/residual", "w2/residual"]
            got = np.concatenate([state[f"{k}/residual"] for k, _ in SEGMENTS])
            sent = alpha * np.where(p[r] >= 0, 1.0, -1.0)  # this rank's own contribution
            expected = p[r] - (outs[0] if mode == "global" else sent)
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
            residual[r] = got
        if mode == "global":
            # The mean residual is exactly the deviation of the aggregate from the mean update.
            np.testing.assert_allclose(np.mean(residual, axis=0), np.mean(p, axis=0) - outs[0],
                                       atol=1e-5)


def test_state_restores_through_state_dict():
    comp = MarsitCompressor()
    n = 3
    # Identical inputs on every rank: the selection is then deterministic, so a restored
    # run must reproduce the original exactly whatever the random draws.
    x = [np.random.default_rng(s).standard_normal(D).astype(np.float32) for s in range(3)]
    xs = [[x[s]] * n for s in range(3)]
    outs, runners, _ = run_compressor(comp, xs[:2], steps=2, seed=1)
    saved = [r.state_dict() for r in runners]
    fresh = [CompressorRunner(comp, B, seed=99) for _ in range(n)]
    for runner, state in zip(fresh, saved):
        runner.load_state_dict(state)
    a, _, _ = run_compressor(comp, xs[2:], runners=runners)
    b, _, _ = run_compressor(comp, xs[2:], runners=fresh)
    np.testing.assert_array_equal(a[0][0], b[0][0])
    for ra, rb in zip(runners, fresh):
        for key, value in ra.state_dict().items():
            np.testing.assert_array_equal(value, rb.state_dict()[key])


@pytest.mark.parametrize("topology,rows,n", [("ring", None, 2), ("ring", None, 3),
                                            ("ring", None, 4), ("torus", 2, 4),
                                            ("torus", 3, 6), ("torus", 2, 6)])
def test_wire_volume_matches_the_cost_model(topology, rows, n):
    comp = MarsitCompressor(topology=topology, torus_rows=rows)
    _, _, meters = run_compressor(comp, random_xs(n, 1))
    nbytes = packed_sign_bytes(D)
    ring = 2.0 * (n - 1) / n
    for m in meters:
        # The per-segment scales travel by allgather (summed identically on every rank).
        assert m.by_kind["allgather"] == pytest.approx((n - 1) * 4 * len(SEGMENTS))
        # Every hop carries one chunk of 1-bit signs: at most ceil(bytes / chunks) each.
        assert m.by_kind["sendrecv"] <= 2 * (n - 1) * -(-nbytes // (n // (rows or 1)))
    mean = np.mean([m.bytes_sent for m in meters])
    assert mean == pytest.approx(comp.wire_bytes(D, n, len(SEGMENTS)))
    assert mean == pytest.approx(ring * nbytes + (n - 1) * 4 * len(SEGMENTS))
    if topology == "ring":  # exact per rank: all chunks but (r+1) and (r+2) are sent
        sizes = [b - a for a, b in chunk_bounds(nbytes, n)]
        for r, m in enumerate(meters):
            assert m.by_kind["sendrecv"] == 2 * nbytes - sizes[(r + 1) % n] - sizes[(r + 2) % n]


@pytest.mark.parametrize("topology,n", [("butterfly", 4), ("butterfly", 8), ("direct", 3), ("direct", 6)])
def test_butterfly_and_direct_wire_volume_matches_the_cost_model(topology, n):
    comp = MarsitCompressor(topology=topology)
    _, _, meters = run_compressor(comp, random_xs(n, 1))
    layout = comp.layout(_Layout(n, None))
    mean = np.mean([m.bytes_sent for m in meters])
    assert mean == pytest.approx(comp.wire_bytes(D, n, len(SEGMENTS), layout=layout))
    nbytes = packed_sign_bytes(D)
    if topology == "direct":
        padded = -(-nbytes // n) * n
        for m in meters:
            assert m.by_kind == pytest.approx({"alltoall": (n - 1) * (padded // n + 4 * len(SEGMENTS)),
                                               "allgather": (n - 1) * padded // n})
    else:
        assert mean == pytest.approx(2.0 * (n - 1) / n * nbytes + (n - 1) * 4 * len(SEGMENTS))


def test_constant_scale_sends_only_sign_bits():
    comp = MarsitCompressor(scale=0.01, check_finite=False)
    n = 4
    outs, _, meters = run_compressor(comp, random_xs(n, 1))
    np.testing.assert_allclose(np.abs(outs[0][0]), 0.01, rtol=1e-6)
    assert "allreduce" not in meters[0].by_kind and "allgather" not in meters[0].by_kind
    assert np.mean([m.bytes_sent for m in meters]) == pytest.approx(comp.wire_bytes(D, n, 3))
    assert comp.wire_bytes(D, n, 3) == pytest.approx(1.5 * packed_sign_bytes(D))


def test_constant_scale_checks_finiteness_with_one_small_allreduce():
    comp = MarsitCompressor(scale=0.01)  # check_finite=True by default
    n = 4
    _, _, meters = run_compressor(comp, random_xs(n, 1))
    assert meters[0].by_kind["allreduce"] == pytest.approx(1.5 * 4)  # one float32 flag
    assert np.mean([m.bytes_sent for m in meters]) == pytest.approx(comp.wire_bytes(D, n, 3))


def test_without_compensation_is_stateless_plain_sign():
    comp = MarsitCompressor(compensation=False)
    assert not comp.stateful
    x = np.random.default_rng(0).standard_normal(D).astype(np.float32)
    outs, runners, _ = run_compressor(comp, [[x] * 3])
    np.testing.assert_allclose(outs[0][0], segment_mean_abs(x) * np.where(x >= 0, 1, -1), rtol=1e-6)
    assert runners[0].state_dict() == {}


def test_single_rank_and_empty_buffer():
    comp = MarsitCompressor()
    x = np.array([0.5, -2.0, 0.0], np.float32)
    runner = CompressorRunner(comp, B)
    out = ThreadWorld(1).run(lambda c: runner.reduce(x, c, "g", [("p", 3)]))[0]
    np.testing.assert_allclose(out, [2.5 / 3, -2.5 / 3, 2.5 / 3], rtol=1e-6)
    runners = [CompressorRunner(comp, B) for _ in range(3)]
    outs = ThreadWorld(3).run(
        lambda c: runners[c.rank].reduce(np.zeros(0, np.float32), c, "g", [("p", 0)]))
    assert all(o.size == 0 for o in outs)


def test_registry_and_options():
    comp = hvd_quant.get("marsit", topology="torus", torus_rows=2)
    assert isinstance(comp, MarsitCompressor) and comp.stateful
    cascade = hvd_quant.get("cascading_sign")
    assert isinstance(cascade, CascadingSignCompressor)
    assert cascade.hop == "cascade" and not cascade.compensation and not cascade.stateful
    assert "hop" not in cascade.options()
    assert comp.fingerprint() != hvd_quant.get("marsit").fingerprint()
    with pytest.raises(ValueError):
        comp.validate(6 - 1)
    for bad in ({"scale": "max"}, {"scale": -1.0}, {"topology": "tree"},
                {"topology": "torus"}, {"hop": "sum"}):
        with pytest.raises(ValueError):
            hvd_quant.get("marsit", **bad)


def test_cascading_compressor_runs_and_agrees():
    comp = CascadingSignCompressor(topology="torus", torus_rows=2)
    outs, _, _ = run_compressor(comp, random_xs(4, 1))
    for out in outs[0][1:]:
        np.testing.assert_array_equal(out, outs[0][0])


# --- other backends -------------------------------------------------------------------

def framework_run(backend, comp, xs_np, seed=0):
    n = len(xs_np)
    runners = [CompressorRunner(comp, backend, seed=seed) for _ in range(n)]
    xs = [backend.constant(x, "float32") for x in xs_np]
    outs = ThreadWorld(n).run(
        lambda c: backend.to_numpy(runners[c.rank].reduce(xs[c.rank], FrameworkComm(c, backend),
                                                          "g", SEGMENTS)))
    return outs, runners


def check_framework(backend):
    x = np.random.default_rng(0).standard_normal(D).astype(np.float32)
    for topology, rows in (("ring", None), ("torus", 2), ("butterfly", None), ("direct", None),
                           ("gather", None)):
        comp = MarsitCompressor(topology=topology, torus_rows=rows, compensation="global")
        # Same input everywhere: the result must be exactly alpha * sign(x).
        outs, _ = framework_run(backend, comp, [x] * 4)
        np.testing.assert_allclose(outs[0], segment_mean_abs(x) * np.where(x >= 0, 1, -1), rtol=1e-6)
        # Different inputs: ranks agree and the residual is p - out.
        xs = random_xs(4, 1, seed=3)[0]
        outs, runners = framework_run(backend, comp, xs)
        for r in range(4):
            np.testing.assert_array_equal(outs[r], outs[0])
            state = runners[r].state_dict()
            got = np.concatenate([state[f"{k}/residual"] for k, _ in SEGMENTS])
            np.testing.assert_allclose(got, xs[r] - outs[0], rtol=1e-6, atol=1e-6)
    # The default path (local compensation) on the direct layout, its scales riding in the
    # alltoall, and on the gather layout (auto's choice for this small buffer at 5 ranks),
    # its scales riding in the allgather: the numpy oracle's bits.
    xs = random_xs(5, 1, seed=4)[0]
    # The cascade likewise (gathered at 5 ranks, its tie-breaks riding with the bits).
    for comp in (MarsitCompressor(topology="direct"), MarsitCompressor(), CascadingSignCompressor(),
                 CascadingSignCompressor(topology="direct")):
        outs, _ = framework_run(backend, comp, xs)
        want, _ = framework_run(B, comp, xs)
        for got, ref in zip(outs, want):
            np.testing.assert_array_equal(got, ref)


def test_torch_backend():
    torch_backend = pytest.importorskip("hvd_quant.torch.backend")
    check_framework(torch_backend.TorchBackend())


def test_tensorflow_backend_eager_and_in_tf_function():
    tf_backend = pytest.importorskip("hvd_quant.tensorflow.backend")
    import tensorflow as tf

    TB = tf_backend.TFBackend()
    check_framework(TB)

    # Inside tf.function: the hop operators and a single-rank compressor step trace.
    rng = TB.generator(0)
    own = tf.constant(np.arange(64, dtype=np.uint8))
    recv = tf.constant(np.arange(64, dtype=np.uint8)[::-1].copy())
    sel = tf.function(lambda a, b: MarsitSelect().combine(TB, a, 1, b, 3, rng))(own, recv)
    o, r, s = (np.unpackbits(np.asarray(v), bitorder="little") for v in (own, recv, sel.numpy()))
    assert ((s == o) | (s == r)).all()
    cas = tf.function(lambda a, b: CascadingSign().combine(TB, a, 1, b, 1, rng))(own, recv)
    c = np.unpackbits(cas.numpy(), bitorder="little")
    assert (c[o == r] == o[o == r]).all()

    comp = MarsitCompressor(topology="torus", torus_rows=1)
    runner = CompressorRunner(comp, TB)
    x = tf.constant(np.array([0.5, -2.0, 0.0], np.float32))
    step = tf.function(lambda v: runner.reduce(v, SoloComm(), "g", [("p", 3)]))
    np.testing.assert_allclose(step(x).numpy(), [2.5 / 3, -2.5 / 3, 2.5 / 3], rtol=1e-6)
    np.testing.assert_allclose(runner.state_dict()["p/residual"],
                               [0.5 - 2.5 / 3, -2.0 + 2.5 / 3, -2.5 / 3], rtol=1e-5)


def test_a_failing_ring_leaves_the_residual_as_it_was(monkeypatch):
    """The new residual is written only after the ring has delivered (in the decode's
    pass): when a hop fails (a dead peer, the collective deadline), the error reaches the
    caller and the residual kept from the last step is untouched, on the fused kernels
    and on the oracle."""
    from hvd_quant.compressors import marsit
    from hvd_quant.core.backend import NumpyKernelBackend
    from hvd_quant.kernels import enabled

    x = np.random.default_rng(0).standard_normal(D).astype(np.float32)
    for backend in [B] + ([NumpyKernelBackend()] if enabled() else []):
        runner = CompressorRunner(MarsitCompressor(), backend, seed=0)
        runner.reduce(x.copy(), SoloComm(), "g", SEGMENTS)
        before = {k: v.copy() for k, v in runner.state_dict().items()}
        assert before and any(np.any(v) for v in before.values())

        def dead_peer(*args, **kwargs):
            raise RuntimeError("ring hop 'x' did not complete within 10 s")
        with monkeypatch.context() as m:
            m.setattr(marsit, "ring_allreduce", dead_peer)
            with pytest.raises(RuntimeError, match="did not complete"):
                runner.reduce(2 * x, SoloComm(), "g", SEGMENTS)
        after = runner.state_dict()
        assert after.keys() == before.keys()
        for k in before:
            np.testing.assert_array_equal(after[k], before[k])


# --- topology="auto": a torus along the hosts when the layout is known ------------------
def run_on_hosts(compressor, xs, ranks_per_node):
    """One step on a thread world whose communicators report ``ranks_per_node[rank]``
    (what Horovod's local and cross sizes give a real job); the first-step agreement
    check runs too. Returns (outs, meters)."""
    n = len(xs)
    runners = [CompressorRunner(compressor, B) for _ in range(n)]
    world = ThreadWorld(n)

    def body(c):
        c.ranks_per_node = lambda: ranks_per_node[c.rank]
        runners[c.rank].check_once(c, "g")
        return runners[c.rank].reduce(xs[c.rank], c, "g", SEGMENTS)
    return world.run(body), world.meters


@pytest.mark.parametrize("n,k", [(4, 2)])
def test_auto_topology_is_the_torus_of_the_hosts(n, k):
    xs = random_xs(n, 1)[0]
    auto, _ = run_on_hosts(MarsitCompressor(), xs, [k] * n)
    torus, _ = run_on_hosts(MarsitCompressor(topology="torus", torus_rows=n // k), xs, [None] * n)
    for a, t in zip(auto, torus):
        np.testing.assert_array_equal(a, t)
    assert MarsitCompressor().layout(_Layout(n, k)) == n // k
    assert CascadingSignCompressor().layout(_Layout(n, k)) == n // k  # the same hops as its baseline


@pytest.mark.parametrize("layout", [[None] * 4, [1] * 4, [4] * 4])
def test_auto_topology_is_a_ring_without_hosts_to_follow(layout):
    """Unknown layout, one rank per host, or one host: the plain ring."""
    xs = random_xs(4, 1)[0]
    auto, _ = run_on_hosts(MarsitCompressor(), xs, layout)
    ring, _ = run_on_hosts(MarsitCompressor(topology="ring"), xs, layout)
    for a, r in zip(auto, ring):
        np.testing.assert_array_equal(a, r)


def test_auto_topology_on_uneven_hosts_fails_fast_and_says_why():
    """Ranks that derive different layouts (hosts of 1 and 3 ranks can look even from
    one rank) are stopped by the agreement check before any hop, on every rank."""
    with pytest.raises(RankDisagreement, match="node layout.*topology='ring'"):
        run_on_hosts(MarsitCompressor(), random_xs(4, 1)[0], [None, None, 2, None])
    # An explicit topology derives nothing from the hosts: no disagreement.
    run_on_hosts(MarsitCompressor(topology="ring"), random_xs(4, 1)[0], [None, None, 2, None])


@pytest.mark.parametrize("n,k", [(5, None), (6, 3), (6, 2), (8, 1), (8, 2)])
def test_auto_topology_is_direct_from_five_ranks(n, k):
    """From 5 ranks on, two collectives whatever the hosts (a ring's or a torus's hops
    are one Horovod collective each), or one allgather for a small buffer; hosts of
    uneven sizes then cannot disagree."""
    xs = random_xs(n, 1)[0]
    auto, auto_meters = run_on_hosts(MarsitCompressor(), xs, [k] * n)
    gather, _ = run_on_hosts(MarsitCompressor(topology="gather"), xs, [None] * n)
    for a, t in zip(auto, gather):
        np.testing.assert_array_equal(a, t)
    assert MarsitCompressor().layout(_Layout(n, k)) == "direct"
    assert MarsitCompressor().buffer_layout(_Layout(n, k), D, len(SEGMENTS)) == "gather"
    # Beyond GATHER_EXTRA_BYTES of extra bytes, the direct layout's alltoall and allgather.
    big = 8 * (GATHER_EXTRA_BYTES // (n - 2) + 1)
    assert MarsitCompressor().buffer_layout(_Layout(n, k), big) == "direct"
    assert MarsitCompressor().buffer_layout(_Layout(n, k), big - 8 * 8) == "gather"
    # The cascade gathers too, its row twice the bits (they come with as many tie-breaks).
    assert CascadingSignCompressor().buffer_layout(_Layout(n, k), D, len(SEGMENTS)) == "gather"
    assert CascadingSignCompressor().buffer_layout(_Layout(n, k), big - 8 * 8) == "direct"
    # One allgather (the signs, with the scales in it): no other collective.
    for meter in auto_meters:
        assert set(meter.by_kind) == {"allgather"}
    run_on_hosts(MarsitCompressor(), random_xs(6, 1)[0], [None] * 4 + [2, None])


def test_gather_layout_without_compensation_is_the_mean_of_plain_signs():
    n = 6
    xs = random_xs(n, 1, seed=6)
    outs, _, _ = run_compressor(MarsitCompressor(topology="gather", compensation=False), xs)
    alpha = np.mean([segment_mean_abs(x) for x in xs[0]], axis=0)
    mean_sign = np.mean([np.where(x >= 0, 1.0, -1.0) for x in xs[0]], axis=0)
    for out in outs[0]:
        np.testing.assert_allclose(out, alpha * mean_sign, rtol=1e-5, atol=1e-7)


def test_gather_layout_with_a_non_finite_rank_returns_nan_and_keeps_the_residuals():
    n = 5
    comp = MarsitCompressor()
    runners = [CompressorRunner(comp, B, seed=2) for _ in range(n)]
    run_compressor(comp, random_xs(n, 1, seed=7), runners=runners)
    before = [runners[r].state_dict() for r in range(n)]
    xs = random_xs(n, 1, seed=8)
    xs[0][3][5] = np.inf
    outs, _, _ = run_compressor(comp, xs, runners=runners)
    for r in range(n):
        assert np.isnan(outs[0][r]).all()
        after = runners[r].state_dict()
        for key in before[r]:
            np.testing.assert_array_equal(after[key], before[r][key])


def tree_weights(n):
    """Each rank's weight in the expected value of a pairwise fold (tree_fold's order,
    pairs ``(0, 1), (2, 3), ...``, an odd one passing up) of cascading signs: a combine
    halves both sides' weights."""
    groups = [[r] for r in range(n)]
    weights = np.ones(n)
    while len(groups) > 1:
        nxt = []
        for i in range(0, len(groups) - 1, 2):
            weights[groups[i] + groups[i + 1]] /= 2.0
            nxt.append(groups[i] + groups[i + 1])
        if len(groups) % 2:
            nxt.append(groups[-1])
        groups = nxt
    return weights


def test_gathered_cascade_is_the_fold_with_each_ranks_shipped_tie_breaks():
    """Every rank folds the gathered rows pairwise, combine k keeping its own side's bit
    where rank k's first draw of fair coin flips is 1: the numpy fold by hand, bit for
    bit, on every rank, from one allgather of twice the bits plus the scales."""
    n, seed = 5, 3
    xs = random_xs(n, 1, seed=9)
    comp = CascadingSignCompressor(topology="gather")
    outs, _, meters = run_compressor(comp, xs, seed=seed)
    nbytes = packed_sign_bytes(D)
    bits = [np.packbits((x >= 0).astype(np.uint8), bitorder="little") for x in xs[0]]
    masks = [B.to_numpy(cascade_tie_mask(B, B.generator(seed + 1_000_003 * r), nbytes)) for r in range(n)]
    rows, used = list(bits), iter(masks)
    while len(rows) > 1:
        folded = []
        for i in range(0, len(rows) - 1, 2):
            m = next(used)
            folded.append((rows[i] & m) | (rows[i + 1] & ~m))
        rows = folded + (rows[-1:] if len(rows) % 2 else [])
    signs = np.where(np.unpackbits(rows[0], bitorder="little")[:D] == 1, 1.0, -1.0)
    alpha = np.mean([segment_mean_abs(x) for x in xs[0]], axis=0)
    for out in outs[0]:
        np.testing.assert_allclose(out, alpha * signs, rtol=1e-5, atol=1e-7)
    for meter in meters:
        assert set(meter.by_kind) == {"allgather"}
        assert meter.bytes_sent == pytest.approx(comp.wire_bytes(D, n, len(SEGMENTS), layout="gather"))
        assert meter.bytes_sent == (n - 1) * (2 * nbytes + 4 * len(SEGMENTS))


@pytest.mark.parametrize("topology", ["gather", "direct"])
def test_cascade_is_as_biased_gathered_as_in_the_direct_layout(topology):
    """Both layouts fold the ranks in the same tree, so a rank's weight in the expected
    sign is halved at each of its combines: at 5 ranks 1/8 for ranks 0-3, 1/2 for rank 4.
    Signs + + + - - (mean +0.2) give -0.25 in expectation; Marsit's gather gives the
    exact +0.2."""
    n, d = 5, 8 * 4000
    rank_signs = np.array([1.0, 1.0, 1.0, -1.0, -1.0])
    weights = tree_weights(n)
    np.testing.assert_allclose(weights, [1 / 8] * 4 + [1 / 2])
    expected = float(weights @ rank_signs)
    xs = [np.full(d, s, np.float32) for s in rank_signs]  # |x| = 1: alpha = 1
    world = ThreadWorld(n)
    runners = [CompressorRunner(CascadingSignCompressor(topology=topology), B, seed=4) for _ in range(n)]
    outs = world.run(lambda c: runners[c.rank].reduce(xs[c.rank], c, "g", [("p", d)]))
    se = np.sqrt((1.0 - expected ** 2) / d)
    assert abs(outs[0].mean() - expected) <= 5 * se
    assert abs(outs[0].mean() - rank_signs.mean()) > 20 * se
    marsit = ThreadWorld(n).run(lambda c: CompressorRunner(MarsitCompressor(topology="gather"), B).reduce(
        xs[c.rank], c, "g", [("p", d)]))
    np.testing.assert_allclose(marsit[0], rank_signs.mean(), rtol=1e-6)


@pytest.mark.parametrize("topology", ["butterfly", "direct"])
@pytest.mark.parametrize("compensation", ["local", "global", False])
def test_direct_and_butterfly_alpha_matches_the_ring(topology, compensation):
    """The scale alpha is the same number whatever carries it (the direct layout's
    alltoall or an allgather): where every rank holds the same signs, every layout gives
    the same result, bit for bit."""
    n = 4
    base = np.random.default_rng(5).standard_normal(D).astype(np.float32)
    xs = [base * (1.0 + 0.25 * r) for r in range(n)]  # same signs, different magnitudes
    outs = {}
    for topo in ("ring", topology):
        outs[topo], _ = run_on_hosts(MarsitCompressor(topology=topo, compensation=compensation), xs,
                                     [None] * n)
    for a, b in zip(outs["ring"], outs[topology]):
        np.testing.assert_array_equal(a, b)


class _Layout:
    def __init__(self, size, k):
        self.size, self._k = size, k

    def ranks_per_node(self):
        return self._k


def test_ranks_per_node_of_needs_even_hosts_numbered_host_by_host():
    # 2 hosts x 2 ranks, rank = cross_rank * local_size + local_rank.
    assert ranks_per_node_of(3, 1, 2, 1, 2, size=4) == 2
    assert ranks_per_node_of(1, 1, 2, 1, 2, size=4) is None  # numbered round-robin
    assert ranks_per_node_of(0, 0, 4, 0, 1, size=4) is None  # one host
    assert ranks_per_node_of(0, 0, 1, 0, 4, size=4) is None  # one rank per host
    # Hosts of 3 and 1 ranks: 3 x 2 != 4 and 3 x 1 != 4 on the first host.
    assert ranks_per_node_of(0, 0, 3, 0, 2, size=4) is None
    assert ranks_per_node_of(1, 1, 3, 0, 1, size=4) is None
