"""Fused kernels: the hot paths of every method as one-pass CPU loops.

The algorithms are written once against :class:`~hvd_quant.core.backend.Backend`. A few
steps of them are *fused primitives*: named operations that a generic implementation
builds from several backend operations (several passes over memory, full-size int32 or
float temporaries), and that a fast kernel does in one pass. Each generic implementation
asks ``B.kernel(name, *tensors)`` first and uses the fast one when the backend offers it:

=========================== =============================================== ===============================
primitive                   generic twin                                    used by
=========================== =============================================== ===============================
``sign_pack``               ``core.packing.pack_signs``                     every sign method
``sign_pack_residual``      ``core.packing.sign_pack_residual``             marsit, onebit
``unpack_scaled_sum``       ``core.packing.unpack_scaled_sum``              marsit, onebit, BinSGDM
``compensate_sums``         ``core.segments.compensate_sums``               global_qsgd, marsit, onebit
``compensate_sums_signs``   ``core.segments.compensate_sums_signs``         ef_sign, marsit, onebit
``sign_residual``           ``core.packing.sign_residual``                  onebit (server residual)
``unpack_sum_residual``     ``core.packing.unpack_sum_residual``            ef_sign, marsit, onebit
``unpack_sums_signs``       ``core.packing.unpack_sums_signs``              onebit (server stage)
``absmax_finite``           ``compressors.global_qsgd.absmax_finite``       global_qsgd(_exp)
``quantize_lanes``          ``compressors.global_qsgd.quantize``            global_qsgd (int32 lanes)
``quantize_ints``           ``compressors.global_qsgd.quantize``            global_qsgd (native ints)
``dequantize_lanes``        ``compressors.global_qsgd.dequantize``          global_qsgd (int32 lanes)
``dequantize_ints``         ``compressors.global_qsgd.dequantize``          global_qsgd (native ints)
``block_absmax_finite``     ``compressors.global_qsgd.block_absmax_finite`` global_qsgd (a scale per block)
``quantize_lanes_blocks``   ``compressors.global_qsgd.quantize_blocks``     global_qsgd (blocks, lanes)
``quantize_ints_blocks``    ``compressors.global_qsgd.quantize_blocks``     global_qsgd, qsgd (blocks)
``dequantize_lanes_blocks`` ``compressors.global_qsgd.dequantize``          global_qsgd (blocks, lanes)
``dequantize_ints_blocks``  ``compressors.global_qsgd.dequantize``          global_qsgd, qsgd (blocks)
``exp_encode``              ``compressors.exp_dithering.exp_encode``        global_qsgd_exp
``exp_combine``             ``compressors.exp_dithering.combine_codes``     global_qsgd_exp (every hop)
``exp_decode``              ``compressors.exp_dithering.exp_decode``        global_qsgd_exp
``marsit_select``           ``compressors.marsit.MarsitSelect``             marsit (every hop)
``rebinarize``              ``core.hierarchical.threshold_rows``            BinSGDM (k not 2**L)
``binsgdm_encode``          ``optimizers.binsgdm.binary_randomize``         BinSGDM
``all_finite``              ``Backend.all_finite``                          every non-finite check
``ema``                     ``optimizers.elementwise.ema``                  1-bit Adam, 0/1 Adam
``descend``                 ``optimizers.elementwise.descend``              BinSGDM
``adam_descend``            ``optimizers.elementwise.adam_descend``         1-bit Adam, 0/1 Adam
``precondition``            ``optimizers.elementwise.precondition``         0/1 Adam (final sync)
``zero_one_sync_input``     ``optimizers.elementwise.zero_one_sync_input``  0/1 Adam (sync)
``zero_one_sync_result``    ``optimizers.elementwise.zero_one_sync_result`` 0/1 Adam (sync)
``uniform``                 ``Backend.uniform``                             random draws
``random_bytes``            ``core.rng.random_bytes``                       random bit planes
=========================== =============================================== ===============================

Fast kernels exist for CPU tensors (numba, :mod:`hvd_quant.kernels.cpu`): the torch
backend uses them for CPU tensors (zero-copy numpy views), the TensorFlow backend for CPU
tensors eagerly and inside ``tf.function`` (:mod:`hvd_quant.tensorflow.kernels`: DLPack
and ``tf.numpy_function``, results in buffers kept from step to step,
:mod:`hvd_quant.kernels.buffers`, declared ahead by :mod:`hvd_quant.kernels.signatures`).
For CUDA tensors the torch backend uses their Triton twins (:mod:`hvd_quant.kernels.gpu`:
every primitive here but ``add_rows``, the same bits; Triton is imported when CUDA
tensors first arrive, :func:`gpu_module`). TensorFlow GPU tensors and XLA-compiled
functions keep the generic path; the numpy backend is the oracle and never uses them
(:class:`~hvd_quant.core.backend.NumpyKernelBackend` does, for tests and benchmarks).
Random draws come from the counter-based generator of :mod:`hvd_quant.core.rng`, so
kernel and oracle draw identical numbers whatever the thread count. Set
``HVD_QUANT_KERNELS=0`` to force the generic path everywhere (GPU too).

This package is the ground floor of the layers (kernels, core, methods, adapters): it
depends on none of the layers above it; the backends that call it (``NumpyKernelBackend``,
the torch and TensorFlow backends) sit above and reach down to it.
"""

import os
import threading
import time

from . import threads

#: Every fused primitive with a fast CPU kernel (and a Triton one, :mod:`hvd_quant.kernels.gpu`).
NAMES = ("sign_pack", "sign_pack_residual", "unpack_scaled_sum", "compensate_sums",
         "compensate_sums_signs", "sign_residual", "unpack_sum_residual", "unpack_sums_signs",
         "absmax_finite", "quantize_lanes", "quantize_ints", "dequantize_lanes", "dequantize_ints",
         "block_absmax_finite", "quantize_lanes_blocks", "quantize_ints_blocks",
         "dequantize_lanes_blocks", "dequantize_ints_blocks", "exp_encode", "exp_combine", "exp_decode",
         "marsit_select", "rebinarize", "binsgdm_encode", "uniform", "random_bytes", "all_finite",
         "ema", "descend", "adam_descend", "precondition", "zero_one_sync_input",
         "zero_one_sync_result")

_cpu = None
_state = {"checked": False, "ok": False, "why": "", "prepared": False}
_gpu = {"checked": False, "module": None, "why": "", "launch_read": False}
_gpu_lock = threading.RLock()
_gpu_interpreted = None


def enabled():
    """True when the numba kernels can be used (numba imports and they are not disabled
    with ``HVD_QUANT_KERNELS=0``). The first call applies the thread policy
    (:mod:`hvd_quant.kernels.threads`) before numba is imported, and logs a warning with
    the reason once if the kernels cannot be used."""
    def load():
        threads.configure()
        cpu_module()
        _state["ok"] = True

    _check_once(_state, load, ImportError,  # numba missing: the generic path still works
                lambda exc: f"numba is not importable ({exc})",
                "hvd_quant: fused CPU kernels off, %s; the generic path runs instead, several "
                "times slower: pip install 'numba>=0.60'")
    return _state["ok"]


def _check_once(state, load, errors, why, advice):
    """On the first call for ``state`` (the CPU or the GPU kernels' record): unless
    ``HVD_QUANT_KERNELS=0`` switches every kernel off, ``load()`` them; if that raises one
    of ``errors``, record ``why(exc)`` in ``state["why"]`` and log ``advice`` (a format
    with one ``%s``, the reason) once as a warning. The generic path runs instead."""
    if state["checked"]:
        return
    state["checked"] = True
    if os.environ.get("HVD_QUANT_KERNELS", "1") == "0":
        state["why"] = "disabled by HVD_QUANT_KERNELS=0"
        return
    try:
        load()
    except errors as exc:
        state["why"] = why(exc)
        threads.log.warning(advice, state["why"])


def why_disabled():
    enabled()
    return _state["why"]


def cpu_module():
    global _cpu
    if _cpu is None:
        from . import cpu
        threads.apply_to(cpu)
        _cpu = cpu
    return _cpu


def gpu_module():
    """The Triton kernels (:mod:`hvd_quant.kernels.gpu`), imported on the first call (the
    torch backend calls it when CUDA tensors first arrive, never at ``import hvd_quant``);
    ``None`` when they cannot be used: ``HVD_QUANT_KERNELS=0``, or Triton missing or
    broken, which is logged once as a warning with the reason (CUDA tensors then take the
    generic path, plain torch operations)."""
    def load():
        from . import gpu
        _gpu["module"] = gpu

    with _gpu_lock:
        _check_once(_gpu, load, Exception,  # ImportError, or a Triton that fails to load
                    lambda exc: f"Triton is not usable ({type(exc).__name__}: {exc})",
                    "hvd_quant: fused GPU kernels off, %s; CUDA tensors take the generic path "
                    "instead (plain torch operations, several passes per primitive): install "
                    "the Triton that matches your torch (pip install triton)")
        if _gpu["module"] is not None and not _gpu.get("launch_read"):
            _gpu["module"].launch_from_env()  # a bad HVD_QUANT_GPU_LAUNCH raises to the caller
            _gpu["launch_read"] = True
    return _gpu["module"]


def why_gpu_disabled():
    gpu_module()
    return _gpu["why"]


def gpu_interpreted():
    """A second copy of :mod:`hvd_quant.kernels.gpu` whose kernels run under Triton's
    interpreter, on CPU tensors (tests and ``benchmarks/bench_gpu.py --interpret``).

    Triton decides when a kernel is defined whether the interpreter runs it, and its own
    library kernels (the combine functions of ``tl.sum``, ...) must be interpreted too: so
    Triton is imported here with ``TRITON_INTERPRET=1`` set for that moment only, and the
    module executed again under another name; the real module is not touched. This must
    come before anything else in the process imports Triton (``RuntimeError`` otherwise);
    a process that uses it does not compile Triton kernels for a GPU. The interpreter
    patches ``triton.language`` while a kernel runs: call these from one thread at a time.
    """
    global _gpu_interpreted
    with _gpu_lock:
        if _gpu_interpreted is None:
            import importlib.util
            import sys

            if "triton" in sys.modules and not _triton_interpreted():
                raise RuntimeError("Triton was imported before without TRITON_INTERPRET=1: its library "
                                   "kernels cannot run under the interpreter in this process")
            name = __name__ + "._gpu_interpreted"
            spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), "gpu.py"))
            module = importlib.util.module_from_spec(spec)
            before = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1"
            try:
                import triton.experimental.gluon  # noqa: F401  (else imported by the first launch)
                import triton.language  # noqa: F401

                spec.loader.exec_module(module)
                _direct_device_functions(module)
            finally:
                if before is None:
                    del os.environ["TRITON_INTERPRET"]
                else:
                    os.environ["TRITON_INTERPRET"] = before
            _gpu_interpreted = module
    return _gpu_interpreted


def _direct_device_functions(module):
    """Under the interpreter, call device functions (every jit function of ``module`` but
    its kernels, ``*_k``, and Triton's own library functions: ``tl.sum``, ``tl.max``, ...)
    as the interpreter's rewritten Python functions. Its nested call patches
    ``triton.language`` anew at each call, which was most of the kernels' time here (the
    tests' cost); a kernel's launch patches it once for the whole run, ``triton.language.
    core`` included once the module names it. The same code runs, so the same results."""
    import triton.language as tl
    import triton.language.standard as standard

    module._tl_core = tl.core  # the launch then patches the core builtins the library calls
    for namespace, keep in ((module, lambda key: key.endswith("_k")), (tl, None), (standard, None)):
        for key, value in list(vars(namespace).items()):
            if type(value).__name__ == "InterpretedFunction" and not (keep and keep(key)):
                setattr(namespace, key, value.rewrite())


def _triton_interpreted():
    """Whether the Triton in this process was imported for the interpreter."""
    import triton.language.standard as standard

    return type(getattr(standard, "cdiv", None)).__name__ != "JITFunction"


def set_threads(n):
    """Use ``n`` kernel threads per rank (``None``: back to the environment and the
    policy); see :mod:`hvd_quant.kernels.threads`. Returns the choice in effect."""
    return threads.set_threads(n)


def _warm_flavour(k):
    import numpy as np

    x = np.linspace(-1, 1, 24, dtype=np.float32)
    bounds = np.array([0, 10, 24], np.int64)
    bits = k.sign_pack(x)
    k.sign_pack_residual(x, None, np.ones(2, np.float32), bounds)
    k.sign_pack_residual(x, x.copy(), np.ones(2, np.float32), bounds)
    k.unpack_scaled_sum(np.stack([bits, bits]), np.ones((2, 2), np.float32), bounds, 24,
                        base=np.zeros(24, np.float32))
    k.unpack_scaled_sum(np.stack([bits, bits]), np.ones((2, 2), np.float32), bounds, 24,
                        base=np.zeros(24, np.float32), base_scales=np.ones(2, np.float32))
    k.unpack_scaled_sum(bits, np.ones(2, np.float32), bounds, 24)
    k.compensate_sums(x, x.copy(), bounds)
    k.compensate_sums(x, None, bounds, squares=True)
    for e in (None, x.copy()):
        k.compensate_sums_signs(x, e, bounds)
        k.sign_residual(x, e, np.ones(2, np.float32), bounds)
        k.sign_residual(x, e, np.ones(2, np.float32), bounds, out=e)
        k.unpack_sum_residual(np.stack([bits, bits]), np.ones((2, 2), np.float32), bounds, 24,
                              x.copy(), e, np.ones(2, np.float32), resid_out=e)
        k.unpack_sum_residual(np.stack([bits, bits]), np.ones((2, 2), np.float32), bounds, 24,
                              x, e, np.ones(2, np.float32))
    aligned = np.array([0, 8, 24], np.int64)  # whole bytes: the fused path itself
    for scales in (None, np.ones(2, np.float32)):
        for squares in (False, True):
            base = x.copy()
            k.unpack_sums_signs(np.stack([bits, bits]), np.ones((2, 2), np.float32), aligned, 24,
                                base=base, base_scales=scales, out=base, squares=squares)
    k.unpack_sums_signs(bits, np.ones(2, np.float32), aligned, 24)
    k.absmax_finite(x)
    for width in (8, 16):
        w = k.quantize_lanes(x, 1.0, 1.0, 3, 1, width, True)
        k.dequantize_lanes(w, 24, width, 0.5)
    for dtype in (np.int8, np.int16, np.int32):
        k.dequantize_ints(k.quantize_ints(x, 1.0, 1.0, 3, 1, dtype), 0.5)
    ones = np.ones(3, np.float32)  # three blocks of 8
    k.block_absmax_finite(x, 8)
    for width in (8, 16):
        k.dequantize_lanes_blocks(k.quantize_lanes_blocks(x, ones, ones, 8, 3, 1, width, True), 24, width, ones, 8)
    for dtype in (np.int8, np.int16, np.int32):
        k.dequantize_ints_blocks(k.quantize_ints_blocks(x, ones, ones, 8, 3, 1, dtype), ones, 8)
    codes = k.exp_encode(x, 1.0, 2, 1)
    k.exp_decode(k.exp_combine(codes, codes, 2), 1.0, 1.0)
    k.marsit_select(bits, bits, 0.5, 3)
    k.rebinarize(np.concatenate([bits, bits]), 2, 7)
    k.binsgdm_encode(x, x.copy(), np.abs(x), 0.9, 5)
    k.uniform(1, 8)
    k.random_bytes(1, 9)
    k.all_finite(x)
    v = np.abs(x)
    k.ema(x, x, 0.9)
    k.ema(v, x, 0.999, square=True)
    k.descend(x, x, 0.1, 0.0)
    k.descend(x.copy(), x, 0.1, 0.0, in_place=True)
    for acc in (None, x.copy()):
        k.adam_descend(x, x, v, 0.1, 1e-8, 0.0, acc)
        y = x.copy()
        k.adam_descend(y, x, v, 0.1, 1e-8, 0.0, acc, x_out=y, acc_out=acc)  # in place
    k.ema(x.copy(), x, 0.9, in_place=True)
    k.zero_one_sync_result(x, k.precondition(x, v, 1e-8), x, v, 1e-8, 0.1)
    k.zero_one_sync_result(x, None, x, v, 1e-8, 0.1)
    k.zero_one_sync_input(x, x, x, v, x, 0.9, 0.1, 1e-8, 0.0)
    for index_dtype in (np.int32, np.int64):  # Keras' embedding gradients: int32 or int64 rows
        k.add_rows(np.zeros((4, 6), np.float32), np.array([1, 3], index_dtype), x[:12].reshape(2, 6))


def warm_up(flavours="in use"):
    """Compile (or load from numba's on-disk cache) every kernel now, so that the first
    training step does not pay for it. Returns the seconds it took.

    ``flavours``: ``"in use"`` (the serial or parallel twins, whichever the thread policy
    picked), ``"serial"`` or ``"parallel"`` (one of them), or ``"all"`` (both: what
    ``scripts/bootstrap.sh`` makes sure of once per machine, so that no rank ever compiles,
    whatever its thread count; it compiles the two in two processes at once, since the
    twins are cached under different names). A fresh machine pays about a second per
    kernel signature once; later processes load the cached machine code.
    """
    flags = {"all": (True, False), "serial": (True,), "parallel": (False,), "in use": None}
    if flavours not in flags:
        raise ValueError(f"flavours must be one of {sorted(flags)}, got {flavours!r}")
    if not enabled():
        return 0.0
    start = time.perf_counter()
    k = cpu_module()
    if flags[flavours] is None:
        _warm_flavour(k)
    else:
        serial = k._SERIAL[0]
        try:
            for flag in flags[flavours]:
                k.use_serial(flag)
                _warm_flavour(k)
        finally:
            k.use_serial(serial)
    return time.perf_counter() - start


def prepare():
    """Everything a process needs before its first step, once: the thread policy
    (re-decided on every call: Horovod may know the ranks on this host by now) and the
    kernels loaded (on the first call). Called by the adapters when an optimizer, tape or
    compressor is set up. Returns the seconds the kernels took to load (0.0 after the first call)."""
    if os.environ.get("HVD_QUANT_KERNELS", "1") != "0":
        threads.configure()  # cheap (a few small files): Horovod may be initialised by now
    if _state["prepared"]:
        return 0.0
    _state["prepared"] = True
    return warm_up()


def loaded_signatures():
    """How many kernel signatures this process has compiled or loaded from the cache so
    far (both twins). Constant during training once :func:`prepare` has run: the tests
    check that no step compiles or loads a kernel."""
    return sum(len(d.signatures) for d in dispatchers())


def dispatchers():
    """Every numba dispatcher of the CPU kernels loaded in this process (both twins, and
    the helpers they inline); none before the kernels are loaded."""
    if _cpu is None:
        return []
    from numba.core.registry import CPUDispatcher

    found = []
    for value in vars(_cpu).values():
        if isinstance(value, _cpu._Twin):
            found += value.dispatchers()
        elif isinstance(value, CPUDispatcher):
            found.append(value)
    for kernels_of_width in _cpu._LANES.values():
        found += [d for twin in kernels_of_width for d in twin.dispatchers()]
    return found

