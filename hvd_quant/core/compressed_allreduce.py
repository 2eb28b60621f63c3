"""The two-stage 1-bit compressed allreduce with worker and server error feedback.

The collective behind 1-bit Adam (Tang et al., "1-bit Adam: Communication Efficient
Large-Scale Training with Adam's Convergence Speed", ICML 2021) and 0/1 Adam (Lu et al.,
ICLR 2023), as DeepSpeed implements it in ``deepspeed/runtime/comm/nccl.py``
(``NcclBackend.compressed_allreduce``; ``mpi.py`` and ``compressed.py`` do the same with
other transports). Written from that description, not from its code.

With ``n`` ranks and a buffer of ``d`` elements, padded with zeros to ``D``, a multiple of
``n * lcm(n, 8)`` (DeepSpeed's ``divider = n * 8 / gcd(n, 8)``), so that every rank's
chunk of ``D / n`` elements is a whole number of bytes:

1. **worker** (every rank)::

       c        = pad(x) + e_worker                (e_worker: D elements, this rank's)
       sigma_w  = ||c||_2 / sqrt(D)                (RMS scale, zero padding included)
       e_worker = c - sigma_w * sign(c)            (sign(0) = +1)
       bits     = packbits(c >= 0), cut into n chunks

   ``alltoall``: chunk ``j`` of every rank goes to rank ``j``, with ``sigma_w``.
2. **server** (rank ``j`` owns chunk ``j``)::

       c_s      = sum_r (sigma_w[r] * (1/n)) * sign_r[chunk j] + e_server   (rows in rank order)
       sigma_s  = ||c_s||_2 / sqrt(D / n)
       e_server = c_s - sigma_s * sign(c_s)
       bits_s   = packbits(c_s >= 0)

   ``allgather`` of ``bits_s`` with ``sigma_s``. (:func:`compressed_allreduce_compensated`
   keeps ``c_s`` and ``sigma_s`` instead of ``e_server``, and folds ``e_server`` into the
   next step's decode: the same numbers with fewer passes over the chunk.)
3. **output**, identical on every rank: chunk ``j`` is ``sigma_s[j] * sign(bits_s[j])``,
   cut back to ``d`` elements.

Bytes sent per rank (the :class:`~hvd_quant.core.comm.WireMeter` cost model): the
alltoall ``(n - 1) / n * D / 8``, the server allgather ``(n - 1) * D / (8 n)``, and one
float32 scale to each other rank in each: about ``2 (n - 1) / n * D / 8``, 32 times less
than an fp32 allreduce's ``2 (n - 1) / n * 4 D``. The scales travel in the same
collectives as the signs (DeepSpeed gathers them separately): two collectives per call.

Per-tensor scales in one collective (``counts``): DeepSpeed's ``step()`` calls
``compressed_allreduce`` once per parameter tensor, each with its own error buffers and so
its own worker and server scales; only under its fp16 optimizer, which flattens each
parameter group into one tensor, is there one scale per group. Passing the tensor sizes
as ``counts`` gives exactly the per-tensor results (each tensor padded by the rule above,
its error buffers concatenated in tensor order) with one set of collectives for all
tensors: tensor ``i``'s chunk ``j`` goes to rank ``j``, so the alltoall sends rank ``j``
the concatenation of every tensor's chunk ``j``, and each collective carries one float32
scale per tensor.

Non-finite input: a rank whose ``c`` holds inf or NaN has a non-finite ``sigma_w``; every
rank receives every ``sigma_w`` with the signs, before any error buffer changes, so every
rank sees it, leaves both error buffers exactly as they were, and returns NaN for the
whole buffer.
"""

import math

import numpy as np

from .compressor import note_scales
from .packing import (packed_sign_bytes, sign_pack_residual, sign_residual, split_scales,
                      unpack_scaled_sum, unpack_sum_residual, unpack_sums_signs, with_scales)
from .pipeline import start_allgather, start_alltoall
from .segments import compensate_sums, compensate_sums_signs

FLOAT32_MAX = float(np.finfo(np.float32).max)


def padded_size(numel, world_size):
    """``numel`` rounded up to a multiple of ``n * lcm(n, 8)`` (DeepSpeed's padding).
    With a list of tensor sizes, the sum of their padded sizes (one buffer per tensor)."""
    if not isinstance(numel, int):
        return sum(padded_size(int(c), world_size) for c in numel)
    unit = world_size * (world_size * 8 // math.gcd(world_size, 8))
    return numel + (-numel) % unit


def rms_scales(B, x, e, counts, sums=None):
    """float32 :func:`rms_scale` of every segment of ``x + e`` (``counts`` elements each),
    from ``sums``, the float64 sums of squares, when they were computed already."""
    norms = B.sqrt(compensate_sums(B, x, e, counts, squares=True) if sums is None else sums)
    roots = np.sqrt(np.maximum(np.asarray(counts, np.float64), 1.0))
    as_deepspeed = B.divide(B.cast(norms, "float32"), roots.astype(np.float32))
    return B.where(B.less(norms, B.full(1, FLOAT32_MAX, "float64")), as_deepspeed,
                   B.cast(B.divide(norms, roots), "float32"))


def rms_scale(B, x, e, numel):
    """float32 ``||x + e||_2 / sqrt(numel)``: the sum of squares is taken in float64 (no
    overflow, no lost digits), then, as DeepSpeed's ``torch.linalg.norm(b) /
    np.sqrt(b.numel())`` on a float32 tensor, the float32 norm is divided by
    ``float32(sqrt(numel))``. Where the norm itself exceeds the float32 range (values near
    the float32 maximum, where DeepSpeed's norm overflows to inf) the division is done in
    float64 first."""
    norm = B.sqrt(compensate_sums(B, x, e, [B.numel(x)], squares=True))
    root = math.sqrt(max(numel, 1))
    as_deepspeed = B.divide(B.cast(norm, "float32"), float(np.float32(root)))
    return B.where(B.less(norm, B.full(1, FLOAT32_MAX, "float64")), as_deepspeed,
                   B.cast(B.divide(norm, root), "float32"))


def compressed_allreduce(B, comm, x, worker_error, server_error, name, counts=None, out=None):
    """Average the flat float32 ``x`` over ``comm``'s ranks at 1 bit per element.

    Parameters
    ----------
    B : Backend
    comm : Communicator
    x : float32 tensor of ``d`` elements
    worker_error : float32 tensor of ``padded_size(counts, n)`` elements (this rank's state)
    server_error : float32 tensor of ``padded_size(counts, n) // n`` elements
    name : str
        Prefix of the collective names, identical on every rank.
    counts : list of int or None
        Sizes of the tensors concatenated in ``x``, each compressed with its own scales
        and error buffers as DeepSpeed's per-tensor ``step()`` does (see the module
        docstring); None: ``x`` is one tensor (DeepSpeed's flattened fp16 group).
    out : float32 tensor of ``d`` elements or None
        Where the result may be decoded (it may be ``x``'s memory: ``x`` is read only in
        the worker stage). Used when the buffer needs no padding; use the returned
        tensor either way.

    Returns
    -------
    out : float32 tensor of ``d`` elements, identical on every rank
    worker_error, server_error : the updated error buffers (updated in place where the
        backend allows; always use the returned ones)
    finite : boolean scalar tensor, False when any rank's input was not finite
    """
    result, worker_error, server_error, _, finite = _two_stages(
        B, comm, x, worker_error, server_error, None, name, counts, out)
    return result, worker_error, server_error, finite


def compressed_allreduce_compensated(B, comm, x, worker_error, server_state, server_scale, name,
                                     counts=None, out=None):
    """:func:`compressed_allreduce` with the server's state kept as its compensated values
    ``c_s`` and their scales ``sigma_s`` instead of the residual: the same results, bit for
    bit, with fewer passes over the server's chunk.

    DeepSpeed's server stage writes ``e_s = c_s - sigma_s * sign(c_s)`` after re-signing,
    then reads it back at the next step; here the residual is never written: the next
    step's decode folds it in as it reads ``c_s`` (``base_scales``), and the sums that set
    the new scale and the sign bits are taken from each block of ``c_s`` as it is decoded
    (fused primitive ``unpack_sums_signs``). Per step and element of the chunk: 8 bytes of
    memory traffic (``c_s`` read and written back in place) instead of 20 (``D / n``
    elements on every rank).

    The worker's state stays a residual: its new value is only known to be kept once
    every rank's scale has arrived, so compensated values written before that would need
    a second buffer (a non-finite step must leave the state as it was), and a write to
    memory that is not in the cache reads it first: the same traffic as writing the
    residual in the decode's pass (measured with the kernels, 2026-11-27).

    A residual is the compensated state with zero scales (``e - 0 * sign(e) == e``): a
    server error saved in DeepSpeed's form, or by the plain function, continues exactly
    with ``server_scale`` zeros; :func:`server_residual` gives DeepSpeed's form back.

    Parameters
    ----------
    server_state : float32 tensor of ``padded_size(counts, n) // n`` elements
        The server's compensated values ``c_s`` (zeros at the start).
    server_scale : float32 tensor of ``len(counts)`` elements (1 when ``counts`` is None)
        Their scales ``sigma_s`` (zeros at the start).
    Others as in :func:`compressed_allreduce`.

    Returns
    -------
    out, worker_error, server_state, server_scale, finite
        The last three are left as they were when any rank's input was not finite.
    """
    return _two_stages(B, comm, x, worker_error, server_state, server_scale, name, counts, out)


def server_residual(B, server_state, server_scale, counts, world_size):
    """DeepSpeed's server error ``c_s - sigma_s * sign(c_s)`` of a compensated server state
    (:func:`compressed_allreduce_compensated`), per tensor of ``counts``."""
    chunks = [padded_size(int(c), world_size) // world_size for c in counts]
    return sign_residual(B, server_state, None, server_scale, chunks)


def _two_stages(B, comm, x, worker_error, server_error, server_scale, name, counts, out):
    """Both functions above; ``server_scale`` None: the server error is a residual."""
    n, d = comm.size, B.numel(x)
    counts, padded, buf = _padded_input(B, x, counts, n)
    chunks = [p // n for p in padded]
    total, chunk = sum(padded), sum(chunks)

    # Phase 1 (worker): one pass gives the sums of squares and the sign bits (a sign does
    # not depend on the scale). One alltoall carries the signs and the RMS scales: row j,
    # for rank j, is every tensor's chunk j of the signs (in tensor order), then this
    # rank's scales (4 bytes per tensor). Every rank then holds every rank's scales, so it
    # knows whether the step is finite before any error buffer changes. (A scale allgather
    # beside the alltoall ran before it in Horovod, one more collective per bucket.)
    sums, bits = compensate_sums_signs(B, buf, worker_error, padded, squares=True)
    worker_scale = rms_scales(B, buf, worker_error, padded, sums=sums)
    width = packed_sign_bytes(chunk)
    sent = with_scales(B, B.reshape(_rank_major(B, bits, chunks, n), (n, width)), n, worker_scale)
    received, worker_scales = split_scales(  # n rows: rank r's chunk, rank r's scales
        B, start_alltoall(comm, sent, f"{name}.worker_signs").wait(), n, width, len(counts))
    note_scales(comm, B, worker_scales)  # the owner's metrics, where they are on
    finite = B.all_finite(worker_scales)

    # Phase 2 (server): average this rank's chunks, add the server error, re-sign them.
    # The sum is decoded over the server's state itself where the backend allows (no new
    # buffer of D / n elements: a fresh one of 63 MB cost 3-4 ms of page faults per call).
    def server_stage():
        averaged = worker_scales * (1.0 / n)
        if server_scale is None:  # DeepSpeed's form: the residual is the state
            compensated = unpack_scaled_sum(B, received, averaged, chunks, chunk,
                                            base=server_error, out=server_error)
            scale = rms_scales(B, compensated, None, chunks)
            server_bits, new_error = sign_pack_residual(B, compensated, None, scale, chunks,
                                                        out=server_error)
            return server_bits, new_error, scale, scale
        # Compensated form: c_s is the new state, and its sums and signs are taken in the
        # decode's pass, while each block is still in the cache.
        compensated, sums, server_bits = unpack_sums_signs(
            B, received, averaged, chunks, chunk, base=server_error, base_scales=server_scale,
            out=server_error, squares=True)
        scale = rms_scales(B, compensated, None, chunks, sums=sums)
        return server_bits, compensated, scale, scale

    kept_scale = B.zeros(len(counts)) if server_scale is None else server_scale
    server_bits, server_error, server_scale_sent, server_scale = B.cond(
        finite, server_stage,
        lambda: (B.zeros(packed_sign_bytes(chunk), "uint8"), server_error, B.zeros(len(counts)),
                 kept_scale))

    # Phase 3: every rank gathers every chunk's signs and scales, and decodes them. One
    # allgather carries both (each rank's scales as 4 bytes per tensor after its signs):
    # two gathers of different dtypes ran one after the other in Horovod, and the second
    # added 1-2 ms to every bucket on the emulated 10 Gbit/s link (profiled 2026-11-26).
    # The worker error is written in the decode's pass (fused primitive
    # unpack_sum_residual), which reads x and the error once where a residual pass while
    # the gather travelled read them once more; with one core per rank (several ranks per
    # host) that pass took its CPU from the backward pass, not from idle time.
    row = with_scales(B, B.reshape(server_bits, (1, width)), 1, server_scale_sent)
    all_bits, server_scales = split_scales(
        B, start_allgather(comm, row, f"{name}.server_signs").wait(), n, width, len(counts))
    note_scales(comm, B, server_scales)

    def decode():
        tensor_bits, tensor_scales = _tensor_major(B, all_bits, server_scales, chunks, n)
        per_chunk = [c for c in chunks for _ in range(n)]
        # The worker's scale of each tensor, once per chunk of it: the decode's segments.
        own = B.reshape(B.concat_columns([B.reshape(worker_scale, (-1, 1))] * n), (-1,))
        into = out if total == d else None  # padded: decoded into a buffer of its own
        mean, new_error = unpack_sum_residual(B, tensor_bits, tensor_scales, per_chunk, total, buf,
                                              worker_error, own, out=into, resid_out=worker_error)
        return _unpad_tensors(B, mean, counts, padded), new_error

    result, worker_error = B.cond(finite, decode, lambda: (B.full(d, float("nan")), worker_error))
    return result, worker_error, server_error, server_scale, finite


def gathered_allreduce(B, comm, x, worker_error, name, counts=None, out=None):
    """The worker stage of :func:`compressed_allreduce`, then one allgather of every rank's
    signs and scales, and the exact average of the ``n`` scaled signs on every rank: the
    server stage's ``c_s`` with no server error and no second sign.

    One collective instead of two, for small buffers at many ranks (the layout
    ``OnebitCompressor(layout="auto")`` picks by :func:`~hvd_quant.core.ring.gathers`):
    each rank receives ``(n - 1) (D / 8 + 4 T)`` bytes, against about twice ``D / 8`` in
    the two stages, and saves one collective's latency, which at 16 ranks cost more than
    the whole buffer's bytes (docs/benchmarks/scaling.md). The worker keeps its error
    feedback, padding and RMS scales exactly as in the two stages; the estimate is closer
    to the mean than the two stages' (it is never re-signed), so the server has nothing
    to carry and its state is not touched. Every rank decodes the same rows in rank order:
    bit-identical results.

    Parameters and returns as :func:`compressed_allreduce` without ``server_error``:
    ``(out, worker_error, finite)``; a non-finite step leaves the worker error as it was.
    """
    n, d = comm.size, B.numel(x)
    counts, padded, buf = _padded_input(B, x, counts, n)
    total = sum(padded)

    # Phase 1 (worker): sums of squares and sign bits in one pass, as in the two stages.
    sums, bits = compensate_sums_signs(B, buf, worker_error, padded, squares=True)
    worker_scale = rms_scales(B, buf, worker_error, padded, sums=sums)

    # Phase 2: one allgather of every rank's signs with its scales after them; the scales
    # say whether every rank's step is finite before the error buffer changes.
    width = packed_sign_bytes(total)
    row = with_scales(B, B.reshape(bits, (1, width)), 1, worker_scale)
    all_bits, worker_scales = split_scales(
        B, start_allgather(comm, row, f"{name}.gather").wait(), n, width, len(counts))
    finite = B.all_finite(worker_scales)

    # Phase 3: sum_r (sigma_w[r] / n) * sign_r in rank order (DeepSpeed's server average,
    # over the whole buffer) and the new worker error, in one pass.
    def decode():
        into = out if total == d else None
        mean, new_error = unpack_sum_residual(B, all_bits, worker_scales * (1.0 / n), padded, total, buf,
                                              worker_error, worker_scale, out=into,
                                              resid_out=worker_error)
        return _unpad_tensors(B, mean, counts, padded), new_error

    result, worker_error = B.cond(finite, decode, lambda: (B.full(d, float("nan")), worker_error))
    return result, worker_error, finite


def gathered_allreduce_bytes(numel, world_size):
    """Bytes one rank sends in :func:`gathered_allreduce` (WireMeter cost model)."""
    n = world_size
    if n == 1:
        return 0.0
    tensors = 1 if isinstance(numel, int) else len(numel)
    return (n - 1) * (padded_size(numel, n) // 8 + 4.0 * tensors)


def _padded_input(B, x, counts, n):
    """``(counts, padded sizes, x padded)``: the tensor sizes of ``x`` (``[d]`` when None,
    checked to add up to ``d``), each padded by DeepSpeed's rule for ``n`` ranks."""
    d = B.numel(x)
    counts = [d] if counts is None else [int(c) for c in counts]
    if sum(counts) != d:
        raise ValueError(f"tensor sizes {counts} do not add up to the buffer's {d} elements")
    padded = [padded_size(c, n) for c in counts]
    return counts, padded, _pad_tensors(B, x, counts, padded)


def _pad_tensors(B, x, counts, padded):
    """Each tensor of ``x`` followed by its zero padding (``x`` itself, not a copy, when no
    tensor needs any: e.g. at 2 ranks for sizes that are multiples of 16)."""
    if list(counts) == list(padded):
        return x
    if len(counts) == 1:
        return B.pad(x, padded[0] - counts[0])
    parts, offset = [], 0
    for c, p in zip(counts, padded):
        parts.append(B.pad(B.slice(x, offset, offset + c), p - c))
        offset += c
    return B.concat(parts)


def _unpad_tensors(B, y, counts, padded):
    """Inverse of :func:`_pad_tensors`."""
    if list(counts) == list(padded):  # nothing was padded (y may be the caller's out)
        return y
    if len(counts) == 1:
        return B.slice(y, 0, counts[0])
    parts, offset = [], 0
    for c, p in zip(counts, padded):
        parts.append(B.slice(y, offset, offset + c))
        offset += p
    return B.concat(parts)


def _rank_major(B, bits, chunks, n):
    """Packed signs in tensor order (tensor i: n chunks of ``chunks[i] / 8`` bytes) to
    rank order (chunk r of every tensor, then chunk r + 1...). Bytes only: 1/32 of the
    buffer's size."""
    if len(chunks) == 1:
        return bits
    columns, offset = [], 0
    for c in chunks:
        columns.append(B.reshape(B.slice(bits, offset, offset + n * (c // 8)), (n, c // 8)))
        offset += n * (c // 8)
    return B.reshape(B.concat_columns(columns), (-1,))


def _tensor_major(B, bits, scales, chunks, n):
    """Inverse of :func:`_rank_major` for the gathered server signs, and their scales
    (``n`` rows of one scale per tensor) in the same order."""
    if len(chunks) == 1:
        return bits, scales
    rows = B.reshape(bits, (n, -1))
    scale_rows = B.reshape(scales, (n, len(chunks)))
    out_bits, out_scales, offset = [], [], 0
    for i, c in enumerate(chunks):
        out_bits.append(B.reshape(B.slice_columns(rows, offset, offset + c // 8), (-1,)))
        out_scales.append(B.reshape(B.slice_columns(scale_rows, i, i + 1), (-1,)))
        offset += c // 8
    return B.concat(out_bits), B.concat(out_scales)


def compressed_allreduce_bytes(numel, world_size):
    """Bytes one rank sends in :func:`compressed_allreduce` (WireMeter cost model).
    ``numel``: the buffer's size, or the list of its tensors' sizes (``counts``)."""
    n = world_size
    if n == 1:
        return 0.0
    total = padded_size(numel, n)
    tensors = 1 if isinstance(numel, int) else len(numel)
    return ((n - 1) / n * (total // 8)      # alltoall of the worker signs
            + (n - 1) * (total // n // 8)   # allgather of the server signs
            + 2 * (n - 1) * 4.0 * tensors)  # the float32 scales, one per tensor in each
