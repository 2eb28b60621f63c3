"""Horovod process sets for a 2D torus: rows, then columns.

A torus allreduce (``Compression.marsit(topology="torus", torus_rows=R)``) runs its hops
on row rings and column rings. Register the row and column sets when Horovod starts and
the hops run inside those process sets::

    hvd.init(process_sets=hvd_quant.torus_process_sets(rows=2, size=4))

Without them, each row/column hop is routed through one global alltoall instead
(:class:`hvd_quant.core.comm.RoutedGroup`); results are identical either way.
"""

from .core.hierarchical import horovod_ranks_per_node

_CREATED = []  # every ProcessSet made here; hvd.init() fills in their ids


def torus_layout(rows, size):
    """``(row_rank_lists, column_rank_lists)``: row ``i`` holds ranks ``i*cols ...``."""
    if rows < 1 or size % rows:
        raise ValueError(f"torus rows={rows} must divide the number of ranks ({size})")
    cols = size // rows
    row_lists = [list(range(i * cols, (i + 1) * cols)) for i in range(rows)]
    col_lists = [list(range(j, size, cols)) for j in range(cols)]
    return row_lists, col_lists


def torus_process_sets(rows, size):
    """ProcessSet objects for every row and column of a ``rows x (size // rows)`` torus,
    to pass to ``hvd.init(process_sets=...)``. Rows or columns that would be the whole
    world (or one rank) are left out; those hops use the global set or are no-ops."""
    from horovod.common.process_sets import ProcessSet

    row_lists, col_lists = torus_layout(rows, size)
    sets = [ProcessSet(r) for r in row_lists + col_lists if 1 < len(r) < size]
    _CREATED.extend(sets)
    return sets


def node_process_sets(ranks_per_node, size):
    """ProcessSet objects for the hierarchical 1-bit allreduce (BinSGDM): every node's
    ranks, and every group of ranks that share a local rank, with ``ranks_per_node``
    contiguous ranks per node. Pass them to ``hvd.init(process_sets=...)``."""
    if ranks_per_node < 1 or size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the number of ranks ({size})")
    return torus_process_sets(size // ranks_per_node, size)


def includes_this_rank(process_set):
    """Whether this rank is in ``process_set`` (Horovod's ``ProcessSet.included()``), with
    the global set always included: Horovod computes ``included()`` through whichever
    framework's Horovod was imported last, so with both ``horovod.torch`` and
    ``horovod.tensorflow`` imported, the global set reads as empty (seen with 0.28.1)."""
    return process_set.process_set_id == 0 or bool(process_set.included())


def registered_set(ranks):
    """The initialised ProcessSet made by :func:`torus_process_sets` with exactly these
    ranks, or ``None``. Sets from an earlier ``hvd.init()`` that Horovod no longer knows
    are forgotten first: after ``hvd.shutdown(); hvd.init()`` their ids may name other
    ranks."""
    forget_stale_sets()
    for ps in _CREATED:
        if ps.process_set_id is not None and list(ps.ranks) == sorted(ranks):
            return ps
    return None


def forget_stale_sets():
    """Invalidate the process sets made here that Horovod no longer knows.

    Horovod Elastic resets with ``hvd.shutdown(); hvd.init()``, without process sets, and
    does not invalidate the old ``ProcessSet`` objects: their ids would name sets that no
    longer exist (or other ranks). Called by the elastic states of
    :mod:`hvd_quant.torch.elastic` / :mod:`hvd_quant.tensorflow.elastic` on every reset;
    the torus and node hops then run routed through the global set (same results) unless
    the sets are registered again (e.g. ``hvd.add_process_set`` with
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1``)."""
    live = {}
    try:
        from horovod.common.process_sets import _basics
        live = {int(i): sorted(r) for i, r in _basics._get_process_set_ids_and_ranks().items()}
    except Exception:  # Horovod not initialised: nothing is live
        live = {}
    for ps in _CREATED:
        if ps.process_set_id is not None and live.get(ps.process_set_id) != sorted(ps.ranks):
            ps._invalidate()


class ProcessSetTorus:
    """Mixin for Horovod communicators (torch and TF): torus rows and columns over
    registered process sets, else the routed default of ``Communicator.subgroups``.

    A subclass sets ``_horovod`` (``horovod.torch`` or ``horovod.tensorflow``) and is
    made with ``process_set=None``: Horovod's global process set."""

    def __init__(self, process_set=None):
        super().__init__()
        self.process_set = (process_set if process_set is not None
                            else self._horovod.global_process_set)
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()

    def refresh(self):
        """Re-read ``rank`` and ``size`` from the process set and forget the cached torus
        sub-groups. Call after Horovod was initialised again (an elastic reset): a
        communicator caches both, and the world may have changed."""
        if self.process_set.process_set_id is None:
            raise RuntimeError(f"hvd_quant: the process set {self.process_set!r} is no longer "
                               "registered with Horovod (after an elastic reset only the global "
                               "process set exists); use the global process set with elastic jobs")
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()
        self.__dict__.pop("_torus", None)

    def ranks_per_node(self):
        """Ranks per host from Horovod's local and cross sizes (the global process set
        only, with every host holding as many ranks, numbered host by host; else None)."""
        if self.process_set.process_set_id != 0:
            return None
        return horovod_ranks_per_node(self._horovod)

    def subgroups(self, rows):
        """Row and column rings of a torus: over Horovod process sets when they were
        registered with ``hvd.init(process_sets=hvd_quant.torus_process_sets(...))``,
        else routed through global alltoalls (see ``Communicator.subgroups``)."""
        cache = self.__dict__.setdefault("_torus", {})
        if rows not in cache:
            cache[rows] = torus_subgroups(self, rows, type(self)) or super().subgroups(rows)
        return cache[rows]


def torus_subgroups(comm, rows, make):
    """``(row_comm, col_comm)`` over registered process sets, or ``None`` when ``comm`` is
    not the global set or the sets were not registered. ``make(process_set)`` builds a
    communicator of the caller's framework; both share ``comm``'s byte meter."""
    if comm.process_set.process_set_id != 0:
        return None
    row_lists, col_lists = torus_layout(rows, comm.size)
    cols = comm.size // rows
    mine = (row_lists[comm.rank // cols], col_lists[comm.rank % cols])
    found = [registered_set(r) for r in mine]
    if any(ps is None for ps in found):
        return None
    pair = tuple(make(ps) for ps in found)
    for c in pair:
        c.meter = comm.meter
    return pair
