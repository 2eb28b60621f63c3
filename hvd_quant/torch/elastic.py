"""Horovod Elastic with hvd_quant: :class:`TorchState`, a drop-in ``hvd.elastic.TorchState``.

::

    import horovod.torch as hvd
    import hvd_quant.torch as hq
    from hvd_quant.torch.elastic import TorchState

    hvd.init()
    opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  compression=hq.Compression.ef_sign)
    state = TorchState(model=model, optimizer=opt, step=0)

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            ...
            state.step += 1
            state.commit()

    train(state)

Use it exactly like Horovod's ``hvd.elastic.TorchState``; it accepts the same arguments
and additionally knows the optimizers of hvd_quant:

* ``hvd_quant.torch.DistributedOptimizer`` (any ``compression=``);
* Horovod's stock ``hvd.DistributedOptimizer`` with ``compression=hvd_quant.torch.Compression.<name>``
  (the compressor state lives in the compression object, per optimizer: it is committed
  and restored with the optimizer);
* ``hvd_quant.torch.OnebitAdam``, ``ZeroOneAdam`` and ``BinSGDM``.

What happens on a reset (a rank failed, or hosts were added or removed)
-----------------------------------------------------------------------
Horovod restores the last commit (after a failure), shuts Horovod down and initialises it
again, calls :meth:`TorchState.reset`, then broadcasts the state from rank 0 (unless hosts
were only removed). For every hvd_quant object this state:

1. re-reads rank and size (communicators cache both; torus sub-groups are rebuilt) and
   forgets the torus/node process sets of ``hvd_quant.torus_process_sets`` /
   ``node_process_sets``: Horovod's reset initialises only the global set, so those hops
   run routed through it (same results);
2. re-validates the compressor or method for the new size, raising ``ValueError`` on
   every rank if it cannot work there (Marsit's ``torus_rows`` must divide the size,
   BinSGDM's ``ranks_per_node`` too; Global-QSGD picks its safe levels for the new size
   at each step, and fails here if explicit ``bits``/``levels`` are no longer safe);
3. makes the first-step agreement check (same compressor and options, same model, same
   values) run again on the next step, on every rank, together with the ranks that joined.

Per-rank state (the rule)
-------------------------
* Error feedback of the compressors (``ef_sign``, Marsit's compensation...), kept per
  parameter: **ranks that survive keep their residuals** (as of the last commit after a
  failure), **ranks that join start from zero**. This is safe: error feedback only delays
  gradient mass that a rank has not sent yet; it is never broadcast.
* State whose size or meaning depends on the rank or the world size: the padded worker
  and server error buffers of the 1-bit compressed allreduce (the ``onebit`` compressor's
  buffer slots, 1-bit Adam, 0/1 Adam) **restart from zero** on a rank whose ``(rank,
  size)`` changed (with a warning for compressor buffer slots).
* Random streams of stochastic compressors are per rank number and kept.
* The 1-bit optimizers' other state (moments, 0/1 Adam's accumulators and schedule
  counters, master weights) is **made identical from rank 0** by the sync, as the model
  is, so that every rank follows the same schedule. (When hosts were only removed,
  Horovod skips the sync and every survivor keeps its own.)
* The wrapped optimizer's own state (SGD momentum, Adam moments) is broadcast from rank 0
  by Horovod as usual.
"""

import copy

import horovod.torch as hvd
from horovod.torch.elastic.state import OptimizerStateHandler, TorchState as _HorovodTorchState

from ..process_sets import forget_stale_sets
from .compression import TorchCompressor
from .functions import broadcast_optimizer_state
from .onebit_optimizers import RuleOptimizer

__all__ = ["TorchState", "reset_for_new_world"]


def _kind(optimizer):
    """``"rule"``, ``"ours"``, ``"stock"`` (Horovod's optimizer with our compression) or None."""
    if isinstance(optimizer, RuleOptimizer):
        return "rule"
    if hasattr(optimizer, "_runner") and isinstance(getattr(optimizer, "_compression", None),
                                                    TorchCompressor):
        return "ours"
    if isinstance(getattr(optimizer, "_compression", None), TorchCompressor):
        return "stock"
    return None


def reset_for_new_world(optimizer):
    """Adapt one hvd_quant optimizer to the world after ``hvd.init()`` ran again (steps 1-3
    of the module docstring). :class:`TorchState` calls it on every reset; call it
    yourself (e.g. from ``state.register_reset_callbacks``) if you use Horovod's own
    ``TorchState``. Other optimizers are left alone."""
    kind = _kind(optimizer)
    if kind == "rule":
        optimizer.elastic_reset()
    elif kind == "ours":
        optimizer._comm.refresh()
        optimizer._runner.reset_checks(optimizer._comm.size)
    elif kind == "stock":
        owned = optimizer._compression.owned(optimizer)
        if owned.comm is not None:
            owned.comm.refresh()
        owned.runner.reset_checks(hvd.size())


class _QuantOptimizerHandler(OptimizerStateHandler):
    """Horovod's optimizer handler plus hvd_quant's state and reset (module docstring)."""

    def __init__(self, optimizer):
        self._kind = _kind(optimizer)
        self._saved_compression = None
        super().__init__(optimizer)
        self._save_compression()

    def _save_compression(self):
        if self._kind == "stock":
            opt = self.value
            self._saved_compression = copy.deepcopy(opt._compression.state_dict(opt))

    def set_value(self, value):
        self._kind = _kind(value)
        super().set_value(value)

    def save(self):
        super().save()
        self._save_compression()

    def restore(self):
        super().restore()
        if self._kind == "stock" and self._saved_compression is not None:
            self.value._compression.load_state_dict(self._saved_compression, self.value)

    def sync(self):
        # Horovod's sync is broadcast_optimizer_state, which steps an optimizer without
        # state: hq.DistributedOptimizer takes Horovod's own path there (the wrapped
        # optimizer's step, no reduction), and the 1-bit optimizers broadcast their state
        # without a step (hvd_quant.torch.functions).
        if self._kind == "rule":
            self.value.broadcast_state(root_rank=0)
        else:
            broadcast_optimizer_state(self.value, root_rank=0)

    def reset(self):
        reset_for_new_world(self.value)


class TorchState(_HorovodTorchState):
    """``hvd.elastic.TorchState`` that also commits, restores and resets hvd_quant's state.

    Same arguments as Horovod's: ``model``, ``optimizer`` and any other keyword arguments
    (several models and optimizers may be given). See the module docstring for what a
    reset does and which per-rank state is kept.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        super().__init__(model=model, optimizer=optimizer, **kwargs)
        for name, handler in list(self._handlers.items()):
            if isinstance(handler, OptimizerStateHandler) and _kind(handler.value) is not None:
                self._handlers[name] = _QuantOptimizerHandler(handler.value)

    def reset(self):
        forget_stale_sets()
        for handler in self._handlers.values():
            if isinstance(handler, _QuantOptimizerHandler):
                handler.reset()
        super().reset()
