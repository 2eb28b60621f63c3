"""``hvd_quant.tensorflow.DistributedGradientTape``: Horovod's signature, fused compressed
reduction, Keras 2 and Keras 3.

Stock ``hvd.DistributedGradientTape`` fails on Keras 3 variables (``'Variable' object has
no attribute 'ref'``, horovod #4290) because it keys variables by ``.ref()``. This tape
names variables by Keras 3's ``path`` (or ``name``), flattens every gradient into one
float32 buffer per group, and averages it with the compressor's own algorithm. It works
eagerly and inside ``tf.function``; compressor state lives in ``tf.Variable`` objects
created on first use.

A tape is rebuilt every step, so it cannot own state itself: the state belongs to the set
of variables it reduces (``compression.state_dict(model.trainable_variables)``). One
compression object may serve any number of models, even with identical layer names; each
gets its own state. fp16/bf16 gradients are reduced in fp32 and come back in the
variable's dtype.
"""


import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

from ..core.runner import digest63, values_digest63
from . import kernels
from .comm import HorovodTFComm
from .compression import Compression, TFCompressor, variable_name


class DistributedGradientTape:
    """Wrap a ``tf.GradientTape``; ``gradient()`` returns gradients averaged over ranks.

    Parameters mirror ``horovod.tensorflow.DistributedGradientTape``. ``compression`` is
    an ``hvd_quant.tensorflow.Compression.<name>`` object. ``num_groups``/``groups`` split
    the variables into that many fused buffers (default: one). ``sparse_as_dense``
    (default True): a sparse gradient (``tf.IndexedSlices``, an ``Embedding``'s) is reduced
    as a dense gradient of its variable's full size, which costs that many float32 per
    step in memory, in the compressor's passes and (before compression) on the wire, like
    Horovod's ``sparse_as_dense=True``; ``False`` raises on a sparse gradient (hvd_quant
    has no sparse reduction). ``device_dense``, ``device_sparse`` and
    ``gradient_predivide_factor`` are accepted for compatibility (averaging is exact).

    On the first ``gradient()`` call all ranks check that they use the same compressor and
    options, the same variable names/shapes/dtypes and the same variable values, and raise
    :class:`~hvd_quant.core.runner.RankDisagreement` together if not.
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=True, op=hvd.Average, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, process_set=hvd.global_process_set):
        if not isinstance(compression, TFCompressor):
            raise TypeError(
                "hvd_quant.tensorflow.DistributedGradientTape needs an hvd_quant compressor "
                f"(hvd_quant.tensorflow.Compression.<name>), got {compression!r}")
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("hvd_quant.tensorflow.DistributedGradientTape supports op=hvd.Average or hvd.Sum")
        if gradient_predivide_factor != 1.0 and op != hvd.Average:
            raise ValueError("gradient_predivide_factor only applies to op=hvd.Average")
        self._tape = gradtape
        self._compression = compression
        self._variables = None  # known at gradient(): they own the compressor state
        self._op = op
        self._groups = groups if groups is not None else num_groups
        self._process_set = process_set
        self._comm = None
        self._sparse_as_dense = bool(sparse_as_dense)

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

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False):
        grads = self._tape.gradient(target, sources, output_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        reduced = self._reduce(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)

    def _reduce(self, grads, variables):
        if self._comm is None:
            self._comm = HorovodTFComm(self._process_set)
            self._compression.prepare()  # kernels and thread policy, once Horovod is up
        self._variables = list(variables)
        runner = self._compression.owned(self._variables).runner
        reduced, _ = reduce_gradients(runner, self._comm, grads, variables, self._groups, self._op,
                                      sparse_as_dense=self._sparse_as_dense)
        return reduced

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


@tf.autograph.experimental.do_not_convert  # traced as written: branches are B.cond
def reduce_gradients(runner, comm, grads, variables, groups=0, op=hvd.Average, scale=None,
                     sparse_as_dense=True, where="the tape"):
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
    """
    check_agreement_once(runner, comm, variables, groups)
    out = list(grads)
    finite = []
    for (key, segments), index in zip(group_segments(variables, groups),
                                      _split_groups(len(variables), groups)):
        flat = flatten_gradients([grads[i] for i in index], [variables[i] for i in index], sparse_as_dense,
                                 where)
        if scale is not None:
            flat = flat / tf.cast(scale, tf.float32)
        mean = runner.reduce(flat, comm, key, segments)
        if op == hvd.Sum:
            mean = mean * float(comm.size)
        finite.append(runner.backend.all_finite(mean))
        offset = 0
        for i, (_, n) in zip(index, segments):
            out[i] = tf.cast(tf.reshape(mean[offset:offset + n], variables[i].shape), variables[i].dtype)
            offset += n
    all_finite = tf.reduce_all(tf.stack(finite)) if finite else tf.constant(True)
    return out, all_finite


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
                                      _split_groups(len(variables), groups)):
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
            for gi, index in enumerate(_split_groups(len(variables), groups))]


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


def _split_groups(count, groups):
    if not groups:
        return [list(range(count))]
    if isinstance(groups, int):
        size = -(-count // groups)
        return [list(range(i, min(i + size, count))) for i in range(0, count, size)]
    raise ValueError("groups given as lists of variables are not supported; pass num_groups")


def _structure_digest(segments, variables):
    return digest63(*(f"{n}:{tuple(v.shape)}:{v.dtype}" for (n, _), v in zip(segments, variables)))


def _value_digest(variables):
    return values_digest63(np.asarray(v.numpy()) for v in variables)
