"""A one-rank communicator for unit tests: every collective is the identity."""

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
