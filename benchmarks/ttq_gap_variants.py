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
* ``ef_sign_precond<K>`` (2026-12-06, ``benchmarks/reference/ttq-gap-precond-2026-12-06/``):
  every ``K``-th step an exact fp32 allreduce, whose running mean of squares gives every
  element an RMS ``sigma`` that all ranks hold; between them ``ef_sign`` of ``g / sigma``,
  its mean multiplied back by ``sigma`` (:class:`_Preconditioned`). Suffixes: ``_noef``
  (no error feedback), ``f3``/``f10``/``f01`` (``sigma`` floored at 0.3, 1 or 0.01 of its
  tensor's RMS instead of 0.1). ``ef_sign_exact<K>`` and ``ef_sign_exact10_noef`` are the
  controls: the exact steps alone, plain scaled signs between them.
* ``qsgd_block512`` (2026-12-06): ``qsgd`` with one l2 norm per block of 512 elements instead
  of one per fused buffer (:class:`_QSGDBlocked`); ``global_qsgd_block512``: ``global_qsgd``
  with one shared scale per block of 512 elements (:class:`_GlobalQSGDBlocked`).
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


# --- error feedback in a preconditioned space (2026-12-06) ----------------------------------------
class _Preconditioned(EFSignCompressor):
    """``ef_sign`` on ``g / sigma`` instead of ``g``, its mean multiplied back by ``sigma``.

    ``sigma`` is a per-element RMS of the exact mean gradient, the same on every rank: every
    ``every``-th step of a buffer is an exact fp32 allreduce (its mean is returned as it is),
    and ``sigma2`` is a bias-corrected running mean of its squares, with Adam's beta2 per
    step (``0.999 ** every`` per sample). Between those steps the scaled signs carry
    ``g / sigma``, whose elements have comparable magnitudes, so the mean that reaches Adam
    has ``sigma``'s per-element magnitudes and Adam's second moment is no longer flat over a
    tensor (the diagnosis of ``benchmarks/reference/ttq-gap-2026-12-01/``). ``sigma`` is
    floored at ``floor`` times its tensor's RMS, so that an element whose exact samples
    were all zero (an embedding row not seen) does not dominate its tensor's scale.

    A diagnostic variant: its step counter lives on the object, keyed by buffer name, and
    is not checkpointed."""

    state_slots = ("residual", "sigma2")
    every = 10
    floor = 0.1
    beta2 = 0.999

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._steps = {}

    def reduce(self, x, ctx):
        step = self._steps.get(ctx.name, 0)
        self._steps[ctx.name] = step + 1
        sigma2 = ctx.state.get("sigma2")
        if step % self.every == 0:
            exact = ctx.comm.allreduce(x, "sum", ctx.collective_name("exact")) / ctx.comm.size
            weight = max(1.0 / (step // self.every + 1), 1.0 - self.beta2 ** self.every)
            ctx.state.set("sigma2", sigma2 * (1.0 - weight) + exact * exact * weight)
            return exact
        sigma = self._sigma(sigma2, [c for _, c in ctx.segments])
        out, ctx.out = ctx.out, None
        try:
            return super().reduce(x / sigma, ctx) * sigma
        finally:
            ctx.out = out

    def _sigma(self, sigma2, counts):
        parts = []
        for s2 in torch.split(sigma2, counts):
            rms = s2.mean().sqrt()
            parts.append(torch.clamp(s2.sqrt(), min=float(self.floor * rms) + 1e-30))
        return torch.cat(parts)


class _PreconditionedNoFeedback(_Preconditioned):
    """The preconditioned variant with its residual zeroed before every compressed step."""

    def reduce(self, x, ctx):
        ctx.state.set("residual", ctx.state.get("residual") * 0)
        return super().reduce(x, ctx)


class _ExactEvery(_Preconditioned):
    """The control: the exact steps of the preconditioned variant, plain ``ef_sign`` between
    them (``sigma`` = 1), to separate what the exact steps give from what ``sigma`` gives."""

    def _sigma(self, sigma2, counts):
        return torch.ones_like(sigma2)


class _ExactEveryNoFeedback(_PreconditionedNoFeedback):
    """The control without error feedback: exact steps, plain scaled signs between them."""

    def _sigma(self, sigma2, counts):
        return torch.ones_like(sigma2)


# ef_sign_precond<K>[f01|f3|f10][_noef], ef_sign_exact<K>[_noef]: K steps between exact rounds,
# sigma's floor (0.1 of its tensor's RMS without a tag), error feedback or not.
for _every in (5, 10, 25, 50):
    for _floor, _tag in ((0.1, ""), (0.01, "f01"), (0.3, "f3"), (1.0, "f10")):
        for _base, _suffix in ((_Preconditioned, ""), (_PreconditionedNoFeedback, "_noef")):
            _name = f"ef_sign_precond{_every}{_tag}{_suffix}"
            register(type(_name, (_base,), {"name": _name, "every": _every, "floor": _floor}))
    for _base, _suffix in ((_ExactEvery, ""), (_ExactEveryNoFeedback, "_noef")):
        _name = f"ef_sign_exact{_every}{_suffix}"
        register(type(_name, (_base,), {"name": _name, "every": _every}))


# --- QSGD with the paper's buckets (2026-12-06) ---------------------------------------------------
from hvd_quant.compressors.qsgd import QSGDCompressor  # noqa: E402


class _QSGDBlocked(QSGDCompressor):
    """``qsgd`` with one l2 norm per block of ``block`` consecutive elements of the buffer
    instead of one per buffer, as the experiments of Alistarh et al. (NeurIPS 2017) cut the
    gradient into buckets of about 512 elements, each with its own norm (the docstring of
    :mod:`hvd_quant.compressors.qsgd`). With ``d`` elements under one norm, QSGD's variance
    bound is ``min(d / s**2, sqrt(d) / s)`` times ``||x||**2``; at ``s = 127`` a fused
    buffer of 6.5M elements gives about 20, a block of 512 about 0.03. 4 more bytes per
    block on the wire (0.8% at 8 bits and 512 elements).

    A diagnostic, torch only and written plainly: two allgathers (levels, norms), draws
    from a generator seeded by rank, buffer and step, norms from float64 sums, no handling
    of non-finite input or of norms near the float32 maximum."""

    block = 512

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._steps = {}

    def reduce(self, x, ctx):
        comm, n, s = ctx.comm, ctx.comm.size, self.s
        step = self._steps.get(ctx.name, 0)
        self._steps[ctx.name] = step + 1
        d, block = x.numel(), self.block
        rows = -(-d // block)
        xb = torch.nn.functional.pad(x, (0, rows * block - d)).view(rows, block)
        norms = (xb.double().pow(2).sum(dim=1).sqrt() * (1 + 2 ** -8)).float()
        v = s * xb / norms.clamp_min(1e-30)[:, None]
        seed = (comm.rank * 1_000_003 + step * 7919 + sum(map(ord, ctx.name))) % (2 ** 62)
        u = torch.rand(v.shape, generator=torch.Generator().manual_seed(seed))
        low = torch.floor(v)
        q = (low + (u < v - low).float()).to(torch.int8).view(-1)
        all_q = comm.allgather(q, ctx.collective_name("levels")).view(n, rows, block)
        all_norms = comm.allgather(norms, ctx.collective_name("norms")).view(n, rows)
        total = None
        for r in range(n):  # rank order, the same floats on every rank
            part = all_q[r].float() * (all_norms[r] / (s * n))[:, None]
            total = part if total is None else total + part
        return total.reshape(-1)[:d].contiguous()

    def wire_bytes(self, numel, world_size, segments=1, int_dtypes=None):
        return float((world_size - 1) * (numel * self.width // 8 + 4 * -(-int(numel) // self.block)))


for _b in (512,):
    register(type(f"QSGDBlock{_b}", (_QSGDBlocked,), {"name": f"qsgd_block{_b}", "block": _b}))


# --- Global-QSGD with a shared scale per block (2026-12-06) ---------------------------------------
from hvd_quant.compressors.global_qsgd import GlobalQSGDCompressor  # noqa: E402


class _GlobalQSGDBlocked(GlobalQSGDCompressor):
    """``global_qsgd`` (max norm) with one shared scale per block of ``block`` elements:
    an allreduce-max of every block's ``max|x|`` (4 bytes per block), the same levels as
    ``global_qsgd`` at this world size, stochastic rounding onto each block's grid and one
    sum-allreduce of the integers, so it stays allreduce-compatible.

    A diagnostic for losses only, torch only: the integers travel as int32 (4 bytes each,
    so its bytes on the meter are 4x what an 8-bit wire would send), draws from a generator
    seeded by rank, buffer and step, no handling of non-finite input."""

    block = 512

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._steps = {}

    def reduce(self, x, ctx):
        comm, n = ctx.comm, ctx.comm.size
        _, levels = self.resolve(n)
        step = self._steps.get(ctx.name, 0)
        self._steps[ctx.name] = step + 1
        d, block = x.numel(), self.block
        rows = -(-d // block)
        xb = torch.nn.functional.pad(x, (0, rows * block - d)).view(rows, block)
        scales = comm.allreduce(xb.abs().amax(dim=1).contiguous(), "max", ctx.collective_name("scales"))
        v = levels * torch.clamp(xb / scales.clamp_min(1e-30)[:, None], -1.0, 1.0)
        seed = (comm.rank * 1_000_003 + step * 7919 + sum(map(ord, ctx.name))) % (2 ** 62)
        u = torch.rand(v.shape, generator=torch.Generator().manual_seed(seed))
        low = torch.floor(v)
        q = (low + (u < v - low).float()).to(torch.int32).view(-1)
        total = comm.allreduce(q, "sum", ctx.collective_name("levels")).view(rows, block)
        return (total.float() * (scales / (levels * n))[:, None]).reshape(-1)[:d].contiguous()


register(type("GlobalQSGDBlock512", (_GlobalQSGDBlocked,), {"name": "global_qsgd_block512", "block": 512}))
