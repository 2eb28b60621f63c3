"""What compression does while training: bytes, phase times, residuals and probe errors.

One owner (an optimizer; see :mod:`hvd_quant.core.handle`) holds one :class:`OwnerMetrics`
when it turns metrics on (``CompressorRunner.observe``); the runner feeds it each
reduction of a buffer ("bucket") through :meth:`OwnerMetrics.measure`, and the adapter
feeds it the step's own times (:meth:`OwnerMetrics.record_step`). Every figure, its unit
and where it comes from is declared once, in the tables below (:data:`STEP_FIGURES`,
:data:`PROBE_FIGURES`, :data:`OWNER_FIGURES`, :data:`DERIVED`), and users read them all
with :meth:`OwnerMetrics.snapshot`, a dict of plain numbers (``opt.metrics()``).

The phases of one reduction
---------------------------
The reduction runs on a :class:`TimedComm`, which wraps the owner's communicator and
tells a :class:`PhaseClock` when each collective starts and returns (an asynchronous
collective's start and its ``wait()`` alike). From those instants, after the fact:

* ``wait_s``: time inside collectives (on the wire, or waiting for the slowest rank);
* ``encode_s``: the reduction's own work until its last collective starts (compress,
  pack; for methods of several rounds, the work between them: a ring's hops);
* ``decode_s``: the work after the last collective returns (unpack, average, write).

With a profiler running, each of these stretches is a named range
(``hvd_quant/encode``, ``hvd_quant/wait``, ``hvd_quant/decode``), opened through the
``ranges`` factory the adapter passes (``torch.profiler.record_function``). A stretch's
name is chosen when it opens, so "decode" is recognised by the number of collectives the
bucket issued the step before: on a bucket's first step every stretch after a collective
is named ``hvd_quant/decode``; the times are exact on every step. On a GPU these are the
host's times (the kernels run asynchronously); staged collectives wait for the device.

Probe steps
-----------
Every ``probe_every`` reductions of a bucket (the ``probe_every``-th, ``2 * probe_every``-th,
...; ``0``: never), the owner pays for an exact answer. Before the reduction one fp32
reduce-scatter of the bucket's gradient (an alltoall named
``hvd_quant.<owner>.<bucket>.probe`` on every rank, issued before the method's own
collectives, and a sum of the blocks received: :func:`exact_mean_shard`) gives each rank
its shard of the exact mean ``g``; after it, with the method's estimate ``ĝ``, one
allgather of six float64 numbers per rank (``...probe.figures``) shares

* ``||ĝ - g||^2``, ``||g||^2``, ``<ĝ, g>`` and ``||ĝ||^2`` over each rank's shard, which
  every rank adds up the same way, so that the relative error ``||ĝ - g|| / ||g||`` and
  the cosine similarity ``<ĝ, g> / (||ĝ|| ||g||)`` are the same number on every rank;
* each rank's ``||x_r||^2`` (its own gradient) and ``||e_r||^2`` (its error-feedback
  residual after the step, for compressors that keep one), averaged over ranks: the
  residual's and the gradient's root mean square over ranks, also the same everywhere.

No rank needs the whole exact mean, so the probe sends half of what an allreduce would:
``(n - 1) / n * 4 d`` bytes more for the bucket's ``d`` elements (until 2026-12-05 it was
an allreduce, twice that), and makes two passes over the bucket (a padded copy and its
norm) and a few over the rank's shard. At 2 ranks that is 16 times what a 1-bit
allgather sends, so ``probe_every=1000`` adds about 1.6% to the bytes of ``ef_sign``.
Non-finite probes (a rank's gradient held inf or NaN) are not recorded.

Every rank takes the same decisions: whether a step probes depends only on how many
times the bucket was reduced (the same on every rank; restarted on every rank by
:meth:`OwnerMetrics.restart` after an elastic reset), and the probe's figures come from
the allgather every rank runs.

The scales a method sends
-------------------------
A method reports the scales its estimate is built from after the collective that brings
them (``ReduceContext.sent_scales`` or :func:`hvd_quant.core.compressor.note_scales`; the
reports ride on the reduction's :class:`PhaseClock`; :data:`SCALE_FIGURES` says which
ones each method reports). They are the same on every rank, since every rank decodes
from them. A growing scale is a growing residual seen from the wire: a sign method's scale
is ``mean|g + e|``, so it follows the error-feedback residual ``e`` once that dominates.

Non-finite steps
----------------
After each reduction, whether the estimate is finite (its sum is: one pass over it, about
5 ms for 8M elements on one core here). A non-finite gradient on any rank makes the reduced gradient non-finite on
every rank (every method here carries it), so the count of such steps, the steps
``torch.amp.GradScaler`` skips, is the same on every rank. The flag is read from the
device lazily (at :meth:`OwnerMetrics.snapshot`, or once 64 are waiting), so a GPU step
gets no extra host synchronisation.
"""

import logging
import math
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace

import numpy as np

from .comm import RoutedGroup, WrappingComm, exchange_blocks, rank_order_sum
from .costmodel import fp32_ring_bytes

log = logging.getLogger("hvd_quant")

#: Default of ``probe_every`` (reductions of a bucket between probes): rare enough to add
#: about 1.6% to a 1-bit method's bytes at 2 ranks (module docstring), often enough to see
#: a drift over a run.
DEFAULT_PROBE_EVERY = 1000

#: Per bucket, every reduction: name -> meaning. Summed over buckets for the owner.
STEP_FIGURES = {
    "bytes_sent": "bytes this rank sent for the reduction (WireMeter's cost model)",
    "fp32_bytes": "bytes an fp32 ring allreduce of the same buffer would send",
    "encode_s": "seconds of the reduction's own work until its last collective",
    "wait_s": "seconds inside collectives",
    "decode_s": "seconds of work after the last collective returned",
    "probe_s": "seconds of the probe's extra collectives and passes (0 off probe steps)",
    "nonfinite": "1 when the reduced gradient held inf or NaN",
    "fallback": "1 when the guard reduced the bucket in fp32 instead of the method",
}
#: Per bucket, probe steps only: the raw sums the probe's allgather shares.
PROBE_FIGURES = {
    "sq_grad": "mean over ranks of ||x_r||^2, each rank's own gradient",
    "sq_residual": "mean over ranks of ||e_r||^2, the error-feedback residual after the step",
    "sq_error": "||g_hat - g||^2, the estimate against the exact fp32 mean",
    "sq_exact": "||g||^2 of the exact fp32 mean",
    "dot": "<g_hat, g>",
    "sq_estimate": "||g_hat||^2",
}
#: Per bucket, the steps whose method reported the scales it sent (``note_scales``):
#: every scale the step's estimate is built from, as every rank holds it after the
#: exchange (``ef_sign``: each rank's ``mean|p|`` per tensor; ``marsit``: the shared
#: ``alpha`` per tensor; ``global_qsgd``: the one global scale; ``onebit`` and the 1-bit
#: optimizers: the worker and server RMS scales; ``qsgd``: each rank's norm). Over
#: buckets ``scale_max`` is the largest, the others are summed.
SCALE_FIGURES = {
    "scale_max": "the largest |scale| sent in the step",
    "scale_sum": "the sum of the |scales| sent in the step",
    "scale_count": "how many scales the step sent",
}
#: Per owner, per step, measured by the adapter around its step.
OWNER_FIGURES = {
    "step_s": "seconds from the previous step's end to this step's end",
    "sync_s": "seconds the step waited for the reductions (synchronize)",
    "update_s": "seconds of the wrapped optimizer's update",
    "rest_s": "step_s - sync_s - update_s: forward, backward, data, the rest",
}
#: Figures derived from the sums above, for a bucket or summed over buckets: a running
#: mean (".mean") is the same function of the sums over every step (a pooled ratio).
DERIVED = {
    "compression_ratio": lambda f: _ratio(f["fp32_bytes"], f["bytes_sent"]),
    "grad_norm": lambda f: _root(f.get("sq_grad")),
    "residual_norm": lambda f: _root(f.get("sq_residual")),
    "residual_ratio": lambda f: _root(_ratio(f.get("sq_residual"), f.get("sq_grad"))),
    "scale_avg": lambda f: _ratio(f.get("scale_sum"), f.get("scale_count")),
    "probe_rel_error": lambda f: _root(_ratio(f.get("sq_error"), f.get("sq_exact"))),
    "probe_cosine": lambda f: _ratio(f.get("dot"), _root(_product(f.get("sq_exact"),
                                                                   f.get("sq_estimate")))),
}
#: Flags waiting to be read from the device before they are read all at once.
MAX_PENDING_FLAGS = 64


def check_probe_every(value):
    """``value`` as an int >= 0, else a ``ValueError`` that says what is allowed."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"probe_every must be a whole number >= 0 (0: no probe steps), got {value!r}")
    return int(value)


def _scale_figures(backend, reported):
    """:data:`SCALE_FIGURES` of one reduction from ``note_scales``' reports (read
    from the device now), or ``{}`` when the method reported none."""
    if not reported:
        return {}
    return {"scale_max": max(float(backend.to_numpy(m)) for m, _, _ in reported),
            "scale_sum": sum(float(backend.to_numpy(t)) for _, t, _ in reported),
            "scale_count": float(sum(c for _, _, c in reported))}


def _ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def _root(a):
    return None if a is None or a < 0 else math.sqrt(a)


def _product(a, b):
    return None if a is None or b is None else a * b


def _sum_squares(B, x):
    """``||x||^2`` as a Python float: one pass with no temporary where the tensor has a
    ``dot`` (numpy, torch), else through the backend."""
    if hasattr(x, "dot"):
        return float(x.dot(x))
    return float(B.to_numpy(B.sum(x * x)))


def _dot(B, x, y):
    if hasattr(x, "dot"):
        return float(x.dot(y))
    return float(B.to_numpy(B.sum(x * y)))


# --- timing one reduction ------------------------------------------------------------------
class PhaseClock:
    """The phases of one reduction (module docstring), from the collectives it issues.

    ``ranges(name)`` returns a context manager that marks a named range for a profiler
    (``None``: no ranges); ``expected`` is the number of collective intervals the bucket
    issued the step before (``None`` on its first step), used only to name the ranges."""

    def __init__(self, ranges=None, expected=None):
        self._ranges = ranges
        self.expected = expected
        self.collectives = 0  # intervals seen: a blocking collective, an async start, a wait
        self.encode_s = self.wait_s = self.decode_s = 0.0
        self._depth = 0  # a collective that issues another through this clock counts once
        self._range = None
        self.scales = []  # the method's reports (compressor.note_scales), read with the flags
        self._mark = time.perf_counter()
        self._switch("hvd_quant/encode")

    def _switch(self, name):
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if name is not None and self._ranges is not None:
            self._range = self._ranges(name)
            self._range.__enter__()

    def begin(self):
        """A collective starts: the work since the last mark was encoding."""
        self._depth += 1
        if self._depth == 1:
            now = time.perf_counter()
            self.encode_s += now - self._mark
            self._mark = now
            self._switch("hvd_quant/wait")

    def end(self):
        """The collective returned: the next stretch is decoding if it was the last one."""
        self._depth -= 1
        if self._depth == 0:
            now = time.perf_counter()
            self.wait_s += now - self._mark
            self._mark = now
            self.collectives += 1
            last = self.expected is None or self.collectives >= self.expected
            self._switch("hvd_quant/decode" if last else "hvd_quant/encode")

    def finish(self):
        """The reduction returned: the work since the last collective was decoding."""
        self.decode_s = time.perf_counter() - self._mark
        self._switch(None)


class TimedComm(WrappingComm):
    """``inner`` with each collective reported to ``clock`` (:class:`PhaseClock`).

    Everything else is ``inner``'s: ``rank``, ``size``, the meter (bytes are counted once,
    by ``inner``), the integer dtypes it sums, its asynchronous collectives where it has
    them (their handles' ``wait()`` timed too) and its sub-groups (timed as well)."""

    _ASYNC = ("allgather_async", "alltoall_async", "allreduce_async")

    _OWN = ("inner", "clock")

    def __init__(self, inner, clock):
        super().__init__(inner)
        self.clock = clock

    def __getattr__(self, name):
        value = super().__getattr__(name)  # AttributeError where inner has no async twin
        if name in self._ASYNC:
            return lambda *args: _TimedHandle(self._timed(value, *args), self.clock)
        return value

    def _timed(self, fn, *args):
        self.clock.begin()
        try:
            return fn(*args)
        finally:
            self.clock.end()

    def allreduce(self, x, op, name):
        return self._timed(self.inner.allreduce, x, op, name)

    def allgather(self, x, name):
        return self._timed(self.inner.allgather, x, name)

    def alltoall(self, x, name):
        return self._timed(self.inner.alltoall, x, name)

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        return self._timed(self.inner.sendrecv, x, dest, source, name, recv_numel)

    def ranks_per_node(self):
        return self.inner.ranks_per_node()

    def subgroups(self, rows):
        # A routed group stays a RoutedGroup (gather_blocks looks for one), routed
        # through this communicator's timed sendrecv.
        return tuple(RoutedGroup(self, sub.members) if isinstance(sub, RoutedGroup)
                     else type(self)(sub, self.clock) for sub in self.inner.subgroups(rows))


def phases_from_instants(start, end, intervals):
    """``(encode_s, wait_s, decode_s)`` of a reduction that ran from ``start`` to ``end``
    with collectives from ``t0`` to ``t1`` for each ``(t0, t1)`` of ``intervals`` (seconds,
    any clock): what :class:`PhaseClock` measures, from instants a compiled reduction
    records (a TensorFlow graph's timestamps). There collectives may overlap (the
    executor runs independent ops at once), so ``wait_s`` is the time at least one
    collective ran, ``decode_s`` the time after the last one returned and ``encode_s`` the
    rest: the three add up to ``end - start``."""
    total = max(0.0, end - start)
    if not intervals:
        return total, 0.0, 0.0
    wait, reach = 0.0, -math.inf
    for t0, t1 in sorted(intervals):
        t0 = max(t0, reach)
        if t1 > t0:
            wait += t1 - t0
            reach = t1
    wait = min(wait, total)
    decode = min(max(0.0, end - max(t1 for _, t1 in intervals)), total - wait)
    return total - wait - decode, wait, decode


def untimed(comm):
    """The communicator behind ``comm``'s :class:`TimedComm` wrappers (``comm`` itself when
    it is not one). A wrapper is made for each reduction, so what keys per-communicator
    state (``auto``'s measured link and choices) must key it by this one, which lives as
    long as its owner."""
    while isinstance(comm, TimedComm):
        comm = comm.inner
    return comm


class _TimedHandle:
    def __init__(self, handle, clock):
        self._handle, self._clock = handle, clock

    def wait(self):
        self._clock.begin()
        try:
            return self._handle.wait()
        finally:
            self._clock.end()


# --- the state: per owner, per bucket ------------------------------------------------------
class BucketMetrics:
    """One bucket's figures: the last reduction's and the sums over all of them.

    ``last`` and ``total`` hold :data:`STEP_FIGURES`; ``last_probe`` and ``probe_total``
    hold :data:`PROBE_FIGURES` (empty until the first probe). ``steps`` counts the
    reductions, ``since_restart`` those since the last elastic restart (probe decisions),
    ``collectives`` the intervals of the last one (range names, :class:`PhaseClock`)."""

    def __init__(self, index, key=None):
        self.index, self.key = index, key
        self.describe = ""  # its size and first tensors, for the guard's warnings
        self.numel = 0  # elements of the buffer (the report's fp32 cost)
        self.steps = self.since_restart = self.probes = 0
        self.collectives = None
        self.fresh = False  # reduced since the owner's last step ended (record_step)
        self.idle = False  # not reduced in the owner's last recorded step
        self.last = dict.fromkeys(STEP_FIGURES, 0.0)
        self.total = dict.fromkeys(STEP_FIGURES, 0.0)
        self.last_probe, self.probe_total = {}, {}
        self.scaled = 0  # reductions whose method reported its scales
        self.last_scale, self.scale_total = {}, {}

    def record(self, figures, probe):
        self.fresh, self.idle = True, False
        self.steps += 1
        self.since_restart += 1
        for k in STEP_FIGURES:
            self.last[k] = float(figures.get(k, 0.0))
            self.total[k] += self.last[k]
        if probe is not None:
            self.probes += 1
            self.last_probe = dict(probe)
            for k, v in probe.items():
                self.probe_total[k] = self.probe_total.get(k, 0.0) + v

    def settled(self, step, nonfinite, scales):
        """Reduction ``step``'s figures read from the device later (:meth:`OwnerMetrics._settle`):
        whether its mean was finite, and :data:`SCALE_FIGURES` (``{}``: none reported).
        They are the last figures only while ``step`` is the latest reduction and the
        owner's last step ran it."""
        if step == self.steps and not self.idle:
            self.last["nonfinite"] = float(nonfinite)
            self.last_scale = dict(scales)
        self.total["nonfinite"] += float(nonfinite)
        if scales:
            self.scaled += 1
            for k in SCALE_FIGURES:
                self.scale_total[k] = self.scale_total.get(k, 0.0) + scales[k]


class OwnerMetrics:
    """One owner's metrics (module docstring): its buckets' :class:`BucketMetrics`, in the
    order they were first reduced, and the owner's step figures (:data:`OWNER_FIGURES`).

    Parameters
    ----------
    probe_every : int
        Reductions of a bucket between probe steps; ``0``: none (:func:`check_probe_every`).
    ranges : callable or None
        ``ranges(name)`` -> context manager marking a profiler range (the adapter's).
    """

    def __init__(self, probe_every=DEFAULT_PROBE_EVERY, ranges=None, guard=None):
        self.probe_every = check_probe_every(probe_every)
        self.ranges = ranges
        self.guard = guard  # hvd_quant.core.guard.Guard, or None (off)
        self.verdict = None  # the adapter's "does it pay" Verdict, once made
        self._rank = 0  # this rank in the owner's communicator (the guard's warnings)
        self.buckets = {}  # group key -> BucketMetrics
        self.steps = 0
        self.last_step = dict.fromkeys(OWNER_FIGURES, 0.0)
        self.step_total = dict.fromkeys(OWNER_FIGURES, 0.0)
        self.timed_steps = 0
        self._step_end = None  # when the adapter's last step ended (record_step)
        self._pending = []  # (bucket, its reduction, the owner's step, flag, backend, scales): not read yet
        self._lock = threading.Lock()  # the bucket worker appends while a snapshot may read
        self.nonfinite_steps = set()  # the owner's steps (_step_number) that held inf/NaN

    def bucket(self, group):
        if group not in self.buckets:
            used = {b.index for b in self.buckets.values()}
            self.buckets[group] = BucketMetrics(min(set(range(len(used) + 1)) - used), group)
        return self.buckets[group]

    def forget(self, group):
        """Drop buffer ``group``'s figures: the owner no longer reduces it (DDP rebuilt its
        buckets after the first step), so its last step must not count in the sums. Its
        number goes to the next new bucket; the guard drops its state too."""
        self.buckets.pop(group, None)
        if self.guard is not None:
            self.guard.forget(group)

    def restart(self):
        """Count reductions towards the next probe from zero on every bucket: after an
        elastic reset, ranks that joined start from zero, so the survivors must too."""
        for b in self.buckets.values():
            b.since_restart = 0
        if self.guard is not None:
            self.guard.restart()

    def probes_now(self, bucket):
        return bool(self.probe_every) and (bucket.since_restart + 1) % self.probe_every == 0

    def measure(self, runner, flat, comm, group, segments, reduce, probing=True, finite=None, finite_of=None):
        """``reduce(comm)``, the reduction of buffer ``group`` (``flat``, made of
        ``segments``) by ``runner``, run on a :class:`TimedComm` and recorded, with a
        probe around it on probe steps (``probing=False``: never, for an exact round).
        Returns the reduction's result. ``finite()``, where given, says whether the
        reduction's inputs were finite on every rank (a result that carries no NaN, such
        as a sum of signs, cannot say it); else whether the result is, by
        ``finite_of(result)`` where given (an adapter that needs the flag itself computes
        it once, for both) or by its sum. ``runner`` is a
        :class:`~hvd_quant.core.runner.CompressorRunner`, or anything with its
        ``backend``, ``collective_prefix(group)`` and ``residual(group, segments, comm)``."""
        B = runner.backend
        bucket = self._reducing(group, int(B.numel(flat)), segments, comm.rank)
        # A bucket the guard reduces in fp32 is exact: no probe, and the method's state
        # and random streams wait untouched (hvd_quant.core.guard).
        fallback = self.guard is not None and self.guard.falling_back(group)
        probe = None
        if probing and self.probes_now(bucket) and not fallback:
            probe = _Probe(B, comm, runner, group, segments, flat, self.ranges)
        bytes_before = comm.meter.bytes_sent
        clock = PhaseClock(self.ranges, None if fallback else bucket.collectives)
        try:
            if fallback:
                name = f"hvd_quant.{runner.collective_prefix(group)}.fallback"
                mean = TimedComm(comm, clock).allreduce(flat, "sum", name) * (1.0 / comm.size)
            else:
                mean = reduce(TimedComm(comm, clock))
        finally:
            clock.finish()
        if not fallback:  # the range names follow the method's own collectives
            bucket.collectives = clock.collectives
        figures = {"bytes_sent": comm.meter.bytes_sent - bytes_before,
                   "fp32_bytes": fp32_ring_bytes(B.numel(flat), comm.size),
                   "encode_s": clock.encode_s, "wait_s": clock.wait_s, "decode_s": clock.decode_s,
                   "fallback": float(fallback)}
        probed = probe.finish(mean) if probe is not None else None
        if probe is not None:
            figures["probe_s"] = probe.seconds
        # The sum, not the elements: one pass with no temporary (a float32 sum overflows
        # only past 3e38, where a gradient is lost anyway).
        if finite is not None and not fallback:
            flag = finite()
        else:
            flag = finite_of(mean) if finite_of is not None else B.all_finite(B.sum(mean))
        self._recorded(bucket, figures, probed, flag, B, clock.scales)
        return mean

    def _reducing(self, group, numel, segments, rank):
        """Buffer ``group``'s :class:`BucketMetrics`, told its size before a reduction."""
        bucket = self.bucket(group)
        bucket.numel = numel
        if not bucket.describe:
            bucket.describe = _describe(numel, segments)
        self._rank = rank
        return bucket

    def _recorded(self, bucket, figures, probed, flag, backend, scales):
        """Record one reduction of ``bucket``: its :data:`STEP_FIGURES` (``figures``), its
        probe's (``probed``, or ``None``), the guard's view of it, and its finiteness
        ``flag`` and ``scales`` (``note_scales``' reports) to read later (:meth:`_settle`)."""
        bucket.record(figures, probed)
        if self.guard is not None:
            rel = DERIVED["probe_rel_error"](probed) if probed is not None else None
            self.guard.reduced(bucket.key, bool(figures.get("fallback")), rel, self._rank, bucket.describe)
        with self._lock:
            self._pending.append((bucket, bucket.steps, self._step_number(bucket), flag, backend, scales))
            waiting = len(self._pending)
        if waiting >= MAX_PENDING_FLAGS:
            self._settle()

    def eager_due(self):
        """Whether the next reduction of some bucket must run as :meth:`measure` runs it,
        eagerly: it is a probe step, or the guard sends it to fp32. A compiled reduction
        (TensorFlow's graph, which times its collectives itself and records them with
        :meth:`record_reduction`) runs on every other step. Buckets not reduced yet probe
        at their first reduction only with ``probe_every=1``. The same on every rank."""
        if not self.buckets:
            return self.probe_every == 1
        return any(self.probes_now(b) or (self.guard is not None and self.guard.falling_back(key))
                   for key, b in self.buckets.items())

    def record_reduction(self, group, segments, numel, rank, size, bytes_sent, phases, flag, backend, scales=()):
        """Record a reduction of buffer ``group`` (``numel`` elements made of ``segments``)
        measured by the adapter, not by :meth:`measure`: a compiled one, on a step where
        :meth:`eager_due` was False (no probe, no fallback). ``phases`` is
        ``(encode_s, wait_s, decode_s)`` (:func:`phases_from_instants`), ``bytes_sent``
        what this rank sent, ``flag`` whether the mean is finite, ``scales`` the method's
        ``note_scales`` reports, as :meth:`measure` records them."""
        bucket = self._reducing(group, int(numel), segments, rank)
        encode_s, wait_s, decode_s = phases
        figures = {"bytes_sent": float(bytes_sent), "fp32_bytes": fp32_ring_bytes(int(numel), size),
                   "encode_s": encode_s, "wait_s": wait_s, "decode_s": decode_s, "fallback": 0.0}
        self._recorded(bucket, figures, None, flag, backend, list(scales))

    def _step_number(self, bucket):
        """The step a reduction of ``bucket`` belongs to: the owner's step in progress
        where the adapter records steps (a 1-bit optimizer's buckets are not all reduced
        every step), else the bucket's reduction count (the same where every bucket is
        reduced every step). The same on every rank."""
        return max(bucket.steps, self.steps + 1)

    def _settle(self):
        """Read the waiting finiteness flags (one host read each on a GPU)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for bucket, reduction, step, flag, B, scales in pending:  # in order: the last one is the latest
            bad = not bool(flag)
            figures = _scale_figures(B, scales)
            bucket.settled(reduction, bad, figures)
            if bad:
                self.nonfinite_steps.add(step)
            if self.guard is not None and figures:
                self.guard.scaled(bucket.key, step, figures["scale_max"], self._rank, bucket.describe)
            if self.guard is not None:
                self.guard.nonfinite(step, bad, self._rank, len(self.nonfinite_steps))

    def reduced_all(self):
        """The adapter has every bucket's mean of this step (its ``synchronize()``): with
        a guard on, read the finiteness flags now, so that its non-finite warning follows
        the steps, also those a loss scaler skips without a ``step()`` (a host read per
        bucket on a GPU, after the step waited for the buckets anyway)."""
        if self.guard is not None:
            self._settle()

    def leave_out(self, seconds):
        """Leave ``seconds`` spent since the last step ended out of the next ``step_s`` (the
        monitoring's own work between steps, such as the report's link measurement)."""
        if self._step_end is not None:
            self._step_end += seconds

    def record_step(self, sync_s, update_s, now=None):
        """The adapter's step ended: ``sync_s`` waiting for reductions, ``update_s`` in the
        update. ``step_s`` runs from the previous step's end (none on the first step). A
        buffer the step did not reduce (a 1-bit optimizer's warm-up round after its
        freeze, 0/1 Adam on a local step) counts zeros as its last figures."""
        now = time.perf_counter() if now is None else now
        previous, self._step_end = self._step_end, now
        self.steps += 1
        for b in self.buckets.values():  # a buffer this step did not reduce sent nothing in it
            if not b.fresh:
                b.last = dict.fromkeys(STEP_FIGURES, 0.0)
                b.last_scale, b.idle = {}, True
            b.fresh = False
        if previous is None:
            return
        step_s = now - previous
        self.last_step = {"step_s": step_s, "sync_s": sync_s, "update_s": update_s,
                          "rest_s": max(0.0, step_s - sync_s - update_s)}
        for k, v in self.last_step.items():
            self.step_total[k] += v
        self.timed_steps += 1

    def reduction_seconds(self):
        """Seconds spent in measured reductions so far (every bucket's encode, wait,
        decode and probe): a step's ``sync_s`` where its reductions run inside the
        update (a 1-bit optimizer's rounds) is the difference across it."""
        return sum(b.total[k] for b in self.buckets.values() for k in ("encode_s", "wait_s", "decode_s", "probe_s"))

    def rule_step_ended(self, started, reductions_before):
        """A 1-bit optimizer's step (its rounds inside the update) ended: record it, its
        ``sync_s`` the rounds' time since ``reductions_before``
        (:meth:`reduction_seconds`), ``update_s`` the rest since ``started``
        (``time.perf_counter()``), and with a guard read the finiteness flags now."""
        rounds = self.reduction_seconds() - reductions_before
        self.record_step(rounds, max(0.0, time.perf_counter() - started - rounds))
        self.reduced_all()

    def snapshot(self):
        """Every figure as a plain number (``None`` where not measured yet): see
        :func:`snapshot_of`."""
        self._settle()
        return snapshot_of(self)


def snapshot_of(owner):
    """``{name: number}``: for each figure ``F`` of :data:`STEP_FIGURES`,
    :data:`PROBE_FIGURES`, :data:`SCALE_FIGURES`, :data:`DERIVED` and
    :data:`OWNER_FIGURES`, ``F`` (the last step, summed over buckets; ``scale_max``: the
    largest) and ``F.mean`` (the mean per step; for derived ratios the pooled ratio of
    all steps' sums), and per bucket ``bucket<i>/F`` and
    ``bucket<i>/F.mean``; plus ``steps``, ``probes`` and ``skipped_steps`` (steps in
    which a bucket's reduced gradient held inf or NaN), ``fallbacks`` (times the guard
    sent a bucket to fp32, :mod:`hvd_quant.core.guard`), ``saves_s`` (seconds per step
    the method saves against fp32 on this link, once the adapter has said so: :func:`pays`)
    and ``saves_most_s`` (the same if fp32 hid none of its reduction behind backward)."""
    buckets = sorted(owner.buckets.values(), key=lambda b: b.index)
    out = {"steps": owner.steps or max((b.steps for b in buckets), default=0),
           "probes": max((b.probes for b in buckets), default=0),
           "skipped_steps": len(owner.nonfinite_steps),
           "fallbacks": owner.guard.fallbacks() if owner.guard is not None else 0,
           "saves_s": owner.verdict.saves_s if owner.verdict is not None else None,
           "saves_most_s": owner.verdict.saves_most_s if owner.verdict is not None else None}
    for b in buckets:
        _put(out, f"bucket{b.index}/", _last(b), _means(b))
    _put(out, "", _summed([_last(b) for b in buckets]), _summed([_means(b) for b in buckets]))
    for k in OWNER_FIGURES:
        out[k] = owner.last_step[k] if owner.timed_steps else None
        out[k + ".mean"] = owner.step_total[k] / owner.timed_steps if owner.timed_steps else None
    return out


def _describe(numel, segments):
    """A bucket in a warning: its size and first tensors."""
    names = [str(n) for n, _ in segments]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{numel:,} elements: {shown}"


def _last(b):
    """A bucket's last figures: its last reduction's, probe's and scales'."""
    return {**b.last, **b.last_probe, **b.last_scale}


def _means(b):
    """A bucket's per-step means of the step sums, per-probe means of the probe sums and
    per-reporting-step means of the scale sums."""
    means = {k: v / b.steps for k, v in b.total.items()} if b.steps else {}
    means.update({k: v / b.probes for k, v in b.probe_total.items()} if b.probes else {})
    means.update({k: v / b.scaled for k, v in b.scale_total.items()} if b.scaled else {})
    return means


def _summed(dicts):
    """Figures over buckets: summed, but for ``scale_max``, the largest."""
    out = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = max(out.get(k, v), v) if k == "scale_max" else out.get(k, 0.0) + v
    return out


def _put(out, prefix, last, mean):
    for name, figures in (("", last), (".mean", mean)):
        for k in list(STEP_FIGURES) + list(PROBE_FIGURES) + list(SCALE_FIGURES):
            out[f"{prefix}{k}{name}"] = figures.get(k)
        for k, derive in DERIVED.items():
            out[f"{prefix}{k}{name}"] = derive(figures) if figures else None


def exact_mean_shard(B, comm, flat, name):
    """This rank's shard of the exact fp32 mean of ``flat`` over ranks, by one
    reduce-scatter: ``(lo, hi, mean[lo:hi])``. The buffer is cut into ``size`` blocks of
    ``ceil(d / size)`` elements (the last padded with zeros), block ``j`` goes to rank
    ``j`` (:func:`~hvd_quant.core.comm.exchange_blocks`, an alltoall) and each rank adds
    the blocks it received in rank order. It sends ``(n - 1) / n`` of the buffer, half
    of what an allreduce that gave every rank the whole mean would. Horovod's own
    reducescatter (over Gloo) was timed as well, in Keras at 2 hosts and 1 Gbit/s, and
    took as long as the allreduce (a probe step's excess 1,281 ms against 1,245; the
    alltoall: 973 against 1,253), though alone it beat the alltoall (729 against 1,015
    ms; not diagnosed): ``benchmarks/reference/monitoring-probe-2026-12-05/``."""
    n, d = comm.size, int(B.numel(flat))
    block = -(-d // n)
    received = exchange_blocks(B, comm, B.pad(flat, block * n - d), name)
    lo, hi = min(comm.rank * block, d), min((comm.rank + 1) * block, d)
    total = rank_order_sum(B, received, n)
    return lo, hi, B.slice(total, 0, hi - lo) * (1.0 / n)


class _Probe:
    """One probe step of one bucket (module docstring, "Probe steps"): the exact mean
    before the reduction, the shared figures after it."""

    def __init__(self, B, comm, runner, group, segments, flat, ranges):
        self.B, self.comm, self.runner, self.group, self.segments = B, comm, runner, group, segments
        self.ranges = ranges
        self.name = f"hvd_quant.{runner.collective_prefix(group)}.probe"
        start = time.perf_counter()
        with self._range():
            # Before the reduction: it may write its result over ``flat``.
            self.lo, self.hi, self.exact = exact_mean_shard(B, comm, flat, self.name)
            self.sq_grad = _sum_squares(B, flat)
        self.seconds = time.perf_counter() - start

    def _range(self):
        return self.ranges("hvd_quant/probe") if self.ranges is not None else _Nothing()

    def finish(self, mean):
        """The probe's figures (:data:`PROBE_FIGURES`), the same on every rank, or
        ``None`` when they are not finite."""
        B, start = self.B, time.perf_counter()
        with self._range():
            residual = self.runner.residual(self.group, self.segments, self.comm)
            sq_residual = _sum_squares(B, residual) if residual is not None else float("nan")
            estimate = B.slice(mean, self.lo, self.hi)
            row = [self.sq_grad, sq_residual, _sum_squares(B, estimate - self.exact),
                   _sum_squares(B, self.exact), _dot(B, estimate, self.exact),
                   _sum_squares(B, estimate)]
            gathered = self.comm.allgather(B.constant(np.array(row, np.float64), "float64"),
                                           self.name + ".figures")
            rows = np.asarray(B.to_numpy(gathered), np.float64).reshape(self.comm.size, len(row))
        self.seconds += time.perf_counter() - start
        # Each rank's row holds its shard's sums; every rank adds the same gathered rows
        # the same way, so every rank holds the same figures.
        shared = {"sq_grad": rows[:, 0].mean(), "sq_residual": rows[:, 1].mean()}
        shared.update(zip(("sq_error", "sq_exact", "dot", "sq_estimate"), rows[:, 2:].sum(axis=0)))
        if residual is None:
            del shared["sq_residual"]
        shared = {k: float(v) for k, v in shared.items()}
        return shared if all(math.isfinite(v) for v in shared.values()) else None


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- does it pay here? --------------------------------------------------------------------
#: Steps after which the adapter says once whether compression pays on this link (``0``:
#: never). The per-step figures are the means over the second half of those steps: the
#: first half pays for compiling kernels, the first-step checks and allocations.
DEFAULT_REPORT_AFTER = 100
#: A saving or a loss below this share of the step is "about even": the measured times
#: move by more than that between runs on a shared machine.
EVEN_SHARE = 0.02


def check_report_after(value):
    """``value`` as an int >= 0 (0: no report), else a ``ValueError``; a report needs a
    window of at least one step after the warm-up's first half, so 1 is refused."""
    if (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0
            or value == 1):
        raise ValueError(f"report_after must be a whole number >= 2 (0: no report), got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Verdict:
    """Whether a method pays on this link (:func:`pays`): seconds per step.

    ``method_s`` is the method's measured reduction (``encode_s + wait_s + decode_s``) and
    ``waited_s`` the part of it the step waited for (its ``sync_s``; under overlap the rest
    ran behind the backward pass). ``fp32_s`` is what an fp32 allreduce of the same buckets
    took when timed on the same ranks (:func:`time_fp32`), alone. Two savings follow, as
    fp32 would hide more or less of its reduction behind backward:

    * ``saves_s = fp32_s - method_s`` (negative: it costs), if fp32 hid as much as the
      method did; ``share`` is that against the measured step, and decides :attr:`pays`;
    * ``saves_most_s = fp32_s - waited_s``, if fp32 hid none of it.

    The two agree where nothing is hidden (no overlap, the 1-bit optimizers, TensorFlow,
    the DDP hooks). ``text`` is the line rank 0 logs."""
    method: str
    method_s: float
    compute_s: float
    fp32_s: float
    saves_s: float
    step_s: float
    share: float
    text: str
    waited_s: float = None
    saves_most_s: float = None

    @property
    def pays(self):
        return self.share >= EVEN_SHARE

    @property
    def may_pay(self):
        """Not :attr:`pays`, but it would if fp32 hid none of its reduction: the figures
        cannot tell (8 ranks on 2 cores, 2026-12-07: ``global_qsgd`` saved 6% of the step
        where ``saves_s`` said it cost 3%)."""
        return not self.pays and self.saves_most_s is not None and self.saves_most_s / self.step_s >= EVEN_SHARE


#: A timed fp32 reduction shorter than this is timed once more and the faster kept: noise
#: on a shared link only ever adds time, and a second round is cheap when the first was.
FP32_RETIME_BELOW_S = 0.5


def time_fp32(B, comm, buckets, prefix="hvd_quant.report"):
    """Seconds an fp32 sum-allreduce of a buffer of each of ``buckets`` (element counts)
    takes on ``comm``, one after the other, as the slowest rank timed it: what fp32 would
    cost these buckets here, timed instead of predicted from the link.

    A prediction from a measured link and :mod:`~hvd_quant.core.costmodel` was 2 to 60
    times off where every rank shared two cores (docs/guide/monitoring.md, "Checked against
    measured step times"): the one 1 MB allreduce it timed waited for the scheduler, and
    the fp32 sum's own compute was not in it. Timed, both are in. It costs one fp32
    reduction of the model once per run (2.5 s for 29.5 MB at 100 Mbit/s; under
    :data:`FP32_RETIME_BELOW_S`, two). Every rank of ``comm`` must call it at the same
    point, with no bucket in flight; its collectives are named ``<prefix>.*``. Its bytes
    are left out of ``comm``'s meter: the meter counts the method's traffic."""
    meter = comm.meter
    counted = (meter.bytes_sent, dict(meter.by_kind))
    try:
        with getattr(B, "eager_scope", nullcontext)():
            B.to_numpy(comm.allreduce(B.zeros(1), "sum", prefix + ".start"))  # all ranks here
            seconds = _slowest(B, comm, _timed_fp32_round(B, comm, buckets, prefix + ".fp32"), prefix + ".slowest")
            # Whether to time again is decided from the slowest rank's time, which every rank
            # holds: decided from its own time, one rank may time again while another does not,
            # and the job hangs on the unmatched allreduce (seen at 8 ranks on 2 cores).
            if seconds < FP32_RETIME_BELOW_S:
                again = _timed_fp32_round(B, comm, buckets, prefix + ".fp32b")
                seconds = min(seconds, _slowest(B, comm, again, prefix + ".slowestb"))
    finally:  # the meter keeps the method's bytes whatever happened here
        meter.bytes_sent, meter.by_kind = counted
    return seconds


def _slowest(B, comm, seconds, name):
    """The largest of every rank's ``seconds``, the same on every rank."""
    out = comm.allreduce(B.constant(np.array([seconds], np.float64), "float64"), "max", name)
    return float(B.to_numpy(out)[0])


def _timed_fp32_round(B, comm, buckets, prefix):
    start = time.perf_counter()
    for i, numel in enumerate(buckets):
        out = comm.allreduce(B.zeros(int(numel)), "sum", f"{prefix}.{i}")
        B.to_numpy(B.slice(out, 0, 1))  # done on the device too
    return time.perf_counter() - start


def pays(method, per_step, buckets, world_size, fp32_s, instead=""):
    """The verdict (:class:`Verdict`) on ``method`` from its measured figures per step,
    ``per_step`` (``encode_s``, ``wait_s``, ``decode_s``, ``step_s`` and, where measured,
    ``sync_s`` and ``probe_s``: means over a window, as :func:`per_step_between` gives
    them), against ``fp32_s``, the seconds an fp32 allreduce of the same ``buckets``
    (element counts) took at ``world_size`` ranks (:func:`time_fp32`). ``instead``: what the
    line recommends when the method does not pay (the adapter's words for fp32 and ``auto``).

    Both are reduction times, and ``wait_s`` includes waiting for the slowest rank, which
    fp32 waited for too. Under overlap the method hides part of its reduction behind the
    backward pass, and fp32 would hide some of its own: as much (the saving ``saves_s``,
    which decides), or none (``saves_most_s``). Where the first says no and the second yes,
    the line says the figures cannot tell."""
    compute = per_step["encode_s"] + per_step["decode_s"]
    ours = compute + per_step["wait_s"]
    waited = _waited(per_step, ours)
    fp32 = float(fp32_s)
    step = max(per_step["step_s"], ours, 1e-12)
    saves, saves_most = fp32 - ours, fp32 - waited
    share = saves / step
    verdict = Verdict(method, ours, compute, fp32, saves, step, share, "", waited, saves_most)
    ms = _duration
    measured = _measured(per_step, ours, waited, compute, fp32, buckets, world_size)
    if verdict.pays:
        # Said against fp32's step (ours plus the saving): a share of our own step passes
        # 100% where fp32's communication is most of its step (161% at 100 Mbit/s, seen).
        fp32_step = step + saves
        text = (f"hvd_quant: `{method}` saves about {ms(saves)} per step on this link, "
                f"{100 * saves / fp32_step:.0f}% of the step fp32 would take (a {ms(step)} step against "
                f"about {ms(fp32_step)}, {fp32_step / step:.2f}x): {measured}.")
    elif verdict.may_pay:
        text = (f"hvd_quant: `{method}` saves up to about {ms(saves_most)} per step on this link "
                f"({100 * saves_most / (step + saves_most):.0f}% of fp32's step) if fp32 would hide none of "
                f"its reduction behind the backward pass, and {_signed(saves)} if it would hide as much as "
                f"`{method}` does ({ms(ours - waited)}); these figures cannot tell which, so time some steps "
                f"in fp32 beside it: {measured}.")
    elif share > -EVEN_SHARE:
        text = (f"hvd_quant: `{method}` and fp32 cost about the same on this link ({ms(abs(saves))} per "
                f"step apart, under {100 * EVEN_SHARE:.0f}% of the {ms(step)} step): {measured}.")
    else:
        text = (f"hvd_quant: `{method}` does not pay on this link: it costs about {ms(-saves)} per step "
                f"more than fp32 ({100 * -share:.0f}% of the {ms(step)} step): {measured}.")
        if compute >= fp32:
            text += (" Its encoding and decoding alone take longer than fp32's whole reduction, so a "
                     "faster link would not change this.")
        if instead:
            text += " " + instead
    return replace(verdict, text=text)


def _waited(per_step, ours):
    """The part of the method's reduction ``ours`` the step waited for: its ``sync_s``
    less a probe's time (the probe is not the method's), at most ``ours``; all of it where
    the adapter measures no ``sync_s``."""
    if per_step.get("sync_s") is None:
        return ours
    return min(ours, max(0.0, per_step["sync_s"] - per_step.get("probe_s", 0.0)))


def _measured(per_step, ours, waited, compute, fp32, buckets, world_size):
    """The line's figures: the method's reduction and fp32's, timed."""
    ms = _duration
    # The ring's bytes per rank over fp32's time: the rate the link gave fp32, compute and all.
    effective_bps = 8.0 * fp32_ring_bytes(sum(buckets), world_size) / max(fp32, 1e-12)
    # Under 1% hidden is the clocks' rounding, not overlap: not worth a clause.
    hidden = (f"; the step waited for {ms(waited)} of it, the rest ran behind the backward pass"
              if ours - waited > 0.01 * ours else "")
    allreduces = f"{len(buckets)} allreduce{'s' if len(buckets) != 1 else ''}"
    return (f"its reduction takes {ms(ours)} per step (encode and decode {ms(compute)}, waiting on "
            f"collectives {ms(per_step['wait_s'])}{hidden}); fp32's took {ms(fp32)} alone, timed at this "
            f"step ({_size(4.0 * sum(buckets))} in {allreduces} at {world_size} ranks: "
            f"{effective_bps / 1e6:.0f} Mbit/s on the ring, its sums included)")


def _signed(saves):
    return f"saves about {_duration(saves)}" if saves >= 0 else f"costs about {_duration(-saves)}"


def _duration(seconds):
    """``12.3 ms`` below a second, ``1.89 s`` from one up (not ``1.89e+03 ms``)."""
    return f"{seconds * 1e3:.3g} ms" if abs(seconds) < 1.0 else f"{seconds:.3g} s"


def _size(nbytes):
    return f"{nbytes / 1e6:.3g} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.3g} kB"


#: The running sums a report's window is made of (:func:`per_step_between`).
WINDOW_FIGURES = ("encode_s", "wait_s", "decode_s", "probe_s", "bytes_sent", "fp32_bytes", "step_s", "sync_s")


def window_mark(owner):
    """The owner's running sums now (:data:`WINDOW_FIGURES`, summed over buckets), to
    take per-step means between two marks."""
    mark = {k: sum(b.total[k] for b in owner.buckets.values()) for k in STEP_FIGURES}
    mark.update(owner.step_total)
    mark["timed_steps"] = owner.timed_steps
    return {k: mark[k] for k in WINDOW_FIGURES + ("timed_steps",)}


def per_step_between(start, end):
    """Means per step of :data:`WINDOW_FIGURES` between two :func:`window_mark` marks
    (``None`` when no step was timed between them). A probe's time is taken out of the
    step: the probe is the monitoring's cost, not the method's."""
    steps = end["timed_steps"] - start["timed_steps"]
    if steps <= 0:
        return None
    out = {k: (end[k] - start[k]) / steps for k in WINDOW_FIGURES}
    out["step_s"] = max(0.0, out["step_s"] - out["probe_s"])
    out["steps"] = steps
    return out


class PaysReport:
    """The adapter's one "does it pay here?" line (:func:`pays`), after ``after`` steps
    (``0``: never; :func:`check_report_after`). The per-step figures are the means over the
    second half of those steps; fp32 is timed when the line is made (:func:`time_fp32`), by
    every rank at the same step, between two steps so that no bucket is in flight; only
    rank 0 logs it. ``instead``: the adapter's words for what to use when the method does
    not pay; ``compresses=False``: the owner reduces in fp32 (nothing to compare, no line).
    ``start``: steps before the window counts them (a 1-bit optimizer's warm-up,
    ``Rule.steady_after``): the line comes after ``start + after`` steps."""

    def __init__(self, after, instead="", compresses=True, start=0):
        self.after = check_report_after(after)
        self.instead = instead
        self.compresses = bool(compresses)
        self.start = int(start)
        self._window = None  # the metrics' sums where the window starts

    def step_ended(self, metrics, method, backend, comm, fp32_buckets=None):
        """Called by every rank after each recorded step (``metrics.steps`` counts them),
        with the owner's ``backend`` and ``comm``; returns the :class:`Verdict` at the step
        it is made (also kept in ``metrics.verdict``), else ``None``. ``fp32_buckets``: a
        callable giving the element counts fp32 would reduce, where they are not the
        metrics' buckets (a 1-bit optimizer's buckets are its kinds of round; fp32 would
        reduce each group once); called only when the line is made."""
        after, steps = self.after, metrics.steps - self.start
        if not after or comm.size < 2 or not self.compresses:
            return None
        if steps == after // 2:
            self._window = window_mark(metrics)
            return None
        if steps != after or self._window is None:
            return None
        per_step = per_step_between(self._window, window_mark(metrics))
        buckets = list(fp32_buckets()) if fp32_buckets else [b.numel for b in metrics.buckets.values()]
        start = time.perf_counter()
        fp32_s = time_fp32(backend, untimed(comm), buckets)
        metrics.leave_out(time.perf_counter() - start)  # not the next step's time
        metrics.verdict = pays(method, per_step, buckets, comm.size, fp32_s, self.instead)
        if comm.rank == 0:
            log.info(metrics.verdict.text)
        return metrics.verdict
