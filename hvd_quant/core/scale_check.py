"""One warning at start when a method's wire grows with the ranks past half of fp32's.

An allgather of every rank's bits (``ef_sign``, BinSGDM's flat path) sends ``(n - 1) d / 8``
bytes per rank, while an fp32 ring allreduce sends ``2 (n - 1) / n * 4 d`` whatever ``n``:
from 32 ranks on the 1-bit allgather sends more than half as much as fp32, from 64 ranks
as much. Users pick a method at 2 ranks and run it at 256; nothing told them. So the first
time an owner (an optimizer, a tape's variables, a 1-bit optimizer) reduces, rank 0 logs
one warning through the ``hvd_quant`` logger when the method's bytes per rank at this
world size (:mod:`hvd_quant.core.costmodel`) exceed half of an fp32 ring allreduce's by
more than 256 KiB (below that, a collective's latency matters more than the bytes),
naming the methods whose bytes stay flat. Nothing else changes: the method runs as asked.
"""

import logging

from . import costmodel
from .ring import GATHER_EXTRA_BYTES

log = logging.getLogger("hvd_quant")

#: Above this share of an fp32 ring allreduce's bytes per rank, the warning is logged.
THRESHOLD = 0.5

_DONE_ATTR = "_hvd_quant_scale_checked"


def excess(method, numel, world_size, ranks_per_node=None, options=None):
    """``(bytes per rank, fp32 ring bytes per rank)`` when ``method`` sends more than
    :data:`THRESHOLD` of an fp32 ring allreduce for ``numel`` elements at ``world_size``
    ranks, else ``None`` (also for methods the cost model does not know)."""
    # The baselines have no compression to lose as ranks grow (``none`` sends exactly
    # fp32's bytes at every world size, ``fp16`` half).
    if world_size < 2 or numel < 1 or not costmodel.compresses(method):
        return None
    try:
        sent = costmodel.wire_bytes(costmodel.collectives(method, numel, world_size, ranks_per_node,
                                                          options=_model_options(options)))
    except ValueError:
        return None
    fp32 = costmodel.fp32_ring_bytes(numel, world_size)
    # A small model's bytes do not matter beside a collective's latency: the same margin
    # under which onebit and Marsit gather a small buffer on purpose (core.ring.gathers).
    return (sent, fp32) if sent - THRESHOLD * fp32 > GATHER_EXTRA_BYTES else None


def _model_options(options):
    keep = ("topology", "torus_rows", "norm", "bits", "levels")
    return {k: v for k, v in (options or {}).items() if k in keep and v is not None}


def message(method, numel, world_size, sent, fp32, ranks_per_node=None):
    flat = costmodel.flat_methods(world_size, numel, ranks_per_node)
    return (f"hvd_quant: {method} sends {sent / 1e6:.3g} MB per rank per step for {numel:,} gradient "
            f"elements at {world_size} ranks, {sent / fp32:.2f}x the {fp32 / 1e6:.3g} MB of an fp32 ring "
            f"allreduce: its bytes per rank grow with the number of ranks (an allgather of every "
            f"rank's bits). Methods whose bytes per rank stay flat here: {', '.join(flat)}. "
            "See docs/guide/tuning.md, 'Which method at which scale'.")


def warn_once(owner, method, comm, numel, options=None, ranks_per_node="comm"):
    """Log the warning (rank 0 only) the first time ``owner`` gets here, if ``method``'s
    bytes per rank at ``comm.size`` ranks exceed :data:`THRESHOLD` of fp32's. Returns the
    message when one was logged (on rank 0), else ``None``. Later calls cost an attribute
    lookup. ``ranks_per_node``: the layout the method follows (default: what ``comm``
    reports, as compressors derive it)."""
    if getattr(owner, _DONE_ATTR, False):
        return None
    try:
        setattr(owner, _DONE_ATTR, True)
    except AttributeError:
        return None
    k = ranks_per_node
    if k == "comm":
        k = comm.ranks_per_node() if hasattr(comm, "ranks_per_node") else None
    found = excess(method, int(numel), comm.size, k, options)
    if found is None or comm.rank != 0:
        return None
    text = message(method, int(numel), comm.size, *found, ranks_per_node=k)
    log.warning(text)
    return text
