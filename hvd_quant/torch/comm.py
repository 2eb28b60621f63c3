"""Horovod (torch) implementation of :class:`hvd_quant.core.comm.Communicator`.

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

import os
import time

import torch
import horovod.torch as hvd

from ..core.comm import Communicator
from ..core.watchdog import WATCHDOG
from ..process_sets import ProcessSetTorus

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


class HorovodTorchComm(ProcessSetTorus, Communicator):
    """Collectives over a Horovod process set (the global one by default). Every call
    runs under the collective deadline of :mod:`hvd_quant.core.watchdog` (for the
    ``*_async`` ones: the handle's ``wait()``)."""

    _horovod = hvd  # ProcessSetTorus reads the global process set and the layout from it

    @staticmethod
    def _check_allreduce_dtype(x):
        if x.dtype not in _ALLREDUCE_DTYPES:
            raise TypeError(f"Horovod's torch allreduce cannot reduce {x.dtype}; pack small "
                            "integers into int32 lanes (hvd_quant.core.packing.pack_lanes)")

    def allreduce(self, x, op, name):
        self._check_allreduce_dtype(x)
        self._count_allreduce(x.numel() * x.element_size())
        hvd_op = {"sum": hvd.Sum, "max": hvd.Max}[op]
        with WATCHDOG.guard(f"allreduce {name!r}"):
            return wait_for(hvd.allreduce_async(x, name=name, op=hvd_op, process_set=self.process_set))

    def allgather(self, x, name):
        self._count_allgather(x.numel() * x.element_size())
        with WATCHDOG.guard(f"allgather {name!r}"):
            return wait_for(hvd.allgather_async(x, name=name, process_set=self.process_set))

    # Asynchronous twins (hvd_quant.core.pipeline.start_allgather / start_alltoall /
    # start_allreduce): the collective is on the wire while the caller computes; wait()
    # returns its result.
    def allgather_async(self, x, name):
        self._count_allgather(x.numel() * x.element_size())
        return _AsyncHandle(hvd.allgather_async(x, name=name, process_set=self.process_set),
                            f"allgather {name!r}")

    def alltoall_async(self, x, name):
        if self.size == 1:
            from ..core.pipeline import _Done
            return _Done(x.clone())
        self._count_alltoall(x.numel() * x.element_size())
        # An alltoall's handle gives (output, received splits): keep the output.
        return _AsyncHandle(hvd.alltoall_async(x, name=name, process_set=self.process_set),
                            f"alltoall {name!r}", pick=0)

    def allreduce_async(self, x, op, name):
        self._check_allreduce_dtype(x)
        self._count_allreduce(x.numel() * x.element_size())
        hvd_op = {"sum": hvd.Sum, "max": hvd.Max}[op]
        return _AsyncHandle(hvd.allreduce_async(x, name=name, op=hvd_op, process_set=self.process_set),
                            f"allreduce {name!r}")

    def alltoall(self, x, name):
        if self.size == 1:
            return x.clone()
        self._count_alltoall(x.numel() * x.element_size())
        with WATCHDOG.guard(f"alltoall {name!r}"):
            return wait_for(hvd.alltoall_async(x, name=name, process_set=self.process_set))[0]

    def sendrecv(self, x, dest, source, name, recv_numel=None):
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
