"""Multi-hop allreduce (ring and 2D torus) on wire-format tensors, one hop at a time.

Horovod's allreduce can only *sum* numbers. Marsit's bitwise selection, exponential
dithering's stochastic sum and other reductions that stay in a compressed format need
their own reduction at every hop, so the ring is spelled out here hop by hop on top of
:meth:`Communicator.sendrecv`. Each hop sends one chunk to the ring successor
(``dest = rank + 1``) and receives one from the predecessor (``source = rank - 1``).

Ring allreduce of a wire tensor cut into ``n`` chunks (``n`` = ranks), two phases:

1. **Reduce-scatter** (``n - 1`` hops, named ``{name}.rs{s}``). At hop ``s`` rank ``r``
   sends its partial chunk ``(r - s) mod n`` and folds the received chunk
   ``(r - s - 1) mod n`` into its own with a :class:`~hvd_quant.core.hops.HopOperator`.
   The received chunk stands for ``(s + 1) * own_count`` ranks, the local one for
   ``own_count``. Afterwards rank ``r`` holds chunk ``(r + 1) mod n`` reduced over all ranks.
2. **Allgather** (``n - 1`` hops, named ``{name}.ag{s}``). The reduced chunks travel round
   the ring *unchanged*, so every rank ends with identical data (even when the operator
   is random).

Each rank sends ``2 (n - 1)`` chunks, ``2 (n - 1) / n`` times the wire size on average
over ranks (exactly, summed over ranks), the same cost model as Horovod's allreduce.

Torus allreduce on ``R`` rows of ``C`` ranks: reduce-scatter along the row ring, a full
ring allreduce of the held chunk along the column ring (``own_count = C``, since that chunk
already stands for a whole row), then allgather along the row ring.

Butterfly allreduce (``n`` a power of two): recursive halving, then recursive doubling.
At reduce-scatter step ``k`` (distance ``m = 2**k``) rank ``r`` and its partner ``r ^ m``
hold the same range; the rank whose bit ``m`` is 0 keeps the lower half and sends the upper
one, the other the reverse, and each folds what it received into the half it keeps (both
stand for ``m`` ranks). After ``log2 n`` steps each rank holds ``1 / n`` of the wire reduced
over all ranks; the allgather retraces the steps in reverse order, copying. Every rank
sends the ring's bytes, ``2 (n - 1) / n`` of the wire (the halves add up to it), in
``2 log2 n`` hops instead of ``2 (n - 1)``. The first (largest) reduce-scatter steps and
the last allgather steps pair neighbouring ranks, so with ranks numbered host by host they
stay on the host.

Direct allreduce: one alltoall sends chunk ``j`` of every rank's (padded) wire to rank
``j``, which folds the ``n`` chunks it received with the operator, pairwise in rank order
(a balanced tree: chunks of ``c1`` and ``c2`` ranks meet), and one allgather shares the
reduced chunks. Two collectives instead of ``2 (n - 1)`` hops, the same bytes per rank up
to the padding of the wire to a multiple of ``n`` units.

Every rank issues the same hops with the same names in the same order, whatever the
tensor size: chunk sizes are static Python ints, chunks may be empty, and no branch
depends on tensor values, so the code also runs inside ``tf.function``.
"""

from .comm import exchange_blocks, gather_blocks
from .hops import HopOperator


def chunk_bounds(numel, parts, unit=1):
    """``[(start, stop)]`` of ``parts`` contiguous chunks covering ``range(numel)``.

    Chunks are cut only at multiples of ``unit`` (the last one may end at ``numel``) and
    differ by at most one unit in size; trailing chunks are empty when there are fewer
    units than parts.
    """
    units = -(-numel // unit)
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = min(numel, start + (base + (1 if i < extra else 0)) * unit)
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_reduce_scatter(B, comm, chunks, op, name, rng, own_count=1):
    """Phase 1 of a ring allreduce.

    Parameters
    ----------
    B : Backend
    comm : Communicator
        The ring; rank ``r`` sends to ``r + 1`` and receives from ``r - 1`` (mod size).
    chunks : list of tensor
        ``comm.size`` wire chunks, with the same sizes on every rank.
    op : HopOperator
    name : str
        Prefix of the hop names ``{name}.rs{s}``.
    rng : generator
        Passed to ``op.combine``.
    own_count : int
        How many ranks each rank's own chunks stand for.

    Returns
    -------
    index : int
        ``(comm.rank + 1) % comm.size``, the chunk this rank now holds fully reduced.
    chunks : list of tensor
        A new list whose entry ``index`` is the reduced chunk (other entries are partial).
    """
    n, r = comm.size, comm.rank
    chunks = list(chunks)
    sizes = [B.numel(c) for c in chunks]
    for s in range(n - 1):
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        received = comm.sendrecv(chunks[send_i], dest=(r + 1) % n, source=(r - 1) % n,
                                 name=f"{name}.rs{s}", recv_numel=sizes[recv_i])
        # Empty chunks still take part in the hop (every rank must issue it), but there
        # is nothing to combine; skipping also keeps random operators' draws out of it.
        if sizes[recv_i]:
            chunks[recv_i] = op.combine(B, chunks[recv_i], own_count,
                                        received, (s + 1) * own_count, rng)
    return (r + 1) % n, chunks


def ring_allgather(B, comm, chunks, index, name):
    """Phase 2 of a ring allreduce: forward reduced chunks unchanged round the ring.

    ``chunks[index]`` must be this rank's reduced chunk, with ``index = (rank + 1) % n``
    as returned by :func:`ring_reduce_scatter`. Returns a new list in which every entry
    is the reduced chunk, identical on every rank. Hops are named ``{name}.ag{s}``.
    """
    n, r = comm.size, comm.rank
    chunks = list(chunks)
    sizes = [B.numel(c) for c in chunks]
    for s in range(n - 1):
        send_i, recv_i = (index - s) % n, (index - s - 1) % n
        chunks[recv_i] = comm.sendrecv(chunks[send_i], dest=(r + 1) % n, source=(r - 1) % n,
                                       name=f"{name}.ag{s}", recv_numel=sizes[recv_i])
    return chunks


def ring_allreduce(B, comm, wire, op, name, rng, own_count=1):
    """Reduce the 1-D wire tensor ``wire`` over the ranks of ``comm`` with ``op``, on a ring.

    Parameters
    ----------
    B : Backend
    comm : Communicator
    wire : tensor
        1-D wire-format tensor (packed sign bytes, integer codes, floats...), the same
        length on every rank.
    op : HopOperator
        Per-hop combine; chunks are cut at multiples of ``op.unit``.
    name : str
        Prefix of the hop names (``{name}.rs{s}``, ``{name}.ag{s}``), identical on every rank.
    rng : generator
        This rank's generator, for random operators.
    own_count : int
        How many ranks ``wire`` already stands for (1, or a row size in a torus).

    Returns
    -------
    tensor
        The reduced wire tensor, same length and dtype, identical on every rank.
    """
    n = comm.size
    if n == 1:
        return wire
    bounds = chunk_bounds(B.numel(wire), n, op.unit)
    chunks = [B.slice(wire, a, b) for a, b in bounds]
    # Phase 1: reduce-scatter; each rank ends with one chunk reduced over all ranks.
    index, chunks = ring_reduce_scatter(B, comm, chunks, op, name, rng, own_count)
    # Phase 2: allgather; the reduced chunks are copied, never combined again.
    return B.concat(ring_allgather(B, comm, chunks, index, name))


def torus_allreduce(B, row_comm, col_comm, wire, op, name, rng):
    """Reduce ``wire`` over an ``R x C`` torus of ranks with ``op``.

    Parameters
    ----------
    B : Backend
    row_comm : Communicator
        The ``C`` ranks of this rank's row; ``row_comm.rank`` is the column index.
    col_comm : Communicator
        The ``R`` ranks of this rank's column; ``col_comm.rank`` is the row index. All
        ranks of a column must have the same ``row_comm.rank`` (see
        :meth:`Communicator.subgroups`).
    wire, op, name, rng
        As for :func:`ring_allreduce`. Hops are named ``{name}.row.rs{s}``,
        ``{name}.col.rs{s}``, ``{name}.col.ag{s}``, ``{name}.row.ag{s}``.

    Returns
    -------
    tensor
        The reduced wire tensor, identical on every rank of the torus.
    """
    cols = row_comm.size
    bounds = chunk_bounds(B.numel(wire), cols, op.unit)
    chunks = [B.slice(wire, a, b) for a, b in bounds]
    # Phase 1: reduce-scatter along the row; the held chunk stands for the C row ranks.
    index, chunks = ring_reduce_scatter(B, row_comm, chunks, op, f"{name}.row", rng, 1)
    # Phase 2: every rank of a column holds the same chunk index; ring-allreduce it down
    # the column, each rank's contribution counting for a whole row.
    chunks[index] = ring_allreduce(B, col_comm, chunks[index], op, f"{name}.col", rng,
                                   own_count=cols)
    # Phase 3: allgather along the row.
    return B.concat(ring_allgather(B, row_comm, chunks, index, f"{name}.row"))


#: From this many ranks on, the ring methods' default layout is the direct allreduce (two
#: collectives) instead of ``2 (n - 1)`` hops: Marsit's ``topology="auto"`` and
#: exponential dithering (docs/benchmarks/scaling.md).
DIRECT_FROM = 5

#: The most bytes a rank may receive beyond a two-collective layout's for one buffer to be
#: reduced by a single allgather instead (:func:`gathers`). A Horovod collective costs its
#: negotiation cycle over every rank whatever its size: at 16 emulated ranks at 100 Mbit/s
#: the second collective of onebit and Marsit cost 50-60 ms a step on the digits MLP
#: (docs/benchmarks/scaling.md, phase 2), about 400 KB at the link's measured rate; on
#: Horovod's 1 ms cycle 256 KiB is 2 ms at 1 Gbit/s and less at any faster link.
GATHER_EXTRA_BYTES = 256 * 1024


def gathers(n, row_bytes):
    """Whether a buffer whose packed row is ``row_bytes`` goes by one allgather of every
    rank's row at ``n`` ranks, rather than by the method's usual collectives (a
    reduce-scatter and an allgather, or an allreduce: about ``2 row_bytes`` per rank in
    all): from :data:`DIRECT_FROM` ranks on, when the allgather's ``(n - 1) row_bytes``
    exceed those bytes by at most :data:`GATHER_EXTRA_BYTES` (small buffers, where a
    collective's latency outweighs its bytes). Up to 4 ranks nothing changes: the layouts
    there stay bit for bit what they were. Used by onebit, Marsit and both Global-QSGD
    variants."""
    return n >= DIRECT_FROM and (n - 2) * row_bytes <= GATHER_EXTRA_BYTES


def is_power_of_two(n):
    return n >= 1 and n & (n - 1) == 0


def butterfly_allreduce(B, comm, wire, op, name, rng):
    """Reduce ``wire`` over the ranks of ``comm`` (a power of two) with ``op`` by recursive
    halving and doubling (module docstring). Hops are named ``{name}.bf.rs{k}`` and
    ``{name}.bf.ag{k}``. Returns the reduced wire tensor, identical on every rank."""
    n, r = comm.size, comm.rank
    if not is_power_of_two(n):
        raise ValueError(f"a butterfly allreduce needs a power-of-two number of ranks, got {n}")
    if n == 1:
        return wire
    unit = op.unit
    lo, hi = 0, B.numel(wire)
    held = wire       # the wire elements [lo, hi) as this rank holds them (partial sums)
    steps = []        # per step: (partner, my half's bounds, the partner's half's bounds)
    m, count = 1, 1
    while m < n:
        partner = r ^ m
        mid = chunk_bounds(hi - lo, 2, unit)[0][1] + lo
        lower, upper = (lo, mid), (mid, hi)
        mine, theirs = (lower, upper) if r & m == 0 else (upper, lower)
        send = B.slice(held, theirs[0] - lo, theirs[1] - lo)
        keep = B.slice(held, mine[0] - lo, mine[1] - lo)
        received = comm.sendrecv(send, partner, partner, f"{name}.bf.rs{len(steps)}",
                                 recv_numel=mine[1] - mine[0])
        if mine[1] > mine[0]:  # nothing to fold in an empty half (and no draws)
            keep = op.combine(B, keep, count, received, count, rng)
        held, (lo, hi) = keep, mine
        steps.append((partner, mine, theirs))
        m, count = 2 * m, 2 * count
    # Allgather: retrace the steps, last first; each exchange doubles what is held.
    for k, (partner, mine, theirs) in reversed(list(enumerate(steps))):
        received = comm.sendrecv(held, partner, partner, f"{name}.bf.ag{k}",
                                 recv_numel=theirs[1] - theirs[0])
        held = B.concat([held, received] if mine[0] < theirs[0] else [received, held])
    return held


def tree_fold(B, rows, counts, op, rng):
    """Fold ``rows`` (wire chunks of the same length, standing for ``counts`` ranks each)
    into one with ``op``, pairwise: ``(0, 1), (2, 3), ...``, then pairs of pairs, an odd one
    passing up unchanged. Returns ``(chunk, total count)``."""
    rows, counts = list(rows), list(counts)
    while len(rows) > 1:
        folded, folded_counts = [], []
        for i in range(0, len(rows) - 1, 2):
            folded.append(op.combine(B, rows[i], counts[i], rows[i + 1], counts[i + 1], rng))
            folded_counts.append(counts[i] + counts[i + 1])
        if len(rows) % 2:
            folded.append(rows[-1])
            folded_counts.append(counts[-1])
        rows, counts = folded, folded_counts
    return rows[0], counts[0]


def direct_padded_numel(numel, n, unit=1):
    """Length of the wire a direct allreduce moves: ``numel`` rounded up to a multiple of
    ``n`` units (every rank's chunk the same size)."""
    per = -(-numel // (n * unit)) * unit
    return per * n


def direct_allreduce(B, comm, wire, op, name, rng, extra=None):
    """Reduce ``wire`` over the ranks of ``comm`` with ``op`` in two collectives: an
    alltoall of its ``n`` chunks (``{name}.direct.rs``), a local pairwise fold of the ``n``
    chunks this rank received (:func:`tree_fold`), and an allgather of the folded chunks
    (``{name}.direct.ag``). The wire is padded with zeros to :func:`direct_padded_numel`
    elements (zero units must fold to zero, as packed sign bytes and integer sums do).

    ``extra``: uint8 bytes of the same length on every rank (a uint8 wire only) that ride
    at the end of every row of the alltoall, so that every rank receives every rank's
    ``extra`` with no collective of its own (Marsit's scales).

    Returns the reduced wire tensor, identical on every rank; with ``extra``, the pair
    ``(reduced, extras)``, ``extras`` every rank's bytes in rank order, flat.
    """
    n = comm.size
    if n == 1:
        return wire if extra is None else (wire, extra)
    numel = B.numel(wire)
    padded = direct_padded_numel(numel, n, op.unit)
    sent = B.pad(wire, padded - numel) if padded > numel else wire
    per = padded // n
    if extra is None:
        received = exchange_blocks(B, comm, sent, f"{name}.direct.rs")
    else:
        e = B.numel(extra)
        table = B.concat_columns([B.reshape(sent, (n, per)), B.reshape(B.concat([extra] * n), (n, e))])
        table = B.reshape(exchange_blocks(B, comm, B.reshape(table, (-1,)), f"{name}.direct.rs"),
                          (n, per + e))
        received = B.reshape(B.slice_columns(table, 0, per), (-1,))
        extras = B.reshape(B.slice_columns(table, per, per + e), (-1,))
    rows = [B.slice(received, i * per, (i + 1) * per) for i in range(n)]
    folded = tree_fold(B, rows, [1] * n, op, rng)[0] if per else rows[0]
    gathered = gather_blocks(B, comm, folded, f"{name}.direct.ag")
    out = B.slice(gathered, 0, numel) if padded > numel else gathered
    return out if extra is None else (out, extras)


class IntSum(HopOperator):
    """Exact integer sum (ignores counts). Wraps on overflow like the wire dtype does, so
    choose a dtype wide enough for the sum over all ranks."""

    name = "int_sum"

    def combine(self, B, own, own_count, received, received_count, rng):
        return own + received


class FloatSum(HopOperator):
    """Floating-point sum (ignores counts). Chunks are added in a different order on
    different chunks, but the allgather copies results, so all ranks still agree."""

    name = "float_sum"

    def combine(self, B, own, own_count, received, received_count, rng):
        return own + received
