"""An in-process world of ``n`` ranks on threads: the oracle for every collective algorithm.

Each rank runs the same per-rank code (the code that runs under Horovod) on its own thread
with numpy tensors. Collectives meet at a barrier, so the simulation also checks that
every rank issues the same collectives in the same order with the same names: a mismatch
raises :class:`CollectiveMismatch` instead of silently pairing the wrong tensors.

Example
-------
>>> world = ThreadWorld(3)
>>> world.run(lambda comm: comm.allreduce(np.ones(2) * comm.rank, "sum", "x"))  # doctest: +SKIP

Sub-groups: :meth:`ThreadComm.split` (MPI-style ``color`` / ``key``) and
:meth:`ThreadComm.subgroups` (torus rows and columns) give communicators over subsets of
the ranks, each with its own rendezvous, so collectives are checked within each group.
"""

import threading

import numpy as np

from .backend import NumpyBackend
from .comm import Communicator


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives (kind or name) in the same round."""


class _Rendezvous:
    def __init__(self, n, timeout):
        self.n = n
        self.timeout = timeout
        self.barrier = threading.Barrier(n, timeout=timeout)
        self.slots = [None] * n
        self._lock = threading.Lock()
        self._children = {}
        self._aborted = False

    def child(self, key, n):
        """The rendezvous of sub-group ``key`` (created by whichever member asks first)."""
        with self._lock:
            rv = self._children.get(key)
            if rv is None:
                rv = self._children[key] = _Rendezvous(n, self.timeout)
                if self._aborted:
                    rv.abort()
            return rv

    def abort(self):
        """Break this barrier and every sub-group's, so no rank waits for a dead one."""
        with self._lock:
            self._aborted = True
            children = list(self._children.values())
        self.barrier.abort()
        for rv in children:
            rv.abort()

    def exchange(self, rank, item):
        """Deposit ``item``; return every rank's item, in rank order."""
        self.slots[rank] = item
        self.barrier.wait()
        items = list(self.slots)
        self.barrier.wait()
        return items


class ThreadComm(Communicator):
    """One rank's view of a :class:`ThreadWorld`, or of a sub-group of it."""

    allreduce_int_dtypes = ("int8", "int16", "int32", "int64")

    def __init__(self, rendezvous, rank, size, backend):
        super().__init__()
        self._rv = rendezvous
        self.rank = rank
        self.size = size
        self.backend = backend
        self._splits = 0
        self._torus = {}

    def _exchange(self, kind, name, payload):
        # Callers deposit copies (np.array): the other ranks read a contribution after the
        # exchange returns, when its owner may already write that memory again (a torch
        # optimizer writes the mean into the gradient buffer it sent), as a real
        # collective, which copies its input, allows.
        items = self._rv.exchange(self.rank, (kind, name, payload))
        keys = {(k, nm) for k, nm, _ in items}
        if len(keys) != 1:
            raise CollectiveMismatch(f"ranks issued different collectives in one round: {sorted(keys)}")
        return [p for _, _, p in items]

    def allreduce(self, x, op, name):
        x = np.array(x)  # a copy: see _exchange
        self._count_allreduce(x.nbytes)
        parts = self._exchange("allreduce:" + op, name, x)
        if op == "sum":
            out = parts[0].copy()
            for p in parts[1:]:
                out = out + p  # integer dtypes sum exactly, in their own width
            return out.astype(x.dtype, copy=False)
        if op == "max":
            return np.max(np.stack(parts), axis=0)
        raise ValueError(f"unknown reduction {op!r}")

    def allgather(self, x, name):
        x = np.array(x)  # a copy: see _exchange
        self._count_allgather(x.nbytes)
        parts = self._exchange("allgather", name, x)
        if len({p.shape for p in parts}) != 1:
            raise CollectiveMismatch(f"allgather {name!r}: ranks contributed different shapes")
        return np.concatenate(parts)

    def alltoall(self, x, name):
        x = np.array(x)  # a copy: see _exchange
        if x.size % self.size:
            raise ValueError(f"alltoall {name!r}: {x.size} elements do not split into {self.size} chunks")
        self._count_alltoall(x.nbytes)
        parts = self._exchange("alltoall", name, x)
        if len({p.shape for p in parts}) != 1:
            raise CollectiveMismatch(f"alltoall {name!r}: ranks contributed different shapes")
        k = x.size // self.size
        return np.concatenate([p[self.rank * k:(self.rank + 1) * k] for p in parts])

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        x = np.array(x)  # a copy: see _exchange
        self._count_send(x.nbytes, dest)
        parts = self._exchange("sendrecv", name, (dest, x))
        dests = sorted(d for d, _ in parts)
        if dests != list(range(self.size)):
            raise CollectiveMismatch(f"sendrecv {name!r}: destinations are not a permutation")
        sent_dest, payload = parts[source]
        if sent_dest != self.rank:
            raise CollectiveMismatch(f"sendrecv {name!r}: rank {source} sent to {sent_dest}, "
                                     f"not to rank {self.rank}")
        if recv_numel is not None and payload.size != recv_numel:
            raise CollectiveMismatch(f"sendrecv {name!r}: expected {recv_numel} elements, got {payload.size}")
        return payload.copy()

    def split(self, color, key=None):
        """A communicator over the ranks that pass the same ``color``, ordered by
        ``(key, rank)`` (``key`` defaults to this rank). Collective over this communicator.

        The sub-communicator shares this one's :attr:`meter`.
        """
        key = self.rank if key is None else key
        self._splits += 1
        items = self._exchange("split", f"split{self._splits}", (color, key))
        members = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(items) if c == color)]
        rv = self._rv.child((self._splits, color), len(members))
        sub = ThreadComm(rv, members.index(self.rank), len(members), self.backend)
        sub.meter = self.meter
        return sub

    def subgroups(self, rows):
        """``(row_comm, col_comm)`` of a ``rows x (size // rows)`` torus; see
        :meth:`hvd_quant.core.comm.Communicator.subgroups` for the contract."""
        if rows not in self._torus:
            if rows < 1 or self.size % rows:
                raise ValueError(f"{rows} torus rows do not divide {self.size} ranks")
            row, col = divmod(self.rank, self.size // rows)
            self._torus[rows] = (self.split(color=row, key=col), self.split(color=col, key=row))
        return self._torus[rows]


class ThreadWorld:
    """``n`` simulated ranks. :meth:`run` calls ``fn(comm)`` on every rank concurrently."""

    def __init__(self, size, timeout=60.0):
        if size < 1:
            raise ValueError("a world needs at least one rank")
        self.size = size
        self.timeout = timeout
        self.backend = NumpyBackend()

    def run(self, fn):
        """Run ``fn(comm)`` on every rank; return the list of results in rank order.

        An exception on any rank aborts the others (no hang) and is re-raised here.
        """
        rv = _Rendezvous(self.size, self.timeout)
        comms = [ThreadComm(rv, r, self.size, self.backend) for r in range(self.size)]
        results = [None] * self.size
        errors = [None] * self.size

        def body(r):
            try:
                results[r] = fn(comms[r])
            except BaseException as exc:  # noqa: B902 - re-raised in the caller
                errors[r] = exc
                rv.abort()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout * 4)
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
        if first is None:
            first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        if any(t.is_alive() for t in threads):
            raise TimeoutError("simulated ranks did not finish")
        self.meters = [c.meter for c in comms]
        return results
