"""The small tensor-ops interface every algorithm in :mod:`hvd_quant` is written against.

Each quantizer, packer and per-hop operator is written once, in terms of the methods of
:class:`Backend`, and runs unchanged on numpy arrays, torch tensors or TensorFlow tensors.
The numpy implementation here is also the test oracle: the multi-process tests compare
what Horovod produced against the same algorithm run on numpy arrays;
:class:`NumpyKernelBackend` runs them through the fused CPU kernels
(:mod:`hvd_quant.kernels`, the layer below this one) instead.

Only flat (1-D) tensors are used by the algorithms; adapters flatten and restore shapes.
Dtypes are named by strings (``"float32"``, ``"uint8"``, ``"int8"``, ``"int16"``,
``"int32"``, ``"int64"``) so that core code never imports a framework.
"""

import numpy as np

from .. import kernels
from .rng import CounterRNG, draws

_BIT_WEIGHTS = np.array([1, 2, 4, 8, 16, 32, 64, 128], dtype=np.uint8)


def truth(value):
    """``bool(value)`` for a boolean scalar (a Python bool or a one-element tensor), read
    from the tensor once.

    On a GPU every read of a tensor's value is a device-to-host copy that waits for all
    the work queued before it on the stream. A step reads its verdict (the finite flag
    every rank shares) in several places (the compressor's branch, the state's commit,
    where the new parameters may go): the first read is kept on the tensor, with the
    tensor's version, and later reads of the same, unmodified tensor reuse it. numpy and
    other objects that take no attribute are read as they are."""
    if isinstance(value, (bool, int, float)) or not hasattr(value, "_version"):
        return bool(value)
    version = value._version  # torch: bumped by every in-place change
    cached = getattr(value, "_hvd_quant_truth", None)
    if cached is not None and cached[0] == version:
        return cached[1]
    result = bool(value)
    try:
        value._hvd_quant_truth = (version, result)
    except (AttributeError, TypeError):
        pass
    return result


class _Box:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class Backend:
    """Abstract tensor operations. Subclasses wrap one framework.

    Methods take and return that framework's tensors. Shapes are 1-D unless a method
    says otherwise.
    """

    name = "abstract"

    # --- construction and conversion ---------------------------------------------------
    def zeros(self, n, dtype="float32"):
        raise NotImplementedError

    def full(self, n, value, dtype="float32"):
        raise NotImplementedError

    def constant(self, values, dtype):
        """A 1-D tensor from a Python sequence or numpy array."""
        raise NotImplementedError

    def cast(self, x, dtype):
        raise NotImplementedError

    def bitcast(self, x, dtype):
        """Reinterpret the bits of ``x`` as ``dtype`` (e.g. float32 to int32), element by
        element; no value conversion. Between widths (float32 to uint8 and back) the last
        dimension changes as numpy's ``view`` and ``tf.bitcast`` change it: 4 bytes per
        float, and back from a last dimension of 4 (reshape to the shape you need)."""
        raise NotImplementedError

    def to_numpy(self, x):
        raise NotImplementedError

    def item(self, x):
        """The Python number held by a one-element tensor (eager only)."""
        return self.to_numpy(x).reshape(-1)[0].item()

    def kernel_scalar(self, x):
        """A one-element tensor as a fused kernel's scalar argument: the Python number it
        holds (:meth:`item`), except where the kernels read a tensor on the device
        themselves (the torch backend's GPU kernels), which then gets it as it is, with
        no host read."""
        return self.item(x)

    def numel(self, x):
        raise NotImplementedError

    def is_floating(self, x):
        raise NotImplementedError

    # --- shape -----------------------------------------------------------------------
    def reshape(self, x, shape):
        raise NotImplementedError

    def concat(self, xs):
        raise NotImplementedError

    def concat_columns(self, xs):
        """Concatenate 2-D tensors along axis 1."""
        raise NotImplementedError

    def slice(self, x, start, stop):
        raise NotImplementedError

    def slice_columns(self, x, start, stop):
        """Columns ``start:stop`` of a 2-D tensor."""
        return x[:, start:stop]

    def pad(self, x, n):
        """Append ``n`` zeros."""
        if n == 0:
            return x
        return self.concat([x, self.zeros(n, self.dtype_name(x))])

    def dtype_name(self, x):
        raise NotImplementedError

    def repeat(self, values, counts):
        """``values[i]`` repeated ``counts[i]`` times (counts: Python ints)."""
        raise NotImplementedError

    def arange(self, n, dtype="int64"):
        """``0, 1, ..., n - 1``."""
        raise NotImplementedError

    # --- arithmetic and reductions ----------------------------------------------------
    def abs(self, x):
        raise NotImplementedError

    def clip(self, x, lo, hi):
        """``x`` limited to ``[lo, hi]`` (Python numbers), element by element."""
        raise NotImplementedError

    def floor(self, x):
        raise NotImplementedError

    def sqrt(self, x):
        raise NotImplementedError

    def sum(self, x, axis=None):
        raise NotImplementedError

    def max(self, x, axis=None):
        """The largest element (0 for an empty ``x``), or along ``axis``."""
        raise NotImplementedError

    def where(self, cond, a, b):
        raise NotImplementedError

    def all_finite(self, x):
        """A boolean scalar tensor: no element of ``x`` is inf or NaN (True for empty)."""
        raise NotImplementedError

    def divide(self, x, c):
        """``x / c`` for a Python number or numpy array ``c`` (of ``x``'s dtype), rounded as
        a true division: algorithms divide by constants with this so that every backend
        gives the oracle's bits (TensorFlow graphs would multiply by ``1 / c`` instead)."""
        if isinstance(c, np.ndarray):
            c = self.constant(c, c.dtype.name)
        return x / c

    def select(self, cond, a, b):
        """``a if cond else b`` for scalars: Python numbers eagerly; TensorFlow graphs use
        ``tf.where`` (counters there are tensors)."""
        return a if truth(cond) else b

    def minimum(self, a, b):
        """The smaller of two scalars (Python numbers eagerly, tensors in graphs)."""
        return a if truth(a <= b) else b

    def logical_and(self, a, b):
        """``a and b`` for boolean scalars (Python bools or one-element tensors); a
        boolean tensor in TensorFlow graphs."""
        return truth(a) and truth(b)

    def cond(self, pred, true_fn, false_fn):
        """``true_fn()`` if the boolean scalar ``pred`` holds, else ``false_fn()``: a Python
        branch eagerly, ``tf.cond`` in a TensorFlow graph. Both must return tensors of
        the same shapes and dtypes. Never put a collective in only one branch. A tensor
        ``pred`` is read once (:func:`truth`)."""
        return true_fn() if truth(pred) else false_fn()

    def greater_equal(self, a, b):
        raise NotImplementedError

    def less(self, a, b):
        raise NotImplementedError

    # --- integer bit operations -------------------------------------------------------
    def bitwise_and(self, a, b):
        raise NotImplementedError

    def bitwise_or(self, a, b):
        raise NotImplementedError

    def bitwise_not(self, a):
        raise NotImplementedError

    def bitwise_xor(self, a, b):
        raise NotImplementedError

    def right_shift(self, x, k):
        raise NotImplementedError

    def left_shift(self, x, k):
        raise NotImplementedError

    # --- persistent state -------------------------------------------------------------
    def variable(self, initial):
        """A mutable holder for state (a ``tf.Variable`` under TensorFlow), initialised
        from the numpy array ``initial``."""
        return _Box(self.constant(initial, initial.dtype.name))

    def read(self, var):
        return var.value

    def assign(self, var, value):
        var.value = value
        return value

    # --- randomness ---------------------------------------------------------------------
    def generator(self, seed):
        """This rank's random stream seeded by an int: a counter-based generator
        (:mod:`hvd_quant.core.rng`) whose draws are identical on every backend."""
        return CounterRNG(seed)

    def uniform(self, gen, n):
        """``n`` float32 samples from U[0, 1) (multiples of ``2**-24``): one call of
        ``gen``'s stream (:func:`hvd_quant.core.rng.hash_bits`)."""
        return self.draws(gen.next_key(self), n)

    def draws(self, key, n):
        """``n`` float32 samples from U[0, 1) of the call with key ``key`` (one pass on
        the fused ``uniform`` kernel where there is one)."""
        fast = self.kernel("uniform")
        return fast(key, n) if fast is not None else draws(self, key, n)

    # --- fused kernels --------------------------------------------------------------------
    def kernel(self, name, *tensors):
        """A fast implementation of the fused primitive ``name`` for these tensors, or
        ``None`` to use the generic one built from the operations above.

        Fused primitives are named one-pass operations (sign + pack, stochastic rounding
        + lane packing, ...) whose generic implementation sits next to the algorithm that
        uses it; :mod:`hvd_quant.kernels` lists them and holds the fast CPU versions. The
        numpy backend returns ``None`` for all: it is the oracle the kernels are tested
        against.
        """
        return None

    def lookup(self, table, indices):
        """``table[indices]``: rows of the constant 2-D numpy ``table`` picked by an integer
        tensor, shape ``(len(indices), table.shape[1])``. The converted table is cached."""
        raise NotImplementedError

    def _cached_table(self, table, convert):
        cache = self.__dict__.setdefault("_tables", {})
        key = id(table)
        if key not in cache:
            cache[key] = (table, convert(table))  # keep table alive so the id stays valid
        return cache[key][1]

    # --- bit packing (generic implementations; subclasses may override for speed) -------
    def packbits(self, bits):
        """Pack a uint8 0/1 tensor whose length is a multiple of 8; bit ``j`` of byte ``i``
        (least significant first) is element ``8*i + j``."""
        groups = self.reshape(self.cast(bits, "int32"), (-1, 8))
        weights = self.reshape(self.constant(_BIT_WEIGHTS, "int32"), (1, 8))
        return self.cast(self.sum(groups * weights, axis=1), "uint8")

    def unpackbits(self, packed):
        """Inverse of :meth:`packbits`: uint8 0/1 of length ``8 * len(packed)``."""
        wide = self.reshape(self.cast(packed, "int32"), (-1, 1))
        shifts = self.reshape(self.constant(np.arange(8), "int32"), (1, 8))
        bits = self.bitwise_and(self.right_shift(wide, shifts), self.full(1, 1, "int32"))
        return self.cast(self.reshape(bits, (-1,)), "uint8")


class NumpyBackend(Backend):
    """numpy implementation; the reference (oracle) backend."""

    name = "numpy"

    def zeros(self, n, dtype="float32"):
        return np.zeros(n, dtype=dtype)

    def full(self, n, value, dtype="float32"):
        return np.full(n, value, dtype=dtype)

    def constant(self, values, dtype):
        return np.asarray(values, dtype=dtype).reshape(-1)

    def cast(self, x, dtype):
        return np.asarray(x).astype(dtype, copy=False)

    def bitcast(self, x, dtype):
        return np.asarray(x).view(dtype)

    def to_numpy(self, x):
        return np.asarray(x)

    def numel(self, x):
        return int(np.size(x))

    def is_floating(self, x):
        return np.issubdtype(np.asarray(x).dtype, np.floating)

    def reshape(self, x, shape):
        return np.reshape(x, shape)

    def concat(self, xs):
        return np.concatenate(xs)

    def concat_columns(self, xs):
        return np.concatenate(xs, axis=1)

    def slice(self, x, start, stop):
        return x[start:stop]

    def dtype_name(self, x):
        return np.asarray(x).dtype.name

    def repeat(self, values, counts):
        return np.repeat(values, counts)

    def arange(self, n, dtype="int64"):
        return np.arange(n, dtype=dtype)

    def abs(self, x):
        return np.abs(x)

    def clip(self, x, lo, hi):
        return np.clip(x, lo, hi)

    def floor(self, x):
        return np.floor(x)

    def sqrt(self, x):
        return np.sqrt(x)

    def sum(self, x, axis=None):
        return np.sum(x, axis=axis)

    def max(self, x, axis=None):
        if axis is not None:
            return np.max(x, axis=axis)
        return np.max(x) if np.size(x) else np.zeros((), dtype=np.asarray(x).dtype)

    def where(self, cond, a, b):
        return np.where(cond, a, b)

    def all_finite(self, x):
        return np.bool_(np.isfinite(x).all())

    def greater_equal(self, a, b):
        return np.greater_equal(a, b)

    def less(self, a, b):
        return np.less(a, b)

    def bitwise_and(self, a, b):
        return np.bitwise_and(a, b)

    def bitwise_or(self, a, b):
        return np.bitwise_or(a, b)

    def bitwise_not(self, a):
        return np.invert(a)

    def bitwise_xor(self, a, b):
        return np.bitwise_xor(a, b)

    def right_shift(self, x, k):
        return np.right_shift(x, k)

    def left_shift(self, x, k):
        return np.left_shift(x, k)

    def lookup(self, table, indices):
        return table[np.asarray(indices)]

    def packbits(self, bits):
        return np.packbits(np.asarray(bits, dtype=np.uint8), bitorder="little")

    def unpackbits(self, packed):
        return np.unpackbits(np.asarray(packed, dtype=np.uint8), bitorder="little")


class NumpyKernelBackend(NumpyBackend):
    """The numpy backend with the fast CPU kernels (:mod:`hvd_quant.kernels`) switched on.

    The plain :class:`NumpyBackend` is the oracle; this one runs the same algorithms
    through the kernels, so tests can compare the two on identical inputs and seeds, and
    benchmarks can time the kernels without a framework.
    """

    name = "numpy+kernels"

    def kernel(self, name, *tensors):
        return getattr(kernels.cpu_module(), name) if kernels.enabled() else None
