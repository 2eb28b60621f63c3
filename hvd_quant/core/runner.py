"""Runs a :class:`Compressor` on one rank: state, randomness and cross-rank agreement.

Every owner of a compressor (an optimizer, a tape's variables, a Keras optimizer) holds
its own :class:`CompressorRunner`; the adapter supplies the backend and the communicator,
the runner does the rest the same way for torch and TensorFlow.
"""

import hashlib
import logging
import os
import zlib

import numpy as np

from . import scale_check
from .compressor import ReduceContext
from .metrics import DEFAULT_PROBE_EVERY, OwnerMetrics
from .state import StateStore


class RankDisagreement(RuntimeError):
    """Ranks disagree on something that must be identical (compressor, options, model)."""


log = logging.getLogger("hvd_quant")

#: Environment variable that makes differing parameter values an error (``strict=True``).
STRICT_ENV = "HVD_QUANT_STRICT"


def strict_default(strict=None):
    """``strict`` if given, else whether ``HVD_QUANT_STRICT`` is set to 1/true/yes.

    Strict: ranks that hold different parameter values at the first step raise
    :class:`RankDisagreement` together (what hvd_quant always did before). Not strict (the
    default, as Horovod): training goes on, and rank 0 warns once if the values still
    differ at the next check (:class:`ValueAgreement`)."""
    if strict is not None:
        return bool(strict)
    value = os.environ.get(STRICT_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"{STRICT_ENV} must be 0 or 1, got {value!r}")


#: What the value warning tells the user to do, per framework of the caller.
BROADCAST_HINT = ("Broadcast them before training: hvd.broadcast_parameters(model.state_dict(), "
                  "root_rank=0) for torch, hvd_quant.tensorflow.broadcast_variables(model.variables, "
                  "root_rank=0) for TensorFlow (Keras 2 or 3), or "
                  "hvd_quant.tensorflow.callbacks.BroadcastGlobalVariablesCallback(0) in model.fit.")

_warned_values = [False]  # one warning per process, whatever the number of owners and buffers


class ValueAgreement:
    """Whether the ranks hold the same parameter values, decided as Horovod users need it.

    Horovod averages the gradients whatever values the ranks hold: each rank applies the
    same mean to its own values, which is well defined for every compressor. Programs
    that hold different values at their first step are common and correct: Horovod's
    TensorFlow 2 examples broadcast after the first step (so that the optimizer's slots
    exist), and ``hvd.broadcast_optimizer_state`` takes a step before it broadcasts. A
    program that never broadcasts trains one model per rank, which is almost always a
    mistake.

    So values that differ at an owner's first check are remembered, not refused (unless
    ``strict``: then :class:`RankDisagreement` on every rank together, as before). The
    next check of the same buffer compares them once more (one 8-byte allgather); if they
    still differ, rank 0 logs one warning per process naming the fix. The decision to
    re-check rests on the gathered digests, which every rank holds, so every rank issues
    the same collectives.
    """

    def __init__(self, strict=None):
        self.strict = strict_default(strict)
        self._pending = set()  # keys whose values differed at their first check

    def first(self, key, differ, what):
        """The first check of ``key`` found the ranks' values differ (``differ``: the
        agreement groups, or ``None`` when they agree)."""
        if differ is None:
            return
        if self.strict:
            raise RankDisagreement(f"hvd_quant: ranks disagree on {what} (groups that agree: "
                                   f"{differ}). {BROADCAST_HINT} (strict: unset {STRICT_ENV} or pass "
                                   "strict=False to train anyway, as Horovod does.)")
        self._pending.add(key)

    def pending(self, key):
        return key in self._pending

    def recheck(self, comm, backend, key, values_digest, what, rank):
        """The second check of ``key``: gather the values' digests again and warn (rank 0,
        once per process) if they still differ."""
        self._pending.discard(key)
        gathered = comm.allgather(backend.constant(np.array([values_digest], np.int64), "int64"),
                                  f"hvd_quant.check.{key}.values")
        groups = disagreeing_groups(backend.to_numpy(gathered).reshape(-1))
        if groups is not None:
            warn_different_values(rank, what, groups)

    def clear(self):
        self._pending.clear()


def warn_different_values(rank, what, groups):
    """Rank 0's one warning that the ranks train different models."""
    if rank != 0 or _warned_values[0]:
        return
    _warned_values[0] = True
    log.warning(
        "hvd_quant: the ranks still hold different values of %s after their first step "
        "(groups that agree: %s). Gradients are averaged all the same, as Horovod does, so "
        "each rank applies the same mean to its own values and the ranks train different "
        "models. %s Set %s=1 (or pass strict=True) to make this an error.",
        what, groups, BROADCAST_HINT, STRICT_ENV)


def disagreeing_groups(column):
    """``None`` when every entry of ``column`` (one per rank) is equal, else a text
    listing the groups of ranks that agree."""
    column = np.asarray(column).reshape(-1)
    if not (column != column[0]).any():
        return None
    groups = {}
    for r, v in enumerate(column):
        groups.setdefault(int(v), []).append(r)
    return "; ".join(f"ranks {ranks}" for ranks in groups.values())


def digest63(*parts):
    """A stable 63-bit integer digest of strings/bytes (same value on every rank)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return int.from_bytes(h.digest()[:8], "little") >> 1


def values_digest63(arrays):
    """A 63-bit digest of the bytes of numpy arrays, for the first-step check that every
    rank holds the same parameter values.

    A CRC-32 of each array's bytes (read in place through a memoryview: no copy; zlib's
    CRC runs at several GB/s, 19 ms for 127 MB here, against 124 ms for ``tobytes()`` and
    SHA-256) chained over the arrays, with their sizes, into :func:`digest63`. It catches
    what the check is for, parameters that were never broadcast (any difference in a
    random initialisation), not deliberate collisions."""
    crc, sizes = 0, []
    for a in arrays:
        a = np.ascontiguousarray(a)
        crc = zlib.crc32(memoryview(a.reshape(-1).view(np.uint8)), crc)
        sizes.append(a.nbytes)
    return digest63(crc, *sizes)


def check_agreement(gathered, labels, fix_hints):
    """Raise :class:`RankDisagreement` if the rows of ``gathered`` (one per rank) differ.

    ``labels[j]`` names column ``j``; ``fix_hints[j]`` tells the user what to do about it.
    Every rank sees the same ``gathered``, so every rank raises the same error together:
    no rank is left waiting in a collective.
    """
    gathered = np.asarray(gathered).reshape(len(gathered), -1)
    problems = []
    for j, label in enumerate(labels):
        which = disagreeing_groups(gathered[:, j])
        if which is not None:
            problems.append(f"ranks disagree on {label} (groups that agree: {which}). {fix_hints[j]}")
    if problems:
        raise RankDisagreement("hvd_quant: " + " ".join(problems))


class CompressorRunner:
    """One rank's execution state for a compressor, for one owner.

    The owner is whatever uses the compressor: an optimizer, a gradient tape's variables,
    a Keras optimizer (see :mod:`hvd_quant.core.handle`). Two owners never share a
    runner, so they never share error feedback or random streams.

    Parameters
    ----------
    compressor : Compressor
    backend : Backend
    seed : int
        Base seed; rank ``r`` draws from ``seed + 1_000_003 * r`` so ranks are independent
        and runs are reproducible.
    make_variable : callable, optional
        ``make_variable(name, numpy_initial) -> variable``: the owner creates the state
        tensors (and the random streams' call counters) itself, in :meth:`build`; see
        :class:`~hvd_quant.core.state.StateStore`.
    scope : str
        Prefix of this runner's collective names, so that two owners reducing in one
        TensorFlow graph never issue two collectives with one name. Every rank must give
        the same owner the same scope (the handle numbers owners in creation order).
    strict : bool or None
        Ranks holding different parameter values raise :class:`RankDisagreement` (``True``)
        or train on with one warning (``False``); ``None``: ``HVD_QUANT_STRICT``
        (:class:`ValueAgreement`).
    """

    def __init__(self, compressor, backend, seed=0, *, make_variable=None, scope="", strict=None):
        self.compressor = compressor
        self.backend = backend
        self.seed = int(seed)
        self.make_variable = make_variable
        self.scope = str(scope)
        self.store = StateStore(backend, make_variable) if compressor.stateful else None
        self._rng = {}
        self._rng_restored = {}  # rank -> calls, waiting for the stream
        self._rng_counters = []  # owner-made counters, for variables()
        self._checked = set()
        self.values = ValueAgreement(strict)
        self.metrics = None  # OwnerMetrics once the owner turns them on (observe)

    def place(self, backend):
        """Make the state from now on with ``backend`` (the same framework on another
        device: the stock path learns its gradients' device from the first one). Only
        before the first reduction: state that exists stays where it is, so then
        ``RuntimeError``. State restored from a checkpoint and not yet used is kept (it
        waits as numpy arrays)."""
        if self.store is not None and self.store.variables():
            raise RuntimeError("hvd_quant: the compressor's state exists already; it cannot move "
                               "to another device")
        self.backend = backend
        if self.store is not None:
            self.store.backend = backend

    def state_slots(self):
        """Names of the per-element float32 state tensors the compressor keeps.

        ``Compressor.state_slots`` where the compressor declares it; otherwise
        ``("residual",)`` for a stateful compressor (the one key every stateful
        compressor here uses) and nothing for a stateless one."""
        slots = getattr(self.compressor, "state_slots", None)
        if slots is None:
            slots = ("residual",) if self.compressor.stateful else ()
        return tuple(slots)

    def buffer_sizes(self, segments, world_size):
        """``{key: size}`` of the compressor's buffer slots for a buffer made of
        ``segments`` reduced over ``world_size`` ranks (``Compressor.buffer_state_sizes``)."""
        slots = tuple(getattr(self.compressor, "buffer_slots", ()))
        if not slots:
            return {}
        sizes = self.compressor.buffer_state_sizes(sum(int(n) for _, n in segments), world_size)
        return {k: int(sizes[k]) for k in slots}

    def build(self, rank, groups, size=None):
        """Create the state of ``groups`` (``[(group, segments)]``) and this rank's random
        stream now, e.g. when a Keras optimizer is built, outside any ``tf.function``.
        ``size``, the world size, is needed by compressors with buffer slots (their
        state's size depends on it)."""
        if self.store is not None:
            buffer_slots = tuple(getattr(self.compressor, "buffer_slots", ()))
            if buffer_slots and size is None:
                raise TypeError(f"{self.compressor!r} keeps state whose size depends on the "
                                "world size: CompressorRunner.build(rank, groups, size=...)")
            for group, segments in groups:
                keys = {k: "float32" for k in self.state_slots() + buffer_slots}
                sizes = self.buffer_sizes(segments, size) if buffer_slots else {}
                self.store.allocate(group, segments, keys, buffer_sizes=sizes, world=(rank, size))
        self.rng(rank, creating=True)

    def rng(self, rank, creating=False):
        if rank not in self._rng:
            rng = self.backend.generator(self.seed + 1_000_003 * rank)
            if self.make_variable is not None and hasattr(rng, "counter"):
                if not creating:
                    raise KeyError("hvd_quant: the random stream was not created when its "
                                   "owner was built (CompressorRunner.build)")
                # The owner holds the call counter, so its checkpoints resume the stream.
                rng.counter = self.make_variable(f"rng{rank}_calls", np.zeros((), np.int64))
                self._rng_counters.append(rng.counter)
            if rank in self._rng_restored:
                rng.calls = self._rng_restored.pop(rank)
            self._rng[rank] = rng
        return self._rng[rank]

    def variables(self):
        """The tensors this runner created through ``make_variable`` (per-rank state: never
        broadcast them from one rank to the others)."""
        if self.make_variable is None:
            return []
        return (self.store.variables() if self.store is not None else []) + list(self._rng_counters)

    def collective_prefix(self, group):
        return f"{self.scope}.{group}" if self.scope else str(group)

    def check_once(self, comm, key, digests=lambda: (0, 0)):
        """Verify, once per ``key``, that all ranks use the same compressor and options,
        the same parameter structure and the same node layout (:class:`RankDisagreement`
        on every rank together if not), and compare their parameter values
        (:class:`ValueAgreement`: a warning at the next check if they still differ, an
        error only when strict).

        ``digests()`` returns ``(structure_digest, value_digest)``; it is called on the
        first check only, and once more on the next one if the values differed then, so
        hashing the parameters costs nothing on later steps. The scope is part of the
        structure: ranks that created their owners in different orders are told so
        instead of exchanging gradients of different models."""
        if key in self._checked:
            if self.values.pending(key):
                self.values.recheck(comm, self.backend, key, digests()[1], "the model's parameters",
                                    comm.rank)
            return
        self.compressor.validate(comm.size)
        structure, values = digests()
        if self.scope:
            structure = digest63(structure, self.scope)
        layout = self.compressor.layout(comm)
        row = np.array([self.compressor.fingerprint(), structure, values, digest63(repr(layout))],
                       dtype=np.int64)
        gathered = comm.allgather(self.backend.constant(row, "int64"), f"hvd_quant.check.{key}")
        gathered = self.backend.to_numpy(gathered).reshape(comm.size, 4)
        check_agreement(
            gathered[:, [0, 1, 3]],
            ["the compressor or its options", "the model's parameter names/shapes/dtypes",
             "the node layout the compressor derives"],
            [f"This rank uses {self.compressor!r}; pass the same compression to every rank.",
             "Build the same model on every rank, and create the optimizers/tapes that use "
             "hvd_quant compression in the same order on every rank.",
             f"This rank derives {layout!r} from its host's ranks "
             "(hvd.local_size(), hvd.cross_size()); hosts seem to hold different numbers of "
             "ranks. Choose the topology explicitly, the same on every rank (for Marsit: "
             "topology='ring', or 'torus' with torus_rows)."])
        self.values.first(key, disagreeing_groups(gathered[:, 2]), "the model's parameter values")
        self._checked.add(key)

    def reset_checks(self, world_size=None):
        """Forget which agreement checks ran (:meth:`check_once`), so that they run again
        on the next step, and re-validate the compressor for ``world_size`` ranks when
        given (``ValueError`` if its options cannot work there). Used after an elastic
        reset: ranks that joined run the check, so every survivor must run it too."""
        if world_size is not None:
            self.compressor.validate(int(world_size))
        self._checked.clear()
        self.values.clear()
        if self.metrics is not None:  # ranks that joined count towards probes from zero
            self.metrics.restart()

    def adapt_world(self, rank, size, resize=None):
        """Adapt to a new world after an elastic reset: re-validate the compressor for
        ``size`` ranks (``ValueError`` before anything changed), make the agreement
        checks run again, move the world-dependent buffer slots to rank ``rank`` of
        ``size`` from zeros (:meth:`StateStore.adapt_world`; ``resize`` is the owner's hook
        for fixed-shape tensors) and create this rank's random stream if the rank number
        is new. Per-element error feedback and the streams of known ranks are kept."""
        self.reset_checks(size)
        if self.store is not None:
            self.store.adapt_world((rank, size), lambda segments: self.buffer_sizes(segments, size),
                                   resize)
        # An owner-made stream counter can only be created here, outside any trace.
        self.rng(int(rank), creating=True)

    def context(self, comm, group, segments, out=None):
        """The :class:`ReduceContext` of buffer ``group`` on ``comm``: its state view (with
        the buffer slots sized for ``comm.size`` ranks), collective names and random stream;
        ``out``: where the result may be written (:class:`ReduceContext`)."""
        scale_check.warn_once(self, self.compressor.name, comm, sum(int(c) for _, c in segments),
                              self.compressor.options())
        return ReduceContext(self.backend, comm, self.collective_prefix(group), segments,
                             state=self.state_view(group, segments, comm), rng=self.rng(comm.rank), out=out)

    def state_view(self, group, segments, comm):
        """The state of buffer ``group`` on ``comm``, its buffer slots sized for
        ``comm.size`` ranks (``None`` for a stateless compressor)."""
        if self.store is None:
            return None
        return self.store.view(group, segments, world=(comm.rank, comm.size),
                               buffer_sizes=self.buffer_sizes(segments, comm.size))

    def reduce(self, flat, comm, group, segments, out=None):
        """Mean over ranks of the flat float32 buffer ``flat`` made of ``segments``
        (written into ``out`` where the compressor can, see :class:`ReduceContext`)."""
        return self.compressor.reduce(flat, self.context(comm, group, segments, out=out))

    # --- metrics (hvd_quant.core.metrics) -------------------------------------------------
    def observe(self, probe_every=DEFAULT_PROBE_EVERY, ranges=None, guard=None):
        """Turn this owner's metrics on (:class:`~hvd_quant.core.metrics.OwnerMetrics`;
        ``ranges``: the framework's profiler ranges; ``guard``: a
        :class:`~hvd_quant.core.guard.Guard`, or ``None``) and return them. Only
        reductions run through :meth:`measured` are recorded (and guarded)."""
        self.metrics = OwnerMetrics(probe_every, ranges, guard)
        return self.metrics

    def measured(self, flat, comm, group, segments, reduce, finite_of=None):
        """``reduce(comm)``, the reduction of buffer ``group`` (``flat``, made of
        ``segments``: :meth:`reduce` or a pipelined one), measured when metrics are on
        (:meth:`observe`): then it runs on a timing wrapper of ``comm``, and on probe
        steps with one extra reduce-scatter and allgather around it, on every rank alike.
        ``finite_of(mean)``: how the metrics tell whether the mean is finite, where the
        caller computes that flag anyway (one pass over the mean, not two)."""
        if self.metrics is None:
            return reduce(comm)
        return self.metrics.measure(self, flat, comm, group, segments, reduce, finite_of=finite_of)

    def residual(self, group, segments, comm):
        """This rank's error-feedback residual of buffer ``group`` on ``comm`` (the
        compressor's ``residual_slot``), or ``None`` for compressors that keep none. A
        residual kept per buffer (a buffer slot, padded for the world's ranks) comes
        without its padding."""
        slot = getattr(self.compressor, "residual_slot", "residual")
        buffer_slots = tuple(getattr(self.compressor, "buffer_slots", ()))
        if self.store is None or slot not in self.state_slots() + buffer_slots:
            return None
        view = self.state_view(group, segments, comm)
        residual = view.get(slot)
        return self.backend.slice(residual, 0, view.numel) if slot in buffer_slots else residual

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self):
        """Error-feedback state, ``{"param/key": numpy}`` (empty for stateless compressors)."""
        return self.store.state_dict() if self.store is not None else {}

    def load_state_dict(self, state):
        if self.store is None:
            if state:
                raise ValueError(f"{self.compressor!r} keeps no state, but state was given")
            return
        self.store.load_state_dict(state)

    def rng_state(self):
        """``{rank: calls}`` of the random streams that have drawn: restoring it with
        :meth:`load_rng_state` resumes them exactly (stochastic compressors)."""
        return {int(r): int(g.calls) for r, g in self._rng.items() if int(g.calls)}

    def load_rng_state(self, state):
        for rank, calls in state.items():
            rank = int(rank)
            if rank in self._rng:
                self._rng[rank].calls = int(calls)
            else:
                self._rng_restored[rank] = int(calls)
