"""Communicators for unit tests: one rank (every collective the identity), and a thread
world's communicator that takes and returns a framework's tensors."""

from hvd_quant.core.comm import Communicator


class SoloComm(Communicator):
    """One rank; the default integer dtypes (int32/int64) force the lane path."""

    def allreduce(self, x, op, name):
        return x

    def allgather(self, x, name):
        return x

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        return x

    def subgroups(self, rows):
        return self, self


class FrameworkComm(Communicator):
    """A thread-world communicator that takes and returns another framework's tensors."""

    def __init__(self, inner, backend):
        super().__init__()
        self.inner, self.B = inner, backend
        self.rank, self.size, self.meter = inner.rank, inner.size, inner.meter

    def _wrap(self, out):
        return self.B.constant(out, out.dtype.name)

    def allreduce(self, x, op, name):
        return self._wrap(self.inner.allreduce(self.B.to_numpy(x), op, name))

    def allgather(self, x, name):
        return self._wrap(self.inner.allgather(self.B.to_numpy(x), name))

    def alltoall(self, x, name):
        return self._wrap(self.inner.alltoall(self.B.to_numpy(x), name))

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        return self._wrap(self.inner.sendrecv(self.B.to_numpy(x), dest, source, name, recv_numel))

    def subgroups(self, rows):
        return tuple(FrameworkComm(c, self.B) for c in self.inner.subgroups(rows))
