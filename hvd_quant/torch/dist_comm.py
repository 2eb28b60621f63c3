"""``torch.distributed`` implementation of :class:`hvd_quant.core.comm.Communicator`.

The compressors are written once, per rank, against a :class:`~hvd_quant.core.comm.Communicator`;
Horovod is one transport (:class:`hvd_quant.torch.comm.HorovodTorchComm`), a
``torch.distributed`` process group is another: :class:`DistComm`. Whatever backend the
group was created with does the work, Gloo for CPU tensors and NCCL for CUDA tensors,
by the same code. This module does not import Horovod.

Mapping of the collectives:

* ``allreduce(x, "sum" | "max")``: ``dist.all_reduce`` with ``ReduceOp.SUM`` / ``MAX``;
* ``allgather``: ``dist.all_gather`` into ``size`` tensors, concatenated in rank order;
* ``alltoall``: ``dist.all_to_all_single`` with equal splits; a large one in pieces
  (:func:`hvd_quant.core.comm.alltoall_pieces`);
* ``sendrecv``: one ``dist.batch_isend_irecv`` with a send to ``dest`` and a receive from
  ``source`` (both issued at once, so a ring of ranks cannot deadlock on the order of
  its sends and receives);
* ``*_async``: the same with ``async_op=True``; the handle's ``wait()`` gives the result
  (:func:`hvd_quant.core.pipeline.start_allgather` and its siblings use them).

Collective names are not sent: ``torch.distributed`` matches collectives by the order in
which every rank issues them, and the algorithms already issue them in the same order on
every rank (the names are what Horovod matches by). Bytes go on the same
:class:`~hvd_quant.core.comm.WireMeter` under the same cost model as Horovod's, so
``bytes_sent`` compares across transports. Every blocking wait runs under the collective
deadline of :mod:`hvd_quant.core.watchdog` (besides the process group's own timeout).

Ranks per node (:meth:`DistComm.ranks_per_node`, which Marsit's ``topology="auto"``
reads): on the world group, from ``torchrun``'s ``LOCAL_WORLD_SIZE``/``LOCAL_RANK``/
``GROUP_RANK``; else (another group, or no ``torchrun``) from every rank's host name,
gathered once over the group.
"""

import os
import socket

import torch
import torch.distributed as dist

from ..core.comm import Communicator
from ..core.hierarchical import ranks_per_node_of
from ..core.watchdog import WATCHDOG
from . import pieces

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class _Work:
    """An asynchronous ``torch.distributed`` collective; ``wait()`` (under the collective
    deadline) returns ``finish()``, its result."""

    def __init__(self, work, finish, label):
        self._work, self._finish, self._label = work, finish, label

    def wait(self):
        with WATCHDOG.guard(self._label):
            self._work.wait()
        return self._finish()


class _Done:
    def __init__(self, value):
        self._value = value

    def wait(self):
        return self._value


class DistComm(Communicator):
    """Collectives over a ``torch.distributed`` process group (default: the world).

    ``torch.distributed`` must be initialised (``dist.init_process_group``, as
    ``torchrun`` programs do). ``rank`` and ``size`` are this process's within ``group``;
    a process outside ``group`` cannot make one (``ValueError``).

    Parameters
    ----------
    group : ProcessGroup or None
        The process group (``None``: the default, world group).
    """

    # The integer sums that the algorithms pack into: the same as Horovod's, so the packed
    # layouts, and hence the bits, are the same on both transports.
    allreduce_int_dtypes = ("int32", "int64")

    def __init__(self, group=None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("hvd_quant: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group() first (torchrun sets up "
                               "its environment)")
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("hvd_quant: this process is not a member of the process group given")
        self.size = dist.get_world_size(group)
        self._rpn = "unknown"

    def _global(self, r):
        """The world rank of rank ``r`` of this communicator's group (point-to-point
        operations take world ranks)."""
        if self.group is None:
            return r
        return dist.get_global_rank(self.group, r)

    # --- blocking collectives ---------------------------------------------------------------
    def allreduce(self, x, op, name):
        return self.allreduce_async(x, op, name).wait()

    def allgather(self, x, name):
        return self.allgather_async(x, name).wait()

    def alltoall(self, x, name):
        return self.alltoall_async(x, name).wait()

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        if self.size == 1 or (dest == self.rank and source == self.rank):
            return x.clone()
        self._count_send(x.numel() * x.element_size(), dest)
        x = x.contiguous()
        out = torch.empty(x.numel() if recv_numel is None else int(recv_numel),
                          dtype=x.dtype, device=x.device)
        # The receive is posted before the send. Over Gloo, with the send posted first, one
        # exchange in three or so ran one way and then the other: 14.7 MB each way took
        # 2.4 s instead of 1.2 s at 100 Mbit/s, and the 1-bit optimizers' fp32 rounds
        # (a ring of these) 1.6x Horovod's (benchmarks/reference/ddp-2026-12-03/gloo-exchange/).
        ops = [dist.P2POp(dist.irecv, out, self._global(source), self.group),
               dist.P2POp(dist.isend, x, self._global(dest), self.group)]
        works = dist.batch_isend_irecv(ops)
        with WATCHDOG.guard(f"ring hop {name!r}"):
            for w in works:
                w.wait()
        return out

    # --- asynchronous twins (hvd_quant.core.pipeline.start_*) ---------------------------------
    def allreduce_async(self, x, op, name):
        if x.dtype not in (torch.int32, torch.int64) and not x.is_floating_point():
            raise TypeError(f"hvd_quant: allreduce of {x.dtype} is not portable across "
                            "torch.distributed backends; pack small integers into int32 lanes "
                            "(hvd_quant.core.packing.pack_lanes)")
        self._count_allreduce(x.numel() * x.element_size())
        out = x.clone().contiguous()  # the caller's tensor stays as it was, as with Horovod
        if self.size == 1:
            return _Done(out)
        work = dist.all_reduce(out, op=_OPS[op], group=self.group, async_op=True)
        return _Work(work, lambda: out, f"allreduce {name!r}")

    def allgather_async(self, x, name):
        self._count_allgather(x.numel() * x.element_size())
        x = x.contiguous()
        if self.size == 1:
            return _Done(x.clone())
        parts = [torch.empty_like(x) for _ in range(self.size)]
        work = dist.all_gather(parts, x, group=self.group, async_op=True)
        return _Work(work, lambda: torch.cat(parts), f"allgather {name!r}")

    def alltoall_async(self, x, name):
        if x.numel() % self.size:
            raise ValueError(f"alltoall {name!r}: {x.numel()} elements do not split into "
                             f"{self.size} chunks")
        if self.size == 1:
            return _Done(x.clone())
        self._count_alltoall(x.numel() * x.element_size())
        return pieces.start_alltoall(x, self.size, name, self._start_alltoall)

    def _start_alltoall(self, x, name):
        x = x.contiguous()
        out = torch.empty_like(x)
        work = dist.all_to_all_single(out, x, group=self.group, async_op=True)
        return _Work(work, lambda: out, f"alltoall {name!r}")

    # --- layout --------------------------------------------------------------------------------
    def ranks_per_node(self):
        """``k`` when the group's ranks lie ``k`` to a node, node by node, on more than one
        node (see :meth:`Communicator.ranks_per_node`); ``None`` otherwise.

        Collective the first time on a group other than the world (or without
        ``torchrun``'s environment): every rank's host name is gathered once. Every rank
        calls it at the same point (the compressor's first-step layout check)."""
        if self._rpn == "unknown":
            self._rpn = self._derive_ranks_per_node()
        return self._rpn

    def _derive_ranks_per_node(self):
        env = os.environ
        if (self.group is None and "LOCAL_WORLD_SIZE" in env and "LOCAL_RANK" in env
                and "GROUP_RANK" in env):
            local = int(env["LOCAL_WORLD_SIZE"])
            if local > 0 and self.size % local == 0:
                return ranks_per_node_of(self.rank, int(env["LOCAL_RANK"]), local,
                                         int(env["GROUP_RANK"]), self.size // local, self.size)
            return None
        if self.size == 1:
            return None
        hosts = [None] * self.size
        dist.all_gather_object(hosts, socket.gethostname(), group=self.group)
        return ranks_per_node_from_hosts(hosts)


def ranks_per_node_from_hosts(hosts):
    """``k`` when ``hosts`` (one host name per rank, in rank order) is ``size // k`` runs of
    ``k`` equal names, each host once, with more than one host and ``k > 1``; else ``None``."""
    size = len(hosts)
    k = 1
    while k < size and hosts[k] == hosts[0]:
        k += 1
    if k == 1 or k == size or size % k:
        return None
    runs = [hosts[i:i + k] for i in range(0, size, k)]
    if any(len(set(run)) != 1 for run in runs) or len({run[0] for run in runs}) != len(runs):
        return None
    return k
