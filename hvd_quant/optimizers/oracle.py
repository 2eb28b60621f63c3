"""Rules run on numpy arrays, one flat parameter group per rank: the optimizers' oracle.

The multi-process tests compare what the torch and TensorFlow optimizers did under
Horovod with this, on the same inputs and seeds; the unit tests run it on a
:class:`~hvd_quant.core.simulate.ThreadWorld` against plain transcriptions of DeepSpeed's
rules (``tests/deepspeed_reference.py``).
"""

import numpy as np

from ..core.backend import NumpyBackend
from .base import EagerGroupState, StepContext, initial_state


class OracleOptimizer:
    """One rank's optimizer over one flat float32 parameter vector.

    Parameters
    ----------
    rule : Rule
    x : numpy array
        Initial parameters (copied).
    comm : Communicator
        This rank's communicator (a ThreadComm in tests).
    hp : dict
        ``betas``, ``eps``, ``weight_decay`` (and what else the rule reads).
    seed : int
        Base seed; this rank draws from ``seed + 1_000_003 * rank``, like the adapters.
    backend : Backend
        ``NumpyBackend()`` (the oracle) by default; ``NumpyKernelBackend()`` runs the same
        rule through the fused kernels.
    counts : list of int or None
        Sizes of the tensors concatenated in ``x`` (None: one tensor).
    """

    def __init__(self, rule, x, comm, hp, seed=0, mask=None, backend=None, name="opt.g0", counts=None):
        self.rule, self.comm, self.hp, self.mask, self.name = rule, comm, dict(hp), mask, name
        self.B = backend or NumpyBackend()
        self.x = np.array(x, np.float32).reshape(-1)
        self.counts = [self.x.size] if counts is None else [int(c) for c in counts]
        rule.validate(comm.size)
        slots, scalars = initial_state(rule, self.counts, comm.size)
        self.state = EagerGroupState(slots, scalars)
        self.rng = self.B.generator(seed + 1_000_003 * comm.rank)

    def step(self, g, lr):
        ctx = StepContext(self.B, self.comm, self.state, np.asarray(g, np.float32).reshape(-1),
                          self.x, lr, self.hp, self.name, rng=self.rng, mask=self.mask,
                          counts=self.counts)
        self.x = np.asarray(self.rule.step(ctx), np.float32)
        return self.x

    def final_sync(self):
        """0/1 Adam's :meth:`~hvd_quant.optimizers.zero_one_adam.ZeroOneAdamRule.final_sync`
        on this rank (every rank calls it); its bytes are added to ``state.bytes_sent``
        (no step kind is recorded: it is not a step). Returns whether it synced."""
        pending = bool(self.rule.sync_pending(self.B, self.state))
        ctx = StepContext(self.B, self.comm, self.state, None, self.x, 0.0, self.hp, self.name,
                          rng=self.rng, mask=self.mask, counts=self.counts)
        self.x = np.asarray(self.rule.final_sync(ctx), np.float32)
        if pending and self.comm.size > 1:
            self.state.bytes_sent += self.rule.wire_bytes("onebit", self.counts, self.comm.size)
        return pending
