"""1-bit SGD with two-sided error feedback: the two-stage compressed allreduce as a compressor.

The gradient reduction of 1-bit Adam (Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang,
He, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed", ICML 2021, arXiv 2102.02888) and of 0/1 Adam (Lu et al., ICLR 2023), offered on
its own for any optimizer: DeepSpeed's ``NcclBackend.compressed_allreduce``
(``deepspeed/runtime/comm/nccl.py``), implemented once in
:func:`hvd_quant.core.compressed_allreduce.compressed_allreduce` (bit-exact against a numpy
transcription of DeepSpeed's rules, ``tests/deepspeed_reference.py``). Each rank
compensates its gradient with its *worker* error and sends RMS-scaled signs; the rank that
owns a chunk averages it, compensates it with its *server* error and re-signs it; every
rank gathers every chunk. Both sides keep what their sign threw away, hence "two-sided".

With ``n`` ranks, a buffer of ``d`` elements is padded with zeros to ``D``, a multiple of
``n * lcm(n, 8)`` (DeepSpeed's padding), and per rank and per buffer::

    c        = pad(g) + e_worker            sigma_w = ||c||_2 / sqrt(D)
    e_worker = c - sigma_w * sign(c)        (sign(0) = +1)
    -> alltoall of the packed signs (chunk j to rank j), allgather of the n sigma_w
    c_s      = sum_r sigma_w[r] / n * sign_r[chunk j] + e_server       (on rank j)
    sigma_s  = ||c_s||_2 / sqrt(D / n);     e_server = c_s - sigma_s * sign(c_s)
    -> allgather of the packed server signs and of the n sigma_s
    out      = concat_j sigma_s[j] * sign(c_s[j]), cut back to d        (every rank alike)

Layouts (option ``layout``): the above is ``"two_stage"``, two dependent collectives
whatever ``n``. ``"gather"`` sends each rank's worker signs and scale in one allgather
and every rank decodes the exact average ``sum_r sigma_w[r] / n * sign_r``, the server's
``c_s`` without its error or second sign (:func:`~hvd_quant.core.compressed_allreduce.gathered_allreduce`):
one collective, ``(n - 1) (D / 8 + 4)`` bytes per rank. ``"auto"`` (default) takes it from
5 ranks on for buffers small enough that a collective's latency outweighs the extra bytes
(:func:`~hvd_quant.core.ring.gathers`), and the two stages otherwise and always up to 4
ranks.

One scale per buffer and side: through hvd_quant's ``DistributedOptimizer`` (torch or
Keras) and ``DistributedGradientTape`` a fused buffer shares one scale, like DeepSpeed's
flattened fp32 parameter group; through Horovod's stock ``hvd.DistributedOptimizer`` /
``hvd.DistributedGradientTape`` each tensor is its own buffer, like DeepSpeed's
per-parameter loop.

Bytes sent per rank (the :class:`~hvd_quant.core.comm.WireMeter` cost model):
``(n - 1) / n * D / 8`` (alltoall) ``+ (n - 1) * D / (8 n)`` (server signs) ``+ 8 (n - 1)``
(two float32 scales), about ``2 (n - 1) / n * D / 8``: 32 times less than an fp32
allreduce, whatever the number of tensors.

State, per rank and per buffer: the worker error (``D`` elements) and this rank's chunk of
the server's state (``D / n``), kept compensated: ``server_error`` holds ``c_s`` and
``server_scale`` its ``sigma_s``; DeepSpeed's server error is ``c_s - sigma_s * sign(c_s)``
(:func:`~hvd_quant.core.compressed_allreduce.compressed_allreduce_compensated`: the same results with
fewer passes over memory; a residual saved by an earlier version resumes exactly, as the
compensated state with zero scale). They depend on the world size and the rank, so they
are *buffer slots* (see :mod:`hvd_quant.core.state`): saved whole under
``"hvd_quant.buffer/<layout>/rank<r>of<n>/worker_error"``, ``.../server_error`` and
``.../server_scale``, restored
only on the same rank of a world of the same size, otherwise dropped (with a warning) and
restarted from zero, as DeepSpeed does on every checkpoint load. In Keras they are
optimizer variables of fixed shape (``..._fused0_worker_error``); a checkpoint taken at
another world size does not fit them and Keras refuses to load it.

Non-finite input: an inf or NaN on any rank makes that rank's worker scale non-finite;
the scales are gathered before any error buffer changes, so every rank returns NaN for
the whole buffer and leaves both error buffers exactly as they were, with no collective
added (:mod:`hvd_quant.core.compressed_allreduce`).
"""

from ..core.compressor import Compressor
from ..core.costmodel import onebit_collectives, onebit_memory_bytes
from ..core.compressed_allreduce import (compressed_allreduce_bytes, compressed_allreduce_compensated, gathered_allreduce,
                           gathered_allreduce_bytes, padded_size)
from ..core.ring import gathers

#: The ``layout`` option's values.
LAYOUTS = ("auto", "two_stage", "gather")


class OnebitCompressor(Compressor):
    """Two-stage 1-bit compressed allreduce with worker and server error feedback.

    The averaging collective of DeepSpeed's 1-bit Adam and 0/1 Adam
    (``deepspeed/runtime/comm/nccl.py``, ``NcclBackend.compressed_allreduce``; Tang et al.,
    "1-bit Adam", ICML 2021) as a gradient compressor: "1-bit SGD with two-sided error
    feedback" for any optimizer.

    Parameters
    ----------
    layout : "auto" (default), "two_stage" or "gather"
        ``"two_stage"``: DeepSpeed's alltoall and allgather, two dependent collectives.
        ``"gather"``: the worker stage, then one allgather of every rank's signs and the
        exact average of them (:func:`~hvd_quant.core.compressed_allreduce.gathered_allreduce`: no
        server stage, so the server state stays as it is). ``"auto"``: the two stages,
        except from 5 ranks on for a buffer small enough that one collective's latency
        outweighs the gather's extra bytes (:func:`~hvd_quant.core.ring.gathers`): at 16
        ranks the second collective cost more than the whole buffer's bytes
        (docs/benchmarks/scaling.md). Up to 4 ranks ``"auto"`` is always the two stages.

    Attributes
    ----------
    buffer_slots : tuple of str
        ``("worker_error", "server_error", "server_scale")``: per-buffer state of ``D``,
        ``D / n`` and 1
        elements (:meth:`buffer_state_sizes`), saved per rank and world size.

    Notes
    -----
    Every rank ends with bit-identical results: the output is decoded from gathered
    signs and scales only. The estimate is biased (scaled signs); the error feedback on
    both sides carries what was lost into the next step. The first steps therefore lag
    the true mean; 1-bit Adam runs full-precision warm-up steps before switching to this
    reduction (use ``hvd_quant.torch.OnebitAdam`` / ``ZeroOneAdam`` for that schedule).
    """

    name = "onebit"
    stateful = True
    error_feedback = True
    state_slots = ()  # nothing per element: both error buffers are buffer slots
    buffer_slots = ("worker_error", "server_error", "server_scale")
    # What this rank held back of its own input, as ef_sign's residual; the server error is
    # the chunk's error of the averaging stage, shared out among the ranks.
    residual_slot = "worker_error"

    def __init__(self, layout="auto"):
        if layout not in LAYOUTS:
            raise ValueError(f"onebit: layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
        self.layout_option = layout

    def options(self):
        return {"layout": self.layout_option}

    def buffer_layout(self, numel, world_size):
        """``"two_stage"`` or ``"gather"``: how a buffer of ``numel`` elements is reduced
        at ``world_size`` ranks (the same on every rank)."""
        if self.layout_option != "auto":
            return self.layout_option
        row = padded_size(numel, world_size) // 8 + 4
        return "gather" if gathers(world_size, row) else "two_stage"

    def buffer_state_sizes(self, numel, world_size):
        total = padded_size(numel, world_size)
        return {"worker_error": total, "server_error": total // world_size, "server_scale": 1}

    def reduce(self, x, ctx):
        B = ctx.backend
        worker_error = ctx.state.get("worker_error")
        server_state = ctx.state.get("server_error")
        server_scale = ctx.state.get("server_scale")
        if self.buffer_layout(B.numel(x), ctx.comm.size) == "gather":
            out, worker_error, _ = gathered_allreduce(B, ctx.comm, x, worker_error, ctx.collective_name("onebit"),
                                                      out=ctx.out)
            ctx.state.set("worker_error", worker_error)
            return out
        out, worker_error, server_state, server_scale, _ = compressed_allreduce_compensated(
            B, ctx.comm, x, worker_error, server_state, server_scale, ctx.collective_name("onebit"),
            out=ctx.out)
        ctx.state.set("worker_error", worker_error)
        ctx.state.set("server_error", server_state)
        ctx.state.set("server_scale", server_scale)
        return out

    def wire_bytes(self, numel, world_size, segments=1):
        if self.buffer_layout(numel, world_size) == "gather":
            return float(gathered_allreduce_bytes(numel, world_size))
        return float(compressed_allreduce_bytes(numel, world_size))

    def collectives(self, numel, world_size, ranks_per_node=None, segments=1, rank=0):
        return onebit_collectives([numel], world_size, self.buffer_layout(numel, world_size))

    def memory_bytes(self, numel, world_size, ranks_per_node=None, segments=1):
        return onebit_memory_bytes(numel, world_size)
