"""Step time with and without overlap, side by side in one run (PyTorch, Horovod).

    .venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/bench_overlap.py

One small MLP, one training step = zero_grad, forward, backward, ``step()``. For each
method, configurations of ``hvd_quant.torch.DistributedOptimizer``:

* ``step, 1 buffer``: ``bucket_size_mb=0`` (every gradient fused, reduced at ``step()``;
  the default until 2026-11-26);
* ``step, buckets``: the same buckets as below, reduced at ``step()`` (``overlap=False``);
* ``overlap``: ``bucket_size_mb`` buckets reduced during backward (as the default does,
  whose size follows the model; results identical to ``step, buckets``);
* ``overlap+chunks``: as ``overlap``, each buffer's sign allgather pipelined in chunks
  (``pipeline_chunk_mb``; ef_sign only);

and Horovod's own ``hvd.DistributedOptimizer`` (fp32, overlapped per tensor) for
reference. Configurations run round-robin, one step each, so slow drift of a shared
machine hits them alike; the table gives the median step time and the interquartile
range in milliseconds. On one machine the "network" is loopback: overlap hides the
compression and collective time behind backward only when there are cores to spare.
"""

import argparse
import statistics
import time

import torch
import horovod.torch as hvd

import hvd_quant.torch as hq


def make_model(width, depth, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--methods", default="none,ef_sign,global_qsgd")
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--chunk-mb", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=15, help="timed steps per configuration")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args()

    hvd.init()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    runs = {}
    for method in args.methods.split(","):
        comp = hq.Compression.get(method)
        configs = {"step, 1 buffer": {"bucket_size_mb": 0},
                   "step, buckets": {"bucket_size_mb": args.bucket_mb, "overlap": False},
                   "overlap": {"bucket_size_mb": args.bucket_mb}}
        if method == "ef_sign":
            configs["overlap+chunks"] = {"bucket_size_mb": args.bucket_mb, "pipeline_chunk_mb": args.chunk_mb}
        for label, kw in configs.items():
            model = make_model(args.width, args.depth)
            opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                          named_parameters=model.named_parameters(), compression=comp, **kw)
            runs[(method, label)] = (model, opt)
    model = make_model(args.width, args.depth)
    runs[("horovod fp32", "stock")] = (model, hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3), named_parameters=model.named_parameters()))

    def step(model, opt):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    times = {k: [] for k in runs}
    for i in range(args.steps + 2):  # two warm-up rounds (kernels, first-step checks)
        for key, (model, opt) in runs.items():
            hvd.allreduce(torch.zeros(1), name="barrier")
            start = time.perf_counter()
            step(model, opt)
            if i >= 2:
                times[key].append(time.perf_counter() - start)

    # Compute alone: forward + backward with no reduction.
    model = make_model(args.width, args.depth)
    compute = []
    for i in range(args.steps + 2):
        start = time.perf_counter()
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if i >= 2:
            compute.append(time.perf_counter() - start)

    if hvd.rank() == 0:
        nparams = sum(q.numel() for q in make_model(args.width, args.depth).parameters())
        print(f"{hvd.size()} ranks, MLP {args.depth}x{args.width} ({nparams / 1e6:.1f}M params, "
              f"{4 * nparams / 2 ** 20:.0f} MB fp32), batch {args.batch}, {args.threads} thread(s), "
              f"buckets {args.bucket_mb} MB, chunks {args.chunk_mb} MB, {args.steps} steps each")
        print(f"forward+backward alone: median {1000 * statistics.median(compute):.1f} ms")
        print(f"{'method':<14}{'configuration':<18}{'median ms':>10}{'IQR ms':>16}")
        for (method, label), ts in times.items():
            q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
            print(f"{method:<14}{label:<18}{1000 * statistics.median(ts):>10.1f}"
                  f"{f'{1000 * q[0]:.1f}-{1000 * q[2]:.1f}':>16}")


if __name__ == "__main__":
    main()
