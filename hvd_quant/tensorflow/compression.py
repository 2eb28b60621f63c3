"""``hvd_quant.tensorflow.Compression``: our compressors behind Horovod's compression
interface, for ``hvd.DistributedGradientTape`` (Keras 2 / tf-keras) and for our tape.

See :mod:`hvd_quant.torch.compression` for why compressors that need their own
collectives run them inside ``compress`` and hand Horovod a one-element placeholder.

Horovod's stock tape and its tf-keras optimizer are rebuilt or re-traced freely and pass
no optimizer to ``compress``; their state is owned by the *set of variables being
reduced* (Horovod's ``allreduce_grads(grads, vars)``), named by variable name within it.
Two models, even with identical layer names, therefore keep separate state, and
``Compression.ef_sign.state_dict(model.trainable_variables)`` returns one model's.
"""

import sys

import tensorflow as tf

from ..core.handle import CompressionNamespace, CompressorHandle
from .backend import TFBackend
from .kernels import prepare_kernels


def variable_name(var):
    """Stable name of a TF or Keras variable: Keras 3's ``path``, else ``name`` minus ``:0``."""
    path = getattr(var, "path", None)
    if isinstance(path, str) and path:
        return path
    name = var.name
    return name[:-2] if name.endswith(":0") else name


def _horovod_call_site():
    """(variable name or None, op, variables or None) for the gradient Horovod's stock tape
    is compressing.

    Horovod 0.28.1 builds its reductions in ``allreduce_grads(grads, vars)`` with a list
    comprehension over ``i``, and ``hvd.allreduce`` holds the ``op``; under ``tf.function``
    autograph runs them as ``tf__allreduce_grads`` / ``tf__allreduce``. Returns ``None``
    when not called from Horovod's ``allreduce``.
    """
    frame = sys._getframe(2)
    op, index = None, None
    found_allreduce = False
    while frame is not None:
        code_name = frame.f_code.co_name.removeprefix("tf__")
        local = frame.f_locals
        if code_name == "allreduce" and "compression" in local and "op" in local:
            op, found_allreduce = local["op"], True
        elif found_allreduce and index is None and isinstance(local.get("i"), int) and "grad" in local:
            index = local["i"]
        elif code_name == "allreduce_grads" and "vars" in local:
            variables = local["vars"]
            if index is not None and variables is not None and index < len(variables):
                return variable_name(variables[index]), op, list(variables)
            return None, op, None
        frame = frame.f_back
    return (None, op, None) if found_allreduce else None


class TFCompressor(CompressorHandle):
    """A registered compressor, usable as ``compression=`` for Horovod's stock
    ``hvd.DistributedGradientTape`` and for :class:`hvd_quant.tensorflow.DistributedGradientTape`.

    The object is configuration (see :mod:`hvd_quant.core.handle`); calling it returns
    one with updated options.
    """

    framework = "tensorflow"

    def __init__(self, name, seed=0, **options):
        super().__init__(name, seed=seed, **options)
        self.prepare()

    def prepare(self):
        """Set-up time: the kernels this compressor runs are loaded now, not in the first
        step, under the thread policy for this host (see
        :func:`hvd_quant.tensorflow.kernels.prepare_kernels`). Called again by the
        optimizer and the tape once Horovod is initialised (the ranks on this host are
        known then)."""
        if self.name not in ("none", "fp16"):  # plain casts around Horovod's allreduce
            prepare_kernels()

    def make_backend(self):
        return TFBackend()

    def state_dict(self, variables=None):
        """This rank's compressor state for the tape or stock optimizer reducing
        ``variables`` (numpy arrays keyed ``"variable/key"``; save it per rank).
        ``variables`` may be left out while only one model uses this object."""
        return super().state_dict(variables)

    def load_state_dict(self, state, variables=None):
        """Restore :meth:`state_dict` output for the tape or stock optimizer that reduces
        ``variables``, e.g. before the first step of a restored run."""
        super().load_state_dict(state, variables)

    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor):
        if not tensor.dtype.is_floating:
            return tensor, None
        import horovod.tensorflow as hvd

        if self.algorithm.horovod_wire_dtype is not None:
            site = _horovod_call_site()
            owned = self.owned(site[2] if site is not None else None)
            wire = tf.cast(tensor, self.algorithm.horovod_wire_dtype)
            self._count_horovod_cast(owned, wire.shape.num_elements() * wire.dtype.size, hvd.size())
            return wire, ("cast", tensor.dtype)
        from .comm import HorovodTFComm

        if self.algorithm.multi_hop:
            raise RuntimeError(
                f"hvd_quant: {self!r} reduces hop by hop on a ring, which Horovod's stock "
                "hvd.DistributedGradientTape cannot order (it reduces variables concurrently). "
                "Use hvd_quant.tensorflow.DistributedGradientTape(tape, "
                f"compression=hvd_quant.tensorflow.Compression.{self.name}).")
        site = _horovod_call_site()
        vname, op, variables = site if site is not None else (None, None, None)
        owned = self.owned(variables)  # the reduced variables own the state
        if vname is None:
            if site is None or self.algorithm.stateful:
                raise RuntimeError(
                    f"hvd_quant: {self!r} runs its own collectives"
                    + (" and keeps per-variable state" if self.algorithm.stateful else "")
                    + "; it supports Horovod's stock hvd.DistributedGradientTape (0.28.1) and "
                    "hvd_quant.tensorflow.DistributedGradientTape. Use "
                    "hvd_quant.tensorflow.DistributedGradientTape(tape, "
                    f"compression=hvd_quant.tensorflow.Compression.{self.name}).")
            owned.anonymous_calls += 1
            vname = f"tensor{owned.anonymous_calls}"
        if op == hvd.Adasum:
            raise ValueError("hvd_quant compressors do not support op=hvd.Adasum")
        if owned.comm is None:
            owned.comm = HorovodTFComm()
        with tf.init_scope():
            owned.runner.check_once(owned.comm, "stock")
        # fp32 inside the compressor whatever the variable's dtype (fp16, bf16).
        flat = tf.cast(tf.reshape(tensor, [-1]), tf.float32)
        mean = owned.runner.reduce(flat, owned.comm, vname, [(vname, flat.shape.num_elements())])
        if op == hvd.Sum:
            mean = mean * float(owned.comm.size)
        result = tf.cast(tf.reshape(mean, tf.shape(tensor)), tensor.dtype)
        return tf.zeros([1], dtype=tf.float32), ("result", result)

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor, ctx):
        if ctx is None:
            return tensor
        kind, value = ctx
        return tf.cast(tensor, value) if kind == "cast" else value


Compression = CompressionNamespace(TFCompressor)
