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

   ``alltoall``: chunk ``j`` of every rank goes to rank ``j``; ``allgather`` of ``sigma_w``.
2. **server** (rank ``j`` owns chunk ``j``)::

       c_s      = sum_r (sigma_w[r] * (1/n)) * sign_r[chunk j] + e_server   (rows in rank order)
       sigma_s  = ||c_s||_2 / sqrt(D / n)
       e_server = c_s - sigma_s * sign(c_s)
       bits_s   = packbits(c_s >= 0)

   ``allgather`` of ``bits_s`` and of ``sigma_s``.
3. **output**, identical on every rank: chunk ``j`` is ``sigma_s[j] * sign(bits_s[j])``,
   cut back to ``d`` elements.

Bytes sent per rank (the :class:`~hvd_quant.core.comm.WireMeter` cost model): the
alltoall ``(n - 1) / n * D / 8``, the server allgather ``(n - 1) * D / (8 n)``, and two
allgathers of one float32: about ``2 (n - 1) / n * D / 8``, 32 times less than an fp32
allreduce's ``2 (n - 1) / n * 4 D``.

Non-finite input: a rank whose ``c`` holds inf or NaN has a non-finite ``sigma_w``; the
scales are gathered before any error buffer changes, so every rank sees it, leaves both
error buffers exactly as they were, and returns NaN for the whole buffer. (DeepSpeed
gathers the scales after the sign alltoall; the order of independent collectives does
not change any result.)
"""

import math

import numpy as np

from .packing import packed_sign_bytes, sign_pack_residual, unpack_scaled_sum
from .segments import compensate_sums

FLOAT32_MAX = float(np.finfo(np.float32).max)


def padded_size(numel, world_size):
    """``numel`` rounded up to a multiple of ``n * lcm(n, 8)`` (DeepSpeed's padding)."""
    unit = world_size * (world_size * 8 // math.gcd(world_size, 8))
    return numel + (-numel) % unit


def rms_scale(B, x, e, numel):
    """float32 ``||x + e||_2 / sqrt(numel)``: the sum of squares is taken in float64 (no
    overflow, no lost digits), then, as DeepSpeed's ``torch.linalg.norm(b) /
    np.sqrt(b.numel())`` on a float32 tensor, the float32 norm is divided by
    ``float32(sqrt(numel))``. Where the norm itself exceeds the float32 range (values near
    the float32 maximum, where DeepSpeed's norm overflows to inf) the division is done in
    float64 first."""
    norm = B.sqrt(compensate_sums(B, x, e, [B.numel(x)], squares=True))
    root = math.sqrt(max(numel, 1))
    as_deepspeed = B.cast(norm, "float32") / float(np.float32(root))
    return B.where(B.less(norm, B.full(1, FLOAT32_MAX, "float64")), as_deepspeed,
                   B.cast(norm / root, "float32"))


def compressed_allreduce(B, comm, x, worker_error, server_error, name):
    """Average the flat float32 ``x`` over ``comm``'s ranks at 1 bit per element.

    Parameters
    ----------
    B : Backend
    comm : Communicator
    x : float32 tensor of ``d`` elements
    worker_error : float32 tensor of ``padded_size(d, n)`` elements (this rank's state)
    server_error : float32 tensor of ``padded_size(d, n) // n`` elements
    name : str
        Prefix of the collective names, identical on every rank.

    Returns
    -------
    out : float32 tensor of ``d`` elements, identical on every rank
    worker_error, server_error : the updated error buffers (updated in place where the
        backend allows; always use the returned ones)
    finite : boolean scalar tensor, False when any rank's input was not finite
    """
    n, d = comm.size, B.numel(x)
    total = padded_size(d, n)
    chunk = total // n
    buf = B.pad(x, total - d)

    # Phase 1 (worker): RMS scale, gathered first so every rank knows if the step is finite.
    worker_scale = B.reshape(rms_scale(B, buf, worker_error, total), (1,))
    worker_scales = comm.allgather(worker_scale, f"{name}.worker_scale")
    finite = B.all_finite(worker_scales)
    bits, worker_error = B.cond(
        finite, lambda: sign_pack_residual(B, buf, worker_error, worker_scale, [total], out=worker_error),
        lambda: (B.zeros(packed_sign_bytes(total), "uint8"), worker_error))
    received = comm.alltoall(bits, f"{name}.worker_signs")  # n rows: every rank's signs of my chunk

    # Phase 2 (server): average this rank's chunk, add the server error, re-sign it.
    def server_stage():
        compensated = unpack_scaled_sum(B, received, worker_scales * (1.0 / n), [chunk], chunk,
                                        base=server_error)
        scale = B.reshape(rms_scale(B, compensated, None, chunk), (1,))
        server_bits, new_error = sign_pack_residual(B, compensated, None, scale, [chunk], out=server_error)
        return server_bits, new_error, scale

    server_bits, server_error, server_scale = B.cond(
        finite, server_stage,
        lambda: (B.zeros(packed_sign_bytes(chunk), "uint8"), server_error, B.zeros(1)))

    # Phase 3: every rank gathers every chunk's signs and scale, and decodes them.
    all_bits = comm.allgather(server_bits, f"{name}.server_signs")
    server_scales = comm.allgather(server_scale, f"{name}.server_scale")
    out = B.cond(finite,
                 lambda: B.slice(unpack_scaled_sum(B, all_bits, server_scales, [chunk] * n, total), 0, d),
                 lambda: B.full(d, float("nan")))
    return out, worker_error, server_error, finite


def compressed_allreduce_bytes(numel, world_size):
    """Bytes one rank sends in :func:`compressed_allreduce` (WireMeter cost model)."""
    n = world_size
    if n == 1:
        return 0.0
    total = padded_size(numel, n)
    return ((n - 1) / n * (total // 8)      # alltoall of the worker signs
            + (n - 1) * (total // n // 8)   # allgather of the server signs
            + 2 * (n - 1) * 4.0)            # allgathers of the two float32 scales
