"""The reduced buffer cut into the Keras benchmark model's 19 gradients, eagerly: a slice
per variable (before) against one ``tf.split`` (hvd_quant.tensorflow.tape.reduce_gradients
since this folder), medians of 200 alternating calls, one thread; and that both give the
same values. ``python split.py``"""
import time

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
VOCAB, DIM, FF, BLOCKS = 32000, 384, 1536, 4  # benchmarks/keras_bench_worker.py's model
shapes = [(VOCAB, DIM)] + [s for _ in range(BLOCKS) for s in ((DIM, FF), (FF,), (FF, DIM), (DIM,))] + [(DIM, VOCAB), (VOCAB,)]
sizes = [int(np.prod(s)) for s in shapes]
mean = tf.random.normal([sum(sizes)], seed=0)


def sliced():
    out, offset = [], 0
    for shape, n in zip(shapes, sizes):
        out.append(tf.cast(tf.reshape(mean[offset:offset + n], shape), tf.float32))
        offset += n
    return out


def split():
    return [tf.cast(tf.reshape(p, s), tf.float32) for p, s in zip(tf.split(mean, sizes), shapes)]


for f in (sliced, split):
    f()
times = {"a slice per variable": [], "one tf.split": []}
for _ in range(200):
    for name, f in zip(times, (sliced, split)):
        t = time.perf_counter()
        f()
        times[name].append(time.perf_counter() - t)
print(f"{len(shapes)} tensors, {sum(sizes):,} elements: " + ", ".join(
    f"{name} {1e3 * np.median(v):.2f} ms" for name, v in times.items()))
print("the same values:", all(bool(tf.reduce_all(a == b)) for a, b in zip(sliced(), split())))
