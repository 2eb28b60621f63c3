"""Fused CPU kernels (numba): one pass over memory per primitive, no full-size temporaries.

Each function here is the fast twin of a generic implementation written with
:class:`~hvd_quant.core.backend.Backend` operations; the docstring names that twin, and
``tests/test_kernels.py`` checks the pair on the numpy oracle: bit for bit wherever the
result does not depend on the order of a float sum, and with the same random draws
(:mod:`hvd_quant.core.rng`), since both compute draw ``i`` of a call from ``(key, i)``
alone. Float sums that set a scale (``sum |p|``, ``sum p**2``) accumulate in float64
over fixed blocks of :data:`BLOCK` elements, so they do not depend on the thread count
either; they agree with the generic float64 sums to a few units of float64 rounding.

Functions take and return numpy arrays (torch CPU tensors are passed as zero-copy
``tensor.numpy()`` views by :mod:`hvd_quant.torch.backend`). Arrays are 1-D, C-contiguous,
float32 unless stated. Kernels with a ``prange`` loop exist as serial and parallel twins
compiled from one body; :mod:`hvd_quant.kernels.threads` picks which runs (serial at one
thread per rank) and how many threads the parallel ones use. ``cache=True`` keeps
compiled code on disk, so the compile cost (about a second per kernel) is paid once per
machine (``scripts/bootstrap.sh`` pays it), and :func:`hvd_quant.kernels.warm_up` loads
it before training starts.
"""

import types

import numpy as np
from llvmlite import ir
from numba import njit, prange, types as nbtypes
from numba.extending import intrinsic

from .blocks import check_lanes, piece_blocks

BLOCK = 1 << 16
# error_model="numpy": a float division by zero gives inf or nan, as in the numpy oracle,
# instead of a check that raises ZeroDivisionError, which also kept LLVM from vectorizing
# every loop that divides (0/1 Adam's sync result ran 4x slower).
_OPTS = dict(cache=True, nogil=True, error_model="numpy")


# --- serial and parallel twins ------------------------------------------------------------
# Every kernel with a ``prange`` loop is compiled two ways from one body: with a parallel
# region on numba's pool, and serially (``prange`` is then ``range``). One thread per rank,
# the usual case when ranks share a host, runs the serial twin: a parallel region on one
# thread pays numba's scheduling call and vectorizes worse (benchmarks/bench_threads.py).
# hvd_quant.kernels.threads picks the flavour; both give the same bits (fixed blocks).
_SERIAL = [False]


def use_serial(flag):
    """Run the serial twins (``True``) or the parallel ones (see :mod:`.threads`)."""
    _SERIAL[0] = bool(flag)


def _renamed(fn, suffix):
    """``fn`` under another qualified name: numba names a kernel's on-disk cache after it,
    so the twins do not overwrite each other's compiled code."""
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + suffix, fn.__defaults__,
                              fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + suffix
    twin.__doc__ = fn.__doc__
    return twin


class _Twin:
    """A kernel's parallel and serial compilations; calls go to the flavour in use.
    Compiled (or loaded from the cache) lazily, on a flavour's first call."""

    def __init__(self, fn):
        self.parallel = njit(parallel=True, **_OPTS)(fn)
        self.serial = njit(**_OPTS)(_renamed(fn, "__serial"))
        self.__name__, self.__doc__ = fn.__name__, fn.__doc__

    def __call__(self, *args):
        return (self.serial if _SERIAL[0] else self.parallel)(*args)

    def dispatchers(self):
        return (self.parallel, self.serial)


def _twin(fn):
    return _Twin(fn)


# --- buffers given to the wrappers ---------------------------------------------------------
def _same(a, b):
    """Whether ``a`` and ``b`` are the same buffer (an output given as one of the inputs)."""
    return a is not None and b is not None and a.size == b.size and a.ctypes.data == b.ctypes.data


def _as_rows(packed, scales, d):
    """Packed sign rows ``(rows, ceil(d / 8))`` and their float32 scales ``(rows, S)``."""
    packed = np.ascontiguousarray(packed).reshape(-1, (d + 7) // 8)
    return packed, np.ascontiguousarray(scales, dtype=np.float32).reshape(packed.shape[0], -1)


# --- random draws (hvd_quant.core.rng) ---------------------------------------------------
# The hash is emitted as 32-bit integer IR. Written in numba code it was 64-bit: numba
# types integer arithmetic as 64-bit, so every multiply was a vpmullq (several micro-ops,
# half the lanes per vector), which made the draws, not memory, the cost of stochastic
# rounding. In 32-bit lanes (vpmulld) most kernels that draw per element took 17-57% less
# time (docs/benchmarks/kernels.md). Same bits: lowbias32 works modulo 2**32 either way.
def _mix32_ir(builder, x):
    i32 = x.type
    x = builder.xor(x, builder.lshr(x, ir.Constant(i32, 16)))
    x = builder.mul(x, ir.Constant(i32, 0x7FEB352D))
    x = builder.xor(x, builder.lshr(x, ir.Constant(i32, 15)))
    x = builder.mul(x, ir.Constant(i32, 0x846CA68B))
    return builder.xor(x, builder.lshr(x, ir.Constant(i32, 16)))


def _low32(builder, value, numba_type):
    """The low 32 bits of an integer argument (a narrower one extended by its sign)."""
    i32 = ir.IntType(32)
    if value.type.width > 32:
        return builder.trunc(value, i32)
    if value.type.width < 32:
        return (builder.sext if numba_type.signed else builder.zext)(value, i32)
    return value


def _draw_ir(builder, index, index_type, key, key_type):
    """``bits(i) = mix32(mix32(i ^ key) ^ key)`` of ``rng`` on the low 32 bits of both."""
    key = _low32(builder, key, key_type)
    inner = _mix32_ir(builder, builder.xor(_low32(builder, index, index_type), key))
    return _mix32_ir(builder, builder.xor(inner, key))


def _integers(*numba_types):
    return all(isinstance(t, nbtypes.Integer) for t in numba_types)


@intrinsic
def _draw(typingctx, index, key):
    """Draw ``index`` of the call with key ``key`` (integers; their low 32 bits count):
    ``rng.hash_bits`` as a uint32."""
    if not _integers(index, key):
        return None

    def codegen(context, builder, signature, args):
        return _draw_ir(builder, args[0], signature.args[0], args[1], signature.args[1])
    return nbtypes.uint32(index, key), codegen


@intrinsic
def _uniform(typingctx, key, index):
    """Draw ``index`` of the call with key ``key``: ``rng.uniform_from_bits``, the top 24
    bits times ``2**-24``, a float32 in [0, 1) (exact: 24 bits fit its mantissa)."""
    if not _integers(index, key):
        return None

    def codegen(context, builder, signature, args):
        bits = _draw_ir(builder, args[1], signature.args[1], args[0], signature.args[0])
        top = builder.lshr(bits, ir.Constant(ir.IntType(32), 8))
        f32 = ir.FloatType()
        return builder.fmul(builder.uitofp(top, f32), ir.Constant(f32, 2.0 ** -24))
    return nbtypes.float32(key, index), codegen


@_twin
def _uniform_fill(key, out):
    k = np.uint64(key)
    for i in prange(out.size):
        out[i] = _uniform(k, i)


def uniform(key, n, out=None):
    """``Backend.uniform``: ``n`` draws of the call with key ``key`` (into ``out`` if given)."""
    out = np.empty(n, np.float32) if out is None else out
    _uniform_fill(key, out)
    return out


@_twin
def _random_bytes_fill(key, out):
    k = np.uint64(key)
    words = out.size // 4
    for w in prange(words):
        h = np.uint64(_draw(w, k))
        for b in range(4):
            out[4 * w + b] = np.uint8((h >> np.uint64(8 * b)) & np.uint64(255))
    if out.size % 4:  # the last word's first bytes
        h = np.uint64(_draw(words, k))
        for b in range(out.size - 4 * words):
            out[4 * words + b] = np.uint8((h >> np.uint64(8 * b)) & np.uint64(255))


def random_bytes(key, n, out=None):
    """``rng.random_bytes``: ``n`` bytes, byte ``i`` the byte ``i % 4`` (least significant
    first) of 32-bit draw ``i // 4`` of the call with key ``key`` (into ``out`` if given)."""
    out = np.empty(n, np.uint8) if out is None else out
    _random_bytes_fill(key, out)
    return out


# --- sign bits (hvd_quant.core.packing) -------------------------------------------------
# Loops run over whole bytes inside one segment with a fixed inner loop of 8 (which numba
# compiles to straight-line code); the few bytes that straddle a segment boundary, and the
# last partial byte, go through a general per-element path afterwards.

@_twin
def _sign_pack(x, out):
    for b in prange(x.size // 8):
        v = 0
        for j in range(8):
            v |= np.int32(x[8 * b + j] >= 0) << j
        out[b] = np.uint8(v)
    tail = x.size // 8
    if x.size % 8:
        v = 0
        for j in range(x.size - 8 * tail):
            v |= np.int32(x[8 * tail + j] >= 0) << j
        out[tail] = np.uint8(v)


def sign_pack(x, out=None):
    """``packing.pack_signs``: bit ``x >= 0``, 8 per byte, least significant first (into
    ``out`` if given)."""
    out = np.empty((x.size + 7) // 8, np.uint8) if out is None else out
    _sign_pack(x, out)
    return out


@njit(**_OPTS)
def _general_bytes(bounds):
    """Indices of the bytes holding a segment boundary strictly inside, or the tail."""
    d = bounds[-1]
    out = [np.int64(-1)]  # each byte once (several boundaries may share one), in order
    for s in range(1, bounds.size - 1):
        if bounds[s] % 8 and bounds[s] < d and bounds[s] // 8 != out[-1]:
            out.append(bounds[s] // 8)
    if d % 8 and d // 8 != out[-1]:
        out.append(d // 8)
    return out[1:]


@njit(inline="always", **_OPTS)
def _segment_of(bounds, i):
    return np.searchsorted(bounds, i, side="right") - 1


# Packing bits in the same loop that computes the residual keeps LLVM from vectorizing
# either (the 8 shifted ORs form a chain per byte). So the whole bytes of a segment go in
# cache-sized pieces of SPR_PIECE elements, each in two loops: a vectorized one that
# writes the residual and one 0/1 byte per element into small scratch buffers, then one
# that packs 8 such bytes into a bit byte with a multiply (each 0/1 byte lands on its own
# bit of the top byte). The residual goes through the scratch buffer because it is
# usually written over ``e`` itself: with the same array read and written, LLVM's
# run-time overlap check sends the loop down its scalar path.
SPR_PIECE = 4096
_PACK_MUL = np.uint64(0x0102040810204080)  # bit 56 + j gets byte j
_S56 = np.uint64(56)


@njit(**_OPTS)
def _spr_piece(x, e, has_e, sc, pos, tmp, resid, bits):
    m = x.size
    for i in range(m):
        p = x[i] + e[i] if has_e else x[i]
        ge = p >= np.float32(0)
        pos[i] = np.uint8(1) if ge else np.uint8(0)
        tmp[i] = p - (sc if ge else -sc)
    for i in range(m):
        resid[i] = tmp[i]
    words = pos[:m].view(np.uint64)
    for b in range(m // 8):
        bits[b] = np.uint8((words[b] * _PACK_MUL) >> _S56)


@_twin
def _sign_pack_residual(x, e, scales, bounds, bits, resid):
    # p = x + e is recomputed here rather than stored by the pass that summed it: the
    # same float32 add gives the same p, and no buffer of p is written or read.
    d = x.size
    has_e = e.size > 0
    for s in range(scales.size):
        sc = scales[s]
        first, end = (bounds[s] + 7) // 8, bounds[s + 1] // 8
        pieces = (8 * (end - first) + SPR_PIECE - 1) // SPR_PIECE
        for k in prange(pieces):
            a = 8 * first + k * SPR_PIECE
            b = min(8 * end, a + SPR_PIECE)
            pos = np.empty(SPR_PIECE, np.uint8)
            tmp = np.empty(SPR_PIECE, np.float32)
            _spr_piece(x[a:b], e[a:b] if has_e else e, has_e, sc, pos, tmp, resid[a:b],
                       bits[a // 8:b // 8])
    for b in _general_bytes(bounds):
        v = 0
        for i in range(8 * b, min(d, 8 * b + 8)):
            sc = scales[_segment_of(bounds, i)]
            p = x[i] + e[i] if has_e else x[i]
            pos = p >= 0
            v |= np.int32(pos) << (i - 8 * b)
            resid[i] = p - (sc if pos else -sc)
        bits[b] = np.uint8(v)


def sign_pack_residual(x, e, scales, bounds, out=None, bits_out=None):
    """``packing.sign_pack_residual``: with ``p = x + e`` (``e`` may be ``None``), the
    packed sign bits of ``p`` and the residual ``p - where(p >= 0, scale, -scale)``, one
    float32 scale per segment (``bounds``: int64 segment offsets). ``out`` (may be ``e``
    itself) receives the residual in place, ``bits_out`` the bits."""
    bits = np.empty((x.size + 7) // 8, np.uint8) if bits_out is None else bits_out
    resid = np.empty_like(x) if out is None else out
    if x.size:
        _sign_pack_residual(x, np.empty(0, np.float32) if e is None else e,
                            np.ascontiguousarray(scales, dtype=np.float32), bounds, bits, resid)
    return bits, resid


@njit(inline="always", **_OPTS)
def _signed(byte, j, sc):
    return sc if (byte >> j) & 1 else -sc


@njit(**_OPTS)
def _unpack_row(row, sc, add, out):
    """``out (+)= where(bit, sc, -sc)`` for the 8 len(row) bits of ``row`` (1-D slices:
    a 2-D slice has a run-time inner stride and would not vectorize)."""
    # sc * (+1 or -1) is exact: the same float as the select of sc or -sc, without a branch.
    if add:
        for b in range(row.size):
            v = np.int32(row[b])
            for j in range(8):
                out[8 * b + j] += sc * np.float32(2 * ((v >> j) & 1) - 1)
    else:
        for b in range(row.size):
            v = np.int32(row[b])
            for j in range(8):
                out[8 * b + j] = sc * np.float32(2 * ((v >> j) & 1) - 1)


@njit(**_OPTS)
def _add_into(out, base):
    for i in range(out.size):
        out[i] += base[i]


#: Bytes per parallel piece of :func:`_unpack_scaled_sum`: 16 KB of float32 output, so the
#: rows after the first add into memory still in the L1 cache.
UNPACK_PIECE = 512


@njit(**_OPTS)
def _decode_piece(packed, col, a, b, base, has_base, folds, fold, out):
    """Bytes ``a:b`` of every row times its scale (``col``), summed in row order into
    ``out[8a:8b]``, then ``base`` added (its residual with the scale ``fold`` if ``folds``).
    The piece of base is read first (into the L1 cache), so that out may be base itself:
    onebit's server stage decodes over its state, with no new buffer."""
    kept = base[8 * a:8 * b].copy() if has_base else base
    if folds:
        _residual_in_place(kept, fold)
    for r in range(packed.shape[0]):
        _unpack_row(packed[r][a:b], col[r], r > 0, out[8 * a:8 * b])
    if has_base:
        _add_into(out[8 * a:8 * b], kept)


@_twin
def _unpack_scaled_sum(packed, scales, bounds, base, base_scales, out):
    # Per piece, row 0 is written, rows 1.. are added, then base: the generic twin's order,
    # so the same floats. The output is written from memory once and re-read from the
    # cache per row. (A per-row table of the 8 signed scales of every byte value, summed
    # over the rows in registers, was 1.5x slower than this on an AVX-512 core: 14.5 against
    # 9.6 ms for 2 rows of 31.7M elements, both cores busy, 2026-11-26.)
    d = out.size
    rows = packed.shape[0]
    has_base = base.size > 0
    folds = base_scales.size > 0
    for s in range(scales.shape[1]):
        first, end = (bounds[s] + 7) // 8, bounds[s + 1] // 8
        col = np.ascontiguousarray(scales[:, s])
        fold = base_scales[s] if folds else np.float32(0)
        for k in prange((end - first + UNPACK_PIECE - 1) // UNPACK_PIECE):
            a = first + k * UNPACK_PIECE
            _decode_piece(packed, col, a, min(end, a + UNPACK_PIECE), base, has_base, folds, fold, out)
    for b in _general_bytes(bounds):
        for i in range(8 * b, min(d, 8 * b + 8)):
            s = _segment_of(bounds, i)
            acc = _signed(packed[0, b], i - 8 * b, scales[0, s])
            for r in range(1, rows):
                acc += _signed(packed[r, b], i - 8 * b, scales[r, s])
            if has_base:
                v = base[i]
                if folds:
                    v = v - (base_scales[s] if v >= np.float32(0) else -base_scales[s])
                acc += v
            out[i] = acc


@njit(**_OPTS)
def _residual_in_place(p, sc):
    """``p - where(p >= 0, sc, -sc)`` over ``p``: the residual that ``_sign_pack_residual``
    writes, the same float32 operation."""
    for i in range(p.size):
        v = p[i]
        p[i] = v - (sc if v >= np.float32(0) else -sc)


def unpack_scaled_sum(packed, scales, bounds, d, base=None, out=None, base_scales=None):
    """``packing.unpack_scaled_sum``: ``sum_r scales[r, seg(i)] * sign_r(i)`` for rows
    ``r`` of packed sign bytes, summed in row order in float32, plus ``base`` (if given)
    after the sum; with ``base_scales`` (one float32 per segment), plus the residual
    ``base - where(base >= 0, base_scale, -base_scale)`` instead. ``out`` may be ``base``
    itself."""
    out = np.empty(d, np.float32) if out is None else out
    if d == 0:
        return out
    packed, scales = _as_rows(packed, scales, d)
    _unpack_scaled_sum(packed, scales, bounds, *_base_and_folds(base, base_scales), out)
    return out


def _base_and_folds(base, base_scales):
    """The decode's ``base`` and ``base_scales`` as the kernels take them: empty float32
    arrays for "none" (a folded residual needs a base)."""
    none = np.empty(0, np.float32)
    folds = (none if base is None or base_scales is None
             else np.ascontiguousarray(base_scales, dtype=np.float32).reshape(-1))
    return (none if base is None else base), folds


# The decode and this rank's error-feedback residual in one pass (ef_sign, marsit, onebit's
# worker): the residual pass reads x and e and writes e, the decode writes out, which is x
# itself when the mean goes back into the gradient; a write to memory not in the cache
# reads it first, so the two separate passes read x twice. Here each piece's residual is
# written first (x and e are read into the cache), then the rows are decoded over it.
@_twin
def _unpack_sum_residual(packed, scales, bounds, x, e, has_e, own, in_place, resid, out):
    d = out.size
    rows = packed.shape[0]
    for s in range(scales.shape[1]):
        first, end = (bounds[s] + 7) // 8, bounds[s + 1] // 8
        col = np.ascontiguousarray(scales[:, s])
        sc = own[s]
        for k in prange((end - first + UNPACK_PIECE - 1) // UNPACK_PIECE):
            a = first + k * UNPACK_PIECE
            b = min(end, a + UNPACK_PIECE)
            if in_place:
                _residual_piece_in_place(x[8 * a:8 * b], e[8 * a:8 * b], sc)
            else:
                _residual_piece(x[8 * a:8 * b], e[8 * a:8 * b] if has_e else e, has_e, sc,
                                resid[8 * a:8 * b])
            for r in range(rows):
                _unpack_row(packed[r][a:b], col[r], r > 0, out[8 * a:8 * b])
    for b in _general_bytes(bounds):
        for i in range(8 * b, min(d, 8 * b + 8)):
            s = _segment_of(bounds, i)
            p = x[i] + e[i] if has_e else x[i]
            resid[i] = p - (own[s] if p >= np.float32(0) else -own[s])
            acc = _signed(packed[0, b], i - 8 * b, scales[0, s])
            for r in range(1, rows):
                acc += _signed(packed[r, b], i - 8 * b, scales[r, s])
            out[i] = acc


def unpack_sum_residual(packed, scales, bounds, d, x, e, own_scales, out=None, resid_out=None):
    """``packing.unpack_sum_residual``: :func:`unpack_scaled_sum` (no base) and
    :func:`sign_residual` of ``p = x + e`` with this rank's ``own_scales``, in one pass;
    the same floats as the two calls. ``out`` may be ``x`` itself and ``resid_out`` may
    be ``e`` itself. Returns ``(sum, residual)``."""
    out = np.empty(d, np.float32) if out is None else out
    in_place = _same(resid_out, e)
    resid = e if in_place else (np.empty_like(x) if resid_out is None else resid_out)
    if d == 0:
        return out, resid
    packed, scales = _as_rows(packed, scales, d)
    own = np.ascontiguousarray(own_scales, dtype=np.float32).reshape(-1)
    _unpack_sum_residual(packed, scales, bounds, x, np.empty(0, np.float32) if e is None else e,
                         e is not None, own, in_place, resid, out)
    return out, resid


# --- sums that set scales -----------------------------------------------------------------
# The float64 sums of a block may be reassociated (``fastmath`` reassoc only: inf and NaN
# still propagate): LLVM then keeps several vector accumulators instead of one serial
# chain of dependent adds, which made these sums 4x slower than reading the memory. The
# order is fixed by the compiled code, so a given machine always gets the same sum, for
# any thread count; it differs from a strict left-to-right sum by float64 rounding only.
@njit(fastmath={"reassoc"}, **_OPTS)
def _block_sum(x, e, has_e, squares):
    acc = 0.0
    if squares:
        for i in range(x.size):
            w = np.float64(x[i] + e[i] if has_e else x[i])
            acc += w * w
    else:
        for i in range(x.size):
            acc += abs(np.float64(x[i] + e[i] if has_e else x[i]))
    return acc


@_twin
def _compensate_sums(x, e, lo, hi, squares):
    n = hi - lo
    nblocks = (n + BLOCK - 1) // BLOCK
    partial = np.zeros(max(nblocks, 1), np.float64)
    has_e = e.size > 0
    for blk in prange(nblocks):
        a = lo + blk * BLOCK
        b = min(hi, a + BLOCK)
        partial[blk] = _block_sum(x[a:b], e[a:b] if has_e else e, has_e, squares)
    total = 0.0
    for blk in range(nblocks):  # fixed order: the same sum for any thread count
        total += partial[blk]
    return total


@_twin
def _small_segment_sums(x, e, bounds, squares, out):
    # Segments of at most BLOCK elements are one block each: the sum _compensate_sums
    # makes of them (0.0 + the block's sum), for all of them in one call.
    has_e = e.size > 0
    for s in prange(bounds.size - 1):
        a, b = bounds[s], bounds[s + 1]
        total = 0.0
        total += _block_sum(x[a:b], e[a:b] if has_e else e, has_e, squares)
        out[s] = total


def compensate_sums(x, e, bounds, squares=False):
    """``segments.compensate_sums``: per segment, the float64 sum of ``|p|`` (or of
    ``p**2``) for ``p = x + e`` (``e`` may be ``None``). Many small segments (a norm per
    block of a few hundred elements) go in one call: a call per segment costs more than
    its sum."""
    e_arr = np.empty(0, np.float32) if e is None else e
    if bounds.size > 2 and int(np.max(np.diff(bounds))) <= BLOCK:
        out = np.empty(bounds.size - 1, np.float64)
        _small_segment_sums(x, e_arr, bounds, squares, out)
        return out
    return np.array([_compensate_sums(x, e_arr, bounds[s], bounds[s + 1], squares)
                     for s in range(bounds.size - 1)], np.float64)


@njit(**_OPTS)
def _block_signs(x, e, has_e, first, pos, bits):
    """Sign bits of ``x + e`` (slices starting at buffer element ``first``) for the whole
    bytes inside the slices, while they are still in the cache after the block's sum."""
    a = (first + 7) // 8 * 8 - first  # where the first whole byte starts in the slice
    m = max(0, (x.size - a) // 8 * 8)
    xs = x[a:a + m]
    es = e[a:a + m] if has_e else e
    for i in range(m):
        p = xs[i] + es[i] if has_e else xs[i]
        pos[i] = np.uint8(1) if p >= np.float32(0) else np.uint8(0)
    words = pos[:m].view(np.uint64)
    b0 = (first + a) // 8
    for w in range(m // 8):
        bits[b0 + w] = np.uint8((words[w] * _PACK_MUL) >> _S56)


@_twin
def _sums_and_signs(x, e, lo, hi, squares, bits):
    # The block sums exactly as _compensate_sums makes them (the same _block_sum on the
    # same slices), then the block's sign bits from the cache: one pass over memory.
    n = hi - lo
    nblocks = (n + BLOCK - 1) // BLOCK
    partial = np.zeros(max(nblocks, 1), np.float64)
    has_e = e.size > 0
    for blk in prange(nblocks):
        a = lo + blk * BLOCK
        b = min(hi, a + BLOCK)
        xs = x[a:b]
        es = e[a:b] if has_e else e
        partial[blk] = _block_sum(xs, es, has_e, squares)
        pos = np.empty(BLOCK, np.uint8)
        _block_signs(xs, es, has_e, a, pos, bits)
    total = 0.0
    for blk in range(nblocks):
        total += partial[blk]
    return total


def _edge_bytes(bounds, block):
    """Bytes that no block of :func:`_sums_and_signs` packs whole: those holding a
    segment or block boundary strictly inside, and the last, partial byte."""
    d = int(bounds[-1])
    edges = {d // 8} if d % 8 else set()
    for s in range(bounds.size - 1):
        for p in range(int(bounds[s]), int(bounds[s + 1]), block):  # start, block boundaries
            if p % 8:
                edges.add(p // 8)
    return np.array(sorted(edges), np.int64)


@njit(**_OPTS)
def _pack_edges(x, e, has_e, edges, bits):
    d = x.size
    for byte in edges:
        v = 0
        for i in range(8 * byte, min(d, 8 * byte + 8)):
            p = x[i] + e[i] if has_e else x[i]
            v |= np.int32(p >= 0) << (i - 8 * byte)
        bits[byte] = np.uint8(v)


def compensate_sums_signs(x, e, bounds, squares=False, bits_out=None):
    """``segments.compensate_sums_signs``: :func:`compensate_sums` (the same sums, bit for
    bit) and the packed sign bits of ``p = x + e`` (into ``bits_out`` if given), in one
    pass over ``x`` and ``e``."""
    e_arr = np.empty(0, np.float32) if e is None else e
    bits = np.empty((x.size + 7) // 8, np.uint8) if bits_out is None else bits_out
    sums = np.array([_sums_and_signs(x, e_arr, bounds[s], bounds[s + 1], squares, bits)
                     for s in range(bounds.size - 1)], np.float64)
    if x.size:
        _pack_edges(x, e_arr, e is not None, _edge_bytes(bounds, BLOCK), bits)
    return sums, bits


# The decode of a sum of sign rows, then the sums and the sign bits of the result (onebit's
# server stage: the chunk's new compensated values, their scale and their signs): each
# block is decoded into the output, then summed and signed while it is in the cache, with
# the same blocks and block sums as _sums_and_signs. The plain order read the output back
# from memory for the sums and signs after writing it.
@_twin
def _unpack_sums_signs(packed, scales, s, lo, hi, base, base_scales, squares, out, bits):
    has_base = base.size > 0
    folds = base_scales.size > 0
    col = np.ascontiguousarray(scales[:, s])
    fold = base_scales[s] if folds else np.float32(0)
    none = np.empty(0, np.float32)
    nblocks = (hi - lo + BLOCK - 1) // BLOCK
    partial = np.zeros(max(nblocks, 1), np.float64)
    for blk in prange(nblocks):
        a = lo + blk * BLOCK
        b = min(hi, a + BLOCK)
        for p in range(a // 8, b // 8, UNPACK_PIECE):  # as _unpack_scaled_sum, per piece
            _decode_piece(packed, col, p, min(b // 8, p + UNPACK_PIECE), base, has_base, folds, fold, out)
        partial[blk] = _block_sum(out[a:b], none, False, squares)
        pos = np.empty(BLOCK, np.uint8)
        _block_signs(out[a:b], none, False, a, pos, bits)
    total = 0.0
    for blk in range(nblocks):  # fixed order: the same sum for any thread count
        total += partial[blk]
    return total


def unpack_sums_signs(packed, scales, bounds, d, base=None, base_scales=None, out=None,
                      squares=False, bits_out=None):
    """``packing.unpack_sums_signs``: :func:`unpack_scaled_sum` into ``out`` (which may be
    ``base`` itself), then :func:`compensate_sums_signs` of the result with no ``e`` (the
    same floats, sums and bits), in one pass. Returns ``(sum, sums, bits)``. Segments that
    do not start on a whole byte, and a buffer whose last byte is partial, take the two
    kernels one after the other."""
    out = np.empty(d, np.float32) if out is None else out
    bits = np.empty((d + 7) // 8, np.uint8) if bits_out is None else bits_out
    if d == 0 or np.any(bounds % 8):
        out = unpack_scaled_sum(packed, scales, bounds, d, base=base, out=out, base_scales=base_scales)
        return (out,) + compensate_sums_signs(out, None, bounds, squares=squares, bits_out=bits)
    packed, scales = _as_rows(packed, scales, d)
    base, folds = _base_and_folds(base, base_scales)
    sums = np.array([_unpack_sums_signs(packed, scales, s, bounds[s], bounds[s + 1], base, folds,
                                        squares, out, bits)
                     for s in range(bounds.size - 1)], np.float64)
    return out, sums, bits


@_twin
def _sign_residual(x, e, scales, bounds, resid):
    has_e = e.size > 0
    for s in range(scales.size):
        sc = scales[s]
        lo, hi = bounds[s], bounds[s + 1]
        for k in prange((hi - lo + SPR_PIECE - 1) // SPR_PIECE):
            a = lo + k * SPR_PIECE
            b = min(hi, a + SPR_PIECE)
            _residual_piece(x[a:b], e[a:b] if has_e else e, has_e, sc, resid[a:b])


@njit(**_OPTS)
def _residual_piece(x, e, has_e, sc, resid):
    for i in range(x.size):
        p = x[i] + e[i] if has_e else x[i]
        resid[i] = p - (sc if p >= np.float32(0) else -sc)


@_twin
def _sign_residual_in_place(x, e, scales, bounds):
    # e read and written through the same array: LLVM vectorizes (see adam_descend).
    for s in range(scales.size):
        sc = scales[s]
        lo, hi = bounds[s], bounds[s + 1]
        for k in prange((hi - lo + SPR_PIECE - 1) // SPR_PIECE):
            a = lo + k * SPR_PIECE
            b = min(hi, a + SPR_PIECE)
            _residual_piece_in_place(x[a:b], e[a:b], sc)


@njit(**_OPTS)
def _residual_piece_in_place(x, e, sc):
    for i in range(x.size):
        p = x[i] + e[i]
        e[i] = p - (sc if p >= np.float32(0) else -sc)


def sign_residual(x, e, scales, bounds, out=None):
    """``packing.sign_residual``: the error-feedback residual ``p - where(p >= 0, scale,
    -scale)`` of ``p = x + e`` without the bits (:func:`compensate_sums_signs` packed
    them); into ``out``, which may be ``e`` itself."""
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    in_place = _same(out, e)
    resid = e if in_place else (np.empty_like(x) if out is None else out)
    e_arr = np.empty(0, np.float32) if e is None else e
    if not x.size:
        return resid
    if in_place:
        _sign_residual_in_place(x, e, scales, bounds)
    else:
        _sign_residual(x, e_arr, scales, bounds, resid)
    return resid


# Magnitudes compared as integers: for non-negative floats the order of the bit patterns is
# the order of the values, and an integer max vectorizes where a float max with NaN checks
# does not. Patterns at or above 0x7F800000 are inf and NaN.
_INF_BITS = np.uint32(0x7F800000)
_ABS_BITS = np.uint32(0x7FFFFFFF)


@njit(**_OPTS)
def _block_absmax_bits(u):
    finite_max = np.uint32(0)
    any_max = np.uint32(0)
    for i in range(u.size):
        a = u[i] & _ABS_BITS
        any_max = max(any_max, a)
        finite_max = max(finite_max, a if a < _INF_BITS else np.uint32(0))
    return finite_max, any_max


@_twin
def _absmax(x):
    u = x.view(np.uint32)
    n = u.size
    nblocks = (n + BLOCK - 1) // BLOCK
    mx = np.zeros(max(nblocks, 1), np.uint32)
    top = np.zeros(max(nblocks, 1), np.uint32)
    for blk in prange(nblocks):
        a = blk * BLOCK
        mx[blk], top[blk] = _block_absmax_bits(u[a:min(n, a + BLOCK)])
    return np.array([mx.max()], np.uint32).view(np.float32)[0], top.max() < _INF_BITS


def absmax_finite(x):
    """``global_qsgd.absmax_finite``: ``(max |x|, all finite)``; the max ignores
    non-finite elements."""
    if x.size == 0:
        return np.float32(0), True
    m, ok = _absmax(x)
    return np.float32(m), bool(ok)


@_twin
def _max_magnitude_bits(bits):
    n = bits.size
    nblocks = (n + BLOCK - 1) // BLOCK
    top = np.zeros(max(nblocks, 1), np.uint32)
    for blk in prange(nblocks):
        top[blk] = _block_absmax_bits(bits[blk * BLOCK:min(n, blk * BLOCK + BLOCK)])[1]
    return top.max()


def all_finite(x):
    """``Backend.all_finite`` for float32: no inf or NaN (exponent bits all ones)."""
    return x.size == 0 or bool(_max_magnitude_bits(x.view(np.uint32)) < np.uint32(0x7F800000))


# --- Global-QSGD linear dithering (hvd_quant.compressors.global_qsgd) ----------------------
@njit(inline="always", **_OPTS)
def _level(x, i, pre, scale, levels, key, first):
    # Element i of x is element first + i of the whole buffer: its draw has that index,
    # so a buffer quantized in chunks draws exactly what it draws in one call.
    v = (x[i] * pre) / scale
    v = min(max(v, np.float32(-1.0)), np.float32(1.0)) * levels
    low = np.floor(v)
    return np.int64(low) + np.int64(_uniform(key, first + i) < v - low)


@njit(inline="always", **_OPTS)
def _block_range(b, block, lead, n):
    # Elements [lo, hi) of a piece of n elements, starting lead into its first block, that
    # lie in its block b (the layout of hvd_quant.kernels.blocks).
    return max(b * block - lead, 0), min((b + 1) * block - lead, n)


@njit(inline="always", **_OPTS)
def _unpack_word(words, w, count, factor, out, width):
    # Word w's first count lanes of width bits, times factor, into out. Inlined into the
    # lane kernels, where width is a constant: the lanes' loop becomes straight-line code.
    # (A module function, not a closure of _lane_kernels: numba keys a kernel's cache by the
    # pickled cells of its closure, and a dispatcher in a cell pickles differently in every
    # process, so every process compiled the kernels again and added them to the cache.)
    lanes = 32 // width
    mask = (1 << width) - 1
    half = 1 << (width - 1)
    top = width * (lanes - 1)
    word = np.int64(words[w])
    if count == lanes:  # straight-line code for a whole word
        for j in range(lanes - 1):
            out[w * lanes + j] = np.float32(((word >> (width * j)) & mask) - half) * factor
        out[w * lanes + lanes - 1] = np.float32(word >> top) * factor  # arithmetic shift
    else:
        for j in range(count):
            lane = word >> top if j == lanes - 1 else ((word >> (width * j)) & mask) - half
            out[w * lanes + j] = np.float32(lane) * factor


def _lane_kernels(width):
    """Quantize and dequantize kernels for one lane width, compiled with the width as a
    constant so the loop over a word's lanes becomes straight-line code (2x faster): with
    one scale, and with a scale (a ``pre``, a factor) per block (``quantize_lanes_blocks``),
    where a block's elements fill whole words. Their closures hold numbers only (see
    :func:`_unpack_word`)."""
    lanes = 32 // width

    @_twin
    def quantize(x, pre, scale, levels, key, offset, words, first):
        d = x.size
        k = np.uint64(key)
        full = d // lanes
        for w in prange(full):
            acc = np.int64(offset)
            for j in range(lanes):
                acc += _level(x, w * lanes + j, pre, scale, levels, k, first) << (width * j)
            words[w] = np.int32(acc)
        if d % lanes:  # the last word: padding lanes hold 0
            acc = np.int64(offset)
            for j in range(d - full * lanes):
                acc += _level(x, full * lanes + j, pre, scale, levels, k, first) << (width * j)
            words[full] = np.int32(acc)

    @_twin
    def dequantize(words, factor, out):
        d = out.size
        for w in prange(d // lanes):
            _unpack_word(words, w, lanes, factor, out, width)
        if d % lanes:
            _unpack_word(words, d // lanes, d % lanes, factor, out, width)

    @_twin
    def quantize_blocks(x, pre, scale, block, lead, levels, key, offset, words, first):
        d = x.size
        k = np.uint64(key)
        for b in prange(scale.size):
            lo, hi = _block_range(b, block, lead, d)
            p, s = pre[b], scale[b]
            for w in range(lo // lanes, hi // lanes):
                acc = np.int64(offset)
                for j in range(lanes):
                    acc += _level(x, w * lanes + j, p, s, levels, k, first) << (width * j)
                words[w] = np.int32(acc)
            if hi == d and hi > lo and d % lanes:  # the last, partial word
                acc = np.int64(offset)
                for j in range(d - d // lanes * lanes):
                    acc += _level(x, d // lanes * lanes + j, p, s, levels, k, first) << (width * j)
                words[d // lanes] = np.int32(acc)

    @_twin
    def dequantize_blocks(words, factor, block, lead, out):
        d = out.size
        for b in prange(factor.size):
            lo, hi = _block_range(b, block, lead, d)
            for w in range(lo // lanes, hi // lanes):
                _unpack_word(words, w, lanes, factor[b], out, width)
            if hi == d and hi > lo and d % lanes:
                _unpack_word(words, d // lanes, d % lanes, factor[b], out, width)

    return quantize, dequantize, quantize_blocks, dequantize_blocks


_LANES = {8: _lane_kernels(8), 16: _lane_kernels(16)}


def quantize_lanes(x, pre, scale, levels, key, width, add_offset, first=0, out=None):
    """``global_qsgd.quantize``: stochastically rounded levels of ``x * pre / scale``
    (``linear_quantize``), packed ``32 // width`` per int32 word (``packing.pack_lanes``;
    into ``out`` if given). ``x`` is elements ``first ..`` of the buffer whose call has
    key ``key``."""
    lanes = 32 // width
    offset = sum((1 << (width - 1)) << (width * j) for j in range(lanes - 1)) if add_offset else 0
    words = np.empty((x.size + lanes - 1) // lanes, np.int32) if out is None else out
    _LANES[width][0](x, np.float32(pre), np.float32(scale), np.float32(levels), key, offset, words,
                     np.int64(first))
    return words


@_twin
def _quantize_ints(x, pre, scale, levels, key, out, first):
    k = np.uint64(key)
    for i in prange(x.size):
        out[i] = _level(x, i, pre, scale, levels, k, first)


def quantize_ints(x, pre, scale, levels, key, dtype, first=0, out=None):
    """``global_qsgd.quantize``: stochastically rounded levels of ``x * pre / scale`` as
    ``dtype`` (``linear_quantize``; into ``out`` if given); ``x`` is elements ``first ..``
    of the call's buffer."""
    out = np.empty(x.size, dtype) if out is None else out
    _quantize_ints(x, np.float32(pre), np.float32(scale), np.float32(levels), key, out, np.int64(first))
    return out


def dequantize_lanes(words, numel, width, factor, out=None):
    """``packing.unpack_lanes`` + ``global_qsgd.linear_dequantize``: lane sums of int32
    ``words`` times the float32 ``factor`` (into ``out`` if given)."""
    out = np.empty(numel, np.float32) if out is None else out
    _LANES[width][1](words, np.float32(factor), out)
    return out


@_twin
def _dequantize_ints(q, factor, out):
    for i in prange(q.size):
        out[i] = np.float32(q[i]) * factor


def dequantize_ints(q, factor, out=None):
    """``global_qsgd.linear_dequantize`` of native integer sums (into ``out`` if given)."""
    out = np.empty(q.size, np.float32) if out is None else out
    _dequantize_ints(q, np.float32(factor), out)
    return out


# --- A scale per block (global_qsgd's and qsgd's ``block``) -------------------------------
# Element i of a piece that starts at element ``first`` of the whole buffer belongs to the
# piece's block (first % block + i) // block: the blocks are the whole buffer's, so a chunk
# (core.pipeline) that starts inside a block takes that block's scale for its first
# elements. Each loop runs over whole blocks, one scale each: no division per element.


def _tables(*per_block):
    """Each table of values per block as a flat float32 array."""
    return [np.ascontiguousarray(v, np.float32).reshape(-1) for v in per_block]


@_twin
def _block_absmax(u, block, mx, top):
    n = u.size
    for b in prange(mx.size):
        a = b * block
        mx[b], top[b] = _block_absmax_bits(u[a:min(n, a + block)])


def block_absmax_finite(x, block):
    """``global_qsgd.block_absmax`` and ``Backend.all_finite`` in one pass:
    ``(max |x| per block of block elements over its finite elements, float32;
    all finite)``."""
    block, _, nblocks = piece_blocks(x.size, block, 0)
    mx = np.zeros(nblocks, np.uint32)
    top = np.zeros(nblocks, np.uint32)
    _block_absmax(x.view(np.uint32), np.int64(block), mx, top)
    return mx.view(np.float32), bool(top.max() < _INF_BITS)


def quantize_lanes_blocks(x, pre, scale, block, levels, key, width, add_offset, first=0, out=None):
    """:func:`quantize_lanes` with a ``pre`` and a scale per block of ``block`` elements of the
    whole buffer (float32 arrays, one value per block ``x`` touches: ``x`` is elements
    ``first ..``): ``global_qsgd.blockwise`` then ``global_qsgd.quantize`` on a grid of 1,
    in one pass. ``block`` and ``first`` must be multiples of the lanes per word."""
    pre, scale = _tables(pre, scale)
    block, lead, _ = piece_blocks(x.size, block, first, pre.size, scale.size)
    check_lanes(width, block, lead)
    lanes = 32 // width
    offset = sum((1 << (width - 1)) << (width * j) for j in range(lanes - 1)) if add_offset else 0
    words = np.empty((x.size + lanes - 1) // lanes, np.int32) if out is None else out
    _LANES[width][2](x, pre, scale, np.int64(block), np.int64(lead), np.float32(levels), key, offset, words,
                     np.int64(first))
    return words


@_twin
def _quantize_ints_blocks(x, pre, scale, block, lead, levels, key, out, first):
    k = np.uint64(key)
    for b in prange(scale.size):
        lo, hi = _block_range(b, block, lead, x.size)
        p, s = pre[b], scale[b]
        xs, os = x[lo:hi], out[lo:hi]  # indices from 0: no negative-index checks, vectorized
        for i in range(xs.size):
            os[i] = _level(xs, i, p, s, levels, k, first + lo)


def quantize_ints_blocks(x, pre, scale, block, levels, key, dtype, first=0, out=None):
    """:func:`quantize_ints` with a ``pre`` and a scale per block (as
    :func:`quantize_lanes_blocks`, any ``block``)."""
    pre, scale = _tables(pre, scale)
    block, lead, _ = piece_blocks(x.size, block, first, pre.size, scale.size)
    out = np.empty(x.size, dtype) if out is None else out
    _quantize_ints_blocks(x, pre, scale, np.int64(block), np.int64(lead), np.float32(levels), key, out,
                          np.int64(first))
    return out


def dequantize_lanes_blocks(words, numel, width, factor, block, first=0, out=None):
    """:func:`dequantize_lanes` with a float32 ``factor`` per block (as
    :func:`quantize_lanes_blocks`): ``global_qsgd.dequantize`` of blocks, in one pass."""
    (factor,) = _tables(factor)
    block, lead, _ = piece_blocks(numel, block, first, factor.size)
    check_lanes(width, block, lead)
    out = np.empty(numel, np.float32) if out is None else out
    _LANES[width][3](words, factor, np.int64(block), np.int64(lead), out)
    return out


@_twin
def _dequantize_ints_blocks(q, factor, block, lead, out):
    for b in prange(factor.size):
        lo, hi = _block_range(b, block, lead, q.size)
        f = factor[b]
        qs, os = q[lo:hi], out[lo:hi]
        for i in range(qs.size):
            os[i] = np.float32(qs[i]) * f


def dequantize_ints_blocks(q, factor, block, first=0, out=None):
    """:func:`dequantize_ints` with a float32 ``factor`` per block (as
    :func:`quantize_ints_blocks`): ``global_qsgd.dequantize`` and ``qsgd.decode_row`` of
    blocks, in one pass."""
    (factor,) = _tables(factor)
    block, lead, _ = piece_blocks(q.size, block, first, factor.size)
    out = np.empty(q.size, np.float32) if out is None else out
    _dequantize_ints_blocks(q, factor, np.int64(block), np.int64(lead), out)
    return out


# --- Global-QSGD exponential dithering (hvd_quant.compressors.exp_dithering) ---------------
@_twin
def _exp_encode(x, scale, step, key, out):
    k = np.uint64(key)
    for i in prange(x.size):
        z = x[i] / scale
        z = min(max(z, np.float32(-1.0)), np.float32(1.0)) * step
        mag = abs(z)
        bits = np.float32(mag).view(np.int32)
        expo = bits >> 23
        u = _uniform(k, i)
        if expo >= 1:
            p = np.float32(bits & 0x7FFFFF) * np.float32(2.0 ** -23)
            code = 128 - expo - np.int32(u < p)
        else:
            p = mag * np.float32(2.0 ** 126)
            code = np.int32(u < p) * 127
        if code >= 1 and z < 0:
            code += 128
        out[i] = np.uint8(code)


def exp_encode(x, scale, world_size, key, out=None):
    """``exp_dithering.exp_encode``: uint8 codes of ``x / (scale * 2**(n-1))`` (into
    ``out`` if given)."""
    out = np.empty(x.size, np.uint8) if out is None else out
    _exp_encode(x, np.float32(scale), np.float32(2.0 ** (1 - world_size)), key, out)
    return out


@_twin
def _exp_combine(a, b, key, out):
    k = np.uint64(key)
    for i in prange(a.size):
        va, vb = np.int32(a[i]), np.int32(b[i])
        ca, cb = va & 127, vb & 127
        if cb < 1:  # a zero operand passes the other through (b's check wins, as generic)
            out[i] = a[i]
            continue
        if ca < 1:
            out[i] = b[i]
            continue
        sa, sb = va >> 7, vb >> 7
        e = ca if ca < cb else cb
        sign = sa if ca < cb else sb
        d = abs(ca - cb)
        same = sa == sb
        if not same and d == 0:
            out[i] = 0
            continue
        t = min(max(d if same else d - 1, 0), 126)
        thr = np.float32(1.0) - np.int32((127 - t) << 23).view(np.float32)
        jump = np.int32(_uniform(k, i) >= thr)
        out[i] = np.uint8(sign * 128 + (e - jump if same else e + jump))


def exp_combine(a, b, key, out=None):
    """``exp_dithering.combine_codes``: unbiased stochastic sum of two code arrays (into
    ``out`` if given)."""
    out = np.empty(a.size, np.uint8) if out is None else out
    _exp_combine(a, b, key, out)
    return out


@_twin
def _exp_decode(codes, factor, scale, out):
    top = np.float32(3.4028235e38)
    for i in prange(codes.size):
        c = np.int32(codes[i])
        mc = c & 127
        mag = np.float32(0) if mc < 1 else np.int32((128 - mc) << 23).view(np.float32)
        sign = np.float32(1.0) - np.float32(2.0) * np.float32(c >> 7)
        out[i] = min(max(mag * sign * factor * scale, -top), top)


def exp_decode(codes, factor, scale, out=None):
    """``exp_dithering.exp_decode``: ``value(code) * factor * scale`` (float32, in that
    order), saturated at the float32 maximum; ``factor = 2**(n-1) / n``."""
    out = np.empty(codes.size, np.float32) if out is None else out
    _exp_decode(codes, np.float32(factor), np.float32(scale), out)
    return out


# --- Marsit's per-hop bit selection (hvd_quant.compressors.marsit) --------------------------
@_twin
def _marsit_select(own, recv, keep, key, out):
    k = np.uint64(key)
    for b in prange(own.size):
        m = 0
        for j in range(8):
            if _uniform(k, 8 * b + j) < keep:
                m |= 1 << j
        mask = np.uint8(m)
        out[b] = (own[b] & mask) | (recv[b] & ~mask)


def marsit_select(own, recv, keep, key, out=None):
    """``marsit.MarsitSelect.combine``: each bit from ``own`` with probability ``keep``
    (draw ``8 * byte + bit`` of the call), else from ``recv`` (into ``out`` if given)."""
    out = np.empty(own.size, np.uint8) if out is None else out
    _marsit_select(own, recv, np.float32(keep), key, out)
    return out


# --- the hierarchical 1-bit allreduce's re-binarisation (hvd_quant.core.hierarchical) ------
# Byte b spread over 8 bytes, byte j of the uint64 = bit j of b: adding one word per packed
# byte counts the +1 signs of 8 elements at once (at most 255 rows, so no carries).
_SPREAD = np.array([sum(((b >> j) & 1) << (8 * j) for j in range(8)) for b in range(256)],
                   np.uint64)


@njit(**_OPTS)
def _rebinarize_piece(rows, k, inv_k, key, first, count, up, out):
    # As _binsgdm_piece: the draws and comparisons in a vectorized loop over one 0/1 byte
    # per element, packed 8 at a time with a multiply afterwards. The threshold is the
    # generic path's float32 expression of the node sum 2 * ones - k, the same floats.
    m = 8 * out.size
    words = count[:m].view(np.uint64)
    words[:] = 0
    for j in range(rows.shape[0]):
        for w in range(m // 8):
            words[w] += _SPREAD[rows[j, first // 8 + w]]
    half, one = np.float32(0.5), np.float32(1.0)
    for i in range(m):
        s = np.float32(np.int32(2) * np.int32(count[i]) - k)
        up[i] = np.uint8(1) if _uniform(key, first + i) < (s * inv_k + one) * half else np.uint8(0)
    bits = up[:m].view(np.uint64)
    for w in range(m // 8):
        out[w] = np.uint8((bits[w] * _PACK_MUL) >> _S56)


@_twin
def _rebinarize(rows, inv_k, key, out):
    k = np.uint64(key)
    nrows = np.int32(rows.shape[0])
    pieces = (out.size + SPR_PIECE // 8 - 1) // (SPR_PIECE // 8)
    for c in prange(pieces):
        a = c * (SPR_PIECE // 8)
        e = min(out.size, a + SPR_PIECE // 8)
        count = np.empty(SPR_PIECE, np.uint8)
        up = np.empty(SPR_PIECE, np.uint8)
        _rebinarize_piece(rows, nrows, inv_k, k, 8 * a, count, up, out[a:e])


def rebinarize(rows, k, key, out=None):
    """``hierarchical.threshold_rows``: from ``k`` rows of packed signs (``k * w`` bytes), the
    ``w`` packed bytes of ``draw(i) < (S_i / k + 1) / 2`` where ``S_i`` is the sum of the
    rows' signs of element ``i`` (``+1`` with the probability that keeps the node's mean
    unbiased), draw ``i`` of the call with key ``key``; into ``out`` if given. One pass
    over the rows: the node sums are never written. ``k`` up to 255 (the counts are
    bytes; the generic path takes any)."""
    if not 1 <= k <= 255 or rows.size % k:
        raise ValueError(f"rebinarize: {rows.size} bytes are not k={k} rows (1 <= k <= 255)")
    rows = np.ascontiguousarray(rows).reshape(k, -1)
    out = np.empty(rows.shape[1], np.uint8) if out is None else out
    _rebinarize(rows, np.float32(1.0 / k), key, out)
    return out


# --- BinSGDM's binary randomization (hvd_quant.optimizers.binsgdm) ------------------------
@njit(**_OPTS)
def _binsgdm_piece(g, m, b, beta, one_minus_beta, k, first, m_out, b_out, up, bits):
    # As _sign_pack_residual: a vectorized loop writes one 0/1 byte per element into a
    # small scratch, then 8 of them are packed with a multiply (bit-by-bit ORs in the
    # same loop kept LLVM from vectorizing the moments, the division and the draws).
    n = g.size
    for i in range(n):
        mi = m[i] * beta + g[i] * one_minus_beta
        bi = b[i] * beta + abs(g[i]) * one_minus_beta
        m_out[i] = mi
        b_out[i] = bi
        z = mi / bi if np.float32(0) < bi else np.float32(0)
        z = min(max(z, np.float32(-1.0)), np.float32(1.0))
        up[i] = np.uint8(1) if _uniform(k, first + i) < (z + np.float32(1.0)) * np.float32(0.5) else np.uint8(0)
    words = up[:n // 8 * 8].view(np.uint64)
    for w in range(n // 8):
        bits[w] = np.uint8((words[w] * _PACK_MUL) >> _S56)
    if n % 8:  # the buffer's last, partial byte
        v = 0
        for j in range(n - n % 8, n):
            v |= np.int32(up[j]) << (j - (n - n % 8))
        bits[n // 8] = np.uint8(v)


@_twin
def _binsgdm_encode(g, m, b, beta, one_minus_beta, key, m_out, b_out, bits):
    d = g.size
    k = np.uint64(key)
    pieces = (d + SPR_PIECE - 1) // SPR_PIECE
    for c in prange(pieces):
        a = c * SPR_PIECE
        e = min(d, a + SPR_PIECE)
        up = np.empty(SPR_PIECE, np.uint8)
        _binsgdm_piece(g[a:e], m[a:e], b[a:e], beta, one_minus_beta, k, a, m_out[a:e], b_out[a:e],
                       up, bits[a // 8:(e + 7) // 8])


def binsgdm_encode(g, m, b, beta, key, m_out=None, b_out=None, bits_out=None):
    """``binsgdm.binary_randomize``: the new momentum and |g| average (new arrays, or
    ``m_out`` / ``b_out``, never ``m`` / ``b`` themselves: the caller stores them only if
    the step is finite everywhere) and the packed bits of ``q = +1`` with probability
    ``(1 + m/b) / 2`` (into ``bits_out`` if given)."""
    m_out = np.empty_like(g) if m_out is None else m_out
    b_out = np.empty_like(g) if b_out is None else b_out
    bits = np.empty((g.size + 7) // 8, np.uint8) if bits_out is None else bits_out
    _binsgdm_encode(g, m, b, np.float32(beta), np.float32(1.0 - beta), key, m_out, b_out, bits)
    return m_out, b_out, bits


# --- Adam-family update rules (hvd_quant.optimizers.elementwise) ---------------------------
# The generic twins are float32 tensor expressions; these loops do the same float32
# operations in the same order (no fastmath, so no fused multiply-add), hence the same bits.

@_twin
def _ema(avg, value, beta, rest, square, out):
    for i in prange(out.size):
        v = value[i] * value[i] if square else value[i]
        out[i] = avg[i] * beta + v * rest


@_twin
def _ema_in_place(avg, value, beta, rest, square):
    for i in prange(avg.size):
        v = value[i] * value[i] if square else value[i]
        avg[i] = avg[i] * beta + v * rest


def ema(avg, value, beta, square=False, in_place=False, out=None):
    """``elementwise.ema``: ``avg * beta + value * (1 - beta)`` (``value**2`` if square),
    into ``avg`` itself when ``in_place``, else into ``out`` (or a fresh array)."""
    if in_place:
        _ema_in_place(avg, value, np.float32(beta), np.float32(1.0 - beta), square)
        return avg
    out = np.empty_like(avg) if out is None else out
    _ema(avg, value, np.float32(beta), np.float32(1.0 - beta), square, out)
    return out


@_twin
def _descend(x, step, lr, wd, has_wd, divisor, out):
    for i in prange(x.size):
        q = step[i] / divisor  # a float32 true division: the generic path's B.divide
        s = q + x[i] * wd if has_wd else q
        out[i] = x[i] - s * lr


@_twin
def _descend_in_place(x, step, lr, wd, has_wd, divisor):
    for i in prange(x.size):
        q = step[i] / divisor
        s = q + x[i] * wd if has_wd else q
        x[i] = x[i] - s * lr


def descend(x, step, lr, weight_decay, in_place=False, out=None, divisor=1.0):
    """``elementwise.descend``: ``x - lr * (step / divisor + weight_decay * x)``, into ``x``
    itself when ``in_place``, else into ``out`` (or a fresh array)."""
    args = (np.float32(lr), np.float32(weight_decay), weight_decay > 0.0, np.float32(divisor))
    if in_place:
        _descend_in_place(x, step, *args)
        return x
    out = np.empty_like(x) if out is None else out
    _descend(x, step, *args, out)
    return out


@njit(inline="always", **_OPTS)
def _adam_delta(x, m, v, lr, eps, wd, has_wd):
    upd = m / (np.sqrt(v) + eps)
    if has_wd:
        upd = upd + x * wd
    return upd * lr


@_twin
def _adam_descend(x, m, v, lr, eps, wd, has_wd, acc, x_out, acc_out):
    has_acc = acc.size > 0
    for i in prange(x.size):
        delta = _adam_delta(x[i], m[i], v[i], lr, eps, wd, has_wd)
        x_out[i] = x[i] - delta
        if has_acc:
            acc_out[i] = acc[i] - delta


@_twin
def _adam_descend_in_place(x, m, v, lr, eps, wd, has_wd, acc):
    # x (and acc) read and written through the same array: LLVM then knows the store
    # does not feed a later load and vectorizes; distinct in/out arrays that happen to
    # share memory would fail its run-time overlap check and run scalar.
    has_acc = acc.size > 0
    for i in prange(x.size):
        delta = _adam_delta(x[i], m[i], v[i], lr, eps, wd, has_wd)
        x[i] = x[i] - delta
        if has_acc:
            acc[i] = acc[i] - delta


def adam_descend(x, m, v, lr, eps, weight_decay, acc=None, x_out=None, acc_out=None):
    """``elementwise.adam_descend``: ``(x - delta, acc - delta)`` (``acc``'s part empty
    when it is None) with ``delta = lr * (m / (sqrt(v) + eps) + weight_decay * x)``,
    written into ``x_out`` / ``acc_out`` when given: in place when they are ``x`` / ``acc``
    themselves (both, when ``acc`` is given)."""
    args = (np.float32(lr), np.float32(eps), np.float32(weight_decay), weight_decay > 0.0)
    empty = np.empty(0, np.float32)
    if _same(x_out, x) and (acc is None or _same(acc_out, acc)):
        _adam_descend_in_place(x, m, v, *args, empty if acc is None else acc)
        return x, (empty if acc is None else acc)
    x_out = np.empty_like(x) if x_out is None else x_out
    acc_out = (np.empty_like(x) if acc_out is None else acc_out) if acc is not None else empty
    _adam_descend(x, m, v, *args, empty if acc is None else acc, x_out, acc_out)
    return x_out, acc_out


@_twin
def _precondition(u, v, eps, out):
    for i in prange(out.size):
        out[i] = u[i] * (np.sqrt(v[i]) + eps)


def precondition(u, v, eps, out=None):
    """``elementwise.precondition``: ``u * (sqrt(v) + eps)`` (into ``out`` if given)."""
    out = np.empty_like(u) if out is None else out
    _precondition(u, v, np.float32(eps), out)
    return out


@_twin
def _zero_one_sync_input(x, m, g, v, u, beta, rest, lr, eps, wd, has_wd, base, w):
    # _ema, _adam_descend, then _precondition and the base - u of _zero_one_sync_result,
    # per element: the same float32 operations in the same order.
    for i in prange(x.size):
        mi = m[i] * beta + g[i] * rest
        delta = _adam_delta(x[i], mi, v[i], lr, eps, wd, has_wd)
        ui = u[i] - delta
        base[i] = (x[i] - delta) - ui
        w[i] = ui * (np.sqrt(v[i]) + eps)


def zero_one_sync_input(x, m, g, v, u, beta, lr, eps, weight_decay, base=None, w=None):
    """``elementwise.zero_one_sync_input``: with ``m' = m * beta + g * (1 - beta)`` and
    Adam's ``delta`` from ``m'``, the pair ``((x - delta) - (u - delta), (u - delta) *
    (sqrt(v) + eps))`` (into ``base`` / ``w`` if given; neither may share memory with an
    input)."""
    base = np.empty_like(x) if base is None else base
    w = np.empty_like(x) if w is None else w
    _zero_one_sync_input(x, m, g, v, u, np.float32(beta), np.float32(1.0 - beta), np.float32(lr),
                         np.float32(eps), np.float32(weight_decay), weight_decay > 0.0, base, w)
    return base, w


@_twin
def _zero_one_sync_result(base, u, w, v, eps, lrs, synced, momentum):
    has_u = u.size > 0
    for i in prange(synced.size):
        b = base[i] - u[i] if has_u else base[i]
        synced[i] = b + w[i] / (np.sqrt(v[i]) + eps)
        momentum[i] = -(w[i] / lrs)


def zero_one_sync_result(base, u, w, v, eps, lrs, synced=None, momentum=None):
    """``elementwise.zero_one_sync_result``: ``((base - u) + w / (sqrt(v) + eps),
    -(w / lrs))``, ``base`` alone when ``u`` is None (into ``synced`` / ``momentum`` if
    given; neither may share memory with an input)."""
    synced = np.empty_like(w) if synced is None else synced
    momentum = np.empty_like(w) if momentum is None else momentum
    _zero_one_sync_result(base, np.empty(0, np.float32) if u is None else u, w, v, np.float32(eps),
                          np.float32(lrs), synced, momentum)
    return synced, momentum


# --- dense gradients from sparse ones (the TensorFlow adapter's IndexedSlices) -------------
@njit(**_OPTS)
def _add_rows(table, indices, values):
    for i in range(indices.size):
        r = indices[i]
        if r >= 0:  # negative indices are dropped, as tf.math.unsorted_segment_sum drops them
            for j in range(table.shape[1]):
                table[r, j] += values[i, j]


def add_rows(table, indices, values):
    """``table[indices[i]] += values[i]`` for every ``i``, in index order (so duplicates
    sum as ``tf.math.unsorted_segment_sum`` sums them on the CPU): the dense gradient of a
    ``tf.IndexedSlices`` written over zeros. ``table``: 2-D float32 (rows, columns);
    ``values``: float32 (len(indices), columns); an index past the last row raises."""
    if indices.size and indices.max() >= table.shape[0]:
        raise IndexError(f"row index {int(indices.max())} out of range for {table.shape[0]} rows")
    _add_rows(table, indices, values)
    return table
