"""Diagnostic variants of ``ef_sign`` for the quality-gap measurement of issue 51
(``benchmarks/reference/ttq-gap-2026-12-01/``). Not methods: each changes one thing of
:class:`~hvd_quant.compressors.ef_sign.EFSignCompressor`, so that a loss difference at equal
steps can be put down to that one thing.

    horovodrun ... benchmarks/ttq_worker.py --method ef_sign --import ttq_gap_variants \\
        --compressor ef_sign_block256 ...

* ``ef_sign_block<K>`` (K in :data:`BLOCKS`): one scale per block of ``K`` consecutive
  elements of each tensor instead of one per tensor (a tensor's last block may be
  shorter). ``K = 256`` is one scale per row of this benchmark's embedding and of its
  ``d_model``-input matrices. The sign bits, the residual and its state are the same as
  ``ef_sign``'s: only the segments its scales are taken over change (4 more bytes on the
  wire per block).
* ``ef_sign_noef``: the scaled sign of ``g`` alone, the residual dropped every step (what
  error feedback's delay costs or buys); ``ef_sign_noef_block256``: both changes.
"""

from hvd_quant.compressors.ef_sign import EFSignCompressor
from hvd_quant.core.compressor import register

BLOCKS = (16, 64, 128, 256, 4096)


def blocked(segments, block):
    """``segments`` (``[(name, count)]``) cut into blocks of at most ``block`` elements."""
    out = []
    for name, count in segments:
        count = int(count)
        for start in range(0, count, block):
            out.append((f"{name}#{start // block}", min(block, count - start)))
    return out


class _Blocked(EFSignCompressor):
    block = None

    def reduce(self, x, ctx):
        original = ctx.segments
        ctx.segments = blocked(original, self.block)  # only the scales read these
        try:
            return super().reduce(x, ctx)
        finally:
            ctx.segments = original

    def wire_bytes(self, numel, world_size, segments=1):
        return super().wire_bytes(numel, world_size, max(segments, -(-int(numel) // self.block)))


for _k in BLOCKS:
    register(type(f"EFSignBlock{_k}", (_Blocked,), {"name": f"ef_sign_block{_k}", "block": _k}))


class EFSignNoFeedback(EFSignCompressor):
    """Scaled sign without error feedback: the residual is zeroed before every step."""

    name = "ef_sign_noef"

    def reduce(self, x, ctx):
        residual = ctx.state.get("residual")
        ctx.state.set("residual", residual * 0)
        return super().reduce(x, ctx)


register(EFSignNoFeedback)


class EFSignNoFeedbackBlock256(_Blocked):
    """Both: no error feedback and one scale per 256 elements."""

    name = "ef_sign_noef_block256"
    block = 256

    def reduce(self, x, ctx):
        ctx.state.set("residual", ctx.state.get("residual") * 0)
        return super().reduce(x, ctx)


register(EFSignNoFeedbackBlock256)


# --- a diagnostic base optimizer -----------------------------------------------------------------
import torch  # noqa: E402


class TensorVAdam(torch.optim.Optimizer):
    """Adam (Kingma & Ba, 2015) whose second moment is shared by a whole tensor: the
    update is ``m_hat / (sqrt(mean(v_hat)) + eps)``, ``mean`` over the tensor's elements.

    Not a method. Fed fp32 gradients, it isolates one effect of feeding Adam scaled signs:
    every element of a tensor then arrives with the same magnitude (the tensor's scale), so
    Adam's per-element ``v`` is flat over the tensor and its per-element normalisation is
    lost; what is left is momentum SGD normalised per tensor. If this optimizer on fp32
    gradients loses what ``ef_sign`` loses, that loss is the cause."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["t"], st["m"], st["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["t"] += 1
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = st["m"] / (1 - b1 ** st["t"])
                v_hat = st["v"].mean() / (1 - b2 ** st["t"])
                p.add_(m_hat / (v_hat.sqrt() + group["eps"]), alpha=-group["lr"])


def tensor_v_adam(params, lr):
    return TensorVAdam(params, lr=lr)
