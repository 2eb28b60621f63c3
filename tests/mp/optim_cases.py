"""Inputs and schedules shared by tests/mp/optim_worker.py (under Horovod) and the oracle."""

import numpy as np

SHAPES = [(7, 13), (29,), (5,)]
COUNTS = [int(np.prod(s)) for s in SHAPES]  # the optimizers' tensors: one scale each
NUMEL = sum(COUNTS)
STEPS = 26
HP = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
# Small intervals so that every phase of each schedule happens within STEPS steps.
CONFIGS = {
    "onebit_adam": dict(freeze_step=6),
    "zero_one_adam": dict(var_freeze_step=8, var_update_scaler=2, local_step_scaler=3,
                          local_step_clipper=4),
    "binsgdm": dict(),
}


def initial_params():
    return (np.random.default_rng(5).integers(-512, 513, NUMEL) / 512.0).astype(np.float32)


def grad(rank, step):
    """Dyadic gradients: fp32 sums over ranks are exact in any order."""
    rng = np.random.default_rng(1000 * rank + step)
    return (rng.integers(-1024, 1025, NUMEL) / 1024.0).astype(np.float32)


def lr(step):
    return 1e-2 * (1.0 - step / (2 * STEPS))  # a schedule: 0/1 Adam's sum of lrs follows it


# Two param groups (p0 and p1; p2) with their own base learning rates under one schedule
# factor, as torch.optim.lr_scheduler.LambdaLR computes them: base * factor(step).
GROUPS = [[0, 1], [2]]
GROUP_LRS = [1e-2, 3e-3]


def lr_factor(step):
    return (step + 1) / 4 if step < 3 else 1.0 - step / (2 * STEPS)  # warm-up, then decay


def group_lr(group, step):
    return GROUP_LRS[group] * lr_factor(step)


def mask():
    """An exp_avg_mask over all NUMEL elements: zeros on every 7th element and on p2."""
    m = (np.arange(NUMEL) % 7 != 0).astype(np.float32)
    m[NUMEL - COUNTS[-1]:] = 0.0
    return m


def count_collectives(comm):
    """Wrap ``comm``'s collectives, blocking and asynchronous, with a counter (a one-element
    list) of the calls issued."""
    calls = [0]
    for method in ("allreduce", "allgather", "alltoall", "sendrecv",
                   "allreduce_async", "allgather_async", "alltoall_async"):
        inner = getattr(comm, method, None)
        if inner is None:
            continue

        def counted(*args, _inner=inner, **kwargs):
            calls[0] += 1
            return _inner(*args, **kwargs)
        setattr(comm, method, counted)
    return calls
