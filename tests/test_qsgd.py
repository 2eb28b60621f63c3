"""QSGD (Alistarh et al. 2017) against a hand-written numpy reference (ThreadWorld)."""

import numpy as np
import pytest

from solo_comm import FrameworkComm, SoloComm

import hvd_quant
from hvd_quant.core.backend import NumpyBackend, NumpyKernelBackend
from hvd_quant.core.compressor import ReduceContext
from hvd_quant.core.rng import CounterRNG, draws
from hvd_quant.core.runner import CompressorRunner
from hvd_quant.core.simulate import ThreadWorld

B = NumpyBackend()
K = NumpyKernelBackend()
MARGIN = 1.0 + 2.0 ** -8  # the scale's inflation (global_qsgd's l2 margin)
TINY = np.float32(1.1754944e-38)
FMAX = np.finfo(np.float32).max
OPTIONS = [{}, dict(bits=16), dict(levels=5), dict(bits=16, levels=1000), dict(block=None),
           dict(block=4), dict(bits=16, block=100), dict(levels=5, block=1001)]
SIZES = [0, 1, 7, 1001]


def reference(xs, seed, bits=None, levels=None, block=512):
    """QSGD written out in numpy: rank ``r`` scales each block of ``block`` elements (the
    whole buffer for ``None``) by its own ``||x_block|| * MARGIN``, rounds ``s |x| / norm``
    stochastically with the draws of the first call of the stream ``seed + 1_000_003 r``
    (the runner's seeding, one call over the whole buffer), and the mean estimate adds
    ``q_r * norm_r / (s n)`` in rank order (float32). Returns ``(estimate, levels)``."""
    width = bits or (8 if (levels or 0) <= 127 else 16)
    s = levels or 2 ** (width - 1) - 1
    n = len(xs)
    total = np.zeros(xs[0].size, np.float32)
    ints = []
    for r, x in enumerate(xs):
        step = block or max(x.size, 1)
        norms = [np.float32(np.sqrt(np.sum(x[i:i + step].astype(np.float64) ** 2)) * MARGIN)
                 for i in range(0, x.size, step)]
        norm = np.repeat(np.maximum(np.asarray(norms, np.float32), TINY),
                         [len(x[i:i + step]) for i in range(0, x.size, step)])
        u = draws(B, CounterRNG(seed + 1_000_003 * r).next_key(), x.size)
        v = np.clip(x / norm, np.float32(-1), np.float32(1)) * np.float32(s)
        q = np.floor(v) + (u < v - np.floor(v)).astype(np.float32)
        assert np.abs(q).max(initial=0) <= s
        ints.append(q.astype(f"int{width}"))
        total = total + ints[-1].astype(np.float32) * (norm / np.float32(s * n))
    return total, ints


def reduce_all(comp, xs, seed=0, backend=B):
    """``comp.reduce`` on every rank of a ThreadWorld, seeded as :func:`reference`;
    returns (result, meters, recorded collectives)."""
    world = ThreadWorld(len(xs))

    def body(comm):
        rng = backend.generator(seed + 1_000_003 * comm.rank)
        return comp.reduce(xs[comm.rank], ReduceContext(backend, comm, "buf", [("w", xs[0].size)], rng=rng))

    out = world.run(body)
    for o in out[1:]:  # every rank decodes the same rows in the same order: the same bits
        np.testing.assert_array_equal(o, out[0])
    return out[0], world.meters


def inputs(n, d, seed=0):
    rng = np.random.default_rng(seed + 31 * n + d)
    return [(rng.standard_normal(d) * rng.uniform(0.1, 3)).astype(np.float32) for _ in range(n)]


# --- options ---------------------------------------------------------------------------------
def test_options_and_widths():
    assert hvd_quant.get("qsgd").resolve() == (8, 127)  # sign and level in one byte
    assert hvd_quant.get("qsgd", bits=16).resolve() == (16, 32767)
    assert hvd_quant.get("qsgd", levels=200).resolve() == (16, 200)
    assert hvd_quant.get("qsgd", levels=3).resolve(64) == (8, 3)  # no world size enters
    assert "qsgd" in hvd_quant.available()
    # A norm per 512 elements by default, as the paper's experiments; None: one per buffer.
    assert hvd_quant.get("qsgd").options() == {"bits": None, "levels": None, "block": 512}
    assert hvd_quant.get("qsgd", block=None).options()["block"] is None
    assert hvd_quant.get("qsgd").fingerprint() != hvd_quant.get("qsgd", block=None).fingerprint()
    for opts in [dict(bits=4), dict(bits=32), dict(levels=0), dict(levels=2.5), dict(levels=True),
                 dict(bits=8, levels=128), dict(levels=40000), dict(norm="max"),
                 dict(block=0), dict(block=-1), dict(block=True), dict(block=2.5), dict(block="512")]:
        with pytest.raises(ValueError):
            hvd_quant.get("qsgd", **opts)


# --- against the reference ---------------------------------------------------------------------
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("d", SIZES)
def test_equals_the_reference_bit_for_bit_with_its_bytes(opts, n, d):
    xs = inputs(n, d)
    comp = hvd_quant.get("qsgd", **opts)
    got, meters = reduce_all(comp, xs, seed=4)
    want, _ = reference(xs, 4, **opts)
    np.testing.assert_array_equal(got, want)
    width, block = comp.resolve()[0], comp.block
    blocks = max(1, -(-d // block)) if block else 1
    for m in meters:  # one allgather of d w/8 bytes of levels + scale and pre (8 bytes a block)
        assert m.bytes_sent == comp.wire_bytes(d, n) == (n - 1) * (d * width // 8 + 8 * blocks)
        assert set(m.by_kind) <= {"allgather"}


@pytest.mark.parametrize("opts", [{}, dict(block=None)], ids=["default", "block=None"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_through_the_kernels_equals_the_oracle(n, opts):
    # The float64 sums of squares may add in another order: the norms agree to float32
    # rounding, and with them almost every level; the levels themselves are the same
    # fused quantizer global_qsgd uses.
    xs = inputs(n, 5003, seed=1)
    comp = hvd_quant.get("qsgd", **opts)
    got, _ = reduce_all(comp, xs, seed=2, backend=K)
    want, _ = reduce_all(comp, xs, seed=2)
    step = max(np.linalg.norm(x) for x in xs) * MARGIN / 127 / n
    assert np.mean(got == want) > 0.99 and np.max(np.abs(got - want)) <= step * (1 + 1e-5)


def test_collectives_match_the_code():
    from test_costmodel import CASES, model_list, recorded_compressor
    for n, k in CASES:
        for opts in ({}, dict(bits=16), dict(block=None), dict(block=1000)):
            for r, log in enumerate(recorded_compressor("qsgd", 4097, n, k, 3, opts)):
                assert log == model_list("qsgd", 4097, n, k, 3, opts, r)
    comp = hvd_quant.get("qsgd")
    assert comp.memory_bytes(1000, 4) > 0
    # Against global_qsgd at the same 8 bits: an allgather costs n / 2 times an allreduce,
    # and a scale and pre per 512 elements 1 + 8/512 times more.
    g = hvd_quant.get("global_qsgd", norm="l2", block=None)
    for n in (2, 4, 8, 16):
        ratio = comp.wire_bytes(10 ** 6, n) / g.wire_bytes(10 ** 6, n, int_dtypes=("int8",))
        assert ratio == pytest.approx(n / 2 * (1 + 8 / 512), rel=1e-3)
        one_norm = hvd_quant.get("qsgd", block=None).wire_bytes(10 ** 6, n)
        assert one_norm / g.wire_bytes(10 ** 6, n, int_dtypes=("int8",)) == pytest.approx(n / 2, rel=1e-3)


# --- unbiasedness and the paper's variance bound ------------------------------------------------
@pytest.mark.parametrize("n,opts", [(1, {}), (3, {}), (3, dict(levels=2)), (5, dict(levels=7)),
                                    (3, dict(levels=2, block=5))])
def test_unbiased_over_seeds_within_the_variance_bound(n, opts):
    """400 fixed seeds: the mean estimate's average is within 5 standard errors of the
    true mean per element, and its variance is within QSGD's bound (Lemma 3.1:
    ``E ||Q_s(x) - x||^2 <= min(d / s^2, sqrt(d) / s) ||x||^2``, independent over the
    workers, so the mean's is ``1 / n^2`` of the sum; ``||x||`` inflated by the margin).
    With ``block``, the bound holds block by block, with ``d`` the block's size."""
    d, trials = 12, 400
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(d).astype(np.float32) for _ in range(n)]
    for x in xs:
        x[[0, 1]] = [0.0, 1e-6]  # a zero and a tiny value in every rank
    comp = hvd_quant.get("qsgd", **opts)
    s = comp.resolve()[1]
    est = np.array([reduce_all(comp, xs, seed=1000 + t)[0] for t in range(trials)], np.float64)
    mean = np.mean(xs, axis=0, dtype=np.float64)
    stderr = est.std(axis=0) / np.sqrt(trials)
    # (+1e-5: the tiny element rounds up with probability ~1e-6 s / ||x||, never seen here)
    assert np.all(np.abs(est.mean(axis=0) - mean) <= 5 * stderr + 1e-5)
    assert np.all(est[:, 0] == 0)  # zero in every rank: exactly zero
    k = comp.block or d
    bound = sum(min(len(b) / s ** 2, np.sqrt(len(b)) / s) * (np.linalg.norm(b) * MARGIN) ** 2
                for x in xs for b in np.split(x, range(k, d, k))) / n ** 2
    measured = np.mean(np.sum((est - mean) ** 2, axis=1))
    assert measured <= 1.2 * bound  # 400 draws: a 20% margin on a mean of squares


# --- edge cases ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3])
def test_zeros_single_nonzero_and_near_max(n):
    comp = hvd_quant.get("qsgd")
    zeros = [np.zeros(7, np.float32) for _ in range(n)]
    est, _ = reduce_all(comp, zeros)
    assert np.all(est == 0)
    single = [z.copy() for z in zeros]
    single[n - 1][3] = -2.5  # on its own rank's grid the element is the norm / MARGIN
    est, _ = reduce_all(comp, single, seed=5)
    assert np.all(est[np.arange(7) != 3] == 0)
    assert abs(est[3] + 2.5 / n) <= 2.5 * MARGIN / 127 / n * (1 + 1e-6)
    # Near the float32 maximum the norm is carried scaled by 2**-64: finite, close.
    rng = np.random.default_rng(n)
    big = [(rng.choice([-1.0, 1.0], 1001) * FMAX * rng.uniform(0.25, 0.5, 1001)).astype(np.float32)
           for _ in range(n)]
    est, _ = reduce_all(comp, big, seed=6)
    assert np.isfinite(est).all()
    step = max(np.linalg.norm(x.astype(np.float64)) for x in big) * MARGIN / 127 / n
    assert np.max(np.abs(est - np.mean(np.asarray(big, np.float64), axis=0))) <= n * step


@pytest.mark.parametrize("opts", [{}, dict(block=4), dict(block=None)], ids=["default", "block=4", "block=None"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", ["normal", "zeros", "subnormal", "near_max"])
@pytest.mark.parametrize("d", [0, 1, 5, 13, 1001])
def test_awkward_inputs_as_the_other_compressors(n, kind, d, opts):
    from test_fault_sweep import test_compressors_on_awkward_inputs
    test_compressors_on_awkward_inputs("qsgd", opts, n, d, kind)


@pytest.mark.parametrize("opts", [{}, dict(bits=16), dict(block=8), dict(block=None)])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_one_non_finite_element_on_one_rank(opts, n, bad):
    """As every compressor (tests/test_fault_sweep.py's rule): NaN for the whole buffer on
    every rank; the random stream advances as on a finite step (one call); the next,
    finite step is the reference's."""
    d = 37
    xs = inputs(n, d)
    poisoned = [x.copy() for x in xs]
    poisoned[n - 1][11] = bad
    runners = [CompressorRunner(hvd_quant.get("qsgd", **opts), B, seed=1) for _ in range(n)]
    segs = [("w", 20), ("b", 17)]

    def body(c):
        r = runners[c.rank]
        out = r.reduce(poisoned[c.rank], c, "buf", segs)
        calls = r.rng_state().get(c.rank, 0)
        return out, calls, r.reduce(xs[c.rank], c, "buf", segs), r.rng_state().get(c.rank, 0)

    results = ThreadWorld(n).run(body)
    for out, calls, after, calls_after in results:
        assert out.shape == (d,) and np.isnan(out).all()
        assert calls == 1 and calls_after == 2
        np.testing.assert_array_equal(after, results[0][2])


# --- torch and TensorFlow -------------------------------------------------------------------
def framework_reduce(backend, xs, seed, wrap, unwrap, step=None, opts=None):
    world = ThreadWorld(len(xs))
    comp = hvd_quant.get("qsgd", **(opts or {}))

    def body(comm):
        ctx = ReduceContext(backend, FrameworkComm(comm, backend), "buf", [("w", xs[0].size)],
                            rng=backend.generator(seed + 1_000_003 * comm.rank))
        run = step or (lambda t: comp.reduce(t, ctx))
        return unwrap(run(wrap(xs[comm.rank])))
    return world.run(body)


@pytest.mark.parametrize("opts", [{}, dict(block=None)], ids=["default", "block=None"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_torch_equals_the_oracle_bit_for_bit(n, opts):
    torch = pytest.importorskip("torch")
    from hvd_quant.torch.backend import TorchBackend
    xs = inputs(n, 4099, seed=3)
    want_k, _ = reduce_all(hvd_quant.get("qsgd", **opts), xs, seed=8, backend=K)
    for out in framework_reduce(TorchBackend(), xs, 8, torch.from_numpy, lambda t: t.numpy(), opts=opts):
        np.testing.assert_array_equal(out, want_k)  # the same kernels and sums
    want, _ = reference(xs, 8, **opts)
    np.testing.assert_array_equal(want_k, want)  # and here the reference's bits


def test_torch_repeat_of_blocks_equals_numpy():
    """The blocks' scales spread over their elements: TorchBackend.repeat takes one count
    for equal blocks (the last perhaps shorter) and a tensor of them otherwise."""
    torch = pytest.importorskip("torch")
    from hvd_quant.torch.backend import TorchBackend
    values = np.arange(1, 6, dtype=np.float32)
    for counts in ([4, 4, 4, 4, 1], [4, 4, 4, 4, 4], [4, 4, 4, 4, 0], [0, 0, 0, 0, 0], [1, 2, 3, 4, 5],
                   [3, 3, 3, 3, 7], [2, 0, 2, 2, 2]):
        got = TorchBackend().repeat(torch.from_numpy(values), counts).numpy()
        np.testing.assert_array_equal(got, np.repeat(values, counts))
    got = TorchBackend().repeat(torch.tensor([2.5]), [3]).numpy()
    np.testing.assert_array_equal(got, [2.5, 2.5, 2.5])


@pytest.mark.parametrize("opts", [{}, dict(block=None)], ids=["default", "block=None"])
@pytest.mark.parametrize("n", [1, 3])
def test_tensorflow_eager_and_graph_equal_the_oracle(n, opts):
    tf = pytest.importorskip("tensorflow")
    from hvd_quant.tensorflow.backend import TFBackend
    tfb = TFBackend()
    xs = inputs(n, 4099, seed=3)
    want, _ = reduce_all(hvd_quant.get("qsgd", **opts), xs, seed=8, backend=K)
    for out in framework_reduce(tfb, xs, 8, tf.constant, np.asarray, opts=opts):
        np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(want, reference(xs, 8, **opts)[0])
    # Inside tf.function, one rank: a runner with its stream, three steps.
    segs = [("a", 1000), ("b", 3099)]
    want_runner = CompressorRunner(hvd_quant.get("qsgd", **opts), B, seed=3)
    runner = CompressorRunner(hvd_quant.get("qsgd", **opts), tfb, seed=3,
                              make_variable=lambda n, init: tf.Variable(init))
    runner.build(0, [("buf", segs)], size=1)
    step = tf.function(lambda x: runner.reduce(x, SoloComm(), "buf", segs), autograph=False)
    for s in range(3):
        x = inputs(1, 4099, seed=20 + s)[0]
        np.testing.assert_array_equal(np.asarray(step(tf.constant(x))),
                                      want_runner.reduce(x, SoloComm(), "buf", segs))


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_the_adapters_know_it(framework):
    pytest.importorskip(framework)
    hq = __import__(f"hvd_quant.{framework}", fromlist=["Compression"])
    assert "qsgd" in dir(hq.Compression)
    handle = hq.Compression.qsgd(bits=16)
    assert handle is not None
