"""Horovod (TensorFlow) implementation of :class:`hvd_quant.core.comm.Communicator`."""

import tensorflow as tf
import horovod.tensorflow as hvd

from contextlib import nullcontext

from ..core.comm import Communicator
from ..core.watchdog import WATCHDOG
from ..process_sets import ProcessSetTorus

# Horovod's TF allreduce kernel types (no int16, no bool).
_ALLREDUCE_DTYPES = (tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64)


class HorovodTFComm(ProcessSetTorus, Communicator):
    """Collectives over a Horovod process set (the global one by default).

    Names are passed with ``ignore_name_scope=True`` so that the same call gets the same
    name eagerly and inside any ``tf.function`` or name scope, on every rank.
    """

    allreduce_int_dtypes = ("int8", "int32", "int64")

    _horovod = hvd  # ProcessSetTorus reads the global process set and the layout from it

    @staticmethod
    def _name(name):
        # With ignore_name_scope Horovod keeps only what follows the last "/", so
        # "dense/bias" and "dense_1/bias" would collide; "/" is not needed in our names.
        return name.replace("/", ".")

    @staticmethod
    def _guard(label):
        """The collective deadline (:mod:`hvd_quant.core.watchdog`) for eager calls; in a
        graph the op runs later, after Python has returned."""
        return WATCHDOG.guard(label) if tf.executing_eagerly() else nullcontext()

    @staticmethod
    def _nbytes(x):
        return x.shape.num_elements() * x.dtype.size

    def allreduce(self, x, op, name):
        if x.dtype not in _ALLREDUCE_DTYPES:
            raise TypeError(f"Horovod's TensorFlow allreduce cannot reduce {x.dtype.name}")
        self._count_allreduce(self._nbytes(x))
        hvd_op = {"sum": hvd.Sum, "max": hvd.Max}[op]
        with self._guard(f"allreduce {name!r}"):
            return hvd.allreduce(x, op=hvd_op, name=self._name(name), ignore_name_scope=True,
                                 process_set=self.process_set)

    def allgather(self, x, name):
        self._count_allgather(self._nbytes(x))
        with self._guard(f"allgather {name!r}"):
            out = hvd.allgather(x, name=self._name(name), ignore_name_scope=True, process_set=self.process_set)
        # Every rank contributes the same length: give graphs the static shape.
        return tf.reshape(out, [self.size * x.shape.num_elements()])

    def alltoall(self, x, name):
        if self.size == 1:
            return tf.identity(x)
        self._count_alltoall(self._nbytes(x))
        with self._guard(f"alltoall {name!r}"):
            out = hvd.alltoall(x, name=self._name(name), ignore_name_scope=True, process_set=self.process_set)
        return tf.reshape(out, [x.shape.num_elements()])

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        if self.size == 1:
            return tf.identity(x)
        n = x.shape.num_elements()
        self._count_send(self._nbytes(x), dest)
        # One hop = an alltoall in which this rank's only non-empty split goes to ``dest``.
        splits = tf.one_hot(dest, self.size, on_value=n, off_value=0, dtype=tf.int32)
        with self._guard(f"ring hop {name!r}"):
            received, _ = hvd.alltoall(x, splits=splits, name=self._name(name), ignore_name_scope=True,
                                       process_set=self.process_set)
        return tf.reshape(received, [n if recv_numel is None else recv_numel])
