"""The stand-in's ``horovod.torch.elastic``: only what ``import hvd_quant.torch`` reads."""
