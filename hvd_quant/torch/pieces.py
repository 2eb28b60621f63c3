"""An alltoall in pieces (:func:`hvd_quant.core.comm.alltoall_pieces`: why, and when), for
the torch communicators, Horovod's and ``torch.distributed``'s."""

import torch

from ..core import comm as core_comm


class PiecesHandle:
    """The pieces of one alltoall, all started; ``wait()`` waits for each in turn and puts
    every share's columns back in order."""

    def __init__(self, handles, size):
        self._handles, self._size = handles, size

    def wait(self):
        received = [h.wait().view(self._size, -1) for h in self._handles]
        return torch.cat(received, dim=1).view(-1)


def start_alltoall(x, size, name, start_whole):
    """Start ``x``'s alltoall over ``size`` ranks: whole, by ``start_whole(x, name)`` (the
    communicator's own alltoall, which returns a handle), or, where
    :func:`~hvd_quant.core.comm.alltoall_pieces` says so, as pieces each started by it and
    named ``{name}.piece{i}``, under one :class:`PiecesHandle`. The caller counts the
    bytes, once."""
    pieces = core_comm.alltoall_pieces(x.numel(), size, x.element_size())
    if pieces is None:
        return start_whole(x, name)
    shares = x.reshape(size, -1)
    return PiecesHandle([start_whole(shares[:, a:b].contiguous().view(-1), f"{name}.piece{i}")
                         for i, (a, b) in enumerate(pieces)], size)
