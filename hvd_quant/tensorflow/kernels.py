"""The fused CPU kernels (:mod:`hvd_quant.kernels`) on TensorFlow tensors, eagerly and in graphs.

How, and why this way
---------------------
The numba kernels take numpy arrays. Measured on this project's 2-core machine, one
thread, a 29.3M-float (117 MB) tensor (``benchmarks/bench_tf_kernels.py``, median of 9;
a TensorFlow pass over it writing a fresh tensor: 6 ms):

====================================================================  =========
an ``EagerTensor``'s memory as a writable array (``_numpy()``)           0.00 ms
``EagerTensor.numpy()`` (documented to copy)                             10.9 ms
an aligned array as a tensor by DLPack (``from_dlpack``)                 0.00 ms
the same by ``tf.constant`` / ``tf.convert_to_tensor`` (copies)          16.3 ms
``tf.numpy_function`` in a graph returning a kept 64-byte-aligned array   0.13 ms
the same returning a fresh ``np.empty`` (16-byte aligned: copied)         4.9 ms
====================================================================  =========

Inside ``tf.function`` a ``numpy_function``'s inputs arrive as arrays over the tensors'
own memory (no copy; eagerly, ``tf.numpy_function`` copies them, so eager calls go
direct). So both directions are zero-copy without a compiled TensorFlow op, and a C++
custom op (built at set-up from ``tf.sysconfig`` flags) would add a compiler step to
``scripts/bootstrap.sh`` for no time saved; it would only have given in-place variable
updates with TensorFlow's own locking, which adoption (below) gives without one. The
kernels then run at their numpy speed (the model's 18 per-tensor segments; generic
TensorFlow in a ``tf.function`` / kernels in a ``tf.function``): EF-SignSGD's sums and
signs 76 / 9.8 ms, its residual 304 / 9.4 ms, decoding two ranks' signs 424 / 14.3 ms,
Global-QSGD's absolute maximum 14.8 / 4.3 ms; eager calls cost the same as in graphs.

What :meth:`TFBackend.kernel <hvd_quant.tensorflow.backend.TFBackend.kernel>` returns
for a fused primitive is a callable with the numpy kernel's signature that takes and
returns TensorFlow tensors:

* **eagerly**, the kernel runs on the tensors' own memory (``EagerTensor._numpy()``: a
  writable array over the tensor's buffer; ``numpy()`` would copy) and its results come
  back through DLPack, without a copy;
* **in a graph** (``tf.function``, ``model.fit``), the kernel runs inside a
  ``tf.numpy_function`` op, which hands it its input tensors' memory as arrays and wraps
  the arrays it returns without a copy when they are 64-byte aligned. The op is
  declared stateless: a kernel never writes into its inputs (below), so the op is a pure
  function of them and TensorFlow's executor may run it as soon as its inputs are ready,
  e.g. while a ring hop is on the wire.

Results go into buffers kept from step to step (:mod:`hvd_quant.kernels.buffers`): a
buffer is reused once no tensor holds it (its reference count says so), so no full-size
result is allocated per step, and a result a caller keeps is never overwritten. The
fused gradient buffer itself (every gradient concatenated, an ``Embedding``'s
``IndexedSlices`` made dense in place) is one more kept buffer, written in one pass by
:func:`flatten`. ``hvd_quant.kernels.buffers.RESULTS.release()`` returns the buffers no
tensor holds (e.g. between two models in one process).

Kernels run with the default floating-point environment (:func:`ieee_floats`):
TensorFlow's threads flush subnormals to zero, numpy, torch and the kernels do not, and
the kernels must give the oracle's bits.

State updated in place. A kernel is never given a tensor's memory to write into, not even
``out=`` over a compressor's residual (as the torch backend does): in TensorFlow a tensor
read from a ``tf.Variable`` shares the variable's buffer, and writing it behind
TensorFlow's back would change any other tensor read from it. The new residual goes to a
kept buffer instead, and ``var.assign(result)`` *adopts* that buffer (TensorFlow forwards
a tensor's last reference into the variable instead of copying; measured eagerly and in
graphs, through ``tf.cond``). Each piece of state thus alternates between two buffers,
with no copy and no allocation per step, for twice the state's memory; where TensorFlow
cannot forward (another op still reads the result), it copies, as for any assignment.

Where the generic path runs instead, with the reason logged once per process: kernels
off (``HVD_QUANT_KERNELS=0``, numba missing), a function XLA compiles (``jit_compile``:
``numpy_function`` cannot be compiled), GPU tensors (and graph tensors not placed on the
CPU while a GPU is visible), and, in graphs only, ``descend``, ``adam_descend`` and
``zero_one_sync_result``, whose callers in :mod:`hvd_quant.optimizers.elementwise` turn
the learning rate into a Python ``float`` before the call, which a graph tensor cannot
be (eagerly they are fused).
"""

import contextlib
import ctypes
import ctypes.util
import logging
import threading

import numpy as np
import tensorflow as tf

from .. import kernels as _kernels
from ..kernels.buffers import RESULTS
from ..kernels.signatures import SIGNATURES, bind, output_dtype
from .xla_step import in_xla_context

log = logging.getLogger("hvd_quant")

#: Results smaller than this come back as copies (``tf.constant``); larger ones by DLPack.
_SMALL_BYTES = 4096

_logged = set()
# One kernel at a time per process: with several kernel threads, two TensorFlow ops
# running kernels at once would each start a parallel region on the rank's cores.
_lock = threading.Lock()
_gpus = []


def _libm():
    for name in ("libm.so.6", None):  # glibc's name first: find_library runs ldconfig
        try:
            lib = ctypes.CDLL(name or ctypes.util.find_library("m") or "libm.so")
        except OSError:
            continue
        if hasattr(lib, "fegetenv") and hasattr(lib, "fesetenv"):
            return lib
    return None


_LIBM = _libm()
_FE_DFL_ENV = ctypes.c_void_p(-1)  # glibc's FE_DFL_ENV, ((const fenv_t *) -1)


@contextlib.contextmanager
def ieee_floats():
    """The calling thread's floating-point environment at its default while the block
    runs: IEEE subnormals, round to nearest. TensorFlow's executor threads run with
    flush-to-zero and denormals-are-zero set, under which a kernel would read
    ``-1e-45 >= 0`` as true; the numpy oracle and torch do not flush, and neither do the
    kernels. (Without glibc's ``fesetenv``: the environment is left as it is.)"""
    if _LIBM is None:
        yield
        return
    saved = ctypes.create_string_buffer(64)  # fenv_t: 28 bytes on x86-64, 8 on aarch64
    _LIBM.fegetenv(saved)
    _LIBM.fesetenv(_FE_DFL_ENV)
    try:
        yield
    finally:
        _LIBM.fesetenv(saved)


def _log_once(reason, level=logging.WARNING):
    if reason not in _logged:
        _logged.add(reason)
        log.log(level, "hvd_quant: fused kernels not used %s; the generic TensorFlow path runs "
                "instead", reason)


def _gpu_visible():
    if not _gpus:
        _gpus.append(bool(tf.config.list_logical_devices("GPU")))
    return _gpus[0]


def _on_gpu(t):
    device = (getattr(t, "device", "") or "").upper()
    if "GPU" in device:
        return True
    return not tf.executing_eagerly() and "CPU" not in device and _gpu_visible()


def why_not(name, tensors=()):
    """Why ``name`` cannot run as a kernel on ``tensors`` here (``""`` when it can)."""
    if not _kernels.enabled():
        return f"({_kernels.why_disabled()})"
    if in_xla_context():
        return "inside a function XLA compiles (jit_compile): numpy_function cannot be compiled"
    if any(tf.is_tensor(t) and _on_gpu(t) for t in tensors):
        return "on GPU tensors (the kernels are CPU code)"
    return ""


def kernel(name, tensors=()):
    """The fused kernel ``name`` as a callable on TensorFlow tensors, or ``None`` (logged
    once per reason) where it cannot run; see the module docstring."""
    if not _kernels.enabled():  # off by choice, or numba missing (enabled() logged that)
        return None
    reason = why_not(name, tensors)
    if reason:  # ours to fix, not the user's: at INFO (GPU and XLA: a warning)
        _log_once(reason, logging.WARNING)
        return None
    fn = getattr(_kernels.cpu_module(), name)
    sig = SIGNATURES[name]

    def call(*args, **kwargs):
        arguments = bind(fn, args, kwargs)
        for out in sig.outputs:  # results go to kept buffers, never into a caller's tensor
            if out.keyword is not None:
                arguments[out.keyword] = None
        if tf.executing_eagerly():
            return _eager(fn, sig, arguments)
        return _graph(name, fn, sig, arguments)
    return call


# --- the call itself (numpy arrays in, numpy arrays out) ----------------------------------------
def _run(fn, sig, arguments):
    """Call ``fn`` on numpy ``arguments`` with every result in a kept buffer; the results
    as a list of arrays of the declared dtypes."""
    for out in sig.outputs:
        if out.keyword is not None:
            numel = out.numel(arguments, np.size)
            if numel:
                arguments[out.keyword] = RESULTS.empty(numel, output_dtype(out, arguments))
    if sig.in_place is not None:
        arguments[sig.in_place] = False  # every result has a buffer of its own now
    with _lock, ieee_floats():
        _kernels.threads.apply_in_thread()  # numba's thread count is per thread
        result = fn(**arguments)
    result = result if isinstance(result, tuple) else (result,)
    return [np.asarray(r, dtype=output_dtype(o, arguments)) for r, o in zip(result, sig.outputs)]


def _number(array):
    """A one-element array as a Python number (what the kernels take as scalars)."""
    return np.asarray(array).reshape(-1)[0].item()


def _is_tensor(value):
    return tf.is_tensor(value) or isinstance(value, tf.Variable)


# --- eagerly --------------------------------------------------------------------------------------
def _eager(fn, sig, arguments):
    for key, value in arguments.items():
        if _is_tensor(value):
            array = tf.convert_to_tensor(value)._numpy()  # the tensor's memory, no copy
            arguments[key] = _number(array) if key in sig.scalars else array
    results = [_to_eager(a) for a in _run(fn, sig, arguments)]
    return results[0] if len(results) == 1 else tuple(results)


def _to_eager(array):
    if array.nbytes < _SMALL_BYTES or array.ctypes.data % 64:
        return tf.constant(array)
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())  # shares the kept buffer


# --- in a graph -----------------------------------------------------------------------------------
def _static_numel(value):
    if _is_tensor(value):
        n = value.shape.num_elements()
        if n is None:
            raise ValueError("hvd_quant needs tensors with static shapes under tf.function")
        return n
    return int(np.size(value))


def _graph(name, fn, sig, arguments):
    inputs = [key for key, value in arguments.items() if _is_tensor(value)]
    fixed = {key: value for key, value in arguments.items() if key not in inputs}
    specs = [(output_dtype(o, arguments), None if o.numel is None else o.numel(arguments, _static_numel))
             for o in sig.outputs]

    def body(*arrays):
        call = dict(fixed)
        for key, array in zip(inputs, arrays):
            call[key] = _number(array) if key in sig.scalars else array
        return _run(fn, sig, call)

    outs = tf.numpy_function(body, [arguments[k] for k in inputs], [tf.as_dtype(d) for d, _ in specs],
                             stateful=False, name=f"hvd_quant_{name}")
    for t, (_, numel) in zip(outs, specs):
        t.set_shape([] if numel is None else [numel])
    return outs[0] if len(outs) == 1 else tuple(outs)


# --- the fused buffer ---------------------------------------------------------------------------
def flatten(grads, shapes):
    """One flat float32 tensor of ``grads`` (dense tensors, ``tf.IndexedSlices`` made
    dense, ``None`` as zeros; ``shapes`` are their variables' static shapes), written into
    a kept buffer by one ``numpy_function`` (no fresh concatenation and no fresh dense
    copy of an embedding's gradient per step), or ``None`` where the kernels cannot run
    here or a gradient is not float32 (the caller's generic ``tf.concat`` then runs).

    Bit-identical to ``tf.concat`` of ``tf.convert_to_tensor`` of each: an
    ``IndexedSlices``' rows are added over zeros in index order
    (:func:`hvd_quant.kernels.cpu.add_rows`), as TensorFlow's CPU segment sum adds them.
    """
    dense = [g for g in grads if g is not None and not isinstance(g, tf.IndexedSlices)]
    sparse = [g for g in grads if isinstance(g, tf.IndexedSlices)]
    if any(t.dtype != tf.float32 for t in dense + [g.values for g in sparse]) or not _kernels.enabled():
        return None
    if why_not("flatten", dense + [g.values for g in sparse]):
        return None  # logged by the kernels this step runs
    layout, inputs, total = [], [], 0
    for g, shape in zip(grads, shapes):
        numel = int(np.prod(shape))
        if g is None:
            layout.append(("zeros", total, numel, None))
        elif isinstance(g, tf.IndexedSlices):
            layout.append(("rows", total, numel, (int(shape[0]), numel // max(1, int(shape[0])))))
            inputs += [g.values, g.indices]
        else:
            layout.append(("dense", total, numel, None))
            inputs.append(g)
        total += numel
    add_rows = _kernels.cpu_module().add_rows

    def body(*arrays):
        out = RESULTS.empty(total, np.float32)
        arrays = iter(arrays)
        with _lock, ieee_floats():
            for kind, start, numel, rows in layout:
                part = out[start:start + numel]
                if kind == "dense":
                    np.copyto(part, next(arrays).reshape(-1))
                else:
                    part.fill(0.0)
                    if kind == "rows":
                        values, indices = next(arrays), next(arrays)
                        add_rows(part.reshape(rows), indices.reshape(-1), values.reshape(indices.size, rows[1]))
        return out

    if tf.executing_eagerly():
        return _to_eager(body(*(tf.convert_to_tensor(t)._numpy() for t in inputs)))
    flat = tf.numpy_function(body, inputs, tf.float32, stateful=False, name="hvd_quant_flatten")
    flat.set_shape([total])
    return flat


# --- set-up -----------------------------------------------------------------------------------------
@tf.autograph.experimental.do_not_convert  # may be called while tracing: plain Python
def prepare_kernels():
    """Set-up time, before the first step: the kernels' thread policy and the kernels
    loaded (:func:`hvd_quant.kernels.prepare`), and one warning if TensorFlow's own intra-op
    threads oversubscribe the host (by default each rank's TensorFlow uses every core
    it may run on)."""
    _kernels.prepare()
    intra = tf.config.threading.get_intra_op_parallelism_threads() or _kernels.threads.affinity_cores()
    _kernels.threads.warn_oversubscribed(
        "TensorFlow", intra, "tf.config.threading.set_intra_op_parallelism_threads({share}) "
        "(and set_inter_op_parallelism_threads) before the first TensorFlow op")
