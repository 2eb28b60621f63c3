"""Runs a :class:`Compressor` on one rank: state, randomness and cross-rank agreement.

Every owner of a compressor (an optimizer, a tape's variables, a Keras optimizer) holds
its own :class:`CompressorRunner`; the adapter supplies the backend and the communicator,
the runner does the rest the same way for torch and TensorFlow.
"""

import hashlib
import zlib

import numpy as np

from . import scale_check
from .compressor import ReduceContext
from .state import StateStore


class RankDisagreement(RuntimeError):
    """Ranks disagree on something that must be identical (compressor, options, model)."""


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
        column = gathered[:, j]
        if (column != column[0]).any():
            groups = {}
            for r, v in enumerate(column):
                groups.setdefault(int(v), []).append(r)
            which = "; ".join(f"ranks {ranks}" for ranks in groups.values())
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
    """

    def __init__(self, compressor, backend, seed=0, *, make_variable=None, scope=""):
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
        the same parameter structure and the same parameter values.

        ``digests()`` returns ``(structure_digest, value_digest)``; it is called only the
        first time, so hashing the parameters costs nothing on later steps. The scope is
        part of the structure: ranks that created their owners in different orders are
        told so instead of exchanging gradients of different models."""
        if key in self._checked:
            return
        self.compressor.validate(comm.size)
        structure, values = digests()
        if self.scope:
            structure = digest63(structure, self.scope)
        layout = self.compressor.layout(comm)
        row = np.array([self.compressor.fingerprint(), structure, values, digest63(repr(layout))],
                       dtype=np.int64)
        gathered = comm.allgather(self.backend.constant(row, "int64"), f"hvd_quant.check.{key}")
        check_agreement(
            self.backend.to_numpy(gathered).reshape(comm.size, 4),
            ["the compressor or its options", "the model's parameter names/shapes/dtypes",
             "the model's parameter values", "the node layout the compressor derives"],
            [f"This rank uses {self.compressor!r}; pass the same compression to every rank.",
             "Build the same model on every rank, and create the optimizers/tapes that use "
             "hvd_quant compression in the same order on every rank.",
             "Broadcast them before training: hvd.broadcast_parameters(model.state_dict(), "
             "root_rank=0) for torch, hvd_quant.tensorflow.broadcast_variables(model.variables, "
             "root_rank=0) for TensorFlow (Keras 2 or 3), or "
             "hvd_quant.tensorflow.callbacks.BroadcastGlobalVariablesCallback(0) in model.fit.",
             f"This rank derives {layout!r} from its host's ranks "
             "(hvd.local_size(), hvd.cross_size()); hosts seem to hold different numbers of "
             "ranks. Choose the topology explicitly, the same on every rank (for Marsit: "
             "topology='ring', or 'torus' with torus_rows)."])
        self._checked.add(key)

    def reset_checks(self, world_size=None):
        """Forget which agreement checks ran (:meth:`check_once`), so that they run again
        on the next step, and re-validate the compressor for ``world_size`` ranks when
        given (``ValueError`` if its options cannot work there). Used after an elastic
        reset: ranks that joined run the check, so every survivor must run it too."""
        if world_size is not None:
            self.compressor.validate(int(world_size))
        self._checked.clear()

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
        state = None
        if self.store is not None:
            state = self.store.view(group, segments, world=(comm.rank, comm.size),
                                    buffer_sizes=self.buffer_sizes(segments, comm.size))
        return ReduceContext(self.backend, comm, self.collective_prefix(group), segments, state=state,
                             rng=self.rng(comm.rank), out=out)

    def reduce(self, flat, comm, group, segments, out=None):
        """Mean over ranks of the flat float32 buffer ``flat`` made of ``segments``
        (written into ``out`` where the compressor can, see :class:`ReduceContext`)."""
        return self.compressor.reduce(flat, self.context(comm, group, segments, out=out))

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
