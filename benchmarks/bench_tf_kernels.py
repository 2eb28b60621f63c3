"""How the fused kernels reach TensorFlow tensors, timed: one process, one thread.

    .venv/bin/python benchmarks/bench_tf_kernels.py [--numel 29334272] [--repeats 7]

For a buffer of ``--numel`` floats (default: the 29.3M parameters of the Keras model in
``benchmarks/bench_keras.py``), one segment and the model's 18 per-tensor segments, the
median over ``--repeats`` calls (after two warm-up calls) of:

* the mechanisms themselves: an ``EagerTensor``'s memory as an array (``_numpy()``, and
  the copying ``numpy()``), an array back as a tensor (DLPack, ``tf.constant``,
  ``tf.convert_to_tensor``), a ``tf.numpy_function`` that passes a buffer through (kept
  aligned result, and a fresh unaligned one), and a TensorFlow copy for scale;
* each hot primitive of EF-SignSGD and Global-QSGD and a whole ``ef_sign`` reduction at one
  rank: the generic TensorFlow path, the kernels eagerly and the kernels in a
  ``tf.function``.

TensorFlow runs with one intra-op and one inter-op thread, and the kernels serially, as
a rank does with one core of its own.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HVD_QUANT_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvd_quant import kernels  # noqa: E402
from hvd_quant.core.packing import sign_residual, unpack_scaled_sum  # noqa: E402
from hvd_quant.core.segments import compensate_sums_signs  # noqa: E402
from hvd_quant.compressors import global_qsgd as gq  # noqa: E402
from hvd_quant.kernels.buffers import RESULTS  # noqa: E402
from hvd_quant.tensorflow.backend import TFBackend  # noqa: E402

#: The per-tensor sizes of bench_keras.py's model (embedding, 4 residual MLP blocks, head).
MODEL_COUNTS = ([32000 * 384] + [384 * 1536, 1536, 1536 * 384, 384] * 4 + [384 * 32000, 32000])


class Generic(TFBackend):
    def kernel(self, name, *tensors):
        return None


def timed(fn, repeats):
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        if hasattr(out, "numpy") or isinstance(out, (tuple, list)):
            tf.nest.map_structure(lambda v: v._numpy() if hasattr(v, "_numpy") else v, out)
        times.append(time.perf_counter() - t)
    return statistics.median(times), (max(times) - min(times))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=sum(MODEL_COUNTS))
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    kernels.warm_up()
    d = args.numel
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal(d).astype(np.float32))
    e = tf.constant(rng.standard_normal(d).astype(np.float32) * 0.1)
    kept = RESULTS.empty(d, np.float32)
    kept[:] = 1.0
    rows = []

    def row(label, fn):
        med, spread = timed(fn, args.repeats)
        rows.append((label, med, spread))
        print(f"{label:72s} {1e3 * med:9.2f} ms  (range {1e3 * spread:.2f})", flush=True)

    print(f"{d:,} floats ({4 * d / 1e6:.0f} MB), median of {args.repeats}; TensorFlow 1 thread, kernels serial")
    scale = tf.function(lambda t: t * 1.5)
    row("TensorFlow x * 1.5 into a fresh tensor (one pass, tf.function)", lambda: scale(x))
    row("EagerTensor._numpy(): its memory as an array", lambda: x._numpy())
    row("EagerTensor.numpy(): a copy", lambda: x.numpy())
    row("array -> tensor by DLPack (kept aligned buffer)", lambda: tf.experimental.dlpack.from_dlpack(kept.__dlpack__()))
    row("array -> tensor by tf.constant", lambda: tf.constant(kept))
    row("array -> tensor by tf.convert_to_tensor", lambda: tf.convert_to_tensor(kept))
    fresh = tf.function(lambda t: tf.numpy_function(lambda a: np.empty(a.size, np.float32), [t], tf.float32,
                                                    stateful=False))
    row("tf.numpy_function returning a fresh np.empty (unaligned: copied)", lambda: fresh(x))
    same = tf.function(lambda t: tf.numpy_function(lambda a: kept, [t], tf.float32, stateful=False))
    row("tf.numpy_function returning a kept aligned buffer (wrapped)", lambda: same(x))

    T, G = TFBackend(), Generic()
    for counts_label, counts in (("1 segment", [d]), ("18 segments", MODEL_COUNTS if sum(MODEL_COUNTS) == d else [d])):
        scales = tf.constant(np.linspace(0.5, 1.5, len(counts)).astype(np.float32))
        for label, B in (("generic TF", G), ("kernels", T)):
            sums_signs = lambda B=B: compensate_sums_signs(B, x, e, counts)  # noqa: E731
            resid = lambda B=B: sign_residual(B, x, e, scales, counts, out=e)  # noqa: E731
            bits = compensate_sums_signs(T, x, e, counts)[1]
            allbits = tf.concat([bits, bits], 0)
            allscales = tf.concat([scales, scales], 0) * 0.5
            decode = lambda B=B: unpack_scaled_sum(B, allbits, allscales, counts, d)  # noqa: E731
            for name, fn in (("sums + signs", sums_signs), ("residual", resid), ("decode 2 rows", decode)):
                row(f"{counts_label:11s} {name:14s} {label:10s} eager", fn)
                row(f"{counts_label:11s} {name:14s} {label:10s} tf.function", tf.function(fn))
    for label, B in (("generic TF", G), ("kernels", T)):
        fn = lambda B=B: gq.absmax_finite(B, x)  # noqa: E731
        row(f"global_qsgd absmax    {label:10s} eager", fn)
        row(f"global_qsgd absmax    {label:10s} tf.function", tf.function(fn))


if __name__ == "__main__":
    main()
