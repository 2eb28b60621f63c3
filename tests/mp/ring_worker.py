"""4-rank checks (torch): ring and 2x2 torus integer sums equal Horovod's allreduce, with
the torus over registered process sets and routed through global alltoalls, and a ring
over a process set equals Horovod's allreduce on that set; BinSGDM's hierarchical
allreduce (2 nodes x 2) on a step with one rank's inf, -inf or NaN."""
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


def binsgdm_hierarchical_non_finite():
    """BinSGDM over 2 nodes x 2 (its hierarchical allreduce needs 4 ranks): rank 3's
    gradient holds inf, -inf, then NaN in one element, each after a finite step. The
    flag must cross the node (intra-node alltoall) and the nodes (inter-node allgather):
    every rank skips each bad step with its parameters and state unchanged."""
    import numpy as np
    import hvd_quant.torch as hq

    p = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 37))
    opt = hq.BinSGDM([p], lr=1e-2, ranks_per_node=2)
    rng = np.random.default_rng(hvd.rank())
    result = []
    for bad in (float("inf"), float("-inf"), float("nan")):
        p.grad = torch.from_numpy(rng.standard_normal(37).astype(np.float32))
        opt.step()
        group = opt.state["hvd_quant.group0"]
        before = (p.detach().clone(), {k: v.clone() for k, v in group["slots"].items()},
                  dict(group["scalars"]), opt.skipped_steps)
        g = torch.from_numpy(rng.standard_normal(37).astype(np.float32))
        if hvd.rank() == 3:
            g[11] = bad
        p.grad = g
        opt.step()
        result.append({"skipped": opt.skipped_steps - before[3], "kind": opt.step_kinds[-1],
                       "x_unchanged": bool(torch.equal(p.detach(), before[0])),
                       "state_unchanged": all(torch.equal(v, before[1][k]) for k, v in group["slots"].items())
                       and dict(group["scalars"]) == before[2]})
    return result


out["binsgdm_2x2_non_finite"] = binsgdm_hierarchical_non_finite()
Path(sys.argv[1]).joinpath(f"rank{hvd.rank()}.json").write_text(json.dumps({"sums": out}))
# The last collectives above ran in the node process sets. A rank that shut Horovod down
# now could tear them down under a rank still inside one ("Process set provided does not
# exist", seen in 2 of 7 runs): every rank leaves only after a global collective.
hvd.allreduce(torch.zeros(1), name="ring_worker.done")
