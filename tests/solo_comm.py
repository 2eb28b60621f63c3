"""Communicators for unit tests: one rank (every collective the identity), and a thread
world's communicator that takes and returns a framework's tensors."""

from hvd_quant.core.comm import Communicator


class SoloComm(Communicator):
    """One rank; the default integer dtypes (int32/int64) force the lane path."""

    def allreduce(self, x, op, name):
        return x

    def allgather(self, x, name):
        return x

    def alltoall(self, x, name):
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


class Transport(FrameworkComm):
    """A thread world's communicator that takes a copy of what it sends, as a transport
    does: the thread world hands the other ranks a reference to the sender's array, which
    a staging buffer reused at once would overwrite under them."""

    def allreduce(self, x, op, name):
        return super().allreduce(x.clone(), op, name)

    def allgather(self, x, name):
        return super().allgather(x.clone(), name)

    def alltoall(self, x, name):
        return super().alltoall(x.clone(), name)

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        return super().sendrecv(x.clone(), dest, source, name, recv_numel)

    def subgroups(self, rows):
        return tuple(Transport(c, self.B) for c in self.inner.subgroups(rows))


class FakeProcessSet:
    """Horovod's global process set as the torch optimizers ask it, without Horovod: the
    simulated ranks' communicators come from :func:`use_thread_comms`."""

    process_set_id = 0

    def included(self):
        return True

    def rank(self):
        return 0

    def size(self):
        return 1


_LOCAL = __import__("threading").local()


def use_thread_comms(monkeypatch):
    """Make the torch adapters' ``make_comm`` give the calling thread's communicator
    (:func:`set_thread_comm`), and every optimizer the same scope (one process makes
    every simulated rank's)."""
    from hvd_quant.core import handle
    from hvd_quant.torch import distributed_optimizer, onebit_optimizers, staging

    def make(process_set, device):
        return _LOCAL.comm

    monkeypatch.setattr(handle, "new_scope", lambda: "o0")
    monkeypatch.setattr(distributed_optimizer, "make_comm", make)
    monkeypatch.setattr(onebit_optimizers, "make_comm", make)
    monkeypatch.setattr(staging, "make_comm", make)  # the stock path's


def set_thread_comm(comm):
    _LOCAL.comm = comm
    return comm
