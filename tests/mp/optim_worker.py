"""Runs inside every rank (under horovodrun) for tests/test_optimizers_mp.py.

``python optim_worker.py torch OUTDIR [RANKS_PER_NODE]`` trains hvd_quant's torch
optimizers on the gradients of tests/mp/optim_cases.py and writes ``OUTDIR/rank{r}.json``:
final parameters, step kinds, bytes, the number of collectives each step issued, a
checkpoint round trip (in Phase A and between syncs in Phase B), two param groups under
``LambdaLR``, one verdict for all groups (a bad gradient in one group skips the step in
every group, ``hq.GradScaler`` backs off), DeepSpeed's ``non_freeze`` groups,
``exp_avg_mask`` (and what ``load_state_dict`` does with it), 0/1 Adam's ``final_sync``,
each optimizer on a torch.distributed process group (Gloo, beside Horovod: the same bits,
and ``broadcast_state`` over the group), and the errors and warnings bad input raised.
"""

import io
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import horovod.torch as hvd

import optim_cases as cases
import worker_common
import hvd_quant
import hvd_quant.torch as hq

OUT = Path(sys.argv[2])
RANKS_PER_NODE = int(sys.argv[3]) if len(sys.argv) > 3 else None

size_hint = int(__import__("os").environ.get("HOROVOD_SIZE", "1"))
hvd.init(process_sets=hvd_quant.node_process_sets(RANKS_PER_NODE, size_hint)
         if RANKS_PER_NODE and 1 < RANKS_PER_NODE < size_hint else None)
RANK, SIZE = hvd.rank(), hvd.size()
results = worker_common.Results(timing="stored", rank=RANK, size=SIZE)  # what each part costs
record = results.record


def make_params():
    flat, params, offset = cases.initial_params(), [], 0
    for shape in cases.SHAPES:
        n = int(np.prod(shape))
        params.append(torch.nn.Parameter(torch.from_numpy(flat[offset:offset + n].reshape(shape).copy())))
        offset += n
    return params


def make_optimizer(name, params, lr=cases.lr(0), groups=None, **extra):
    """``groups``: lists of parameter indices, one param group each (with its own lr)."""
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    hp = cases.HP
    if groups is not None:
        params = [{"params": [params[i] for i in idx], "lr": cases.GROUP_LRS[g]} for g, idx in enumerate(groups)]
    options = dict(cases.CONFIGS[name], **extra)
    if name == "onebit_adam":
        return hq.OnebitAdam(params, lr=lr, named_parameters=named, betas=hp["betas"], eps=hp["eps"],
                             weight_decay=hp["weight_decay"], **options)
    if name == "zero_one_adam":
        return hq.ZeroOneAdam(params, lr=lr, named_parameters=named, betas=hp["betas"], eps=hp["eps"],
                              weight_decay=hp["weight_decay"], **options)
    return hq.BinSGDM(params, lr=lr, named_parameters=named, betas=(0.9,),
                      weight_decay=hp["weight_decay"], ranks_per_node=RANKS_PER_NODE, **options)


def set_grads(params, step, drop=None):
    flat, offset = cases.grad(RANK, step), 0
    for i, p in enumerate(params):
        n = p.numel()
        p.grad = None if i == drop else torch.from_numpy(flat[offset:offset + n].reshape(p.shape).copy())
        offset += n


def flat_params(params):
    return np.concatenate([p.detach().numpy().reshape(-1) for p in params]).astype(np.float64).tolist()


def run(name, steps=cases.STEPS, opt=None, params=None, start=0, drop=None, set_lr=True, after_step=None):
    params = params or make_params()
    opt = opt or make_optimizer(name, params)
    # Horovod's communicator itself (a staging one wraps it, and runs fp32 rings on it)
    calls = cases.count_collectives(getattr(opt._comm, "inner", opt._comm))
    per_step = []
    for s in range(start, steps):
        set_grads(params, s, drop=drop if s == 3 else None)
        for group in opt.param_groups if set_lr else ():
            group["lr"] = cases.lr(s)
        before = calls[0]
        opt.step()
        per_step.append(calls[0] - before)
        if after_step is not None:
            after_step(s + 1)  # steps taken
    return params, opt, per_step


def train(name):
    params, opt, per_step = run(name)
    return {"x": flat_params(params), "kinds": opt.step_kinds, "bytes": opt.bytes_sent,
            "rounds": opt.comm_rounds, "calls": per_step}


def metrics_of(name):
    """Issue 54: the rounds measured, a probe every 4 rounds of a kind: the same parameters
    as :func:`train`, the figures at the end (bucket names in order), the totals; the
    "does it pay" line 8 steps after the warm-up (the step it came at, its fp32 time, text)."""
    params = make_params()
    opt = make_optimizer(name, params, probe_every=4, report_after=8)
    verdicts = []
    run(name, opt=opt, params=params,
        after_step=lambda s: verdicts.append(s) if opt._metrics.verdict is not None and not verdicts else None)
    snap = opt.metrics()
    totals = sum(b.total["bytes_sent"] for b in opt._metrics.buckets.values())
    verdict = opt._metrics.verdict
    return {"x": flat_params(params), "metrics": snap, "buckets": list(opt._metrics.buckets),
            "bytes": opt.bytes_sent, "measured_bytes": totals,
            "verdict": verdict and {"step": verdicts[0], "fp32_s": verdict.fp32_s, "method_s": verdict.method_s,
                                    "text": verdict.text}}


def guarded(name):
    """Issue 54: the guard on a 1-bit optimizer. A bound no probe meets (1e-6), a probe on
    every round: the compressed bucket falls back to fp32 after 2 probes in a row, for 3
    of its rounds, then probes again; the flags per step, the guard's checkpoint and a
    copy of it loaded into a new optimizer, and whether the parameters stayed finite."""
    params = make_params()
    opt = make_optimizer(name, params, probe_every=1,
                         guard={"error_bound": 1e-6, "patience": 2, "fallback_steps": 3})
    flags = []
    for s in range(cases.STEPS):
        set_grads(params, s)
        for group in opt.param_groups:
            group["lr"] = cases.lr(s)
        opt.step()
        m = opt.metrics()
        flags.append([m[f"bucket{i}/fallback"] for i in range(len(opt._metrics.buckets))])
    saved = opt.state_dict()
    other = make_optimizer(name, make_params(), probe_every=1, guard=True)
    other.load_state_dict(saved)
    return {"flags": flags, "buckets": list(opt._metrics.buckets), "guard": saved["hvd_quant"]["guard"],
            "loaded": other._metrics.guard.state_dict(), "fallbacks": opt.metrics()["fallbacks"],
            "finite": bool(np.isfinite(flat_params(params)).all())}


def guard_warns_nonfinite(name):
    """Issue 54: gradients that are NaN on one rank at steps 2 to 5 make every rank skip
    them; the guard (nonfinite_patience 3) warns once, on rank 0, with the 1-bit hint."""
    import logging

    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("hvd_quant").addHandler(handler)
    try:
        params = make_params()
        opt = make_optimizer(name, params, guard={"nonfinite_patience": 3})
        for s in range(8):
            set_grads(params, s)
            if 2 <= s <= 5 and RANK == SIZE - 1:
                params[0].grad[0] = float("nan")
            opt.step()
    finally:
        logging.getLogger("hvd_quant").removeHandler(handler)
    return {"warnings": [m for m in messages if "guard" in m], "skipped": opt.skipped_steps,
            "metrics_skipped": opt.metrics()["skipped_steps"]}


def train_staged(name):
    """:func:`train` with every collective's tensors staged through separate host buffers
    (``HVD_QUANT_WIRE=staged``: what a GPU model gets from a Horovod without GPU
    operations), and the bytes that crossed."""
    import os

    os.environ["HVD_QUANT_WIRE"] = "staged"
    try:
        params, opt, per_step = run(name)
    finally:
        del os.environ["HVD_QUANT_WIRE"]
    meter = opt._comm.host_meter
    return {"x": flat_params(params), "kinds": opt.step_kinds, "bytes": opt.bytes_sent,
            "calls": per_step, "host_bytes": opt.host_bytes, "payload": meter.payload}


def init_process_group():
    """torch.distributed (Gloo) beside Horovod in these processes, for the optimizers on a
    process group: rank 0 picks a free port and Horovod broadcasts it."""
    import datetime
    import os
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    port = 0
    if RANK == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0, name="optim_worker.port")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=RANK, world_size=SIZE, timeout=datetime.timedelta(seconds=120))


def train_on_group(name):
    """:func:`train` with the optimizer on a torch.distributed process group (the world, over
    Gloo): Horovod takes no part in its steps."""
    init_process_group()
    params = make_params()
    params, opt, _ = run(name, opt=make_optimizer(name, params, process_group=True), params=params)
    return {"x": flat_params(params), "kinds": opt.step_kinds, "bytes": opt.bytes_sent,
            "rounds": opt.comm_rounds, "comm": type(opt._comm).__name__}


def broadcast_on_group(name, at=6):
    """Horovod's resume pattern on a process group: every rank trains ``at`` steps, then
    builds a fresh optimizer; rank 0 loads its state into it, and ``broadcast_state(0)``
    gives every rank rank 0's state (the error buffers, world-dependent, stay each rank's)."""
    init_process_group()
    params, trained, _ = run(name, steps=at, opt=make_optimizer(name, make_params(), process_group=True))
    fresh = make_optimizer(name, params, process_group=True)
    if RANK == 0:
        fresh.load_state_dict(trained.state_dict())
    fresh.broadcast_state(0)

    def kept(opt):
        out = {}
        for gi, group in enumerate(opt.param_groups):
            st = opt._group_state(gi, group)
            world = set(opt._world_slots([p.numel() for p in group["params"]], SIZE))
            out[f"g{gi}"] = {"scalars": {k: float(v) for k, v in sorted(st.scalars.items())},
                             "slots": {k: v.double().tolist() for k, v in sorted(st.slots.items())
                                       if k not in world}}
        return out
    return {"state": kept(fresh), "trained": kept(trained)}


def checkpoint(name, at, earlier=False):
    """Stop at step ``at``, save (per rank), restore into fresh objects, continue: the result
    must equal an uninterrupted run bit for bit. ``earlier``: the checkpoint rewritten as
    versions before the compensated server state saved it (the server error as DeepSpeed's
    residual, no ``server_scale``)."""
    params, opt, _ = run(name, steps=at)
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    if earlier:
        from hvd_quant.core.compressed_allreduce import server_residual
        from hvd_quant.torch.backend import TorchBackend

        for gi, group in enumerate(opt.param_groups):
            slots = saved["opt"]["state"][f"hvd_quant.group{gi}"]["slots"]
            counts = [p.numel() for p in group["params"]]  # scales="tensor": one per tensor
            slots["server_error"] = server_residual(TorchBackend(), slots["server_error"],
                                                    slots.pop("server_scale"), counts, hvd.size())
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


def schedule_disagreement():
    """One rank with another var_freeze_step: the ranks would take different branches."""
    params = make_params()
    opt = make_optimizer("zero_one_adam", params, var_freeze_step=8 if RANK == 0 else 9)
    set_grads(params, 0)
    opt.step()
    return "no error"


def groups_under_lambda_lr(name):
    """Two param groups with their own base lr under torch's LambdaLR: the lr each group
    saw at each step, 0/1 Adam's Γ after each step, and the final parameters."""
    params = make_params()
    opt = make_optimizer(name, params, groups=cases.GROUPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cases.lr_factor)
    seen, gammas = [[], []], [[], []]
    for s in range(cases.STEPS):
        set_grads(params, s)
        for g, group in enumerate(opt.param_groups):
            seen[g].append(group["lr"])
        opt.step()
        sched.step()
        for g in range(2):
            gammas[g].append(opt.state[f"hvd_quant.group{g}"]["scalars"].get("lrs"))
    return {"x": flat_params(params), "lrs": seen, "gammas": gammas, "kinds": opt.step_kinds}


def poison_group(params, group):
    """inf in the first element of ``group``'s first parameter's gradient."""
    with torch.no_grad():
        params[cases.GROUPS[group][0]].grad.view(-1)[0] = float("inf")


def group_skip(scaled=False, steps=5, where=3):
    """Where per-group verdicts drifted: 1-bit Adam with freeze_step=3 over two param groups
    (cases.GROUPS); at step ``where`` group 1's gradient holds inf on the last rank only.
    Every rank must skip the step in both groups (one schedule). ``scaled``: under
    ``hq.GradScaler`` (gradients scaled by its scale), which must back off everywhere."""
    params = make_params()
    opt = make_optimizer("onebit_adam", params, groups=cases.GROUPS, freeze_step=3)
    scaler = hq.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000) if scaled else None
    skipped, scales = [], []
    for s in range(steps):
        set_grads(params, s)
        if scaler is not None:
            scaler.scale(torch.ones(()))  # GradScaler makes its scale on first use
            with torch.no_grad():
                for p in params:
                    p.grad.mul_(scaler.get_scale())
        if s == where and RANK == SIZE - 1:
            poison_group(params, 1)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        skipped.append(opt.last_step_skipped)
    return {"x": flat_params(params), "skipped": skipped, "skipped_steps": opt.skipped_steps,
            "scales": scales, "kinds": opt.step_kinds,
            "counters": [opt.state[f"hvd_quant.group{g}"]["scalars"] for g in range(2)]}


def non_freeze_groups():
    """1-bit Adam over cases.GROUPS with group 1 ``non_freeze`` (DeepSpeed's flag): fp32
    Adam for that group throughout; and the optimizers that refuse the flag."""
    params = make_params()
    opt = make_optimizer("onebit_adam", params, groups=cases.GROUPS)
    opt.param_groups[1]["non_freeze"] = True
    calls = cases.count_collectives(opt._comm)
    per_step = []
    for s in range(cases.STEPS):
        set_grads(params, s)
        before = calls[0]
        opt.step()
        per_step.append(calls[0] - before)
    refused = {}
    for cls in (hq.ZeroOneAdam, hq.BinSGDM):
        fresh = make_params()
        try:
            cls([{"params": fresh[:2]}, {"params": fresh[2:], "non_freeze": True}], lr=1e-3)
            refused[cls.__name__] = "no error"
        except ValueError as exc:
            refused[cls.__name__] = str(exc)
    return {"x": flat_params(params), "kinds": opt.step_kinds, "bytes": opt.bytes_sent,
            "rounds": opt.comm_rounds, "calls": per_step, "refused": refused}


def mask_and_load_state_dict(at=5):
    """Checkpoint with a mask of ones at step ``at``; restore into an optimizer with the
    script's mask (DeepSpeed: that one stays) and into one without (the checkpoint's is
    dropped)."""
    params = make_params()
    opt = make_optimizer("zero_one_adam", params)
    opt.param_groups[0]["exp_avg_mask"] = torch.ones(cases.NUMEL)
    run("zero_one_adam", steps=at, opt=opt, params=params)
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = make_params()
    with torch.no_grad():
        for p, v in zip(fresh, saved["params"]):
            p.copy_(v)
    user = torch.from_numpy(cases.mask())
    mine = make_optimizer("zero_one_adam", fresh)
    mine.param_groups[0]["exp_avg_mask"] = user
    mine.load_state_dict(saved["opt"])
    kept = mine.param_groups[0]["exp_avg_mask"]
    unmasked = make_optimizer("zero_one_adam", make_params())
    unmasked.load_state_dict(saved["opt"])
    return {"kept": bool(torch.equal(kept, user)), "dropped": "exp_avg_mask" not in unmasked.param_groups[0],
            "checkpoint_unchanged": bool(torch.equal(saved["opt"]["param_groups"][0]["exp_avg_mask"],
                                                     torch.ones(cases.NUMEL)))}


def final_sync():
    """0/1 Adam with exact_sync and param_groups[0]["exp_avg_mask"] (DeepSpeed's way of
    setting it) ends on a local step; final_sync makes one model. A second call does
    nothing. (One run for both: every step of a Horovod job costs several collectives.)"""
    params = make_params()
    opt = make_optimizer("zero_one_adam", params, exact_sync=True)
    opt.param_groups[0]["exp_avg_mask"] = torch.from_numpy(cases.mask())
    params, opt, _ = run("zero_one_adam", opt=opt, params=params)
    before = flat_params(params)
    bytes_before, rounds_before, kinds = opt.bytes_sent, opt.comm_rounds, list(opt.step_kinds)
    calls = cases.count_collectives(opt._comm)
    synced = opt.final_sync()
    first = calls[0]
    after = flat_params(params)
    again = opt.final_sync()
    return {"before": before, "x": after, "synced": synced, "again": again, "calls": [first, calls[0] - first],
            "bytes": opt.bytes_sent - bytes_before, "rounds": opt.comm_rounds - rounds_before,
            "kinds_unchanged": opt.step_kinds == kinds,
            "gamma": opt.state["hvd_quant.group0"]["scalars"]["lrs"]}


def deepspeed_arguments():
    """DeepSpeed's constructor arguments: accepted silently at DeepSpeed's defaults, with a
    warning otherwise; DeepSpeed's positional engine in place of lr is refused."""
    out = {}
    for label, kwargs in (("defaults", dict(deepspeed=None, eps_inside_sqrt=False, max_grad_norm=0.0,
                                             cuda_aware=False, comm_backend_name="nccl")),
                          ("others", dict(deepspeed=object(), eps_inside_sqrt=True, max_grad_norm=1.0,
                                          cuda_aware=True, comm_backend_name="mpi"))):
        for cls in (hq.OnebitAdam, hq.ZeroOneAdam):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cls(make_params(), lr=1e-3, **kwargs)
            out[f"{label}/{cls.__name__}"] = [str(w.message) for w in caught if w.category is UserWarning]
    try:
        hq.ZeroOneAdam(make_params(), object())
        out["engine_as_lr"] = "no error"
    except TypeError as exc:
        out["engine_as_lr"] = str(exc)
    return out


def meta_parameters():
    """Parameters on a device the optimizers do not run on (the meta device) are refused."""
    hq.ZeroOneAdam([torch.nn.Parameter(torch.empty(3, device="meta"))], lr=1e-3)
    return "no error"


def sparse_gradients(sparse_as_dense=False):
    """nn.Embedding(sparse=True): refused with sparse_as_dense=False; by default reduced as
    the dense gradient, with the very results of a dense embedding (every optimizer)."""
    out = {}
    for name in cases.CONFIGS:
        runs = []
        for sparse in (True, False):
            torch.manual_seed(0)  # the same weights on every rank
            emb = torch.nn.Embedding(10, 4, sparse=sparse)
            opt = make_optimizer(name, list(emb.parameters()), sparse_as_dense=sparse_as_dense)
            for step in range(3):
                emb.weight.grad = None
                emb(torch.tensor([1, 2, 2, 7 - RANK])).pow(2).sum().backward()  # a repeated row
                opt.step()
            runs.append(emb.weight.detach().reshape(-1).double().tolist())
        out[name] = {"sparse": runs[0], "dense": runs[1]}
    return out


for name in cases.CONFIGS:
    record(f"train/{name}", lambda: train(name))
    record(f"metrics/{name}", lambda: metrics_of(name))
    record(f"guard_nonfinite/{name}", lambda: guard_warns_nonfinite(name))
    if name != "binsgdm":  # its sign sums are never probed: nothing for the bound to read
        record(f"guarded/{name}", lambda: guarded(name))
    if RANKS_PER_NODE is None:
        record(f"train_staged/{name}", lambda: train_staged(name))
        record(f"group/{name}", lambda: train_on_group(name))
        record(f"group_broadcast/{name}", lambda: broadcast_on_group(name))
record("missing_grad", lambda: {"x": flat_params(run("zero_one_adam", drop=1 if RANK == 1 else None)[0])})
if RANKS_PER_NODE is None:
    record("checkpoint/phase_a", lambda: checkpoint("zero_one_adam", 5))
    record("checkpoint/phase_b", lambda: checkpoint("zero_one_adam", 13))
    record("checkpoint/onebit_adam", lambda: checkpoint("onebit_adam", 9))
    record("checkpoint/phase_b_earlier", lambda: checkpoint("zero_one_adam", 13, earlier=True))
    record("checkpoint/onebit_adam_earlier", lambda: checkpoint("onebit_adam", 9, earlier=True))
    record("checkpoint/binsgdm", lambda: checkpoint("binsgdm", 7))
    record("lr_disagreement", lr_disagreement)
    record("schedule_disagreement", schedule_disagreement)
    record("sparse", sparse_gradients)
    record("sparse_as_dense", lambda: sparse_gradients(sparse_as_dense=True))
    record("groups/zero_one_adam", lambda: groups_under_lambda_lr("zero_one_adam"))
    record("groups/skip", group_skip)
    record("groups/grad_scaler", lambda: group_skip(scaled=True, steps=4, where=2))
    record("groups/non_freeze", non_freeze_groups)
    record("mask_checkpoint", mask_and_load_state_dict)
    record("final_sync", final_sync)
    record("deepspeed_arguments", deepspeed_arguments)
    record("meta_parameters", meta_parameters)

results.write(OUT, RANK)
# No rank shuts Horovod down while another may still be in a node process set's
# collective (see tests/mp/ring_worker.py): leave after a global one.
hvd.allreduce(torch.zeros(1), name="optim_worker.done")
