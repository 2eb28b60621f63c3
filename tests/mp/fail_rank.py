"""Rank 1 dies before a collective that rank 0 is waiting in."""
import sys
import torch
import horovod.torch as hvd

hvd.init()
if hvd.rank() == 1:
    sys.exit("rank 1 fails on purpose")
hvd.allreduce(torch.ones(4), name="never_completes")
