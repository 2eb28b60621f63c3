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
compiles the step) Python runs once, when the step is traced, so nothing could be timed
or counted there. With metrics on, the reduction of a step therefore runs as one
``tf.py_function`` (:func:`~hvd_quant.tensorflow.tape.reduce_when_the_graph_runs`, the
path TF1-style graphs take): the eager code, with the same bits, run each time the graph
runs, its phases timed and its probes taken as on torch. That replaces the graph's own
collectives by eager ones, so it is a choice the user makes; eagerly (a tape outside any
``tf.function``) nothing changes but the measuring.

Each phase is also a profiler range (``tf.profiler.experimental.Trace``:
``hvd_quant/encode``, ``hvd_quant/wait``, ``hvd_quant/decode``, ``hvd_quant/probe``), seen
in TensorBoard's trace viewer when ``tf.profiler.experimental.start`` runs.

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
                            check_probe_every)

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


def step_ended(monitor):
    """Record the end of a step where it runs: at once eagerly, as a ``tf.py_function``
    (run after the step's updates, which come before it in program order) in a graph."""
    if tf.executing_eagerly():
        monitor.step_ended()
    else:
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
