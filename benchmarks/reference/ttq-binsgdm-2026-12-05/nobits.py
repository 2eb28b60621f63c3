"""BinSGDM's update without its bits: a diagnosis, not a method (issue 51).

BinSGDM (hvd_quant/optimizers/binsgdm.py) keeps on each rank ``m`` (momentum) and ``b``
(the average of ``|g|``, the same beta), sends one random bit per element whose mean is
``z = m / b``, and steps by ``lr`` times the mean of those +-1 over the ranks. This
optimizer takes the same step from the exact mean gradient and without the random bit::

    m = beta m + (1 - beta) g,   b = beta b + (1 - beta) |g|,   x = x - lr * m / b   (0/0 = 0)

Run as the base optimizer of the Horovod fp32 row (``--base-optimizer
nobits:normalised_momentum``, this folder on PYTHONPATH), it gets the fp32 mean gradient.
Against BinSGDM it removes two things at once: the binary randomisation (each element
moves by the whole ``lr`` with a random sign, mean ``z``) and the per-rank moments.

``normalised_momentum_long_b`` keeps ``b`` over a longer memory than ``m`` (``beta_b``
0.999, Adam's beta2; ``m/b`` may then leave [-1, 1], which the bits could not carry): the
one change that gives the denominator Adam's lag behind shrinking gradients. Both moments
are bias-corrected as Adam's are (with one beta the corrections cancel: BinSGDM's ``m / b``).
"""

import torch

BETA = 0.9  # hq.BinSGDM's default betas=(0.9,)


class NormalisedMomentum(torch.optim.Optimizer):
    def __init__(self, params, lr=5e-4, beta=BETA, beta_b=None):  # defaults: Horovod re-makes the class
        super().__init__(params, dict(lr=lr, beta=beta, beta_b=beta if beta_b is None else beta_b))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta, beta_b = group["beta"], group["beta_b"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                    state["b"] = torch.zeros_like(p)
                    state["t"] = 0
                m, b = state["m"], state["b"]
                state["t"] += 1
                m.mul_(beta).add_(p.grad, alpha=1.0 - beta)
                b.mul_(beta_b).add_(p.grad.abs(), alpha=1.0 - beta_b)
                # Bias corrections as Adam's: with one beta they cancel (BinSGDM's m / b).
                correction = (1.0 - beta_b ** state["t"]) / (1.0 - beta ** state["t"])
                z = torch.where(b > 0, m / torch.where(b > 0, b, torch.ones_like(b)), torch.zeros_like(b)) * correction
                p.add_(z, alpha=-group["lr"])


def normalised_momentum(params, lr):
    return NormalisedMomentum(params, lr)


def normalised_momentum_long_b(params, lr):
    return NormalisedMomentum(params, lr, beta_b=0.999)
