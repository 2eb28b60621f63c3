"""Issue 54 diagnosis: what the compiled measured reduction's record (one tf.py_function
per step, ``Monitor.record_compiled``) and the step's end cost in Python, at one rank, on
the Keras benchmark's 29.3M-parameter model (a timing only: random tokens, no loss
reported), then a cProfile of the record. Run from the repository root:
``.venv/bin/python benchmarks/reference/keras-metrics-compiled-2026-12-08/record_cost.py``."""
import os, sys, time, statistics as st
sys.path.insert(0, "benchmarks")  # keras_bench_worker.build_model
import numpy as np, tensorflow as tf, keras
import horovod.tensorflow as hvd
hvd.init()
import hvd_quant.tensorflow as hq
from hvd_quant.tensorflow import monitoring
from keras_bench_worker import build_model
acc = {"record": [], "step_ended": []}
def timed(name, f):
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[name].append(time.perf_counter() - t)
    return g
monitoring.Monitor.record_compiled = timed("record", monitoring.Monitor.record_compiled)
monitoring.Monitor.step_ended = timed("step_ended", monitoring.Monitor.step_ended)
rng = np.random.default_rng(0)
B, S = 4, 16
x = rng.integers(0, 32000, (400, S)).astype("int32"); y = rng.integers(0, 32000, (400, S)).astype("int32")
m = build_model(keras, S)
opt = hq.DistributedOptimizer(keras.optimizers.Adam(1e-4), compression=hq.Compression.ef_sign, metrics=True, probe_every=0, report_after=0)
m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
m.fit(x, y, batch_size=B, epochs=1, verbose=0, shuffle=False)
for k, v in acc.items():
    print(k, len(v), "median %.3f ms" % (1e3 * st.median(v[5:])), "mean %.3f" % (1e3 * st.mean(v[5:])))
print({k: opt.metrics()[k] for k in ("encode_s", "wait_s", "decode_s", "sync_s", "update_s", "step_s")})
print(len(opt.metrics()), "buckets", len(opt._monitor.metrics.buckets))
import cProfile, pstats
orig = monitoring.Monitor.record_compiled
pr = cProfile.Profile()
def prof(*a, **k):
    pr.enable()
    try:
        return orig(*a, **k)
    finally:
        pr.disable()
monitoring.Monitor.record_compiled = prof
m.fit(x, y, batch_size=B, epochs=1, verbose=0, shuffle=False)
pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
