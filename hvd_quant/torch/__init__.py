"""PyTorch adapter: ``Compression`` and ``DistributedOptimizer`` mirroring ``horovod.torch``.

>>> import horovod.torch as hvd, hvd_quant.torch as hq          # doctest: +SKIP
>>> opt = hq.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
...                               compression=hq.Compression.ef_sign)   # doctest: +SKIP
"""

from .._requirements import check as _check_requirements

# Versions and Horovod's torch ops: one clear ImportError. Horovod is optional: without it
# the torch.distributed paths work (hq.ddp's hooks, the 1-bit optimizers with
# process_group=), and the Horovod entry points raise, naming what to install.
_HOROVOD_MISSING = _check_requirements("torch", horovod_optional=True)

from .backend import TorchBackend
from .compression import Compression, TorchCompressor
from .onebit_optimizers import BinSGDM, GradScaler, OnebitAdam, ZeroOneAdam


def _needs_horovod(name):
    def entry_point(*args, **kwargs):
        raise ImportError(f"hvd_quant.torch.{name} needs Horovod. {_HOROVOD_MISSING}\n"
                          "Without Horovod: hvd_quant.torch.ddp.comm_hook (DDP communication hooks) "
                          "and the 1-bit optimizers with process_group= work over torch.distributed.")
    entry_point.__name__ = entry_point.__qualname__ = name
    return entry_point


if _HOROVOD_MISSING is None:
    from .comm import HorovodTorchComm
    from .distributed_optimizer import DistributedOptimizer
    from . import functions as _functions
    from .functions import broadcast_optimizer_state

    # hvd.broadcast_optimizer_state steps an optimizer whose state is empty, on those ranks
    # only: hvd_quant's 1-bit optimizers broadcast their state without a step instead
    # (hvd_quant.torch.functions says why).
    _functions.install()
else:
    HorovodTorchComm = _needs_horovod("HorovodTorchComm")
    DistributedOptimizer = _needs_horovod("DistributedOptimizer")
    broadcast_optimizer_state = _needs_horovod("broadcast_optimizer_state")

__all__ = ["BinSGDM", "Compression", "DistributedOptimizer", "GradScaler", "HorovodTorchComm", "OnebitAdam",
           "TorchBackend", "TorchCompressor", "ZeroOneAdam", "broadcast_optimizer_state"]
from . import ddp  # noqa: E402  DDP communication hooks over torch.distributed (hq.ddp.comm_hook)
from . import monitoring  # noqa: E402  hq.monitoring.TensorBoardWriter(opt, writer)
