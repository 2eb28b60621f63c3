"""Data-parallel training of a small MLP on scikit-learn's digits with hvd_quant (PyTorch).

    horovodrun -np 2 -H localhost:2 python examples/pytorch_train.py --compression ef_sign

``--path stock`` uses Horovod's own ``hvd.DistributedOptimizer`` with our compressor.
"""

import time

import numpy as np
import torch
import horovod.torch as hvd

import hvd_quant.torch as hq
from common import Reporter, describe, digits_split, parse_args, parse_options


def main():
    args = parse_args(__doc__.splitlines()[0])
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # ranks share the machine's cores
    (x_train, y_train), (x_test, y_test) = digits_split(hvd.rank(), hvd.size())
    x_train, y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
    x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = hq.Compression.get(args.compression, seed=args.seed, **parse_options(args.option))
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    wrap = hq.DistributedOptimizer if args.path == "ours" else hvd.DistributedOptimizer
    opt = wrap(base, named_parameters=model.named_parameters(), compression=compression)

    numel = sum(p.numel() for p in model.parameters())
    fp32_bytes = 2.0 * (hvd.size() - 1) / hvd.size() * 4 * numel
    label = f"torch/{args.path}/{args.compression}" + "".join(f",{o}" for o in args.option)
    report = Reporter(args, hvd.rank(), hvd.size(), label)
    if hvd.rank() == 0:
        print(describe(compression, hvd.size()), flush=True)
    gen = torch.Generator().manual_seed(args.seed + hvd.rank())
    steps = len(x_train) // args.batch_size  # the same count on every rank
    steps = int(hvd.allreduce(torch.tensor(steps), op=hvd.Min, name="steps"))
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
        report.epoch(epoch, loss, acc, sent, step_time)
    report.finish(fp32_bytes)


def _bytes(opt, compression):
    """Bytes this rank sent so far (our optimizer's meter, or the compressor's own in the
    stock path; Horovod's own allreduce of ``none``/``fp16`` counted by its cost model)."""
    if hasattr(opt, "bytes_sent"):
        return opt.bytes_sent
    return compression.bytes_sent


if __name__ == "__main__":
    main()
