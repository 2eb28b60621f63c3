"""Collectives seen by one rank, and a wire meter that counts the bytes they send.

Algorithms in :mod:`hvd_quant` are written per rank against :class:`Communicator`. Three
implementations exist: Horovod for torch (:mod:`hvd_quant.torch.comm`), Horovod for
TensorFlow (:mod:`hvd_quant.tensorflow.comm`) and threads in one process
(:class:`hvd_quant.core.simulate.ThreadWorld`), which is the test oracle.

Every collective carries a ``name``. All ranks must issue the same collectives, in the same
order, with the same names; Horovod matches collectives across ranks by name.
"""


class WireMeter:
    """Counts the bytes one rank sends, under the usual cost model of each collective.

    * allreduce of ``b`` bytes (ring): ``2 * (n - 1) / n * b``
    * allgather of a ``b``-byte contribution (ring): ``(n - 1) * b``
    * point-to-point send of ``b`` bytes: ``b``
    """

    def __init__(self):
        self.bytes_sent = 0.0
        self.by_kind = {}

    def add(self, kind, nbytes):
        self.bytes_sent += nbytes
        self.by_kind[kind] = self.by_kind.get(kind, 0.0) + nbytes

    def reset(self):
        self.bytes_sent = 0.0
        self.by_kind = {}


class Communicator:
    """The collectives one rank may call. ``rank`` and ``size`` are within this communicator.

    Tensors are 1-D, of the framework the communicator belongs to.
    """

    rank = 0
    size = 1
    #: Integer dtypes whose ``allreduce(op="sum")`` this communicator performs natively.
    #: Others must be packed (``hvd_quant.core.packing.pack_lanes``) into one of these.
    allreduce_int_dtypes = ("int32", "int64")

    def __init__(self):
        self.meter = WireMeter()

    def allreduce(self, x, op, name):
        """Element-wise reduction over ranks; ``op`` is ``"sum"`` or ``"max"``. Integer
        tensors are summed exactly (never averaged)."""
        raise NotImplementedError

    def allgather(self, x, name):
        """Concatenation of every rank's ``x`` in rank order (all the same length)."""
        raise NotImplementedError

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        """Send ``x`` to rank ``dest`` and return what rank ``source`` sent to this rank.

        ``recv_numel``, the length of what arrives, lets graph-mode backends give the
        result a static shape; it may differ from ``len(x)``.

        Every rank of the communicator must call it in the same round, and the ``dest`` of
        all ranks must form a permutation (for a ring: ``dest = rank + 1``,
        ``source = rank - 1``, modulo ``size``)."""
        raise NotImplementedError

    # Helpers shared by all implementations: byte accounting under the cost model.
    def _count_allreduce(self, nbytes):
        if self.size > 1:
            self.meter.add("allreduce", 2.0 * (self.size - 1) / self.size * nbytes)

    def _count_allgather(self, nbytes):
        self.meter.add("allgather", float((self.size - 1) * nbytes))

    def _count_send(self, nbytes, dest):
        if dest != self.rank:
            self.meter.add("sendrecv", float(nbytes))
