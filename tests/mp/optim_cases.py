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
