"""``hvd_quant.torch.Compression``: our compressors behind Horovod's compression interface.

Horovod's interface (``horovod/torch/compression.py``) is ``compress(tensor) -> (tensor,
ctx)``, then Horovod allreduces the result, then ``decompress(tensor, ctx)``. Most of our
compressors need more than one allreduce of a cast tensor (a global scale first, an
allgather of bits, a ring). Through Horovod's stock ``DistributedOptimizer`` they therefore
run their whole reduction inside ``compress`` with their own collectives, hand Horovod a
one-element placeholder, and return the result from ``decompress``. Our
:class:`~hvd_quant.torch.DistributedOptimizer` instead fuses every gradient into one buffer
and calls the algorithm directly.
"""

import sys

import torch

from ..core.handle import CompressionNamespace, CompressorHandle
from .backend import TorchBackend

_OPTIMIZER_FRAMES = ("_allreduce_grad_async", "_grouped_allreduce_grad_async")


def _horovod_call_site():
    """(parameter name, op, size) of the gradient Horovod's stock optimizer is compressing.

    Horovod passes ``compress`` only the gradient tensor. Its optimizer's frame holds the
    parameter ``p`` and the optimizer (``self``), whose ``_parameter_names`` gives the name
    Horovod itself uses for this allreduce. Verified against Horovod 0.28.1; returns
    ``None`` when called from anywhere else.
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
                return names[param], getattr(opt, "op", None)
            return None
        frame = frame.f_back
    return None


class TorchCompressor(CompressorHandle):
    """A registered compressor, usable as ``compression=`` for Horovod's stock
    ``hvd.DistributedOptimizer`` and for :class:`hvd_quant.torch.DistributedOptimizer`.

    Calling the object returns a new, independently-stateful instance with updated
    options: ``Compression.ef_sign()`` or ``Compression.global_qsgd(norm="l2")``.
    """

    framework = "torch"

    def make_backend(self):
        return TorchBackend()

    def state_dict(self):
        """Per-rank compressor state (stock-Horovod path), keyed ``"param/key"``."""
        return {k: torch.from_numpy(v) for k, v in self.runner().state_dict().items()}

    # --- Horovod's compression interface ------------------------------------------------------
    def compress(self, tensor):
        if not tensor.is_floating_point():
            return tensor, None  # like Horovod's fp16 compressor: integers pass through
        if self.core.horovod_wire_dtype is not None:
            import horovod.torch as hvd

            wire = tensor.to(getattr(torch, self.core.horovod_wire_dtype))
            self._count_horovod_cast(wire.numel() * wire.element_size(), hvd.size())
            return wire, ("cast", tensor.dtype)
        import horovod.torch as hvd
        from .comm import HorovodTorchComm

        site = _horovod_call_site()
        if site is None:
            raise RuntimeError(
                f"hvd_quant: {self!r} runs its own collectives and must know which parameter "
                "it compresses; it supports Horovod's stock hvd.DistributedOptimizer (0.28.1) "
                "and hvd_quant.torch.DistributedOptimizer. Use "
                "hvd_quant.torch.DistributedOptimizer(optimizer, named_parameters=..., "
                f"compression=hvd_quant.torch.Compression.{self.name}).")
        pname, op = site
        if op == hvd.Adasum:
            raise ValueError("hvd_quant compressors do not support op=hvd.Adasum")
        if self._comm is None:
            self._comm = HorovodTorchComm()
        runner = self.runner()
        runner.check_once(self._comm, "stock")
        flat = tensor.detach().reshape(-1).to(torch.float32)
        mean = runner.reduce(flat, self._comm, pname, [(pname, flat.numel())])
        if op == hvd.Sum:
            mean = mean * self._comm.size
        result = mean.reshape(tensor.shape).to(tensor.dtype)
        # Horovod still allreduces what we return: give it one element, not the gradient.
        return tensor.new_zeros(1), ("result", result)

    def decompress(self, tensor, ctx):
        if ctx is None:
            return tensor
        kind, value = ctx
        return tensor.to(value) if kind == "cast" else value


Compression = CompressionNamespace(TorchCompressor)
