"""``auto``: per bucket, the method the cost model predicts cheapest on this link.

``hq.Compression.auto(family="onebit_ef")`` (torch or TensorFlow). The first time an owner
(an optimizer, a tape's variables) reduces on a communicator:

1. **the link is measured**: after an untimed 4-byte allreduce that brings the ranks
   together, the fastest of :data:`LINK_REPEATS` 4-byte allreduces times the latency and
   the fastest of as many allreduces of 1 MB the rate; a copy of 16 MB times the memory
   bandwidth. Where ``fp16`` is a candidate, as many fp16 allreduces of 1 MB time what
   summing fp16 costs beyond fp32 (Gloo converts each element in software unless built
   with ``GLOO_USE_AVX``, which Horovod's own build does not set: 2.5 to 4 times fp32's
   allreduce of the same elements here; ``scripts/build_horovod.sh``, Fix 9). Every rank's
   timings travel by one allgather and the slowest of each is used, so that **every rank
   holds the same figures** (a rank's own timing differs from its peers', and the choice
   below must not);
2. **each bucket gets its method**, the first time it is reduced: among ``none`` (fp32)
   and the family's methods, the one whose predicted time
   (:func:`hvd_quant.core.costmodel.predict`: its collectives at the measured latency and
   rate, the shares of the rate each collective kind reached on the emulated links, its
   passes over memory) is smallest for this bucket's size and tensors at this world
   size. Small buckets stay fp32 where one collective's latency outweighs what fewer
   bytes save. Rank 0 logs the choice with every candidate's predicted time (the
   ``hvd_quant`` logger, at INFO); :meth:`AutoCompressor.choices` returns them.

Families: ``"onebit_ef"`` (1 bit per element with error feedback: ``ef_sign``, ``marsit``,
``onebit``), ``"unbiased"`` (``global_qsgd``, and ``global_qsgd_exp`` up to its 104
ranks), ``"any"`` (those and ``fp16``), ``"no_feedback"`` (``"any"`` without error
feedback: ``fp16`` and the unbiased ones); fp32 is always a candidate. The default,
``family=None``, is ``"any"``, and ``"no_feedback"`` when ``hq.DistributedOptimizer`` (torch
or Keras) wraps an adaptive optimizer (:meth:`AutoCompressor.for_adaptive_optimizer`):
error feedback flattens Adam's per-element normalisation (:mod:`hvd_quant.core.adaptive_check`).

The choice depends only on what every rank shares (the gathered timings, the world size,
the bucket's sizes), so every rank issues the same collectives. It is made again after
the world changes size (an elastic reset). The chosen method keeps its state in the
owner's store as it would alone (``ef_sign`` and ``marsit`` share the key ``residual``;
``onebit``'s error buffers are buffer slots), so checkpoints work as for that method.

``link=`` (a :class:`~hvd_quant.core.costmodel.LinkModel`, the same on every rank) skips
the measurement and chooses on those figures: the choice is then the same in every run
(a test that compares two runs bit for bit, a link known from
``benchmarks/costmodel_calibrate.py``).

Caveat: the model's error was measured on the emulated cluster (issue 42,
docs/benchmarks/scaling.md); where it misjudges, the choice may be the second best.
"""

import functools
import logging
import time
import weakref
from contextlib import nullcontext

import numpy as np

from ..core import costmodel
from ..core.compressor import Compressor, get
from ..core.guard import default_error_bound
from ..core.compressed_allreduce import padded_size
from ..core.metrics import untimed

log = logging.getLogger("hvd_quant")

#: The candidates of each family (``none``, fp32, is always one too).
FAMILIES = {"onebit_ef": ("ef_sign", "marsit", "onebit"),
            "unbiased": ("global_qsgd", "global_qsgd_exp"),
            "any": ("fp16", "ef_sign", "marsit", "onebit", "global_qsgd", "global_qsgd_exp"),
            "no_feedback": ("fp16", "global_qsgd", "global_qsgd_exp")}

PROBE_BYTES = 1 << 20
COPY_BYTES = 16 << 20
#: Timed repeats of the latency and the rate collectives, the fastest kept: a link's
#: noise only ever adds time. Timed once, one 1 MB allreduce made the link look 1.5 to 2
#: times slower than Horovod fp32's step implied in some runs on the emulated cluster at
#: 1 Gbit/s (docs/guide/monitoring.md, "Checked against measured step times").
LINK_REPEATS = 3


def link_from_timings(latency_s, probe_s, copy_s, n, probe16_s=None, probe_bytes=PROBE_BYTES,
                      copy_bytes=COPY_BYTES):
    """A :class:`~hvd_quant.core.costmodel.LinkModel` from the slowest rank's timings: the
    4-byte allreduce's ``latency_s`` (every kind's latency), the rate that makes an
    allreduce of ``probe_bytes`` take ``probe_s`` at the allreduce's calibrated share of
    the rate, the copy bandwidth (read + write) of ``copy_bytes`` in ``copy_s``, and, given
    ``probe16_s`` (an fp16 allreduce of as many bytes), the fp16 sum's cost beyond fp32's
    per byte summed (:attr:`~hvd_quant.core.costmodel.LinkModel.sum_s_per_byte`)."""
    eff = dict(costmodel.EMULATED_EFFICIENCY)
    wire = 2.0 * (n - 1) / n * probe_bytes
    moving = max(probe_s - latency_s, 1e-6)
    rate = 8.0 * wire / moving / eff["allreduce"]
    sums = {}
    if probe16_s is not None and n > 1:
        # Same bytes on the wire, so the difference is the sums': each rank sums (n - 1) / n
        # of the buffer. Never below fp32's: noise only ever adds time.
        sums["float16"] = max(0.0, probe16_s - probe_s) / ((n - 1) / n * probe_bytes)
    return costmodel.LinkModel(rate, dict.fromkeys(costmodel.KINDS, float(latency_s)),
                               dict.fromkeys(costmodel.KINDS, 0.0), eff,
                               2.0 * copy_bytes / max(copy_s, 1e-9), "measured at start (auto)",
                               sum_s_per_byte=sums)


def measure_link(B, comm, prefix="hvd_quant.auto", fp16=False):
    """The link figures every rank shares (module docstring, 1.): each rank's timings,
    gathered, the slowest. Every rank of ``comm`` must call it at the same point, with the
    same ``fp16`` (also time the fp16 sum); its collectives are named ``<prefix>.start``,
    ``.latency``, ``.rate``, ``.fp16`` and ``.timings``."""
    return _gathered_link(B, comm, lambda: local_timings(B, comm, prefix, fp16), prefix)


def _gathered_link(B, comm, timings, prefix):
    n = comm.size
    with getattr(B, "eager_scope", nullcontext)():
        mine = B.constant(np.array(timings(), np.float64), "float64")
        slowest = B.to_numpy(comm.allgather(mine, prefix + ".timings")).reshape(n, -1).max(axis=0)
    return link_from_timings(*(float(v) for v in slowest[:3]), n,
                             probe16_s=float(slowest[3]) if len(slowest) > 3 else None)


def local_timings(B, comm, prefix="hvd_quant.auto", fp16=False):
    """This rank's ``[latency, probe, copy]`` seconds, and ``probe16`` after them with
    ``fp16``: the fastest of :data:`LINK_REPEATS` 4-byte allreduces (after an untimed one
    that brings the ranks together), of as many allreduces of 1 MB, and, with ``fp16``,
    of as many fp16 allreduces of 1 MB (:func:`fp16_probe_values`); a 16 MB copy."""
    tiny, probe = B.zeros(1), B.zeros(PROBE_BYTES // 4)
    B.to_numpy(comm.allreduce(tiny, "sum", prefix + ".start"))
    latency = _fastest_allreduce(B, comm, tiny, prefix + ".latency")
    rate = _fastest_allreduce(B, comm, probe, prefix + ".rate")
    probe16 = []
    if fp16:
        # Values like a gradient's, not zeros: Gloo's software conversion is quicker on zeros.
        # Horovod without Fix 9, 16 MB, beyond fp32: 2.6 ns per byte summed on zeros and 7.7 on
        # these at 2 ranks, 19 and 37 at 8 (benchmarks/reference/ttq-fp16-sum-2026-12-04).
        half = B.cast(B.constant(fp16_probe_values(), "float32"), "float16")
        probe16 = [_fastest_allreduce(B, comm, half, prefix + ".fp16")]
    src = np.ones(COPY_BYTES // 4, np.float32)
    dst = np.empty_like(src)
    # The first copy writes fresh pages and pays their page faults (149 ms against 4.3 for
    # later copies on a cluster host, 2026-12-02): measured so, the memory looked as slow as
    # 0.2 GB/s instead of 7.5, every compressor's passes over memory looked dear, and auto
    # chose fp32 for every bucket at 1 Gbit/s. Time the best of two copies after an untimed one.
    np.copyto(dst, src)
    copies = []
    for _ in range(2):
        t = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t)
    return [latency, rate, min(copies)] + probe16


@functools.lru_cache(maxsize=1)
def fp16_probe_values():
    """What the fp16 probe sums (1 MB of fp16): a fixed draw on the scale of a gradient,
    the same on every rank."""
    return (np.random.default_rng(0).standard_normal(PROBE_BYTES // 2) * 0.01).astype(np.float32)


def _fastest_allreduce(B, comm, x, name):
    """The fastest of :data:`LINK_REPEATS` sum-allreduces of ``x``, named ``<name><i>``."""
    return min(_timed(lambda: B.to_numpy(comm.allreduce(x, "sum", f"{name}{i}"))) for i in range(LINK_REPEATS))


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def choose(candidates, numel, n, link, ranks_per_node=None, segments=1):
    """``(method, {method: predicted seconds})``: the cheapest of ``none`` and
    ``candidates`` for one bucket (ties go to the earlier candidate, ``none`` first)."""
    predicted = {}
    for m in ("none",) + tuple(candidates):
        if m == "global_qsgd_exp" and n > 104:
            continue
        try:
            predicted[m] = costmodel.predict(m, numel, n, link, ranks_per_node, segments,
                                             buckets=[numel])["total_s"]
        except ValueError:
            continue
    best = min(predicted, key=lambda m: predicted[m])
    return best, predicted


class AutoCompressor(Compressor):
    """Per bucket, the cheapest method of ``family`` on this link (module docstring).

    Parameters
    ----------
    family : "onebit_ef", "unbiased", "no_feedback", "any" or None (default)
        ``None``: ``"any"``, and ``"no_feedback"`` (fp16 and the unbiased methods) for an
        adaptive optimizer (Adam and its kin; :meth:`for_adaptive_optimizer`), whose
        per-element normalisation error feedback flattens: with Adam on a real-text
        language model ``ef_sign``, ``auto``'s cheapest choice at 100 Mbit/s, ended 42%
        above fp32's loss, ``global_qsgd`` 3.8% below it (docs/benchmarks/time-to-quality.md).
        A family given explicitly is kept.
    link : :class:`~hvd_quant.core.costmodel.LinkModel` (or a dict of its fields), optional
        The link to choose on instead of measuring it; every rank must pass equal
        figures (they are part of :meth:`options`, which the ranks compare).
    """

    name = "auto"
    stateful = True
    multi_hop = True  # it may choose Marsit's ring
    #: The adapters turn the guard on for auto unless told otherwise (hvd_quant.core.guard):
    #: a bucket whose chosen method strays falls back to fp32.
    guard_by_default = True

    def __init__(self, family=None, link=None):
        if family is not None and family not in FAMILIES:
            raise ValueError(f"auto: family must be one of {', '.join(map(repr, FAMILIES))} or None, "
                             f"got {family!r}")
        self.family_given = family is not None
        family = "any" if family is None else family
        if isinstance(link, dict):  # a handle's config() (Keras get_config) gives its fields
            link = costmodel.LinkModel(**link)
        if link is not None and not isinstance(link, costmodel.LinkModel):
            raise ValueError(f"auto: link must be a hvd_quant.core.costmodel.LinkModel, got {type(link).__name__}")
        self.family, self.link = family, link
        self.candidates = FAMILIES[family]
        self._methods = {m: get(m) for m in ("none",) + self.candidates}
        # A bucket may get a method with error feedback, whose errors run higher: the
        # guard's bound is the loosest of the candidates' (guard.default_error_bound).
        self.guard_error_bound = max(default_error_bound(m) for m in self._methods.values())
        slots = []
        for m in self._methods.values():
            for s in (m.state_slots if m.state_slots is not None else (("residual",) if m.stateful else ())):
                if s not in slots:
                    slots.append(s)
        self.state_slots = tuple(slots)
        self.buffer_slots = tuple(s for m in self._methods.values() for s in m.buffer_slots)
        self._worlds = weakref.WeakKeyDictionary()  # comm -> {"size", "link", "choices"}

    def options(self):
        return {"family": self.family} if self.link is None else {"family": self.family, "link": repr(self.link)}

    def for_adaptive_optimizer(self):
        """For Adam and its kin: the same ``auto`` without the methods that keep error
        feedback (family ``"no_feedback"``), unless a family was given."""
        return self if self.family_given else AutoCompressor("no_feedback", self.link)

    def buffer_state_sizes(self, numel, world_size):
        return {"worker_error": padded_size(numel, world_size),
                "server_error": padded_size(numel, world_size) // world_size,
                "server_scale": 1} if self.buffer_slots else {}

    def validate(self, world_size):
        for m in self._methods.values():
            if m.name != "global_qsgd_exp":
                m.validate(world_size)

    # --- the measurement and the choice ---------------------------------------------------
    def world(self, B, comm):
        """This communicator's measured link and the choices made so far (measured on
        first use, and again when the world changed size)."""
        # Keyed by the owner's communicator, not by the timing wrapper the metrics make
        # for each reduction: keyed by that, every step measured the link and chose again.
        key = untimed(comm)
        entry = self._worlds.get(key)
        if entry is None or entry["size"] != comm.size:
            link = self.link if self.link is not None else self._measure(B, comm)
            entry = {"size": comm.size, "link": link, "choices": {}}
            self._worlds[key] = entry
        return entry

    def _measure(self, B, comm):
        """The link figures every rank shares: each rank's timings, gathered, the slowest."""
        return _gathered_link(B, comm, lambda: self._local_timings(B, comm), "hvd_quant.auto")

    def _local_timings(self, B, comm):
        return local_timings(B, comm, fp16="fp16" in self.candidates)

    def choice(self, B, comm, group, segments):
        entry = self.world(B, comm)
        if group not in entry["choices"]:
            numel = sum(int(c) for _, c in segments)
            k = comm.ranks_per_node() if hasattr(comm, "ranks_per_node") else None
            best, predicted = choose(self.candidates, numel, comm.size, entry["link"], k, len(segments))
            entry["choices"][group] = best
            if comm.rank == 0:
                link = entry["link"]
                log.info(
                    f"hvd_quant auto({self.family}): bucket {group} ({numel:,} elements, {len(segments)} "
                    f"tensors) at {comm.size} ranks, link {link.rate_bps / 1e6:.0f} Mbit/s with "
                    f"{1e3 * link.latency0['allreduce']:.1f} ms per collective, memory "
                    f"{link.memory_bps / 1e9:.1f} GB/s"
                    + "".join(f", {dtype} sum +{1e9 * v:.2g} ns/byte" for dtype, v in link.sum_s_per_byte.items())
                    + "; predicted ms: "
                    + ", ".join(f"{m} {1e3 * s:.1f}" for m, s in sorted(predicted.items(), key=lambda i: i[1]))
                    + f" -> {best}")
        return self._methods[entry["choices"][group]]

    def choices(self, comm):
        """``{bucket name: method}`` chosen so far on ``comm`` (empty before the first
        reduction)."""
        entry = self._worlds.get(untimed(comm))
        return dict(entry["choices"]) if entry else {}

    def reduce(self, x, ctx):
        return self.choice(ctx.backend, ctx.comm, ctx.name, ctx.segments or [("", ctx.backend.numel(x))]) \
            .reduce(x, ctx)

    def wire_bytes(self, numel, world_size, segments=1):
        """Unknown before the link is measured: the most any candidate may send."""
        return max(m.wire_bytes(numel, world_size, segments) for m in self._methods.values())
