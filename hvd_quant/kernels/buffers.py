"""Memory for kernel results that a framework wraps without a copy, reused step after step.

A graph framework (TensorFlow) cannot hand a kernel a buffer of its own to write into: a
``tf.numpy_function`` gets its inputs as arrays and must return its results as arrays,
and TensorFlow wraps a returned array without a copy only when it is 64-byte aligned
(``np.empty`` gives 16: then every result is copied into a fresh tensor). A fresh
100 MB result per step costs page faults on top of the kernel itself (see the README's
Speed section), so results go into buffers kept here instead.

A buffer is handed out again only once nothing holds it any more. Every array handed out
is a new view whose base is the kept buffer; numpy points every view of a view at that
same base, and a framework that wraps an array keeps a reference to it until its tensor
is freed (TensorFlow's numpy-backed tensors and DLPack capsules both do). So the kept
buffer's reference count says, exactly, whether some tensor or array still uses it. A
tensor that escapes the step (a result a user keeps) keeps its buffer; the next step
then gets another one. A ``tf.Variable`` assigned a result adopts its memory (TensorFlow
forwards the last reference to a tensor instead of copying it): state kept in variables
(error feedback) thus alternates between two buffers, with no copy and no allocation.
"""

import sys
import threading

import numpy as np

#: TensorFlow's (and Eigen's widest) alignment: an array aligned to it is wrapped, not copied.
ALIGN = 64


def _count_of_unheld():
    """``sys.getrefcount`` of a kept buffer that nothing else holds, as :meth:`KeptBuffers._free`
    sees it (measured, not assumed: interpreters count borrowed references differently)."""
    probe = KeptBuffers()
    probe._kept.setdefault(8, []).append(np.empty(8 + ALIGN, np.uint8))
    return probe._counts(8)[0]


class KeptBuffers:
    """Aligned numpy buffers for kernel results, each reused once nothing holds it.

    :meth:`empty` returns a fresh aligned view of a kept buffer of that many bytes that no
    array, tensor or variable uses any more, or of a new one. Buffers are never given
    back to the system while the process runs, except by :meth:`release`.
    """

    def __init__(self):
        self._kept = {}  # nbytes -> [uint8 arrays of nbytes + ALIGN bytes]
        self._lock = threading.Lock()

    def _counts(self, nbytes):
        return [sys.getrefcount(raw) for raw in self._kept.get(nbytes, ())]

    def empty(self, numel, dtype):
        """A C-contiguous, ``ALIGN``-aligned array of ``numel`` elements of ``dtype``
        (contents undefined), in memory no live array or tensor uses."""
        dtype = np.dtype(dtype)
        nbytes = int(numel) * dtype.itemsize
        with self._lock:
            raws = self._kept.setdefault(nbytes, [])
            counts = self._counts(nbytes)
            raw = next((r for r, c in zip(raws, counts) if c <= _UNHELD), None)
            if raw is None:
                raw = np.empty(nbytes + ALIGN, np.uint8)
                raws.append(raw)
        start = (-raw.ctypes.data) % ALIGN
        return raw[start:start + nbytes].view(dtype)

    def release(self):
        """Forget the buffers nothing holds (memory goes back to the system); those still
        in use are kept and reused later."""
        with self._lock:
            for nbytes in list(self._kept):
                counts = self._counts(nbytes)
                self._kept[nbytes] = [r for r, c in zip(self._kept[nbytes], counts) if c > _UNHELD]
                if not self._kept[nbytes]:
                    del self._kept[nbytes]

    def nbytes(self):
        """Bytes kept (held or not)."""
        with self._lock:
            return sum((n + ALIGN) * len(raws) for n, raws in self._kept.items())


_UNHELD = _count_of_unheld()

#: The process's buffers for kernel results (the TensorFlow adapter's).
RESULTS = KeptBuffers()
