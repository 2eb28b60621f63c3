"""Horovod programs run as Horovod runs them, then with one line changed to hvd_quant.

Each program is taken from a Horovod usage pattern (its docs, examples and tests) and
runs with ``hvd.DistributedOptimizer`` and with ``hq.DistributedOptimizer`` under
``compression=hq.Compression.none`` and ``ef_sign``. The results say what a drop-in must
give: the same parameters as Horovod where the compression is exact, the same averaged
gradient on every rank, and the warning (or not) about parameter values.

The programs run one after the other in this one process, each between its own
``hvd.init()`` and ``hvd.barrier(); hvd.shutdown()``, as Horovod's own test harness runs
its tests; between them run programs that fail on every rank together (ranks that
disagree, a compressor that cannot work at this size, a stock optimizer whose compressor
refuses). So the job also checks that hvd_quant leaves nothing behind after such an
error: no worker thread, no armed deadline, no stale process set, and a training program
after all of them still gives the results it gave first.

    horovodrun -np N python dropin_worker.py OUT_DIR
"""

import json
import os
import sys
import threading

import torch
import horovod.torch as hvd

import hvd_quant.torch as hq
from hvd_quant.core.runner import RankDisagreement
from hvd_quant.core.watchdog import WATCHDOG
from logged import captured_warnings

PATHS = ("horovod", "none", "ef_sign")


def wrap(path, base, **kwargs):
    """The one line a user changes: Horovod's optimizer, or hvd_quant's with a compressor."""
    if path == "horovod":
        return hvd.DistributedOptimizer(base, **kwargs)
    return hq.DistributedOptimizer(base, compression=getattr(hq.Compression, path), **kwargs)


def per_rank_seed(base):
    """Per-rank initial values: the programs below never broadcast before their first step."""
    torch.manual_seed(base + hvd.rank())


def batches(n, shape=(8, 6), seed=0):
    g = torch.Generator().manual_seed(1000 * seed + hvd.rank())
    return [(torch.randn(*shape, generator=g), torch.randint(0, 3, (shape[0],), generator=g))
            for _ in range(n)]


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def step(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def flat(params):
    return torch.cat([p.detach().reshape(-1).float() for p in params]).tolist()


def grads(params):
    """The gradients the last step applied (the averaged ones)."""
    return torch.cat([(p.grad.to_dense() if p.grad.is_sparse else p.grad).reshape(-1).float()
                      for p in params if p.grad is not None]).tolist()


# --- programs that work under Horovod ---------------------------------------------------------
def init_then_broadcast(path):
    """One step initialises Adam's state, then parameters and optimizer state are
    broadcast (Horovod's docs: broadcast after the optimizer's state exists)."""
    per_rank_seed(10)
    model = mlp()
    opt = wrap(path, torch.optim.Adam(model.parameters(), lr=0.01), named_parameters=model.named_parameters())
    data = batches(4, seed=1)
    step(model, opt, data[0])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for batch in data[1:]:
        step(model, opt, batch)
    return {"params": flat(model.parameters()), "grads": grads(model.parameters())}


def gan(path):
    """A GAN: two optimizers, ``requires_grad`` toggled between their steps, per-rank
    initial values (never broadcast)."""
    per_rank_seed(20)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    disc = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt_g = wrap(path, torch.optim.SGD(gen.parameters(), lr=0.05, momentum=0.5),
                 named_parameters=gen.named_parameters())
    opt_d = wrap(path, torch.optim.SGD(disc.parameters(), lr=0.05),
                 named_parameters=disc.named_parameters())
    g = torch.Generator().manual_seed(7 + hvd.rank())
    for _ in range(3):
        z, real = torch.randn(8, 4, generator=g), torch.randn(8, 6, generator=g)
        gen.requires_grad_(False)
        disc.requires_grad_(True)
        opt_d.zero_grad()
        (disc(gen(z)).mean() - disc(real).mean()).backward()
        opt_d.step()
        gen.requires_grad_(True)
        disc.requires_grad_(False)
        opt_g.zero_grad()
        (-disc(gen(z)).mean()).backward()
        opt_g.step()
    disc.requires_grad_(True)
    return {"params": flat(list(gen.parameters()) + list(disc.parameters())),
            "grads": grads(gen.parameters()) + grads(disc.parameters())}


def sparse_embedding(path):
    """A sparse ``nn.Embedding`` (SGD updates it sparsely); per-rank initial values."""
    per_rank_seed(30)
    emb = torch.nn.Embedding(40, 6, sparse=True)
    head = torch.nn.Linear(6, 3)
    params = list(emb.parameters()) + list(head.parameters())
    named = [("emb.weight", emb.weight)] + [(f"head.{n}", p) for n, p in head.named_parameters()]
    opt = wrap(path, torch.optim.SGD(params, lr=0.1), named_parameters=named)
    g = torch.Generator().manual_seed(40 + hvd.rank())
    for _ in range(3):
        tokens = torch.randint(0, 40, (8,), generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(head(emb(tokens)), y).backward()
        opt.step()
    return {"params": flat(params), "grads": grads(head.parameters())}


def unnamed(path):
    """An optimizer built without ``named_parameters``; per-rank initial values."""
    per_rank_seed(50)
    model = mlp()
    opt = wrap(path, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for batch in batches(3, seed=5):
        step(model, opt, batch)
    return {"params": flat(model.parameters()), "grads": grads(model.parameters())}


def process_set_of_even_ranks(path):
    """Every rank builds its optimizer over the even ranks' process set and steps: an
    odd rank is not in it and trains on its own gradients (hybrid-parallel programs
    restrict a sub-model's optimizer so)."""
    even = hvd.add_process_set(list(range(0, hvd.size(), 2)))
    odd = hvd.add_process_set(list(range(1, hvd.size(), 2)))
    try:
        torch.manual_seed(60)  # identical initial values: the even ranks must agree
        model = mlp()
        opt = wrap(path, torch.optim.SGD(model.parameters(), lr=0.1),
                   named_parameters=model.named_parameters(), process_set=even)
        for batch in batches(3, seed=6):
            step(model, opt, batch)
        return {"params": flat(model.parameters()), "grads": grads(model.parameters()),
                "included": bool(even.included())}
    finally:
        hvd.remove_process_set(odd)
        hvd.remove_process_set(even)


def state_digest(opt):
    """The optimizer's per-parameter state (Adam's moments and step), as one list."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for name in sorted(opt.state[p]):
                out.extend(torch.as_tensor(opt.state[p][name]).reshape(-1).float().tolist())
    return out


def resume_on_rank_0(path):
    """Horovod's resume pattern: rank 0 loads a checkpoint (its model and Adam's state),
    the other ranks start fresh, then every rank broadcasts the parameters and the
    optimizer state from rank 0. On the fresh ranks the state is empty, so
    ``hvd.broadcast_optimizer_state`` steps the optimizer there, and only there, to
    create it (this hung with hvd_quant's optimizer before)."""
    per_rank_seed(90)
    model = mlp()
    opt = wrap(path, torch.optim.Adam(model.parameters(), lr=0.01), named_parameters=model.named_parameters())
    if hvd.rank() == 0:  # the checkpoint: an earlier run's model and Adam state
        # (trained apart: a backward through `model` would start a reduction on rank 0 alone)
        earlier_model = mlp()
        earlier = torch.optim.Adam(earlier_model.parameters(), lr=0.01)
        for x, y in batches(2, seed=9):
            earlier.zero_grad()
            torch.nn.functional.cross_entropy(earlier_model(x), y).backward()
            earlier.step()
        model.load_state_dict(earlier_model.state_dict())
        opt.load_state_dict(earlier.state_dict())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    broadcast = state_digest(opt)
    for batch in batches(3, seed=2):
        step(model, opt, batch)
    return {"params": flat(model.parameters()), "grads": grads(model.parameters()), "state": broadcast}


PROGRAMS = {"init_then_broadcast": init_then_broadcast, "gan": gan,
            "sparse_embedding": sparse_embedding, "unnamed": unnamed,
            "process_set": process_set_of_even_ranks, "resume_on_rank_0": resume_on_rank_0}


# --- the 1-bit optimizers, which own their communication -----------------------------------
ONEBIT = {"onebit_adam": lambda params, named: hq.OnebitAdam(params, lr=0.01, freeze_step=2,
                                                             named_parameters=named),
          "zero_one_adam": lambda params, named: hq.ZeroOneAdam(params, lr=0.01, var_freeze_step=2,
                                                                exact_sync=True, named_parameters=named),
          "binsgdm": lambda params, named: hq.BinSGDM(params, lr=0.01, named_parameters=named)}


def onebit_flat_state(opt):
    """Every rank-independent slot and counter of a 1-bit optimizer's state (the error
    buffers, each rank's own, left out), as one list."""
    out = []
    for gi, group in enumerate(opt.param_groups):
        saved = opt.state[f"hvd_quant.group{gi}"]
        mine = set(opt._world_slots([p.numel() for p in group["params"]], hvd.size()))
        for name in sorted(saved["slots"]):
            if name not in mine:
                out.extend(saved["slots"][name].reshape(-1).tolist())
        out.extend(float(v) for _, v in sorted(saved["scalars"].items()))
    return out


def onebit_resume_on_rank_0(name):
    """The resume pattern with a 1-bit optimizer: every rank trains a few steps (past
    1-bit Adam's freeze), rank 0 keeps that state as its checkpoint, then a new model and
    optimizer on every rank, the checkpoint loaded on rank 0 only, and both broadcast
    from rank 0 with Horovod's functions. The fresh ranks must end with rank 0's state
    (their own error buffers aside) and train on in step with it."""
    per_rank_seed(95)
    model = mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = ONEBIT[name](model.parameters(), model.named_parameters())
    for batch in batches(4, seed=3):
        step(model, opt, batch)
    checkpoint = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
    expected = onebit_flat_state(opt)
    per_rank_seed(96)
    model = mlp()
    opt = ONEBIT[name](model.parameters(), model.named_parameters())
    if hvd.rank() == 0:
        model.load_state_dict(checkpoint[0])
        opt.load_state_dict(checkpoint[1])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    broadcast = onebit_flat_state(opt)
    for batch in batches(3, seed=4):
        step(model, opt, batch)
    if name == "zero_one_adam":  # its ranks' weights differ between syncs, by design (exact_sync: not after)
        opt.final_sync()
    return {"state": broadcast, "expected": expected, "params": flat(model.parameters()),
            "kinds": list(opt.step_kinds)}


# --- programs that fail on every rank together -----------------------------------------------
def strict_values():
    per_rank_seed(70)
    model = mlp()
    opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  compression=hq.Compression.ef_sign, strict=True)
    step(model, opt, batches(1)[0])


def shapes_differ():
    torch.manual_seed(71)
    model = torch.nn.Linear(6, 3 + hvd.rank() % 2)
    opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  compression=hq.Compression.global_qsgd)
    x = torch.randn(4, 6)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


def compressors_differ_stock():
    """Horovod's stock optimizer with our compressors, a different one on odd ranks: the
    check inside the first gradient hook fails on every rank, in backward."""
    torch.manual_seed(72)
    model = mlp()
    comp = hq.Compression.ef_sign if hvd.rank() % 2 == 0 else hq.Compression.onebit
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=comp)
    step(model, opt, batches(1)[0])


def onebit_hyper_differ():
    torch.manual_seed(73)
    model = mlp()
    opt = hq.OnebitAdam(model.parameters(), lr=1e-3 * (1 + hvd.rank() % 2),
                        named_parameters=model.named_parameters(), freeze_step=2)
    step(model, opt, batches(1)[0])


def zero_grad_mid_round():
    """``zero_grad()`` between backward and step while buckets are being reduced (a bug
    Horovod refuses too): the error comes after the round was finished on every rank."""
    torch.manual_seed(75)
    model = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(4)])
    opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  compression=hq.Compression.marsit, bucket_size_mb=1e-4)
    model(torch.randn(4, 6)).sum().backward()
    opt.zero_grad()


#: A model whose failed optimizer stays alive (as a traceback or a user's variable keeps
#: it): the next program trains the same model with a new optimizer.
KEPT = {}


def strict_values_kept():
    per_rank_seed(76)
    model = KEPT["model"] = mlp()
    opt = KEPT["opt"] = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                named_parameters=model.named_parameters(),
                                                compression=hq.Compression.ef_sign, strict=True,
                                                bucket_size_mb=1e-4)
    step(model, opt, batches(1)[0])


def train_model(model):
    """Three ef_sign steps of ``model`` from fixed values; its parameters."""
    torch.manual_seed(77)
    model.load_state_dict(mlp().state_dict())
    opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  compression=hq.Compression.ef_sign, bucket_size_mb=1e-4)
    for batch in batches(3, seed=7):
        step(model, opt, batch)
    return {"params": flat(model.parameters())}


def torus_that_cannot_be():
    torch.manual_seed(74)
    model = mlp()
    opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  compression=hq.Compression.marsit(topology="torus",
                                                                    torus_rows=hvd.size() + 1))
    step(model, opt, batches(1)[0])


FAILURES = {"strict_values": (strict_values, RankDisagreement),
            "shapes_differ": (shapes_differ, RankDisagreement),
            "compressors_differ_stock": (compressors_differ_stock, RankDisagreement),
            "onebit_hyper_differ": (onebit_hyper_differ, RankDisagreement),
            "torus_that_cannot_be": (torus_that_cannot_be, ValueError),
            "zero_grad_mid_round": (zero_grad_mid_round, AssertionError),
            "strict_values_kept": (strict_values_kept, RankDisagreement)}


def leftovers():
    """What an hvd_quant error could leave behind: bucket worker threads, armed deadlines."""
    workers = [t.name for t in threading.enumerate() if t.name.startswith("hvd_quant-buckets")]
    return {"bucket_threads": workers, "armed_deadlines": len(WATCHDOG._armed)}


def run_program(label, fn, *args):
    """One program between its own init and shutdown; its result and the hvd_quant
    warnings it logged on this rank."""
    print(f"[dropin] {label}", flush=True)
    hvd.init()
    with captured_warnings() as messages:
        try:
            result = fn(*args)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result, error = None, f"{type(exc).__name__}: {exc}"
    hvd.barrier()
    hvd.shutdown()
    return {"result": result, "error": error, "warnings": messages, **leftovers()}


def main():
    out_dir = sys.argv[1]
    results = {}
    for name, fn in PROGRAMS.items():
        for path in PATHS:
            results[f"{name}/{path}"] = run_program(f"{name}/{path}", fn, path)
    for name in ONEBIT:
        results[f"onebit_resume/{name}"] = run_program(f"onebit_resume/{name}", onebit_resume_on_rank_0, name)
    for name, (fn, expected) in FAILURES.items():
        results[f"fail/{name}"] = run_program(f"fail/{name}", fn)
        results[f"fail/{name}"]["expected"] = expected.__name__
        # After every all-ranks error, the process initialises again and trains.
        results[f"after/{name}"] = run_program(f"after/{name}", init_then_broadcast, "ef_sign")
    # The model whose failed optimizer is still alive, trained by a new one, against a
    # fresh model trained the same way.
    results["reused_model"] = run_program("reused_model", train_model, KEPT["model"])
    results["fresh_model"] = run_program("fresh_model", train_model, mlp())
    hvd.init()
    rank = hvd.rank()
    hvd.shutdown()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
