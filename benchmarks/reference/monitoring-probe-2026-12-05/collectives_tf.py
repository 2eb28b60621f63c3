"""2 ranks, TensorFlow eager: the same collectives as collectives_torch.py on a 117 MB fp32 buffer."""
import statistics, time
import tensorflow as tf
import horovod.tensorflow as hvd
hvd.init()
d = 29_334_272
x = tf.random.normal([d])
half = tf.identity(x[: d // 2])
def timed(label, fn, reps=5):
    ts = []
    for i in range(reps):
        hvd.allreduce(tf.zeros([1]), name=f"bar.{label}.{i}")
        t = time.perf_counter(); out = fn(f"{label}.{i}"); _ = out.numpy() if hasattr(out, "numpy") else out[0].numpy(); ts.append(time.perf_counter() - t)
    ts = hvd.allgather(tf.constant([ts])).numpy().max(0).tolist()
    if hvd.rank() == 0:
        print(f"tf {label:14s} median {1e3*statistics.median(ts):7.0f} ms  all " + " ".join(f"{1e3*v:.0f}" for v in ts), flush=True)
timed("allreduce", lambda n: hvd.allreduce(x, op=hvd.Sum, name=n))
timed("alltoall", lambda n: hvd.alltoall(x, name=n))
timed("reducescatter", lambda n: hvd.reducescatter(x, op=hvd.Sum, name=n))
timed("allgather-half", lambda n: hvd.allgather(half, name=n))
