"""The stand-in's ``horovod.torch.functions``: the name hvd_quant.torch.functions wraps."""
from . import _absent as broadcast_optimizer_state  # noqa: F401
