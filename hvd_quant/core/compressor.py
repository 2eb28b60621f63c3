"""The framework-agnostic compressor interface.

A :class:`Compressor` is an *algorithm for averaging a flat float32 buffer over ranks*:
it quantizes, runs whatever collectives it needs through a
:class:`~hvd_quant.core.comm.Communicator`, and returns every rank's estimate of the mean.
This is wider than Horovod's ``compress``/``decompress`` pair (which always ends in one
allreduce): Global-QSGD needs a scalar allreduce before quantizing, sign methods need an
allgather or a ring. The framework adapters turn a :class:`Compressor` into Horovod's
interface where that is possible.

Implementations keep no framework imports and no per-rank globals: everything they touch
comes from the :class:`ReduceContext`.

Compressors by name (:func:`register`, :func:`get`, :func:`available`): the table lives
here, at the bottom of the package, and is filled from above (:mod:`hvd_quant.registry`
registers the built-in methods, users register their own), so that the core (the
framework adapters' handles, the cost model) can build a compressor from a user's
``compression="marsit"`` without importing any method's module.
"""

import difflib
import hashlib
import json


def note_scales(comm, backend, scales):
    """A method's report of the scales it sent (``SCALE_FIGURES`` of
    :mod:`hvd_quant.core.metrics`), through the communicator its reduction runs on:
    recorded when that is a measured reduction's timing wrapper (``TimedComm``, which
    carries the reduction's clock), ignored otherwise (metrics off: one attribute
    lookup). The largest and the summed ``|scale|`` stay on the device until the flags
    are read (``OwnerMetrics.snapshot``), so a GPU step gets no host synchronisation."""
    clock = getattr(comm, "clock", None)
    if clock is None:
        return
    magnitudes = backend.abs(backend.cast(backend.reshape(scales, (-1,)), "float32"))
    clock.scales.append((backend.max(magnitudes), backend.sum(magnitudes), int(backend.numel(magnitudes))))


class ReduceContext:
    """What one call of :meth:`Compressor.reduce` may use.

    Attributes
    ----------
    backend : Backend
        Tensor operations for the framework of ``x``.
    comm : Communicator
        Collectives among the ranks that share this buffer.
    name : str
        Prefix for collective names; identical on every rank for the same buffer.
    state : StateView or None
        Persistent per-parameter state of this buffer (``None`` for stateless compressors).
    segments : list of (str, int)
        Parameter names and sizes, in order, that make up the buffer.
    rng : generator
        This rank's random generator (from ``backend.generator``), for stochastic rounding.
    out : float32 tensor of the buffer's length, or None
        Where the result may be written instead of a fresh buffer (the torch optimizer
        passes the fused buffer, often the gradient's own memory, so the result lands in
        ``.grad`` with no 100 MB allocation and copy). It may share memory with ``x``: a
        compressor that writes it must have finished reading ``x`` first. Compressors
        may ignore it; callers must use the returned tensor either way.
    """

    def __init__(self, backend, comm, name, segments, state=None, rng=None, out=None):
        self.backend = backend
        self.comm = comm
        self.name = name
        self.segments = segments
        self.state = state
        self.rng = rng
        self.out = out

    def collective_name(self, phase):
        return f"hvd_quant.{self.name}.{phase}"

    def sent_scales(self, scales):
        """Report the scales this step's estimate is built from, as every rank holds them
        after the collective that brought them, to the owner's metrics
        (:func:`note_scales`; nothing when metrics are off)."""
        note_scales(self.comm, self.backend, scales)


class Compressor:
    """Base class. Subclasses set :attr:`name` and implement :meth:`reduce`.

    Attributes
    ----------
    name : str
        Registry name, e.g. ``"ef_sign"``.
    stateful : bool
        True when the compressor keeps error-feedback or compensation state; such
        compressors need stable parameter names.
    """

    name = "abstract"
    stateful = False
    #: True when the method carries what it threw away into the next step (error
    #: feedback); :mod:`hvd_quant.core.adaptive_check` warns when it feeds Adam and kin.
    error_feedback = False
    #: False for the uncompressed baselines (``none``, ``fp16``): no scale warning, and
    #: never named as a method whose bytes stay flat (:mod:`hvd_quant.core.scale_check`).
    compresses = True
    #: Set (to a dtype name) when the compressor is a plain cast around a sum-allreduce;
    #: Horovod's stock optimizers can then run it with no collectives of our own.
    horovod_wire_dtype = None
    #: True when the reduction runs hop by hop (ring / torus point-to-point transfers).
    #: Such chains must be issued one buffer at a time; Horovod's stock TF tape builds
    #: one reduction per variable that may run concurrently, so it refuses them.
    multi_hop = False
    #: Names of the per-element float32 state tensors (one value per buffer element, saved
    #: per parameter as ``"param/key"``). ``None``: ``("residual",)`` for a stateful
    #: compressor, nothing for a stateless one (see ``CompressorRunner.state_slots``).
    state_slots = None
    #: Names of float32 state tensors kept per *buffer* rather than per element, whose
    #: sizes depend on the world size (:meth:`buffer_state_sizes`), e.g. the 1-bit
    #: allreduce's padded worker error and this rank's chunk of server error. They are
    #: saved whole, tagged with the buffer's parameters, the rank and the world size, and
    #: restored only into the same buffer on the same rank of a world of the same size;
    #: otherwise they restart from zero (see :mod:`hvd_quant.core.state`).
    buffer_slots = ()
    #: The state slot (per element or per buffer) that holds this rank's error-feedback
    #: residual, what it held back from the mean: the metrics' ``residual_norm`` reads it
    #: on probe steps (:mod:`hvd_quant.core.metrics`). A compressor without such a slot
    #: reports none.
    residual_slot = "residual"
    #: True when :meth:`reduce_chunked` pipelines the buffer in chunks, bit-identical to
    #: :meth:`reduce` (:func:`hvd_quant.core.pipeline.chunked_reduce` asks this, and
    #: otherwise runs :meth:`reduce`).
    chunkable = False

    def for_adaptive_optimizer(self):
        """The compressor to run for an adaptive optimizer (Adam and its kin: a per-element
        second moment that error feedback flattens, :mod:`hvd_quant.core.adaptive_check`):
        this one. A compressor that chooses among methods may return one that leaves out
        those with error feedback. The optimizer adapters ask it (``make_runner(adaptive=...)``)."""
        return self

    def buffer_state_sizes(self, numel, world_size):
        """``{key: number of elements}`` of each of :attr:`buffer_slots` for a buffer of
        ``numel`` elements reduced over ``world_size`` ranks."""
        return {}

    def options(self):
        """The options that define this compressor's behaviour (must agree across ranks)."""
        return {}

    def fingerprint(self):
        """A 63-bit integer identifying name and options, for cross-rank agreement checks."""
        blob = json.dumps([self.name, self.options()], sort_keys=True, default=str).encode()
        return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1

    def validate(self, world_size):
        """Raise ``ValueError`` when the options cannot work with ``world_size`` ranks."""

    def layout(self, comm):
        """What this compressor derives from ``comm``'s node layout (e.g. Marsit's torus
        rows with ``topology="auto"``), or ``None`` when nothing. Every rank must derive
        the same: the first-step agreement check compares it across ranks."""
        return None

    def reduce(self, x, ctx):
        """Return every rank's estimate of ``mean_over_ranks(x)`` (flat float32).

        ``x`` is read only: the torch optimizer may pass a view of the gradient itself,
        and the result must be a buffer of its own, not ``x``, or ``ctx.out`` (see
        :class:`ReduceContext`), written only once ``x`` is no longer read."""
        raise NotImplementedError

    def reduce_chunked(self, x, ctx, chunks):
        """:meth:`reduce`, with the collectives cut at the element ranges ``chunks``
        (``[(start, stop)]``, multiples of 8 elements but the last) so that one chunk is
        on the wire while the next is encoded and the previous one decoded
        (:func:`hvd_quant.core.pipeline.pipelined`). The same result, state and random
        stream as :meth:`reduce`, bit for bit. Called only when :attr:`chunkable`; the
        default has nothing to pipeline and runs :meth:`reduce`."""
        return self.reduce(x, ctx)

    def wire_bytes(self, numel, world_size, segments=1):
        """Bytes one rank sends to reduce a buffer of ``numel`` elements (cost model of
        :class:`~hvd_quant.core.comm.WireMeter`)."""
        raise NotImplementedError

    def collectives(self, numel, world_size, ranks_per_node=None, segments=1, rank=0):
        """The collectives rank ``rank`` issues to reduce one buffer of ``numel`` elements in
        ``segments`` tensors at ``world_size > 1`` ranks, ``ranks_per_node`` per host
        (``None``: unknown or one), in the order it issues them: a list of
        :class:`~hvd_quant.core.costmodel.Collective` (the cost model's
        :func:`~hvd_quant.core.costmodel.collectives`; ``tests/test_costmodel.py`` checks
        it against what :meth:`reduce` issues). ``NotImplementedError`` where the method
        has no model."""
        raise NotImplementedError

    def memory_bytes(self, numel, world_size, ranks_per_node=None, segments=1):
        """Bytes one rank reads and writes in memory to reduce ``numel`` elements: the
        method's passes over the buffer, lower bounds (the cost model's
        :func:`~hvd_quant.core.costmodel.memory_bytes`)."""
        raise NotImplementedError

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in sorted(self.options().items()))
        return f"{type(self).__name__}({opts})"


# --- compressors by name ----------------------------------------------------------------------
_REGISTRY = {}


def register(cls):
    """Add a :class:`Compressor` subclass under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a compressor named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def available():
    """Sorted names of every registered compressor."""
    return sorted(_REGISTRY)


def registered(name):
    """The class registered under ``name``, or ``None``."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def get(name, **options):
    """A new compressor instance for ``name``, configured with ``options``.

    Raises
    ------
    ValueError
        For an unknown name (the message lists the available ones) or bad options.
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        hint = difflib.get_close_matches(str(name), _REGISTRY, n=1)
        hint = f" Did you mean {hint[0]!r}?" if hint else ""
        raise ValueError(f"unknown compressor {name!r}.{hint} Available: {', '.join(available())}")
    try:
        return _REGISTRY[name](**options)
    except TypeError as exc:
        raise ValueError(f"bad options for compressor {name!r}: {exc}") from None
