"""One rank of the Horovod Elastic job of tests/test_elastic.py (torch).

``python elastic_worker.py OUTDIR STEPS KILL_STEP MARKER``

Trains several tiny regression models at once, each with its own hvd_quant optimizer,
all in one ``hvd_quant.torch.elastic.TorchState`` committed after every step:

* ``ef_sign``: ``hvd_quant.torch.DistributedOptimizer`` with per-rank error feedback;
* ``qsgd``: the same with Global-QSGD (its safe levels depend on the number of ranks);
* ``stock``: Horovod's own ``hvd.DistributedOptimizer`` with ``Compression.ef_sign``;
* ``onebit``: ``hvd_quant.torch.OnebitAdam`` (1-bit rounds after step 2), one scale for the
  flattened group (``scales="group"``), so that the elastic path covers both layouts;
* ``zeroone``: ``hvd_quant.torch.ZeroOneAdam`` (1-bit rounds, padded error buffers), one
  scale and padded segment per tensor (the default).

The worker whose host is ``127.0.0.1`` (the job's second "host") writes ``MARKER`` and
dies with ``os._exit(1)`` when it reaches step ``KILL_STEP``; the discovery script then
lists only ``localhost:2``, Horovod blacklists the failed host, and the two survivors
restore the last commit, reset and finish. Each rank that finishes writes
``OUTDIR/rank{r}.json``.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import horovod.torch as hvd

import hvd_quant.torch as hq
from hvd_quant.torch.elastic import TorchState
from worker_common import kill_second_host_at

OUT, STEPS, KILL_STEP, MARKER = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
HOST = os.environ.get("HOROVOD_HOSTNAME", "")
D_IN, D_OUT, BATCH = 8, 2, 24

hvd.init()
torch.manual_seed(0)
W_TRUE = torch.randn(D_IN, D_OUT)
EVAL_X = torch.randn(256, D_IN, generator=torch.Generator().manual_seed(123))
EVAL_Y = EVAL_X @ W_TRUE


def batch(step):
    """This rank's share of the global batch of ``step`` (depends on rank and size)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, D_IN, generator=g)
    y = x @ W_TRUE
    return x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(D_IN, D_OUT)


def eval_loss(model):
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(EVAL_X), EVAL_Y))


models = {name: make_model(i) for i, name in enumerate(["ef_sign", "qsgd", "stock", "onebit", "zeroone"])}
named = {k: list(m.named_parameters()) for k, m in models.items()}
opts = {
    "ef_sign": hq.DistributedOptimizer(torch.optim.SGD(models["ef_sign"].parameters(), lr=0.05),
                                       named_parameters=named["ef_sign"],
                                       compression=hq.Compression.ef_sign),
    "qsgd": hq.DistributedOptimizer(torch.optim.SGD(models["qsgd"].parameters(), lr=0.1),
                                    named_parameters=named["qsgd"],
                                    compression=hq.Compression.global_qsgd(bits=8)),
    "stock": hvd.DistributedOptimizer(torch.optim.SGD(models["stock"].parameters(), lr=0.05),
                                      named_parameters=named["stock"],
                                      compression=hq.Compression.ef_sign),
    # The 1-bit Adams keep DeepSpeed's rule (no bias correction, no variance floor): this job checks the elastic
    # path, and its loss bound (0.7x in 10 steps) was set with that rule's large early steps.
    "onebit": hq.OnebitAdam(models["onebit"].parameters(), lr=0.01, named_parameters=named["onebit"],
                            freeze_step=2, scales="group", bias_correction=False, variance_floor=0),
    "zeroone": hq.ZeroOneAdam(models["zeroone"].parameters(), lr=0.01, named_parameters=named["zeroone"],
                              var_freeze_step=1000, var_update_scaler=1, bias_correction=False, variance_floor=0),
}
initial = {k: eval_loss(m) for k, m in models.items()}
kwargs = {f"model_{k}": m for k, m in models.items()}
kwargs.update({f"opt_{k}": o for k, o in opts.items()})
state = TorchState(step=0, **kwargs)

resets = []


def on_reset():
    """Runs after hvd_quant's reset, before the sync: what each rank kept."""
    ef = opts["ef_sign"]._runner.state_dict()
    stock_state = opts["stock"]._compression.state_dict(opts["stock"])
    z = opts["zeroone"].state["hvd_quant.group0"]["slots"]
    resets.append({
        "size": hvd.size(), "rank": hvd.rank(), "step": state.step,
        "ef_residual_abs": float(sum(abs(v).sum() for v in ef.values())),
        "stock_residual_abs": float(sum(abs(v).sum() for k, v in stock_state.items()
                                        if k.endswith("/residual"))),
        "zeroone_worker_error_abs": float(z["worker_error"].abs().sum()),
        "zeroone_worker_error_numel": int(z["worker_error"].numel()),
        "zeroone_checked": opts["zeroone"]._checked,
        "ef_checked": sorted(opts["ef_sign"]._runner._checked),
        "qsgd_levels": list(opts["qsgd"]._compression.algorithm.resolve(hvd.size())),
    })


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        kill_second_host_at(state.step, KILL_STEP, MARKER)
        print(f"[{time.time():.1f}] rank {hvd.rank()}/{hvd.size()} step {state.step}", flush=True)
        x, y = batch(state.step)
        for k, model in models.items():
            opt = opts[k]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        state.step += 1
        state.commit()


train(state)

result = {
    "rank": hvd.rank(), "size": hvd.size(), "host": HOST, "steps": state.step,
    "resets": resets, "initial": initial,
    "final": {k: eval_loss(m) for k, m in models.items()},
    "weights": {k: [p.detach().reshape(-1).tolist() for p in m.parameters()] for k, m in models.items()},
    "kinds": {k: opts[k].step_kinds for k in ("onebit", "zeroone")},
    "qsgd_levels": list(opts["qsgd"]._compression.algorithm.resolve(hvd.size())),
}
(OUT / f"rank{hvd.rank()}.json").write_text(json.dumps(result))
