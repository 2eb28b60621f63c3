"""What a method costs per step at ``n`` ranks: its collectives, their bytes, their time.

For each method the model lists the collectives the code issues for one buffer (a bucket
of the torch optimizer, a tape's fused variables, an optimizer's parameter group), in
the order the code issues them, with the payload each rank passes in
(:func:`collectives`). Each compressor states its own, next to its ``wire_bytes``
(:meth:`~hvd_quant.core.compressor.Compressor.collectives` and ``memory_bytes``); this
module finds it by name in the table of registered compressors. A method that is not a
compressor (a 1-bit optimizer, Horovod's own allreduce, torch's PowerSGD hook) states its
cost in its own module as a :class:`MethodCost` (:func:`register_cost`), so this module
names no method. ``tests/test_costmodel.py`` runs every method on a
:class:`~hvd_quant.core.simulate.ThreadWorld` through a recording communicator and checks
these lists against what the code really issued, for several world sizes and host
layouts, so the model cannot drift from the code.

Time of one step of one buffer, per rank (:func:`predict`)::

    sum over its dependent collectives c of   latency(c.kind, c.ranks)
                                            + wire bytes of c / (efficiency(c.kind) * rate)
    + bytes the method reads and writes in memory / memory bandwidth

* ``latency(kind, n) = latency0[kind] + latency1[kind] * (n - 1)``: Horovod's negotiation
  of the collective (its background thread's cycle and the cross-rank exchange of every
  cycle) and the messages of Gloo's algorithm, whose number grows with ``n`` (a ring
  allreduce makes at least ``4 (n - 1)`` sequential transfers, an allgather ``n - 1``, an
  alltoall ``n - 1`` at once, preceded by an exchange of the split sizes);
* wire bytes are :class:`~hvd_quant.core.comm.WireMeter`'s (what one rank sends: an
  allreduce of ``b`` bytes ``2 (n - 1) / n * b``, an allgather ``(n - 1) b``, an alltoall
  ``(n - 1) / n * b``, a hop ``b``), at a measured fraction of the link rate per kind
  (Gloo's allgather and alltoall were measured at about half the link rate on shaped
  links);
* memory: the passes of the method over the buffer (:func:`memory_bytes`, lower bounds),
  at a measured copy bandwidth (bytes read plus written per second), and
  ``cascading_sign``'s folds in bytes of a copy
  (:func:`hvd_quant.compressors.marsit.cascade_fold_bytes`, measured);
* for a method that states them (torch's PowerSGD), its floating-point operations at a
  rate (:attr:`MethodCost.flops`).

The link figures come from :class:`LinkModel`: calibrated on Gloo's own collectives on the
emulated cluster (``benchmarks/costmodel_calibrate.py``), or assumed for a datacenter
(:meth:`LinkModel.datacenter`), for the extrapolation to many ranks
(``benchmarks/costmodel_extrapolate.py``).
"""

import inspect
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from .compressor import available, registered
from .compressed_allreduce import padded_size
from .ring import chunk_bounds

KINDS = ("allreduce", "allgather", "alltoall", "sendrecv")


@dataclass(frozen=True)
class Collective:
    """One collective a rank issues: its ``kind``, the bytes this rank passes in
    (``nbytes``: an allreduce's buffer, an allgather's contribution, an alltoall's whole
    input, a hop's chunk) and the ranks of the communicator it runs on. ``overlapped``:
    in flight beside the ones after it (its time is not on the step's critical path).
    ``dtype``: what an allreduce sums (:attr:`LinkModel.sum_s_per_byte`)."""
    kind: str
    nbytes: float
    ranks: int
    overlapped: bool = False
    dtype: str = "float32"

    def wire_bytes(self):
        """Bytes this rank sends (:class:`~hvd_quant.core.comm.WireMeter` cost model)."""
        n, b = self.ranks, self.nbytes
        if n <= 1:
            return 0.0
        return {"allreduce": 2.0 * (n - 1) / n * b, "allgather": (n - 1) * b,
                "alltoall": (n - 1) / n * b, "sendrecv": b}[self.kind]


@dataclass(frozen=True)
class MethodCost:
    """The cost of a method that is not a registered compressor, stated by its own module
    and registered here by name (:func:`register_cost`): the 1-bit optimizers (their
    1-bit step), Horovod's own allreduce, torch's PowerSGD hook.

    collectives : ``(numel, world_size, ranks_per_node, segments, options)`` -> list of
        :class:`Collective` for one buffer, as :func:`collectives` documents
    memory_bytes : ``(numel, world_size)`` -> bytes read and written (a lower bound)
    compresses : False for an uncompressed baseline (no scale warning, not "flat")
    one_buffer : the method reduces the whole model as one buffer (an optimizer's
        parameter group, one DDP bucket), not in the torch optimizer's buckets
    flops : ``(options)`` -> floating-point operations of its compression per step, or None
    """
    collectives: Callable
    memory_bytes: Callable
    compresses: bool = True
    one_buffer: bool = False
    flops: Optional[Callable] = None


_COSTS = {}


def register_cost(name, cost):
    """Make the cost model know ``name`` (a method module calls this at import)."""
    if registered(name) is not None:
        raise ValueError(f"{name!r} is a registered compressor: it states its own cost")
    _COSTS[name] = cost


def known_methods():
    """Every name the cost model knows: the registered compressors, then the others."""
    return available() + sorted(_COSTS)


def compresses(method):
    """False for the uncompressed baselines (``none``, ``fp16``, ``horovod_fp32``)."""
    cls = registered(method)
    if cls is not None:
        return cls.compresses
    cost = _COSTS.get(method)
    return cost.compresses if cost is not None else True


# --- the collectives of each method -------------------------------------------------------------
def collectives(method, numel, world_size, ranks_per_node=None, segments=1, options=None, rank=0):
    """The collectives ``method`` issues to reduce one buffer of ``numel`` float32 elements
    made of ``segments`` tensors, at ``world_size`` ranks with ``ranks_per_node`` per host
    (``None``: unknown or one), at its default options (``options`` overrides some: see
    below), as rank ``rank`` issues them (ring and torus hops send different chunks from
    different ranks; the same kinds, and the same bytes over all ranks). A 1-bit
    optimizer's list is one of its 1-bit steps (0/1 Adam: a sync step).

    A registered compressor states its own list
    (:meth:`~hvd_quant.core.compressor.Compressor.collectives`), built from the options
    its constructor takes (others are ignored): e.g. ``marsit``/``cascading_sign``
    ``topology`` (and ``torus_rows``), ``global_qsgd`` ``norm``, ``onebit`` ``layout``.
    Any other method states its list in its :class:`MethodCost`: Horovod's own
    ``horovod_fp32``, the 1-bit optimizers (``tensor_sizes``) and torch's
    ``ddp_powersgd`` (``shapes``, ``rank``)."""
    n, d, S = int(world_size), int(numel), int(segments)
    options = dict(options or {})
    if n <= 1:
        return []
    compressor = compressor_for(method, options)
    if compressor is not None:
        try:
            return compressor.collectives(d, n, ranks_per_node, S, rank)
        except NotImplementedError:
            raise _unknown(method) from None
    cost = _COSTS.get(method)
    if cost is None:
        raise _unknown(method)
    return cost.collectives(d, n, ranks_per_node, S, options)


def compressor_for(method, options=None):
    """The registered compressor named ``method`` (``None`` for any other name), built
    with those of ``options`` its constructor takes."""
    cls = registered(method)
    if cls is None:
        return None
    params = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in (options or {}).items() if k in params})


def _unknown(method):
    return ValueError(f"the cost model does not know {method!r}; known: {', '.join(known_methods())}")


def even_sizes(d, S):
    """``d`` elements shared out over ``S`` tensors as evenly as can be."""
    base, extra = divmod(d, S)
    return [base + (1 if i < extra else 0) for i in range(S)]


def ring_hops(nbytes, n, ranks, r=0):
    """A ring allreduce of ``nbytes`` (unit 1) as hops: what ring rank ``r`` sends at each
    of the ``2 (n - 1)`` hops (a chunk each; chunk sizes differ by at most one byte)."""
    sizes = [b - a for a, b in chunk_bounds(int(nbytes), n)]
    rs = [sizes[(r - s) % n] for s in range(n - 1)]
    ag = [sizes[(r + 1 - s) % n] for s in range(n - 1)]
    return [Collective("sendrecv", float(b), ranks) for b in rs + ag]


class HostLayout:
    """A stand-in communicator for :meth:`Compressor.layout`: size and ranks per host."""

    def __init__(self, size, k):
        self.size, self._k = size, k

    def ranks_per_node(self):
        return self._k


_Layout = HostLayout  # its earlier name


def onebit_collectives(sizes, n, layout="two_stage"):
    """The 1-bit compressed allreduce (:mod:`hvd_quant.core.compressed_allreduce`) of tensors of
    ``sizes`` elements, each padded on its own: DeepSpeed's two stages (an alltoall, an
    allgather), or ``layout="gather"``'s one allgather."""
    D = sum(padded_size(int(c), n) for c in sizes)
    width = D // n // 8
    T = len(sizes)
    if layout == "gather":
        return [Collective("allgather", D / 8 + 4.0 * T, n)]
    return [Collective("alltoall", float(n * (width + 4 * T)), n),
            Collective("allgather", float(width + 4 * T), n)]


# --- bytes -------------------------------------------------------------------------------------
def wire_bytes(colls):
    """Bytes one rank sends for ``colls``."""
    return sum(c.wire_bytes() for c in colls)


def fp32_ring_bytes(numel, world_size):
    """Bytes one rank sends in an fp32 ring allreduce of ``numel`` elements."""
    n = world_size
    return 2.0 * (n - 1) / n * 4 * numel if n > 1 else 0.0


def memory_bytes(method, numel, world_size, ranks_per_node=None, segments=1, options=None):
    """Bytes one rank reads and writes in memory to reduce ``numel`` elements (lower bounds,
    passes over the buffer; network copies belong to the link). A registered compressor
    states its own (:meth:`~hvd_quant.core.compressor.Compressor.memory_bytes`, built as in
    :func:`collectives`: ``ranks_per_node``, ``segments`` and ``options``, its topology,
    choose ``cascading_sign``'s layout, whose folds depend on it)."""
    compressor = compressor_for(method, options)
    if compressor is not None:
        try:
            return compressor.memory_bytes(numel, int(world_size), ranks_per_node, segments)
        except NotImplementedError:
            raise ValueError(f"the cost model does not know {method!r}") from None
    cost = _COSTS.get(method)
    if cost is None:
        raise ValueError(f"the cost model does not know {method!r}")
    return cost.memory_bytes(numel, int(world_size))


def ring_memory_bytes(numel, n):
    """An fp32 ring allreduce's passes: each of its ``2 (n - 1)`` steps reads and writes
    ``1 / n`` of the buffer, twice."""
    return 4.0 * (4.0 * float(numel)) * (n - 1) / n


def sign_feedback_memory_bytes(numel, n):
    """A sign method with error feedback (``ef_sign``, ``marsit``): the sums and bits of
    ``g + e`` in one pass (``2F``), decode and residual in one pass (``4F``), the gathered
    or ring bits."""
    return 4.0 * float(numel) * (6.0 + (2.0 * n - 1.0) / 32.0)


def level_memory_bytes(numel, n):
    """Integer levels on the wire (``global_qsgd``, ``global_qsgd_exp``): quantize and
    decode (``3F``), one byte per element written and read, and the sum's."""
    F, w = 4.0 * float(numel), 1.0 * float(numel)
    return 3.0 * F + 2.0 * w + 4.0 * w * (n - 1) / n


def onebit_memory_bytes(numel, n):
    """The 1-bit compressed allreduce's passes over the padded buffer ``D``."""
    D = 4.0 * padded_size(int(numel), n)
    return 6.0 * D + 2.0 * D / n


# --- time ---------------------------------------------------------------------------------------
@dataclass
class LinkModel:
    """Link figures: seconds of latency per collective and kind, the share of the link
    rate each kind reaches, and the memory bandwidth.

    Attributes
    ----------
    rate_bps : float
        Each host's link rate, bits per second.
    latency0, latency1 : dict kind -> seconds
        ``latency(kind, n) = latency0[kind] + latency1[kind] * (n - 1)``.
    efficiency : dict kind -> fraction of ``rate_bps`` the kind's wire bytes move at.
    memory_bps : float
        Bytes read plus written per second (a copy's bandwidth).
    flops : float
        Floating-point operations per second of a rank (PowerSGD's matrix products).
    sum_s_per_byte : dict dtype -> seconds
        What an allreduce's sum of that dtype costs per byte summed beyond fp32's, which
        the rate already holds (the rate is measured or fitted on fp32 allreduces). A ring
        allreduce sums ``(n - 1) / n`` of its buffer on each rank. Gloo's fp16 sum converts
        each element in software unless it was built with ``GLOO_USE_AVX`` (Horovod's own
        build does not set it; ``scripts/build_horovod.sh`` Fix 9 does): there it took 2.5 to
        4 times fp32's allreduce of the same elements on this project's CPUs.
        :mod:`hvd_quant.compressors.auto` measures it; empty: no dtype costs more.
    source : str
        Where the figures come from (a calibration file, an assumption).
    """
    rate_bps: float
    latency0: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 1e-3))
    latency1: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    efficiency: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 1.0))
    memory_bps: float = 10e9
    source: str = "defaults"
    flops: float = 50e9
    sum_s_per_byte: dict = field(default_factory=dict)

    def latency(self, kind, n):
        return self.latency0[kind] + self.latency1[kind] * max(0, n - 1)

    def collective_s(self, c):
        """Seconds of one collective on its critical path."""
        if c.ranks <= 1:
            return 0.0
        seconds = self.latency(c.kind, c.ranks) + 8.0 * c.wire_bytes() / (self.efficiency[c.kind] * self.rate_bps)
        if c.kind == "allreduce":
            seconds += self.sum_s_per_byte.get(c.dtype, 0.0) * (c.ranks - 1) / c.ranks * c.nbytes
        return seconds

    def with_rate(self, rate_bps):
        return LinkModel(rate_bps, dict(self.latency0), dict(self.latency1), dict(self.efficiency),
                         self.memory_bps, self.source, self.flops, dict(self.sum_s_per_byte))

    def to_dict(self):
        return {"rate_bps": self.rate_bps, "latency0": self.latency0, "latency1": self.latency1,
                "efficiency": self.efficiency, "memory_bps": self.memory_bps, "source": self.source,
                "flops": self.flops, "sum_s_per_byte": self.sum_s_per_byte}

    @classmethod
    def from_dict(cls, d):
        return cls(float(d["rate_bps"]), dict(d["latency0"]), dict(d["latency1"]), dict(d["efficiency"]),
                   float(d.get("memory_bps", 10e9)), str(d.get("source", "")), float(d.get("flops", 50e9)),
                   {k: float(v) for k, v in d.get("sum_s_per_byte", {}).items()})

    @classmethod
    def datacenter(cls, rate_bps, message_s=25e-6, horovod_s=1e-3, memory_bps=20e9, efficiency=None,
                   flops=50e9):
        """Assumed figures for real hosts (one rank per host, its own cores): every
        collective pays Horovod's negotiation ``horovod_s`` (half a 1 ms cycle on average
        plus the cycle's cross-rank exchange, itself a Gloo ring) and Gloo's sequential
        messages at ``message_s`` each: a ring allreduce ``4 (n - 1)`` (two segments per
        chunk), an allgather ``n - 1``, an alltoall and a hop ``2 (n - 1)`` (the split
        sizes, then the data; the ``n - 1`` sends of each go out at once, but each costs
        the sender its own overhead). The negotiation's exchange adds ``4 (n - 1)``
        messages to every kind. ``efficiency`` defaults to the shares measured on the
        emulated links (:data:`EMULATED_EFFICIENCY`)."""
        steps = {"allreduce": 4, "allgather": 1, "alltoall": 2, "sendrecv": 2}
        return cls(float(rate_bps), dict.fromkeys(KINDS, horovod_s),
                   {k: (steps[k] + 4) * message_s for k in KINDS},
                   dict(efficiency or EMULATED_EFFICIENCY), memory_bps,
                   f"assumed: {message_s * 1e6:g} us per message, {horovod_s * 1e3:g} ms per "
                   f"collective for Horovod's negotiation, {memory_bps / 1e9:g} GB/s memory, "
                   f"{flops / 1e9:g} GFLOP/s", flops)


#: Share of the link rate each kind reached on the emulated 100 Mbit/s links, fitted over
#: 2, 4, 8 and 16 hosts of one rank (phase-2 calibration of issue 42, 2026-11-28, no other
#: job on the machine: benchmarks/reference/scaling-2026-11-28-phase2/calibration). Not the
#: 1 Gbit/s figures: there 16 ranks on 2 cores could not fill the link with 1 MB messages
#: (an allreduce reached 0.14 of the rate at 16 hosts), which measures the CPUs, not Gloo.
EMULATED_EFFICIENCY = {"allreduce": 0.97, "allgather": 0.84, "alltoall": 0.57, "sendrecv": 0.79}


def comm_seconds(colls, link):
    """Seconds of ``colls`` on the critical path (overlapped ones left out)."""
    return sum(link.collective_s(c) for c in colls if not c.overlapped)


def bucket_numels(numel, bucket_mb=25):
    """Buffer sizes of a model of ``numel`` float32 parameters split into buckets of at most
    ``bucket_mb`` MB, assuming tensors small enough to fill them. 25 MB is DDP's size and
    the torch optimizer's default bucket from a 200 MB model up (and for every model before
    2026-12-07, which the measurements this model is validated on used); below 200 MB its
    default is an eighth of the model
    (:func:`hvd_quant.torch.distributed_optimizer.default_bucket_mb`): pass that layout
    as ``buckets=`` to :func:`predict`."""
    cap = int(bucket_mb * 2 ** 20 // 4)
    full, rest = divmod(int(numel), cap)
    return [cap] * full + ([rest] if rest else [])


def predict(method, numel, world_size, link, ranks_per_node=None, segments=1, buckets=None,
            options=None):
    """Predicted seconds of one step's reduction, per rank: ``{"comm_s", "memory_s",
    "total_s", "bytes", "collectives"}`` summed over ``buckets`` (buffer sizes; default:
    :func:`bucket_numels` of ``numel``, one bucket for the 1-bit optimizers' group).
    ``segments``: tensors in the model, shared out over the buckets."""
    cost = _COSTS.get(method)
    if buckets is None:
        one = cost is not None and cost.one_buffer  # one parameter group / one DDP bucket
        buckets = [int(numel)] if one else bucket_numels(numel)
    total = float(sum(buckets))
    comm = memory = nbytes = 0.0
    count = 0
    for b in buckets:
        seg = max(1, round(segments * b / total)) if total else 1
        colls = collectives(method, b, world_size, ranks_per_node, seg, options)
        comm += comm_seconds(colls, link)
        nbytes += wire_bytes(colls)
        count += sum(1 for c in colls if not c.overlapped)
        memory += memory_bytes(method, b, world_size, ranks_per_node, seg, options) / link.memory_bps
    compute = 0.0
    if cost is not None and cost.flops is not None:
        compute = cost.flops(dict(options or {})) / link.flops
    return {"comm_s": comm, "memory_s": memory, "compute_s": compute, "total_s": comm + memory + compute,
            "bytes": nbytes, "collectives": count}


def flat_methods(world_size, numel, ranks_per_node=None, candidates=None):
    """The methods whose bytes per rank at ``world_size`` stay at most half of an fp32 ring
    allreduce's: the ones whose wire does not grow with ``n`` (named by
    :mod:`hvd_quant.core.scale_check`'s warning)."""
    ref = fp32_ring_bytes(numel, world_size)
    out = []
    for m in known_methods() if candidates is None else candidates:
        if not compresses(m):
            continue
        try:
            b = wire_bytes(collectives(m, numel, world_size, ranks_per_node))
        except ValueError:
            continue
        if b <= 0.5 * ref:
            out.append(m)
    return out


def crossover_ranks(method, numel, link, baseline="none", ranks=None, ranks_per_node=None):
    """The smallest ``n`` (of ``ranks``, default powers of two and their midpoints from 2
    to 65536) from which ``method`` is predicted slower than ``baseline`` per step, and
    ``None`` if it never is there; plus whether it was faster at the smallest ``n``."""
    if ranks is None:
        ranks = sorted({int(2 ** (e / 2)) for e in range(2, 33)})
    faster_at_start = None
    for n in ranks:
        ours = predict(method, numel, n, link, ranks_per_node)["total_s"]
        ref = predict(baseline, numel, n, link, ranks_per_node)["total_s"]
        if faster_at_start is None:
            faster_at_start = ours < ref
        if (ours < ref) != faster_at_start:
            return n, faster_at_start
    return None, faster_at_start


def ceil_log2(n):
    return max(0, math.ceil(math.log2(n))) if n > 0 else 0
