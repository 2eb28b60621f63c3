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


def alltoall_in_pieces(x, size, name, start):
    """A :class:`PiecesHandle` of ``x``'s alltoall in pieces, each started by
    ``start(piece, piece_name)`` (the communicator's own whole alltoall, which returns a
    handle) and named ``{name}.piece{i}``; ``None`` when ``x`` goes whole. The caller
    counts the bytes, once."""
    pieces = core_comm.alltoall_pieces(x.numel(), size, x.element_size())
    if pieces is None:
        return None
    shares = x.reshape(size, -1)
    return PiecesHandle([start(shares[:, a:b].contiguous().view(-1), f"{name}.piece{i}")
                         for i, (a, b) in enumerate(pieces)], size)
