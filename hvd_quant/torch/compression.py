"""``hvd_quant.torch.Compression``: our compressors behind Horovod's compression interface.

Horovod's interface (``horovod/torch/compression.py``) is ``compress(tensor) -> (tensor,
ctx)``, then Horovod allreduces the result, then ``decompress(tensor, ctx)``. Most of our
compressors need more than one allreduce of a cast tensor (a global scale first, an
allgather of bits, a ring). Through Horovod's stock ``DistributedOptimizer`` they therefore
run their whole reduction inside ``compress`` with their own collectives, hand Horovod a
one-element placeholder, and return the result from ``decompress``. Our
:class:`~hvd_quant.torch.DistributedOptimizer` instead fuses every gradient into one buffer
and calls the algorithm directly.

State through the stock optimizer belongs to that optimizer (found in the caller's frame)
and is named by parameter name within it: one compression object may serve several
optimizers, e.g. a GAN's generator and discriminator with identical parameter names.
``Compression.ef_sign.state_dict(optimizer)`` returns one optimizer's state.

Devices: an optimizer's state lives on the device of the first gradient it compresses,
and its gradients are reduced there (on a GPU, only the collectives' packed bytes cross
to the host: :mod:`hvd_quant.torch.staging`). A gradient on another device (a model
split over devices) is copied to that one and its result copied back, once said in a
warning. Each gradient is reduced inside Horovod's hook, on the stream that produced it,
while backward goes on: :class:`~hvd_quant.torch.DistributedOptimizer` overlaps better.
"""

import logging

import sys

import torch

from ..core.handle import CompressionNamespace, CompressorHandle
from .backend import TorchBackend, prepare_kernels

log = logging.getLogger("hvd_quant")

_OPTIMIZER_FRAMES = ("_allreduce_grad_async", "_grouped_allreduce_grad_async")


def _horovod_call_site():
    """(parameter name, op, optimizer) of the gradient Horovod's stock optimizer is
    compressing.

    Horovod passes ``compress`` only the gradient tensor. Its optimizer's frame holds the
    parameter ``p`` and the optimizer (``self``), whose ``_parameter_names`` gives the name
    Horovod itself uses for this allreduce. Verified against Horovod 0.28.1; returns
    ``None`` when called from anywhere else, and ``(None, op, optimizer)`` when the
    parameter is not found.
    """
    frame = sys._getframe(2)
    param = None
    while frame is not None:
        local = frame.f_locals
        if param is None and isinstance(local.get("p"), torch.nn.Parameter):
            param = local["p"]
        if frame.f_code.co_name in _OPTIMIZER_FRAMES and "self" in local:
            opt = local["self"]
            names = getattr(opt, "_parameter_names", {})
            if param is not None and param in names:
                return names[param], getattr(opt, "op", None), opt
            return None, getattr(opt, "op", None), opt
        frame = frame.f_back
    return None


class TorchCompressor(CompressorHandle):
    """A registered compressor, usable as ``compression=`` for Horovod's stock
    ``hvd.DistributedOptimizer`` and for :class:`hvd_quant.torch.DistributedOptimizer`.

    The object is configuration (see :mod:`hvd_quant.core.handle`); calling it returns
    one with updated options: ``Compression.ef_sign()`` or
    ``Compression.global_qsgd(norm="l2")``.
    """

    framework = "torch"

    def __init__(self, name, seed=0, **options):
        super().__init__(name, seed=seed, **options)
        self.prepare()

    def prepare(self):
        """Set-up time: the kernels this compressor runs are loaded now, not in the first
        step, under the thread policy for this host (see :func:`prepare_kernels`)."""
        if self.name not in ("none", "fp16"):  # plain casts around Horovod's allreduce
            prepare_kernels()

    def make_backend(self, device="cpu"):
        return TorchBackend(device)

    def state_dict(self, optimizer=None):
        """This rank's compressor state in Horovod's stock ``optimizer`` (torch tensors,
        keyed ``"param/key"``; ``torch.save`` it per rank). ``optimizer`` may be left out
        while only one optimizer uses this object."""
        return {k: torch.as_tensor(v) for k, v in super().state_dict(optimizer).items()}

    # --- Horovod's compression interface ------------------------------------------------------
    def compress(self, tensor):
        if not tensor.is_floating_point():
            return tensor, None  # like Horovod's fp16 compressor: integers pass through
        import horovod.torch as hvd

        site = _horovod_call_site()
        if self.algorithm.horovod_wire_dtype is not None:
            owned = self.owned(site[2] if site is not None else None)
            wire = tensor.to(getattr(torch, self.algorithm.horovod_wire_dtype))
            self._count_horovod_cast(owned, wire.numel() * wire.element_size(), hvd.size())
            return wire, ("cast", tensor.dtype)
        from .staging import make_comm

        if site is None or site[0] is None:
            raise RuntimeError(
                f"hvd_quant: {self!r} runs its own collectives and must know which parameter "
                "it compresses; it supports Horovod's stock hvd.DistributedOptimizer (0.28.1) "
                "and hvd_quant.torch.DistributedOptimizer. Use "
                "hvd_quant.torch.DistributedOptimizer(optimizer, named_parameters=..., "
                f"compression=hvd_quant.torch.Compression.{self.name}).")
        pname, op, optimizer = site
        if op == hvd.Adasum:
            raise ValueError("hvd_quant compressors do not support op=hvd.Adasum")
        owned = self.owned(optimizer)  # this optimizer's own state, named by parameter
        if owned.comm is None:  # the first gradient's device is the state's (module docstring)
            owned.runner.place(self.make_backend(tensor.device))
            owned.comm = make_comm(None, tensor.device)
        owned.runner.check_once(owned.comm, "stock")
        # fp32 inside the compressor, whatever the parameter's dtype (fp16, bf16), on the
        # state's device: a gradient on another one is copied over and its result back.
        home = owned.runner.backend.device
        if tensor.device != home:
            _note_other_device(owned, tensor.device, home)
        flat = tensor.detach().reshape(-1).to(device=home, dtype=torch.float32)
        mean = owned.runner.reduce(flat, owned.comm, pname, [(pname, flat.numel())])
        if op == hvd.Sum:
            mean = mean * owned.comm.size
        result = mean.reshape(tensor.shape).to(device=tensor.device, dtype=tensor.dtype)
        # Horovod still allreduces what we return: give it one float32 element, not the
        # gradient (Horovod's torch allreduce has no bfloat16), in host memory whatever
        # the gradient's device (decompress returns our result; a GPU placeholder would
        # cost two copies, and ranks on different devices would hand Horovod different
        # kinds of tensors).
        return torch.zeros(1), ("result", result)

    def host_bytes(self, optimizer=None):
        """Bytes copied between the GPU and host memory for this handle's collectives in
        Horovod's stock ``optimizer`` (:class:`~hvd_quant.torch.staging.HostMeter`; 0 when
        nothing was staged). ``optimizer`` may be left out while only one uses it."""
        from .staging import host_bytes

        return host_bytes(self._find(optimizer).comm)

    def decompress(self, tensor, ctx):
        if ctx is None:
            return tensor
        kind, value = ctx
        return tensor.to(value) if kind == "cast" else value


Compression = CompressionNamespace(TorchCompressor)


def _note_other_device(owned, device, home):
    if getattr(owned, "noted_devices", False):
        return
    owned.noted_devices = True
    log.warning("hvd_quant: a gradient on %s is compressed with state on %s (the device of the "
                "optimizer's first gradient): it is copied there and its result back (8 bytes "
                "per element); keep the model on one device to avoid the copies.", device, home)
