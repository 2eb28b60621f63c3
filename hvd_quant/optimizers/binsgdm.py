"""BinSGDM (Birder): a 1-bit adaptive optimizer by binary randomization, no warm-up.

Peng, Qin, Yu, Wang, Wang, Li: "BinSGDM: Extreme One-Bit Quantization for Communication
Efficient Large-Scale Distributed Training" (ICLR 2023 submission, OpenReview
U45w87vFQ3), published as "Birder: Communication-Efficient 1-bit Adaptive Optimizer for
Practical Distributed DNN Training", NeurIPS 2023. What the abstracts state: a 1-bit
adaptive optimizer whose quantization is cheap, needs no full-precision warm-up, has
Adam's convergence rate, and comes with a hierarchical 1-bit allreduce. The paper's
algorithm and its code (openi.pcl.ac.cn/c2net_optim/Birder) were not reachable, so the
update below is **our reconstruction** (project notes, methods.md section 1.3)::

    m = beta m + (1 - beta) g              (momentum)
    b = beta b + (1 - beta) |g|            (EMA of |g|, the same beta, so |m| <= b)
    z = m / b                              (0/0 taken as 0; in [-1, 1])
    q = +1 with probability (1 + z) / 2, else -1      (E q = z: 1 bit, no float scale)
    q_bar = mean over ranks of q           (hierarchical 1-bit allreduce, core.hierarchical)
    x = x - lr * (q_bar + weight_decay * x)

The ICLR text footnotes an AMSGrad-style step as "more about theoretical significance ...
we commonly do not implement it in practice"; it is left out here too. No error feedback:
the randomization is unbiased. Every element moves by at most ``lr`` per step (before
weight decay), as with sign methods, so learning rates are Adam-like.

Randomness comes from this rank's counter-based stream (``seed + 1_000_003 * rank``); its
position (``draws``) is part of the optimizer state, so a restored run draws the same
numbers. A step on which any rank's gradient is not finite, in any param group, changes
nothing in any group on any rank (the flag rides in the allreduce's own messages; one
verdict per step, see :mod:`hvd_quant.optimizers.base`). DeepSpeed's ``non_freeze``
param groups (a 1-bit Adam flag) are refused: there is no freeze here to opt out of.
"""

from ..core.costmodel import Collective, MethodCost, register_cost
from ..core.hierarchical import hierarchical_bytes, node_layout, sign_sum
from ..core.packing import packed_sign_bytes
from ..core.rng import call_key, call_key_tensor, draws, stream_key
from .base import Rule, keep_if
from .elementwise import descend

#: BinSGDM's one beta by default: 0.8 since 2026-12-06, 0.9 before. On the time-to-quality
#: LM (lr 5e-4, 2 ranks, 400 steps) 0.8 ended nearer Adam on each of four seeds under a
#: warm-up and cosine schedule (mean gap -0.2% against +0.9%), and on three of four at a
#: constant rate (mean +2.5% against +4.8% on one host; one of those runs moved by 2% with
#: the CPU that ran it); on the convergence page's byte-level LM 1.0 to 1.9% lower in all
#: four runs; 0.95 and 0.99 were much worse (issue 51; docs/benchmarks/time-to-quality.md,
#: "Where BinSGDM's gap comes from"; benchmarks/reference/binsgdm-default-beta-2026-12-06/).
DEFAULT_BETA = 0.8


def single_beta(betas, beta=None):
    """The one beta of BinSGDM from ``beta`` or a ``betas`` tuple (all values equal)."""
    values = {float(b) for b in ((beta,) if beta is not None else betas)}
    if len(values) != 1 or not 0.0 <= next(iter(values)) < 1.0:
        raise ValueError("BinSGDM uses one beta in [0, 1) for the momentum and the |g| average "
                         f"(so that |m| <= b); got betas={betas}, beta={beta}")
    return values.pop()


def binary_randomize(B, g, m, b, beta, key, out=(None, None)):
    """New ``m``, ``b`` and the packed +-1 bits of ``q`` (fused primitive
    ``binsgdm_encode``, which writes the new ``m`` and ``b`` into the pair ``out`` where
    given; one draw of the call ``key`` per element)."""
    fast = B.kernel("binsgdm_encode", g, m, b)
    if fast is not None:
        return fast(g, m, b, beta, key, m_out=out[0], b_out=out[1])
    m = m * beta + g * (1.0 - beta)
    b = b * beta + B.abs(g) * (1.0 - beta)
    positive = B.less(B.zeros(1), b)  # b > 0 (b is never negative)
    z = B.clip(B.where(positive, m / B.where(positive, b, B.full(1, 1.0)), B.zeros(1)), -1.0, 1.0)
    up = B.less(draws(B, key, B.numel(g)), (z + 1.0) * 0.5)
    d = B.numel(g)
    return m, b, B.packbits(B.pad(B.cast(up, "uint8"), (-d) % 8))


class BinSGDMRule(Rule):
    """The BinSGDM update for one flat parameter group (reconstruction; module docstring).

    Parameters
    ----------
    ranks_per_node : int or None
        Ranks per node of the hierarchical allreduce (``None``: flat 1-bit allgather).
    seed : int
        Base of every rank's random stream.
    """

    name = "binsgdm"
    param_slots = ("exp_avg", "exp_avg_abs")
    per_rank_slots = ("exp_avg", "exp_avg_abs")  # moments of each rank's own gradients
    non_freeze_refusal = ("BinSGDM has no warm-up and no frozen variance for a group to opt out "
                          "of (non_freeze is DeepSpeed's OnebitAdam flag, runtime/fp16/onebit/adam.py)")

    def __init__(self, ranks_per_node=None, seed=0):
        if ranks_per_node is not None and (isinstance(ranks_per_node, bool)
                                           or not isinstance(ranks_per_node, int) or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be None or a positive int, got {ranks_per_node!r}")
        super().__init__(ranks_per_node=ranks_per_node, seed=int(seed))
        self.ranks_per_node = ranks_per_node
        self.seed = int(seed)

    def validate(self, world_size):
        node_layout(world_size, self.ranks_per_node)

    def scalars(self):
        return {"step": 0, "draws": 0}

    def wire_bytes(self, kind, numel, world_size):
        if kind != "onebit" or world_size == 1:
            return 0.0
        return sum(hierarchical_bytes(numel, world_size, self.ranks_per_node).values())

    def step(self, ctx):
        B, st, comm = ctx.B, ctx.state, ctx.comm
        n, d = comm.size, B.numel(ctx.x)
        beta = ctx.hp["betas"][0]
        calls = st.scalar("draws")
        key = stream_key(self.seed + 1_000_003 * comm.rank)
        if isinstance(calls, int):
            encode_key, sum_key = call_key(key, calls), call_key(key, calls + 1)
        else:  # a graph counter (TensorFlow)
            encode_key, sum_key = call_key_tensor(B, key, calls), call_key_tensor(B, key, calls + 1)

        m, b, bits = binary_randomize(B, ctx.g, st.slot("exp_avg"), st.slot("exp_avg_abs"), beta, encode_key,
                                      out=(ctx.buffer("m"), ctx.buffer("b")))
        local_ok = B.all_finite(ctx.g)
        held = {}

        def reduce(comm):  # the signs' sum, not a mean: measured (bytes, times), never probed
            held["sum"] = sign_sum(B, comm, bits, d, self.ranks_per_node if n > 1 else None, sum_key,
                                   ctx.collective_name("signs"), finite=local_ok)
            return held["sum"][0]

        # A sum of signs is finite whatever the ranks sent: the round's own verdict says.
        ctx.measured("signs", ctx.g, reduce, probe=False, finite=lambda: held["sum"][2])
        q_sum, count, ok = held["sum"]
        if n > 1:
            st.count("onebit", self.wire_bytes("onebit", d, n))
        else:
            st.count("local", 0.0)
        st.commit(ok, {"exp_avg": m, "exp_avg_abs": b},
                  {"step": st.scalar("step") + 1, "draws": calls + 2})
        # x - lr * (q_sum / count + weight_decay * x), the mean of the signs formed in the
        # update's own pass, into the parameters where the adapter allows
        return keep_if(B, ok, descend(B, ctx.x, q_sum, ctx.lr, ctx.hp["weight_decay"],
                                      into=ctx.into_x(ok), out=ctx.x_buffer(), divisor=count), ctx.x)



def binsgdm_collectives(d, n, k, segments=1, options=None):
    """What one BinSGDM step issues (for the cost model): one allgather of packed signs, or
    with several hosts the hierarchy's hops (:mod:`hvd_quant.core.hierarchical`)."""
    nodes, k = node_layout(n, k)
    if nodes == 1 or k == 1:
        return [Collective("allgather", packed_sign_bytes(d) + 1.0, n)]
    shard = (d + (-d) % (8 * k)) // k
    row = shard // 8 + 1.0
    # Node groups are routed through the global communicator's hops unless Horovod process
    # sets were registered (hvd_quant.node_process_sets): k - 1 hops, M - 1 hops, k - 1 hops.
    return ([Collective("sendrecv", row, n)] * (k - 1) + [Collective("sendrecv", row, n)] * (nodes - 1)
            + [Collective("sendrecv", nodes * row, n)] * (k - 1))


# Its passes: the randomized sign and momentum (11 float32 passes), the sum of the signs.
register_cost("binsgdm", MethodCost(binsgdm_collectives, lambda numel, n: 4.0 * float(numel) * (14.0 + n / 32.0),
                                    one_buffer=True))
