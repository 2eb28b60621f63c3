"""``hvd_quant.tensorflow.DistributedGradientTape``: Horovod's signature, fused compressed
reduction, Keras 2 and Keras 3.

Stock ``hvd.DistributedGradientTape`` fails on Keras 3 variables (``'Variable' object has
no attribute 'ref'``, horovod #4290) because it keys variables by ``.ref()``. This tape
names variables by Keras 3's ``path`` (or ``name``), flattens every gradient into one
float32 buffer per group, and averages it with the compressor's own algorithm. It works
eagerly, inside ``tf.function`` and in TF1-style graphs (``tf.Graph().as_default()``, where the
reduction runs when the graph runs); compressor state lives in ``tf.Variable`` objects
created on first use.

A tape is rebuilt every step, so it cannot own state itself: the state belongs to the set
of variables it reduces (``compression.state_dict(model.trainable_variables)``). One
compression object may serve any number of models, even with identical layer names; each
gets its own state. fp16/bf16 gradients are reduced in fp32 and come back in the
variable's dtype.
"""


import logging
import weakref

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

from ..core.metrics import DEFAULT_PROBE_EVERY, DEFAULT_REPORT_AFTER
from ..core.runner import digest63, values_digest63
from ..process_sets import includes_this_rank
from . import kernels, monitoring
from .comm import HorovodTFComm
from .compression import Compression, variable_name

log = logging.getLogger("hvd_quant")


class DistributedGradientTape:
    """Wrap a ``tf.GradientTape``; ``gradient()`` returns gradients averaged over ranks.

    Parameters mirror ``horovod.tensorflow.DistributedGradientTape``. ``compression`` is
    an ``hvd_quant.tensorflow.Compression.<name>`` object. ``num_groups``/``groups`` split
    the variables into that many fused buffers (default: one; ``groups`` as Horovod's, lists
    of variables). ``sparse_as_dense`` (default True): a sparse gradient
    (``tf.IndexedSlices``, an ``Embedding``'s) is reduced as a dense gradient of its
    variable's full size, which costs that many float32 per step in memory, in the
    compressor's passes and (before compression) on the wire, like Horovod's
    ``sparse_as_dense=True``; ``False`` (Horovod's default, a sparse allreduce there) is
    reduced the same way, since hvd_quant has no sparse reduction, and rank 0 says so once. ``device_dense``, ``device_sparse`` and
    ``gradient_predivide_factor`` are accepted for compatibility (averaging is exact).

    On the first ``gradient()`` call all ranks check that they use the same compressor and
    options and the same variable names/shapes/dtypes, and raise
    :class:`~hvd_quant.core.runner.RankDisagreement` together if not. Variable values that
    differ between ranks are averaged over as Horovod does; if they still differ at the
    next check (the next eager step, or the next trace), rank 0 warns once. ``strict=True``
    (or ``HVD_QUANT_STRICT=1``) makes them an error at the first call instead.

    Model parallelism, as Horovod's tape: :meth:`register_local_source` marks a variable
    whose gradient stays this rank's own (not reduced; divided by the number of ranks when
    ``scale_local_gradients``, Horovod's default), and :func:`PartialDistributedGradientTape`
    registers every trainable variable of ``local_layers``. Unlike Horovod's own (horovod
    #4290), both work on Keras 3 variables. A rank outside ``process_set`` reduces nothing.

    Monitoring (:mod:`hvd_quant.tensorflow.monitoring`, docs/guide/monitoring.md):
    ``metrics=True`` measures what compression does (:meth:`metrics`; inside a
    ``tf.function`` the reduction stays compiled, timed by the graph, but on probe steps,
    which run the eager code in a ``tf.py_function``; in a TF1-style graph every step
    does) and writes it as ``tf.summary`` scalars under the default writer every
    ``summary_every`` steps. ``probe_every``, ``guard`` and ``report_after`` are
    ``hq.DistributedOptimizer``'s (torch): probe steps against the exact fp32 mean, the
    guard that falls back to fp32, the "does it pay" line. The metrics, like the
    compressor's state, belong to the variables the tape reduces, so they go on across
    the tapes of successive steps.
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=True, op=hvd.Average, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, process_set=hvd.global_process_set,
                 scale_local_gradients=True, strict=None, metrics=False,
                 probe_every=DEFAULT_PROBE_EVERY, guard=None, report_after=DEFAULT_REPORT_AFTER,
                 summary_every=100):
        compression = Compression.require(compression, hvd.Compression,
                                          "hvd_quant.tensorflow.DistributedGradientTape",
                                          "Horovod's hvd.DistributedGradientTape")
        monitoring.check_options(metrics, probe_every, guard, report_after, compression)
        self._monitoring = (probe_every, guard, report_after) if metrics else None
        self._summary_every = monitoring.check_summary_every(summary_every)
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("hvd_quant.tensorflow.DistributedGradientTape supports op=hvd.Average or hvd.Sum")
        if gradient_predivide_factor != 1.0 and op != hvd.Average:
            raise ValueError("gradient_predivide_factor only applies to op=hvd.Average")
        self._tape = gradtape
        self._compression = compression
        self._variables = None  # known at gradient(): they own the compressor state
        self._op = op
        self._groups = groups if groups is not None else num_groups
        self.process_set = process_set
        self._comm = None
        self._sparse_as_dense = bool(sparse_as_dense)
        self._strict = strict
        self.scale_local_gradients = bool(scale_local_gradients)
        self._local_sources = {}  # id -> variable (held, so that the id stays its own)

    def register_local_source(self, source):
        """Keep ``source``'s gradient local: it is not reduced over ranks (Horovod's
        ``DistributedGradientTape.register_local_source``), for a model-parallel part such
        as an embedding sharded by rank. Works for ``tf.Variable`` and Keras 3 variables."""
        self._local_sources[id(source)] = source

    def _is_local(self, source):
        return self._local_sources.get(id(source)) is source

    def __getattr__(self, name):
        # watch(), stop_recording(), reset(), ... go to the wrapped tape.
        if name == "_tape":  # not set yet (failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self._tape, name)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    @property
    def bytes_sent(self):
        """Bytes this rank has sent for gradient reduction (cost model of WireMeter).

        Counted when reductions are built: eagerly once per step, under ``tf.function``
        once per trace."""
        return self._comm.meter.bytes_sent if self._comm is not None else 0.0

    def metrics(self):
        """What compression did for the variables this tape reduces, as
        ``hq.DistributedOptimizer.metrics()`` (torch) gives it: a dict of plain numbers
        (``{}`` before the first reduction; ``metrics=True`` turns them on)."""
        monitor = self._monitor()
        return monitor.snapshot() if monitor is not None else {}

    def _monitor(self):
        if self._monitoring is None or self._variables is None:
            return None
        owned = self._compression.owned(self._variables)
        return monitoring.attach(owned.runner, lambda: monitoring.make_monitor(
            owned.runner, self._comm, self._compression, *self._monitoring))

    def guard_state_dict(self):
        """The guard's state (plain numbers) for a checkpoint, ``{}`` without a guard."""
        monitor = self._monitor()
        return monitor.guard_state_dict() if monitor is not None else {}

    def load_guard_state_dict(self, state):
        """Restore :meth:`guard_state_dict`'s output (after the first reduction)."""
        monitor = self._monitor()
        if monitor is None:
            raise ValueError("the guard is made at the first gradient() with metrics=True: call it first")
        monitor.load_guard_state_dict(state)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False):
        grads = self._tape.gradient(target, sources, output_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        reduced = self._reduce(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """``(local, global)`` lists of ``(source, gradient)``: the registered local
        sources with their own gradients, and the others reduced (Horovod's method)."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        pairs = list(zip(tf.nest.flatten(sources), tf.nest.flatten(grads)))
        return ([(s, g) for s, g in pairs if self._is_local(s)],
                [(s, g) for s, g in pairs if not self._is_local(s)])

    def _reduce(self, grads, variables):
        if not includes_this_rank(self.process_set):
            # This rank's own gradients, as Horovod. The owner is still registered, so that
            # owners are numbered alike on every rank (their collective names).
            shared = [v for v in variables if not self._is_local(v)]
            if shared:
                self._compression.owned(shared)
            return list(grads)
        if self._comm is None:
            self._comm = HorovodTFComm(self.process_set)
            self._compression.prepare()  # kernels and thread policy, once Horovod is up
        shared = [i for i, v in enumerate(variables) if not self._is_local(v)]
        out = list(grads)
        if shared:
            self._variables = [variables[i] for i in shared]
            shared_grads = [grads[i] for i in shared]
            if not self._sparse_as_dense:
                note_sparse_reduced_dense(shared_grads, self._variables, "DistributedGradientTape",
                                          self._comm.rank)
            measured = self._monitoring is not None

            def eagerly():
                return reduce_when_the_graph_runs(
                    self._reduce_eagerly, shared_grads, self._variables, self._groups,
                    self._sparse_as_dense, "DistributedGradientTape",
                    owner=(self._compression, tuple(id(v) for v in self._variables)))

            if building_graph():
                reduced, finite = eagerly()
            elif measured and not tf.executing_eagerly():  # compiled but on probe steps
                monitor = self._monitor()
                reduced, finite = monitoring.reduce_in_graph(
                    monitor, lambda m: self._reduce_compiled(shared_grads, m), eagerly,
                    then=monitor.step_ended)
            else:
                reduced, finite = self._reduce_eagerly(shared_grads, self._variables, self._groups)
            if measured:
                with tf.control_dependencies([finite]):  # after the reduction, also in a TF1 graph
                    monitoring.write_summaries(self._monitor, self._summary_every)
            for i, g in zip(shared, reduced):
                out[i] = g
        if self.scale_local_gradients and len(shared) < len(variables):
            # Horovod divides local gradients by the number of ranks (horovod PR #3695), so
            # that a learning rate tuned for the averaged part suits the local part too.
            for i in set(range(len(variables))) - set(shared):
                out[i] = divide_gradient(grads[i], float(self._comm.size))
        return out

    def _reduce_eagerly(self, grads, variables, groups):
        """The shared gradients reduced with the state owned by ``self._variables`` (the
        tape's variables, or, in a TF1-style graph, :class:`_VariableValue` views of them
        that carry their values when the graph runs)."""
        runner = self._owned_runner()
        monitor = self._monitor()
        if monitor is None:
            return reduce_gradients(runner, self._comm, grads, variables, groups, self._op)
        # A tape sees no update: the step ends with its reduction (the update is in the
        # next step's rest_s).
        out = monitor.reduce(reduce_gradients, runner, self._comm, grads, variables, groups, self._op)
        monitor.step_ended()
        return out

    def _reduce_compiled(self, grads, measured):
        """The shared gradients reduced in a ``tf.function``'s graph, measured by ``measured``."""
        return reduce_gradients(self._owned_runner(), self._comm, grads, self._variables, self._groups, self._op,
                                measured=measured)

    def _owned_runner(self):
        """The runner of the compressor state owned by the tape's variables, with ``strict``."""
        owned = self._compression.owned(self._variables)
        if self._strict is not None:
            owned.runner.values.strict = bool(self._strict)
        return owned.runner

    # --- checkpoints ------------------------------------------------------------------------
    def compression_state_dict(self):
        """This rank's compressor state for the variables this tape reduced (error
        feedback and random-stream positions, numpy arrays); the same as
        ``compression.state_dict(variables)``."""
        return self._compression.state_dict(self._reduced_variables())

    def load_compression_state_dict(self, state):
        self._compression.load_state_dict(state, self._reduced_variables())

    def _reduced_variables(self):
        if self._variables is None:
            raise ValueError("call gradient() first, or use compression.state_dict(variables) / "
                             "compression.load_state_dict(state, variables)")
        return self._variables


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=True,
                                   op=hvd.Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=hvd.global_process_set,
                                   local_layers=None, scale_local_gradients=True, strict=None,
                                   **monitoring_options):
    """A :class:`DistributedGradientTape` whose ``local_layers`` keep their gradients
    local (Horovod's ``PartialDistributedGradientTape``, working on Keras 3 layers):
    every trainable variable of those layers is registered with
    :meth:`~DistributedGradientTape.register_local_source`. Other arguments (the
    monitoring ones too: ``metrics``, ``probe_every``, ...) as :class:`DistributedGradientTape`."""
    layers = keras_layers(local_layers, "PartialDistributedGradientTape")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense,
                                   op, gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients=scale_local_gradients, strict=strict,
                                   **monitoring_options)
    for layer in layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape


def keras_layers(local_layers, where):
    """``local_layers`` as a list of Keras layers (Keras 3 or tf-keras), or a TypeError."""
    if local_layers is None:
        return []
    if not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    bad = [type(x).__name__ for x in local_layers if not hasattr(x, "trainable_weights")]
    if bad:
        raise TypeError(f"hvd_quant.tensorflow.{where}: local_layers must be Keras layers, got {bad}")
    return list(local_layers)


def divide_gradient(grad, n):
    """``grad / n`` in ``grad``'s dtype (a dense tensor or ``tf.IndexedSlices``; ``n`` a
    number or a scalar tensor)."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(n, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad / tf.cast(n, grad.dtype)


@tf.autograph.experimental.do_not_convert  # traced as written: branches are B.cond
def reduce_gradients(runner, comm, grads, variables, groups=0, op=hvd.Average, scale=None,
                     sparse_as_dense=True, where="the tape", measured=None):
    """Average ``grads`` (of ``variables``) over ranks with ``runner``'s compressor.

    Every gradient is cast to float32 (fp16 and bf16 too) and fused into one flat buffer
    per group (:func:`flatten_gradients`); a missing gradient counts as zeros, a sparse
    one (``tf.IndexedSlices``) is made dense unless ``sparse_as_dense`` is False (then it
    raises, naming ``where``); results come back in each variable's dtype. ``scale`` (a
    scalar, e.g. a loss scale) divides the local gradients before the reduction, so that
    error feedback is kept in unscaled units. A non-finite value on
    any rank makes its buffer non-finite on every rank (every compressor's contract).

    Returns ``(reduced gradients, all_finite)``; ``all_finite`` is a boolean scalar
    tensor computed from the reduced values, so it is the same on every rank.
    ``measured``: what measures each bucket's reduction, in place of ``runner.measured``
    (a traced reduction's :meth:`~hvd_quant.tensorflow.monitoring.GraphRecorder.measured`).
    """
    check_agreement_once(runner, comm, variables, groups)
    out = list(grads)
    finite = []
    for (key, segments), index in zip(group_segments(variables, groups),
                                      split_groups(variables, groups)):
        flat = flatten_gradients([grads[i] for i in index], [variables[i] for i in index], sparse_as_dense,
                                 where)
        if scale is not None:
            flat = flat / tf.cast(scale, tf.float32)
        flags = []  # the mean's finiteness, computed once for the metrics (when on) and here

        def finite_of(mean, flags=flags):
            flags.append(runner.backend.all_finite(mean))
            return flags[-1]

        mean = (measured or runner.measured)(
            flat, comm, key, segments,
            lambda c, flat=flat, key=key, segments=segments: runner.reduce(flat, c, key, segments),
            finite_of=finite_of)
        if op == hvd.Sum:
            mean = mean * float(comm.size)
            flags.clear()  # the sum's own flag: it may overflow where the mean did not
        finite.append(flags[-1] if flags else runner.backend.all_finite(mean))
        # One split, not a slice per variable: eagerly (a tape, or the measured
        # py_function) each slice is an op dispatched from Python, about 0.1 ms apiece.
        pieces = tf.split(mean, [n for _, n in segments])
        for i, piece in zip(index, pieces):
            out[i] = tf.cast(tf.reshape(piece, variables[i].shape), variables[i].dtype)
    all_finite = tf.reduce_all(tf.stack(finite)) if finite else tf.constant(True)
    if runner.metrics is not None and measured is None:  # else when the recorded graph runs
        runner.metrics.reduced_all()
    return out, all_finite


def building_graph():
    """True while a TF1-style graph is being built: inside ``tf.Graph().as_default()``,
    or in a ``tf.function`` traced while such a graph is built (Horovod's ``graph_mode``
    tests do both). There ``tf.init_scope()`` leads to that graph, not to eager
    execution, so nothing can be read or checked at build time. Inside a ``tf.function``
    of an eager program it leads to eager execution, and this is False."""
    with tf.init_scope():
        return not tf.executing_eagerly()


class _VariableValue:
    """What the reduction reads of a variable (its name, shape, dtype and, for the
    agreement check, its value), with the value read when the graph runs: ``value``, the
    graph's read of it handed in, or (``None``) the variable itself, read only when asked."""

    def __init__(self, variable, value=None):
        self.path = variable_name(variable)
        self.shape, self.dtype = variable.shape, variable.dtype
        self._variable, self._value = variable, value

    def numpy(self):
        if self._value is not None:
            return self._value.numpy()
        return tf.convert_to_tensor(self._variable).numpy()


def reduce_when_the_graph_runs(reduce_eagerly, grads, variables, groups, sparse_as_dense, where, owner,
                               extra=()):
    """A reduction built into a TF1-style graph (:func:`building_graph`), or into a
    ``tf.function`` whose owner measures its steps (:mod:`hvd_quant.tensorflow.monitoring`):
    one ``tf.py_function`` that runs ``reduce_eagerly(grads, views, view_groups, *extra)``
    (which returns ``(reduced gradients, all_finite)``, as :func:`reduce_gradients`;
    ``extra``: more tensors it reads, such as a loss scale) when the graph runs, so that
    the code and the bits are eager mode's.

    At build time nothing can run: the first-step agreement check reads the variables'
    values (``.numpy()``), and the compressor's state variables would be graph variables
    that the program's initializer, run before, never saw. When the graph runs, the
    function gets the gradients (a ``tf.IndexedSlices`` as its rows:
    :func:`gradients_for_py_function`) and ``views`` of the variables (what the reduction
    reads of each: their current values, handed in by a TF1-style graph, else read by the
    function when the check asks), and the check runs once, as in eager mode (a
    difference warns, ``strict`` raises: the graph's run then fails with a
    ``tf.errors.UnknownError`` carrying the :class:`RankDisagreement`'s message). Each
    run of the graph reduces once more, as each eager call does. Reductions of the same
    ``owner`` in one graph run in the order they were built, on every rank, through a
    control dependency (else the executor may run them in either order, a different one
    on each rank)."""
    for g, v in zip(grads, variables):
        if isinstance(g, tf.IndexedSlices) and not sparse_as_dense:
            raise sparse_gradient_error(v, where)
    passed, rebuild = gradients_for_py_function(grads, variables)
    # The variables' values are read for the first step's check only. In a tf.function of
    # an eager program the function reads them itself, then: a value handed in is read by
    # the graph every step, and reading an embedding's variable (in copy-on-read mode once
    # a gather has touched it) copies the whole table each time. A TF1-style graph's
    # variables cannot be read from the function, so there the graph hands them in.
    values = [tf.convert_to_tensor(v) for v in variables] if building_graph() else []
    extra = [tf.convert_to_tensor(x) for x in extra]
    index_groups = split_groups(variables, groups)
    count, given = len(values), len(passed)

    def reduce_now(*tensors):
        handed = tensors[given:given + count] or [None] * len(variables)
        views = [_VariableValue(v, value) for v, value in zip(variables, handed)]
        out, finite = reduce_eagerly(rebuild(tensors[:given]), views,
                                     [[views[i] for i in index] for index in index_groups],
                                     *tensors[given + count:])
        return list(out) + [finite]

    built = _graph_reductions.setdefault(tf.compat.v1.get_default_graph(), {})
    previous = built.get(owner)
    with tf.control_dependencies([previous] if previous is not None else []):
        results = tf.py_function(reduce_now, passed + values + extra,
                                 [tf.as_dtype(v.dtype) for v in variables] + [tf.bool],
                                 name="hvd_quant_reduce")
    built[owner] = results[-1]
    for r, v in zip(results, variables):
        r.set_shape(v.shape)
    results[-1].set_shape([])
    return results[:-1], results[-1]


def gradients_for_py_function(grads, variables):
    """``grads`` as the tensors a ``tf.py_function`` takes, and the function that gives
    them back inside it: ``(tensors, rebuild)``. A ``tf.IndexedSlices`` goes in as its
    values and indices and comes back as one, with its variable's shape, so that the
    eager flattening adds its rows into the kept buffer (:func:`flatten_gradients`): made
    dense in the graph, an embedding's gradient would be allocated, zeroed and scattered
    at its full size each step, then copied (32000 x 384 floats in the Keras benchmark's
    model), for the same bits. ``None`` goes in as zeros, which the reduction treats alike."""
    tensors, layout = [], []
    for g, v in zip(grads, variables):
        if isinstance(g, tf.IndexedSlices):
            layout.append(("rows", len(tensors), tuple(v.shape)))
            tensors += [g.values, g.indices]
        else:
            layout.append(("dense", len(tensors), None))
            tensors.append(tf.zeros(v.shape, tf.as_dtype(v.dtype)) if g is None else tf.convert_to_tensor(g))

    def rebuild(given):
        return [tf.IndexedSlices(given[i], given[i + 1], tf.constant(shape, tf.int64)) if kind == "rows"
                else given[i] for kind, i, shape in layout]
    return tensors, rebuild


# graph -> {owner: the last reduction built for that owner's state in that graph}
_graph_reductions = weakref.WeakKeyDictionary()

_sparse_noted = [False]  # one note per process


def note_sparse_reduced_dense(grads, variables, where, rank):
    """``sparse_as_dense=False`` (Horovod's default) with a ``tf.IndexedSlices`` gradient:
    hvd_quant has no sparse reduction, so it is reduced as dense all the same; rank 0 says
    so once, with the cost (when tracing, under ``tf.function``)."""
    if _sparse_noted[0] or rank != 0:
        return
    for g, v in zip(grads, variables):
        if isinstance(g, tf.IndexedSlices):
            _sparse_noted[0] = True
            log.warning(
                "hvd_quant: the gradient of %s is sparse (tf.IndexedSlices) and %s has "
                "sparse_as_dense=False (Horovod's default). hvd_quant has no sparse reduction: it "
                "reduces the gradient as a dense buffer of the variable's full size (%.3g MB of "
                "float32 per step), with the averaged values Horovod's sparse allreduce gives. "
                "Pass sparse_as_dense=True to silence this.",
                variable_name(v), where, 4 * int(np.prod(v.shape)) / 1e6)
            return


def sparse_gradient_error(variable, where):
    """The error for a ``tf.IndexedSlices`` gradient where ``sparse_as_dense=False``."""
    return ValueError(
        f"hvd_quant: the gradient of {variable_name(variable)} is sparse (tf.IndexedSlices, e.g. "
        f"from an Embedding) and {where} has sparse_as_dense=False. hvd_quant compresses dense "
        "buffers only (a sparse reduction is not implemented): leave sparse_as_dense at its "
        "default, True, which reduces a dense gradient of the variable's full size (4 bytes per "
        f"element: {4 * int(np.prod(variable.shape)) / 1e6:.3g} MB per step here).")


def flatten_gradients(grads, variables, sparse_as_dense=True, where="the optimizer"):
    """``grads`` of ``variables`` as one flat float32 buffer: ``None`` as zeros,
    ``tf.IndexedSlices`` made dense (``sparse_as_dense``; else :func:`sparse_gradient_error`),
    other dtypes cast to float32. Written by a fused kernel into a kept buffer where it
    can run (:func:`hvd_quant.tensorflow.kernels.flatten`), else by ``tf.concat``; the
    same bits either way."""
    for g, v in zip(grads, variables):
        if isinstance(g, tf.IndexedSlices) and not sparse_as_dense:
            raise sparse_gradient_error(v, where)
    if not grads:
        return tf.zeros([0])
    fast = kernels.flatten(grads, [tuple(v.shape) for v in variables])
    if fast is not None:
        return fast
    parts = []
    for g, v in zip(grads, variables):
        if g is None:
            g = tf.zeros(v.shape, dtype=tf.float32)
        elif isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        parts.append(tf.reshape(tf.cast(g, tf.float32), [-1]))
    return tf.concat(parts, axis=0)


@tf.autograph.experimental.do_not_convert
def check_agreement_once(runner, comm, variables, groups=0):
    """The first time per buffer: every rank checks, eagerly even while tracing, that all
    use the same compressor, variables and values (:meth:`CompressorRunner.check_once`)."""
    for (key, segments), index in zip(group_segments(variables, groups),
                                      split_groups(variables, groups)):
        group_vars = [variables[i] for i in index]
        with tf.init_scope():
            runner.check_once(comm, key, lambda: (
                _structure_digest(segments, group_vars), _value_digest(group_vars)))


def group_segments(variables, groups=0):
    """``[(group key, segments)]`` of the fused buffers :func:`reduce_gradients` builds
    for ``variables`` (to create their state up front)."""
    names = [variable_name(v) for v in variables]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"variables with duplicate names cannot carry compressor state: {dups}")
    return [(f"fused{gi}", [(names[i], int(np.prod(variables[i].shape))) for i in index])
            for gi, index in enumerate(split_groups(variables, groups))]


def broadcast_variables(variables, root_rank=0, process_set=hvd.global_process_set):
    """Broadcast variable values from ``root_rank``; works for Keras 3 variables too.

    ``hvd.broadcast_variables`` fails on Keras 3 variables under TF 2.21 (it assigns to a
    symbolic tensor); this assigns each broadcast value back eagerly, one named
    broadcast per variable, in the order given (identical on every rank).
    """
    for i, var in enumerate(variables):
        value = hvd.broadcast(tf.convert_to_tensor(var), root_rank, name=f"hvd_quant.bcast.{i}",
                              ignore_name_scope=True, process_set=process_set)
        var.assign(value)


def split_groups(variables, groups):
    """The fused buffers as lists of indices into ``variables``: one buffer (``0`` or
    ``None``), ``groups`` buffers of consecutive variables (an int), or, as Horovod's
    ``groups=[[v1, v2], [v3]]``, the variables of each inner list that are among
    ``variables`` (in their order there), then one buffer of all the others."""
    count = len(variables)
    if not groups:
        return [list(range(count))]
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"num_groups must be >= 0, got {groups}")
        size = -(-count // groups)
        return [list(range(i, min(i + size, count))) for i in range(0, count, size)]
    position = {id(v): i for i, v in enumerate(variables)}
    listed, seen = [], set()
    for inner in groups:
        index = sorted(position[id(v)] for v in inner if id(v) in position)
        if seen & set(index):
            raise ValueError("groups: a variable may appear in one group only")
        seen.update(index)
        if index:
            listed.append(index)
    rest = [i for i in range(count) if i not in seen]
    return listed + ([rest] if rest else [])


def _structure_digest(segments, variables):
    return digest63(*(f"{n}:{tuple(v.shape)}:{v.dtype}" for (n, _), v in zip(segments, variables)))


def _value_digest(variables):
    return values_digest63(np.asarray(v.numpy()) for v in variables)
