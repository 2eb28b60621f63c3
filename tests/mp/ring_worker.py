"""4-rank check: ring and 2x2 torus integer sums equal Horovod's allreduce (torch)."""
import json
import sys
from pathlib import Path

import numpy as np
import torch
import horovod.torch as hvd

from hvd_quant.core import ring
from hvd_quant.torch.backend import TorchBackend
from hvd_quant.torch.comm import HorovodTorchComm

import cases

hvd.init()
B, comm = TorchBackend(), HorovodTorchComm()
out = {}
for d in cases.SIZES:
    x = torch.from_numpy(cases.rank_ints(hvd.rank(), d))
    row, col = comm.subgroups(2)
    out[str(d)] = {
        "ring": ring.ring_allreduce(B, comm, x, ring.IntSum(), f"r{d}", B.generator(0)).tolist(),
        "torus": ring.torus_allreduce(B, row, col, x, ring.IntSum(), f"t{d}", B.generator(0)).tolist(),
        "hvd": hvd.allreduce(x, op=hvd.Sum, name=f"h{d}").tolist(),
    }
Path(sys.argv[1]).joinpath(f"rank{hvd.rank()}.json").write_text(json.dumps({"sums": out}))
