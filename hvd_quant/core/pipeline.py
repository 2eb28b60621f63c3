"""Overlap: reduce fused buckets while backward runs, and pipeline chunks of one buffer.

Two mechanisms, both framework-agnostic (the torch optimizer and the compressors use
them):

:class:`BucketPipeline`
    One worker thread per owner reduces buckets ``0, 1, ..., B-1`` *in index order*, each
    as soon as it has been launched (its gradients are ready) and every earlier bucket
    is done. Readiness differs between ranks (a parameter unused on one rank, a slower
    layer), index order does not: every rank issues the same collectives, in the same
    order, with the same names, and draws its random stream in the same order as the
    step-time path that reduces groups ``0 .. B-1`` one after the other. That is what
    makes the overlapped result bit-identical to the unbucketed one, for every
    compressor, including those whose reduction is a chain of dependent collectives
    (ring and torus methods), which could not be expressed as independent async handles.
    Horovod collectives may be called from any thread (Horovod's own background thread
    does the work and the wait releases the GIL).

:func:`chunked_reduce`
    Inside one buffer: start chunk ``k``'s collective asynchronously, then encode chunk
    ``k + 1`` (and decode chunk ``k - 1``) while it is on the wire. The scale collective
    still covers the whole buffer first, so the quantization grid is unchanged.
    Implemented for ``ef_sign`` (bit-identical to the unchunked method: the per-segment
    scales come from the whole buffer, chunk boundaries fall on multiples of 8
    elements so the packed bytes are the same bytes, and encoding and decoding are
    element-wise), and for ``global_qsgd`` (the integer allreduce in chunks: the scale
    collective and the random call's key cover the whole buffer, and chunk ``k``
    quantizes with the draws of its own element indices, so every level, and the sum,
    is bit-identical to the unchunked method). Other compressors fall back to their own
    ``reduce`` (see :func:`supports_chunking`).

Asynchronous collectives: a communicator may offer ``allgather_async(x, name)``,
``alltoall_async(x, name)`` and ``allreduce_async(x, op, name)`` returning a handle with
``wait()`` (:func:`start_allgather`, :func:`start_alltoall`, :func:`start_allreduce`);
without them (the thread-world oracle) the collective runs eagerly and the handle only
returns its result, which keeps the results the same.
"""

import threading

import numpy as np

from .packing import packed_sign_bytes, sign_pack_residual, unpack_scaled_sum
from .segments import compensate_sums, segment_bounds, segment_means


# --- bucket pipeline -----------------------------------------------------------------------
class BucketPipeline:
    """Reduces ``nbuckets`` buckets per round on one worker thread, in index order.

    ``reduce_bucket(b)`` does the whole reduction of bucket ``b`` (it reads the gradients
    and runs the collectives) and returns its result. :meth:`launch` marks a bucket ready
    (from a gradient hook, during backward); :meth:`wait_all` launches the ones that were
    not (parameters without gradients this step), waits for the round and returns the
    results in bucket order, re-raising the first error of the round. After an error the
    rest of the round is skipped: every rank raises together when the error is a
    cross-rank check (:class:`~hvd_quant.core.runner.RankDisagreement`).

    The worker thread lives for one round: it is started by the round's first launch and
    ends when the round's last bucket is reduced. A thread that waited between rounds
    would keep ``reduce_bucket`` (and so its optimizer, model and buffers) alive for as
    long as the process runs, even after the optimizer is dropped.
    """

    def __init__(self, nbuckets, reduce_bucket, name="hvd_quant-buckets"):
        self.nbuckets = int(nbuckets)
        self._reduce = reduce_bucket
        self._name = name
        self._cv = threading.Condition()
        self._running = False  # a worker thread is in its loop (set and cleared under _cv)
        self._closed = False
        self._reset()

    def _reset(self):
        self._ready = [False] * self.nbuckets
        self._results = [None] * self.nbuckets
        self._next = 0      # the bucket the worker reduces next
        self._error = None
        self._active = False  # a bucket of this round has been launched

    @property
    def active(self):
        """True between the first launch of a round and :meth:`wait_all`."""
        return self._active

    def launched(self, b):
        return self._ready[b]

    def launch(self, b):
        with self._cv:
            if self._ready[b]:
                return
            self._ready[b] = True
            self._active = True
            self._start()
            self._cv.notify_all()

    def _start(self):
        # Under _cv. _running, not is_alive(): a worker that has decided to end but not yet
        # ended must not be counted on for the next round.
        if not self._running:
            self._running = True
            threading.Thread(target=self._work, name=self._name, daemon=True).start()

    def _work(self):
        while True:
            with self._cv:
                while not self._closed and self._next < self.nbuckets and not self._ready[self._next]:
                    self._cv.wait()
                if self._closed or self._next >= self.nbuckets:  # the round is done
                    self._running = False
                    return
                b, failed = self._next, self._error is not None
            result = None
            if not failed:
                try:
                    result = self._reduce(b)
                except BaseException as exc:  # noqa: B902 - re-raised by wait_all
                    with self._cv:
                        self._error = exc
            with self._cv:
                self._results[b] = result
                self._next = b + 1
                self._cv.notify_all()
                if self._next >= self.nbuckets:  # decided under the lock that wait_all resets under
                    self._running = False
                    return

    def wait_all(self):
        """Launch every bucket not yet launched, wait for the round, return the results."""
        with self._cv:
            for b in range(self.nbuckets):
                self._ready[b] = True
            if self._next < self.nbuckets:
                self._start()
            self._cv.notify_all()
            while self._next < self.nbuckets:
                self._cv.wait()
            results, error = self._results, self._error
            self._reset()
        if error is not None:
            raise error
        return results

    def abandon(self):
        """End the round without reducing the buckets not started yet (no collectives are
        issued for them); waits for the one in progress, if any. Errors are dropped."""
        with self._cv:
            if self._error is None:
                self._error = RuntimeError("round abandoned")
            for b in range(self.nbuckets):
                self._ready[b] = True
            if self._running:
                self._cv.notify_all()
                while self._next < self.nbuckets:
                    self._cv.wait()
            self._reset()

    def close(self):
        with self._cv:
            self._closed = True
            self._cv.notify_all()


# --- chunk pipelining inside one buffer ----------------------------------------------------
class _Done:
    """The handle of a collective that already ran (communicators without async ops)."""

    def __init__(self, value):
        self._value = value

    def wait(self):
        return self._value


def start_allgather(comm, x, name):
    if hasattr(comm, "allgather_async"):
        return comm.allgather_async(x, name)
    return _Done(comm.allgather(x, name))


def start_alltoall(comm, x, name):
    if hasattr(comm, "alltoall_async"):
        return comm.alltoall_async(x, name)
    return _Done(comm.alltoall(x, name))


def start_allreduce(comm, x, op, name):
    if hasattr(comm, "allreduce_async"):
        return comm.allreduce_async(x, op, name)
    return _Done(comm.allreduce(x, op, name))


#: Compressors (by class name) that :func:`chunked_reduce` pipelines.
_CHUNKED = {"EFSignCompressor": "ef_sign", "GlobalQSGDCompressor": "global_qsgd"}


def supports_chunking(compressor):
    """True when :func:`chunked_reduce` pipelines this compressor's buffer.

    * ``ef_sign`` and ``global_qsgd``: yes, bit-identical to unchunked (module docstring).
    * ring/torus methods (``marsit``, ``cascading_sign``, ``global_qsgd_exp``): their
      reduction is a chain of hops, and Marsit's and exponential dithering's per-hop
      draws are indexed by position within a hop's chunk; they overlap through
      :class:`BucketPipeline` instead.
    * ``onebit``: its server stage needs every rank's whole chunk (alltoall) first.
    """
    name = _CHUNKED.get(type(compressor).__name__)
    return name is not None and name == getattr(compressor, "name", None)


def chunk_bounds(numel, chunk_numel):
    """``[(start, stop)]`` covering ``numel`` elements in chunks of ``chunk_numel``
    rounded up to a multiple of 8 (so packed sign bytes never straddle two chunks)."""
    step = max(8, -(-int(chunk_numel) // 8) * 8)
    return [(a, min(numel, a + step)) for a in range(0, numel, step)]


def _chunk_segments(counts, a, b):
    """``(segment indices, counts within [a, b))`` of the non-empty segments overlapping
    the element range ``[a, b)``."""
    bounds = segment_bounds(counts)
    idx, sub = [], []
    for s in range(len(counts)):
        lo, hi = max(a, int(bounds[s])), min(b, int(bounds[s + 1]))
        if hi > lo:
            idx.append(s)
            sub.append(hi - lo)
    return idx, sub


def chunked_reduce(runner, flat, comm, group, segments, chunk_numel, out=None):
    """``runner.reduce(flat, comm, group, segments, out)``, pipelined in chunks of about
    ``chunk_numel`` elements where the compressor supports it (otherwise the plain
    reduction). Same result, same state."""
    compressor = runner.compressor
    d = runner.backend.numel(flat)
    if not chunk_numel or not supports_chunking(compressor) or d <= chunk_numel:
        return runner.reduce(flat, comm, group, segments, out=out)
    ctx = runner.context(comm, group, segments, out=out)
    if compressor.name == "global_qsgd":
        return _global_qsgd_chunked(flat, ctx, compressor, chunk_bounds(d, chunk_numel))
    return _ef_sign_chunked(flat, ctx, chunk_bounds(d, chunk_numel))


def _ef_sign_chunked(x, ctx, chunks):
    """EF-SignSGD (:mod:`hvd_quant.compressors.ef_sign`) with the sign allgather cut into
    chunks: pack chunk ``k + 1`` and decode chunk ``k - 1`` while chunk ``k`` travels."""
    B, comm = ctx.backend, ctx.comm
    d, n = B.numel(x), comm.size
    counts = [c for _, c in ctx.segments]
    nseg = len(counts)
    residual = ctx.state.get("residual")

    # Phases 1-2 over the whole buffer, exactly as unchunked: per-segment scales, then
    # every rank's scales by allgather (the finite verdict comes with them).
    scales = segment_means(B, compensate_sums(B, x, residual, counts), counts)
    all_scales = comm.allgather(scales, ctx.collective_name("scales"))
    if not bool(B.to_numpy(B.all_finite(all_scales))):
        return B.full(d, float("nan"))  # every rank sees the same scales: residual kept

    own = B.to_numpy(scales)
    rows = B.to_numpy(all_scales).reshape(n, nseg) / np.float32(n)  # as unchunked: scale / n
    in_place = B.kernel("sign_pack_residual", x, residual, scales) is not None
    decode = B.kernel("unpack_scaled_sum", B.zeros(0, "uint8"), scales)
    out = (ctx.out if ctx.out is not None else B.zeros(d)) if decode is not None else None
    pieces, new_residual = [], []

    def encode(k):
        a, b = chunks[k]
        idx, sub = _chunk_segments(counts, a, b)
        r_slice = B.slice(residual, a, b)
        bits, res = sign_pack_residual(B, B.slice(x, a, b), r_slice,
                                       B.constant(own[idx], "float32"), sub, out=r_slice)
        if not in_place:
            new_residual.append(res)
        return start_allgather(comm, bits, ctx.collective_name(f"signs.c{k}")), idx, sub

    def finish(k, handle, idx, sub):
        a, b = chunks[k]
        all_bits = handle.wait()
        chunk_scales = B.constant(np.ascontiguousarray(rows[:, idx]).reshape(-1), "float32")
        if decode is not None:
            decode(all_bits, chunk_scales, segment_bounds(sub), b - a, out=B.slice(out, a, b))
        else:
            pieces.append(unpack_scaled_sum(B, all_bits, chunk_scales, sub, b - a))

    pending = encode(0)
    for k in range(1, len(chunks)):
        started = encode(k)
        finish(k - 1, *pending)
        pending = started
    finish(len(chunks) - 1, *pending)
    if not in_place:
        ctx.state.set("residual", B.concat(new_residual))
    else:
        ctx.state.set("residual", residual)
    return out if out is not None else B.concat(pieces)


def _global_qsgd_chunked(x, ctx, compressor, chunks):
    """Global-QSGD (:mod:`hvd_quant.compressors.global_qsgd`) with the integer allreduce
    cut into chunks: quantize chunk ``k + 1`` and dequantize chunk ``k - 1`` while chunk
    ``k``'s sum is on the wire. Chunk bounds are multiples of 8 elements, so of the lanes
    per int32 word; every chunk uses the one random call of the buffer at its own
    element indices."""
    from ..compressors.global_qsgd import dequantize, global_scale, quantize  # no import cycle

    B, comm = ctx.backend, ctx.comm
    d = B.numel(x)
    width, levels = compressor.resolve(comm.size)
    # Phase 1 over the whole buffer, as unchunked: the scale and the finite verdict.
    scale, pre, finite = global_scale(B, comm, x, compressor.norm, ctx.collective_name("scale"))
    key = ctx.rng.next_key(B)  # the unchunked method's one call, bad step or not
    if not bool(B.to_numpy(finite)):
        return B.full(d, float("nan"))  # every rank has the same verdict: no chunk is sent
    # Chunks are dequantized straight into ctx.out when the fused kernel writes there
    # and no rescaling follows (pre == 1, i.e. not near the float32 maximum).
    native = f"int{width}" in comm.allreduce_int_dtypes
    out = ctx.out if (ctx.out is not None and B.item(pre) >= 1.0 and B.kernel(
        "dequantize_ints" if native else "dequantize_lanes", x) is not None) else None
    pieces = []

    def start(k):
        a, b = chunks[k]
        wire = quantize(B, comm, B.slice(x, a, b), scale, pre, levels, width, key=key, first=a)
        return start_allreduce(comm, wire, "sum", ctx.collective_name(f"levels.c{k}"))

    def finish(k, handle):
        a, b = chunks[k]
        into = B.slice(out, a, b) if out is not None else None
        piece = dequantize(B, comm, handle.wait(), b - a, scale, pre, levels, width, into=into)
        if out is None:  # otherwise the piece is already in place
            pieces.append(piece)

    pending = start(0)
    for k in range(1, len(chunks)):
        started = start(k)
        finish(k - 1, pending)
        pending = started
    finish(len(chunks) - 1, pending)
    return out if out is not None else B.concat(pieces)


def packed_chunk_bytes(chunks):
    """Bytes of the packed signs of each chunk (for tests and cost models)."""
    return [packed_sign_bytes(b - a) for a, b in chunks]
