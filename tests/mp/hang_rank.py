"""Rank 1 hangs (sleeps) while rank 0 waits in a collective."""
import time
import torch
import horovod.torch as hvd

hvd.init()
if hvd.rank() == 1:
    time.sleep(3600)
hvd.allreduce(torch.ones(4), name="never_completes")
