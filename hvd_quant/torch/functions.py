"""Horovod's torch helpers, for hvd_quant's optimizers: ``broadcast_optimizer_state``.

Horovod 0.28.1's ``hvd.broadcast_optimizer_state(optimizer, root_rank)``
(``horovod/torch/functions.py``) first makes sure the optimizer has state: on a rank
whose state is empty (a fresh optimizer, while rank 0 resumed from a checkpoint) it
gives every parameter a zero gradient and takes one step. A step of a distributed
optimizer communicates, and only the ranks with empty state take it, so Horovod skips
the reduction for its own ``DistributedOptimizer``, which it recognises by module
name (``optimizer.__module__ == DistributedOptimizer.__module__``), by calling the
wrapped optimizer's ``step()`` instead. Any other optimizer that communicates in
``step()`` hangs there: the ranks with state wait in the broadcast, the others in
the step's collectives.

hvd_quant's two kinds of optimizer take these paths:

* :func:`hvd_quant.torch.DistributedOptimizer` answers to Horovod's module check
  (the instance's ``__module__``, see ``optimizer.py``), so Horovod's own function
  steps the wrapped optimizer, as it does for Horovod's ``DistributedOptimizer``:
  no reduction, no error feedback fed with zeros. Nothing here is needed for it.
* The 1-bit optimizers (:class:`~hvd_quant.torch.OnebitAdam`,
  :class:`~hvd_quant.torch.ZeroOneAdam`, :class:`~hvd_quant.torch.BinSGDM`) keep
  one flat state per parameter group, which Horovod's function neither creates
  without a step nor broadcasts (it broadcasts per-parameter entries). For them
  :func:`broadcast_optimizer_state` below makes the state identical to the root's
  with the optimizer's own :meth:`~hvd_quant.torch.onebit_optimizers.RuleOptimizer.broadcast_state`
  (hyper-parameters, counters, moments, master weights; each rank keeps its own
  error buffers), with no step.

``import hvd_quant.torch`` puts :func:`broadcast_optimizer_state` in place of
Horovod's in ``horovod.torch``, ``horovod.torch.functions`` and Horovod's elastic
state module (:func:`install`), so that ``hvd.broadcast_optimizer_state`` and
``hvd.elastic.TorchState`` work with the 1-bit optimizers as written. It hands every
other optimizer to Horovod's function unchanged.
"""

import horovod.torch as hvd
import horovod.torch.elastic.state as _horovod_elastic_state
import horovod.torch.functions as _horovod_functions

from .onebit_optimizers import RuleOptimizer

#: Horovod's own function, as Horovod defines it (before :func:`install`).
horovod_broadcast_optimizer_state = _horovod_functions.broadcast_optimizer_state

#: Where Horovod binds the name (``hvd.broadcast_optimizer_state``; the elastic
#: ``OptimizerStateHandler.sync`` reads it from its own module).
_HOROVOD_MODULES = (hvd, _horovod_functions, _horovod_elastic_state)


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Make ``optimizer``'s state equal to ``root_rank``'s on every rank (every rank
    calls it), as ``hvd.broadcast_optimizer_state`` does.

    hvd_quant's 1-bit optimizers broadcast their flat state themselves, without a
    step (module docstring); every other optimizer, ``hq.DistributedOptimizer``
    included, goes to Horovod's function with the same arguments."""
    if isinstance(optimizer, RuleOptimizer):
        optimizer.broadcast_state(root_rank)
        return
    horovod_broadcast_optimizer_state(optimizer, root_rank, model=model)


def install():
    """Bind :func:`broadcast_optimizer_state` where Horovod binds its own. A module
    whose binding is not Horovod's (another library's wrapper) is left alone."""
    for module in _HOROVOD_MODULES:
        if getattr(module, "broadcast_optimizer_state", None) is horovod_broadcast_optimizer_state:
            module.broadcast_optimizer_state = broadcast_optimizer_state
