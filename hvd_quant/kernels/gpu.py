"""Fused GPU kernels (Triton): the primitives of :mod:`hvd_quant.kernels.cpu`, on the GPU.

One function per fused primitive of :data:`hvd_quant.kernels.NAMES`, with the names,
parameters, defaults and result order of :mod:`hvd_quant.kernels.cpu` (``add_rows``, the
TensorFlow adapter's own, excepted), and the same bits: the same sign convention (bit 1
for ``>= 0``), bit order (least significant first), integer lanes and padding, the same
counter-based draws (:mod:`hvd_quant.core.rng`) and the same float32 operations in the
same order. :class:`hvd_quant.torch.backend.TorchBackend` hands them out for CUDA
tensors; ``tests/gpu_interpreter.py`` runs every one under Triton's interpreter against
the numba kernels and the numpy oracle, and ``tests/test_cuda.py`` on a GPU.

The contract
------------
* **Tensors**: torch tensors on one CUDA device (CPU tensors under Triton's interpreter,
  ``TRITON_INTERPRET=1``), 1-D and contiguous, float32 unless stated; packed sign rows
  and their scales may be 2-D ``(rows, ...)`` or flat. ``bounds`` is the numpy int64
  array of :func:`hvd_quant.core.segments.segment_bounds`; its device tables are cached
  per (device, layout) (:mod:`hvd_quant.kernels.segment_tables`), so a step copies no
  constant to the device.
* **Outputs** given by keyword (``out=``, ``bits_out=``, ``resid_out=``, ``x_out=``,
  ``acc_out=``, ``m_out=``, ``b_out=``, ``base=``, ``w=``, ``synced=``, ``momentum=``) are
  written in place, and may be the inputs the CPU kernels allow (``out=e``, ``out=x``,
  ``out=base``, ...): every element is read before it is written, by the same program.
  Otherwise they are allocated on the input's device with ``torch.empty``.
* **Scalars**: every parameter in a signature's ``scalars``
  (:data:`hvd_quant.kernels.signatures.SIGNATURES`) takes a Python number or a
  one-element tensor on the data's device. A tensor is read by the kernel through its
  pointer (never ``.item()``), so a scale or a learning rate computed on the GPU never
  makes the host wait; what the CPU kernels' wrappers compute from a number in float64
  (``1 - beta``, ``weight_decay > 0``) the kernel computes in float64 from the tensor's
  value, so a tensor and the number it holds give the same bits. (A CPU tensor with CUDA
  data is read on the host: that needs no synchronisation.) ``rebinarize``'s ``k``
  sets the output's size: a tensor ``k`` needs ``out=``, whose size gives it.
* **Results** the CPU kernels return as numbers come back as 0-d tensors on the device
  (``absmax_finite``: float32 and bool; ``all_finite``: bool), and the per-segment sums
  as a float64 tensor there.
* **No host synchronisation** inside any primitive (no ``.item()``, ``.cpu()``,
  ``nonzero`` or data-dependent shapes); kernels launch on the current CUDA stream.

Exact float arithmetic
----------------------
A GPU compiler may contract ``a * b + c`` into one fused multiply-add (one rounding
instead of two), and Triton's ``/`` and ``tl.sqrt`` are approximate (``div.full.f32``,
``sqrt.approx.f32``); Triton's libdevice functions flush subnormals (it compiles them
with ``__CUDA_FTZ``). Each would change bits. So:

* every launch passes ``enable_fp_fusion=False``: Triton then emits ``mul.rn.f32`` /
  ``add.rn.f32`` / ``sub.rn.f32`` (explicitly rounded, which ptxas never fuses) and runs
  ptxas with ``--fmad=false`` (Triton's default changed between versions, so it is named);
* division and square root are inline PTX on the GPU, ``div.rn.f32`` and
  ``sqrt.rn.f32`` (IEEE round-to-nearest, subnormals kept, whatever the Triton version;
  Triton's ``tl.div_rn`` / ``tl.sqrt_rn`` flushed subnormals before 3.6), and floor is
  ``cvt.rmi.f32.f32``; under the interpreter the same helpers are ``tl.div_rn``,
  ``tl.sqrt_rn`` and ``tl.floor`` (numpy's IEEE operations);
* ``abs`` of a float32 clears the sign bit, ``min``/``max`` are written as the CPU
  kernels' (numba's) comparisons (``max(a, b)`` is ``b if b > a else a``: a NaN in ``a``
  stays), no library function is called;
* every expression keeps the CPU kernel's order of operations (``m * beta + g * rest``
  as two products and a sum, ``((mag * sign) * factor) * scale``, ...), and the counter
  hash runs in uint32 lanes with uint32-typed constants (a literal above ``2**31`` would
  make Triton compute in int64).

``scripts/check_ptx.py`` compiles every kernel for sm_90 without a GPU and checks its PTX
for ``fma``, ``.ftz`` and approximate division or square root.

What is not bit for bit: the float64 per-segment sums add in another order than the CPU
kernels (tiles of :data:`~hvd_quant.kernels.segment_tables.TILE` elements, each summed as
a tree, then a segment's tile sums as a tree; the CPU kernels' blocks reassociate by
their vector width): within a few float64 ulps of each other and of the oracle, and the
same on every call and in every primitive that sums (``compensate_sums``,
``compensate_sums_signs`` and ``unpack_sums_signs`` give identical sums). A NaN's payload
is the GPU's (canonical) one. Non-finite inputs to the stochastic roundings
(``quantize_*``, ``exp_encode``), which the methods never quantize (they check first),
give unspecified codes, as a float-to-int conversion of NaN does on the CPU.
"""

import json
import os
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

from . import segment_tables
from .blocks import check_lanes, piece_blocks
from .segment_tables import TILE

#: Elements per program of the element-wise kernels.
BLOCK = 2048
_NB = TILE // 8          # packed bytes per tile
_ABS_BLOCK = 8192        # elements per program of the max / finiteness scan
_SUM_BLOCK = 1024        # partial sums per step of a segment's total
_BLOCK_STEP = 512        # elements per step of a block's max (the default block: one step)
_WARPS = 4
_INTERPRETED = None      # set below: whether Triton's interpreter runs these kernels

#: Launch settings of the kernels whose speed depends on them (issue 56), by the primitive
#: family that launches them: ``num_warps`` per program and, for the lane kernels,
#: ``block`` elements per program (a power of two). ``benchmarks/bench_gpu.py --tune``
#: times candidates on the device and checks that each gives the same outputs (bits, and
#: the float64 sums to 1e-12: a reduction's order follows the warps). Every rank of a job
#: must launch with the same settings (the sums set the scales), so this is a constant,
#: not a per-process autotune. Families not named here run with ``_WARPS`` warps.
#: The values (H200, 2026-12-04, ``benchmarks/reference/gpu-2026-12-04-h200/``): the lane
#: kernels take ``--tune``'s fastest (GPT-2 small's gradient, against 4 warps and 2048
#: elements: dequantize_lanes 0.341 -> 0.231 ms, quantize_lanes 0.280 -> 0.266 ms). The
#: others stay at 4 warps: 8 for ``sums`` timed 2% faster on compensate_sums_signs, but
#: onebit's two ``_sums_k`` (the second decodes as well) then took 1381 us against 979 us
#: at 4 warps (its profile, 2026-11-28), so the tune now times every call site of a
#: family; 2 for marsit_select was within 1%.
LAUNCH = {
    "sums": {"num_warps": 4},              # compensate_sums(_signs), unpack_sums_signs
    "unpack": {"num_warps": 4},            # unpack_scaled_sum, unpack_sum_residual
    "quantize_lanes": {"num_warps": 4, "block": 1024},
    "dequantize_lanes": {"num_warps": 8, "block": 1024},
    "marsit_select": {"num_warps": 4},
    "rebinarize": {"num_warps": 4},
}


def set_launch(settings):
    """Merge ``{family: {"num_warps": w, "block": b}}`` into :data:`LAUNCH` after checking
    it (known families and keys, powers of two); returns the settings now in force."""
    if not isinstance(settings, dict):
        raise ValueError(f"launch settings must be a JSON object of families, got {type(settings).__name__}")
    checked = {}
    for family, values in settings.items():
        if family not in LAUNCH:
            raise ValueError(f"launch settings: unknown family {family!r}; known: {', '.join(LAUNCH)}")
        if not isinstance(values, dict) or not set(values) <= set(LAUNCH[family]):
            raise ValueError(f"launch settings for {family!r}: keys must be among {sorted(LAUNCH[family])}, "
                             f"got {values!r}")
        for key, value in values.items():
            low, high = (1, 32) if key == "num_warps" else (64, 65536)
            if isinstance(value, bool) or not isinstance(value, int) or value & (value - 1) \
                    or not low <= value <= high:
                raise ValueError(f"launch settings: {family}.{key} must be a power of two in {low}..{high}, "
                                 f"got {value!r}")
        checked[family] = values
    for family, values in checked.items():
        LAUNCH[family] = {**LAUNCH[family], **values}
    return {family: dict(values) for family, values in LAUNCH.items()}


def launch_from_env():
    """``HVD_QUANT_GPU_LAUNCH``: launch settings as JSON text or a JSON file's path (what
    ``bench_gpu.py --tune`` writes), for a GPU other than the one the defaults were tuned
    on. Every rank must see the same value (launchers pass the environment on)."""
    text = os.environ.get("HVD_QUANT_GPU_LAUNCH", "").strip()
    if text:
        try:
            set_launch(json.loads(text if text.startswith("{") else Path(text).read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"HVD_QUANT_GPU_LAUNCH={text!r}: {exc}") from None


def _warps(family):
    return LAUNCH[family]["num_warps"]


# --- exact float operations, the hash ---------------------------------------------------------
@triton.jit
def _div(a, b, ASM: tl.constexpr):
    if ASM:
        b = tl.broadcast_to(b, a.shape)  # a scalar divisor: no arithmetic, a -0.0 stays
        return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.div_rn(a, b)


@triton.jit
def _sqrt(a, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise("sqrt.rn.f32 $0, $1;", "=f,f", [a],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.sqrt_rn(a)


@triton.jit
def _floor(a, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise("cvt.rmi.f32.f32 $0, $1;", "=f,f", [a],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.floor(a)


@triton.jit
def _fabs(a):
    """|a| for float32: the sign bit cleared (no library call, subnormals kept)."""
    return (a.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _clamp(v, lo, hi):
    """numba's ``min(max(v, lo), hi)``: ``max(a, b)`` is ``b if b > a else a``, so a NaN
    ``v`` stays NaN (as ``np.clip`` in the oracle)."""
    v = tl.where(lo > v, lo, v)
    return tl.where(hi < v, hi, v)


@triton.jit
def _mix32(x):
    """lowbias32 (:func:`hvd_quant.core.rng.mix32`) on uint32 lanes."""
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _draw(index, key):
    """``rng.hash_bits``: draw ``index`` (its low 32 bits) of the call with uint32 ``key``."""
    i = index.to(tl.uint32)
    return _mix32(_mix32(i ^ key) ^ key)


@triton.jit
def _uniform(index, key):
    """``rng.uniform_from_bits``: the top 24 bits times ``2**-24`` (exact in float32)."""
    return (_draw(index, key) >> 8).to(tl.float32) * 5.9604644775390625e-08


# --- scalars: a number, or a one-element tensor read through its pointer -----------------------
@triton.jit
def _key(key, PTR: tl.constexpr):
    if PTR:
        return tl.load(key).to(tl.uint32)
    else:
        return key.to(tl.uint32)


@triton.jit
def _f32(v, PTR: tl.constexpr):
    """A float32 scalar: the number as passed (already float32), or the tensor's value
    rounded to float32 (as ``np.float32(value)``)."""
    if PTR:
        return tl.load(v).to(tl.float32)
    else:
        return v


@triton.jit
def _and_rest(beta, rest, PTR: tl.constexpr):
    """``(float32(beta), float32(1 - beta))``, ``1 - beta`` in float64 as the CPU wrappers
    compute it from a number."""
    if PTR:
        b = tl.load(beta).to(tl.float64)
        return b.to(tl.float32), (1.0 - b).to(tl.float32)
    else:
        return beta, rest


@triton.jit
def _decay(wd, has_wd, PTR: tl.constexpr):
    """``(float32(weight_decay), weight_decay > 0)``, the test on the unrounded value."""
    if PTR:
        w = tl.load(wd).to(tl.float64)
        return w.to(tl.float32), w > 0.0
    else:
        return wd, has_wd != 0


# --- segments --------------------------------------------------------------------------------
@triton.jit
def _tile_info(tiles, t):
    return tl.load(tiles + 4 * t), tl.load(tiles + 4 * t + 1), tl.load(tiles + 4 * t + 2), \
        tl.load(tiles + 4 * t + 3)


@triton.jit
def _segments(bounds, idx, lo, hi, steps):
    """The segment of each element index: the last ``s`` in ``lo .. hi`` with
    ``bounds[s] <= idx`` (so empty segments are passed over), by ``steps`` halvings."""
    a = tl.zeros(idx.shape, tl.int32) + lo
    b = tl.zeros(idx.shape, tl.int32) + hi
    for _ in range(steps):
        mid = (a + b + 1) >> 1
        ok = tl.load(bounds + mid) <= idx
        a = tl.where(ok, mid, a)
        b = tl.where(ok, b, mid - 1)
    return a


@triton.jit
def _per_segment(table, seg, lo, steps):
    """``table[seg]`` per element (a per-segment scale): one load for the whole tile where
    it lies inside one segment (most tiles), a gather from the small table where not."""
    if steps == 0:
        v = tl.broadcast_to(tl.load(table + lo), seg.shape)
    else:
        v = tl.load(table + seg)
    return v


@triton.jit
def _tile_bytes(pid, NB: tl.constexpr):
    """Byte indices ``b`` of tile ``pid``, bit positions ``j`` and element indices (2-D)."""
    b = pid.to(tl.int64) * NB + tl.arange(0, NB)
    j = tl.arange(0, 8)
    return b, j, b[:, None] * 8 + j[None, :]


@triton.jit
def _pack(flag, j):
    """Packed bytes of a (bytes, 8) boolean tile, bit ``j`` least significant first."""
    return tl.sum(flag.to(tl.int32) << j[None, :], axis=1).to(tl.uint8)


@triton.jit
def _signed(sc, p):
    return p - tl.where(p >= 0, sc, -sc)


@triton.jit
def _decode(packed, scales, nbytes, nseg, rows, b, j, seg, lo, steps, bmask):
    """``sum_r scales[r, seg] * sign_r`` over the rows in row order, in float32: row 0's
    value, then each further row added (the CPU kernels' order; ``sc * (+1 or -1)`` is
    exact, as there)."""
    shifts = j[None, :]
    row = packed + b
    col = scales
    byte = tl.load(row, mask=bmask, other=0).to(tl.int32)
    acc = _per_segment(col, seg, lo, steps) * (2 * ((byte[:, None] >> shifts) & 1) - 1).to(tl.float32)
    for _ in range(1, rows):
        row += nbytes
        col += nseg
        byte = tl.load(row, mask=bmask, other=0).to(tl.int32)
        acc += _per_segment(col, seg, lo, steps) * (2 * ((byte[:, None] >> shifts) & 1) - 1).to(tl.float32)
    return acc


@triton.jit
def _piece_sums(w, seg, mask, lo, hi, piece, partial):
    """The float64 sum of ``w`` over each segment ``lo .. hi`` of the tile, stored as the
    tile's pieces (every summing kernel reduces the same shapes, so the same trees)."""
    w = tl.where(mask, w, 0.0)
    for s in range(lo, hi + 1):
        part = tl.sum(tl.sum(tl.where(seg == s, w, 0.0), axis=1), axis=0)
        tl.store(partial + piece + (s - lo), part)


@triton.jit
def _magnitude(p, SQUARES: tl.constexpr):
    w = p.to(tl.float64)
    if SQUARES:
        return w * w
    else:
        return tl.abs(w)


# --- kernels: sign bits ------------------------------------------------------------------------
@triton.jit(do_not_specialize=["n", "nbytes"])
def _sign_pack_k(x, out, n, nbytes, NB: tl.constexpr, ASM: tl.constexpr):
    b, j, idx = _tile_bytes(tl.program_id(0), NB)
    v = tl.load(x + idx, mask=idx < n, other=-1.0)
    tl.store(out + b, _pack(v >= 0, j), mask=b < nbytes)


@triton.jit(do_not_specialize=["n", "nbytes"])
def _sign_residual_k(x, e, scales, bounds, tiles, bits, resid, n, nbytes, HAS_E: tl.constexpr,
                     BITS: tl.constexpr, NB: tl.constexpr, ASM: tl.constexpr):
    pid = tl.program_id(0)
    b, j, idx = _tile_bytes(pid, NB)
    m = idx < n
    p = tl.load(x + idx, mask=m, other=0.0)
    if HAS_E:
        p = p + tl.load(e + idx, mask=m, other=0.0)
    lo, hi, piece, steps = _tile_info(tiles, pid)
    seg = _segments(bounds, idx, lo, hi, steps)
    tl.store(resid + idx, _signed(_per_segment(scales, seg, lo, steps), p), mask=m)
    if BITS:
        tl.store(bits + b, _pack((p >= 0) & m, j), mask=b < nbytes)


@triton.jit(do_not_specialize=["n", "nbytes", "rows", "nseg"])
def _unpack_k(packed, scales, bounds, tiles, base, base_scales, x, e, own, out, resid, n, nbytes,
              rows, nseg, HAS_BASE: tl.constexpr, FOLDS: tl.constexpr, RESID: tl.constexpr,
              HAS_E: tl.constexpr, NB: tl.constexpr, ASM: tl.constexpr):
    pid = tl.program_id(0)
    b, j, idx = _tile_bytes(pid, NB)
    m = idx < n
    lo, hi, piece, steps = _tile_info(tiles, pid)
    seg = _segments(bounds, idx, lo, hi, steps)
    if RESID:  # this rank's residual first: x may be the output
        p = tl.load(x + idx, mask=m, other=0.0)
        if HAS_E:
            p = p + tl.load(e + idx, mask=m, other=0.0)
        tl.store(resid + idx, _signed(_per_segment(own, seg, lo, steps), p), mask=m)
    acc = _decode(packed, scales, nbytes, nseg, rows, b, j, seg, lo, steps, b < nbytes)
    if HAS_BASE:
        v = tl.load(base + idx, mask=m, other=0.0)
        if FOLDS:
            v = _signed(_per_segment(base_scales, seg, lo, steps), v)
        acc = acc + v
    tl.store(out + idx, acc, mask=m)


@triton.jit(do_not_specialize=["n", "nbytes", "rows", "nseg"])
def _sums_k(x, e, packed, scales, base, base_scales, bounds, tiles, partial, out, bits, n, nbytes,
            rows, nseg, HAS_E: tl.constexpr, DECODE: tl.constexpr, HAS_BASE: tl.constexpr,
            FOLDS: tl.constexpr, SQUARES: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr,
            ASM: tl.constexpr):
    # compensate_sums(_signs) of p = x + e, or (DECODE) unpack_sums_signs: the decode into
    # out, then the sums and signs of the very floats written.
    pid = tl.program_id(0)
    b, j, idx = _tile_bytes(pid, NB)
    m = idx < n
    lo, hi, piece, steps = _tile_info(tiles, pid)
    seg = _segments(bounds, idx, lo, hi, steps)
    if DECODE:
        p = _decode(packed, scales, nbytes, nseg, rows, b, j, seg, lo, steps, b < nbytes)
        if HAS_BASE:
            v = tl.load(base + idx, mask=m, other=0.0)
            if FOLDS:
                v = _signed(_per_segment(base_scales, seg, lo, steps), v)
            p = p + v
        tl.store(out + idx, p, mask=m)
    else:
        p = tl.load(x + idx, mask=m, other=0.0)
        if HAS_E:
            p = p + tl.load(e + idx, mask=m, other=0.0)
    _piece_sums(_magnitude(p, SQUARES), seg, m, lo, hi, piece, partial)
    if BITS:
        tl.store(bits + b, _pack((p >= 0) & m, j), mask=b < nbytes)


@triton.jit
def _totals_k(partial, pieces, sums, R: tl.constexpr, ASM: tl.constexpr):
    s = tl.program_id(0)
    first = tl.load(pieces + s)
    end = tl.load(pieces + s + 1)
    acc = tl.zeros([R], tl.float64)
    for start in range(first, end, R):
        o = start + tl.arange(0, R)
        acc += tl.load(partial + o, mask=o < end, other=0.0)
    tl.store(sums + s, tl.sum(acc, axis=0))


# --- kernels: max and finiteness ---------------------------------------------------------------
@triton.jit(do_not_specialize=["n"])
def _absmax_k(u, partial, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
    # Magnitudes compared as int32 bit patterns (the CPU kernel's trick); at or above
    # 0x7F800000: inf or NaN.
    pid = tl.program_id(0)
    o = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(u + o, mask=o < n, other=0) & 0x7FFFFFFF
    tl.store(partial + 2 * pid, tl.max(tl.where(a < 0x7F800000, a, 0), axis=0))
    tl.store(partial + 2 * pid + 1, tl.max(a, axis=0))


@triton.jit(do_not_specialize=["count"])
def _absmax_total_k(partial, count, m, ok, R: tl.constexpr, ASM: tl.constexpr):
    finite = tl.zeros([R], tl.int32)
    top = tl.zeros([R], tl.int32)
    for start in range(0, count, R):
        o = start + tl.arange(0, R)
        finite = tl.maximum(finite, tl.load(partial + 2 * o, mask=o < count, other=0))
        top = tl.maximum(top, tl.load(partial + 2 * o + 1, mask=o < count, other=0))
    tl.store(m, tl.max(finite, axis=0))
    tl.store(ok, (tl.max(top, axis=0) < 0x7F800000).to(tl.uint8))


# --- kernels: Global-QSGD ----------------------------------------------------------------------
@triton.jit
def _level(x, index, pre, scale, levels, key, ASM: tl.constexpr):
    # cpu._level: v = (x * pre) / scale, clamped, times levels; floor + [u < v - floor].
    v = _clamp(_div(x * pre, scale, ASM), -1.0, 1.0) * levels
    low = _floor(v, ASM)
    return low.to(tl.int32) + (_uniform(index, key) < v - low).to(tl.int32)


@triton.jit(do_not_specialize=["n", "nwords", "key", "first", "offset"])
def _quantize_lanes_k(x, out, n, nwords, pre, scale, levels, key, first, offset, PRE: tl.constexpr,
                      SCALE: tl.constexpr, KEY: tl.constexpr, LANES: tl.constexpr, WIDTH: tl.constexpr,
                      NW: tl.constexpr, ASM: tl.constexpr):
    w = tl.program_id(0).to(tl.int64) * NW + tl.arange(0, NW)
    j = tl.arange(0, LANES)
    idx = w[:, None] * LANES + j[None, :]
    m = idx < n
    q = _level(tl.load(x + idx, mask=m, other=0.0), idx + first, _f32(pre, PRE), _f32(scale, SCALE),
               levels, _key(key, KEY), ASM)
    # The lanes' sum modulo 2**32 (uint32 wraps): the CPU kernel's int64 sum cast to int32.
    lanes = tl.where(m, q, 0).to(tl.uint32, bitcast=True) << (WIDTH * j[None, :]).to(tl.uint32)
    word = tl.sum(lanes, axis=1) + offset.to(tl.uint32)
    tl.store(out + w, word.to(tl.int32, bitcast=True), mask=w < nwords)


@triton.jit(do_not_specialize=["n", "key", "first"])
def _quantize_ints_k(x, out, n, pre, scale, levels, key, first, PRE: tl.constexpr, SCALE: tl.constexpr,
                     KEY: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    q = _level(tl.load(x + o, mask=m, other=0.0), o + first, _f32(pre, PRE), _f32(scale, SCALE), levels,
               _key(key, KEY), ASM)
    tl.store(out + o, q.to(out.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n", "nwords"])
def _dequantize_lanes_k(words, out, n, nwords, factor, FACTOR: tl.constexpr, LANES: tl.constexpr,
                        WIDTH: tl.constexpr, NW: tl.constexpr, ASM: tl.constexpr):
    w = tl.program_id(0).to(tl.int64) * NW + tl.arange(0, NW)
    j = tl.arange(0, LANES)
    idx = w[:, None] * LANES + j[None, :]
    word = tl.load(words + w, mask=w < nwords, other=0)
    shifted = word[:, None] >> (WIDTH * j[None, :])  # arithmetic: the top lane keeps its sign
    lane = tl.where(j[None, :] == LANES - 1, shifted, (shifted & ((1 << WIDTH) - 1)) - (1 << (WIDTH - 1)))
    tl.store(out + idx, lane.to(tl.float32) * _f32(factor, FACTOR), mask=idx < n)


@triton.jit(do_not_specialize=["n"])
def _dequantize_ints_k(q, out, n, factor, FACTOR: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(out + o, tl.load(q + o, mask=m, other=0).to(tl.float32) * _f32(factor, FACTOR), mask=m)


# --- kernels: a scale per block (kernels.blocks) ----------------------------------------------
@triton.jit(do_not_specialize=["n", "block"])
def _block_absmax_k(u, mx, top, n, block, BLOCK: tl.constexpr, ASM: tl.constexpr):
    # _absmax_k over one block of `block` elements per program, in steps of BLOCK.
    b = tl.program_id(0).to(tl.int64)
    finite = tl.zeros([BLOCK], tl.int32)
    every = tl.zeros([BLOCK], tl.int32)
    for start in range(0, block, BLOCK):
        i = start + tl.arange(0, BLOCK)
        o = b * block + i
        a = tl.load(u + o, mask=(i < block) & (o < n), other=0) & 0x7FFFFFFF
        finite = tl.maximum(finite, tl.where(a < 0x7F800000, a, 0))
        every = tl.maximum(every, a)
    tl.store(mx + b, tl.max(finite, axis=0))
    tl.store(top + b, tl.max(every, axis=0))


@triton.jit
def _of_block(table, idx, lead, block, m, other):
    # The value of each element's block: element idx of the piece is in its block (lead + idx) // block.
    return tl.load(table + (idx + lead) // block, mask=m, other=other)


@triton.jit(do_not_specialize=["n", "nwords", "block", "lead", "key", "first", "offset"])
def _quantize_lanes_blocks_k(x, out, pre, scale, n, nwords, block, lead, levels, key, first, offset,
                             KEY: tl.constexpr, LANES: tl.constexpr, WIDTH: tl.constexpr, NW: tl.constexpr,
                             ASM: tl.constexpr):
    w = tl.program_id(0).to(tl.int64) * NW + tl.arange(0, NW)
    j = tl.arange(0, LANES)
    idx = w[:, None] * LANES + j[None, :]
    m = idx < n
    q = _level(tl.load(x + idx, mask=m, other=0.0), idx + first, _of_block(pre, idx, lead, block, m, 1.0),
               _of_block(scale, idx, lead, block, m, 1.0), levels, _key(key, KEY), ASM)
    lanes = tl.where(m, q, 0).to(tl.uint32, bitcast=True) << (WIDTH * j[None, :]).to(tl.uint32)
    word = tl.sum(lanes, axis=1) + offset.to(tl.uint32)
    tl.store(out + w, word.to(tl.int32, bitcast=True), mask=w < nwords)


@triton.jit(do_not_specialize=["n", "block", "lead", "key", "first"])
def _quantize_ints_blocks_k(x, out, pre, scale, n, block, lead, levels, key, first, KEY: tl.constexpr,
                            BLOCK: tl.constexpr, ASM: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    q = _level(tl.load(x + o, mask=m, other=0.0), o + first, _of_block(pre, o, lead, block, m, 1.0),
               _of_block(scale, o, lead, block, m, 1.0), levels, _key(key, KEY), ASM)
    tl.store(out + o, q.to(out.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n", "nwords", "block", "lead"])
def _dequantize_lanes_blocks_k(words, out, factor, n, nwords, block, lead, LANES: tl.constexpr,
                               WIDTH: tl.constexpr, NW: tl.constexpr, ASM: tl.constexpr):
    w = tl.program_id(0).to(tl.int64) * NW + tl.arange(0, NW)
    j = tl.arange(0, LANES)
    idx = w[:, None] * LANES + j[None, :]
    m = idx < n
    word = tl.load(words + w, mask=w < nwords, other=0)
    shifted = word[:, None] >> (WIDTH * j[None, :])
    lane = tl.where(j[None, :] == LANES - 1, shifted, (shifted & ((1 << WIDTH) - 1)) - (1 << (WIDTH - 1)))
    tl.store(out + idx, lane.to(tl.float32) * _of_block(factor, idx, lead, block, m, 0.0), mask=m)


@triton.jit(do_not_specialize=["n", "block", "lead"])
def _dequantize_ints_blocks_k(q, out, factor, n, block, lead, BLOCK: tl.constexpr, ASM: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    f = _of_block(factor, o, lead, block, m, 0.0)
    tl.store(out + o, tl.load(q + o, mask=m, other=0).to(tl.float32) * f, mask=m)


# --- kernels: exponential dithering ------------------------------------------------------------
@triton.jit(do_not_specialize=["n", "key"])
def _exp_encode_k(x, out, n, scale, step, key, SCALE: tl.constexpr, KEY: tl.constexpr,
                  BLOCK: tl.constexpr, ASM: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    z = _clamp(_div(tl.load(x + o, mask=m, other=0.0), _f32(scale, SCALE), ASM), -1.0, 1.0) * step
    bits = z.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |z|
    expo = bits >> 23
    u = _uniform(o, _key(key, KEY))
    normal = 128 - expo - (u < (bits & 0x7FFFFF).to(tl.float32) * 1.1920928955078125e-07).to(tl.int32)
    tiny = (u < bits.to(tl.float32, bitcast=True) * 8.507059173023462e+37).to(tl.int32) * 127  # 2**126
    code = tl.where(expo >= 1, normal, tiny)
    code = tl.where((code >= 1) & (z < 0), code + 128, code)
    tl.store(out + o, code.to(tl.uint8), mask=m)


@triton.jit(do_not_specialize=["n", "key"])
def _exp_combine_k(a, b, out, n, key, KEY: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    va = tl.load(a + o, mask=m, other=0).to(tl.int32)
    vb = tl.load(b + o, mask=m, other=0).to(tl.int32)
    ca = va & 127
    cb = vb & 127
    sa = va >> 7
    sb = vb >> 7
    e = tl.where(ca < cb, ca, cb)
    sign = tl.where(ca < cb, sa, sb)
    d = tl.abs(ca - cb)
    same = sa == sb
    t = tl.where(same, d, d - 1)
    t = tl.where(t < 0, 0, tl.where(t > 126, 126, t))
    thr = 1.0 - ((127 - t) << 23).to(tl.float32, bitcast=True)  # 1 - 2**-t, exact
    jump = (_uniform(o, _key(key, KEY)) >= thr).to(tl.int32)
    res = sign * 128 + tl.where(same, e - jump, e + jump)
    res = tl.where(same | (d != 0), res, 0)
    res = tl.where(ca < 1, vb, res)
    res = tl.where(cb < 1, va, res)  # b's check wins, as in the generic path
    tl.store(out + o, res.to(tl.uint8), mask=m)


@triton.jit(do_not_specialize=["n"])
def _exp_decode_k(codes, out, n, factor, scale, FACTOR: tl.constexpr, SCALE: tl.constexpr,
                  BLOCK: tl.constexpr, ASM: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    c = tl.load(codes + o, mask=m, other=0).to(tl.int32)
    mc = c & 127
    mag = tl.where(mc < 1, 0.0, ((128 - mc) << 23).to(tl.float32, bitcast=True))
    sign = 1.0 - 2.0 * (c >> 7).to(tl.float32)
    value = mag * sign * _f32(factor, FACTOR) * _f32(scale, SCALE)
    tl.store(out + o, _clamp(value, -3.4028234663852886e+38, 3.4028234663852886e+38), mask=m)


# --- kernels: Marsit, the hierarchy's re-binarisation, BinSGDM ---------------------------------
@triton.jit(do_not_specialize=["nbytes", "key"])
def _marsit_select_k(own, recv, out, nbytes, keep, key, KEEP: tl.constexpr, KEY: tl.constexpr,
                     NB: tl.constexpr, ASM: tl.constexpr):
    b, j, idx = _tile_bytes(tl.program_id(0), NB)
    bm = b < nbytes
    mask = _pack(_uniform(idx, _key(key, KEY)) < _f32(keep, KEEP), j)
    mine = tl.load(own + b, mask=bm, other=0)
    theirs = tl.load(recv + b, mask=bm, other=0)
    tl.store(out + b, (mine & mask) | (theirs & ~mask), mask=bm)


@triton.jit(do_not_specialize=["width", "k", "key"])
def _rebinarize_k(rows, out, width, k, inv_k, key, KEY: tl.constexpr, NB: tl.constexpr, ASM: tl.constexpr):
    b, j, idx = _tile_bytes(tl.program_id(0), NB)
    bm = b < width
    count = tl.zeros([NB, 8], tl.int32)
    row = rows + b
    for _ in range(k):
        byte = tl.load(row, mask=bm, other=0).to(tl.int32)
        count += (byte[:, None] >> j[None, :]) & 1
        row += width
    s = (2 * count - k).to(tl.float32)  # the node sum, as the generic path's float32
    up = _uniform(idx, _key(key, KEY)) < (s * inv_k + 1.0) * 0.5
    tl.store(out + b, _pack(up, j), mask=bm)


@triton.jit(do_not_specialize=["n", "nbytes", "key"])
def _binsgdm_k(g, m, b, m_out, b_out, bits, n, nbytes, beta, rest, key, BETA: tl.constexpr,
               KEY: tl.constexpr, NB: tl.constexpr, ASM: tl.constexpr):
    byte, j, idx = _tile_bytes(tl.program_id(0), NB)
    ok = idx < n
    beta, rest = _and_rest(beta, rest, BETA)
    gv = tl.load(g + idx, mask=ok, other=0.0)
    mi = tl.load(m + idx, mask=ok, other=0.0) * beta + gv * rest
    bi = tl.load(b + idx, mask=ok, other=0.0) * beta + _fabs(gv) * rest
    tl.store(m_out + idx, mi, mask=ok)
    tl.store(b_out + idx, bi, mask=ok)
    z = _clamp(tl.where(0.0 < bi, _div(mi, bi, ASM), 0.0), -1.0, 1.0)
    up = _uniform(idx, _key(key, KEY)) < (z + 1.0) * 0.5
    tl.store(bits + byte, _pack(up & ok, j), mask=byte < nbytes)


# --- kernels: random draws ---------------------------------------------------------------------
@triton.jit(do_not_specialize=["n", "key"])
def _uniform_k(out, n, key, KEY: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + o, _uniform(o, _key(key, KEY)), mask=o < n)


@triton.jit(do_not_specialize=["n", "key"])
def _random_bytes_k(out, n, key, KEY: tl.constexpr, NW: tl.constexpr, ASM: tl.constexpr):
    w = tl.program_id(0).to(tl.int64) * NW + tl.arange(0, NW)
    j = tl.arange(0, 4)
    h = _draw(w, _key(key, KEY))
    idx = w[:, None] * 4 + j[None, :]
    tl.store(out + idx, ((h[:, None] >> (8 * j[None, :]).to(tl.uint32)) & 255).to(tl.uint8), mask=idx < n)


# --- kernels: the Adam-family update rules ----------------------------------------------------
@triton.jit
def _block(BLOCK: tl.constexpr):
    return tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)


@triton.jit(do_not_specialize=["n"])
def _ema_k(avg, value, out, n, beta, rest, BETA: tl.constexpr, SQUARE: tl.constexpr, BLOCK: tl.constexpr,
           ASM: tl.constexpr):
    o = _block(BLOCK)
    m = o < n
    beta, rest = _and_rest(beta, rest, BETA)
    v = tl.load(value + o, mask=m, other=0.0)
    if SQUARE:
        v = v * v
    tl.store(out + o, tl.load(avg + o, mask=m, other=0.0) * beta + v * rest, mask=m)


@triton.jit(do_not_specialize=["n", "has_wd"])
def _descend_k(x, step, out, n, lr, wd, has_wd, divisor, LR: tl.constexpr, WD: tl.constexpr,
               DIVISOR: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr):
    o = _block(BLOCK)
    m = o < n
    wd, has_wd = _decay(wd, has_wd, WD)
    xv = tl.load(x + o, mask=m, other=0.0)
    q = _div(tl.load(step + o, mask=m, other=0.0), _f32(divisor, DIVISOR), ASM)
    s = tl.where(has_wd, q + xv * wd, q)
    tl.store(out + o, xv - s * _f32(lr, LR), mask=m)


@triton.jit
def _adam_delta(x, m, v, lr, eps, wd, has_wd, ASM: tl.constexpr):
    upd = _div(m, _sqrt(v, ASM) + eps, ASM)
    upd = tl.where(has_wd, upd + x * wd, upd)
    return upd * lr


@triton.jit(do_not_specialize=["n", "has_wd"])
def _adam_descend_k(x, m, v, acc, x_out, acc_out, n, lr, eps, wd, has_wd, LR: tl.constexpr,
                    EPS: tl.constexpr, WD: tl.constexpr, HAS_ACC: tl.constexpr, BLOCK: tl.constexpr,
                    ASM: tl.constexpr):
    o = _block(BLOCK)
    k = o < n
    wd, has_wd = _decay(wd, has_wd, WD)
    xv = tl.load(x + o, mask=k, other=0.0)
    delta = _adam_delta(xv, tl.load(m + o, mask=k, other=0.0), tl.load(v + o, mask=k, other=0.0),
                        _f32(lr, LR), _f32(eps, EPS), wd, has_wd, ASM)
    if HAS_ACC:
        a = tl.load(acc + o, mask=k, other=0.0)
        tl.store(acc_out + o, a - delta, mask=k)
    tl.store(x_out + o, xv - delta, mask=k)


@triton.jit(do_not_specialize=["n"])
def _precondition_k(u, v, out, n, eps, EPS: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr):
    o = _block(BLOCK)
    m = o < n
    vv = tl.load(v + o, mask=m, other=0.0)
    tl.store(out + o, tl.load(u + o, mask=m, other=0.0) * (_sqrt(vv, ASM) + _f32(eps, EPS)), mask=m)


@triton.jit(do_not_specialize=["n", "has_wd"])
def _zero_one_sync_input_k(x, m, g, v, u, base, w, n, beta, rest, lr, eps, wd, has_wd, BETA: tl.constexpr,
                           LR: tl.constexpr, EPS: tl.constexpr, WD: tl.constexpr, BLOCK: tl.constexpr,
                           ASM: tl.constexpr):
    # cpu._zero_one_sync_input: the ema, Adam's delta, then the sync's base and w.
    o = _block(BLOCK)
    k = o < n
    beta, rest = _and_rest(beta, rest, BETA)
    wd, has_wd = _decay(wd, has_wd, WD)
    eps = _f32(eps, EPS)
    xv = tl.load(x + o, mask=k, other=0.0)
    vv = tl.load(v + o, mask=k, other=0.0)
    mi = tl.load(m + o, mask=k, other=0.0) * beta + tl.load(g + o, mask=k, other=0.0) * rest
    delta = _adam_delta(xv, mi, vv, _f32(lr, LR), eps, wd, has_wd, ASM)
    ui = tl.load(u + o, mask=k, other=0.0) - delta
    tl.store(base + o, (xv - delta) - ui, mask=k)
    tl.store(w + o, ui * (_sqrt(vv, ASM) + eps), mask=k)


@triton.jit(do_not_specialize=["n"])
def _zero_one_sync_result_k(base, u, w, v, synced, momentum, n, eps, lrs, EPS: tl.constexpr,
                            LRS: tl.constexpr, HAS_U: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr):
    o = _block(BLOCK)
    k = o < n
    bv = tl.load(base + o, mask=k, other=0.0)
    if HAS_U:
        bv = bv - tl.load(u + o, mask=k, other=0.0)
    wv = tl.load(w + o, mask=k, other=0.0)
    vv = tl.load(v + o, mask=k, other=0.0)
    tl.store(synced + o, bv + _div(wv, _sqrt(vv, ASM) + _f32(eps, EPS), ASM), mask=k)
    tl.store(momentum + o, -_div(wv, _f32(lrs, LRS), ASM), mask=k)


_INTERPRETED = type(_sign_pack_k).__name__ == "InterpretedFunction"


# --- launching -------------------------------------------------------------------------------
def _launch(kernel, programs, *args, num_warps=_WARPS, **constants):
    """Launch ``programs`` programs of ``kernel`` on the current stream: FMA contraction
    off, the PTX helpers on the GPU (module docstring)."""
    if programs:
        kernel[(programs,)](*args, ASM=not _INTERPRETED, num_warps=num_warps, enable_fp_fusion=False,
                            **constants)


def _cdiv(a, b):
    return -(-a // b)


def _device(*tensors):
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    raise ValueError("no tensor argument to take the device from")


def _flat(t, device=None, dtype=None):
    """An input as a contiguous 1-D tensor on ``device`` (numpy arrays are copied there)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(np.asarray(t), device=device)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if t.dim() == 1 and t.is_contiguous():
        return t  # the caller's own tensor (an output given as an input stays that object)
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def _output(given, n, dtype, device):
    """``given`` (checked: contiguous, ``n`` elements of ``dtype``) or a new tensor."""
    if given is None:
        return torch.empty(n, dtype=dtype, device=device)
    if not isinstance(given, torch.Tensor) or not given.is_contiguous() or given.numel() != n \
            or given.dtype != dtype:
        raise ValueError(f"output must be a contiguous {dtype} tensor of {n} elements, got "
                         f"{getattr(given, 'dtype', type(given))} {tuple(getattr(given, 'shape', ()))}")
    return given


def _scalar(value, device):
    """``(argument, pointer?)``: a one-element tensor on ``device`` is passed as itself; a
    number (or a tensor elsewhere, read on the host: no device wait) as a float32 value."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"a scalar argument must have one element, got shape {tuple(value.shape)}")
        if value.device == device:
            return value, True
        value = value.item()
    return float(np.float32(value)), False


def _host(value):
    """A number, or a host tensor's value, as a Python number (for float64 wrappers)."""
    return value.item() if isinstance(value, torch.Tensor) else value


def _with_rest(value, device):
    """``beta`` and ``1 - beta`` as the kernels take them (:func:`_and_rest`)."""
    arg, ptr = _scalar(value, device)
    if ptr:
        return arg, 0.0, True
    v = float(_host(value))
    return float(np.float32(v)), float(np.float32(1.0 - v)), False


def _with_flag(value, device):
    """``weight_decay`` and ``weight_decay > 0`` as the kernels take them (:func:`_decay`)."""
    arg, ptr = _scalar(value, device)
    if ptr:
        return arg, 0, True
    return arg, int(float(_host(value)) > 0.0), False


def _key_arg(key, device):
    """``(argument, pointer?)`` for a call key: a tensor on ``device``, or the int's low 32
    bits as a signed int32 (one kernel signature for every key)."""
    if isinstance(key, torch.Tensor):
        if key.device == device:
            return key, True
        key = key.item()
    k = int(key) & 0xFFFFFFFF
    return (k - (1 << 32) if k >= 1 << 31 else k), False


def _rows(packed, scales, d, device):
    """Packed sign rows (flat) and their scales (flat, rows x segments), and the row count."""
    packed = _flat(packed, device)
    nbytes = (d + 7) // 8
    rows = packed.numel() // nbytes
    if rows < 1 or packed.numel() != rows * nbytes:
        raise ValueError(f"{packed.numel()} packed bytes are not rows of {nbytes} bytes")
    return packed, _flat(scales, device, torch.float32), rows, nbytes


def _layout(bounds, device):
    return segment_tables.layout(bounds, device)


# --- sign bits -------------------------------------------------------------------------------
def sign_pack(x, out=None):
    """``packing.pack_signs``: bit ``x >= 0``, 8 per byte, least significant first (into
    ``out`` if given)."""
    x = _flat(x)
    nbytes = (x.numel() + 7) // 8
    out = _output(out, nbytes, torch.uint8, x.device)
    _launch(_sign_pack_k, _cdiv(nbytes, _NB), x, out, x.numel(), nbytes, NB=_NB)
    return out


def _residual(x, e, scales, bounds, resid, bits):
    lay = _layout(bounds, x.device)
    _launch(_sign_residual_k, lay.tiles_count, x, x if e is None else e, _flat(scales, x.device, torch.float32),
            lay.bounds, lay.tiles, resid if bits is None else bits, resid, x.numel(), (x.numel() + 7) // 8,
            HAS_E=e is not None, BITS=bits is not None, NB=_NB)


def sign_pack_residual(x, e, scales, bounds, out=None, bits_out=None):
    """``packing.sign_pack_residual``: with ``p = x + e`` (``e`` may be ``None``), the
    packed sign bits of ``p`` and the residual ``p - where(p >= 0, scale, -scale)``, one
    float32 scale per segment. ``out`` (may be ``e`` itself) receives the residual in
    place, ``bits_out`` the bits."""
    x, e = _flat(x), _flat(e)
    bits = _output(bits_out, (x.numel() + 7) // 8, torch.uint8, x.device)
    resid = _output(out, x.numel(), torch.float32, x.device)
    _residual(x, e, scales, bounds, resid, bits)
    return bits, resid


def sign_residual(x, e, scales, bounds, out=None):
    """``packing.sign_residual``: the residual of :func:`sign_pack_residual` alone, into
    ``out`` (which may be ``e`` itself)."""
    x, e = _flat(x), _flat(e)
    resid = _output(out, x.numel(), torch.float32, x.device)
    _residual(x, e, scales, bounds, resid, None)
    return resid


def unpack_scaled_sum(packed, scales, bounds, d, base=None, out=None, base_scales=None):
    """``packing.unpack_scaled_sum``: ``sum_r scales[r, seg(i)] * sign_r(i)`` in row order
    in float32, plus ``base`` (with ``base_scales``: its residual) after the sum; ``out``
    may be ``base`` itself."""
    device = _device(packed, scales, base, out)
    out = _output(out, d, torch.float32, device)
    if d == 0:
        return out
    packed, scales, rows, nbytes = _rows(packed, scales, d, device)
    base = _flat(base, device)
    folds = None if base is None or base_scales is None else _flat(base_scales, device, torch.float32)
    lay = _layout(bounds, device)
    _launch(_unpack_k, lay.tiles_count, packed, scales, lay.bounds, lay.tiles, out if base is None else base,
            scales if folds is None else folds, out, out, scales, out, out, d, nbytes, rows, lay.segments,
            HAS_BASE=base is not None, FOLDS=folds is not None, RESID=False, HAS_E=False, NB=_NB,
            num_warps=_warps("unpack"))
    return out


def unpack_sum_residual(packed, scales, bounds, d, x, e, own_scales, out=None, resid_out=None):
    """``packing.unpack_sum_residual``: :func:`unpack_scaled_sum` (no base) and
    :func:`sign_residual` of ``p = x + e`` with ``own_scales``, in one pass. ``out`` may be
    ``x`` and ``resid_out`` may be ``e``. Returns ``(sum, residual)``."""
    x, e = _flat(x), _flat(e)
    out = _output(out, d, torch.float32, x.device)
    resid = _output(resid_out, x.numel(), torch.float32, x.device)
    if d == 0:
        return out, resid
    packed, scales, rows, nbytes = _rows(packed, scales, d, x.device)
    lay = _layout(bounds, x.device)
    _launch(_unpack_k, lay.tiles_count, packed, scales, lay.bounds, lay.tiles, x, scales, x,
            x if e is None else e, _flat(own_scales, x.device, torch.float32), out, resid, d, nbytes, rows,
            lay.segments, HAS_BASE=False, FOLDS=False, RESID=True, HAS_E=e is not None, NB=_NB,
            num_warps=_warps("unpack"))
    return out, resid


# --- sums that set scales --------------------------------------------------------------------
def _sums(lay, device, partial_of, **launch):
    """Run ``partial_of`` (the tile kernel writing the pieces), then add each segment's
    pieces: the float64 sums, one per segment."""
    partial = torch.empty(max(lay.pieces_count, 1), dtype=torch.float64, device=device)
    partial_of(partial)
    sums = torch.empty(lay.segments, dtype=torch.float64, device=device)
    if lay.pieces_count:
        _launch(_totals_k, lay.segments, partial, lay.pieces, sums, R=_SUM_BLOCK)
    else:  # no element: every sum is 0
        sums.zero_()
    return sums


def _compensate(x, e, bounds, squares, bits):
    x, e = _flat(x), _flat(e)
    lay = _layout(bounds, x.device)

    def pieces(partial):
        _launch(_sums_k, lay.tiles_count, x, x if e is None else e, x, partial, partial, partial,
                lay.bounds, lay.tiles, partial, x, x if bits is None else bits, x.numel(), (x.numel() + 7) // 8,
                1, 1, HAS_E=e is not None, DECODE=False, HAS_BASE=False, FOLDS=False, SQUARES=bool(squares),
                BITS=bits is not None, NB=_NB, num_warps=_warps("sums"))
    return _sums(lay, x.device, pieces)


def compensate_sums(x, e, bounds, squares=False):
    """``segments.compensate_sums``: per segment, the float64 sum of ``|p|`` (or of
    ``p**2``) for ``p = x + e`` (``e`` may be ``None``), as a float64 tensor."""
    return _compensate(x, e, bounds, squares, None)


def compensate_sums_signs(x, e, bounds, squares=False, bits_out=None):
    """``segments.compensate_sums_signs``: :func:`compensate_sums` (the same sums, bit for
    bit) and the packed sign bits of ``p = x + e`` (into ``bits_out`` if given), one pass."""
    x = _flat(x)
    bits = _output(bits_out, (x.numel() + 7) // 8, torch.uint8, x.device)
    return _compensate(x, e, bounds, squares, bits), bits


def unpack_sums_signs(packed, scales, bounds, d, base=None, base_scales=None, out=None,
                      squares=False, bits_out=None):
    """``packing.unpack_sums_signs``: :func:`unpack_scaled_sum` into ``out`` (which may be
    ``base``), then the sums and signs of :func:`compensate_sums_signs` of the result (the
    same sums and bits), in one pass. Returns ``(sum, sums, bits)``."""
    device = _device(packed, scales, base, out)
    out = _output(out, d, torch.float32, device)
    bits = _output(bits_out, (d + 7) // 8, torch.uint8, device)
    lay = _layout(bounds, device)
    if d == 0:
        return out, _sums(lay, device, lambda partial: None), bits
    packed, scales, rows, nbytes = _rows(packed, scales, d, device)
    base = _flat(base, device)
    folds = None if base is None or base_scales is None else _flat(base_scales, device, torch.float32)

    def pieces(partial):
        _launch(_sums_k, lay.tiles_count, out, out, packed, scales, out if base is None else base,
                scales if folds is None else folds, lay.bounds, lay.tiles, partial, out, bits, d, nbytes, rows,
                lay.segments, HAS_E=False, DECODE=True, HAS_BASE=base is not None, FOLDS=folds is not None,
                SQUARES=bool(squares), BITS=True, NB=_NB, num_warps=_warps("sums"))
    return out, _sums(lay, device, pieces), bits


# --- max and finiteness ------------------------------------------------------------------------
def _scan(x):
    """``(max |x| over finite elements, all finite)`` as 0-d float32 and bool tensors."""
    x = _flat(x)
    n = x.numel()
    m = torch.empty((), dtype=torch.float32, device=x.device)
    ok = torch.empty((), dtype=torch.uint8, device=x.device)
    programs = _cdiv(n, _ABS_BLOCK)
    partial = torch.empty(2 * max(programs, 1), dtype=torch.int32, device=x.device)
    _launch(_absmax_k, programs, x.view(torch.int32), partial, n, BLOCK=_ABS_BLOCK)
    _launch(_absmax_total_k, 1, partial, programs, m.view(torch.int32), ok, R=_SUM_BLOCK)
    return m, ok.view(torch.bool)


def absmax_finite(x):
    """``global_qsgd.absmax_finite``: ``(max |x|, all finite)`` as 0-d float32 and bool
    tensors on the device; the max ignores non-finite elements."""
    return _scan(x)


def all_finite(x):
    """``Backend.all_finite`` for float32: no inf or NaN, as a 0-d bool tensor."""
    return _scan(x)[1]


# --- Global-QSGD linear dithering --------------------------------------------------------------
def quantize_lanes(x, pre, scale, levels, key, width, add_offset, first=0, out=None):
    """``global_qsgd.quantize``: stochastically rounded levels of ``x * pre / scale``,
    packed ``32 // width`` per int32 word (into ``out`` if given); ``x`` is elements
    ``first ..`` of the buffer whose call has key ``key``."""
    x = _flat(x)
    if width not in (8, 16):
        raise ValueError(f"lane width must be 8 or 16 bits, got {width}")
    lanes = 32 // width
    nwords = _cdiv(x.numel(), lanes)
    words = _output(out, nwords, torch.int32, x.device)
    offset = sum((1 << (width - 1)) << (width * j) for j in range(lanes - 1)) if add_offset else 0
    (pre, pre_ptr), (scale, scale_ptr) = _scalar(pre, x.device), _scalar(scale, x.device)
    key, key_ptr = _key_arg(key, x.device)
    nw = LAUNCH["quantize_lanes"]["block"] // lanes
    _launch(_quantize_lanes_k, _cdiv(nwords, nw), x, words, x.numel(), nwords, pre, scale,
            float(np.float32(levels)), key, int(first), offset, PRE=pre_ptr, SCALE=scale_ptr, KEY=key_ptr,
            LANES=lanes, WIDTH=width, NW=nw, num_warps=_warps("quantize_lanes"))
    return words


_INT_DTYPES = {"int8": torch.int8, "int16": torch.int16, "int32": torch.int32}


def _int_dtype(dtype):
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name if not isinstance(dtype, torch.dtype) \
        else str(dtype).replace("torch.", "")
    if name not in _INT_DTYPES:
        raise ValueError(f"quantize_ints: dtype must be int8, int16 or int32, got {dtype!r}")
    return _INT_DTYPES[name]


def quantize_ints(x, pre, scale, levels, key, dtype, first=0, out=None):
    """``global_qsgd.quantize``: stochastically rounded levels of ``x * pre / scale`` as
    ``dtype`` (into ``out`` if given); ``x`` is elements ``first ..`` of the call's buffer."""
    x = _flat(x)
    out = _output(out, x.numel(), _int_dtype(dtype), x.device)
    (pre, pre_ptr), (scale, scale_ptr) = _scalar(pre, x.device), _scalar(scale, x.device)
    key, key_ptr = _key_arg(key, x.device)
    _launch(_quantize_ints_k, _cdiv(x.numel(), BLOCK), x, out, x.numel(), pre, scale, float(np.float32(levels)),
            key, int(first), PRE=pre_ptr, SCALE=scale_ptr, KEY=key_ptr, BLOCK=BLOCK)
    return out


def dequantize_lanes(words, numel, width, factor, out=None):
    """``packing.unpack_lanes`` + ``global_qsgd.linear_dequantize``: lane sums of int32
    ``words`` times the float32 ``factor`` (into ``out`` if given)."""
    words = _flat(words)
    if width not in (8, 16):
        raise ValueError(f"lane width must be 8 or 16 bits, got {width}")
    out = _output(out, numel, torch.float32, words.device)
    lanes = 32 // width
    factor, factor_ptr = _scalar(factor, words.device)
    nw = LAUNCH["dequantize_lanes"]["block"] // lanes
    _launch(_dequantize_lanes_k, _cdiv(_cdiv(numel, lanes), nw), words, out, numel, words.numel(), factor,
            FACTOR=factor_ptr, LANES=lanes, WIDTH=width, NW=nw, num_warps=_warps("dequantize_lanes"))
    return out


def dequantize_ints(q, factor, out=None):
    """``global_qsgd.linear_dequantize`` of native integer sums (into ``out`` if given)."""
    q = _flat(q)
    out = _output(out, q.numel(), torch.float32, q.device)
    factor, factor_ptr = _scalar(factor, q.device)
    _launch(_dequantize_ints_k, _cdiv(q.numel(), BLOCK), q, out, q.numel(), factor, FACTOR=factor_ptr,
            BLOCK=BLOCK)
    return out


# --- a scale per block (global_qsgd's and qsgd's ``block``) ------------------------------------
def _tables(device, *per_block):
    """Each table of values per block as a flat float32 tensor on ``device``."""
    return [_flat(t, device, torch.float32) for t in per_block]


def block_absmax_finite(x, block):
    """``global_qsgd.block_absmax`` and ``Backend.all_finite`` in one pass: ``(max |x| per
    block over its finite elements, float32; all finite as a 0-d bool tensor)``."""
    x = _flat(x)
    block, _, nblocks = piece_blocks(x.numel(), block, 0)
    mx = torch.zeros(nblocks, dtype=torch.int32, device=x.device)
    top = torch.zeros(nblocks, dtype=torch.int32, device=x.device)
    if x.numel():
        _launch(_block_absmax_k, nblocks, x.view(torch.int32), mx, top, x.numel(), block, BLOCK=_BLOCK_STEP)
    return mx.view(torch.float32), top.max() < 0x7F800000


def quantize_lanes_blocks(x, pre, scale, block, levels, key, width, add_offset, first=0, out=None):
    """``global_qsgd`` with a ``pre`` and a scale per block (``cpu.quantize_lanes_blocks``):
    tensors on the device, one value per block the piece touches."""
    x = _flat(x)
    if width not in (8, 16):
        raise ValueError(f"lane width must be 8 or 16 bits, got {width}")
    pre, scale = _tables(x.device, pre, scale)
    block, lead, _ = piece_blocks(x.numel(), block, first, pre.numel(), scale.numel())
    check_lanes(width, block, lead)
    lanes = 32 // width
    nwords = _cdiv(x.numel(), lanes)
    words = _output(out, nwords, torch.int32, x.device)
    offset = sum((1 << (width - 1)) << (width * j) for j in range(lanes - 1)) if add_offset else 0
    key, key_ptr = _key_arg(key, x.device)
    nw = LAUNCH["quantize_lanes"]["block"] // lanes
    _launch(_quantize_lanes_blocks_k, _cdiv(nwords, nw), x, words, pre, scale, x.numel(), nwords, block, lead,
            float(np.float32(levels)), key, int(first), offset, KEY=key_ptr, LANES=lanes, WIDTH=width, NW=nw,
            num_warps=_warps("quantize_lanes"))
    return words


def quantize_ints_blocks(x, pre, scale, block, levels, key, dtype, first=0, out=None):
    """``global_qsgd`` and ``qsgd`` with a ``pre`` and a scale per block
    (``cpu.quantize_ints_blocks``)."""
    x = _flat(x)
    out = _output(out, x.numel(), _int_dtype(dtype), x.device)
    pre, scale = _tables(x.device, pre, scale)
    block, lead, _ = piece_blocks(x.numel(), block, first, pre.numel(), scale.numel())
    key, key_ptr = _key_arg(key, x.device)
    _launch(_quantize_ints_blocks_k, _cdiv(x.numel(), BLOCK), x, out, pre, scale, x.numel(), block, lead,
            float(np.float32(levels)), key, int(first), KEY=key_ptr, BLOCK=BLOCK)
    return out


def dequantize_lanes_blocks(words, numel, width, factor, block, first=0, out=None):
    """Lane sums times a float32 ``factor`` per block (``cpu.dequantize_lanes_blocks``)."""
    words = _flat(words)
    if width not in (8, 16):
        raise ValueError(f"lane width must be 8 or 16 bits, got {width}")
    (factor,) = _tables(words.device, factor)
    block, lead, _ = piece_blocks(numel, block, first, factor.numel())
    check_lanes(width, block, lead)
    out = _output(out, numel, torch.float32, words.device)
    lanes = 32 // width
    nw = LAUNCH["dequantize_lanes"]["block"] // lanes
    _launch(_dequantize_lanes_blocks_k, _cdiv(_cdiv(numel, lanes), nw), words, out, factor, numel,
            words.numel(), block, lead, LANES=lanes, WIDTH=width, NW=nw, num_warps=_warps("dequantize_lanes"))
    return out


def dequantize_ints_blocks(q, factor, block, first=0, out=None):
    """Integer sums times a float32 ``factor`` per block (``cpu.dequantize_ints_blocks``)."""
    q = _flat(q)
    out = _output(out, q.numel(), torch.float32, q.device)
    (factor,) = _tables(q.device, factor)
    block, lead, _ = piece_blocks(q.numel(), block, first, factor.numel())
    _launch(_dequantize_ints_blocks_k, _cdiv(q.numel(), BLOCK), q, out, factor, q.numel(), block, lead,
            BLOCK=BLOCK)
    return out


# --- Global-QSGD exponential dithering ---------------------------------------------------------
def exp_encode(x, scale, world_size, key, out=None):
    """``exp_dithering.exp_encode``: uint8 codes of ``x / (scale * 2**(n-1))`` (into ``out``
    if given)."""
    x = _flat(x)
    out = _output(out, x.numel(), torch.uint8, x.device)
    scale, scale_ptr = _scalar(scale, x.device)
    key, key_ptr = _key_arg(key, x.device)
    _launch(_exp_encode_k, _cdiv(x.numel(), BLOCK), x, out, x.numel(), scale,
            float(np.float32(2.0 ** (1 - world_size))), key, SCALE=scale_ptr, KEY=key_ptr, BLOCK=BLOCK)
    return out


def exp_combine(a, b, key, out=None):
    """``exp_dithering.combine_codes``: unbiased stochastic sum of two code arrays (into
    ``out`` if given)."""
    a, b = _flat(a), _flat(b)
    out = _output(out, a.numel(), torch.uint8, a.device)
    key, key_ptr = _key_arg(key, a.device)
    _launch(_exp_combine_k, _cdiv(a.numel(), BLOCK), a, b, out, a.numel(), key, KEY=key_ptr, BLOCK=BLOCK)
    return out


def exp_decode(codes, factor, scale, out=None):
    """``exp_dithering.exp_decode``: ``value(code) * factor * scale`` (float32, in that
    order), saturated at the float32 maximum; ``factor = 2**(n-1) / n``."""
    codes = _flat(codes)
    out = _output(out, codes.numel(), torch.float32, codes.device)
    (factor, factor_ptr), (scale, scale_ptr) = _scalar(factor, codes.device), _scalar(scale, codes.device)
    _launch(_exp_decode_k, _cdiv(codes.numel(), BLOCK), codes, out, codes.numel(), factor, scale,
            FACTOR=factor_ptr, SCALE=scale_ptr, BLOCK=BLOCK)
    return out


# --- Marsit, the hierarchy's re-binarisation, BinSGDM ------------------------------------------
def marsit_select(own, recv, keep, key, out=None):
    """``marsit.MarsitSelect.combine``: each bit from ``own`` with probability ``keep``
    (draw ``8 * byte + bit`` of the call), else from ``recv`` (into ``out`` if given)."""
    own, recv = _flat(own), _flat(recv)
    out = _output(out, own.numel(), torch.uint8, own.device)
    keep, keep_ptr = _scalar(keep, own.device)
    key, key_ptr = _key_arg(key, own.device)
    _launch(_marsit_select_k, _cdiv(own.numel(), _NB), own, recv, out, own.numel(), keep, key, KEEP=keep_ptr,
            KEY=key_ptr, NB=_NB, num_warps=_warps("marsit_select"))
    return out


def rebinarize(rows, k, key, out=None):
    """``hierarchical.threshold_rows``: from ``k`` rows of packed signs (``k * w`` bytes),
    the ``w`` packed bytes of ``draw(i) < (S_i / k + 1) / 2`` (``S_i`` the rows' sign sum
    of element ``i``), draw ``i`` of the call with key ``key``; into ``out`` if given. A
    tensor ``k`` needs ``out`` (whose size gives ``k`` without reading the tensor)."""
    rows = _flat(rows)
    if isinstance(k, torch.Tensor):
        if out is None:
            raise ValueError("rebinarize: a tensor k needs out= (the output's size sets the row count)")
        k = rows.numel() // out.numel() if out.numel() else 1
    k = int(k)
    if not 1 <= k <= 255 or rows.numel() % k:
        raise ValueError(f"rebinarize: {rows.numel()} bytes are not k={k} rows (1 <= k <= 255)")
    width = rows.numel() // k
    out = _output(out, width, torch.uint8, rows.device)
    key, key_ptr = _key_arg(key, rows.device)
    _launch(_rebinarize_k, _cdiv(width, _NB), rows, out, width, k, float(np.float32(1.0 / k)), key, KEY=key_ptr,
            NB=_NB, num_warps=_warps("rebinarize"))
    return out


def binsgdm_encode(g, m, b, beta, key, m_out=None, b_out=None, bits_out=None):
    """``binsgdm.binary_randomize``: the new momentum and |g| average (new tensors, or
    ``m_out`` / ``b_out``) and the packed bits of ``q = +1`` with probability
    ``(1 + m/b) / 2`` (into ``bits_out`` if given)."""
    g, m, b = _flat(g), _flat(m), _flat(b)
    n = g.numel()
    m_out = _output(m_out, n, torch.float32, g.device)
    b_out = _output(b_out, n, torch.float32, g.device)
    bits = _output(bits_out, (n + 7) // 8, torch.uint8, g.device)
    beta, rest, beta_ptr = _with_rest(beta, g.device)
    key, key_ptr = _key_arg(key, g.device)
    _launch(_binsgdm_k, _cdiv(n, TILE), g, m, b, m_out, b_out, bits, n, (n + 7) // 8, beta, rest, key,
            BETA=beta_ptr, KEY=key_ptr, NB=_NB)
    return m_out, b_out, bits


# --- random draws ------------------------------------------------------------------------------
def _draw_device(key, out, device):
    if out is not None:
        return out.device
    if isinstance(key, torch.Tensor):
        return key.device
    return torch.device(device if device is not None else "cuda")


def uniform(key, n, out=None, *, device=None):
    """``Backend.uniform``: ``n`` draws of the call with key ``key`` (into ``out`` if given,
    else a new tensor on ``device``: the key's, or the current CUDA device)."""
    device = _draw_device(key, out, device)
    out = _output(out, n, torch.float32, device)
    key, key_ptr = _key_arg(key, device)
    _launch(_uniform_k, _cdiv(n, BLOCK), out, n, key, KEY=key_ptr, BLOCK=BLOCK)
    return out


def random_bytes(key, n, out=None, *, device=None):
    """``rng.random_bytes``: ``n`` bytes, byte ``i`` the byte ``i % 4`` of 32-bit draw
    ``i // 4`` of the call with key ``key`` (into ``out`` if given)."""
    device = _draw_device(key, out, device)
    out = _output(out, n, torch.uint8, device)
    key, key_ptr = _key_arg(key, device)
    _launch(_random_bytes_k, _cdiv(_cdiv(n, 4), BLOCK // 4), out, n, key, KEY=key_ptr, NW=BLOCK // 4)
    return out


# --- the Adam-family update rules --------------------------------------------------------------
def ema(avg, value, beta, square=False, in_place=False, out=None):
    """``elementwise.ema``: ``avg * beta + value * (1 - beta)`` (``value**2`` if square),
    into ``avg`` itself when ``in_place``, else into ``out`` (or a new tensor)."""
    avg, value = _flat(avg), _flat(value)
    out = avg if in_place else _output(out, avg.numel(), torch.float32, avg.device)
    beta, rest, beta_ptr = _with_rest(beta, avg.device)
    _launch(_ema_k, _cdiv(avg.numel(), BLOCK), avg, value, out, avg.numel(), beta, rest, BETA=beta_ptr,
            SQUARE=bool(square), BLOCK=BLOCK)
    return out


def descend(x, step, lr, weight_decay, in_place=False, out=None, divisor=1.0):
    """``elementwise.descend``: ``x - lr * (step / divisor + weight_decay * x)``, into ``x``
    itself when ``in_place``, else into ``out`` (or a new tensor)."""
    x, step = _flat(x), _flat(step)
    out = x if in_place else _output(out, x.numel(), torch.float32, x.device)
    (lr, lr_ptr), (divisor, div_ptr) = _scalar(lr, x.device), _scalar(divisor, x.device)
    wd, has_wd, wd_ptr = _with_flag(weight_decay, x.device)
    _launch(_descend_k, _cdiv(x.numel(), BLOCK), x, step, out, x.numel(), lr, wd, has_wd, divisor, LR=lr_ptr,
            WD=wd_ptr, DIVISOR=div_ptr, BLOCK=BLOCK)
    return out


def adam_descend(x, m, v, lr, eps, weight_decay, acc=None, x_out=None, acc_out=None):
    """``elementwise.adam_descend``: ``(x - delta, acc - delta)`` (an empty tensor for the
    second when ``acc`` is None) with ``delta = lr * (m / (sqrt(v) + eps) + weight_decay *
    x)``, into ``x_out`` / ``acc_out`` when given (they may be ``x`` / ``acc``)."""
    x, m, v, acc = _flat(x), _flat(m), _flat(v), _flat(acc)
    x_out = _output(x_out, x.numel(), torch.float32, x.device)
    if acc is None:
        acc_out = torch.empty(0, dtype=torch.float32, device=x.device)
    else:
        acc_out = _output(acc_out, x.numel(), torch.float32, x.device)
    (lr, lr_ptr), (eps, eps_ptr) = _scalar(lr, x.device), _scalar(eps, x.device)
    wd, has_wd, wd_ptr = _with_flag(weight_decay, x.device)
    _launch(_adam_descend_k, _cdiv(x.numel(), BLOCK), x, m, v, x if acc is None else acc, x_out,
            x_out if acc is None else acc_out, x.numel(), lr, eps, wd, has_wd, LR=lr_ptr, EPS=eps_ptr, WD=wd_ptr,
            HAS_ACC=acc is not None, BLOCK=BLOCK)
    return x_out, acc_out


def precondition(u, v, eps, out=None):
    """``elementwise.precondition``: ``u * (sqrt(v) + eps)`` (into ``out`` if given)."""
    u, v = _flat(u), _flat(v)
    out = _output(out, u.numel(), torch.float32, u.device)
    eps, eps_ptr = _scalar(eps, u.device)
    _launch(_precondition_k, _cdiv(u.numel(), BLOCK), u, v, out, u.numel(), eps, EPS=eps_ptr, BLOCK=BLOCK)
    return out


def zero_one_sync_input(x, m, g, v, u, beta, lr, eps, weight_decay, base=None, w=None):
    """``elementwise.zero_one_sync_input``: with ``m' = m * beta + g * (1 - beta)`` and
    Adam's ``delta`` from ``m'``, the pair ``((x - delta) - (u - delta), (u - delta) *
    (sqrt(v) + eps))`` (into ``base`` / ``w`` if given; neither may share memory with an
    input)."""
    x, m, g, v, u = (_flat(t) for t in (x, m, g, v, u))
    base = _output(base, x.numel(), torch.float32, x.device)
    w = _output(w, x.numel(), torch.float32, x.device)
    beta, rest, beta_ptr = _with_rest(beta, x.device)
    (lr, lr_ptr), (eps, eps_ptr) = _scalar(lr, x.device), _scalar(eps, x.device)
    wd, has_wd, wd_ptr = _with_flag(weight_decay, x.device)
    _launch(_zero_one_sync_input_k, _cdiv(x.numel(), BLOCK), x, m, g, v, u, base, w, x.numel(), beta, rest, lr,
            eps, wd, has_wd, BETA=beta_ptr, LR=lr_ptr, EPS=eps_ptr, WD=wd_ptr, BLOCK=BLOCK)
    return base, w


def zero_one_sync_result(base, u, w, v, eps, lrs, synced=None, momentum=None):
    """``elementwise.zero_one_sync_result``: ``((base - u) + w / (sqrt(v) + eps), -(w /
    lrs))``, ``base`` alone when ``u`` is None (into ``synced`` / ``momentum`` if given;
    neither may share memory with an input)."""
    base, u, w, v = _flat(base), _flat(u), _flat(w), _flat(v)
    synced = _output(synced, w.numel(), torch.float32, w.device)
    momentum = _output(momentum, w.numel(), torch.float32, w.device)
    (eps, eps_ptr), (lrs, lrs_ptr) = _scalar(eps, w.device), _scalar(lrs, w.device)
    _launch(_zero_one_sync_result_k, _cdiv(w.numel(), BLOCK), base, base if u is None else u, w, v, synced,
            momentum, w.numel(), eps, lrs, EPS=eps_ptr, LRS=lrs_ptr, HAS_U=u is not None, BLOCK=BLOCK)
    return synced, momentum


# --- every kernel once -------------------------------------------------------------------------
def warm_up(device="cuda", part=0, parts=1):
    """Call every primitive once with each of its flags and both kinds of scalars (numbers
    and one-element tensors) on small tensors on ``device``, so that Triton compiles (or
    loads from its cache) every kernel variant now rather than in a training step.
    ``part`` of ``parts``: every ``parts``-th call from the ``part``-th, for processes that
    compile in parallel (Triton's on-disk cache is shared). ``scripts/check_ptx.py`` runs it
    with the launches replaced by compilations for sm_90 (no GPU needed) to check the PTX
    of every variant."""
    calls = _warm_calls(torch.device(device))
    for call in calls[part::parts]:
        call()
    return len(calls[part::parts])


def _warm_calls(dev):
    """The calls of :func:`warm_up`, each independent of the others (inputs made with
    plain torch operations)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.linspace(-1, 1, 24, device=dev)
    v = x.abs()
    ones, ones4 = torch.ones(2, device=dev), torch.ones(4, device=dev)
    bits = torch.randint(0, 256, (3,), generator=gen, dtype=torch.uint8).to(dev)
    rows = torch.cat([bits, bits])
    codes = torch.randint(0, 256, (24,), generator=gen, dtype=torch.uint8).to(dev)
    words = torch.randint(-1000, 1000, (12,), generator=gen, dtype=torch.int32).to(dev)
    ints = torch.randint(-100, 100, (24,), generator=gen, dtype=torch.int8).to(dev)
    bounds = np.array([0, 10, 24], np.int64)
    aligned = np.array([0, 8, 24], np.int64)

    def one(value, dtype=torch.float32):
        return torch.full((1,), value, dtype=dtype, device=dev)

    calls = [lambda: sign_pack(x), lambda: absmax_finite(x), lambda: all_finite(x),
             lambda: block_absmax_finite(x, 8)]
    per_block = torch.ones(3, device=dev)  # three blocks of 8
    for key in (5, one(5, torch.int64)):
        for width in (8, 16):
            for offset in (True, False):
                calls.append(lambda w=width, o=offset, k=key: quantize_lanes_blocks(x, per_block, per_block, 8, 3, k,
                                                                                   w, o))
        for dtype in ("int8", "int16", "int32"):
            calls.append(lambda t=dtype, k=key: quantize_ints_blocks(x, per_block, per_block, 8, 3, k, t))
    calls += [lambda w=width: dequantize_lanes_blocks(words, 24, w, per_block, 8) for width in (8, 16)]
    calls += [lambda: dequantize_ints_blocks(ints, per_block, 8), lambda: dequantize_ints_blocks(words, per_block, 8)]
    for e in (None, x.clone()):
        calls += [lambda e=e: sign_pack_residual(x, e, ones, bounds), lambda e=e: sign_residual(x, e, ones, bounds),
                  lambda e=e: compensate_sums(x, e, bounds),
                  lambda e=e: compensate_sums_signs(x, e, bounds, squares=True),
                  lambda e=e: unpack_sum_residual(rows, ones4, bounds, 24, x, e, ones)]
    for base, folds in ((None, None), (x.clone(), None), (x.clone(), ones)):
        calls.append(lambda b=base, f=folds: unpack_scaled_sum(rows, ones4, bounds, 24, base=b, base_scales=f))
        for squares in (False, True):
            calls.append(lambda b=base, f=folds, s=squares: unpack_sums_signs(rows, ones4, aligned, 24, base=b,
                                                                              base_scales=f, squares=s))
    for tensors in (False, True):
        s = one if tensors else (lambda value, dtype=None: value)
        key = one(5, torch.int64) if tensors else 5
        for width in (8, 16):
            for offset in (True, False):
                calls.append(lambda w=width, o=offset, s=s, k=key: quantize_lanes(x, s(1.0), s(1.0), 3, k, w, o))
            calls.append(lambda w=width, s=s: dequantize_lanes(words, 24, w, s(0.5)))
        for dtype in ("int8", "int16", "int32"):
            calls.append(lambda t=dtype, s=s, k=key: quantize_ints(x, s(1.0), s(1.0), 3, k, t))
        calls += [
            lambda s=s: dequantize_ints(ints, s(0.5)),
            lambda s=s: dequantize_ints(words, s(0.5)),
            lambda s=s, k=key: exp_encode(x, s(1.0), 2, k),
            lambda k=key: exp_combine(codes, codes, k),
            lambda s=s: exp_decode(codes, s(1.0), s(1.0)),
            lambda s=s, k=key: marsit_select(bits, bits, s(0.5), k),
            lambda k=key: rebinarize(rows, 2, k),
            lambda s=s, k=key: binsgdm_encode(x, x, v, s(0.9), k),
            lambda k=key: uniform(k, 8, device=dev),
            lambda k=key: random_bytes(k, 9, device=dev),
            lambda s=s: ema(v, x, s(0.9)),
            lambda s=s: ema(v, x, s(0.9), square=True),
            lambda s=s: descend(x, x, s(0.1), s(0.01), divisor=s(2.0)),
            lambda s=s: adam_descend(x, x, v, s(0.1), s(1e-8), s(0.0)),
            lambda s=s: adam_descend(x, x, v, s(0.1), s(1e-8), s(0.0), x.clone()),
            lambda s=s: precondition(x, v, s(1e-8)),
            lambda s=s: zero_one_sync_input(x, x, x, v, x, s(0.9), s(0.1), s(1e-8), s(0.0)),
            lambda s=s: zero_one_sync_result(x, None, x, v, s(1e-8), s(0.1)),
            lambda s=s: zero_one_sync_result(x, x, x, v, s(1e-8), s(0.1)),
        ]
    return calls
