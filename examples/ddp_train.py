"""Data-parallel training of the digits MLP with torch DDP and an hvd_quant communication hook.

    torchrun --nproc_per_node 2 examples/ddp_train.py --compression ef_sign
    torchrun --nproc_per_node 2 examples/ddp_train.py --compression powersgd

The model and data are those of ``examples/pytorch_train.py`` (scikit-learn's digits, each
rank on its own shard), launched by ``torchrun`` instead of ``horovodrun``: no Horovod
collective runs. ``--compression`` names an hvd_quant compressor (``ef_sign``, ``marsit``,
``onebit``, ``global_qsgd``, ``auto``, ...; ``none`` is DDP's fp32 allreduce through our hook),
or ``fp32`` (DDP without a hook) or ``powersgd`` (PyTorch's PowerSGD hook, rank 1, 10
uncompressed warm-up steps, one bucket, as ``pytorch_train.py --path ddp_powersgd``). Gloo
on CPUs; ``--backend nccl`` with one GPU per rank. At the end each rank saves its model and
hook state (``--save``), the error feedback included, which resumes exactly.
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_quant.torch as hq
from common import digits_split


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compression", default="ef_sign")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--save", default="", help="a path prefix: <prefix>.rank<r>.pt per rank")
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
                          if args.backend == "nccl" else "cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", size))))
    torch.manual_seed(args.seed)  # the same initial model on every rank (DDP broadcasts rank 0's)
    (x_train, y_train), (x_test, y_test) = digits_split(rank, size)
    x_train, y_train = torch.from_numpy(x_train).to(device), torch.from_numpy(y_train).to(device)
    x_test, y_test = torch.from_numpy(x_test).to(device), torch.from_numpy(y_test).to(device)

    h = args.hidden
    net = torch.nn.Sequential(torch.nn.Linear(64, h), torch.nn.ReLU(),
                              torch.nn.Linear(h, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device)
    state = None
    if args.compression == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        model = DDP(net, bucket_cap_mb=4096)
        model.register_comm_hook(powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10,
            min_compression_rate=0.5), powerSGD_hook.powerSGD_hook)
    elif args.compression == "fp32":
        model = DDP(net)
    else:
        model = DDP(net)
        state = hq.ddp.register(model, hq.Compression.get(args.compression, seed=args.seed))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    gen = torch.Generator().manual_seed(args.seed + rank)
    steps = torch.tensor(len(x_train) // args.batch_size)
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)  # the same number of steps on every rank
    steps = int(steps)
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(x_train), generator=gen).to(device)
        losses, start = [], time.perf_counter()
        for i in range(steps):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()  # the hook averages each bucket
            opt.step()
            losses.append(loss.item())
        step_ms = 1e3 * (time.perf_counter() - start) / steps
        model.eval()
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        mean_loss = torch.tensor(sum(losses) / len(losses), device=device)
        dist.all_reduce(mean_loss)
        if rank == 0:
            sent = f", {state.bytes_sent / (epoch * steps):.0f} B/step sent" if state is not None else ""
            print(f"epoch {epoch}: loss {float(mean_loss) / size:.4f}, test accuracy {acc:.3f}, "
                  f"{step_ms:.1f} ms/step{sent}", flush=True)
    if rank == 0:
        print(f"final test accuracy {acc:.3f} ({args.compression}, {size} ranks)", flush=True)
    if args.save:
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                    "hook": state.state_dict() if state is not None else None},
                   f"{args.save}.rank{rank}.pt")
    # Release what holds the process group (DDP's reducer, the hook's state) while Python
    # is alive: left to interpreter exit, a Gloo group's threads were destroyed unjoined
    # and the process aborted ("terminate called without an active exception") in about
    # half of the runs on the emulated cluster, after training had finished.
    del model, opt, state
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
