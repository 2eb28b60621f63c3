"""Fused CPU kernels (hvd_quant.kernels.cpu) against their generic twins on the numpy oracle.

Bit for bit wherever the result does not depend on the order of a float sum, with the
same random draws (both sides compute draw ``i`` from the call key and ``i`` alone), and
independent of numba's thread count.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hvd_quant
from hvd_quant import kernels
from hvd_quant.compressors import exp_dithering as ed
from hvd_quant.compressors import global_qsgd as gq
from hvd_quant.compressors.marsit import MarsitSelect
from hvd_quant.core.backend import NumpyBackend, NumpyKernelBackend
from hvd_quant.core.packing import (pack_lanes, pack_signs, sign_pack_residual, sign_residual,
                                    unpack_lanes, unpack_scaled_sum, unpack_sum_residual,
                                    unpack_sums_signs)
from hvd_quant.core.hierarchical import rebinarize, select_rows, threshold_rows
from hvd_quant.core.rng import CounterRNG, draws, random_bytes
from hvd_quant.core.runner import CompressorRunner
from hvd_quant.core.segments import block_counts, chunk_blocks, compensate_sums, compensate_sums_signs
from hvd_quant.core.simulate import ThreadWorld
from hvd_quant.optimizers import elementwise as ew
from solo_comm import SoloComm

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason=f"kernels off: {kernels.why_disabled()}")

B = NumpyBackend()
K = NumpyKernelBackend()
SIZES = [0, 1, 7, 8, 9, 1001, 3 * kernels.cpu_module().BLOCK + 5]


def data(d, seed=0, specials=False):
    x = np.random.default_rng(seed).standard_normal(d).astype(np.float32)
    if specials and d >= 8:
        x[:4] = [0.0, -0.0, 1e-45, -1e-45]  # both zeros and subnormals
    return x


def split(d):
    """Three segments, one of them empty, none aligned to bytes."""
    a = d // 3
    return [a, 0, d - a]


def sign_rows(d, rows):
    """``rows`` ranks' packed signs of ``d`` elements, one after the other, and their
    scales (one per rank and segment of :func:`split`)."""
    packed = np.concatenate([pack_signs(B, data(d, 10 + r)) for r in range(rows)])
    return packed, np.random.default_rng(3).random(rows * 3).astype(np.float32)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    kernels.set_threads(request.param)  # 1: the serial twins; 2: the parallel ones
    yield request.param
    kernels.set_threads(None)


@pytest.mark.parametrize("d", SIZES)
def test_sign_pack_and_residual_are_bit_exact(d, threads):
    x, e = data(d, 1, specials=True), data(d, 2)
    counts = split(d)
    scales = np.array([0.5, 2.0, 0.25], np.float32)
    np.testing.assert_array_equal(kernels.cpu_module().sign_pack(x), pack_signs(B, x))
    for resid in (e, None):
        bits_k, res_k = sign_pack_residual(K, x, resid, scales, counts)
        bits_g, res_g = sign_pack_residual(B, x, resid, scales, counts)
        np.testing.assert_array_equal(bits_k, bits_g)
        np.testing.assert_array_equal(res_k, res_g)
    # In place into the residual buffer (the fast path's use of ``out``).
    buf = e.copy()
    bits_k, res_k = sign_pack_residual(K, x, buf, scales, counts, out=buf)
    assert res_k is buf
    np.testing.assert_array_equal(buf, sign_pack_residual(B, x, e, scales, counts)[1])


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_unpack_scaled_sum_is_bit_exact(d, rows, threads):
    counts = split(d)
    packed, scales = sign_rows(d, rows)
    base = data(d, 4)
    for b in (None, base):
        np.testing.assert_array_equal(unpack_scaled_sum(K, packed, scales, counts, d, base=b),
                                      unpack_scaled_sum(B, packed, scales, counts, d, base=b))
    # Decoded over base itself (onebit's server stage): the same floats.
    buf = base.copy()
    assert unpack_scaled_sum(K, packed, scales, counts, d, base=buf, out=buf) is buf
    np.testing.assert_array_equal(buf, unpack_scaled_sum(B, packed, scales, counts, d, base=base))


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_unpack_sum_residual_is_the_two_passes_bit_for_bit(d, rows, threads):
    # The decode with this rank's residual (ef_sign, marsit, onebit): the same floats as unpack_scaled_sum then
    # sign_residual, also when the mean goes into x itself and the residual into e.
    counts = split(d)
    packed, scales = sign_rows(d, rows)
    own = np.array([0.5, 2.0, 0.25], np.float32)
    x, e = data(d, 1, specials=True), data(d, 2)
    for resid in (e, None):
        want = (unpack_scaled_sum(B, packed, scales, counts, d), sign_residual(B, x, resid, own, counts))
        for got in (unpack_sum_residual(K, packed, scales, counts, d, x, resid, own),
                    unpack_sum_residual(B, packed, scales, counts, d, x, resid, own)):
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
    xb, eb = x.copy(), e.copy()
    mean, res = unpack_sum_residual(K, packed, scales, counts, d, xb, eb, own, out=xb, resid_out=eb)
    assert mean is xb and res is eb
    np.testing.assert_array_equal(xb, unpack_scaled_sum(B, packed, scales, counts, d))
    np.testing.assert_array_equal(eb, sign_residual(B, x, e, own, counts))


@pytest.mark.parametrize("d", [0, 8, 1000, 3 * kernels.cpu_module().BLOCK + 8, 1001])
@pytest.mark.parametrize("rows", [1, 3])
def test_unpack_sums_signs_is_the_decode_then_its_sums_and_signs(d, rows, threads):
    # onebit's server stage: decode over the compensated state (its residual folded in),
    # then the sums of squares and the signs of the result. Segments on whole bytes take
    # the fused pass; 1001 elements (a last, partial byte) the two kernels.
    a = d // 3 // 8 * 8
    counts = [a, 0, d - a]
    packed, scales = sign_rows(d, rows)
    base, folds = data(d, 4, specials=True), np.array([0.5, 2.0, 0.25], np.float32)
    for b, f in ((None, None), (base, None), (base, folds)):
        for squares in (False, True):
            mean = unpack_scaled_sum(K, packed, scales, counts, d, base=b, base_scales=f)
            sums, bits = compensate_sums_signs(K, mean, None, counts, squares)
            buf = None if b is None else b.copy()
            got = unpack_sums_signs(K, packed, scales, counts, d, base=buf, base_scales=f, out=buf,
                                    squares=squares)
            assert b is None or got[0] is buf
            for g, w in zip(got, (mean, sums, bits)):  # the two kernels' very floats and sums
                np.testing.assert_array_equal(g, w)
            want = unpack_sums_signs(B, packed, scales, counts, d, base=b, base_scales=f,
                                     squares=squares)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_allclose(got[1], want[1], rtol=1e-12)
            np.testing.assert_array_equal(got[2], want[2])


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("squares", [False, True])
def test_compensate_sums_match_in_float64(d, squares, threads):
    x, e = data(d, 5), data(d, 6)
    for resid in (e, None):
        got = compensate_sums(K, x, resid, split(d), squares)
        np.testing.assert_allclose(got, compensate_sums(B, x, resid, split(d), squares), rtol=1e-12)


@pytest.mark.parametrize("squares", [False, True])
def test_many_small_segments_sum_in_one_call_with_the_same_bits(squares, threads):
    """A norm per block of a few hundred elements (qsgd's ``block``) makes thousands of
    segments; they are summed in one call, with the bits of one call per segment."""
    cpu = kernels.cpu_module()
    x, e = data(10_007, 50, specials=True), data(10_007, 51)
    counts = [512] * 19 + [0, 10_007 - 19 * 512]  # an empty one and a short last one
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    for resid in (e, None):
        got = compensate_sums(K, x, resid, counts, squares)
        e_arr = np.empty(0, np.float32) if resid is None else resid
        one_by_one = [cpu._compensate_sums(x, e_arr, bounds[s], bounds[s + 1], squares)
                      for s in range(len(counts))]
        assert got.tobytes() == np.array(one_by_one, np.float64).tobytes()
        np.testing.assert_allclose(got, compensate_sums(B, x, resid, counts, squares), rtol=1e-12)


def test_sums_do_not_depend_on_the_thread_count():
    x = data(5 * kernels.cpu_module().BLOCK + 3, 7)
    out = []
    for n in (1, 2):
        kernels.set_threads(n)
        out.append((compensate_sums(K, x, None, [x.size], True), gq.absmax_finite(K, x)[0]))
    kernels.set_threads(None)
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_array_equal(out[0][1], out[1][1])


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_inputs_are_flagged(bad):
    x = data(1001, 8)
    x[500] = bad
    m, ok = gq.absmax_finite(K, x)
    assert not ok and np.isfinite(m)
    assert not np.isfinite(compensate_sums(K, x, None, [1001])[0])
    assert not np.isfinite(compensate_sums(K, x, None, [1001], squares=True)[0])


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("width,native", [(8, False), (16, False), (8, True), (16, True)])
@pytest.mark.parametrize("pre", [1.0, 2.0 ** -64])
def test_quantize_and_dequantize_are_bit_exact(d, width, native, pre, threads):
    class Comm:
        rank, size = 0, 3
        allreduce_int_dtypes = ("int8", "int16", "int32") if native else ("int32",)

    x = data(d, 9) * np.float32(1 / pre)
    scale, levels = np.full(1, np.abs(x).max() * pre if d else 1.0, np.float32), 42
    pre_t = np.full(1, pre, np.float32)
    wire_k = gq.quantize(K, Comm, x, scale, pre_t, levels, width, CounterRNG(5))
    wire_g = gq.quantize(B, Comm, x, scale, pre_t, levels, width, CounterRNG(5))
    assert wire_k.dtype == wire_g.dtype
    np.testing.assert_array_equal(wire_k, wire_g)
    total = wire_g * 3 if native else wire_g  # any integer tensor decodes the same way
    np.testing.assert_array_equal(gq.dequantize(K, Comm, total, d, scale, pre_t, levels, width),
                                  gq.dequantize(B, Comm, total, d, scale, pre_t, levels, width))


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("n", [1, 2, 5])
def test_exponential_dithering_is_bit_exact(d, n, threads):
    x = data(d, 11, specials=True)
    scale = np.full(1, np.abs(x).max() if d else 1.0, np.float32)
    a_k, a_g = ed.encode(K, x, scale, n, CounterRNG(3)), ed.encode(B, x, scale, n, CounterRNG(3))
    np.testing.assert_array_equal(a_k, a_g)
    b = ed.encode(B, data(d, 12), scale, n, CounterRNG(4))
    op = ed.ExpDitheringSum()
    c_k, c_g = op.combine(K, a_g, 1, b, 1, CounterRNG(6)), op.combine(B, a_g, 1, b, 1, CounterRNG(6))
    np.testing.assert_array_equal(c_k, c_g)
    np.testing.assert_array_equal(ed.exp_decode(K, c_g, scale, n), ed.exp_decode(B, c_g, scale, n))


def test_exp_combine_covers_every_pair_of_codes():
    a, b = (np.repeat(np.arange(256, dtype=np.uint8), 256), np.tile(np.arange(256, dtype=np.uint8), 256))
    keep = ((a & 127) > 0) | (a == 0)  # code 128 ("negative zero") is never produced
    keep &= ((b & 127) > 0) | (b == 0)
    a, b = a[keep], b[keep]
    op = ed.ExpDitheringSum()
    for seed in range(3):
        np.testing.assert_array_equal(op.combine(K, a, 1, b, 1, CounterRNG(seed)),
                                      op.combine(B, a, 1, b, 1, CounterRNG(seed)))


@pytest.mark.parametrize("nbytes", [0, 1, 9, 70001])
@pytest.mark.parametrize("counts", [(1, 1), (1, 2), (3, 1)])
def test_marsit_select_is_bit_exact(nbytes, counts, threads):
    own, recv = (np.random.default_rng(s).integers(0, 256, nbytes).astype(np.uint8) for s in (1, 2))
    op = MarsitSelect()
    np.testing.assert_array_equal(op.combine(K, own, counts[0], recv, counts[1], CounterRNG(7)),
                                  op.combine(B, own, counts[0], recv, counts[1], CounterRNG(7)))


@pytest.mark.parametrize("width", [0, 1, 13, 64, 10_007])
@pytest.mark.parametrize("k", [2, 3, 5])
def test_threshold_rebinarisation_is_bit_exact(width, k, threads):
    """The hierarchical allreduce's re-binarisation by a draw per element (what
    ``rebinarize`` does for k not a power of two): k rows of packed signs (the node's
    shard, whole bytes) to packed unbiased bits, the kernel (which counts bits, never
    decoding the sums) against the generic path (decode, then draw). Pieces of 4096
    elements: 10_007 bytes cross several, with a partial last one."""
    rows = np.random.default_rng(width + k).integers(0, 256, k * width).astype(np.uint8)
    got = threshold_rows(K, rows, k, 4242)
    assert got.dtype == np.uint8 and got.size == width
    np.testing.assert_array_equal(got, threshold_rows(B, rows, k, 4242))


@pytest.mark.parametrize("k, way", [(3, threshold_rows), (5, rebinarize), (2, select_rows),
                                    (4, rebinarize), (8, rebinarize)])
def test_rebinarisation_is_unbiased_and_exact_where_the_rows_agree(k, way):
    """Where all k rows agree the node's sign is theirs (probability 0 or 1); elsewhere
    +1 comes with probability ones / k, by a draw against that threshold (k = 3, 5) or by
    a row chosen with log2 k random bits (k = 2, 4, 8; ``rebinarize`` picks the way by k).
    2.5 10^4 elements per count: a tolerance of 5 standard deviations of a binomial
    proportion. Where every row holds the same bit pattern, the result is that pattern."""
    width = 3_125 * (k + 1)
    rng = np.random.default_rng(11 + k)
    ones = rng.integers(0, k + 1, 8 * width)  # +1 signs among the k rows, per element
    signs = rng.permuted(np.arange(k)[:, None] < ones[None, :], axis=0)  # which rows: any
    rows = np.packbits(signs.astype(np.uint8), axis=1, bitorder="little").reshape(-1)
    packed = way(K, rows, k, 99)
    assert packed.dtype == np.uint8 and packed.size == width
    got = np.unpackbits(packed, bitorder="little").astype(bool)
    for c in range(k + 1):
        share = got[ones == c].mean()
        p = c / k
        assert abs(share - p) <= 5 * math.sqrt(p * (1 - p) / (ones == c).sum()), (c, share)
    same = np.tile(rows[:width], k)
    np.testing.assert_array_equal(way(K, same, k, 5), rows[:width])


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 4097, 100_003])
def test_random_bytes_equal_the_oracle(n, threads):
    """The fused ``random_bytes`` (whole 32-bit draws as 4 bytes each, a partial last
    word) against the oracle's hash and byte split; other keys, other bytes."""
    got = random_bytes(K, 31, n)
    assert got.dtype == np.uint8 and got.size == n
    np.testing.assert_array_equal(got, random_bytes(B, 31, n))
    if n >= 4:
        assert (got != random_bytes(B, 32, n)).any()
    if n >= 100_000:  # every bit a fair coin: 5 standard deviations of 800k bits
        assert abs(np.unpackbits(got).mean() - 0.5) <= 5 * 0.5 / math.sqrt(8 * n)


def test_row_selection_is_the_same_on_every_backend():
    """k = 2 and 4: the selected rows come from the counter-based draws, so the kernel
    backend (fused ``random_bytes``) and the oracle give the same bits; a different key, other
    bits."""
    for k in (2, 4):
        rows = np.random.default_rng(k).integers(0, 256, k * 10_007).astype(np.uint8)
        got = select_rows(K, rows, k, 4242)
        np.testing.assert_array_equal(got, select_rows(B, rows, k, 4242))
        assert (got != select_rows(B, rows, k, 4243)).any()


def test_rebinarize_refuses_rows_that_do_not_divide():
    with pytest.raises(ValueError, match="k=3 rows"):
        kernels.cpu_module().rebinarize(np.zeros(10, np.uint8), 3, 1)


def test_uniform_draws_equal_the_generator():
    for n in (0, 1, 1000):
        np.testing.assert_array_equal(kernels.cpu_module().uniform(12345, n), draws(B, 12345, n))


def test_the_hash_takes_any_integer_width():
    """The kernels' hash is 32-bit IR over the low 32 bits of its arguments: an index or
    key of another integer type draws what the int64/uint64 ones do."""
    from numba import njit
    cpu = kernels.cpu_module()

    @njit
    def draws_of(key):
        return (cpu._uniform(key, np.int64(5)), cpu._uniform(key, np.uint8(5)),
                cpu._uniform(np.uint32(key), np.int16(5)), cpu._draw(np.int64(7), key),
                cpu._draw(np.int32(7), key))

    u64, u8, u32_i16, d64, d32 = draws_of(np.uint64(12345))
    assert u64 == u8 == u32_i16 == kernels.cpu_module().uniform(12345, 6)[5]
    assert d64 == d32


@settings(max_examples=60, deadline=None)
@given(d=st.integers(0, 300), seed=st.integers(0, 2 ** 31), nseg=st.integers(1, 5),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]))
def test_sign_kernels_on_random_shapes(d, seed, nseg, scale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(d) * scale).astype(np.float32)
    cuts = np.sort(rng.integers(0, d + 1, nseg - 1))
    counts = np.diff(np.concatenate([[0], cuts, [d]])).tolist()
    scales = rng.random(nseg).astype(np.float32)
    for got, want in zip(sign_pack_residual(K, x, None, scales, counts),
                         sign_pack_residual(B, x, None, scales, counts)):
        np.testing.assert_array_equal(got, want)
    packed = pack_signs(B, x)
    np.testing.assert_array_equal(unpack_scaled_sum(K, packed, scales, counts, d),
                                  unpack_scaled_sum(B, packed, scales, counts, d))


@settings(max_examples=60, deadline=None)
@given(d=st.integers(0, 300), seed=st.integers(0, 2 ** 31), width=st.sampled_from([8, 16]),
       levels=st.integers(1, 63), offset=st.booleans())
def test_lane_kernels_on_random_shapes(d, seed, width, levels, offset):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(d).astype(np.float32)
    scale = np.full(1, max(np.abs(x).max(initial=0.0), 1e-30), np.float32)
    words = kernels.cpu_module().quantize_lanes(x, 1.0, scale[0], levels, 99, width, offset)
    q = gq.linear_quantize(B, x, scale, levels, draws(B, 99, d))
    np.testing.assert_array_equal(words, pack_lanes(B, q, width, offset))
    if offset:
        np.testing.assert_array_equal(
            kernels.cpu_module().dequantize_lanes(words, d, width, 0.25),
            unpack_lanes(B, words, d, width).astype(np.float32) * np.float32(0.25))


class _Comm:
    rank, size = 0, 3

    def __init__(self, native):
        self.allreduce_int_dtypes = ("int8", "int16", "int32") if native else ("int32",)


@settings(max_examples=60, deadline=None)
@given(d=st.integers(0, 3000), block=st.sampled_from([4, 8, 60, 100, 512]), start=st.integers(0, 200),
       seed=st.integers(0, 2 ** 31), width=st.sampled_from([8, 16]), native=st.booleans())
def test_block_kernels_equal_the_oracle(d, block, start, seed, width, native):
    """A scale and a pre per block (global_qsgd and qsgd's ``block``), fused, against the
    oracle's division by blocks and one-scale quantizer on a grid of 1, for a piece of the
    buffer from element ``8 * start`` (a pipelined chunk: it may start inside a block)."""
    rng = np.random.default_rng(seed)
    first = 8 * start
    whole = first + d
    x = (rng.standard_normal(d) * np.exp(3 * rng.standard_normal(d))).astype(np.float32)
    b0, counts = chunk_blocks(whole, block, first, whole)
    k = len(counts)
    scale = (np.abs(x).max(initial=1.0) * rng.uniform(0.5, 2.0, k)).astype(np.float32)
    pre = np.where(rng.random(k) < 0.3, np.float32(gq.RESCALE), np.float32(1.0)).astype(np.float32)
    comm, levels = _Comm(native), gq.max_levels("max", 3, width)
    args = (comm, x, scale, pre, counts, block, levels, width)
    want = gq.quantize_blocks(B, *args, key=77, first=first)
    np.testing.assert_array_equal(gq.quantize_blocks(K, *args, key=77, first=first), want)
    sums = want * 3
    kw = dict(counts=counts, block=block, first=first)
    np.testing.assert_array_equal(gq.dequantize(K, comm, sums, d, scale, pre, levels, width, **kw),
                                  gq.dequantize(B, comm, sums, d, scale, pre, levels, width, **kw))
    if d > block:
        whole_counts = block_counts(d, block)  # the blocks' maxima of a whole buffer
        y = x if seed % 2 else np.where(np.arange(d) == d // 2, np.float32(np.nan), x)
        np.testing.assert_array_equal(gq.local_scale_stat(K, y, "max", whole_counts),
                                      gq.local_scale_stat(B, y, "max", whole_counts))


def test_block_kernels_refuse_short_tables_and_split_words():
    C = kernels.cpu_module()
    x, three = data(24, 3), np.ones(3, np.float32)
    with pytest.raises(ValueError, match="3 values per block needed, got 2"):
        C.quantize_ints_blocks(x, three[:2], three, 8, 3, 1, "int8")
    with pytest.raises(ValueError, match="4 values per block needed, got 3"):
        C.dequantize_ints_blocks(x.astype(np.int8), three, 8, first=4)  # 4 into a block: four blocks
    with pytest.raises(ValueError, match="whole words of 4 lanes"):
        C.quantize_lanes_blocks(x, three, three, 10, 3, 1, 8, True)
    with pytest.raises(ValueError, match="block must be >= 1"):
        C.block_absmax_finite(x, 0)
    # The compressor takes the generic path where the words would split (6 is not a
    # multiple of 4 lanes), with the same bits as the kernels' path elsewhere.
    xs = [data(40, r) for r in range(2)]
    comp = hvd_quant.get("global_qsgd", block=6)
    want = [CompressorRunner(comp, B, seed=1).reduce(x, SoloComm(), "g", [("g", 40)]) for x in xs]
    got = [CompressorRunner(comp, K, seed=1).reduce(x, SoloComm(), "g", [("g", 40)]) for x in xs]
    np.testing.assert_array_equal(got, want)


COMPRESSORS = [("ef_sign", {}), ("marsit", {}), ("marsit", {"compensation": "global"}),
               ("marsit", {"scale": 0.01}), ("global_qsgd", {}), ("global_qsgd", {"norm": "l2"}),
               ("global_qsgd_exp", {}), ("onebit", {})]


@pytest.mark.parametrize("name,opts", COMPRESSORS, ids=[f"{n}-{o}" for n, o in COMPRESSORS])
@pytest.mark.parametrize("n", [2, 3])
def test_compressors_through_kernels_equal_the_oracle(name, opts, n):
    """Whole reductions, three steps (state carried): kernels and oracle agree."""
    d, segs = 2000, [("a", 700), ("b", 1300)]
    xs = [[data(d, 100 * r + s) for s in range(3)] for r in range(n)]
    results = []
    for backend in (B, K):
        runners = [CompressorRunner(hvd_quant.get(name, **opts), backend, seed=3) for _ in range(n)]
        results.append(ThreadWorld(n).run(lambda c: [runners[c.rank].reduce(xs[c.rank][s], c, "buf", segs)
                                                      for s in range(3)]))
    for step in range(3):
        # Scales come from float64 sums in different orders: equal to float32 rounding.
        np.testing.assert_allclose(results[1][0][step], results[0][0][step], rtol=1e-6, atol=1e-7)


# --- the Adam-family primitives (hvd_quant.optimizers.elementwise) ------------------------
def _adam_inputs(d):
    x, m, u, w = data(d, 21, specials=True), data(d, 22) * 1e-2, data(d, 23) * 1e-3, data(d, 24)
    v = np.abs(data(d, 25)) * 1e-4
    if d >= 8:
        v[:2] = 0.0  # a constant input: v stays 0 (eps alone divides)
    return x, m, v, u, w


def _elementwise_results(backend, x, m, v, u, w, wd):
    return [ew.ema(backend, m, x, 0.9), ew.ema(backend, v, x, 0.999, square=True),
            ew.descend(backend, x, w, 1e-3, wd),
            ew.descend(backend, x, w * 3, 1e-3, wd, divisor=3),  # BinSGDM: a sum over 3 ranks
            ew.adam_descend(backend, x, m, v, 3e-3, 1e-8, wd),
            *ew.adam_descend(backend, x, m, v, 1e-3, 1e-6, wd, acc=u),
            ew.precondition(backend, u, v, 1e-8),
            *ew.zero_one_sync_result(backend, x, u, w, v, 1e-8, 0.0123),
            *ew.zero_one_sync_result(backend, x, None, w, v, 1e-8, 0.0123),
            *ew.zero_one_sync_input(backend, x, m, w, v, u, 0.9, 1e-3, 1e-8, wd)]


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_adam_family_primitives_are_bit_exact(d, wd, threads):
    inputs = _adam_inputs(d)
    for got, want in zip(_elementwise_results(K, *inputs, wd), _elementwise_results(B, *inputs, wd)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_in_place_updates_equal_fresh_ones(d, wd, threads):
    """The optimizers write kept steps over their inputs (parameters, moments, the 0/1
    Adam accumulator): the in-place kernels give the fresh ones' bits."""
    x, m, v, u, w = _adam_inputs(d)
    k = kernels.cpu_module()
    a = m.copy()
    np.testing.assert_array_equal(k.ema(a, x, 0.9, in_place=True), k.ema(m, x, 0.9))
    np.testing.assert_array_equal(a, k.ema(m, x, 0.9))
    y = x.copy()
    assert k.descend(y, w, 1e-3, wd, in_place=True) is y
    np.testing.assert_array_equal(y, k.descend(x, w, 1e-3, wd))
    want_x, want_u = k.adam_descend(x, m, v, 1e-3, 1e-6, wd, u)
    y, acc = x.copy(), u.copy()
    got_x, got_u = k.adam_descend(y, m, v, 1e-3, 1e-6, wd, acc, x_out=y, acc_out=acc)
    assert got_x is y and got_u is acc
    np.testing.assert_array_equal(y, want_x)
    np.testing.assert_array_equal(acc, want_u)
    y = x.copy()
    k.adam_descend(y, m, v, 3e-3, 1e-8, wd, x_out=y)
    np.testing.assert_array_equal(y, k.adam_descend(x, m, v, 3e-3, 1e-8, wd)[0])


LAYOUTS = {  # segment sizes: one buffer, unaligned ones, one crossing several blocks
    "one": lambda d: [d],
    "thirds": split,
    "blocks": lambda d: [5, kernels.cpu_module().BLOCK + 3, 0, max(0, d - kernels.cpu_module().BLOCK - 8)],
}


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("with_e", [True, False], ids=["x+e", "x"])
def test_sums_and_signs_in_one_pass(d, layout, with_e, threads):
    """compensate_sums_signs: the very sums of compensate_sums' kernel (the scale must not
    depend on which one a path uses) and the bits of pack_signs; sign_residual: the
    residual of sign_pack_residual, also in place over e."""
    counts = LAYOUTS[layout](d)
    if sum(counts) != d:
        counts = [d]
    x = data(d, 40, specials=True)
    e = data(d, 41) * 0.5 if with_e else None
    for squares in (False, True):
        sums, bits = compensate_sums_signs(K, x, e, counts, squares)
        assert sums.tobytes() == compensate_sums(K, x, e, counts, squares).tobytes()
        np.testing.assert_allclose(sums, compensate_sums(B, x, e, counts, squares), rtol=1e-12)
        np.testing.assert_array_equal(bits, pack_signs(B, x if e is None else x + e))
        np.testing.assert_array_equal(compensate_sums_signs(B, x, e, counts, squares)[1], bits)
    scales = (np.arange(len(counts), dtype=np.float32) + 1) * 0.25
    want = sign_pack_residual(B, x, e, scales, counts)[1]
    np.testing.assert_array_equal(sign_residual(K, x, e, scales, counts), want)
    np.testing.assert_array_equal(sign_residual(B, x, e, scales, counts), want)
    if e is not None:
        got = sign_residual(K, x, e, scales, counts, out=e)
        np.testing.assert_array_equal(e, want)
        assert got is e or np.shares_memory(got, e)


def test_adam_family_primitives_match_the_torch_generic_path(monkeypatch):
    """The kernels against torch's own float32 expressions (Python scalars included):
    equal, except where torch's CPU ``sqrt``, which is not correctly rounded (one ulp
    off numpy's and LLVM's in about 0.6% of elements, more or fewer by CPU), feeds the
    result. That ulp goes through a division and a subtraction which may cancel (a
    parameter minus a step of about its size), so the bound is in ulps of the element's
    largest operand or result, not relative to the result: at most 8 (4 seen, on an AMD
    EPYC; a relative 1e-6 failed there on a result 60 ulps small after cancellation)."""
    torch = pytest.importorskip("torch")
    from hvd_quant.torch.backend import TorchBackend

    fast, generic = TorchBackend(), TorchBackend()
    monkeypatch.setattr(generic, "kernel", lambda name, *tensors: None)
    inputs = [torch.from_numpy(a) for a in _adam_inputs(100_003)]
    operand_scale = np.max([np.abs(a.numpy()) for a in inputs], axis=0)
    for wd in (0.0, 0.01):
        for got, want in zip(_elementwise_results(fast, *inputs, wd), _elementwise_results(generic, *inputs, wd)):
            got, want = got.numpy(), want.numpy()
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
            ulp = np.spacing(np.maximum(operand_scale, np.abs(want)).astype(np.float32))
            finite = np.isfinite(want)
            err = np.abs(got[finite].astype(np.float64) - want[finite]) / ulp[finite]
            assert err.max(initial=0) <= 8, (err.max(), int(np.argmax(err)))
        # Without a square root the very same bits.
        for i in (0, 1, 2, 3, 11):  # the emas, the descends, the momentum -(w / lrs)
            torch.testing.assert_close(_elementwise_results(fast, *inputs, wd)[i],
                                       _elementwise_results(generic, *inputs, wd)[i], rtol=0, atol=0)


@pytest.mark.parametrize("d", SIZES)
def test_all_finite_kernel(d):
    x = data(d, 30)
    assert kernels.cpu_module().all_finite(x)
    for bad in (np.nan, np.inf, -np.inf):
        for where in {0, d // 2, d - 1} if d else ():
            y = x.copy()
            y[where] = bad
            assert not kernels.cpu_module().all_finite(y)
    if d:  # the largest finite float32 is finite
        y = x.copy()
        y[-1] = np.finfo(np.float32).max
        assert kernels.cpu_module().all_finite(y)


def test_every_kernel_is_cached_under_the_same_key_in_every_process():
    """numba keys a kernel's on-disk cache by its bytecode and the pickled cells of its
    closure. A cell that holds a dispatcher (a helper the kernel calls) pickles differently
    in every process, so every process compiled that kernel again and added a copy to the
    cache: the lane kernels' word decoder did, from 032ec20 to 2026-12-06, in every rank.
    Cells of numbers pickle the same everywhere."""
    kernels.cpu_module()
    found = kernels.dispatchers()
    assert len(found) > 60
    for d in found:
        for cell in d.py_func.__closure__ or ():
            assert isinstance(cell.cell_contents, (bool, int, float)), (d.py_func.__qualname__, cell.cell_contents)
