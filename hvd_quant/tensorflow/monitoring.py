"""What compression does while training, on TensorFlow: the metrics of
:mod:`hvd_quant.core.metrics` for the Keras ``DistributedOptimizer`` and the tapes.

>>> opt = hq.DistributedOptimizer(keras.optimizers.Adam(1e-3),              # doctest: +SKIP
...                               compression=hq.Compression.ef_sign, metrics=True)
>>> model.fit(x, y, callbacks=[hq.callbacks.MetricsCallback()])            # doctest: +SKIP
>>> opt.metrics()["probe_rel_error"]                                        # doctest: +SKIP

The figures, their names and units are torch's (``hq.DistributedOptimizer.metrics()``):
the same tables, the same code (:class:`~hvd_quant.core.metrics.OwnerMetrics`).

Why they are asked for (``metrics=True``), not on by default as on torch
--------------------------------------------------------------------------
The figures are measured in Python around each collective (when it starts and returns),
and a probe step is decided by counting reductions. Inside a ``tf.function`` (``model.fit``
compiles the step) Python runs once, when the step is traced, so the graph must measure
itself (:func:`reduce_in_graph`):

* on a step that neither probes nor falls back, the reduction is the compiled one metrics
  off would run, with a ``tf.timestamp`` before and after each collective
  (:class:`GraphTimedComm`) and one ``tf.py_function`` after it that records the
  instants, flags and scales (:class:`GraphRecorder`); the bytes are counted when the
  step is traced;
* on a probe step, or one the guard sends to fp32, a ``tf.cond`` (its predicate a
  ``tf.py_function`` of :meth:`~hvd_quant.core.metrics.OwnerMetrics.eager_due`, the same
  on every rank) runs the eager code instead, as one ``tf.py_function``
  (:func:`~hvd_quant.tensorflow.tape.reduce_when_the_graph_runs`, the path TF1-style
  graphs take): the same bits, its probes taken as on torch.

Until 2026-12-08 every step took the eager path, which cost 3.3-4.5% of the step of a
29.3M-parameter Keras model at 1 Gbit/s (docs/guide/monitoring.md). In a graph, a
bucket's phases come from its collectives' timestamps; buckets may run at once, so
their phases summed over buckets can exceed ``sync_s``.

Where the reduction runs eagerly (an eager tape, a probe step), each phase is also a
profiler range (``tf.profiler.experimental.Trace``: ``hvd_quant/encode``,
``hvd_quant/wait``, ``hvd_quant/decode``, ``hvd_quant/probe``), seen in TensorBoard's
trace viewer when ``tf.profiler.experimental.start`` runs; a compiled step runs no Python
to open them.

Where users read them
---------------------
* ``opt.metrics()`` / ``tape.metrics()``: the dict of plain numbers;
* Keras: :class:`hvd_quant.tensorflow.callbacks.MetricsCallback` adds them to ``logs``;
* tapes: ``tf.summary`` scalars under the user's default writer
  (:func:`write_summaries`, every ``summary_every`` reductions).
"""

import dataclasses
import time
import weakref

import numpy as np
import tensorflow as tf

from ..core.guard import DIVERGENCE_HINT, checked_guard, make_guard
from ..core.metrics import (DERIVED, OWNER_FIGURES, PROBE_FIGURES, SCALE_FIGURES, STEP_FIGURES, PaysReport,
                            TimedComm, check_probe_every, phases_from_instants)

#: The prefix of every summary tag and ``logs`` key.
TAG = "hvd_quant"
#: The owner's figures a summary or the Keras callback writes by default: every figure
#: summed over buckets, for the last step (``metrics()`` has more: running means and
#: per-bucket figures).
SUMMARY_FIGURES = (("steps", "probes", "skipped_steps", "fallbacks", "saves_s", "saves_most_s") + tuple(STEP_FIGURES)
                   + tuple(PROBE_FIGURES) + tuple(SCALE_FIGURES) + tuple(DERIVED) + tuple(OWNER_FIGURES))

#: The guard's advice when the averaged gradient stays non-finite (hvd_quant.core.guard).
NONFINITE_HINT = (
    "Without a loss scale the first such step already wrote inf or NaN into the variables and "
    "every later step follows: check the data and the loss, and lower the learning rate (or warm "
    "it up). With loss scaling (mixed_float16), the scale was halved at each of these steps and no "
    "step came out finite, so the scale is not the cause either: the same applies.")
#: What the "does it pay" line recommends when the method does not pay.
INSTEAD = ("Use fp32 here (compression=hq.Compression.none), or hq.Compression.auto(), which measures "
           "the link and chooses per bucket.")


def guard_config(guard):
    """``guard=`` as plain data for an optimizer's ``get_config`` (settings as their dict)."""
    return guard if guard is None or isinstance(guard, (bool, dict)) else dataclasses.asdict(guard)


def check_summary_every(value):
    """``value`` as an int >= 1, else a ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"summary_every must be a whole number >= 1, got {value!r}")
    return int(value)


class Monitor:
    """One owner's metrics on TensorFlow: what ``metrics=True`` turns on.

    It turns the runner's metrics on (``runner.observe``), times the step's reductions
    (:meth:`reduce`) and records the step when it ends (:meth:`step_ended`), which also
    makes the "does it pay" line after ``report_after`` steps. Everything here runs
    eagerly: in a graph, inside the ``tf.py_function`` s the adapters build."""

    def __init__(self, runner, comm, method, probe_every, guard, report_after):
        self.runner, self.comm, self.method = runner, comm, method
        self.metrics = runner.observe(probe_every, ranges=tf.profiler.experimental.Trace, guard=guard)
        self.report = PaysReport(report_after, INSTEAD, compresses=method != "none")
        self._sync_s = 0.0  # this step's time in reductions
        self._reduced_at = None  # when the last reduction of this step returned

    def reduce(self, fn, *args):
        """``fn(*args)``, the step's reduction, timed as the step's ``sync_s``."""
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._reduced_at = time.perf_counter()
            self._sync_s += self._reduced_at - start

    def record_compiled(self, buckets, times, flags, scales, then=None):
        """A compiled reduction ran (:class:`GraphRecorder`): record each bucket, as
        :meth:`reduce` and ``runner.measured`` would have measured it. ``times`` (seconds
        of ``tf.timestamp``, wall-clock) holds each bucket's start, end and collectives'
        instants; ``flags`` the buckets' finiteness, ``scales`` their reports' largest and
        summed ``|scale|``. The step's ``sync_s`` runs from the first bucket's start to the
        last one's end (buckets may overlap the backward pass and one another)."""
        started, ended = [], []
        for (group, segments, numel, sent, _, _), (start, end, instants, reports), flag in zip(
                buckets, _unpacked(buckets, times, scales), flags):
            self.metrics.record_reduction(group, segments, numel, self.comm.rank, self.comm.size, sent,
                                          phases_from_instants(start, end, instants), flag,
                                          self.runner.backend, reports)
            started.append(start)
            ended.append(end)
        if ended:
            self._sync_s += max(0.0, max(ended) - min(started))
            # perf_counter's instant of the reduction's end, for the update's time
            self._reduced_at = time.perf_counter() - max(0.0, time.time() - max(ended))
        self.metrics.reduced_all()
        if then is not None:
            then()

    def step_ended(self):
        """The step is over (its update applied): record it, and report once."""
        now = time.perf_counter()
        update_s = now - self._reduced_at if self._reduced_at is not None else 0.0
        self.metrics.record_step(self._sync_s, update_s, now)
        self._sync_s, self._reduced_at = 0.0, None
        self.report.step_ended(self.metrics, self.method, self.runner.backend, self.comm)

    def snapshot(self):
        return self.metrics.snapshot()

    def figures(self, names=SUMMARY_FIGURES):
        """``names`` of the snapshot as float64, NaN where not measured yet."""
        snap = self.snapshot()
        return np.array([_number(snap.get(n)) for n in names], np.float64)

    def guard_state_dict(self):
        return self.metrics.guard.state_dict() if self.metrics.guard is not None else {}

    def load_guard_state_dict(self, state):
        if self.metrics.guard is not None and state:
            self.metrics.guard.load_state_dict(state)


def _unpacked(buckets, times, scales):
    """Per bucket of :meth:`Monitor.record_compiled`: its start, end, collectives'
    ``(start, end)`` and scale reports, cut out of the flat ``times`` and ``scales``."""
    t = s = 0
    for *_, collectives, counts in buckets:
        instants = [(float(t0), float(t1)) for t0, t1 in times[t + 2:t + 2 + 2 * collectives].reshape(-1, 2)]
        reports = [(scales[s + 2 * i], scales[s + 2 * i + 1], c) for i, c in enumerate(counts)]
        yield float(times[t]), float(times[t + 1]), instants, reports
        t += 2 + 2 * collectives
        s += 2 * len(counts)


def _number(value):
    return float("nan") if value is None else float(value)


def make_monitor(runner, comm, compressor, probe_every, guard, report_after, adaptive=False):
    """The :class:`Monitor` of an owner whose buckets ``runner`` reduces on ``comm``;
    ``adaptive``: the owner feeds an adaptive optimizer (its buckets may run another
    method: ``compressor.algorithm_for(adaptive)``). Arguments were checked already
    (:func:`check_options`)."""
    return Monitor(runner, comm, compressor.name, probe_every,
                   make_guard(guard, compressor.algorithm_for(adaptive), probe_every, NONFINITE_HINT, DIVERGENCE_HINT),
                   report_after)


def check_options(metrics, probe_every, guard, report_after, compressor, adaptive=False):
    """Check the monitoring arguments at construction: ``ValueError`` naming a bad one
    (a guard needs ``metrics=True``: it reads the metrics' probes)."""
    check_probe_every(probe_every)
    PaysReport(report_after)
    checked_guard(metrics, guard, compressor.algorithm_for(adaptive), probe_every)


# --- a compiled reduction, measured by the graph's own timestamps --------------------------
def reduce_in_graph(monitor, compiled, eagerly, then=None):
    """The step's reduction inside a ``tf.function`` with metrics on (module docstring):
    ``compiled(measured)``, the reduction traced into the graph with ``measured`` in place
    of ``runner.measured`` (:meth:`GraphRecorder.measured`), on every step that neither
    probes nor falls back, else ``eagerly()``, the ``tf.py_function`` of the eager code.
    Both return ``(reduced gradients, all_finite)``. Which one runs is decided when the
    graph runs, by a ``tf.cond`` on :meth:`~hvd_quant.core.metrics.OwnerMetrics.eager_due`,
    the same on every rank (with ``probe_every=0`` there is no cond: never eager).
    ``then()``, where given, runs eagerly after the compiled reduction is recorded (a
    tape's step ends there). The returned ``all_finite`` is read only once the reduction
    is recorded: what must come after the record (the step's end) depends on it. The
    gradients are not held back: an update may start on them as it would unmeasured."""
    def traced():
        recorder = GraphRecorder(monitor)
        reduced, finite = compiled(recorder.measured)
        return reduced, _after(recorder.record(then), finite)

    if not monitor.metrics.probe_every:  # no probe steps, so no guard (checked_guard): never eager
        return traced()
    due = tf.py_function(lambda: tf.constant(monitor.metrics.eager_due()), [], tf.bool, name="hvd_quant_eager_due")
    due.set_shape([])
    return tf.cond(due, eagerly, traced)


def _after(op, out):
    """``out`` (a tensor or a tuple of them) as read only once ``op`` has run."""
    with tf.control_dependencies([op]):
        return tf.nest.map_structure(lambda t: tf.identity(t) if tf.is_tensor(t) else t, out)


class _GraphClock:
    """What :class:`GraphTimedComm` records while a reduction is traced: each collective's
    ``(start, end)`` timestamp ops and the method's scale reports (``note_scales``)."""

    def __init__(self):
        self.intervals, self.scales = [], []


class GraphTimedComm(TimedComm):
    """:class:`~hvd_quant.core.metrics.TimedComm` for a traced reduction: each collective
    gets two ``tf.timestamp`` ops, one run once its input is ready and one once its output
    is, recorded in the clock (:class:`_GraphClock`). The collective waits for the first
    and what reads its output for the second: else the executor, whose threads are busy
    with the step's other work, may run a timestamp late (after the collective started,
    after the decoding that followed it)."""

    def _timed(self, fn, *args):
        with tf.control_dependencies([a for a in args if tf.is_tensor(a)]):
            started = tf.timestamp(name="hvd_quant_wait_starts")
        with tf.control_dependencies([started]):
            out = fn(*args)
        with tf.control_dependencies([t for t in tf.nest.flatten(out) if tf.is_tensor(t)]):
            ended = tf.timestamp(name="hvd_quant_wait_ends")
        self.clock.intervals.append((started, ended))
        return _after(ended, out)


class GraphRecorder:
    """The buckets of one traced reduction (:func:`reduce_in_graph`): per bucket, its
    instants, finiteness flag and scales as graph tensors, and what is known when tracing
    (its key, segments, size and the bytes it sends: the meter counts them once per trace,
    the same every step). :meth:`record` hands them to the owner's metrics when the graph
    runs, through one ``tf.py_function``."""

    def __init__(self, monitor):
        self.monitor = monitor
        self.buckets = []  # (group, segments, numel, bytes_sent, collectives, scale reports)
        self.times, self.flags, self.scale_values = [], [], []

    def measured(self, flat, comm, group, segments, reduce, finite_of=None, **_):
        """``runner.measured``'s part in a traced reduction: ``reduce(comm)`` on a
        :class:`GraphTimedComm`, its instants kept for :meth:`record`."""
        clock = _GraphClock()
        with tf.control_dependencies([flat]):
            start = tf.timestamp(name="hvd_quant_encode_starts")
        before = comm.meter.bytes_sent
        with tf.control_dependencies([start]):
            mean = reduce(GraphTimedComm(comm, clock))
        flag = finite_of(mean) if finite_of is not None else self.monitor.runner.backend.all_finite(mean)
        with tf.control_dependencies([mean]):
            end = tf.timestamp(name="hvd_quant_decode_ends")
        mean = _after(end, mean)
        self.times += [start, end] + [t for interval in clock.intervals for t in interval]
        self.flags.append(flag)
        self.scale_values += [tf.cast(v, tf.float64) for m, t, _ in clock.scales for v in (m, t)]
        self.buckets.append((group, segments, int(flat.shape.num_elements()), comm.meter.bytes_sent - before,
                             len(clock.intervals), [c for _, _, c in clock.scales]))
        return mean

    def record(self, then=None):
        """The op that records this reduction when it runs (after every bucket's)."""
        def record_now(times, flags, scales):
            # As numpy: indexing an eager tensor dispatches an op, about 0.6 ms apiece here.
            self.monitor.record_compiled(self.buckets, times.numpy(), flags.numpy(), scales.numpy(), then)
            return tf.constant(True)

        times = tf.stack(self.times)
        flags = tf.stack(self.flags) if self.flags else tf.zeros([0], tf.bool)
        scales = tf.stack(self.scale_values) if self.scale_values else tf.zeros([0], tf.float64)
        return tf.py_function(record_now, [times, flags, scales], tf.bool, name="hvd_quant_record")


def step_ended(monitor, after=None):
    """Record the end of a step where it runs: at once eagerly, as a ``tf.py_function``
    (run after the step's updates, which come before it in program order) in a graph,
    and after ``after`` (the reduction's ``all_finite``: :func:`reduce_in_graph`)."""
    if tf.executing_eagerly():
        monitor.step_ended()
    else:
        with tf.control_dependencies([after] if after is not None else []):
            tf.py_function(lambda: monitor.step_ended() or tf.constant(True), [], tf.bool,
                           name="hvd_quant_step_ended")


# --- tf.summary for the tapes ----------------------------------------------------------------
def write_summaries(get_monitor, every, names=SUMMARY_FIGURES):
    """Write ``names`` of the metrics of ``get_monitor()`` (made when the first reduction
    ran: a callable, so that a graph reads it when it runs) as ``tf.summary`` scalars
    (``hvd_quant/<figure>``) under the user's default writer, after every ``every``-th
    step; figures not measured yet are left out. The step is the user's
    (``tf.summary.experimental.set_step``) where set, else the metrics' step count. Without
    a default writer ``tf.summary`` writes nothing. In a graph the figures come from a
    ``tf.py_function`` run after the reduction, and the writes are graph ops (the writer
    is the one that is default when the step is traced, as ``tf.summary`` intends)."""
    def figures():
        monitor = get_monitor()
        return monitor.figures(names), np.int64(monitor.metrics.steps)

    if tf.executing_eagerly():
        values, steps = figures()
    else:
        values, steps = tf.py_function(figures, [], [tf.float64, tf.int64], name="hvd_quant_figures")
        values.set_shape([len(names)])
        steps.set_shape([])
    user_step = tf.summary.experimental.get_step()
    step = tf.cast(steps, tf.int64) if user_step is None else user_step

    due = tf.equal(tf.math.floormod(tf.cast(steps, tf.int64), every), 0)
    # record_if, not tf.cond: a cond's name scope would become part of every tag.
    for i, name in enumerate(names):
        with tf.summary.record_if(tf.logical_and(due, tf.math.is_finite(values[i]))):
            tf.summary.scalar(f"{TAG}/{name}", values[i], step=step)


# owner runner -> its Monitor: a tape is made anew each step, its state (and metrics) live on
_monitors = weakref.WeakKeyDictionary()


def attach(runner, make):
    """``runner``'s :class:`Monitor`, made by ``make()`` the first time."""
    if runner not in _monitors:
        _monitors[runner] = make()
    return _monitors[runner]
