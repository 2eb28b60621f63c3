"""Optimizers that own their communication, each written once against the Backend.

* :class:`~hvd_quant.optimizers.onebit_adam.OnebitAdamRule`: 1-bit Adam (DeepSpeed's
  ``OnebitAdam``).
* :class:`~hvd_quant.optimizers.zero_one_adam.ZeroOneAdamRule`: 0/1 Adam (DeepSpeed's
  ``ZeroOneAdam``). Both send their compressed rounds through the two-stage 1-bit
  allreduce (:class:`~hvd_quant.optimizers.compressed_rounds.OnebitRoundsRule`).
* :class:`~hvd_quant.optimizers.binsgdm.BinSGDMRule`: BinSGDM / Birder (a reconstruction)
  on the hierarchical 1-bit allreduce.

See :mod:`hvd_quant.optimizers.base` for the layer's design; the framework optimizers
are ``hvd_quant.torch.OnebitAdam`` / ``ZeroOneAdam`` / ``BinSGDM`` and their
``hvd_quant.tensorflow`` (Keras 3) twins.
"""

from .base import KINDS, Rule
from .binsgdm import BinSGDMRule
from .onebit_adam import OnebitAdamRule
from .zero_one_adam import ZeroOneAdamRule

__all__ = ["BinSGDMRule", "KINDS", "OnebitAdamRule", "Rule", "ZeroOneAdamRule"]
