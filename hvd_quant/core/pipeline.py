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
    still covers the whole buffer first, so the quantization grid is unchanged. Each
    method's chunked path lives with the method
    (:meth:`~hvd_quant.core.compressor.Compressor.reduce_chunked`, e.g.
    :mod:`hvd_quant.compressors.ef_sign` and :mod:`hvd_quant.compressors.global_qsgd`),
    built on :func:`pipelined`; compressors that do not declare
    :attr:`~hvd_quant.core.compressor.Compressor.chunkable` run their own ``reduce``
    (see :func:`supports_chunking`).

Asynchronous collectives: a communicator may offer ``allgather_async(x, name)``,
``alltoall_async(x, name)`` and ``allreduce_async(x, op, name)`` returning a handle with
``wait()`` (:func:`start_allgather`, :func:`start_alltoall`, :func:`start_allreduce`);
without them (the thread-world oracle) the collective runs eagerly and the handle only
returns its result, which keeps the results the same.
"""

import threading

from .packing import packed_sign_bytes


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


def supports_chunking(compressor):
    """True when :func:`chunked_reduce` pipelines this compressor's buffer: the
    compressor says so (:attr:`~hvd_quant.core.compressor.Compressor.chunkable`) and
    implements :meth:`~hvd_quant.core.compressor.Compressor.reduce_chunked`.

    Methods whose reduction is a chain of hops (ring, torus) overlap through
    :class:`BucketPipeline` instead: their per-hop draws are indexed by position within a
    hop's chunk; and a method whose second stage needs every rank's whole chunk first
    (an alltoall) has nothing to start early."""
    return bool(getattr(compressor, "chunkable", False))


def chunk_bounds(numel, chunk_numel):
    """``[(start, stop)]`` covering ``numel`` elements in chunks of ``chunk_numel``
    rounded up to a multiple of 8 (so packed sign bytes never straddle two chunks)."""
    step = max(8, -(-int(chunk_numel) // 8) * 8)
    return [(a, min(numel, a + step)) for a in range(0, numel, step)]


def chunked_reduce(runner, flat, comm, group, segments, chunk_numel, out=None):
    """``runner.reduce(flat, comm, group, segments, out)``, pipelined in chunks of about
    ``chunk_numel`` elements where the compressor supports it (otherwise the plain
    reduction). Same result, same state."""
    compressor = runner.compressor
    d = runner.backend.numel(flat)
    if not chunk_numel or not supports_chunking(compressor) or d <= chunk_numel:
        return runner.reduce(flat, comm, group, segments, out=out)
    ctx = runner.context(comm, group, segments, out=out)
    return compressor.reduce_chunked(flat, ctx, chunk_bounds(d, chunk_numel))


def pipelined(nchunks, start, finish):
    """The software pipeline of a chunked reduction: ``start(k)`` encodes chunk ``k`` and
    starts its collective, returning a handle; ``finish(k, handle)`` waits for it and
    decodes. Chunk ``k + 1`` is started before chunk ``k`` is finished, so one chunk is
    on the wire while the next is encoded and the previous one decoded; every rank
    issues the chunks' collectives in index order."""
    pending = start(0)
    for k in range(1, nchunks):
        started = start(k)
        finish(k - 1, pending)
        pending = started
    finish(nchunks - 1, pending)


def packed_chunk_bytes(chunks):
    """Bytes of the packed signs of each chunk (for tests and cost models)."""
    return [packed_sign_bytes(b - a) for a, b in chunks]
