"""Plain numpy transcriptions of DeepSpeed's 1-bit Adam, 0/1 Adam and compressed allreduce.

Written step by step from ``deepspeed/runtime/fp16/onebit/adam.py`` (``OnebitAdam.step``),
``onebit/zoadam.py`` (``ZeroOneAdam.step``) and ``runtime/comm/nccl.py``
(``NcclBackend.compressed_allreduce``), keeping their control flow and flags
(``initialize``, ``adam_freeze_key`` / ``freeze_key``, ``reinitial_error_buffer``, the
engine's ``enable_backward_allreduce``) and simulating all ``n`` ranks in one process:
nothing here uses hvd_quant. The tests compare hvd_quant's rules with these.

Where the DeepSpeed code calls into torch, the float arithmetic is spelled the same way
as in hvd_quant (e.g. ``m * beta1 + g * (1 - beta1)`` for ``mul_(beta1).add_(g, alpha=...)``)
and norms are taken in float64; the test inputs are dyadic, so fp32 sums of them are
exact in any order. One flat float32 parameter vector per rank stands for DeepSpeed's
flattened fp32 parameter group.
"""

import math

import numpy as np

F32 = np.float32


def padded_size(numel, n):
    divider = int(n * 8 / np.gcd(n, 8))
    size = numel
    if size % (n * divider) != 0:
        size += (n * divider) - (size % (n * divider))
    return size


def _norm(x):
    return F32(math.sqrt(float(np.sum(x.astype(np.float64) ** 2))))


def _sign(x):
    # sign().add_(1).bool().float().add_(-0.5).mul_(2.0): +1 for x >= 0, -1 below.
    return np.where(x >= 0, F32(1), F32(-1)).astype(F32)


def _compress(buf, error):
    """One compression of compressed_allreduce, on the worker or the server side: the scale
    ``norm(buf) / sqrt(numel)`` and the signs of ``buf`` (already compensated with the
    error buffer), and the new error ``buf - scale * sign`` written into ``error``."""
    scale = F32(_norm(buf) / F32(math.sqrt(buf.size)))
    sign = _sign(buf)
    error[:] = buf - scale * sign
    return scale, sign


def compressed_allreduce(buffers, worker_errors, server_errors):
    """NcclBackend.compressed_allreduce on every rank; errors are updated in place (lists).
    Returns the per-rank outputs."""
    n = len(buffers)
    size = buffers[0].size
    total = worker_errors[0].size
    chunk = total // n
    signs, scales = [], []
    for r in range(n):
        buf = np.zeros(total, F32)
        buf[:size] = buffers[r]
        scale, sign = _compress(buf + worker_errors[r], worker_errors[r])
        signs.append(sign)
        scales.append(scale)
    server_scales, server_signs = [], []
    for j in range(n):
        compensated = None
        for r in range(n):  # .mul_(stack(scales).mul_(1 / size)).sum(0): rows in rank order
            part = signs[r][j * chunk:(j + 1) * chunk] * (scales[r] * F32(1.0 / n))
            compensated = part if compensated is None else compensated + part
        scale, sign = _compress(compensated + server_errors[j], server_errors[j])
        server_scales.append(scale)
        server_signs.append(sign)
    out = np.concatenate([server_signs[j] * server_scales[j] for j in range(n)])[:size]
    return [out.copy() for _ in range(n)]


def _engine_average(grads):
    total = grads[0]
    for g in grads[1:]:
        total = total + g
    return total * F32(1.0 / len(grads))


class _Base:
    def __init__(self, xs, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, mask=None):
        self.n = len(xs)
        self.x = [np.array(x, F32) for x in xs]
        self.lr, self.betas, self.eps, self.wd, self.mask = lr, betas, eps, weight_decay, mask
        self.initialize = False
        self.enable_backward_allreduce = True  # the engine's flag, shared by all ranks
        size = self.x[0].size
        self.state = [{"step": 0, "exp_avg": np.zeros(size, F32), "exp_avg_sq": np.zeros(size, F32)}
                      for _ in range(self.n)]
        self.kinds = []

    def _grads(self, grads):
        """What each rank's optimizer sees: the engine's fp32 average when it allreduced."""
        if self.enable_backward_allreduce:
            avg = _engine_average(grads)
            return [avg.copy() for _ in range(self.n)], True
        return [np.array(g, F32) for g in grads], False

    def _new_errors(self):
        size = self.x[0].size
        total = padded_size(size, self.n)
        for s in self.state:
            s["worker_error"] = np.zeros(total, F32)
            s["server_error"] = np.zeros(total // self.n, F32)

    def _compress(self, values):
        return compressed_allreduce(values, [s["worker_error"] for s in self.state],
                                    [s["server_error"] for s in self.state])

    def _update(self, r, lr=None):
        s = self.state[r]
        upd = s["exp_avg"] / (np.sqrt(s["exp_avg_sq"]) + F32(self.eps))
        if self.wd > 0.0:
            upd = upd + self.x[r] * F32(self.wd)
        return upd * F32(self.lr if lr is None else lr)


class OnebitAdam(_Base):
    """OnebitAdam.step for all ranks; ``step(grads)`` takes one gradient per rank.

    ``non_freeze``: the param group's flag (``group['non_freeze'] is True``). The group's
    path through ``step`` does not depend on the other groups (the freeze flags are the
    optimizer's, set from a step count every group shares), so one group stands for
    itself in a multi-group optimizer."""

    def __init__(self, xs, lr, freeze_step, non_freeze=False, **kw):
        super().__init__(xs, lr, **kw)
        self.freeze_step = freeze_step
        self.non_freeze = non_freeze
        self.adam_freeze_key = False

    def step(self, grads):
        grads, averaged = self._grads(grads)
        beta1, beta2 = self.betas
        if not self.initialize:
            self._new_errors()
            self.adam_freeze_key = True  # set by the error-buffer initialisation
        for s in self.state:
            s["step"] += 1
        if not self.adam_freeze_key:
            for r, s in enumerate(self.state):
                s["exp_avg"] = s["exp_avg"] * beta1 + grads[r] * (1.0 - beta1)
                s["exp_avg_sq"] = s["exp_avg_sq"] * beta2 + grads[r] * grads[r] * (1.0 - beta2)
            self.kinds.append("full")
        elif self.non_freeze:
            # dist.all_reduce(grad); grad.mul_(1 / dist.get_world_size()): on the
            # initialisation step too, whose grad the engine has averaged already. No mask.
            avg = _engine_average(grads)
            for s in self.state:
                s["exp_avg"] = s["exp_avg"] * beta1 + avg * (1.0 - beta1)
                s["exp_avg_sq"] = s["exp_avg_sq"] * beta2 + avg * avg * (1.0 - beta2)
            self.kinds.append("full")
        else:
            if self.initialize:
                for r, s in enumerate(self.state):
                    s["exp_avg"] = s["exp_avg"] * beta1 + grads[r] * (1.0 - beta1)
            if self.n > 1:
                out = self._compress([s["exp_avg"] for s in self.state])
                for r, s in enumerate(self.state):
                    s["exp_avg"] = out[r]
            if self.mask is not None:
                for s in self.state:
                    s["exp_avg"] = s["exp_avg"] * self.mask
            self.kinds.append(("onebit" if self.n > 1 else "local") if self.initialize else "init")
        if self.initialize:
            for r in range(self.n):
                self.x[r] = self.x[r] - self._update(r)
        if not self.initialize:
            self._new_errors()  # "Pop out errors": re-created as zeros when next needed
            self.adam_freeze_key = False
            self.initialize = True
            return
        if not self.adam_freeze_key and self.state[0]["step"] >= self.freeze_step:
            self.adam_freeze_key = True
            self.enable_backward_allreduce = False


class ZeroOneAdam(_Base):
    """ZeroOneAdam.step for all ranks; ``step(grads, lr)`` (lr may change every step)."""

    def __init__(self, xs, lr, var_freeze_step, var_update_scaler=16, local_step_scaler=32678,
                 local_step_clipper=16, one_rank_updates_momentum=False, **kw):
        super().__init__(xs, lr, **kw)
        # DeepSpeed skips the Phase-A momentum update on 1-bit rounds with one rank (it
        # sits inside ``if self.size > 1``); hvd_quant updates it: set True to compare.
        self.one_rank_updates_momentum = one_rank_updates_momentum
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.freeze_key = False
        self.reinitial_error_buffer = False

    def step(self, grads, lr=None):
        if lr is not None:
            self.lr = lr
        grads, averaged = self._grads(grads)
        beta1, beta2 = self.betas
        size = self.x[0].size
        for s in self.state:
            if not self.initialize or "worker_error" not in s:
                s.update(var_interval=1, var_counter=0, local_step_interval=1,
                         local_step_counter=0, lrs=0.0,
                         momentum_accumulator=np.zeros(size, F32))
        if not self.initialize or "worker_error" not in self.state[0]:
            self._new_errors()
        for s in self.state:
            s["step"] += 1
        kind = "local"
        if self.initialize:
            if not self.freeze_key:
                s0 = self.state[0]
                if s0["step"] % s0["var_interval"] == 0:
                    assert averaged, "the engine must have allreduced on a variance step"
                    for r, s in enumerate(self.state):
                        s["exp_avg_sq"] = s["exp_avg_sq"] * beta2 + grads[r] * grads[r] * (1.0 - beta2)
                        s["exp_avg"] = s["exp_avg"] * beta1 + grads[r] * (1.0 - beta1)
                    kind = "full"
                else:
                    assert not averaged
                    if self.n > 1:
                        out = self._compress(grads)
                        for r, s in enumerate(self.state):
                            g1 = out[r] * self.mask if self.mask is not None else out[r]
                            s["exp_avg"] = s["exp_avg"] * beta1 + g1 * (1.0 - beta1)
                        kind = "onebit"
                    elif self.one_rank_updates_momentum:
                        s = self.state[0]
                        s["exp_avg"] = s["exp_avg"] * beta1 + grads[0] * (1.0 - beta1)
            else:
                for r, s in enumerate(self.state):
                    s["exp_avg"] = s["exp_avg"] * beta1 + grads[r] * (1.0 - beta1)
                    s["lrs"] += self.lr
        if not self.initialize:
            if self.n > 1:
                out = self._compress([s["momentum_accumulator"] for s in self.state])
                for r, s in enumerate(self.state):
                    s["momentum_accumulator"] = out[r] * self.mask if self.mask is not None else out[r]
            kind = "init"
        if self.initialize:
            for r, s in enumerate(self.state):
                upd = self._update(r)
                self.x[r] = self.x[r] - upd
                if self.freeze_key:
                    s["momentum_accumulator"] = s["momentum_accumulator"] - upd
            s0 = self.state[0]
            if s0["step"] % s0["local_step_interval"] == 0 and self.freeze_key:
                for r, s in enumerate(self.state):
                    self.x[r] = self.x[r] - s["momentum_accumulator"]
                    s["momentum_accumulator"] = s["momentum_accumulator"] * (
                        np.sqrt(s["exp_avg_sq"]) + F32(self.eps))
                if self.n > 1:
                    out = self._compress([s["momentum_accumulator"] for s in self.state])
                    for r, s in enumerate(self.state):
                        s["momentum_accumulator"] = out[r] * self.mask if self.mask is not None else out[r]
                for r, s in enumerate(self.state):
                    s["exp_avg"] = -(s["momentum_accumulator"] / F32(s["lrs"]))
                    self.x[r] = self.x[r] + s["momentum_accumulator"] / (
                        np.sqrt(s["exp_avg_sq"]) + F32(self.eps))
                    s["momentum_accumulator"] = np.zeros(size, F32)
                    s["lrs"] = 0.0
                kind = "onebit" if self.n > 1 else "local"
            for s in self.state:
                if not self.freeze_key:
                    if s["step"] % s["var_interval"] == 0:
                        s["var_counter"] += 1
                        if s["var_counter"] == self.var_update_scaler:
                            s["var_counter"] = 0
                            s["var_interval"] *= 2
                else:
                    s["local_step_counter"] += 1
                    if s["local_step_counter"] == self.local_step_scaler:
                        s["local_step_counter"] = 0
                        s["local_step_interval"] = min(self.local_step_clipper,
                                                       s["local_step_interval"] * 2)
            s0 = self.state[0]
            if not self.freeze_key:
                self.enable_backward_allreduce = (s0["step"] + 1) % s0["var_interval"] == 0
        self.kinds.append(kind)
        if not self.initialize:
            for s in self.state:  # "Pop out errors"
                del s["worker_error"], s["server_error"]
            self.initialize = True
            return
        if self.state[0]["step"] > self.var_freeze_step:
            self.freeze_key = True
            self.enable_backward_allreduce = False
        if self.freeze_key and not self.reinitial_error_buffer:
            for s in self.state:
                s["worker_error"][:] = 0
                s["server_error"][:] = 0
            self.reinitial_error_buffer = True
