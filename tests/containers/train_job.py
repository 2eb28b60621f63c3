"""Compressed data-parallel training for the cluster tests; every rank writes its result.

    horovodrun -np 3 -H w1:1,w2:1,w3:1 python tests/containers/train_job.py \\
        --compression marsit,global_qsgd --epochs 4 --out /cluster/results

The example's data (``examples/common.py``: digits, shard ``rank::size``) and a small MLP
with hvd_quant's fused optimizer, trained from the same start once per compressor (one
launch for all: start-up dominates). Each rank writes ``OUT/rank{r}.json``: its host and,
per compressor, the per-epoch mean loss and a SHA-256 of the final weights, so the test
can check that every container ends with identical weights and that a local run gives the
same result. Rank 0 prints one line per epoch (the kill test waits for them).
"""

import argparse
import hashlib
import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
import torch
import horovod.torch as hvd

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import hvd_quant.torch as hq  # noqa: E402
from common import digits_split  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", required=True,
                   help="comma-separated compressor names, or onebit_adam (hvd_quant's 1-bit Adam)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="directory for rank{r}.json")
    args = p.parse_args()

    hvd.init()
    torch.set_num_threads(1)  # identical kernels (and results) in containers and locally
    (x, y), _ = digits_split(hvd.rank(), hvd.size())
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    runs = {name: train(name, x, y, args) for name in args.compression.split(",")}
    result = {"rank": hvd.rank(), "size": hvd.size(), "container": socket.gethostname(),
              "horovod_host": os.environ.get("HOROVOD_HOSTNAME"), "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".rank{hvd.rank()}.json"
    tmp.write_text(json.dumps(result))
    tmp.replace(out / f"rank{hvd.rank()}.json")  # whole files only
    hvd.shutdown()


def train(name, x, y, args):
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if name == "onebit_adam":  # an optimizer that does its own (1-bit) communication
        opt = hq.OnebitAdam(model.parameters(), lr=0.003, named_parameters=model.named_parameters(),
                            freeze_step=28)  # 2 epochs of fp32 warm-up, then 1-bit rounds
    else:
        opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                      named_parameters=model.named_parameters(),
                                      compression=hq.Compression.get(name, seed=args.seed))
    gen = torch.Generator().manual_seed(args.seed + hvd.rank())
    steps = int(hvd.allreduce(torch.tensor(len(x) // args.batch_size), op=hvd.Min,
                              name=f"{name}.steps"))
    losses = []
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x), generator=gen)
        total = 0.0
        for i in range(steps):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += loss.item()
        losses.append(total / steps)
        if hvd.rank() == 0:
            print(f"[train_job] {name} epoch {epoch} loss {losses[-1]:.4f}", flush=True)
    weights = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()]).numpy()
    return {"losses": losses, "bytes_sent": opt.bytes_sent,
            "weights_sha256": hashlib.sha256(np.ascontiguousarray(weights).tobytes()).hexdigest()}


if __name__ == "__main__":
    main()
