"""Runs inside every rank (under horovodrun) for tests/test_optimizers_mp.py.

``python optim_worker.py torch OUTDIR [RANKS_PER_NODE]`` trains hvd_quant's torch
optimizers on the gradients of tests/mp/optim_cases.py and writes ``OUTDIR/rank{r}.json``:
final parameters, step kinds, bytes, the number of collectives each step issued, a
checkpoint round trip (in Phase A and between syncs in Phase B), and the errors bad
input raised.
"""

import io
import json
import sys
from pathlib import Path

import numpy as np
import torch
import horovod.torch as hvd

import optim_cases as cases
import hvd_quant
import hvd_quant.torch as hq

OUT = Path(sys.argv[2])
RANKS_PER_NODE = int(sys.argv[3]) if len(sys.argv) > 3 else None

size_hint = int(__import__("os").environ.get("HOROVOD_SIZE", "1"))
hvd.init(process_sets=hvd_quant.node_process_sets(RANKS_PER_NODE, size_hint)
         if RANKS_PER_NODE and 1 < RANKS_PER_NODE < size_hint else None)
RANK, SIZE = hvd.rank(), hvd.size()
results = {"rank": RANK, "size": SIZE}


def make_params():
    flat, params, offset = cases.initial_params(), [], 0
    for shape in cases.SHAPES:
        n = int(np.prod(shape))
        params.append(torch.nn.Parameter(torch.from_numpy(flat[offset:offset + n].reshape(shape).copy())))
        offset += n
    return params


def make_optimizer(name, params, lr=cases.lr(0)):
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    hp = cases.HP
    if name == "onebit_adam":
        return hq.OnebitAdam(params, lr=lr, named_parameters=named, betas=hp["betas"], eps=hp["eps"],
                             weight_decay=hp["weight_decay"], **cases.CONFIGS[name])
    if name == "zero_one_adam":
        return hq.ZeroOneAdam(params, lr=lr, named_parameters=named, betas=hp["betas"], eps=hp["eps"],
                              weight_decay=hp["weight_decay"], **cases.CONFIGS[name])
    return hq.BinSGDM(params, lr=lr, named_parameters=named, betas=(0.9,),
                      weight_decay=hp["weight_decay"], ranks_per_node=RANKS_PER_NODE)


def set_grads(params, step, drop=None):
    flat, offset = cases.grad(RANK, step), 0
    for i, p in enumerate(params):
        n = p.numel()
        p.grad = None if i == drop else torch.from_numpy(flat[offset:offset + n].reshape(p.shape).copy())
        offset += n


def count_collectives(opt):
    """Wrap the optimizer's communicator: how many collectives each step issues."""
    calls = [0]
    comm = opt._comm
    for method in ("allreduce", "allgather", "alltoall", "sendrecv"):
        inner = getattr(comm, method)

        def counted(*args, _inner=inner, **kwargs):
            calls[0] += 1
            return _inner(*args, **kwargs)
        setattr(comm, method, counted)
    return calls


def flat_params(params):
    return np.concatenate([p.detach().numpy().reshape(-1) for p in params]).astype(np.float64).tolist()


def run(name, steps=cases.STEPS, opt=None, params=None, start=0, drop=None):
    params = params or make_params()
    opt = opt or make_optimizer(name, params)
    calls = count_collectives(opt)
    per_step = []
    for s in range(start, steps):
        set_grads(params, s, drop=drop if s == 3 else None)
        for group in opt.param_groups:
            group["lr"] = cases.lr(s)
        before = calls[0]
        opt.step()
        per_step.append(calls[0] - before)
    return params, opt, per_step


def record(key, fn):
    try:
        results[key] = fn()
    except Exception as exc:  # recorded for the test to judge
        results[key] = {"error": type(exc).__name__, "message": str(exc)}


def train(name):
    params, opt, per_step = run(name)
    return {"x": flat_params(params), "kinds": opt.step_kinds, "bytes": opt.bytes_sent,
            "rounds": opt.comm_rounds, "calls": per_step}


def checkpoint(name, at):
    """Stop at step ``at``, save (per rank), restore into fresh objects, continue: the result
    must equal an uninterrupted run bit for bit."""
    params, opt, _ = run(name, steps=at)
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = make_params()
    with torch.no_grad():
        for p, v in zip(fresh, saved["params"]):
            p.copy_(v)
    restored = make_optimizer(name, fresh)
    restored.load_state_dict(saved["opt"])
    run(name, opt=restored, params=fresh, start=at)
    uninterrupted, _, _ = run(name)
    return {"restored": flat_params(fresh), "uninterrupted": flat_params(uninterrupted)}


def lr_disagreement():
    params = make_params()
    opt = make_optimizer("zero_one_adam", params, lr=1e-3 if RANK == 0 else 2e-3)
    set_grads(params, 0)
    opt.step()
    return "no error"


def sparse_gradients():
    torch.manual_seed(0)  # the same weights on every rank
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = hq.ZeroOneAdam(emb.parameters(), lr=1e-3)
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    return "no error"


for name in cases.CONFIGS:
    record(f"train/{name}", lambda: train(name))
record("missing_grad", lambda: {"x": flat_params(run("zero_one_adam", drop=1 if RANK == 1 else None)[0])})
if RANKS_PER_NODE is None:
    record("checkpoint/phase_a", lambda: checkpoint("zero_one_adam", 5))
    record("checkpoint/phase_b", lambda: checkpoint("zero_one_adam", 13))
    record("checkpoint/onebit_adam", lambda: checkpoint("onebit_adam", 9))
    record("checkpoint/binsgdm", lambda: checkpoint("binsgdm", 7))
    record("lr_disagreement", lr_disagreement)
    record("sparse", sparse_gradients)

OUT.mkdir(parents=True, exist_ok=True)
(OUT / f"rank{RANK}.json").write_text(json.dumps(results))
print(f"rank {RANK}: wrote {OUT / f'rank{RANK}.json'}")
