"""A GAN-style loop whose two optimizers share one compression object (PyTorch).

    horovodrun -np 2 -H localhost:2 --gloo python examples/gan_torch.py --compression ef_sign
    horovodrun -np 2 -H localhost:2 --gloo python examples/gan_torch.py --compression marsit --path stock

The generator and the discriminator are both ``nn.Sequential``: their parameters have the
same names (``0.weight``, ``2.bias``, ...). One ``compression`` object goes to both
optimizers, as one would pass Horovod's ``Compression.fp16``. The object is configuration:
each optimizer keeps its own compressor state (error feedback, random streams), so the
generator's residuals are never consumed by the discriminator. ``--path stock`` runs the
same loop through Horovod's own ``hvd.DistributedOptimizer``, where the state is kept per
optimizer by the compression object (``compression.state_dict(optimizer)``).

The generator learns a 2-D Gaussian (mean (2, -1), standard deviation 0.5) from noise;
rank 0 prints the losses and the generated mean and spread.
"""

import argparse
import hashlib

import numpy as np
import torch
import horovod.torch as hvd

import hvd_quant.torch as hq
from common import parse_options

TARGET_MEAN, TARGET_STD = torch.tensor([2.0, -1.0]), 0.5


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", default="ef_sign", help="NAME or NAME:KEY=VALUE,KEY=VALUE")
    p.add_argument("--path", choices=["ours", "stock"], default="ours")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    G = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    D = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    for net in (G, D):
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)

    name, _, opts = args.compression.partition(":")
    compression = hq.Compression.get(name, seed=args.seed, **parse_options(filter(None, opts.split(","))))
    wrap = hq.DistributedOptimizer if args.path == "ours" else hvd.DistributedOptimizer
    # One compression object for both optimizers: each keeps its own state.
    opt_g = wrap(torch.optim.Adam(G.parameters(), lr=args.lr, betas=(0.5, 0.999)),
                 named_parameters=G.named_parameters(), compression=compression)
    opt_d = wrap(torch.optim.Adam(D.parameters(), lr=args.lr, betas=(0.5, 0.999)),
                 named_parameters=D.named_parameters(), compression=compression)

    bce = torch.nn.functional.binary_cross_entropy_with_logits
    ones, zeros = torch.ones(args.batch_size, 1), torch.zeros(args.batch_size, 1)
    gen = torch.Generator().manual_seed(args.seed + 1000 * hvd.rank())
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {args.path} optimizer, one object for both: {compression!r}", flush=True)
    for step in range(1, args.steps + 1):
        real = TARGET_MEAN + TARGET_STD * torch.randn(args.batch_size, 2, generator=gen)
        z = torch.randn(args.batch_size, 2, generator=gen)

        opt_d.zero_grad()
        d_loss = bce(D(real), ones) + bce(D(G(z).detach()), zeros)
        d_loss.backward()
        opt_d.step()

        # The generator's step must not produce (or reduce) discriminator gradients.
        for p in D.parameters():
            p.requires_grad_(False)
        opt_g.zero_grad()
        g_loss = bce(D(G(z)), ones)
        g_loss.backward()
        opt_g.step()
        for p in D.parameters():
            p.requires_grad_(True)

        if step % 50 == 0 and hvd.rank() == 0:
            with torch.no_grad():
                fake = G(torch.randn(2000, 2, generator=gen))
            print(f"step {step:4d}  D loss {d_loss.item():.3f}  G loss {g_loss.item():.3f}  "
                  f"fake mean ({fake[:, 0].mean():+.2f}, {fake[:, 1].mean():+.2f})  "
                  f"std {fake.std(0).mean():.2f}  (target (+2.00, -1.00), 0.50)", flush=True)

    state_g, state_d = state(args.path, compression, opt_g), state(args.path, compression, opt_d)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for net in (G, D) for p in net.parameters())).digest()[:8]
    digests = hvd.allgather(torch.from_numpy(np.frombuffer(digest, dtype=np.int64).copy()), name="digest")
    if hvd.rank() == 0:
        print(f"generator state: {sorted(state_g)[:3]}...; discriminator state: {sorted(state_d)[:3]}...")
        shared = [k for k in state_g if k in state_d and torch.equal(state_g[k], state_d[k])
                  and not k.startswith("hvd_quant.rng")]
        print(f"state entries equal between the two optimizers: {len(shared)} of {len(state_g)}")
        print(f"bytes sent per rank: generator {sent(args.path, compression, opt_g):,.0f}, "
              f"discriminator {sent(args.path, compression, opt_d):,.0f}")
        print(f"weights identical on every rank: {len(set(digests.tolist())) == 1}", flush=True)


def state(path, compression, opt):
    """One optimizer's compressor state: ours carries it in state_dict(); through Horovod's
    stock optimizer the compression object keeps it per optimizer."""
    if path == "ours":
        return opt.state_dict()["hvd_quant"]["state"]
    return compression.state_dict(opt)


def sent(path, compression, opt):
    return opt.bytes_sent if path == "ours" else compression.bytes_sent_by(opt)


if __name__ == "__main__":
    main()
