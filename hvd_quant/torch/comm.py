"""Horovod (torch) implementation of :class:`hvd_quant.core.comm.Communicator`.

Where a collective's tensors live (``wire``): ``"host"`` when Horovod is handed tensors in
host memory (CPU parameters, or GPU tensors staged through host buffers by
:class:`hvd_quant.torch.staging.StagingComm`), ``"device"`` when Horovod is handed GPU
tensors itself (a Horovod built with GPU operations). Every rank must hand Horovod the
same kind: before its first collective (and again after an elastic reset) a
communicator compares its ``wire`` with every rank's in one small allgather of host
memory, named after that first collective, and all ranks raise
:class:`~hvd_quant.core.runner.RankDisagreement` together if they differ (Horovod would
refuse the collective, or, for a GPU tensor that Horovod copies to the host itself
without a GPU build, read it before the copy is done).

Large alltoalls go in pieces, unless Horovod's Gloo receives first
--------------------------------------------------------------------
An alltoall that sends a peer more than :data:`~hvd_quant.core.comm.SPLIT_ABOVE` pieces
of :data:`~hvd_quant.core.comm.PIECE_BYTES` goes as pieces, all started before the first
is waited for (:mod:`hvd_quant.torch.pieces`): over Gloo as released a whole one ran one
direction at a time (:func:`hvd_quant.core.comm.alltoall_pieces` has the measurements).
A Horovod built by ``scripts/build_horovod.sh`` posts Gloo's receives first (its Fix 10),
and there a whole alltoall was 10-16% faster than the pieces, so
:attr:`HorovodTorchComm.in_pieces` is then False. Every rank must cut the same: the first
collective's check compares the piece size (with the wire) and raises on every rank where
they differ.

Waiting for a collective
------------------------
``hvd.synchronize`` busy-waits: Horovod 0.28.1 polls the handle in a loop that calls
``std::this_thread::yield()``, so a rank waiting 2 s for a late peer used 1.98 s of CPU.
With a core per rank that costs nothing and answers the moment the bytes are in (polling
with sleeps made the LM step 10-16 ms slower on the emulated 10 Gbit/s cluster, 2 hosts x
1, 5 interleaved rounds, 2026-11-26). With more ranks than cores, the spinning ranks take
the CPU from the ranks, and from the Horovod and Gloo threads, that have work to do.
:data:`WAIT` says how every collective here is waited for (:func:`wait_mode`).
"""

import importlib
import os
import time

import torch
import horovod.torch as hvd

from ..core import comm as core_comm
from ..core.comm import Communicator
from ..core.runner import check_agreement
from ..core.watchdog import WATCHDOG
from ..process_sets import ProcessSetTorus, torus_subgroups
from . import pieces

#: The ``wire`` values, as the codes the agreement check gathers.
WIRES = {"host": 1, "device": 2}

# Horovod's torch allreduce handles these dtypes only (no int8/uint8/bool: horovod #3661).
_ALLREDUCE_DTYPES = (torch.int32, torch.int64, torch.float16, torch.float32, torch.float64)


#: How collectives are waited for: ``"spin"`` (``hvd.synchronize``, as Horovod does),
#: ``"sleep"`` (``hvd.poll`` with sleeps of 20 us doubling up to 1 ms) or ``"auto"``
#: (:func:`wait_mode`). ``HVD_QUANT_WAIT`` in the environment sets it.
WAIT = os.environ.get("HVD_QUANT_WAIT", "auto")
_WAIT_MODES = ("auto", "spin", "sleep")
_resolved = {}


def wait_mode():
    """``"spin"`` or ``"sleep"``: :data:`WAIT`, with ``"auto"`` resolved (once per process)
    to ``"sleep"`` when this host holds more ranks than this process has usable cores
    (:func:`hvd_quant.kernels.threads.usable_cores`), else ``"spin"``.

    Measured with ``benchmarks/scaling_probe.py chain`` (2026-11-28, a shared machine):
    3 ranks on 2 cores, chains of 4-byte and 64 KB collectives, sleeping was faster for
    every kind (allreduce 17 against 21 ms, a ring hop of 64 KB 4.6 against 8.9 ms, the
    mean of 20 allreduces of 64 KB 9 against 299 ms) and used a third of the CPU; 2
    emulated hosts with a core each, spinning was faster (a 4-byte allreduce 1.3 against
    4.9 ms)."""
    if WAIT not in _WAIT_MODES:
        raise ValueError(f"HVD_QUANT_WAIT must be one of {_WAIT_MODES}, got {WAIT!r}")
    if WAIT != "auto":
        return WAIT
    if "auto" not in _resolved:
        from ..kernels.threads import usable_cores
        _resolved["auto"] = "sleep" if hvd.local_size() > usable_cores()[0] else "spin"
    return _resolved["auto"]


def wait_for(handle):
    """``hvd.synchronize(handle)``, waited for in the :func:`wait_mode` way."""
    if wait_mode() == "sleep":
        delay = 20e-6
        while not hvd.poll(handle):
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)
    return hvd.synchronize(handle)


class _AsyncHandle:
    """A Horovod handle whose ``wait()`` runs under the collective deadline."""

    def __init__(self, handle, label, pick=None):
        self._handle, self._label, self._pick = handle, label, pick

    def wait(self):
        with WATCHDOG.guard(self._label):
            out = wait_for(self._handle)
        return out[self._pick] if self._pick is not None else out


def gloo_receives_first():
    """Whether the installed Horovod was built with Gloo's alltoall and allgather posting
    each receive before its send: ``scripts/build_horovod.sh`` (Fix 10) writes
    ``GLOO_RECEIVES_FIRST`` into the module ``horovod.hvd_quant_build`` of the Horovod it
    builds. Then a whole alltoall runs both ways at once: 531 ms against 616 in 1 MiB
    pieces for 58.7 MB each way at 2 emulated hosts and 1 Gbit/s
    (``benchmarks/reference/gloo-recv-first-2026-12-07/``)."""
    try:
        build = importlib.import_module("horovod.hvd_quant_build")
    except ImportError:
        return False
    return bool(getattr(build, "GLOO_RECEIVES_FIRST", False))


class HorovodTorchComm(ProcessSetTorus, Communicator):
    """Collectives over a Horovod process set (the global one by default). Every call
    runs under the collective deadline of :mod:`hvd_quant.core.watchdog` (for the
    ``*_async`` ones: the handle's ``wait()``)."""

    _horovod = hvd  # ProcessSetTorus reads the global process set and the layout from it
    #: Large alltoalls in pieces (module docstring): not where Horovod's Gloo receives first.
    in_pieces = not gloo_receives_first()

    def __init__(self, process_set=None, wire="host"):
        super().__init__(process_set)
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {sorted(WIRES)}, got {wire!r}")
        self.wire = wire
        self._wire_checked = False

    def refresh(self):
        super().refresh()
        self._wire_checked = False  # ranks that joined check theirs: so must the others

    def _check_wire(self, name):
        """Before the first collective (named ``name``, the same on every rank): every rank
        hands Horovod tensors of the same kind (module docstring). Not counted on the
        meter: it is set-up, not gradient traffic."""
        if self._wire_checked:
            return
        self._wire_checked = True
        if self.size == 1:
            return
        # The alltoall's pieces name collectives of their own: ranks that cut differently
        # would wait for each other's pieces forever.
        code = torch.tensor([WIRES[self.wire], self._piece_bytes()], dtype=torch.int64)
        label = f"hvd_quant.wire.{name}"
        with WATCHDOG.guard(f"allgather {label!r}"):
            gathered = wait_for(hvd.allgather_async(code, name=label, process_set=self.process_set))
        check_agreement(
            gathered.numpy().reshape(self.size, 2),
            ["where the tensors handed to Horovod live (1: host memory, 2: the GPU)",
             "the bytes of a large alltoall's pieces (0: whole)"],
            ["Horovod takes GPU tensors itself only when it was built with GPU operations "
             "(hvd.cuda_built()); hvd_quant stages them through host memory otherwise, and "
             "CPU parameters are in host memory. Build the same Horovod on every host, and "
             "put the model on the same kind of device on every rank, or set "
             "HVD_QUANT_WIRE=staged on every rank (GPU tensors staged through host memory).",
             "A Horovod built by hvd_quant's scripts/build_horovod.sh sends it whole, another "
             "in pieces of HVD_QUANT_PIECE_BYTES: build the same Horovod on every host and "
             "set the same HVD_QUANT_PIECE_BYTES on every rank."])

    def _piece_bytes(self):
        return core_comm.PIECE_BYTES if self.in_pieces else 0

    def subgroups(self, rows):
        """Torus rows and columns (:meth:`ProcessSetTorus.subgroups`); over registered
        process sets they hand Horovod the same kind of tensors as this communicator."""
        cache = self.__dict__.setdefault("_torus", {})
        if rows not in cache:
            cache[rows] = (torus_subgroups(self, rows, lambda ps: type(self)(ps, wire=self.wire))
                           or Communicator.subgroups(self, rows))
        return cache[rows]

    @staticmethod
    def _check_allreduce_dtype(x):
        if x.dtype not in _ALLREDUCE_DTYPES:
            raise TypeError(f"Horovod's torch allreduce cannot reduce {x.dtype}; pack small "
                            "integers into int32 lanes (hvd_quant.core.packing.pack_lanes)")

    def allreduce(self, x, op, name):
        self._check_allreduce_dtype(x)
        self._check_wire(name)
        self._count_allreduce(x.numel() * x.element_size())
        hvd_op = {"sum": hvd.Sum, "max": hvd.Max}[op]
        with WATCHDOG.guard(f"allreduce {name!r}"):
            return wait_for(hvd.allreduce_async(x, name=name, op=hvd_op, process_set=self.process_set))

    def allgather(self, x, name):
        self._check_wire(name)
        self._count_allgather(x.numel() * x.element_size())
        with WATCHDOG.guard(f"allgather {name!r}"):
            return wait_for(hvd.allgather_async(x, name=name, process_set=self.process_set))

    # Asynchronous twins (hvd_quant.core.pipeline.start_allgather / start_alltoall /
    # start_allreduce): the collective is on the wire while the caller computes; wait()
    # returns its result.
    def allgather_async(self, x, name):
        self._check_wire(name)
        self._count_allgather(x.numel() * x.element_size())
        return _AsyncHandle(hvd.allgather_async(x, name=name, process_set=self.process_set),
                            f"allgather {name!r}")

    def alltoall_async(self, x, name):
        self._check_wire(name)
        if self.size == 1:
            from ..core.pipeline import _Done
            return _Done(x.clone())
        self._count_alltoall(x.numel() * x.element_size())
        if not self.in_pieces:
            return self._start_alltoall(x, name)
        return pieces.start_alltoall(x, self.size, name, self._start_alltoall)

    def _start_alltoall(self, x, name):
        # An alltoall's handle gives (output, received splits): keep the output.
        return _AsyncHandle(hvd.alltoall_async(x, name=name, process_set=self.process_set),
                            f"alltoall {name!r}", pick=0)

    def allreduce_async(self, x, op, name):
        self._check_allreduce_dtype(x)
        self._check_wire(name)
        self._count_allreduce(x.numel() * x.element_size())
        hvd_op = {"sum": hvd.Sum, "max": hvd.Max}[op]
        return _AsyncHandle(hvd.allreduce_async(x, name=name, op=hvd_op, process_set=self.process_set),
                            f"allreduce {name!r}")

    def alltoall(self, x, name):
        return self.alltoall_async(x, name).wait()

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        self._check_wire(name)
        if self.size == 1:
            return x.clone()
        self._count_send(x.numel() * x.element_size(), dest)
        # One hop = an alltoall in which this rank's only non-empty split goes to ``dest``.
        splits = torch.zeros(self.size, dtype=torch.int32)
        splits[dest] = x.numel()
        with WATCHDOG.guard(f"ring hop {name!r}"):
            received, _ = wait_for(hvd.alltoall_async(x, splits=splits, name=name,
                                                      process_set=self.process_set))
        return received
