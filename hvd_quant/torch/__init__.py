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
from .distributed_optimizer import DistributedOptimizer
from .onebit_optimizers import BinSGDM, GradScaler, OnebitAdam, ZeroOneAdam
from . import functions as _functions
from .functions import broadcast_optimizer_state

# hvd.broadcast_optimizer_state steps an optimizer whose state is empty, on those ranks
# only: hvd_quant's 1-bit optimizers broadcast their state without a step instead
# (hvd_quant.torch.functions says why).
_functions.install()

__all__ = ["BinSGDM", "Compression", "DistributedOptimizer", "GradScaler", "HorovodTorchComm", "OnebitAdam",
           "TorchBackend", "TorchCompressor", "ZeroOneAdam", "broadcast_optimizer_state"]
from . import ddp  # noqa: E402  DDP communication hooks over torch.distributed (hq.ddp.comm_hook)
