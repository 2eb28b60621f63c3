"""GPU tensors through a Horovod built without GPU operations: staged through host buffers.

pip's Horovod, and the one ``scripts/build_horovod.sh`` builds, have CPU operations only
(Gloo). Such a Horovod accepts a CUDA tensor, but copies it to the host itself without
waiting for the stream that produces it (``DoAllreduceCudaOnCPU`` and its siblings in
``horovod/torch/mpi_ops_v2.cc`` record their ready event only in a GPU build), and the
optimizers used to copy every gradient to the host in full. Here only what a collective
carries crosses: the compressors' packed bytes and scales, a few per cent of the gradient.

:class:`StagingComm` wraps a communicator. For each collective whose tensor is on a GPU:

1. the tensor is copied into a page-locked host buffer (kept, one per size, reused from
   step to step: :class:`PinnedPool`) with a non-blocking copy on the current stream, and
   the host waits on an event recorded after it (one host synchronisation per
   collective: Horovod reads the buffer from its own thread);
2. the wrapped communicator runs the collective on the host buffer (Horovod's CPU path);
3. the result is copied into a page-locked buffer and from there to the device with a
   non-blocking copy on the current stream; an event recorded after it keeps the buffer
   from being reused before the copy is done. The caller gets a new device tensor, and
   its next kernels on that stream are ordered after the copy: the host does not wait.

:class:`HostMeter` counts the bytes that cross each way (``to_host``, ``to_device``), the
bytes of the collectives' own tensors in and out (``payload``: what must cross when the
decode runs on the device), and the host's waits for the device. The optimizers expose
its total as ``host_bytes``.

Which wire a device gets (:func:`make_comm`), chosen when an optimizer or the stock path
makes its communicator and logged once per process:

* CPU tensors: Horovod's communicator as it is (nothing to stage);
* GPU tensors and a Horovod built with GPU operations (``hvd.cuda_built()``: NCCL, or
  Horovod's own staging with ready events): handed to Horovod directly;
* GPU tensors and a Horovod without them: :class:`StagingComm`.

``HVD_QUANT_WIRE=staged`` stages every collective's tensors through host buffers, GPU and
CPU tensors alike (a CPU tensor is copied into a separate host buffer and its result
copied out again): what runs in CI without a GPU (``tests/test_staging.py``), and a way
to run staged beside a GPU build. Every rank must hand Horovod the same kind of tensors;
:class:`~hvd_quant.torch.comm.HorovodTorchComm` checks that before its first collective.
"""

import logging
import os
import threading

import torch

from ..core.comm import Communicator, RoutedGroup, WrappingComm
from ..core.pipeline import start_allgather, start_allreduce, start_alltoall

log = logging.getLogger("hvd_quant")

#: ``HVD_QUANT_WIRE``: ``auto`` (default, see the module docstring) or ``staged``.
WIRE_ENV = "HVD_QUANT_WIRE"
_noted = set()  # (device type, wire) already logged in this process


class HostMeter:
    """What crossed between the device and the host for one owner's collectives.

    Attributes
    ----------
    to_host, to_device : int
        Bytes copied from the device into host buffers, and back.
    payload : int
        Bytes of the tensors handed to the collectives and received from them, staged or
        not (the compressed payload: what a decode on the device needs back).
    staged : int
        Collectives whose tensors were staged.
    waits : int
        Times the host waited for the device: one per staged GPU collective (its input
        must be in host memory before Horovod reads it), and a buffer reused before its
        last copy to the device was done.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.to_host = self.to_device = self.payload = self.staged = self.waits = 0

    @property
    def bytes(self):
        """Bytes that crossed, both ways."""
        return self.to_host + self.to_device

    def snapshot(self):
        return {"to_host": self.to_host, "to_device": self.to_device, "payload": self.payload,
                "staged": self.staged, "waits": self.waits}


class PinnedPool:
    """Host buffers kept per ``(dtype, numel)`` and reused: page-locked when ``pinned``.

    A buffer is taken for one collective and given back with the event that ends its use
    (the copy out of it to the device), or none; it is handed out again only once that
    event is done. A step's sizes repeat from step to step, so after the first step
    nothing is allocated (cudaHostAlloc is slow, and a fresh page-locked buffer per call
    would cost more than the copy). At most ``max_free`` idle buffers are kept."""

    def __init__(self, pinned, meter, max_free=256):
        self.pinned = bool(pinned)
        self._meter = meter
        self._free = {}
        self._count = 0
        self._max_free = max_free
        self._lock = threading.Lock()

    def take(self, numel, dtype):
        key = (dtype, int(numel))
        with self._lock:
            entries = self._free.get(key)
            entry = entries.pop() if entries else None
            if entry is not None:
                self._count -= 1
        if entry is None:
            return torch.empty(int(numel), dtype=dtype, pin_memory=self.pinned)
        buf, event = entry
        if event is not None and not event.query():
            self._meter.waits += 1
            event.synchronize()
        return buf

    def give(self, buf, event=None):
        with self._lock:
            if self._count >= self._max_free:  # sizes that changed (an elastic resize)
                self._free.clear()
                self._count = 0
            self._free.setdefault((buf.dtype, buf.numel()), []).append((buf, event))
            self._count += 1


class StagingComm(WrappingComm):
    """A communicator whose collectives take and return tensors on ``device`` while the
    wrapped one (``inner``) sees host memory only (module docstring).

    Parameters
    ----------
    inner : Communicator
        Runs the collectives on host tensors (Horovod's, or a test's).
    device : torch.device or str
        Where the callers' tensors live (a CUDA device; ``"cpu"`` with ``force``).
    force : bool
        Stage CPU tensors as well, through separate host buffers (tests without a GPU).
    """

    def __init__(self, inner, device, force=False, host_meter=None, pool=None):
        super().__init__(inner)  # rank, size, the wire meter, process_set and the like: inner's
        self.device = torch.device(device)
        self.force = bool(force)
        self.host_meter = host_meter if host_meter is not None else HostMeter()
        self._pool = pool if pool is not None else PinnedPool(self.device.type == "cuda", self.host_meter)
        self.wire = "host"


    def refresh(self):
        self.inner.refresh()
        self.__dict__.pop("_staged_subgroups", None)

    def ranks_per_node(self):
        return self.inner.ranks_per_node()

    # --- staging -------------------------------------------------------------------------
    def _stage(self, x):
        """``(host tensor for the collective, device to return the result to or None)``."""
        nbytes = x.numel() * x.element_size()
        self.host_meter.payload += nbytes
        if x.device.type == "cpu" and not self.force:
            return x, None
        self.host_meter.staged += 1
        host = self._pool.take(x.numel(), x.dtype)
        if x.device.type == "cuda":
            host.copy_(x.reshape(-1), non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(x.device))
            self.host_meter.waits += 1
            ready.synchronize()  # Horovod's thread reads the buffer: the copy must be done
        else:
            host.copy_(x.reshape(-1))
        self.host_meter.to_host += nbytes
        return host, x.device

    def _unstage(self, out, device, host):
        """The collective's result ``out`` (host memory) on ``device``; ``host``, the
        input's buffer, goes back to the pool (the collective is done with it)."""
        self.host_meter.payload += out.numel() * out.element_size()
        if device is None:
            return out
        self._pool.give(host)
        out = out.reshape(-1)
        staged = self._pool.take(out.numel(), out.dtype)
        staged.copy_(out)  # Horovod's result is ordinary memory: into a page-locked buffer
        result = torch.empty(out.numel(), dtype=out.dtype, device=device)
        if device.type == "cuda":
            result.copy_(staged, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            self._pool.give(staged, done)
        else:
            result.copy_(staged)
            self._pool.give(staged)
        self.host_meter.to_device += out.numel() * out.element_size()
        return result

    # --- collectives ---------------------------------------------------------------------
    def allreduce(self, x, op, name):
        host, device = self._stage(x)
        return self._unstage(self.inner.allreduce(host, op, name), device, host)

    def allgather(self, x, name):
        host, device = self._stage(x)
        return self._unstage(self.inner.allgather(host, name), device, host)

    def alltoall(self, x, name):
        host, device = self._stage(x)
        return self._unstage(self.inner.alltoall(host, name), device, host)

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        host, device = self._stage(x)
        return self._unstage(self.inner.sendrecv(host, dest, source, name, recv_numel), device, host)

    def allgather_async(self, x, name):
        host, device = self._stage(x)
        return _StagedHandle(self, start_allgather(self.inner, host, name), device, host)

    def alltoall_async(self, x, name):
        host, device = self._stage(x)
        return _StagedHandle(self, start_alltoall(self.inner, host, name), device, host)

    def allreduce_async(self, x, op, name):
        host, device = self._stage(x)
        return _StagedHandle(self, start_allreduce(self.inner, host, op, name), device, host)

    def on_host(self, fn, x):
        """``fn(backend, comm, x)`` on a host copy of ``x``, with a CPU backend and the
        wrapped communicator, its result returned on ``x``'s device: one copy over and one
        back (one wait) for a round of many hops over full-size data, the 1-bit optimizers'
        fp32 rounds (:func:`hvd_quant.optimizers.base.full_precision_mean`), where staging
        each hop would copy the data ``2 (n - 1) / n`` times each way."""
        from .backend import TorchBackend

        host, device = self._stage(x)
        return self._unstage(fn(TorchBackend("cpu"), self.inner, host), device, host)

    def subgroups(self, rows):
        """The wrapped communicator's torus rows and columns, staged the same way. Where
        those route their hops through the wrapped communicator itself, the hops are
        routed through this one instead (so that they are staged)."""
        cache = self.__dict__.setdefault("_staged_subgroups", {})
        if rows not in cache:
            pair = self.inner.subgroups(rows)
            if any(isinstance(c, RoutedGroup) and c.parent is self.inner for c in pair):
                cache[rows] = Communicator.subgroups(self, rows)
            else:
                cache[rows] = tuple(StagingComm(c, self.device, self.force, self.host_meter, self._pool)
                                    for c in pair)
        return cache[rows]


class _StagedHandle:
    """An asynchronous collective on host buffers; ``wait()`` gives the result on the
    device."""

    def __init__(self, comm, handle, device, host):
        self._comm, self._handle, self._device, self._host = comm, handle, device, host

    def wait(self):
        return self._comm._unstage(self._handle.wait(), self._device, self._host)


# --- the choice ----------------------------------------------------------------------------
def wire_setting():
    value = os.environ.get(WIRE_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "staged"):
        raise ValueError(f"{WIRE_ENV} must be 'auto' or 'staged', got {value!r}")
    return value


def horovod_takes_gpu_tensors(hvd):
    """Whether this Horovod handles CUDA tensors itself, with the ready events that order
    its reads after the stream's work: built with CUDA (or ROCm), with NCCL or its own
    copies through the host."""
    return bool(hvd.cuda_built() or hvd.rocm_built())


def wire_for(device, hvd):
    """``"host"``, ``"staged"`` or ``"device"``: how ``device``'s tensors reach Horovod."""
    device = torch.device(device)
    if wire_setting() == "staged":
        return "staged"
    if device.type == "cpu":
        return "host"
    return "device" if horovod_takes_gpu_tensors(hvd) else "staged"


def make_comm(process_set, device):
    """The communicator for tensors on ``device`` over ``process_set`` (module docstring);
    the choice is logged once per process and kind of device."""
    import horovod.torch as hvd

    from .comm import HorovodTorchComm

    device = torch.device(device)
    wire = wire_for(device, hvd)
    _note(device, wire, hvd)
    if wire == "staged":
        return StagingComm(HorovodTorchComm(process_set), device, force=device.type == "cpu")
    return HorovodTorchComm(process_set, wire="device" if wire == "device" else "host")


def _note(device, wire, hvd):
    key = (device.type, wire)
    if key in _noted or (device.type == "cpu" and wire == "host"):
        return
    _noted.add(key)
    if wire == "device":
        how = (f"handed to Horovod directly (Horovod built with GPU operations; NCCL "
               f"{hvd.nccl_built() or 'not built'})")
    elif device.type == "cpu":
        how = f"staged through separate host buffers ({WIRE_ENV}=staged)"
    else:
        why = (f"{WIRE_ENV}=staged" if wire_setting() == "staged"
               else "this Horovod has no GPU operations")
        how = f"staged through page-locked host buffers ({why}): only the packed bytes cross"
    log.info("hvd_quant: the collectives' %s tensors are %s", device.type, how)


def host_meter_of(comm):
    """The :class:`HostMeter` of ``comm`` (None when nothing is staged)."""
    return getattr(comm, "host_meter", None) if isinstance(comm, StagingComm) else None


def host_bytes(comm):
    """Bytes copied between the GPU and host memory for ``comm``'s collectives, both ways,
    since it was made (:class:`HostMeter`; 0 when nothing is staged: CPU tensors, or a
    Horovod that takes GPU tensors itself). The optimizers' ``host_bytes``."""
    meter = host_meter_of(comm)
    return meter.bytes if meter is not None else 0
