"""4-rank checks (torch): ring and 2x2 torus integer sums equal Horovod's allreduce, with
the torus over registered process sets and routed through global alltoalls, and a ring
over a process set equals Horovod's allreduce on that set."""
import json
import sys
from pathlib import Path

import torch
import horovod.torch as hvd

import hvd_quant
from hvd_quant.core import ring
from hvd_quant.core.comm import Communicator
from hvd_quant.torch.backend import TorchBackend
from hvd_quant.torch.comm import HorovodTorchComm

import cases

hvd.init(process_sets=hvd_quant.torus_process_sets(rows=2, size=4))
B, comm = TorchBackend(), HorovodTorchComm()
row, col = comm.subgroups(2)
routed_row, routed_col = Communicator.subgroups(HorovodTorchComm(), 2)
out = {"row_is_process_set": row.process_set.process_set_id != 0,
       "col_is_process_set": col.process_set.process_set_id != 0}
g = B.generator(0)
for d in cases.SIZES:
    x = torch.from_numpy(cases.rank_ints(hvd.rank(), d))
    out[str(d)] = {
        "ring": ring.ring_allreduce(B, comm, x, ring.IntSum(), f"r{d}", g).tolist(),
        "torus": ring.torus_allreduce(B, row, col, x, ring.IntSum(), f"t{d}", g).tolist(),
        "torus_routed": ring.torus_allreduce(B, routed_row, routed_col, x, ring.IntSum(), f"tr{d}", g).tolist(),
        "hvd": hvd.allreduce(x, op=hvd.Sum, name=f"h{d}").tolist(),
        "row_ring": ring.ring_allreduce(B, row, x, ring.IntSum(), f"rr{d}", g).tolist(),
        "row_hvd": hvd.allreduce(x, op=hvd.Sum, name=f"rh{d}", process_set=row.process_set).tolist(),
    }
# Marsit end to end on the process-set torus: every rank must hold the same result.
from hvd_quant.core.runner import CompressorRunner
runner = CompressorRunner(hvd_quant.get("marsit", topology="torus", torus_rows=2), B, seed=3)
x = torch.from_numpy(cases.rank_input(hvd.rank(), 1001, 0))
out["marsit_torus"] = runner.reduce(x, comm, "mt", cases.segments(1001)).tolist()
def reduce_exact(name, options, case):
    r = CompressorRunner(hvd_quant.get(name, **options), B, seed=11)
    return r.reduce(torch.from_numpy(cases.exact_input(case, hvd.rank(), 4)), comm,
                    f"exact.{name}.{options}.{case}", [("v", 5)])


out["exact"] = cases.run_exact_cases(reduce_exact, lambda t: t.numpy())
Path(sys.argv[1]).joinpath(f"rank{hvd.rank()}.json").write_text(json.dumps({"sums": out}))
