"""The Triton kernels (hvd_quant.kernels.gpu) under Triton's interpreter, without a GPU.

Every GPU primitive runs on CPU tensors (``kernels.gpu_interpreted()``: the module's
kernels defined with ``TRITON_INTERPRET=1``) against the numba kernels
(hvd_quant.kernels.cpu) and the numpy oracle (the generic implementations on
``NumpyBackend``): bit for bit (NaN for NaN, and the sign of zero), except the float64
per-segment sums, which add in another order (a few float64 ulps). Sizes around the
Triton kernels' program sizes (``gpu.BLOCK`` element-wise, ``TILE`` elements or
``TILE / 8`` bytes for the segment and bit kernels) and the CPU kernels' ``BLOCK`` where
their sums change shape; segment layouts with empty segments, unaligned boundaries and a
tile crossing many segments; 1 to 5 ranks of rows; every flag the CPU kernels take; and
scalars given as one-element tensors (read by the kernels through their pointers).
The generic call sites are run through the interpreted kernels too (a torch backend
that hands them out for CPU tensors): every compressor and the Adam-family rules against
the oracle. ``tests/test_cuda.py`` runs the compiled kernels on a GPU.

The interpreter is slow (a few milliseconds per program), so sizes stay small.
"""

import importlib.util
import logging
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (scripts/test.sh installs it: scripts/bootstrap.sh --with-triton)",
                allow_module_level=True)

import hvd_quant  # noqa: E402
from hvd_quant import kernels  # noqa: E402
from hvd_quant.compressors import exp_dithering as ed  # noqa: E402
from hvd_quant.compressors import global_qsgd as gq  # noqa: E402
from hvd_quant.compressors.marsit import MarsitSelect  # noqa: E402
from hvd_quant.core.backend import NumpyBackend  # noqa: E402
from hvd_quant.core.hierarchical import threshold_rows  # noqa: E402
from hvd_quant.core.packing import (pack_lanes, pack_signs, sign_pack_residual, sign_residual,  # noqa: E402
                                    unpack_scaled_sum, unpack_sum_residual, unpack_sums_signs)
from hvd_quant.core.rng import CounterRNG, draws, random_bytes  # noqa: E402
from hvd_quant.core.runner import CompressorRunner  # noqa: E402
from hvd_quant.core.segments import compensate_sums, compensate_sums_signs, segment_bounds  # noqa: E402
from hvd_quant.core.simulate import ThreadWorld  # noqa: E402
from hvd_quant.kernels import segment_tables  # noqa: E402
from hvd_quant.optimizers import elementwise as ew  # noqa: E402
from hvd_quant.torch.backend import TorchBackend  # noqa: E402
from solo_comm import FrameworkComm  # noqa: E402

if not kernels.enabled():
    pytest.skip(f"numba kernels off: {kernels.why_disabled()}", allow_module_level=True)
try:
    G = kernels.gpu_interpreted()
except RuntimeError as exc:  # Triton already imported for compilation in this process
    pytest.skip(str(exc), allow_module_level=True)

# The interpreter computes the masked-off lanes too (x / 0, a saturating product): numpy
# warns where the kernels, by design, discard the result.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")
C = kernels.cpu_module()
B = NumpyBackend()
BLOCK, TILE, NB = G.BLOCK, segment_tables.TILE, segment_tables.TILE // 8
SMALL = [0, 1, 7, 8, 31, 32, 33]
SIZES = SMALL + [BLOCK - 1, BLOCK, BLOCK + 1]        # element-wise kernels
TILE_SIZES = SMALL + [TILE - 1, TILE, TILE + 1]      # segment and bit kernels
_ONE_AT_A_TIME = threading.Lock()  # the interpreter patches triton.language while it runs


def T(a):
    """A CPU tensor with a copy of the numpy array ``a``."""
    return torch.from_numpy(np.array(a, copy=True))


def data(d, seed=0, specials=False):
    x = np.random.default_rng(seed).standard_normal(d).astype(np.float32)
    if specials and d >= 8:
        x[:4] = [0.0, -0.0, 1e-45, -1e-45]  # both zeros and subnormals
    return x


def assert_same(got, want, what=""):
    """Bit for bit: equal dtypes and shapes, NaN where NaN, and every other element's bits
    (so -0.0 differs from 0.0)."""
    got = got.numpy() if torch.is_tensor(got) else np.asarray(got)
    want = np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    if got.dtype.kind == "f":
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan, err_msg=what)
        view = np.dtype(f"u{got.dtype.itemsize}")
        np.testing.assert_array_equal(got[~nan].view(view), want[~nan].view(view), err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def layouts(d):
    """Segment sizes summing to ``d``: one segment; empty segments first, inside and last
    with boundaries inside bytes; many 3-element segments in the first tile (a long search)."""
    a = d // 3
    b = max(0, d // 2 - a)
    out = {"one": [d], "empty": [0, a, 0, b, d - a - b, 0]}
    if d > 64:
        out["small"] = [3] * 20 + [d - 60]
    return out


def sign_rows(d, rows, nseg):
    packed = np.concatenate([pack_signs(B, data(d, 10 + r)) for r in range(rows)]) if d else np.zeros(0, np.uint8)
    return packed, np.random.default_rng(3).random(rows * nseg).astype(np.float32) + 0.25


# --- sign bits ---------------------------------------------------------------------------------
@pytest.mark.parametrize("d", TILE_SIZES)
def test_sign_pack(d):
    x = data(d, 1, specials=True)
    if d > 9:
        x[9] = np.nan  # bit 0, as x >= 0 is false
    want = C.sign_pack(x)
    assert_same(G.sign_pack(T(x)), want)
    assert_same(want, pack_signs(B, x))
    out = torch.full((want.size,), 7, dtype=torch.uint8)
    assert G.sign_pack(T(x), out=out) is out
    assert_same(out, want)


@pytest.mark.parametrize("d", TILE_SIZES)
def test_sign_pack_residual_and_sign_residual(d):
    x, e = data(d, 1, specials=True), data(d, 2)
    for name, counts in layouts(d).items():
        bounds = segment_bounds(counts)
        scales = (np.arange(len(counts), dtype=np.float32) + 1) * 0.25
        for resid in (e, None):
            want_bits, want_res = C.sign_pack_residual(x, resid, scales, bounds)
            got_bits, got_res = G.sign_pack_residual(T(x), None if resid is None else T(resid), T(scales), bounds)
            assert_same(got_bits, want_bits, name)
            assert_same(got_res, want_res, name)
            assert_same(G.sign_residual(T(x), None if resid is None else T(resid), T(scales), bounds), want_res, name)
            oracle = sign_pack_residual(B, x, resid, scales, counts)
            assert_same(want_bits, oracle[0], name)
            assert_same(want_res, oracle[1], name)
        # In place over e (the state buffer), bits into a buffer of the caller's.
        want = C.sign_pack_residual(x, e, scales, bounds)
        buf, bits = T(e), torch.empty((d + 7) // 8, dtype=torch.uint8)
        got = G.sign_pack_residual(T(x), buf, T(scales), bounds, out=buf, bits_out=bits)
        assert got[0] is bits and got[1] is buf
        assert_same(buf, want[1], name)
        assert_same(bits, want[0], name)
        buf = T(e)
        assert G.sign_residual(T(x), buf, T(scales), bounds, out=buf) is buf
        assert_same(buf, sign_residual(B, x, e, scales, counts), name)


@pytest.mark.parametrize("d", TILE_SIZES)
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_unpack_scaled_sum(d, rows):
    counts = layouts(d)["empty"]
    bounds = segment_bounds(counts)
    packed, scales = sign_rows(d, rows, len(counts))
    base, folds = data(d, 4, specials=True), np.array([0.5, 2.0, 0.25, 1.0, 3.0, 0.75], np.float32)
    for b, f in ((None, None), (base, None), (base, folds)):
        want = C.unpack_scaled_sum(packed, scales, bounds, d, base=b, base_scales=f)
        assert_same(want, unpack_scaled_sum(B, packed, scales, counts, d, base=b, base_scales=f))
        got = G.unpack_scaled_sum(T(packed).reshape(rows, -1) if d else T(packed), T(scales), bounds, d,
                                  base=None if b is None else T(b), base_scales=None if f is None else T(f))
        assert_same(got, want, f"base={b is not None} folds={f is not None}")
        if b is not None:  # decoded over base itself (onebit's server stage)
            buf = T(b)
            assert G.unpack_scaled_sum(T(packed), T(scales), bounds, d, base=buf, out=buf,
                                       base_scales=None if f is None else T(f)) is buf
            assert_same(buf, want)


@pytest.mark.parametrize("d", TILE_SIZES)
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_unpack_sum_residual(d, rows):
    counts = layouts(d)["empty"]
    bounds = segment_bounds(counts)
    packed, scales = sign_rows(d, rows, len(counts))
    own = (np.arange(len(counts), dtype=np.float32) + 1) * 0.5
    x, e = data(d, 1, specials=True), data(d, 2)
    for resid in (e, None):
        want = C.unpack_sum_residual(packed, scales, bounds, d, x, resid, own)
        oracle = unpack_sum_residual(B, packed, scales, counts, d, x, resid, own)
        got = G.unpack_sum_residual(T(packed), T(scales), bounds, d, T(x), None if resid is None else T(resid), T(own))
        for g, w, o in zip(got, want, oracle):
            assert_same(g, w)
            assert_same(w, o)
    xb, eb = T(x), T(e)  # the mean into x itself, the residual into e
    mean, res = G.unpack_sum_residual(T(packed), T(scales), bounds, d, xb, eb, T(own), out=xb, resid_out=eb)
    assert mean is xb and res is eb
    want = C.unpack_sum_residual(packed, scales, bounds, d, x, e, own)
    assert_same(xb, want[0])
    assert_same(eb, want[1])


def assert_sums(got, want, what=""):
    """float64 sums in another order: within a few float64 ulps (all terms >= 0)."""
    got = got.numpy() if torch.is_tensor(got) else np.asarray(got)
    assert got.dtype == np.float64 and got.shape == np.shape(want), (what, got.dtype, got.shape)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=what)
    np.testing.assert_allclose(got, want, rtol=1e-13, err_msg=what)


@pytest.mark.parametrize("d", [0, 1, 33, TILE - 1, TILE + 1, C.BLOCK + 9])
@pytest.mark.parametrize("squares", [False, True], ids=["abs", "squares"])
def test_compensate_sums_and_signs(d, squares):
    """The CPU kernels sum blocks of cpu.BLOCK elements from each segment's start: a
    segment of BLOCK + 1 elements takes two of them."""
    x, e = data(d, 40, specials=True), data(d, 41) * 0.5
    shapes = layouts(d) if d < C.BLOCK else {"blocks": [5, C.BLOCK + 1, 0, 3]}
    for name, counts in shapes.items():
        bounds = segment_bounds(counts)
        for resid in (e, None):
            want_sums, want_bits = C.compensate_sums_signs(x, resid, bounds, squares)
            r = None if resid is None else T(resid)
            sums = G.compensate_sums(T(x), r, bounds, squares)
            got_sums, got_bits = G.compensate_sums_signs(T(x), r, bounds, squares)
            assert_same(got_sums, sums.numpy(), name)  # one kernel, one order: the same sums
            assert_sums(got_sums, want_sums, name)
            assert_sums(got_sums, compensate_sums(B, x, resid, counts, squares), name)
            assert_same(got_bits, want_bits, name)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_sums_and_flags(bad):
    x = data(TILE + 3, 8)
    x[TILE + 1] = bad
    bounds = segment_bounds([TILE, 3])
    sums = G.compensate_sums(T(x), None, bounds, squares=True).numpy()
    assert np.isfinite(sums[0]) and not np.isfinite(sums[1])
    m, ok = G.absmax_finite(T(x))
    assert m.shape == () and m.dtype == torch.float32 and ok.shape == () and ok.dtype == torch.bool
    want_m, want_ok = C.absmax_finite(x)
    assert_same(m, np.float32(want_m))
    assert bool(ok) is want_ok is False
    assert bool(G.all_finite(T(x))) is C.all_finite(x) is False


@pytest.mark.parametrize("d", [0, 1, 33, 8191, 8193])  # gpu._ABS_BLOCK = 8192
def test_absmax_and_all_finite(d):
    x = data(d, 30, specials=True)
    m, ok = G.absmax_finite(T(x))
    want_m, want_ok = C.absmax_finite(x)
    assert_same(m, np.float32(want_m))
    assert bool(ok) and want_ok
    assert G.all_finite(T(x)).dtype == torch.bool and bool(G.all_finite(T(x)))
    if d:
        y = x.copy()
        y[-1] = np.finfo(np.float32).max  # the largest finite float32 is finite
        assert bool(G.all_finite(T(y))) and float(G.absmax_finite(T(y))[0]) == np.finfo(np.float32).max


# --- Global-QSGD -------------------------------------------------------------------------------
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("width", [8, 16])
def test_quantize_and_dequantize_lanes(d, width):
    x = data(d, 9, specials=True)
    for pre, first in ((1.0, 0), (2.0 ** -64, 8)):
        xs = x * np.float32(1 / pre)
        scale = np.float32(np.abs(xs).max() * pre) if d else np.float32(1.0)
        for add_offset in (True, False):
            want = C.quantize_lanes(xs, pre, scale, 42, 0xDEADBEEF, width, add_offset, first)
            got = G.quantize_lanes(T(xs), pre, scale, 42, 0xDEADBEEF, width, add_offset, first)
            assert_same(got, want, f"pre={pre} first={first} offset={add_offset}")
        # The scale, pre and key as tensors (Global-QSGD's scale comes from a collective).
        want = C.quantize_lanes(xs, pre, scale, 42, 0xDEADBEEF, width, True, first)
        got = G.quantize_lanes(T(xs), torch.tensor([pre], dtype=torch.float32), torch.tensor([scale]), 42,
                               torch.tensor([0xDEADBEEF], dtype=torch.int64), width, True, first,
                               out=torch.empty(-(-d // (32 // width)), dtype=torch.int32))
        assert_same(got, want)
    # The oracle: linear_quantize then pack_lanes, with the same draws.
    scale = np.full(1, np.abs(x).max() if d else 1.0, np.float32)
    q = gq.linear_quantize(B, x, scale, 42, draws(B, 99, d))
    words = C.quantize_lanes(x, 1.0, scale[0], 42, 99, width, True)
    assert_same(words, pack_lanes(B, q, width, True))
    for factor in (0.25, torch.tensor([0.1])):
        want = C.dequantize_lanes(words * 3, d, width, float(factor))
        assert_same(G.dequantize_lanes(T(words * 3), d, width, factor), want)


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("dtype", ["int8", "int16", "int32"])
def test_quantize_and_dequantize_ints(d, dtype):
    x = data(d, 9, specials=True)
    scale = np.float32(np.abs(x).max()) if d else np.float32(1.0)
    want = C.quantize_ints(x, 1.0, scale, 7, 12345, dtype, 16)
    assert_same(G.quantize_ints(T(x), 1.0, scale, 7, 12345, dtype, 16), want)
    assert_same(G.quantize_ints(T(x), torch.tensor([1.0], dtype=torch.float64), torch.tensor([scale]), 7,
                                torch.tensor([12345]), np.dtype(dtype), 16), want)
    total = want.astype(np.int32) * 3
    for factor in (0.125, torch.tensor([0.3], dtype=torch.float64)):
        assert_same(G.dequantize_ints(T(total), factor), C.dequantize_ints(total, float(factor)))


def test_quantize_through_the_call_site_equals_the_oracle():
    class Comm:
        rank, size = 0, 3
        allreduce_int_dtypes = ("int32",)

    x = data(1001, 9) * np.float32(2.0 ** 64)
    scale, pre = np.full(1, np.abs(x).max() * 2.0 ** -64, np.float32), np.full(1, 2.0 ** -64, np.float32)
    got = gq.quantize(IB, Comm, T(x), T(scale), T(pre), 42, 16, CounterRNG(5))
    assert_same(got, gq.quantize(B, Comm, x, scale, pre, 42, 16, CounterRNG(5)))
    assert_same(gq.dequantize(IB, Comm, got, 1001, T(scale), T(pre), 42, 16),
                gq.dequantize(B, Comm, got.numpy(), 1001, scale, pre, 42, 16))


# --- exponential dithering ---------------------------------------------------------------------
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("n", [1, 2, 5])
def test_exponential_dithering(d, n):
    x = data(d, 11, specials=True)
    scale = np.float32(np.abs(x).max()) if d else np.float32(1.0)
    want = C.exp_encode(x, scale, n, 777)
    assert_same(want, ed.encode(B, x, np.full(1, scale), n, _Key(777)))
    assert_same(G.exp_encode(T(x), scale, n, 777), want)
    assert_same(G.exp_encode(T(x), torch.tensor([scale]), n, torch.tensor([777])), want)
    other = C.exp_encode(data(d, 12), scale, n, 778)
    combined = C.exp_combine(want, other, 779)
    assert_same(G.exp_combine(T(want), T(other), 779), combined)
    factor = 2.0 ** (n - 1) / n
    assert_same(G.exp_decode(T(combined), factor, scale), C.exp_decode(combined, factor, scale))
    assert_same(G.exp_decode(T(combined), torch.tensor([factor]), torch.tensor([scale])),
                C.exp_decode(combined, float(np.float32(factor)), scale))


class _Key:
    """A stand-in random stream whose next call has a given key."""

    def __init__(self, key):
        self.key = key

    def next_key(self, B=None):
        return self.key


def test_exp_combine_covers_every_pair_of_codes():
    a, b = np.repeat(np.arange(256, dtype=np.uint8), 256), np.tile(np.arange(256, dtype=np.uint8), 256)
    for key in (1, 0xFFFFFFFF):
        assert_same(G.exp_combine(T(a), T(b), key), C.exp_combine(a, b, key))
    assert_same(C.exp_combine(a, b, 5), ed.combine_codes(B, a, b, draws(B, 5, a.size)))
    top = np.array([255, 127, 1, 129], np.uint8)  # saturation at the float32 maximum
    for scale in (np.float32(3e38), np.float32(np.finfo(np.float32).max)):
        assert_same(G.exp_decode(T(top), 16.0, scale), C.exp_decode(top, 16.0, scale))


# --- Marsit, re-binarisation, BinSGDM ----------------------------------------------------------
@pytest.mark.parametrize("nbytes", [0, 1, 9, NB - 1, NB + 1])
def test_marsit_select(nbytes):
    own, recv = (np.random.default_rng(s).integers(0, 256, nbytes).astype(np.uint8) for s in (1, 2))
    for keep in (1 / 3, 0.5, torch.tensor([0.75], dtype=torch.float64)):
        want = C.marsit_select(own, recv, float(np.float32(float(keep))), 4242)
        assert_same(G.marsit_select(T(own), T(recv), keep, 4242), want)
    op = MarsitSelect()
    assert_same(op.combine(IB, T(own), 1, T(recv), 2, CounterRNG(7)), op.combine(B, own, 1, recv, 2, CounterRNG(7)))


@pytest.mark.parametrize("width", [0, 1, 13, NB - 1, NB + 1])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_rebinarize(width, k):
    rows = np.random.default_rng(width + k).integers(0, 256, k * width).astype(np.uint8)
    want = C.rebinarize(rows, k, 99)
    assert_same(G.rebinarize(T(rows), k, 99), want)
    assert_same(want, threshold_rows(B, rows, k, 99))
    out = torch.empty(width, dtype=torch.uint8)  # a tensor k: the output's size gives the rows
    assert G.rebinarize(T(rows), torch.tensor([k]), torch.tensor([99]), out=out) is out
    assert_same(out, want)


def test_rebinarize_refuses_what_the_cpu_kernel_refuses():
    with pytest.raises(ValueError, match="k=3 rows"):
        G.rebinarize(torch.zeros(10, dtype=torch.uint8), 3, 1)
    with pytest.raises(ValueError, match="needs out="):
        G.rebinarize(torch.zeros(9, dtype=torch.uint8), torch.tensor([3]), 1)


@pytest.mark.parametrize("d", TILE_SIZES)
def test_binsgdm_encode(d):
    g, m = data(d, 50, specials=True), data(d, 51) * 0.1
    b = np.abs(data(d, 52)) * 0.2
    if d > 8:
        b[5:7] = 0.0  # no |g| history: z = 0
    for beta in (0.9, torch.tensor([0.5], dtype=torch.float32)):
        want = C.binsgdm_encode(g, m, b, float(beta), 31337)
        got = G.binsgdm_encode(T(g), T(m), T(b), beta, 31337)
        for x, y in zip(got, want):
            assert_same(x, y)
    outs = [torch.empty(d), torch.empty(d), torch.empty((d + 7) // 8, dtype=torch.uint8)]
    got = G.binsgdm_encode(T(g), T(m), T(b), 0.9, 31337, m_out=outs[0], b_out=outs[1], bits_out=outs[2])
    assert all(x is y for x, y in zip(got, outs))
    from hvd_quant.optimizers.binsgdm import binary_randomize
    for x, y in zip(binary_randomize(IB, T(g), T(m), T(b), 0.9, 31337), binary_randomize(B, g, m, b, 0.9, 31337)):
        assert_same(x, y)


# --- random draws ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES + [4 * BLOCK + 3])
def test_uniform_and_random_bytes(n):
    want = C.uniform(0x9E3779B9, n)
    assert_same(G.uniform(0x9E3779B9, n, device="cpu"), want)
    assert_same(want, draws(B, 0x9E3779B9, n))
    assert_same(G.uniform(torch.tensor([0x9E3779B9]), n), want)
    want = C.random_bytes(31, n)
    assert_same(want, random_bytes(B, 31, n))
    assert_same(G.random_bytes(31, n, device="cpu"), want)
    out = torch.empty(n, dtype=torch.uint8)
    assert G.random_bytes(torch.tensor([31]), n, out=out) is out
    assert_same(out, want)


# --- the Adam-family update rules --------------------------------------------------------------
def _adam_inputs(d):
    x, m, u, w = data(d, 21, specials=True), data(d, 22) * 1e-2, data(d, 23) * 1e-3, data(d, 24)
    v = np.abs(data(d, 25)) * 1e-4
    if d >= 8:
        v[:2] = 0.0  # a constant input: v stays 0 (eps alone divides)
        v[2] = 1e-44  # a subnormal square root
    return x, m, v, u, w


def _as(kind, value):
    """A scalar as a Python float or a one-element tensor holding its float32 value."""
    return torch.tensor([value], dtype=torch.float32) if kind == "tensor" else value


def _num(kind, value):
    """What the CPU kernel gets for the same scalar: the tensor's float32 value."""
    return float(np.float32(value)) if kind == "tensor" else value


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("kind", ["number", "tensor"])
def test_adam_family(d, wd, kind):
    x, m, v, u, w = _adam_inputs(d)
    S, N = (lambda value: _as(kind, value)), (lambda value: _num(kind, value))
    pairs = [
        (G.ema(T(m), T(x), S(0.9)), C.ema(m, x, N(0.9))),
        (G.ema(T(v), T(x), S(0.999), square=True), C.ema(v, x, N(0.999), square=True)),
        (G.descend(T(x), T(w), S(1e-3), S(wd)), C.descend(x, w, N(1e-3), N(wd))),
        (G.descend(T(x), T(w * 3), S(1e-3), S(wd), divisor=S(3.0)), C.descend(x, w * 3, N(1e-3), N(wd), divisor=3.0)),
        (G.adam_descend(T(x), T(m), T(v), S(3e-3), S(1e-8), S(wd))[0], C.adam_descend(x, m, v, N(3e-3), N(1e-8), N(wd))[0]),
        *zip(G.adam_descend(T(x), T(m), T(v), S(1e-3), S(1e-6), S(wd), T(u)),
             C.adam_descend(x, m, v, N(1e-3), N(1e-6), N(wd), u)),
        (G.precondition(T(u), T(v), S(1e-8)), C.precondition(u, v, N(1e-8))),
        *zip(G.zero_one_sync_result(T(x), T(u), T(w), T(v), S(1e-8), S(0.0123)),
             C.zero_one_sync_result(x, u, w, v, N(1e-8), N(0.0123))),
        *zip(G.zero_one_sync_result(T(x), None, T(w), T(v), S(1e-8), S(0.0123)),
             C.zero_one_sync_result(x, None, w, v, N(1e-8), N(0.0123))),
        *zip(G.zero_one_sync_input(T(x), T(m), T(w), T(v), T(u), S(0.9), S(1e-3), S(1e-8), S(wd)),
             C.zero_one_sync_input(x, m, w, v, u, N(0.9), N(1e-3), N(1e-8), N(wd))),
    ]
    for i, (got, want) in enumerate(pairs):
        assert_same(got, want, f"result {i}")
    assert G.adam_descend(T(x), T(m), T(v), 1e-3, 1e-8, wd)[1].numel() == 0


@pytest.mark.parametrize("d", [0, 33, BLOCK + 1])
def test_in_place_updates(d):
    """In place over the parameters, moments and accumulator (the optimizers' use): the
    fresh results' bits."""
    x, m, v, u, w = _adam_inputs(d)
    a = T(m)
    assert G.ema(a, T(x), 0.9, in_place=True) is a
    assert_same(a, C.ema(m, x, 0.9))
    y = T(x)
    assert G.descend(y, T(w), 1e-3, 0.01, in_place=True) is y
    assert_same(y, C.descend(x, w, 1e-3, 0.01))
    y, acc = T(x), T(u)
    got = G.adam_descend(y, T(m), T(v), 1e-3, 1e-6, 0.01, acc, x_out=y, acc_out=acc)
    assert got[0] is y and got[1] is acc
    for g, want in zip((y, acc), C.adam_descend(x, m, v, 1e-3, 1e-6, 0.01, u)):
        assert_same(g, want)
    out = torch.empty(d)
    assert G.ema(T(m), T(x), 0.9, out=out) is out
    assert_same(out, C.ema(m, x, 0.9))
    base, ww = torch.empty(d), torch.empty(d)
    assert G.zero_one_sync_input(T(x), T(m), T(w), T(v), T(u), 0.9, 1e-3, 1e-8, 0.0, base=base, w=ww)[0] is base


# --- the generic call sites through the interpreted kernels -----------------------------------
class InterpretedBackend(TorchBackend):
    """The torch backend with the interpreted Triton kernels for its CPU tensors, one call
    at a time: what TorchBackend("cuda") does with the compiled ones."""

    name = "torch+triton-interpreter"

    def kernel(self, name, *tensors):
        fn = getattr(G, name, None)
        if fn is None or name not in kernels.NAMES:
            return None

        def call(*args, **kwargs):
            if name in ("uniform", "random_bytes"):
                kwargs.setdefault("device", "cpu")
            with _ONE_AT_A_TIME:
                return fn(*args, **kwargs)
        return call


IB = InterpretedBackend()


def dyadic(d, seed):
    return (np.random.default_rng(seed).integers(-2048, 2049, d) / 1024.0).astype(np.float32)


SEGMENTS = [("w1", 300), ("b1", 3), ("empty", 0), ("w2", 130)]
COMPRESSORS = [("ef_sign", {}), ("marsit", {}), ("marsit", {"compensation": "global"}), ("global_qsgd", {}),
               ("global_qsgd", {"norm": "l2"}), ("global_qsgd_exp", {}), ("onebit", {})]


def _reduce(backend, comp, xs, steps):
    n = len(xs)
    runners = [CompressorRunner(comp, backend, seed=5) for _ in range(n)]

    def body(c):
        comm = c if backend is B else FrameworkComm(c, backend)
        return [backend.to_numpy(runners[c.rank].reduce(backend.constant(xs[c.rank][s], "float32"), comm, "g",
                                                        SEGMENTS)) for s in range(steps)]
    return ThreadWorld(len(xs)).run(body), [r.state_dict() for r in runners]


@pytest.mark.parametrize("name,opts", COMPRESSORS, ids=[f"{n}-{o}" for n, o in COMPRESSORS])
def test_compressors_through_the_interpreted_kernels_equal_the_oracle(name, opts):
    """Every compressor's whole reduction, 2 ranks, 2 steps (state carried), through the
    generic call sites with the GPU primitives' results (0-d tensors, float64 sums on the
    tensors' device): the oracle's bits (dyadic inputs: the sums are exact in any order)."""
    d = sum(c for _, c in SEGMENTS)
    xs = [[dyadic(d, 100 * r + s) for s in range(2)] for r in range(2)]
    comp = hvd_quant.get(name, **opts)
    (want, want_state), (got, got_state) = _reduce(B, comp, xs, 2), _reduce(IB, comp, xs, 2)
    for r in range(2):
        for s in range(2):
            assert_same(got[r][s], want[r][s], f"rank {r} step {s}")
        for key in want_state[r]:
            assert_same(np.asarray(got_state[r][key]), np.asarray(want_state[r][key]), key)


def test_elementwise_call_sites_equal_the_oracle():
    x, m, v, u, w = _adam_inputs(1001)
    for wd in (0.0, 0.01):
        got = [ew.ema(IB, T(m), T(x), 0.9), ew.descend(IB, T(x), T(w * 3), 1e-3, wd, divisor=3),
               *ew.adam_descend(IB, T(x), T(m), T(v), 1e-3, 1e-6, wd, acc=T(u)),
               ew.precondition(IB, T(u), T(v), 1e-8),
               *ew.zero_one_sync_input(IB, T(x), T(m), T(w), T(v), T(u), 0.9, 1e-3, 1e-8, wd),
               *ew.zero_one_sync_result(IB, T(x), T(u), T(w), T(v), 1e-8, 0.0123)]
        want = [ew.ema(B, m, x, 0.9), ew.descend(B, x, w * 3, 1e-3, wd, divisor=3),
                *ew.adam_descend(B, x, m, v, 1e-3, 1e-6, wd, acc=u), ew.precondition(B, u, v, 1e-8),
                *ew.zero_one_sync_input(B, x, m, w, v, u, 0.9, 1e-3, 1e-8, wd),
                *ew.zero_one_sync_result(B, x, u, w, v, 1e-8, 0.0123)]
        for i, (g, want_i) in enumerate(zip(got, want)):
            assert_same(g, want_i, f"result {i}")
    counts = [500, 0, 501]
    x, e = dyadic(1001, 1), dyadic(1001, 2)
    for g, want_i in zip(compensate_sums_signs(IB, T(x), T(e), counts), compensate_sums_signs(B, x, e, counts)):
        assert_same(g, want_i)  # dyadic: exact sums
    packed, scales = sign_rows(1001, 3, 3)
    got = unpack_sums_signs(IB, T(packed), T(scales), counts, 1001, base=T(x), squares=True)
    want = unpack_sums_signs(B, packed, scales, counts, 1001, base=x, squares=True)
    assert_same(got[0], want[0])
    assert_sums(got[1], want[1])
    assert_same(got[2], want[2])
    m, ok = gq.absmax_finite(IB, T(x))
    assert m.shape == (1,) and ok.shape == (1,) and bool(ok[0])
    assert_same(m, np.abs(x).max(keepdims=True))
    assert IB.all_finite(T(np.arange(5000, dtype=np.float32))).dtype == torch.bool


# --- the layout tables and the dispatch --------------------------------------------------------
def test_segment_tables_match_a_direct_search():
    rng = np.random.default_rng(0)
    for _ in range(30):
        counts = rng.choice([0, 1, 3, 100, 5000, 9000], size=rng.integers(1, 12)).tolist()
        bounds = segment_bounds(counts)
        tiles, pieces = segment_tables.tables(bounds, tile=64)
        tiles = tiles.reshape(-1, 4)
        d = int(bounds[-1])
        assert tiles.shape[0] == -(-d // 64)
        seg = np.searchsorted(bounds, np.arange(d), side="right") - 1
        partial = np.zeros(max(pieces[-1], 1))
        for t, (lo, hi, piece, steps) in enumerate(tiles):
            s = seg[64 * t:64 * t + 64]
            assert lo == s[0] and hi == s[-1] and (hi - lo) < 2 ** steps
            for j in range(lo, hi + 1):
                partial[piece + j - lo] = (s == j).sum()
        per_segment = [partial[pieces[i]:pieces[i + 1]].sum() for i in range(len(counts))]
        np.testing.assert_array_equal(per_segment, counts)


def test_segment_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(segment_tables, "CACHE_SIZE", 4)
    monkeypatch.setattr(segment_tables, "_cache", type(segment_tables._cache)())
    first = segment_tables.layout(segment_bounds([5, 7]), "cpu")
    assert segment_tables.layout(segment_bounds([5, 7]), "cpu") is first  # no copy the second time
    for n in range(10):
        segment_tables.layout(segment_bounds([n, 3]), "cpu")
    assert segment_tables.cached() == 4
    with pytest.raises(ValueError, match="start at 0"):
        segment_tables.layout(np.array([1, 5]), "cpu")


def test_the_torch_backend_hands_out_the_gpu_kernels_for_cuda(monkeypatch):
    """TorchBackend.kernel: Triton's kernels for CUDA (imported on first use), the numba
    ones for CPU tensors, none with HVD_QUANT_KERNELS=0; a missing Triton is said once."""
    monkeypatch.setattr(kernels, "_gpu", {"checked": False, "module": None, "why": ""})
    monkeypatch.setitem(sys.modules, "hvd_quant.kernels.gpu", G)
    cuda = TorchBackend("cuda")
    assert cuda.kernel("sign_pack_residual") is G.sign_pack_residual
    assert cuda.kernel("uniform").func is G.uniform and cuda.kernel("uniform").keywords == {"device": cuda.device}
    assert cuda.kernel("add_rows") is None  # TF's own: no GPU twin
    assert TorchBackend().kernel("sign_pack", torch.zeros(3)) is not None  # CPU tensors: numba
    assert cuda.kernel("sign_pack", torch.zeros(3)) is None  # CPU tensors on a CUDA backend: generic

    monkeypatch.setattr(kernels, "_gpu", {"checked": False, "module": None, "why": ""})
    monkeypatch.setenv("HVD_QUANT_KERNELS", "0")
    assert cuda.kernel("sign_pack") is None and "HVD_QUANT_KERNELS=0" in kernels.why_gpu_disabled()
    monkeypatch.delenv("HVD_QUANT_KERNELS")


def test_a_missing_triton_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_gpu", {"checked": False, "module": None, "why": ""})
    monkeypatch.setitem(sys.modules, "hvd_quant.kernels.gpu", None)  # the import fails
    cuda = TorchBackend("cuda")
    with caplog.at_level(logging.WARNING, logger="hvd_quant"):
        assert cuda.kernel("sign_pack") is None and cuda.kernel("ema") is None
    warnings = [r for r in caplog.records if "GPU kernels off" in r.getMessage()]
    assert len(warnings) == 1 and "generic path" in warnings[0].getMessage()
    assert "Triton is not usable" in kernels.why_gpu_disabled()


def test_every_primitive_has_a_gpu_kernel_with_the_cpu_signature():
    import inspect

    for name in kernels.NAMES:
        cpu, gpu = inspect.signature(getattr(C, name)), inspect.signature(getattr(G, name))
        own = [p for p in gpu.parameters.values() if p.kind is not p.KEYWORD_ONLY]
        assert [(p.name, p.default) for p in own] == [(p.name, p.default) for p in cpu.parameters.values()], name
    assert "add_rows" not in kernels.NAMES and not hasattr(G, "add_rows")


def test_the_compiled_ptx_has_no_fma_ftz_or_approximation():
    """The kernels with the most float arithmetic (divisions, square roots, multiply-adds)
    compiled for sm_90 without a GPU (``scripts/check_ptx.py``, in a process of its own:
    this one imported Triton for the interpreter): no fma, no flush to zero, no
    approximate division or square root; and a control compiled with contraction allowed
    does hold fma. ``scripts/check_ptx.py`` alone checks every kernel variant."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    only = "_zero_one_sync_input_k,_quantize_lanes_k,_binsgdm_k"
    run = subprocess.run([sys.executable, str(root / "scripts" / "check_ptx.py"), "--only", only],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 failed" in run.stdout and "FAIL" not in run.stdout, run.stdout


def test_importing_hvd_quant_does_not_import_triton():
    import subprocess

    code = ("import sys, hvd_quant, hvd_quant.torch.backend, hvd_quant.kernels; "
            "sys.exit(1 if 'triton' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
