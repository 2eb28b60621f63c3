"""TensorFlow implementation of :class:`hvd_quant.core.backend.Backend`.

Works eagerly and inside ``tf.function``: sizes come from static shapes, and state and
random generators are created under ``tf.init_scope()`` so that they outlive a trace.
Fused primitives run the numba kernels on CPU tensors, eagerly and in graphs
(:mod:`hvd_quant.tensorflow.kernels`).
"""

import numpy as np
import tensorflow as tf

from ..core.backend import Backend
from ..core.rng import CounterRNG, call_key_tensor
from . import kernels as _kernels


class TFCounterRNG(CounterRNG):
    """:class:`~hvd_quant.core.rng.CounterRNG` whose call counter is a ``tf.Variable``, so
    that a traced ``tf.function`` draws new numbers on every run (a Python counter would
    be frozen into the graph at trace time)."""

    def __init__(self, seed):
        super().__init__(seed)
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_quant_rng_calls")

    @property
    def calls(self):
        return int(self.counter.numpy())

    @calls.setter
    def calls(self, value):
        if hasattr(self, "counter"):
            self.counter.assign(int(value))

    def next_key(self, B):
        call = self.counter.assign_add(1) - 1
        return tf.reshape(call_key_tensor(B, self.key, tf.reshape(call, [1])), [1])


class TFBackend(Backend):
    name = "tensorflow"

    def zeros(self, n, dtype="float32"):
        return tf.zeros([n], dtype=dtype)

    def full(self, n, value, dtype="float32"):
        if tf.is_tensor(value):  # a scalar result of a fused kernel
            return tf.fill([n], tf.cast(tf.reshape(value, []), dtype))
        return tf.fill([n], tf.constant(value, dtype=dtype))

    def constant(self, values, dtype):
        return tf.reshape(tf.constant(np.asarray(values), dtype=dtype), [-1])

    def cast(self, x, dtype):
        return tf.cast(x, dtype)

    def bitcast(self, x, dtype):
        return tf.bitcast(x, dtype)

    def to_numpy(self, x):
        return x.numpy() if hasattr(x, "numpy") else np.asarray(x)

    def item(self, x):
        """A Python number eagerly; in a graph the scalar tensor itself (a fused kernel
        takes it as an input and reads the number when the graph runs)."""
        if tf.executing_eagerly():
            return super().item(x)
        return tf.reshape(x, [])

    def numel(self, x):
        n = x.shape.num_elements()
        if n is None:
            raise ValueError("hvd_quant needs tensors with static shapes under tf.function")
        return n

    def is_floating(self, x):
        return x.dtype.is_floating

    def reshape(self, x, shape):
        return tf.reshape(x, shape)

    def concat(self, xs):
        return tf.concat(xs, axis=0)

    def concat_columns(self, xs):
        return tf.concat(xs, axis=1)

    def slice(self, x, start, stop):
        return x[start:stop]

    def dtype_name(self, x):
        if isinstance(x, np.ndarray):
            return x.dtype.name
        return x.dtype.name

    def repeat(self, values, counts):
        return tf.repeat(values, tf.constant(counts, dtype=tf.int64))

    def arange(self, n, dtype="int64"):
        return tf.range(n, dtype=dtype)

    def abs(self, x):
        return tf.abs(x)

    def clip(self, x, lo, hi):
        return tf.clip_by_value(x, lo, hi)

    def floor(self, x):
        return tf.floor(x)

    def sqrt(self, x):
        return tf.sqrt(x)

    def sum(self, x, axis=None):
        return tf.reduce_sum(x, axis=axis)

    def max(self, x, axis=None):
        if axis is not None:
            return tf.reduce_max(x, axis=axis)
        return tf.reduce_max(x) if self.numel(x) else tf.zeros([], dtype=x.dtype)

    def where(self, cond, a, b):
        return tf.where(cond, a, b)

    def all_finite(self, x):
        n = x.shape.num_elements()
        fast = self.kernel("all_finite", x) if x.dtype == tf.float32 and n and n > 4096 else None
        if fast is not None:  # one pass, no bool temporary
            return fast(x)
        return tf.reduce_all(tf.math.is_finite(x))

    def divide(self, x, c):
        # Grappler's constant folding turns x / const into x * (1 / const) inside
        # tf.function, which rounds differently (3.5 / 3 is one ulp off); DivNoNan divides
        # exactly the same way and is left alone. A zero divisor keeps RealDiv (inf, NaN).
        c = np.asarray(c, dtype=x.dtype.as_numpy_dtype)
        if tf.executing_eagerly() or not np.all(c != 0):
            return x / tf.constant(c)
        return tf.math.divide_no_nan(x, tf.constant(c))

    def select(self, cond, a, b):
        if tf.executing_eagerly():
            return super().select(cond, a, b)
        a, b = _same_dtype(a, b)
        return tf.where(tf.reshape(cond, []), a, b)

    def minimum(self, a, b):
        if tf.executing_eagerly():
            return super().minimum(a, b)
        return tf.minimum(*_same_dtype(a, b))

    def logical_and(self, a, b):
        if tf.executing_eagerly():
            return super().logical_and(a, b)
        return tf.logical_and(tf.reshape(tf.cast(a, tf.bool), []), tf.reshape(tf.cast(b, tf.bool), []))

    def cond(self, pred, true_fn, false_fn):
        if tf.executing_eagerly():
            return true_fn() if bool(pred) else false_fn()
        return tf.cond(tf.reshape(pred, []), true_fn, false_fn)

    def greater_equal(self, a, b):
        return tf.greater_equal(a, b)

    def less(self, a, b):
        return tf.less(a, b)

    def bitwise_and(self, a, b):
        return tf.bitwise.bitwise_and(a, b)

    def bitwise_or(self, a, b):
        return tf.bitwise.bitwise_or(a, b)

    def bitwise_not(self, a):
        return tf.bitwise.invert(a)

    def bitwise_xor(self, a, b):
        return tf.bitwise.bitwise_xor(a, b)

    def right_shift(self, x, k):
        return tf.bitwise.right_shift(x, tf.cast(k, x.dtype))

    def left_shift(self, x, k):
        return tf.bitwise.left_shift(x, tf.cast(k, x.dtype))

    def kernel(self, name, *tensors):
        """The numba kernel ``name`` on TensorFlow CPU tensors, eagerly or in a graph, or
        ``None`` where it cannot run (see :mod:`hvd_quant.tensorflow.kernels`)."""
        return _kernels.kernel(name, tensors)

    def lookup(self, table, indices):
        with tf.init_scope():  # a constant that outlives any one trace
            t = self._cached_table(table, tf.constant)
        return tf.gather(t, tf.cast(indices, tf.int32))

    def eager_scope(self):
        """Run eagerly even while a ``tf.function`` traces (one-off measurements at set-up)."""
        return tf.init_scope()

    def variable(self, initial):
        with tf.init_scope():
            return tf.Variable(initial, trainable=False, dtype=initial.dtype.name)

    def read(self, var):
        return var.read_value()

    def assign(self, var, value):
        return var.assign(value)

    def generator(self, seed):
        return TFCounterRNG(seed)


def _same_dtype(a, b):
    """Two scalars as tensors of one dtype (the dtype of whichever is a tensor)."""
    if tf.is_tensor(a) or isinstance(a, tf.Variable):
        return a, tf.cast(b, a.dtype)
    if tf.is_tensor(b) or isinstance(b, tf.Variable):
        return tf.cast(a, b.dtype), b
    return tf.convert_to_tensor(a), tf.convert_to_tensor(b)
