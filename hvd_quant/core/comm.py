"""Collectives seen by one rank, and a wire meter that counts the bytes they send.

Algorithms in :mod:`hvd_quant` are written per rank against :class:`Communicator`. Three
implementations exist: Horovod for torch (:mod:`hvd_quant.torch.comm`), Horovod for
TensorFlow (:mod:`hvd_quant.tensorflow.comm`) and threads in one process
(:class:`hvd_quant.core.simulate.ThreadWorld`), which is the test oracle.

Every collective carries a ``name``. All ranks must issue the same collectives, in the same
order, with the same names; Horovod matches collectives across ranks by name.
"""


import os

#: An alltoall sends each peer pieces of at most this many bytes when its share per peer
#: is above :data:`SPLIT_ABOVE` pieces (:func:`alltoall_pieces`); ``HVD_QUANT_PIECE_BYTES``
#: in the environment sets it, ``0``: never in pieces.
PIECE_BYTES = int(os.environ.get("HVD_QUANT_PIECE_BYTES", 1 << 20))
SPLIT_ABOVE = 4
if PIECE_BYTES < 0:
    raise ValueError(f"HVD_QUANT_PIECE_BYTES must be 0 (never in pieces) or a positive byte "
                     f"count, got {PIECE_BYTES}")


def alltoall_pieces(numel, size, element_size):
    """Column bounds ``[(a, b), ...]`` of the pieces of an alltoall of ``numel`` elements
    in ``size`` equal shares (piece ``i`` takes columns ``a:b`` of every share), or
    ``None``: send it whole.

    Why pieces: over Gloo's TCP pairs a whole alltoall that sent a peer 8 MB or more ran
    one direction and then the other. At 2 emulated hosts and 1 Gbit/s, 58.7 MB each way
    took 1,027 ms through Horovod and 1,029 ms through ``torch.distributed`` (medians of
    7), the time of both directions' bytes in turn, where a plain TCP socket between the
    same hosts carried them both ways at once in 493 ms. In pieces of 1 MiB per peer, all
    started before the first is waited for, it took 743 ms through Horovod and 519 ms
    through ``torch.distributed``; 13.1 MB (a 25 MiB bucket's share) 224 -> 154 ms and
    8 MB 137 -> 89 ms through Horovod (``benchmarks/reference/alltoall-pieces-2026-12-06/``).
    Shares of 2 and 4 MB, which go whole, took their bytes' time in about half the calls
    and twice it in the rest. The likely cause, from Gloo's source and not measured:
    ``gloo/alltoallv.cc`` posts each send before its receive, and the TCP transport holds
    a send until the peer says it is ready to receive, a notice that goes out on the same
    socket behind any data already being sent (``DistComm.sendrecv`` met the same one-way
    runs with the send posted first). Horovod built by ``scripts/build_horovod.sh`` (Fix 10,
    wheel ``p7``) posts Gloo's receives first: its whole alltoall of 58.7 MB each way then
    took 531-551 ms, faster than the pieces (616), so ``HorovodTorchComm`` sends whole there
    (``benchmarks/reference/gloo-recv-first-2026-12-07/``); the pieces stay for
    ``torch.distributed``, whose Gloo is torch's own, and for a Horovod built elsewhere.

    The pieces depend only on ``numel``, which every rank's alltoall has the same of (the
    :meth:`Communicator.alltoall` contract), so every rank issues the same pieces. What
    reaches the size at 2 ranks: a probe's exact fp32 exchange (:mod:`hvd_quant.core.metrics`)
    of a bucket above 8 MB, and a 1-bit wire sent as one buffer for a whole model above
    about 67M parameters; a 1-bit wire of a 25 MiB bucket is 0.8 MB. Measured at 2 hosts
    only. Horovod's TensorFlow alltoall in pieces was no faster (905 ms eagerly, 839 in
    one ``tf.function``, against 784 whole, whose calls took 520 or 1,000 ms), so its
    communicator sends it whole."""
    share = numel // size
    per_piece = PIECE_BYTES // element_size
    if size < 2 or per_piece < 1 or share <= SPLIT_ABOVE * per_piece:
        return None
    return [(a, min(a + per_piece, share)) for a in range(0, share, per_piece)]


class WireMeter:
    """Counts the bytes one rank sends, under the usual cost model of each collective.

    * allreduce of ``b`` bytes (ring): ``2 * (n - 1) / n * b``
    * allgather of a ``b``-byte contribution (ring): ``(n - 1) * b``
    * alltoall of ``b`` bytes in ``n`` equal chunks: ``(n - 1) / n * b`` (the own chunk stays)
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

    def alltoall(self, x, name):
        """``x`` cut into ``size`` equal chunks; chunk ``j`` goes to rank ``j``. Returns the
        chunks this rank received, concatenated in rank order (same length as ``x``)."""
        raise NotImplementedError

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        """Send ``x`` to rank ``dest`` and return what rank ``source`` sent to this rank.

        ``recv_numel``, the length of what arrives, lets graph-mode backends give the
        result a static shape; it may differ from ``len(x)``.

        Every rank of the communicator must call it in the same round, and the ``dest`` of
        all ranks must form a permutation (for a ring: ``dest = rank + 1``,
        ``source = rank - 1``, modulo ``size``)."""
        raise NotImplementedError

    def ranks_per_node(self):
        """Optional hook: ``k`` when this communicator's ranks lie node by node, ``k``
        contiguous ranks on each of ``size // k`` nodes (more than one node, more than one
        rank each); ``None`` when they do not or it is not known (the default). Methods
        that can follow the node boundary read it (Marsit's ``topology="auto"``); ranks
        that derive different layouts from it are stopped by the first-step agreement
        check (``CompressorRunner.check_once``)."""
        return None

    def subgroups(self, rows):
        """Optional hook: the row and column communicators of a 2D torus of this
        communicator's ranks, ``(row_comm, col_comm)``. Used by torus allreduce
        (:func:`hvd_quant.core.ring.torus_allreduce`); communicators without sub-groups
        get the default, :class:`RoutedGroup` pairs that route each hop through this
        communicator's own ``sendrecv``.

        Contract for implementations:

        * ``rows`` must divide ``size``; with ``cols = size // rows``, rank ``r`` sits at
          row ``r // cols``, column ``r % cols`` (rows are contiguous ranks, e.g. the
          ranks of one node).
        * ``row_comm`` holds the ``cols`` ranks of this rank's row, with
          ``row_comm.rank == r % cols``; ``col_comm`` holds the ``rows`` ranks of this
          rank's column, with ``col_comm.rank == r // cols``. Both support ``sendrecv``
          (and may support the other collectives).
        * It is collective: every rank calls it with the same ``rows`` at the same point.
          It is called on every step: create the groups (e.g. Horovod process sets)
          once and return the same cached pair for the same ``rows`` afterwards.
        * The same collective name is issued at the same time on different rows (and on
          different columns); each sub-communicator must match names only among its own
          members (Horovod process sets do).
        * Bytes sent through the sub-communicators are counted on this communicator's
          ``meter`` (share it), so ``meter`` keeps reporting the rank's total traffic.
        """
        cache = self.__dict__.setdefault("_routed_subgroups", {})
        if rows not in cache:
            if rows < 1 or self.size % rows:
                raise ValueError(f"torus rows={rows} must divide the number of ranks ({self.size})")
            cols = self.size // rows
            row, col = divmod(self.rank, cols)
            cache[rows] = (RoutedGroup(self, [row * cols + c for c in range(cols)]),
                           RoutedGroup(self, [r * cols + col for r in range(rows)]))
        return cache[rows]


    # Helpers shared by all implementations: byte accounting under the cost model.
    def _count_allreduce(self, nbytes):
        if self.size > 1:
            self.meter.add("allreduce", 2.0 * (self.size - 1) / self.size * nbytes)

    def _count_allgather(self, nbytes):
        self.meter.add("allgather", float((self.size - 1) * nbytes))

    def _count_alltoall(self, nbytes):
        if self.size > 1:
            self.meter.add("alltoall", (self.size - 1) / self.size * nbytes)

    def _count_send(self, nbytes, dest):
        if dest != self.rank:
            self.meter.add("sendrecv", float(nbytes))


def identical_sum(B, comm, x, name):
    """Sum of the small float vector ``x`` over ranks, bit-identical on every rank.

    Horovod's float allreduce over Gloo was seen to round differently on different ranks
    with 3 ranks (the per-rank results differed in the last bit). A scale that every rank
    must share (a global norm, Marsit's magnitude) therefore travels by allgather and is
    summed locally in rank order: ``n`` times the bytes of ``x``, which is a handful of
    scalars here.
    """
    return rank_order_sum(B, comm.allgather(x, name), comm.size)


def rank_order_sum(B, gathered, n):
    """The sum of the ``n`` equal parts of an allgather's result, added in rank order (the
    second half of :func:`identical_sum`, for a caller that started the allgather itself
    and waits for it later)."""
    k = B.numel(gathered) // n
    rows = B.reshape(gathered, (n, k))
    total = B.reshape(B.slice(rows, 0, 1), (k,))
    for r in range(1, n):
        total = total + B.reshape(B.slice(rows, r, r + 1), (k,))
    return total


def all_ranks_finite(B, comm, x, name):
    """A boolean scalar tensor, identical on every rank: no rank's ``x`` holds inf or NaN.

    One 4-byte allreduce (max of a 0/1 flag). Methods whose existing collectives carry a
    float that a non-finite input would poison use that instead, at no extra cost.
    """
    flag = B.where(B.all_finite(x), B.zeros(1), B.full(1, 1.0))
    return B.less(comm.allreduce(flag, "max", name), B.full(1, 0.5))


def gather_blocks(B, comm, x, name):
    """Every rank's ``x`` (same length everywhere), concatenated in rank order.

    ``comm.allgather`` where the communicator has one; over a :class:`RoutedGroup`, a ring
    of ``n - 1`` sendrecv hops that forwards each block unchanged (same bytes)."""
    if not isinstance(comm, RoutedGroup):
        return comm.allgather(x, name)
    n, r = comm.size, comm.rank
    blocks = [None] * n
    blocks[r] = x
    for s in range(n - 1):
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        blocks[recv_i] = comm.sendrecv(blocks[send_i], (r + 1) % n, (r - 1) % n,
                                       f"{name}.ag{s}", recv_numel=B.numel(x))
    return B.concat(blocks)


def exchange_blocks(B, comm, x, name):
    """Alltoall of ``x`` cut into ``n`` equal blocks: block ``j`` goes to rank ``j``;
    returns the blocks received, in source-rank order.

    ``comm.alltoall`` where the communicator has one; over a :class:`RoutedGroup`,
    ``n - 1`` rounds of sendrecv, round ``s`` sending to rank ``r + s`` (same bytes)."""
    if not isinstance(comm, RoutedGroup):
        return comm.alltoall(x, name)
    n, r = comm.size, comm.rank
    k = B.numel(x) // n
    received = [None] * n
    received[r] = B.slice(x, r * k, (r + 1) * k)
    for s in range(1, n):
        dest, source = (r + s) % n, (r - s) % n
        received[source] = comm.sendrecv(B.slice(x, dest * k, (dest + 1) * k), dest, source,
                                         f"{name}.a2a{s}", recv_numel=k)
    return B.concat(received)


class WrappingComm(Communicator):
    """A communicator that wraps another (``inner``): its rank and size (an elastic reset
    refreshes them), its meter (bytes are counted once, by ``inner``), the integer dtypes
    it sums, and every attribute a subclass does not define (a process set, sub-groups,
    asynchronous collectives) are ``inner``'s. Subclasses override the collectives they
    change: :class:`hvd_quant.torch.staging.StagingComm` (host staging),
    :class:`hvd_quant.core.metrics.TimedComm` (timing)."""

    _OWN = ("inner",)  # looked up on the instance only: never forwarded to inner

    def __init__(self, inner):  # no Communicator.__init__: the meter is inner's
        self.inner = inner
        self.meter = inner.meter
        self.allreduce_int_dtypes = inner.allreduce_int_dtypes

    @property
    def rank(self):
        return self.inner.rank

    @property
    def size(self):
        return self.inner.size

    def __getattr__(self, name):
        if name in self._OWN:
            raise AttributeError(name)
        return getattr(self.inner, name)


class RoutedGroup(Communicator):
    """A sub-group whose hops are routed through the parent's ``sendrecv``.

    The default :meth:`Communicator.subgroups`. Every rank of the parent runs the same
    hop at the same time (all rows of a torus step together), so one parent ``sendrecv``
    in which each rank sends to its successor *within its group* is one hop of every
    group at once. Under Horovod that is a single alltoall with one non-empty split per
    rank: no extra process sets are needed. Only ``sendrecv`` is offered;
    :func:`gather_blocks` and :func:`exchange_blocks` build allgather and alltoall from it.
    """

    def __init__(self, parent, members):
        super().__init__()
        self.parent = parent
        self.members = list(members)
        self.rank = self.members.index(parent.rank)
        self.size = len(self.members)
        self.meter = parent.meter  # traffic is the parent rank's traffic

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        return self.parent.sendrecv(x, self.members[dest], self.members[source], name, recv_numel)

    def allreduce(self, x, op, name):
        raise NotImplementedError("a routed torus group only offers sendrecv")

    def allgather(self, x, name):
        raise NotImplementedError("a routed torus group only offers sendrecv")
