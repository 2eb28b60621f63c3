"""The stand-in's ``horovod.torch.elastic.state``: the module where Horovod's elastic
``OptimizerStateHandler`` reads ``broadcast_optimizer_state`` (hvd_quant.torch.functions
rebinds it there)."""
from ..functions import broadcast_optimizer_state  # noqa: F401
