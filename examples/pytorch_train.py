"""Data-parallel training of a small MLP on scikit-learn's digits with hvd_quant (PyTorch).

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_train.py --compression ef_sign
    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_train.py --optimizer zero_one_adam

``--path stock`` uses Horovod's own ``hvd.DistributedOptimizer`` with our compressor;
``--path ddp`` and ``--path ddp_powersgd`` use torch's DistributedDataParallel over Gloo in
the same processes (an fp32 allreduce, or PowerSGD as PyTorch's documentation sets it up:
rank 1, 10 uncompressed warm-up steps), for comparison. Each rank uses
``hvd_quant.threads_per_rank()`` intra-op threads: the cores divided by the ranks on
this host, as the docs recommend (docs/guide/tuning.md).
``--optimizer sgdm|adam`` is wrapped in a DistributedOptimizer with ``--compression``;
``onebit_adam``, ``zero_one_adam`` and ``binsgdm`` are hvd_quant's 1-bit optimizers, which
communicate by themselves (options by ``--opt-option KEY=VALUE``; defaults below scale
their schedules to the run's length).
"""

import collections
import time

import numpy as np
import torch
import horovod.torch as hvd

import hvd_quant
import hvd_quant.torch as hq
from common import (ONE_BIT, Reporter, describe, digits_split, one_bit_defaults, parse_args, parse_options,
                    powersgd_bytes)


def init_torch_distributed():
    """torch.distributed (Gloo) beside Horovod, for the DDP paths. Under the emulated
    cluster MASTER_ADDR/PORT are set; under horovodrun, rank 0 picks a free local port and
    Horovod broadcasts it."""
    import os
    import socket

    import torch.distributed as dist

    if "MASTER_ADDR" not in os.environ:
        port = 0
        if hvd.rank() == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = hvd.broadcast_object(port, root_rank=0, name="example.master_port")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())


def ddp_model(args, model):
    """``(DDP-wrapped model, bytes sent per step)`` for ``--path ddp|ddp_powersgd``."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    init_torch_distributed()
    shapes = [tuple(p.shape) for p in model.parameters()]
    numel = sum(p.numel() for p in model.parameters())
    if args.path == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model), 2.0 * (hvd.size() - 1) / hvd.size() * 4 * numel
    # One bucket: PowerSGD's allreduces, issued from Gloo's callbacks, can interleave across
    # buckets differently on different ranks on CPU (see benchmarks/cluster_worker.py).
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=4096)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                        start_powerSGD_iter=10, min_compression_rate=0.5)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp, powersgd_bytes(shapes, 1, hvd.size(), min_compression_rate=0.5)


def make_optimizer(args, model, compression, total_steps):
    if args.optimizer in ONE_BIT:
        options = {**one_bit_defaults(args.optimizer, total_steps), **parse_options(args.opt_option)}
        cls = getattr(hq, ONE_BIT[args.optimizer])
        return cls(model.parameters(), lr=args.lr, named_parameters=model.named_parameters(), **options)
    if args.optimizer == "adam":
        base = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if args.path.startswith("ddp"):
        return base  # DDP reduced the gradients in backward
    wrap = hq.DistributedOptimizer if args.path == "ours" else hvd.DistributedOptimizer
    return wrap(base, named_parameters=model.named_parameters(), compression=compression)


def main():
    args = parse_args(__doc__.splitlines()[0])
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(hvd_quant.threads_per_rank())  # ranks share the host's cores
    (x_train, y_train), (x_test, y_test) = digits_split(hvd.rank(), hvd.size())
    x_train, y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
    x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)

    h = args.hidden
    model = torch.nn.Sequential(torch.nn.Linear(64, h), torch.nn.ReLU(),
                                torch.nn.Linear(h, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = hq.Compression.get(args.compression, seed=args.seed, **parse_options(args.option))
    ddp_bytes = None
    if args.path.startswith("ddp"):
        model, ddp_bytes = ddp_model(args, model)

    numel = sum(p.numel() for p in model.parameters())
    fp32_bytes = 2.0 * (hvd.size() - 1) / hvd.size() * 4 * numel
    gen = torch.Generator().manual_seed(args.seed + hvd.rank())
    steps = len(x_train) // args.batch_size  # the same count on every rank
    steps = int(hvd.allreduce(torch.tensor(steps), op=hvd.Min, name="steps"))
    opt = make_optimizer(args, model, compression, steps * args.epochs)
    label = (f"torch/{args.optimizer}" if args.optimizer in ONE_BIT else
             f"torch/{args.path}/{args.optimizer}" if ddp_bytes is not None else
             f"torch/{args.path}/{args.optimizer}/{args.compression}" + "".join(f",{o}" for o in args.option))
    report = Reporter(args, hvd.rank(), hvd.size(), label)
    if hvd.rank() == 0:
        print(opt if args.optimizer in ONE_BIT else
              f"torch DDP over Gloo, {args.path}; bytes/step from its cost model" if ddp_bytes is not None else
              describe(compression, hvd.size()), flush=True)
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(x_train), generator=gen)
        bytes_before = _bytes(opt, compression, ddp_bytes, 0)
        losses, start = [], time.perf_counter()
        for i in range(steps):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        step_time = (time.perf_counter() - start) / steps
        sent = (_bytes(opt, compression, ddp_bytes, steps) - bytes_before) / steps
        model.eval()
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        loss = float(hvd.allreduce(torch.tensor(np.mean(losses)), name=f"loss{epoch}"))
        kinds = collections.Counter(opt.step_kinds) if hasattr(opt, "step_kinds") else None
        report.epoch(epoch, loss, acc, sent, step_time, steps, getattr(opt, "comm_rounds", None), kinds)
    report.finish(fp32_bytes, getattr(opt, "skipped_steps", None))
    if ddp_bytes is not None:
        torch.distributed.destroy_process_group()  # torch asks every program that made a group to end it


def _bytes(opt, compression, ddp_bytes=None, steps=0):
    """Bytes this rank sent so far (our optimizer's meter, or the compressor's own in the
    stock path; Horovod's own allreduce of ``none``/``fp16`` counted by its cost model);
    for DDP, ``ddp_bytes`` per step times ``steps`` (its cost model: DDP has no meter)."""
    if ddp_bytes is not None:
        return ddp_bytes * steps
    if hasattr(opt, "bytes_sent"):
        return opt.bytes_sent
    return compression.bytes_sent


if __name__ == "__main__":
    main()
