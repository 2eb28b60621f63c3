"""Data-parallel training of a small MLP on scikit-learn's digits with hvd_quant (PyTorch).

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_train.py --compression ef_sign
    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_train.py --optimizer zero_one_adam

``--path stock`` uses Horovod's own ``hvd.DistributedOptimizer`` with our compressor.
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

import hvd_quant.torch as hq
from common import ONE_BIT, Reporter, describe, digits_split, one_bit_defaults, parse_args, parse_options


def make_optimizer(args, model, compression, total_steps):
    if args.optimizer in ONE_BIT:
        options = {**one_bit_defaults(args.optimizer, total_steps), **parse_options(args.opt_option)}
        cls = getattr(hq, ONE_BIT[args.optimizer])
        return cls(model.parameters(), lr=args.lr, named_parameters=model.named_parameters(), **options)
    if args.optimizer == "adam":
        base = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    wrap = hq.DistributedOptimizer if args.path == "ours" else hvd.DistributedOptimizer
    return wrap(base, named_parameters=model.named_parameters(), compression=compression)


def main():
    args = parse_args(__doc__.splitlines()[0])
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # ranks share the machine's cores
    (x_train, y_train), (x_test, y_test) = digits_split(hvd.rank(), hvd.size())
    x_train, y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
    x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)

    h = args.hidden
    model = torch.nn.Sequential(torch.nn.Linear(64, h), torch.nn.ReLU(),
                                torch.nn.Linear(h, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = hq.Compression.get(args.compression, seed=args.seed, **parse_options(args.option))

    numel = sum(p.numel() for p in model.parameters())
    fp32_bytes = 2.0 * (hvd.size() - 1) / hvd.size() * 4 * numel
    gen = torch.Generator().manual_seed(args.seed + hvd.rank())
    steps = len(x_train) // args.batch_size  # the same count on every rank
    steps = int(hvd.allreduce(torch.tensor(steps), op=hvd.Min, name="steps"))
    opt = make_optimizer(args, model, compression, steps * args.epochs)
    label = (f"torch/{args.optimizer}" if args.optimizer in ONE_BIT else
             f"torch/{args.path}/{args.optimizer}/{args.compression}" + "".join(f",{o}" for o in args.option))
    report = Reporter(args, hvd.rank(), hvd.size(), label)
    if hvd.rank() == 0:
        print(opt if args.optimizer in ONE_BIT else describe(compression, hvd.size()), flush=True)
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(x_train), generator=gen)
        bytes_before = _bytes(opt, compression)
        losses, start = [], time.perf_counter()
        for i in range(steps):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        step_time = (time.perf_counter() - start) / steps
        sent = (_bytes(opt, compression) - bytes_before) / steps
        model.eval()
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        loss = float(hvd.allreduce(torch.tensor(np.mean(losses)), name=f"loss{epoch}"))
        kinds = collections.Counter(opt.step_kinds) if hasattr(opt, "step_kinds") else None
        report.epoch(epoch, loss, acc, sent, step_time, steps, getattr(opt, "comm_rounds", None), kinds)
    report.finish(fp32_bytes)


def _bytes(opt, compression):
    """Bytes this rank sent so far (our optimizer's meter, or the compressor's own in the
    stock path; Horovod's own allreduce of ``none``/``fp16`` counted by its cost model)."""
    if hasattr(opt, "bytes_sent"):
        return opt.bytes_sent
    return compression.bytes_sent


if __name__ == "__main__":
    main()
