"""PyTorch adapter: ``Compression`` and ``DistributedOptimizer`` mirroring ``horovod.torch``.

>>> import horovod.torch as hvd, hvd_quant.torch as hq          # doctest: +SKIP
>>> opt = hq.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
...                               compression=hq.Compression.ef_sign)   # doctest: +SKIP
"""

from .._requirements import check as _check_requirements

_check_requirements("torch")  # versions and Horovod's torch ops: one clear ImportError

from .backend import TorchBackend
from .comm import HorovodTorchComm
from .compression import Compression, TorchCompressor
from .optimizer import DistributedOptimizer
from .optimizers import BinSGDM, GradScaler, OnebitAdam, ZeroOneAdam

__all__ = ["BinSGDM", "Compression", "DistributedOptimizer", "GradScaler", "HorovodTorchComm", "OnebitAdam",
           "TorchBackend", "TorchCompressor", "ZeroOneAdam"]
