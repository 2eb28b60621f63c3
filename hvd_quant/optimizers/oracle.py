"""Rules run on numpy arrays, one flat parameter group per rank: the optimizers' oracle.

The multi-process tests compare what the torch and TensorFlow optimizers did under
Horovod with this, on the same inputs and seeds; the unit tests run it on a
:class:`~hvd_quant.core.simulate.ThreadWorld` against plain transcriptions of DeepSpeed's
rules (``tests/deepspeed_reference.py``).
"""

import numpy as np

from ..core.backend import NumpyBackend
from .base import EagerGroupState, StepContext, copy_tensor, initial_state, step_groups


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
    in_place : bool
        Run as the torch optimizer does: a kept step may write ``x`` and the state in
        place (with ``NumpyKernelBackend``, whose kernels honour that), and temporaries
        live in buffers kept from step to step. Same bits; it tests those paths.
    """

    def __init__(self, rule, x, comm, hp, seed=0, mask=None, backend=None, name="opt.g0", counts=None,
                 in_place=False):
        self.rule, self.comm, self.hp, self.mask, self.name = rule, comm, dict(hp), mask, name
        self.B = backend or NumpyBackend()
        self.x = np.array(x, np.float32).reshape(-1)
        self.counts = [self.x.size] if counts is None else [int(c) for c in counts]
        self.in_place = bool(in_place)
        rule.validate(comm.size)
        slots, scalars = initial_state(rule, self.counts, comm.size)
        self.state = EagerGroupState(slots, scalars, in_place=self.in_place)
        self.rng = self.B.generator(seed + 1_000_003 * comm.rank)
        self._kept = {}  # in_place: temporaries by name, as the torch optimizer keeps them

    def step(self, g, lr):
        new_xs, kept = step_groups(self.rule, lambda _: self.context(g, lr), [self.x.size])
        if kept:
            self.set_x(new_xs[0])
        return self.x

    def context(self, g, lr):
        """The :class:`StepContext` of a step on gradient ``g`` with learning rate ``lr``."""
        return StepContext(self.B, self.comm, self.state, np.asarray(g, np.float32).reshape(-1),
                           self.x, lr, self.hp, self.name, rng=self.rng, mask=self.mask,
                           counts=self.counts, x_writable=self.in_place,
                           scratch=self._scratch if self.in_place else None)

    def set_x(self, new_x):
        """Take a kept step's parameters (in place: copied into ``x``, as the torch optimizer
        copies them into its parameters; a kept buffer is overwritten by the next step)."""
        if not self.in_place:
            self.x = np.asarray(new_x, np.float32)
        elif new_x is not self.x:
            copy_tensor(new_x, self.x)

    def _scratch(self, name, zero, numel=None):
        numel = self.x.size if numel is None else numel
        buf = self._kept.get(name)
        if buf is None or buf.size != numel:
            buf = self._kept[name] = np.zeros(numel, np.float32) if zero else np.empty(numel, np.float32)
        return buf

    def final_sync(self):
        """0/1 Adam's :meth:`~hvd_quant.optimizers.zero_one_adam.ZeroOneAdamRule.final_sync`
        on this rank (every rank calls it); its bytes are added to ``state.bytes_sent``
        (no step kind is recorded: it is not a step). Returns whether it synced."""
        pending = bool(self.rule.sync_pending(self.B, self.state))
        ctx = StepContext(self.B, self.comm, self.state, None, self.x, 0.0, self.hp, self.name,
                          rng=self.rng, mask=self.mask, counts=self.counts)
        self.set_x(self.rule.final_sync(ctx))
        if pending and self.comm.size > 1:
            self.state.bytes_sent += self.rule.wire_bytes("onebit", self.counts, self.comm.size)
        return pending


class OracleParamGroups:
    """One rank's optimizer over several flat parameter groups, as torch's ``param_groups``:
    every step runs every group through :func:`~hvd_quant.optimizers.base.step_groups`,
    with one verdict for all of them, as the torch optimizer does.

    Parameters
    ----------
    rule : Rule
        One rule for all groups (one optimizer).
    xs : list of numpy arrays
        Each group's initial parameters (copied).
    comm : Communicator
    hps : list of dict
        Each group's hyper-parameters (``betas``, ``eps``, ``weight_decay``, and
        ``non_freeze`` where the rule reads it).
    masks, counts : lists (one entry per group, None for none) or None
    seed, backend, in_place : as :class:`OracleOptimizer`.

    Attributes
    ----------
    groups : list of OracleOptimizer
        One per group (their ``x`` and ``state``), named ``opt.g{i}`` like the torch
        optimizer's groups.
    skipped_steps : int
    last_step_skipped : bool
    """

    def __init__(self, rule, xs, comm, hps, seed=0, masks=None, backend=None, counts=None, in_place=False):
        masks = masks or [None] * len(xs)
        counts = counts or [None] * len(xs)
        self.rule = rule
        self.groups = [OracleOptimizer(rule, x, comm, hp, seed=seed, mask=mask, backend=backend,
                                       name=f"opt.g{i}", counts=c, in_place=in_place)
                       for i, (x, hp, mask, c) in enumerate(zip(xs, hps, masks, counts))]
        self.skipped_steps, self.last_step_skipped = 0, False

    def step(self, grads, lrs):
        """One step: ``grads`` and ``lrs`` hold each group's gradient and learning rate.
        Returns whether the step was kept."""
        new_xs, kept = step_groups(self.rule, lambda i: self.groups[i].context(grads[i], lrs[i]),
                                   [group.x.size for group in self.groups])
        if kept:
            for group, x in zip(self.groups, new_xs):
                group.set_x(x)
        self.last_step_skipped = not kept
        self.skipped_steps += int(not kept)
        return kept
