"""The cases every GPU kernel is checked on, for any device: the interpreter's CPU
tensors (tests/gpu_interpreter.py) and a GPU (tests/test_cuda.py).

:func:`cases` returns the test functions for one GPU kernel module, device and size
lists; a test module puts them into its namespace, where pytest collects them. Each case
runs a primitive of the GPU module against the numba kernel (hvd_quant.kernels.cpu) and,
where there is one, the numpy oracle (the generic implementation on NumpyBackend), bit for
bit (NaN for NaN, and the sign of zero), except the float64 per-segment sums, which add
in another order (within 1e-13, relative). Scalars are given as numbers and as one-element
tensors on the device (which the kernels read through their pointers).
"""

import numpy as np
import pytest
import torch

from hvd_quant import kernels
from hvd_quant.kernels import segment_tables
from hvd_quant.compressors import exp_dithering as ed
from hvd_quant.compressors import global_qsgd as gq
from hvd_quant.compressors.marsit import MarsitSelect
from hvd_quant.core.backend import NumpyBackend
from hvd_quant.core.hierarchical import threshold_rows
from hvd_quant.core.packing import (pack_lanes, pack_signs, sign_pack_residual, sign_residual,
                                    unpack_scaled_sum, unpack_sum_residual)
from hvd_quant.core.rng import CounterRNG, draws, random_bytes
from hvd_quant.core.segments import block_counts, compensate_sums, segment_bounds

B = NumpyBackend()


def data(d, seed=0, specials=False):
    x = np.random.default_rng(seed).standard_normal(d).astype(np.float32)
    if specials and d >= 8:
        x[:4] = [0.0, -0.0, 1e-45, -1e-45]  # both zeros and subnormals
    return x


def assert_same(got, want, what=""):
    """Bit for bit: equal dtypes and shapes, NaN where NaN, and every other element's bits
    (so -0.0 differs from 0.0)."""
    got = got.cpu().numpy() if torch.is_tensor(got) else np.asarray(got)
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


def assert_sums(got, want, what=""):
    """float64 sums in another order: within a few float64 ulps (all terms >= 0)."""
    got = got.cpu().numpy() if torch.is_tensor(got) else np.asarray(got)
    assert got.dtype == np.float64 and got.shape == np.shape(want), (what, got.dtype, got.shape)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=what)
    np.testing.assert_allclose(got, want, rtol=1e-13, err_msg=what)

class _Key:
    """A stand-in random stream whose next call has a given key."""

    def __init__(self, key):
        self.key = key

    def next_key(self, B=None):
        return self.key

def _adam_inputs(d):
    x, m, u, w = data(d, 21, specials=True), data(d, 22) * 1e-2, data(d, 23) * 1e-3, data(d, 24)
    v = np.abs(data(d, 25)) * 1e-4
    if d >= 8:
        v[:2] = 0.0  # a constant input: v stays 0 (eps alone divides)
        v[2] = 1e-44  # a subnormal square root
    return x, m, v, u, w

def _num(kind, value):
    """What the CPU kernel gets for the same scalar: the tensor's float32 value."""
    return float(np.float32(value)) if kind == "tensor" else value


def cases(G, device, backend, sizes, tile_sizes, sum_sizes, abs_sizes, byte_sizes, draw_sizes,
          inplace_sizes):
    """The test functions (by name) for the GPU kernel module ``G`` on ``device``.

    ``backend``: a torch backend whose ``kernel`` hands out ``G``'s functions for tensors
    on ``device`` (for the cases that go through a call site); the size lists: element
    counts for the element-wise kernels (``sizes``), the segment and bit kernels
    (``tile_sizes``), the per-segment sums (``sum_sizes``; one above the CPU kernels'
    ``BLOCK`` takes a segment over two of their blocks), the max/finiteness scan
    (``abs_sizes``), byte counts for Marsit's selection and the re-binarisation
    (``byte_sizes``), draw counts (``draw_sizes``) and the in-place updates
    (``inplace_sizes``).
    """
    C = kernels.cpu_module()

    def T(a):
        """A tensor on the device with a copy of the numpy array ``a``."""
        return torch.from_numpy(np.array(a, copy=True)).to(device)

    def one(value, dtype=None):
        """A one-element tensor on the device (a scalar read through its pointer)."""
        return torch.tensor([value], dtype=dtype, device=device)

    # --- sign bits ---------------------------------------------------------------------------------
    @pytest.mark.parametrize("d", tile_sizes)
    def test_sign_pack(d):
        x = data(d, 1, specials=True)
        if d > 9:
            x[9] = np.nan  # bit 0, as x >= 0 is false
        want = C.sign_pack(x)
        assert_same(G.sign_pack(T(x)), want)
        assert_same(want, pack_signs(B, x))
        out = torch.full((want.size,), 7, dtype=torch.uint8, device=device)
        assert G.sign_pack(T(x), out=out) is out
        assert_same(out, want)

    @pytest.mark.parametrize("d", tile_sizes)
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
            buf, bits = T(e), torch.empty((d + 7) // 8, dtype=torch.uint8, device=device)
            got = G.sign_pack_residual(T(x), buf, T(scales), bounds, out=buf, bits_out=bits)
            assert got[0] is bits and got[1] is buf
            assert_same(buf, want[1], name)
            assert_same(bits, want[0], name)
            buf = T(e)
            assert G.sign_residual(T(x), buf, T(scales), bounds, out=buf) is buf
            assert_same(buf, sign_residual(B, x, e, scales, counts), name)

    @pytest.mark.parametrize("d", tile_sizes)
    @pytest.mark.parametrize("rows", [1, 2, 5])
    def test_unpack_scaled_sum(d, rows):
        counts = layouts(d)["empty"]
        bounds = segment_bounds(counts)
        packed, scales = sign_rows(d, rows, len(counts))
        base, folds = data(d, 4, specials=True), np.array([0.5, 2.0, 0.25, 1.0, 3.0, 0.75], np.float32)
        bases = ((None, None),) if rows == 2 else ((None, None), (base, None), (base, folds))
        for b, f in bases:
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

    @pytest.mark.parametrize("d", tile_sizes)
    @pytest.mark.parametrize("rows", [1, 3])
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

    @pytest.mark.parametrize("d", sum_sizes)
    @pytest.mark.parametrize("squares", [False, True], ids=["abs", "squares"])
    def test_compensate_sums_and_signs(d, squares):
        """The CPU kernels sum blocks of cpu.BLOCK elements from each segment's start: a
        segment of BLOCK + 1 elements takes two of them."""
        x, e = data(d, 40, specials=True), data(d, 41) * 0.5
        shapes = layouts(d) if d < C.BLOCK else {"blocks": [5, d - 8, 0, 3]}
        for name, counts in shapes.items():
            bounds = segment_bounds(counts)
            for resid in (e, None) if name in ("one", "blocks") else (e,):
                want_sums, want_bits = C.compensate_sums_signs(x, resid, bounds, squares)
                r = None if resid is None else T(resid)
                sums = G.compensate_sums(T(x), r, bounds, squares)
                got_sums, got_bits = G.compensate_sums_signs(T(x), r, bounds, squares)
                assert_same(got_sums, sums.cpu().numpy(), name)  # one kernel, one order: the same sums
                assert_sums(got_sums, want_sums, name)
                assert_sums(got_sums, compensate_sums(B, x, resid, counts, squares), name)
                assert_same(got_bits, want_bits, name)

    @pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
    def test_non_finite_sums_and_flags(bad):
        tile = segment_tables.TILE
        x = data(tile + 3, 8)
        x[tile + 1] = bad
        bounds = segment_bounds([tile, 3])
        sums = G.compensate_sums(T(x), None, bounds, squares=True).cpu().numpy()
        assert np.isfinite(sums[0]) and not np.isfinite(sums[1])
        m, ok = G.absmax_finite(T(x))
        assert m.shape == () and m.dtype == torch.float32 and ok.shape == () and ok.dtype == torch.bool
        want_m, want_ok = C.absmax_finite(x)
        assert_same(m, np.float32(want_m))
        assert bool(ok) is want_ok is False
        assert bool(G.all_finite(T(x))) is C.all_finite(x) is False

    @pytest.mark.parametrize("d", abs_sizes)
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
    @pytest.mark.parametrize("d", sizes)
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
            got = G.quantize_lanes(T(xs), one(pre, torch.float32), one(scale), 42,
                                   one(0xDEADBEEF, torch.int64), width, True, first,
                                   out=torch.empty(-(-d // (32 // width)), dtype=torch.int32, device=device))
            assert_same(got, want)
        # The oracle: linear_quantize then pack_lanes, with the same draws.
        scale = np.full(1, np.abs(x).max() if d else 1.0, np.float32)
        q = gq.linear_quantize(B, x, scale, 42, draws(B, 99, d))
        words = C.quantize_lanes(x, 1.0, scale[0], 42, 99, width, True)
        assert_same(words, pack_lanes(B, q, width, True))
        for factor in (0.25, one(0.1)):
            want = C.dequantize_lanes(words * 3, d, width, float(factor))
            assert_same(G.dequantize_lanes(T(words * 3), d, width, factor), want)

    @pytest.mark.parametrize("d", sizes)
    @pytest.mark.parametrize("dtype", ["int8", "int16", "int32"])
    def test_quantize_and_dequantize_ints(d, dtype):
        x = data(d, 9, specials=True)
        scale = np.float32(np.abs(x).max()) if d else np.float32(1.0)
        want = C.quantize_ints(x, 1.0, scale, 7, 12345, dtype, 16)
        assert_same(G.quantize_ints(T(x), 1.0, scale, 7, 12345, dtype, 16), want)
        assert_same(G.quantize_ints(T(x), one(1.0, torch.float64), one(scale), 7,
                                    one(12345), np.dtype(dtype), 16), want)
        total = want.astype(np.int32) * 3
        for factor in (0.125, one(0.3, torch.float64)):
            assert_same(G.dequantize_ints(T(total), factor), C.dequantize_ints(total, float(factor)))

    def test_quantize_through_the_call_site_equals_the_oracle():
        class Comm:
            rank, size = 0, 3
            allreduce_int_dtypes = ("int32",)

        x = data(1001, 9) * np.float32(2.0 ** 64)
        scale, pre = np.full(1, np.abs(x).max() * 2.0 ** -64, np.float32), np.full(1, 2.0 ** -64, np.float32)
        got = gq.quantize(backend, Comm, T(x), T(scale), T(pre), 42, 16, CounterRNG(5))
        assert_same(got, gq.quantize(B, Comm, x, scale, pre, 42, 16, CounterRNG(5)))
        assert_same(gq.dequantize(backend, Comm, got, 1001, T(scale), T(pre), 42, 16),
                    gq.dequantize(B, Comm, got.cpu().numpy(), 1001, scale, pre, 42, 16))

    # --- a scale per block (global_qsgd's and qsgd's block) ----------------------------------------
    @pytest.mark.parametrize("d,block", [(d, b) for d in abs_sizes for b in (64, 100, 512)]
                             + [(d, 1) for d in abs_sizes if d < 64])  # a program per block
    def test_block_absmax_finite(d, block):
        x = data(d, 31, specials=True)
        for y in (x, np.where(np.arange(d) == d // 2, np.float32(np.nan), x)):
            m, ok = G.block_absmax_finite(T(y), block)
            want_m, want_ok = C.block_absmax_finite(y, block)
            assert_same(m, want_m)
            assert ok.dtype == torch.bool and bool(ok) is want_ok is (d == 0 or y is x)
            if want_ok:  # the oracle's maxima, wherever every element is finite
                assert_same(want_m, gq.block_absmax(B, y, block_counts(d, block)) if d > block else
                            np.full(1, np.abs(y).max() if d else 0.0, np.float32))

    @pytest.mark.parametrize("d", sizes)
    @pytest.mark.parametrize("block,first", [(4, 0), (8, 8), (100, 0), (100, 48), (512, 8), (1000, 0)])
    def test_quantize_and_dequantize_blocks(d, block, first):
        """Elements ``first ..`` of a buffer of blocks: the first block perhaps cut short."""
        x = data(d, 13, specials=True)
        k = max(1, -(-(first % block + d) // block))
        scale = (np.abs(x).max() if d else 1.0) * np.linspace(0.5, 2.0, k).astype(np.float32)
        pre = np.where(np.arange(k) % 3 == 1, np.float32(2.0 ** -64), np.float32(1.0)).astype(np.float32)
        scale = np.where(pre < 1, scale * pre, scale).astype(np.float32)
        for width in (8, 16):
            want = C.quantize_lanes_blocks(x, pre, scale, block, 42, 0xBEEF, width, True, first)
            assert_same(G.quantize_lanes_blocks(T(x), T(pre), T(scale), block, 42, 0xBEEF, width, True, first), want)
            assert_same(G.quantize_lanes_blocks(T(x), T(pre), T(scale), block, 42, one(0xBEEF, torch.int64), width,
                                                False, first), C.quantize_lanes_blocks(x, pre, scale, block, 42, 0xBEEF,
                                                                                       width, False, first))
            factor = (scale / 126).astype(np.float32)
            assert_same(G.dequantize_lanes_blocks(T(want * 3), d, width, T(factor), block, first),
                        C.dequantize_lanes_blocks(want * 3, d, width, factor, block, first))
        for dtype in ("int8", "int16", "int32"):
            want = C.quantize_ints_blocks(x, pre, scale, block, 7, 12345, dtype, first)
            assert_same(G.quantize_ints_blocks(T(x), T(pre), T(scale), block, 7, one(12345), dtype, first), want)
            total = want.astype(np.int32) * 3
            assert_same(G.dequantize_ints_blocks(T(total), T(scale / 21), block, first),
                        C.dequantize_ints_blocks(total, scale / 21, block, first))
        with pytest.raises(ValueError, match="values per block"):
            G.quantize_ints_blocks(T(x), T(pre[:k - 1]), T(scale), block, 7, 1, "int8", first)

    def test_blocks_through_the_call_site_equal_the_oracle():
        """global_qsgd's quantize and dequantize of blocks (the fused primitives here, the
        division and the multiply by blocks in the oracle), near the float32 maximum."""
        class Comm:
            rank, size = 0, 3
            allreduce_int_dtypes = ("int32",)

        x = data(2000, 9) * np.float32(2.0 ** 64)
        counts = block_counts(2000, 512)
        scale = np.array([np.abs(x[i:i + 512]).max() for i in range(0, 2000, 512)], np.float32) * np.float32(2.0 ** -64)
        pre = np.full(4, 2.0 ** -64, np.float32)
        got = gq.quantize_blocks(backend, Comm, T(x), T(scale), T(pre), counts, 512, 42, 16, CounterRNG(5))
        assert_same(got, gq.quantize_blocks(B, Comm, x, scale, pre, counts, 512, 42, 16, CounterRNG(5)))
        assert_same(gq.dequantize(backend, Comm, got, 2000, T(scale), T(pre), 42, 16, counts=counts, block=512),
                    gq.dequantize(B, Comm, got.cpu().numpy(), 2000, scale, pre, 42, 16, counts=counts, block=512))

    # --- exponential dithering ---------------------------------------------------------------------
    @pytest.mark.parametrize("d", sizes)
    @pytest.mark.parametrize("n", [1, 5])
    def test_exponential_dithering(d, n):
        x = data(d, 11, specials=True)
        scale = np.float32(np.abs(x).max()) if d else np.float32(1.0)
        want = C.exp_encode(x, scale, n, 777)
        assert_same(want, ed.encode(B, x, np.full(1, scale), n, _Key(777)))
        assert_same(G.exp_encode(T(x), scale, n, 777), want)
        assert_same(G.exp_encode(T(x), one(scale), n, one(777)), want)
        other = C.exp_encode(data(d, 12), scale, n, 778)
        combined = C.exp_combine(want, other, 779)
        assert_same(G.exp_combine(T(want), T(other), 779), combined)
        factor = 2.0 ** (n - 1) / n
        assert_same(G.exp_decode(T(combined), factor, scale), C.exp_decode(combined, factor, scale))
        assert_same(G.exp_decode(T(combined), one(factor), one(scale)),
                    C.exp_decode(combined, float(np.float32(factor)), scale))

    def test_exp_combine_covers_every_pair_of_codes():
        a, b = np.repeat(np.arange(256, dtype=np.uint8), 256), np.tile(np.arange(256, dtype=np.uint8), 256)
        for key in (1, 0xFFFFFFFF):
            assert_same(G.exp_combine(T(a), T(b), key), C.exp_combine(a, b, key))
        assert_same(C.exp_combine(a, b, 5), ed.combine_codes(B, a, b, draws(B, 5, a.size)))
        top = np.array([255, 127, 1, 129], np.uint8)  # saturation at the float32 maximum
        for scale in (np.float32(3e38), np.float32(np.finfo(np.float32).max)):
            assert_same(G.exp_decode(T(top), 16.0, scale), C.exp_decode(top, 16.0, scale))

    # --- Marsit, re-binarisation, BinSGDM ----------------------------------------------------------
    @pytest.mark.parametrize("nbytes", byte_sizes)
    def test_marsit_select(nbytes):
        own, recv = (np.random.default_rng(s).integers(0, 256, nbytes).astype(np.uint8) for s in (1, 2))
        for keep in (1 / 3, 0.5, one(0.75, torch.float64)):
            want = C.marsit_select(own, recv, float(np.float32(float(keep))), 4242)
            assert_same(G.marsit_select(T(own), T(recv), keep, 4242), want)
        op = MarsitSelect()
        assert_same(op.combine(backend, T(own), 1, T(recv), 2, CounterRNG(7)), op.combine(B, own, 1, recv, 2, CounterRNG(7)))

    @pytest.mark.parametrize("width", byte_sizes)
    @pytest.mark.parametrize("k", [1, 2, 3, 5])
    def test_rebinarize(width, k):
        rows = np.random.default_rng(width + k).integers(0, 256, k * width).astype(np.uint8)
        want = C.rebinarize(rows, k, 99)
        assert_same(G.rebinarize(T(rows), k, 99), want)
        assert_same(want, threshold_rows(B, rows, k, 99))
        out = torch.empty(width, dtype=torch.uint8, device=device)  # a tensor k: the output's size gives the rows
        assert G.rebinarize(T(rows), one(k), one(99), out=out) is out
        assert_same(out, want)

    def test_rebinarize_refuses_what_the_cpu_kernel_refuses():
        with pytest.raises(ValueError, match="k=3 rows"):
            G.rebinarize(torch.zeros(10, dtype=torch.uint8, device=device), 3, 1)
        with pytest.raises(ValueError, match="needs out="):
            G.rebinarize(torch.zeros(9, dtype=torch.uint8, device=device), one(3), 1)

    @pytest.mark.parametrize("d", tile_sizes)
    def test_binsgdm_encode(d):
        g, m = data(d, 50, specials=True), data(d, 51) * 0.1
        b = np.abs(data(d, 52)) * 0.2
        if d > 8:
            b[5:7] = 0.0  # no |g| history: z = 0
        for beta in (0.9, one(0.5, torch.float32)):
            want = C.binsgdm_encode(g, m, b, float(beta), 31337)
            got = G.binsgdm_encode(T(g), T(m), T(b), beta, 31337)
            for x, y in zip(got, want):
                assert_same(x, y)
        outs = [torch.empty(d, device=device), torch.empty(d, device=device), torch.empty((d + 7) // 8, dtype=torch.uint8, device=device)]
        got = G.binsgdm_encode(T(g), T(m), T(b), 0.9, 31337, m_out=outs[0], b_out=outs[1], bits_out=outs[2])
        assert all(x is y for x, y in zip(got, outs))
        from hvd_quant.optimizers.binsgdm import binary_randomize
        for x, y in zip(binary_randomize(backend, T(g), T(m), T(b), 0.9, 31337), binary_randomize(B, g, m, b, 0.9, 31337)):
            assert_same(x, y)

    # --- random draws ------------------------------------------------------------------------------
    @pytest.mark.parametrize("n", draw_sizes)
    def test_uniform_and_random_bytes(n):
        want = C.uniform(0x9E3779B9, n)
        assert_same(G.uniform(0x9E3779B9, n, device=device), want)
        assert_same(want, draws(B, 0x9E3779B9, n))
        assert_same(G.uniform(one(0x9E3779B9), n), want)
        want = C.random_bytes(31, n)
        assert_same(want, random_bytes(B, 31, n))
        assert_same(G.random_bytes(31, n, device=device), want)
        out = torch.empty(n, dtype=torch.uint8, device=device)
        assert G.random_bytes(one(31), n, out=out) is out
        assert_same(out, want)

    # --- the Adam-family update rules --------------------------------------------------------------
    def _as(kind, value):
        """A scalar as a Python float or a one-element tensor holding its float32 value."""
        return one(value, torch.float32) if kind == "tensor" else value

    @pytest.mark.parametrize("d", sizes)
    @pytest.mark.parametrize("wd,kind", [(0.0, "number"), (0.01, "number"), (0.01, "tensor")])
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
        if kind == "tensor":  # no weight decay, read through the pointer: x * 0 is never added
            pairs.append((G.adam_descend(T(x), T(m), T(v), S(1e-3), S(1e-8), S(0.0))[0],
                          C.adam_descend(x, m, v, N(1e-3), N(1e-8), 0.0)[0]))
        for i, (got, want) in enumerate(pairs):
            assert_same(got, want, f"result {i}")
        assert G.adam_descend(T(x), T(m), T(v), 1e-3, 1e-8, wd)[1].numel() == 0

    @pytest.mark.parametrize("d", inplace_sizes)
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
        out = torch.empty(d, device=device)
        assert G.ema(T(m), T(x), 0.9, out=out) is out
        assert_same(out, C.ema(m, x, 0.9))
        base, ww = torch.empty(d, device=device), torch.empty(d, device=device)
        assert G.zero_one_sync_input(T(x), T(m), T(w), T(v), T(u), 0.9, 1e-3, 1e-8, 0.0, base=base, w=ww)[0] is base

    # --- launch settings (issue 56) ------------------------------------------------------------------
    @pytest.mark.parametrize("family,settings", LAUNCH_TRIED,
                             ids=[f"{f}-" + "-".join(f"{k}{v}" for k, v in s.items()) for f, s in LAUNCH_TRIED])
    def test_launch_settings_keep_the_bits(family, settings):
        """Other launch settings of a kernel family (``G.LAUNCH``; what ``bench_gpu.py --tune``
        tries) give the CPU kernels' outputs: the family's cases at the sizes around its
        programs, and for the lane kernels one program of the new block and a bit more."""
        saved = {f: dict(v) for f, v in G.LAUNCH.items()}
        G.set_launch({family: settings})
        try:
            if family == "sums":
                for d in sum_sizes[-2:]:
                    test_compensate_sums_and_signs(d, True)
            elif family == "unpack":
                for d in tile_sizes[-2:]:
                    test_unpack_scaled_sum(d, 3)
                    test_unpack_sum_residual(d, 3)
            elif family in ("quantize_lanes", "dequantize_lanes"):
                for d in sizes[-1:] + [settings["block"] + 5]:
                    for width in (8, 16):
                        test_quantize_and_dequantize_lanes(d, width)
            elif family == "marsit_select":
                for nbytes in byte_sizes[-2:]:
                    test_marsit_select(nbytes)
            else:
                for width in byte_sizes[-2:]:
                    test_rebinarize(width, 3)
        finally:
            G.LAUNCH.clear()
            G.LAUNCH.update(saved)

    return {name: fn for name, fn in locals().items() if name.startswith("test_")}


#: Launch settings other than the defaults, per kernel family, for
#: ``test_launch_settings_keep_the_bits`` (every family; warps both ways; lane blocks both ways).
LAUNCH_TRIED = [("sums", {"num_warps": 4}), ("sums", {"num_warps": 16}), ("unpack", {"num_warps": 16}),
                ("quantize_lanes", {"num_warps": 8, "block": 8192}), ("quantize_lanes", {"num_warps": 2, "block": 4096}),
                ("dequantize_lanes", {"num_warps": 4, "block": 8192}),
                ("dequantize_lanes", {"num_warps": 2, "block": 2048}),
                ("marsit_select", {"num_warps": 8}), ("rebinarize", {"num_warps": 16})]
