"""1-bit Adam: Adam during a full-precision warm-up, then the momentum at 1 bit.

Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam: Communication
Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021 (arXiv
2102.02888). Semantics follow DeepSpeed's ``deepspeed/runtime/fp16/onebit/adam.py``
(``OnebitAdam.step``), read from its source; the code here is ours.

Per parameter group, ``step`` counting every call including the first::

    step 1 (DeepSpeed's initialisation step): one compressed allreduce of the (zero)
        momentum; nothing else changes, the gradient is not used
    warm-up, while frozen is False (the engine averages g in fp32 first):
        m = beta1 m + (1 - beta1) g_avg
        v = beta2 v + (1 - beta2) g_avg**2
    after it (v frozen, no fp32 allreduce):
        m = beta1 m + (1 - beta1) g_local
        m = compressed_allreduce(m; worker and server error)     (n > 1 only)
        m = m * exp_avg_mask                                      (if given)
    update = m / (sqrt(v) + eps) + weight_decay * x               (no bias correction)
    x      = x - lr * update
    frozen = True once step >= freeze_step (checked at the end of the step)

A param group with DeepSpeed's ``non_freeze=True`` never freezes. DeepSpeed's ``step()``
gives it a branch of its own wherever the others are compressed (``adam_freeze_key``,
which is also set on DeepSpeed's initialisation step): ``dist.all_reduce(grad)``,
``grad.mul_(1 / dist.get_world_size())``, both moments updated as in the warm-up, no
``exp_avg_mask``. So on the initialisation step its moments take the averaged gradient
(the parameters do not move), and every later step is the warm-up's fp32 Adam. Here
(``ctx.hp["non_freeze"]``): an fp32 round every step (step kind ``full``), counters
identical to the other groups'; the group's error buffers are allocated and stay zero,
as in DeepSpeed. One difference: on its initialisation step DeepSpeed averages a
gradient that its engine has averaged already; here it is averaged once (equal bits in
``tests/test_onebit_optimizers.py`` for 1 to 5 ranks, rounding apart in general).

A step whose averaged gradient (warm-up) or compressed momentum is not finite on any rank,
in any param group, changes nothing in any group, on every rank (one verdict per
optimizer step, see :mod:`hvd_quant.optimizers.base`); so does a warm-up step whose
``g_avg**2`` overflows float32 (``|g| > ~1.8e19``: plain Adam would store an infinite
``v`` and never move those elements again).

So steps ``2 .. freeze_step`` are Adam on averaged gradients and every later step sends
1 bit per element (:mod:`hvd_quant.core.onebit`).

Deliberate departures from DeepSpeed, and why:

* ``load_state_dict`` restores everything. DeepSpeed's (``OnebitAdam.load_state_dict``)
  drops both error buffers (they restart at zero; it saves rank 0's only) and keeps
  ``step``, ``exp_avg`` and ``exp_avg_sq``. In a new process its next ``step()`` is the
  initialisation step again (``initialize`` is not saved): the gradient is not used, the
  parameters do not move, the loaded momentum is replaced by its compressed average; and
  when the checkpoint was past ``freeze_step``, the step after that takes the warm-up
  branch once on each rank's own gradient (the engine's allreduce is off), updating the
  variance with it, before compression resumes. Here checkpoints are per rank and a
  restored run continues bit-identically, as if never stopped.
* The warm-up's fp32 average is our own ring allreduce (identical bits on every rank)
  rather than the engine's allreduce.
"""

from .base import full_precision_mean, keep_if, scales_option
from .elementwise import adam_descend, ema
from .onebit_rounds import OnebitRoundsRule


class OnebitAdamRule(OnebitRoundsRule):
    """DeepSpeed's ``OnebitAdam`` update for one flat parameter group.

    Parameters
    ----------
    freeze_step : int
        Step (counting the initialisation step) after which the variance is frozen and
        the momentum is compressed. DeepSpeed's default is 100000; its tutorials warm
        up for 15-25% of the total steps.
    scales : {"tensor", "group"}
        ``"tensor"`` (default): one RMS scale and one pair of error buffers per tensor,
        as DeepSpeed's ``step()`` compresses each parameter tensor on its own (all
        tensors still go in one set of collectives). ``"group"``: one per parameter
        group, as under DeepSpeed's fp16 optimizer, which flattens each group.
    """

    name = "onebit_adam"
    param_slots = ("exp_avg", "exp_avg_sq")
    per_rank_slots = OnebitRoundsRule.error_slots
    non_freeze_refusal = None  # DeepSpeed's OnebitAdam.step reads group['non_freeze']

    def __init__(self, freeze_step=100000, scales="tensor"):
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 0:
            raise ValueError(f"freeze_step must be an int >= 0, got {freeze_step!r}")
        super().__init__(freeze_step=freeze_step, scales=scales_option(scales))
        self.freeze_step = freeze_step
        self.scales = scales

    def scalars(self):
        return {"step": 0, "initialized": 0, "frozen": 0}

    def step(self, ctx):
        B, st, comm = ctx.B, ctx.state, ctx.comm
        n = comm.size
        beta1, beta2 = ctx.hp["betas"]
        step = st.scalar("step") + 1
        non_freeze = ctx.hp.get("non_freeze", False)  # a Python bool (checked by the adapter)

        def compress(value, into=None):
            return self.compressed_mean(ctx, value, "momentum", into)

        def masked(m):
            # Applied with any number of ranks, as DeepSpeed does.
            return m * ctx.mask if ctx.mask is not None else m

        def initialisation():
            # DeepSpeed's first step: the zero momentum goes through the compressed
            # allreduce once (it stays zero, so do both error buffers); no update.
            m = compress(st.slot("exp_avg"))[0] if n > 1 else st.slot("exp_avg")
            st.count("init", self.wire_bytes("init", ctx.counts, n))
            st.commit(True, {"exp_avg": masked(m)}, {"step": step, "initialized": 1})
            return ctx.x

        def non_freeze_initialisation():
            # DeepSpeed's first step takes a non_freeze group through its fp32 branch:
            # both moments absorb the averaged gradient; no update.
            m, v, ok = full_precision_moments()
            st.commit(ok, {"exp_avg": m, "exp_avg_sq": v}, {"step": step, "initialized": 1})
            return ctx.x

        def apply(m, v, ok):
            # Into the parameters themselves where the adapter allows and the step is kept.
            into = ctx.into_x(ok)
            return adam_descend(B, ctx.x, m, v, ctx.lr, ctx.hp["eps"], ctx.hp["weight_decay"],
                                into=into if into is not None else ctx.x_buffer())

        def full_precision_moments():
            g = full_precision_mean(B, comm, ctx.g, ctx.collective_name("grad"))
            st.count("full", self.wire_bytes("full", ctx.counts, n))
            m = ema(B, st.slot("exp_avg"), g, beta1, out=ctx.buffer("m"))
            v = ema(B, st.slot("exp_avg_sq"), g, beta2, square=True, out=ctx.buffer("v"))
            # v is finite iff g is and g**2 did not overflow float32 (|g| > ~1.8e19, where
            # plain Adam stores an infinite v): either way the step is skipped. v is the
            # same on every rank (from the bit-identical average), so is the verdict.
            return m, v, B.all_finite(v)

        def warm_up():
            # Also every step of a non_freeze group: DeepSpeed's frozen branch gives it
            # an fp32 average and keeps its variance updating (no exp_avg_mask).
            m, v, ok = full_precision_moments()
            # Compression starts after the step at which step >= freeze_step.
            st.commit(ok, {"exp_avg": m, "exp_avg_sq": v},
                      {"step": step, "frozen": B.select(step >= self.freeze_step, 1, 0)})
            return keep_if(B, ok, apply(m, v, ok), ctx.x)

        def compressed():
            m = ema(B, st.slot("exp_avg"), ctx.g, beta1, out=ctx.buffer("m"))
            if n > 1:
                m, ok = compress(m, into=m)  # m is this step's own temporary
                st.count("onebit", self.wire_bytes("onebit", ctx.counts, n))
            else:
                ok = B.all_finite(m)
                st.count("local", 0.0)
            m = masked(m)
            st.commit(ok, {"exp_avg": m}, {"step": step})
            return keep_if(B, ok, apply(m, st.slot("exp_avg_sq"), ok), ctx.x)

        if non_freeze:
            return B.cond(st.scalar("initialized") > 0, warm_up, non_freeze_initialisation)

        def train_step():
            return B.cond(st.scalar("frozen") > 0, compressed, warm_up)

        return B.cond(st.scalar("initialized") > 0, train_step, initialisation)
