"""Global-QSGD (linear and exponential dithering) against the numpy oracle (ThreadWorld)."""

import numpy as np
import pytest

from solo_comm import SoloComm

import hvd_quant
from hvd_quant.compressors.exp_dithering import (
    EXP_MAX_WORLD, ExpDitheringSum, combine_codes, exp_decode, exp_encode)
from hvd_quant.compressors.global_qsgd import (
    L2_SCALE_MARGIN, finish_scale, linear_dequantize, linear_quantize, max_levels,
    resolve_width_levels, stochastic_round, sum_bound)
from hvd_quant.core.backend import NumpyBackend, NumpyKernelBackend
from hvd_quant.core.compressor import ReduceContext
from hvd_quant.core.packing import pack_lanes, unpack_lanes
from hvd_quant.core.rng import CounterRNG, draws
from hvd_quant.core.simulate import ThreadWorld

B = NumpyBackend()
U_MAX = np.float32(1 - 2.0 ** -24)  # largest float32 below 1: never rounds a fraction up
TORCH_INTS = ("int32", "int64")  # torch's Horovod: no int8/int16 sum -> lane packing
NATIVE_INTS = ("int8", "int16", "int32", "int64")
LINEAR = [dict(norm="max"), dict(norm="l2"), dict(norm="max", bits=16),
          dict(norm="l2", bits=16), dict(norm="max", levels=5), dict(norm="max", block=4),
          dict(norm="l2", block=4)]


def reduce_all(comp, xs, seed=0, int_dtypes=None, backend=B, wrap=None):
    """``comp.reduce`` on every rank of a ThreadWorld; returns (results, meters). ``wrap``
    makes a rank's communicator take ``backend``'s tensors (and the input is converted)."""
    world = ThreadWorld(len(xs))

    def body(comm):
        if int_dtypes is not None:
            comm.allreduce_int_dtypes = int_dtypes
        rng = backend.generator(seed + 1_000_003 * comm.rank)
        x = xs[comm.rank] if wrap is None else backend.constant(xs[comm.rank], "float32")
        c = comm if wrap is None else wrap(comm, backend)
        c.allreduce_int_dtypes = comm.allreduce_int_dtypes
        out = comp.reduce(x, ReduceContext(backend, c, "buf", [("w", xs[0].size)], rng=rng))
        return out if wrap is None else backend.to_numpy(out)

    out = world.run(body)
    for o in out[1:]:  # every rank must hold bit-identical results
        np.testing.assert_array_equal(o, out[0])
    return out[0], world.meters


def linear_scale(xs, norm):
    if norm == "max":
        return max(float(np.abs(x).max()) for x in xs)
    return float(np.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in xs))) * L2_SCALE_MARGIN


def code_values(codes):
    """float64 value of each uint8 code: sign * 2**(1 - c), 0 for c = 0."""
    c = codes.astype(np.int64)
    mag = np.where(c & 127, 2.0 ** (1 - (c & 127)), 0.0)
    return np.where(c >> 7, -mag, mag)


# --- options and level rules --------------------------------------------------------------
def test_level_rules():
    for n in range(1, 257):
        assert max_levels("max", n, 8) == 127 // n and max_levels("max", n, 16) == 32767 // n
        for w in (8, 16):
            s, limit = max_levels("l2", n, w), 2 ** (w - 1) - 1
            assert s >= max_levels("max", n, w)
            assert sum_bound("l2", n, s) <= limit < sum_bound("l2", n, s + 1)
    assert resolve_width_levels("max", 64) == (8, 1) and resolve_width_levels("max", 128) == (16, 255)
    assert resolve_width_levels("l2", 64) == (8, 8) and resolve_width_levels("l2", 4) == (8, 62)
    assert resolve_width_levels("max", 4, levels=100) == (16, 100)


@pytest.mark.parametrize("name,opts", [
    ("global_qsgd", dict(norm="l3")), ("global_qsgd", dict(bits=4)), ("global_qsgd", dict(bits=32)),
    ("global_qsgd", dict(levels=0)), ("global_qsgd", dict(levels=2.5)),
    ("global_qsgd", dict(levels=True)), ("global_qsgd", dict(dithering="exponential")),
    ("global_qsgd", dict(block=0)), ("global_qsgd", dict(block=-1)), ("global_qsgd", dict(block=True)),
    ("global_qsgd", dict(block=2.5)), ("global_qsgd", dict(block="512")),
    ("global_qsgd_exp", dict(bits=8))])
def test_unknown_options_raise(name, opts):
    with pytest.raises(ValueError):
        hvd_quant.get(name, **opts)


def test_unsafe_world_sizes_raise():
    hvd_quant.get("global_qsgd", bits=8, levels=63).validate(2)
    for opts, n in [(dict(bits=8, levels=64), 2), (dict(bits=8), 128), (dict(levels=40000), 1),
                    (dict(norm="l2", bits=8, levels=90), 2), (dict(bits=16), 40000)]:
        with pytest.raises(ValueError, match="overflow"):
            hvd_quant.get("global_qsgd", **opts).validate(n)
    hvd_quant.get("global_qsgd_exp").validate(EXP_MAX_WORLD)
    with pytest.raises(ValueError):
        hvd_quant.get("global_qsgd_exp").validate(EXP_MAX_WORLD + 1)
    with pytest.raises(ValueError):  # also raised by reduce, on every rank
        reduce_all(hvd_quant.get("global_qsgd", bits=8, levels=64), [np.ones(4, np.float32)] * 2)


# --- a shared scale per block ---------------------------------------------------------------
def block_reference(xs, seed, norm="max", block=None):
    """Global-QSGD with one shared scale per block, written out in numpy: each block of
    ``block`` elements (the whole buffer for ``None``) takes the max over ranks of its
    ``max|x|`` (``max``) or ``sqrt`` of the ranks' float64 sums of squares times the margin
    (``l2``), at least the smallest normal float32; rank ``r`` rounds ``s x / scale``
    stochastically with the draws of the first call of the stream ``seed + 1_000_003 r``
    (one call over the whole buffer); the integer sum times ``scale / (s n)`` is the
    estimate. Returns ``(estimate, summed levels)``."""
    n, d = len(xs), xs[0].size
    _, s = resolve_width_levels(norm, n)
    step = block or max(d, 1)
    starts = range(0, d, step)
    if norm == "max":
        scales = [max(float(np.abs(x[i:i + step]).max()) for x in xs) for i in starts]
    else:
        scales = [np.sqrt(sum(np.sum(x[i:i + step].astype(np.float64) ** 2) for x in xs)) * L2_SCALE_MARGIN
                  for i in starts]
    scale = np.repeat(np.maximum(np.asarray(scales, np.float32), np.float32(1.1754944e-38)),
                      [len(xs[0][i:i + step]) for i in starts])
    total = np.zeros(d, np.int64)
    for r, x in enumerate(xs):
        u = draws(B, CounterRNG(seed + 1_000_003 * r).next_key(), d)
        v = np.clip(x / scale, np.float32(-1), np.float32(1)) * np.float32(s)
        total += (np.floor(v) + (u < v - np.floor(v))).astype(np.int64)
    return total.astype(np.float32) * (scale / np.float32(s * n)), total


BLOCKS = [(norm, block) for norm in ("max", "l2") for block in (None, 1, 4, 100, 1000, 1001, 4096)]


@pytest.mark.parametrize("norm,block", BLOCKS)
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("int_dtypes", [None, TORCH_INTS], ids=["native", "lanes"])
def test_blocks_equal_the_reference_bit_for_bit(norm, block, n, int_dtypes):
    """``block``: each block's scale is shared by every rank, so the integers still add up
    in one allreduce; the generic path and the fused CPU kernels give the reference's bits,
    with the blocks' scales (and the wire's bytes: 4 or 8 more per block) on the meter."""
    rng = np.random.default_rng(n)
    d = 1001
    xs = [(rng.standard_normal(d) * np.repeat(rng.uniform(1e-3, 10, 11), 91)).astype(np.float32)
          for _ in range(n)]
    comp = hvd_quant.get("global_qsgd", norm=norm, block=block)
    want, total = block_reference(xs, 7, norm, block)
    assert np.abs(total).max() <= 2 ** (comp.resolve(n)[0] - 1) - 1  # the level rule, per block
    for backend in (B, NumpyKernelBackend()):
        got, meters = reduce_all(comp, xs, seed=7, int_dtypes=int_dtypes, backend=backend)
        np.testing.assert_array_equal(got, want)
        for m in meters:
            assert m.bytes_sent == pytest.approx(comp.wire_bytes(d, n, int_dtypes=int_dtypes or NATIVE_INTS))
    blocks = -(-d // block) if block and block < d else 1
    assert comp.blocks(d) == blocks
    ring = 2 * (n - 1) / n
    extra = (blocks - 1) * (ring * 4 if norm == "max" else (n - 1) * 8)  # the blocks' scales
    one_scale = hvd_quant.get("global_qsgd", norm=norm, block=None).wire_bytes(d, n)
    assert comp.wire_bytes(d, n) == pytest.approx(one_scale + extra)


@pytest.mark.parametrize("norm", ["max", "l2"])
def test_blocks_shrink_the_error_of_unequal_magnitudes(norm):
    """What the blocks are for: where magnitudes differ across the buffer (a gradient's
    layers), one scale for all of it leaves the small values a level or two of a grid made
    for the largest; a scale per block gives each block its own grid. Fixed seeds, 3 ranks,
    ten blocks of magnitudes 1e-3 to 10: the relative error of the five smallest."""
    rng = np.random.default_rng(5)
    xs = [(rng.standard_normal(5120) * np.repeat(np.logspace(-3, 1, 10), 512)).astype(np.float32)
          for _ in range(3)]
    small = np.mean(xs, axis=0, dtype=np.float64)[:2560]
    err = {}
    for block in (None, 512):
        est, _ = reduce_all(hvd_quant.get("global_qsgd", norm=norm, block=block), xs, seed=2)
        err[block] = np.linalg.norm(est[:2560] - small) / np.linalg.norm(small)
    assert err[512] < err[None] / 10, err


@pytest.mark.parametrize("n", [3, 8])
def test_exponential_dithering_needs_no_blocks(n):
    """Why ``global_qsgd_exp`` has no ``block``: its codes are powers of two relative to
    the value (one binade's stochastic rounding), so the shared max only sets the top of a
    range of at least 24 binades, and the small blocks' relative error is the large ones'.
    The case of the test above: ten blocks of magnitudes 1e-3 to 10 (the error of the
    mean over 2,560 elements each: the ratio of the halves is within a few percent)."""
    rng = np.random.default_rng(5)
    xs = [(rng.standard_normal(5120) * np.repeat(np.logspace(-3, 1, 10), 512)).astype(np.float32)
          for _ in range(n)]
    mean = np.mean(xs, axis=0, dtype=np.float64)
    est, _ = reduce_all(hvd_quant.get("global_qsgd_exp"), xs, seed=2)
    small, large = (np.linalg.norm(est[s] - mean[s]) / np.linalg.norm(mean[s])
                    for s in (slice(0, 2560), slice(2560, 5120)))
    assert 0.8 < small / large < 1.25, (small, large)


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.parametrize("norm", ["max", "l2"])
def test_blocks_in_the_frameworks_equal_numpy(framework, norm):
    """The torch and TensorFlow backends (eager) give the numpy backends' bits with
    blocks, native integers and lane-packed words alike."""
    from solo_comm import FrameworkComm
    if framework == "torch":
        pytest.importorskip("torch")
        from hvd_quant.torch.backend import TorchBackend as Backend
    else:
        pytest.importorskip("tensorflow")
        from hvd_quant.tensorflow.backend import TFBackend as Backend
    xs = [np.random.default_rng(r).standard_normal(1001).astype(np.float32) * (r + 1) for r in range(3)]
    comp = hvd_quant.get("global_qsgd", norm=norm, block=100)
    for int_dtypes in (TORCH_INTS, NATIVE_INTS):
        want, _ = reduce_all(comp, xs, seed=4, int_dtypes=int_dtypes)
        got, _ = reduce_all(comp, xs, seed=4, int_dtypes=int_dtypes, backend=Backend(), wrap=FrameworkComm)
        np.testing.assert_array_equal(got, want)
    if framework == "tensorflow":  # and inside tf.function: one rank, a runner, three steps
        import tensorflow as tf
        from hvd_quant.core.runner import CompressorRunner
        segs = [("a", 1000), ("b", 3099)]
        want_runner = CompressorRunner(comp, B, seed=3)
        runner = CompressorRunner(comp, Backend(), seed=3, make_variable=lambda n, init: tf.Variable(init))
        runner.build(0, [("buf", segs)], size=1)
        step = tf.function(lambda x: runner.reduce(x, SoloComm(), "buf", segs), autograph=False)
        for s in range(3):
            x = np.random.default_rng(s).standard_normal(4099).astype(np.float32) * np.float32(10.0 ** (s - 1))
            np.testing.assert_array_equal(np.asarray(step(tf.constant(x))),
                                          want_runner.reduce(x, SoloComm(), "buf", segs))


# --- exactness ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("int_dtypes", [None, TORCH_INTS])
def test_every_rank_at_the_max_is_exact_where_the_reference_wraps(n, int_dtypes):
    m = np.float32(0.75)
    x = np.array([m, -m, m, 0, -m], np.float32)
    est, _ = reduce_all(hvd_quant.get("global_qsgd"), [x] * n, int_dtypes=int_dtypes)
    np.testing.assert_allclose(est, x, rtol=1e-6)


def test_reference_rule_wraps_for_every_world_size_and_ours_never():
    # The reference maps the max to 127/n levels: with 127 prime that is a fraction for
    # 2 <= n <= 126, and when every rank rounds it up the int8 sum exceeds 127 and wraps.
    for n in range(2, 127):
        up = np.zeros(n, np.float32)  # u = 0: every fraction rounds up
        ref = stochastic_round(B, np.full(n, 127 / n, np.float32), up).astype(np.int8)
        assert int(ref.astype(np.int64).sum()) > 127 and ref.sum(dtype=np.int8) < 0
        ours = linear_quantize(B, np.ones(n, np.float32), np.ones(1, np.float32),
                               max_levels("max", n, 8), up, "int8")
        assert int(ours.sum(dtype=np.int8)) == int(ours.astype(np.int64).sum()) <= 127


@pytest.mark.parametrize("name,opts",
                         [("global_qsgd", o) for o in LINEAR] + [("global_qsgd_exp", {})])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_zero_and_single_nonzero(name, opts, n):
    comp = hvd_quant.get(name, **opts)
    zeros = [np.zeros(7, np.float32) for _ in range(n)]
    est, _ = reduce_all(comp, zeros)
    assert np.all(est == 0) and not np.isnan(est).any()
    single = [z.copy() for z in zeros]
    single[n - 1][3] = -2.5
    est, _ = reduce_all(comp, single, seed=5)
    mean = np.mean(single, axis=0)
    if opts.get("norm") == "l2":  # not on the grid (scale = |x| * (1 + 2**-8)): bounded
        assert np.all(est[np.arange(7) != 3] == 0)
        assert abs(est[3] - mean[3]) <= linear_scale(single, "l2") / comp.resolve(n)[1]
    else:  # the max is a grid point and a zero operand passes through every hop
        np.testing.assert_allclose(est, mean, rtol=1e-6)


def test_exp_two_ranks_at_the_max_is_exact():
    x = np.array([1.5, -1.5, 0.0], np.float32)
    est, _ = reduce_all(hvd_quant.get("global_qsgd_exp"), [x, x])
    np.testing.assert_allclose(est, x, rtol=1e-6)


# --- unbiasedness and error bounds -------------------------------------------------------------
@pytest.mark.parametrize("name,opts,n,int_dtypes", [
    ("global_qsgd", dict(norm="max"), 3, None), ("global_qsgd", dict(norm="max"), 4, TORCH_INTS),
    ("global_qsgd", dict(norm="l2"), 3, None),
    ("global_qsgd", dict(norm="l2", bits=16), 2, TORCH_INTS),
    ("global_qsgd_exp", {}, 3, None), ("global_qsgd_exp", {}, 4, None),
    ("global_qsgd_exp", {}, 5, None), ("global_qsgd_exp", {}, 8, None)])  # from 5: direct
def test_unbiased_per_element(name, opts, n, int_dtypes):
    rng = np.random.default_rng(n)
    base = [rng.standard_normal(12).astype(np.float32) for _ in range(n)]
    for b in base:
        b[[0, 1]] = [0.0, 1e-6]  # a zero and a tiny value in every rank
    trials = 4000  # tiled: element j of every tile is an independent draw
    est, _ = reduce_all(hvd_quant.get(name, **opts), [np.tile(b, trials) for b in base],
                        seed=11, int_dtypes=int_dtypes)
    est = est.reshape(trials, -1).astype(np.float64)
    mean = np.mean(base, axis=0, dtype=np.float64)
    stderr = est.std(axis=0) / np.sqrt(trials)
    assert np.all(np.abs(est.mean(axis=0) - mean) <= 5 * stderr + 1e-5)


@pytest.mark.parametrize("opts", LINEAR)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_linear_error_bound(opts, n):
    # |Q - sum v| < n (each rank errs by < 1 level), so |est - mean| < scale / s.
    rng = np.random.default_rng(n)
    xs = [(rng.standard_normal(300) * rng.uniform(0.1, 3)).astype(np.float32) for _ in range(n)]
    comp = hvd_quant.get("global_qsgd", **opts)
    est, _ = reduce_all(comp, xs, seed=3)
    bound = linear_scale(xs, opts["norm"]) / comp.resolve(n)[1]
    assert np.max(np.abs(est - np.mean(xs, axis=0))) <= bound * (1 + 1e-5)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_exp_bounds_and_signs(n):
    # Partial results stand for m ranks and stay <= 2**(m-n) (headroom), so
    # |est| <= M 2**(n-1) / n; hops never flip the sign of same-signed inputs.
    rng = np.random.default_rng(n)
    xs = [np.abs(rng.standard_normal(2000)).astype(np.float32) for _ in range(n)]
    for x in xs:
        x[1000:] *= -1
    est, _ = reduce_all(hvd_quant.get("global_qsgd_exp"), xs, seed=2)
    m = max(float(np.abs(x).max()) for x in xs)
    assert np.all(np.abs(est) <= m * 2.0 ** (n - 1) / n * (1 + 1e-6))
    assert np.all(est[:1000] > 0) and np.all(est[1000:] < 0)


# --- overflow: direct simulation of the integer sums up to 256 ranks ----------------------------
def worst_inputs(n):
    """Per-rank inputs (n, d): every rank equal at one coordinate (tight for both norms),
    mixed signs, and random data."""
    rng = np.random.default_rng(n)
    tight = np.zeros((n, 4), np.float32)
    tight[:, 0], tight[:, 1] = 1.0, -1.0
    rand = rng.standard_normal((n, 5)).astype(np.float32)
    rand[:, 0] = 2.0
    return [tight[:, :1], -tight[:, :1], tight, rand]


@pytest.mark.parametrize("norm", ["max", "l2"])
@pytest.mark.parametrize("bits", [None, 16])
def test_integer_sums_never_overflow_up_to_256_ranks(norm, bits):
    for n in [2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256]:
        width, s = resolve_width_levels(norm, n, bits)
        limit = 2 ** (width - 1) - 1
        for xs in worst_inputs(n):
            stat = np.abs(xs).max() if norm == "max" else np.sum(xs.astype(np.float32) ** 2)
            scale, _ = finish_scale(B, np.reshape(np.float32(stat), (1,)), norm)
            for u in (np.float32(0), U_MAX):  # every fraction rounded up, or down
                q = np.stack([linear_quantize(B, x, scale, s, np.full(x.size, u), "int64")
                              for x in xs])
                assert np.abs(q).max() <= s
                # Partial sums over every cyclic run of ranks (any ring chunk's path).
                twice = np.concatenate([q, q])
                worst = max(np.abs(np.cumsum(twice[r:r + n], axis=0)).max() for r in range(n))
                assert worst <= sum_bound(norm, n, s) <= limit
                native = q.astype(f"int{width}").sum(axis=0, dtype=f"int{width}")
                np.testing.assert_array_equal(native, q.sum(axis=0))
                words = sum(pack_lanes(B, qi, width, add_offset=(r == 0)) for r, qi in enumerate(q))
                unpacked = unpack_lanes(B, words, q.shape[1], width)
                np.testing.assert_array_equal(unpacked, q.sum(axis=0))


def chain(codes, u):
    """Sequential reduction, as along a ring: fold rank i's codes into the running result."""
    out = codes[0]
    for i in range(1, len(codes)):
        out = combine_codes(B, codes[i], out, u[i - 1])
    return out


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 16, 25, 64, EXP_MAX_WORLD])
def test_exp_headroom_never_overflows(n):
    m, d = np.ones(1, np.float32), 4000
    rng = np.random.default_rng(n)
    codes = [exp_encode(B, np.ones(d, np.float32), m, n, rng.random(d, dtype=np.float32))
             for _ in range(n)]
    assert np.all(codes[0] == n)  # every rank at the max: 2**(1-n), code n
    out = chain(codes, rng.random((n, d), dtype=np.float32))
    assert np.all((out & 127) >= 1)  # a positive sum never becomes zero: no overflow
    # Forced worst case: every hop rounds up while it can (probability >= 2**-24).
    worst = chain(codes, np.full((n, d), U_MAX))
    assert np.all(worst == (1 if n <= 26 else n - 25))


def test_reference_headroom_overflows_on_a_ring():
    # Reference normalisation N = 2 n M: z = 1/n against a largest magnitude of 1.
    n, d = 3, 200_000
    rng = np.random.default_rng(0)
    codes = [exp_encode(B, np.full(d, 1 / n, np.float32), np.ones(1, np.float32), 1,
                        rng.random(d, dtype=np.float32)) for _ in range(n)]
    overflow = np.mean((chain(codes, rng.random((n, d), dtype=np.float32)) & 127) == 0)
    assert abs(overflow - 1 / 9) < 5 * np.sqrt(1 / 9 * 8 / 9 / d)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_exp_ring_every_rank_at_the_max(n):
    x = np.full(5000, -3.0, np.float32)
    est, _ = reduce_all(hvd_quant.get("global_qsgd_exp"), [x] * n, seed=n)
    assert np.all(est < 0) and np.all(est >= -3.0 * 2.0 ** (n - 1) / n)
    assert abs(est.mean() + 3.0) < 0.1


# --- the exponential-dithering operator and codes -----------------------------------------------
def test_combine_is_unbiased_for_every_pair_of_codes():
    a, b = (g.reshape(-1).astype(np.uint8) for g in np.meshgrid(np.arange(256), np.arange(256)))
    va, vb = code_values(a), code_values(b)
    keep = np.abs(va) + np.abs(vb) <= 1  # within the headroom guarantee
    a, b, total = a[keep], b[keep], (va + vb)[keep]
    lo = code_values(combine_codes(B, a, b, np.zeros(a.size, np.float32)))
    hi = code_values(combine_codes(B, a, b, np.full(a.size, U_MAX)))
    det = lo == hi
    # Deterministic: exact, except jumps of probability below the uniform grid (<= 2**-25).
    assert np.all(np.abs(lo[det] - total[det]) <= 2.0 ** -25 * np.abs(lo[det]))
    p = (total[~det] - lo[~det]) / (hi[~det] - lo[~det])
    assert np.all(np.log2(p) == np.round(np.log2(p))) and np.all((p > 0) & (p <= 1))
    # It jumps exactly when u >= 1 - p: probability p, so E = lo + p (hi - lo) = a + b.
    thr = (1 - p).astype(np.float32)
    at = code_values(combine_codes(B, a[~det], b[~det], thr))
    below = code_values(combine_codes(B, a[~det], b[~det], np.nextafter(thr, np.float32(0))))
    np.testing.assert_array_equal(at, hi[~det])
    np.testing.assert_array_equal(below[p < 1], lo[~det][p < 1])
    # Commutative in distribution; equal magnitudes of opposite sign cancel exactly.
    ba = code_values(combine_codes(B, b, a, np.full(a.size, U_MAX)))
    np.testing.assert_array_equal(ba, hi)
    assert ExpDitheringSum().unit == 1


def test_encode_rounds_to_neighbouring_powers_without_bias():
    rng = np.random.default_rng(0)
    z = np.concatenate([rng.uniform(-1, 1, 2000) * 10.0 ** rng.uniform(-40, 0, 2000),
                        [0.0, 1.0, -1.0, 2.0 ** -126, 3e-39, -1e-45]]).astype(np.float32)
    one = np.ones(1, np.float32)
    up = code_values(exp_encode(B, z, one, 1, np.zeros(z.size, np.float32)))
    down = code_values(exp_encode(B, z, one, 1, np.full(z.size, U_MAX)))
    az = np.abs(z).astype(np.float64)
    assert np.all(np.abs(down) <= az) and np.all(az <= np.abs(up))
    assert np.all((up == down) | (np.abs(up) == np.where(down == 0, 2.0 ** -126, 2 * np.abs(down))))
    assert np.all(np.sign(up) * np.sign(z) >= 0)
    gap = np.abs(up - down)
    p = np.divide(az - np.abs(down), gap, out=np.zeros_like(gap), where=gap > 0)
    # Rounds up exactly when u < p (p is on the 2**-23 grid): E = down + p (up - down) = z.
    mid = code_values(exp_encode(B, z, one, 1, p.astype(np.float32)))
    np.testing.assert_array_equal(mid, down)
    assert np.all(p.astype(np.float32) == p)
    before = np.nextafter(p.astype(np.float32), np.float32(0))
    jumps = p > 0
    np.testing.assert_array_equal(code_values(exp_encode(B, z, one, 1, before))[jumps], up[jumps])


def test_decode_values():
    codes = np.arange(256).astype(np.uint8)
    np.testing.assert_array_equal(exp_decode(B, codes, np.ones(1, np.float32), 1), code_values(codes))
    np.testing.assert_allclose(exp_decode(B, codes, np.full(1, 3, np.float32), 4),
                               code_values(codes) * 3 * 8 / 4, rtol=1e-7)


# --- transport: lanes, wire bytes -------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("opts", LINEAR)
def test_lane_path_equals_native_and_wire_bytes(n, opts):
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(1001).astype(np.float32) for _ in range(n)]
    comp = hvd_quant.get("global_qsgd", **opts)
    native, meters_n = reduce_all(comp, xs, seed=9)
    lanes, meters_l = reduce_all(comp, xs, seed=9, int_dtypes=TORCH_INTS)
    np.testing.assert_array_equal(lanes, native)
    for m in meters_n:
        assert m.bytes_sent == pytest.approx(comp.wire_bytes(1001, n, int_dtypes=NATIVE_INTS))
    for m in meters_l:
        assert m.bytes_sent == pytest.approx(comp.wire_bytes(1001, n))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_exp_wire_bytes(n):
    comp = hvd_quant.get("global_qsgd_exp")
    _, meters = reduce_all(comp, [np.ones(1001, np.float32)] * n)
    assert np.mean([m.bytes_sent for m in meters]) == pytest.approx(comp.wire_bytes(1001, n))
    # Up to 4 ranks a ring of hops; from 5 one alltoall and one allgather of the codes.
    kinds = set(meters[0].by_kind)
    assert kinds <= ({"allreduce", "sendrecv"} if n < 5 else {"allreduce", "alltoall", "allgather"})


def get_backend(name):
    if name == "numpy":
        return B
    pytest.importorskip(name)
    if name == "torch":
        from hvd_quant.torch.backend import TorchBackend
        return TorchBackend()
    from hvd_quant.tensorflow.backend import TFBackend
    return TFBackend()


@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("backend_name", ["numpy", "torch"])
def test_lane_round_trip_and_sums(width, backend_name):
    limit = 2 ** (width - 1) - 1
    rng = np.random.default_rng(width)
    backend = get_backend(backend_name)

    def to(a):
        return backend.constant(a, "int32")

    every = np.arange(-limit, limit + 1, dtype=np.int32)
    for shift in range(32 // width):  # every value in every lane position
        vals = np.roll(every, shift)
        back = unpack_lanes(backend, pack_lanes(backend, to(vals), width, True), vals.size, width)
        np.testing.assert_array_equal(backend.to_numpy(back), vals)
    for n in (2, 3, 4, 7):
        k = limit // n
        q = rng.integers(-k, k + 1, (n, 999)).astype(np.int32)
        q[:, :8], q[:, 8:16] = k, -k  # worst cases
        words = [pack_lanes(backend, to(qi), width, add_offset=(r == 0)) for r, qi in enumerate(q)]
        partial = np.cumsum([backend.to_numpy(w).astype(np.int64) for w in words], axis=0)
        assert np.abs(partial).max() < 2 ** 31  # no int32 wrap-around on the way
        total = words[0]
        for w in words[1:]:
            total = total + w
        out = backend.to_numpy(unpack_lanes(backend, total, 999, width))
        np.testing.assert_array_equal(out, q.sum(axis=0))


# --- the same code on torch and TensorFlow (inside tf.function) ------------------------------------
def kernel_inputs():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-30, 1, 4096)).astype(np.float32)
    u = rng.random((2, 4096), dtype=np.float32)
    a = rng.integers(0, 256, 4096).astype(np.uint8)
    return x, np.full(1, np.abs(x).max(), np.float32), u, a, rng.permutation(a)


def kernels(backend, x, scale, u, a, b, n=3):
    q = linear_quantize(backend, x, scale, 42, u[0], "int8")
    return (q, linear_dequantize(backend, q, scale, 42, n), exp_encode(backend, x, scale, n, u[1]),
            exp_decode(backend, a, scale, n), combine_codes(backend, a, b, u[0]))


def check_backend(backend, run):
    args = kernel_inputs()
    expected = kernels(B, *args)
    for got, want in zip(run(args), expected):
        np.testing.assert_array_equal(backend.to_numpy(got), want)
    for name, opts in [("global_qsgd", dict(norm="max")), ("global_qsgd", dict(norm="l2")),
                       ("global_qsgd_exp", {})]:
        comp = hvd_quant.get(name, **opts)
        ctx = ReduceContext(backend, SoloComm(), "b", [("w", 4096)], rng=backend.generator(1))
        x = args[0]
        est = backend.to_numpy(run(None, lambda t: comp.reduce(t, ctx)))
        if name == "global_qsgd_exp":  # a power-of-two rounding errs by less than |x|
            bound = np.abs(x).max()
        else:  # n = 1: 127 levels
            bound = linear_scale([x], opts["norm"]) / 127
        assert np.max(np.abs(est - x)) <= bound * (1 + 1e-6)


def test_torch_backend_matches_numpy():
    torch = pytest.importorskip("torch")
    from hvd_quant.torch.backend import TorchBackend
    tb = TorchBackend()

    def run(args, fn=None):
        if fn is not None:
            return fn(torch.as_tensor(kernel_inputs()[0]))
        return kernels(tb, *(torch.as_tensor(a) for a in args))
    check_backend(tb, run)


def test_tensorflow_backend_matches_numpy_inside_tf_function():
    tf = pytest.importorskip("tensorflow")
    from hvd_quant.tensorflow.backend import TFBackend
    tfb = TFBackend()

    def run(args, fn=None):
        if fn is not None:
            return tf.function(fn)(tf.constant(kernel_inputs()[0]))
        return tf.function(lambda *t: kernels(tfb, *t))(*(tf.constant(a) for a in args))
    check_backend(tfb, run)


@pytest.mark.parametrize("name,opts", [("global_qsgd", dict(norm="max")),
                                       ("global_qsgd", dict(norm="l2")), ("global_qsgd_exp", {})])
@pytest.mark.parametrize("d", [0, 1, 2])
@pytest.mark.parametrize("int_dtypes", [None, TORCH_INTS])
def test_tiny_buffers(name, opts, d, int_dtypes):
    xs = [np.full(d, r + 1.0, np.float32) for r in range(3)]
    est, _ = reduce_all(hvd_quant.get(name, **opts), xs, int_dtypes=int_dtypes)
    assert est.shape == (d,) and est.dtype == np.float32 and np.all(np.isfinite(est))


@pytest.mark.parametrize("options", LINEAR[:3], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("int_dtypes", [TORCH_INTS, NATIVE_INTS], ids=["lanes", "native"])
def test_a_small_wire_at_many_ranks_is_summed_by_allgather_with_the_same_bits(monkeypatch, options,
                                                                              int_dtypes):
    """From 5 ranks on a small wire of levels goes by one allgather and a local sum in rank
    order (sum_levels): the integers are exact in any order, so the result is the
    allreduce's, bit for bit; only the collective and its bytes differ."""
    import hvd_quant.compressors.global_qsgd as gq
    n, d = 6, 1001
    xs = [np.random.default_rng(40 + r).standard_normal(d).astype(np.float32) for r in range(n)]
    xs[2][7] = 30.0  # one rank holds the global maximum: every partial sum near the bound
    comp = hvd_quant.get("global_qsgd", **options)
    gathered, meters = reduce_all(comp, xs, seed=3, int_dtypes=int_dtypes)
    width, _ = comp.resolve(n)
    payload = gq.int_payload_bytes(d, width, int_dtypes)
    assert gq.gathers(n, payload)
    levels_kind = {"max": "allreduce", "l2": "allgather"}[options["norm"]]  # the scale's
    assert set(meters[0].by_kind) == {"allgather"} | {levels_kind}
    assert meters[0].bytes_sent == pytest.approx(comp.wire_bytes(d, n, int_dtypes=int_dtypes))
    monkeypatch.setattr(gq, "gathers", lambda n, row: False)
    reduced, meters = reduce_all(comp, xs, seed=3, int_dtypes=int_dtypes)
    np.testing.assert_array_equal(gathered, reduced)
    assert meters[0].by_kind.get("allreduce", 0) > 0
    # Below 5 ranks, and for a large wire, the allreduce.
    assert not gq.gathers(4, payload) and not gq.gathers(16, 10 ** 6)


def test_exp_dithering_gathers_a_small_buffer_and_adds_the_decoded_rows():
    """global_qsgd_exp from 5 ranks on, small buffer: the scale allreduce, one allgather of
    every rank's codes, and the sum of the n decoded rows in rank order (no stochastic
    sum), identical on every rank; the cost model's bytes."""
    from hvd_quant.compressors.exp_dithering import encode
    n, d = 6, 1001
    xs = [np.random.default_rng(60 + r).standard_normal(d).astype(np.float32) for r in range(n)]
    comp = hvd_quant.get("global_qsgd_exp")
    got, meters = reduce_all(comp, xs, seed=5)
    scale = B.full(1, max(float(np.abs(x).max()) for x in xs))
    want = None
    for r in range(n):
        codes = encode(B, xs[r], scale, n, B.generator(5 + 1_000_003 * r))
        part = exp_decode(B, codes, scale, n)
        want = part if want is None else want + part
    np.testing.assert_array_equal(got, want)
    assert set(meters[0].by_kind) == {"allreduce", "allgather"}
    assert meters[0].bytes_sent == pytest.approx(comp.wire_bytes(d, n))
