"""One job on 2 emulated hosts (1 Gbit/s): the same exchange through plain TCP and through
hvd_quant's Horovod communicators, whole and in pieces; the slower rank's time, median of
``REPS`` calls, the variants taking turns call by call.

    python -m hvd_quant.cluster run --hosts 2 --rate 1gbit -- .venv/bin/python collectives.py torch
    python -m hvd_quant.cluster run --hosts 2 --rate 1gbit -- .venv/bin/python collectives.py tf

``torch``: plain TCP one way and both ways at once (58.7 MB each way), then
``HorovodTorchComm.alltoall`` of 4, 8, 16, 26.2 (a full 25 MiB bucket) and 117 MB buffers
(2, 4, 8, 13.1 and 58.7 MB to the peer) with ``PIECE_BYTES = 0`` (whole) and at its
default (1 MiB pieces above 4 MiB a peer).
Then torch.distributed's Gloo (the DDP hooks' transport): the 117 MB buffer whole and in
1 MiB pieces (all started, then waited for).
``tf``: Horovod's TensorFlow alltoall of the 117 MB buffer, whole and in 1 MiB pieces,
eagerly one by one and inside one ``tf.function``.
"""

import os
import socket
import statistics
import sys
import threading
import time

import numpy as np

FRAMEWORK = sys.argv[1]
REPS = 7
MB = 1e6


def report(label, ts, nbytes_each_way):
    med = statistics.median(ts)
    alone = nbytes_each_way * 8 / 1e9  # the bytes of one direction at the link rate
    print(f"{label:44s} median {1e3 * med:7.1f} ms  one direction's bytes at 1 Gbit/s {1e3 * alone:6.1f} ms  "
          f"all " + " ".join(f"{1e3 * t:.0f}" for t in ts), flush=True)


def torch_job():
    import torch
    import horovod.torch as hvd
    from hvd_quant.core import comm as core_comm
    from hvd_quant.torch import comm as tcomm
    hvd.init()
    rank = hvd.rank()

    def slowest(ts):
        return hvd.allgather(torch.tensor([ts])).max(0).values.tolist()

    def barrier(name):
        hvd.allreduce(torch.zeros(1), name=name)

    # Plain TCP between the two hosts: is the emulated link full duplex?
    ips = hvd.allgather_object(socket.gethostbyname(os.environ["HOROVOD_HOSTNAME"]))
    n = 58_668_544
    buf = bytearray(n)

    def connect(port):
        if rank == 0:
            ls = socket.socket()
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((ips[0], port))
            ls.listen(1)
            barrier(f"listen{port}")
            c = ls.accept()[0]
            ls.close()
            return c
        barrier(f"listen{port}")
        return socket.create_connection((ips[0], port))

    def send(s):
        s.sendall(memoryview(buf))

    def recv(s):
        got, chunk = 0, bytearray(1 << 20)
        while got < n:
            k = s.recv_into(chunk, min(len(chunk), n - got))
            if not k:
                raise EOFError
            got += k

    sock = connect(29611)

    def one_way():
        (send if rank == 0 else recv)(sock)

    def both_ways():
        t = threading.Thread(target=send, args=(sock,))
        t.start()
        recv(sock)
        t.join()

    tcp = {"plain TCP, one way": one_way, "plain TCP, both ways at once": both_ways}
    times = {k: [] for k in tcp}
    for i in range(REPS):
        for label, fn in tcp.items():
            barrier(f"b.{label}.{i}")
            t = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t)
    for label in tcp:
        ts = slowest(times[label])
        if rank == 0:
            report(label, ts, n)

    default = core_comm.PIECE_BYTES
    comm = tcomm.HorovodTorchComm()
    for per_peer in (2 * MB, 4 * MB, 8 * MB, 25 * 2 ** 20 / 2, 29_334_272 * 2):
        numel = int(2 * per_peer // 4) if per_peer < 50 * MB else 29_334_272
        x = torch.randn(numel)
        times = {"whole": [], "pieces": []}
        for i in range(REPS):
            for variant, piece in (("whole", 0), ("pieces", default)):
                core_comm.PIECE_BYTES = piece
                barrier(f"b.{numel}.{variant}.{i}")
                t = time.perf_counter()
                comm.alltoall(x, f"a2a.{numel}.{variant}")
                times[variant].append(time.perf_counter() - t)
        core_comm.PIECE_BYTES = default
        pieces = core_comm.alltoall_pieces(numel, 2, 4)
        for variant in times:
            ts = slowest(times[variant])
            if rank == 0:
                k = len(pieces) if (pieces and variant == "pieces") else 1
                report(f"torch alltoall {numel * 2 / MB:.1f} MB a peer, {variant} ({k})", ts, numel * 2)

    # torch.distributed's Gloo (the DDP hooks' transport), the 117 MB buffer
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{ips[0]}:29612", rank=rank, world_size=2)
    x = torch.randn(29_334_272)
    per_piece = (1 << 20) // 4

    def dist_whole():
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)

    def dist_pieces():
        shares = x.view(2, -1)
        works = []
        for a in range(0, shares.shape[1], per_piece):
            piece = shares[:, a:a + per_piece].contiguous().view(-1)
            works.append(dist.all_to_all_single(torch.empty_like(piece), piece, async_op=True))
        for w in works:
            w.wait()

    variants = {"torch.distributed alltoall 58.7 MB a peer, whole": dist_whole,
                "torch.distributed alltoall, 1 MiB pieces": dist_pieces}
    times = {k: [] for k in variants}
    for i in range(REPS):
        for label, fn in variants.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t)
    for label in variants:
        ts = slowest(times[label])
        if rank == 0:
            report(label, ts, 2 * 29_334_272)
    dist.destroy_process_group()


def tf_job():
    import tensorflow as tf
    import horovod.tensorflow as hvd
    hvd.init()
    d = 29_334_272
    x = tf.random.normal([d])
    per_piece = (1 << 20) // 4

    def pieces(z):
        m = tf.reshape(z, [2, -1])
        c = m.shape[1]
        return [tf.reshape(m[:, a:min(a + per_piece, c)], [-1]) for a in range(0, c, per_piece)]

    @tf.function
    def in_one_function(z):
        return [hvd.alltoall(p, name=f"f.{j}", ignore_name_scope=True) for j, p in enumerate(pieces(z))]

    variants = {
        "tf alltoall 58.7 MB a peer, whole": lambda: [hvd.alltoall(x, name="whole", ignore_name_scope=True)],
        "tf alltoall, 1 MiB pieces, eager": lambda: [hvd.alltoall(p, name=f"e.{j}", ignore_name_scope=True)
                                                     for j, p in enumerate(pieces(x))],
        "tf alltoall, 1 MiB pieces, one tf.function": lambda: in_one_function(x),
    }
    times = {k: [] for k in variants}
    for i in range(REPS):
        for label, fn in variants.items():
            hvd.allreduce(tf.zeros([1]), name=f"b.{label}.{i}")
            t = time.perf_counter()
            out = fn()
            _ = [o.numpy() for o in out]
            times[label].append(time.perf_counter() - t)
    for label in variants:
        ts = hvd.allgather(tf.constant([times[label]])).numpy().max(0).tolist()
        if hvd.rank() == 0:
            report(label, ts, 2 * d)


torch_job() if FRAMEWORK == "torch" else tf_job()
