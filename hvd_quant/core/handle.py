"""What the framework adapters share: a compressor handle and the ``Compression`` namespace.

``hvd_quant.torch.Compression.<name>`` and ``hvd_quant.tensorflow.Compression.<name>`` are
:class:`CompressorHandle` subclasses. The subclasses add only Horovod's
``compress``/``decompress`` pair and the framework's backend.

Handles are configuration
-------------------------
A handle is a compressor name, its options and a seed, like Horovod's stateless
``Compression.fp16``: one handle may be passed to any number of optimizers and tapes.
The state (error feedback, random streams, agreement checks, byte counts) belongs to
whoever *uses* the handle, each in its own :class:`~hvd_quant.core.runner.CompressorRunner`:

* ``hvd_quant.torch.DistributedOptimizer`` and the Keras
  ``hvd_quant.tensorflow.DistributedOptimizer``: the optimizer (:meth:`make_runner`);
* Horovod's stock torch ``hvd.DistributedOptimizer``, which only calls
  ``compress``/``decompress``: that optimizer object, found in the caller's frame;
* TensorFlow gradient tapes (ours, and Horovod's stock tape and tf-keras optimizer), which
  are rebuilt every step: the set of variables being reduced.

The last two are kept here, in a table held weakly by owner (:meth:`owned`), so that a
dead optimizer or model takes its state with it. Within an owner, state is named by
parameter name. :meth:`state_dict` / :meth:`load_state_dict` take the owner.

Handles with equal configurations (framework, name, options, seed) share that table:
``hq.Compression.marsit`` makes a new handle on every access, as code inside a
``tf.function`` step does on every trace (``DistributedGradientTape(tape,
compression=hq.Compression.marsit)``), and the second trace must find the state the first
one created (TensorFlow refuses to create variables again). Configuration is what a handle
is: two equal ones used by the same owner are the same reduction.
"""

import dataclasses
import itertools
import weakref

from .compressor import available, get
from .runner import CompressorRunner

#: Owners are numbered in creation order, the same on every rank (same program); the
#: number prefixes their collective names (see ``CompressorRunner.scope``).
_owner_numbers = itertools.count()

#: Random-stream positions in a flat state dict: ``"hvd_quant.rng/<rank>/calls"``.
RNG_PREFIX = "hvd_quant.rng/"


#: The owner tables of the stock path and the TF tapes, one per handle configuration.
_OWNER_TABLES = {}


def new_scope():
    return f"o{next(_owner_numbers)}"


class Owned:
    """What one owner of a handle holds on the stock path: its runner, communicator and
    the bytes Horovod's own allreduce sent for plain casts (``none``, ``fp16``)."""

    def __init__(self, runner):
        self.runner = runner
        self.comm = None
        self.horovod_bytes = 0.0
        self.anonymous_calls = 0

    @property
    def bytes_sent(self):
        return self.horovod_bytes + (self.comm.meter.bytes_sent if self.comm is not None else 0.0)


class CompressorHandle:
    """A configured compressor as users pass it to ``compression=``: name, options, seed.

    Calling the handle returns a handle with updated options:
    ``Compression.ef_sign()`` or ``Compression.global_qsgd(norm="l2", seed=3)``.
    """

    #: Set by subclasses: ``"torch"`` or ``"tensorflow"`` (for messages).
    framework = None

    def __init__(self, name, seed=0, **options):
        self.algorithm = get(name, **options)  # the algorithm: options only, no state
        self.name = name
        self.seed = seed
        self._options = dict(options)
        # owner key -> (weak refs, Owned); shared by every handle of this configuration
        self._owners = _OWNER_TABLES.setdefault(
            (type(self).__qualname__, name, repr(sorted(self._options.items())), seed), {})
        self._anonymous = None   # Owned for calls with no owner (stateless compressors)

    def make_backend(self):
        raise NotImplementedError

    def __call__(self, **options):
        seed = options.pop("seed", self.seed)
        return type(self)(self.name, seed=seed, **{**self._options, **options})

    def __repr__(self):
        return (f"hvd_quant.{self.framework}.Compression.{self.name}"
                f"{repr(self.algorithm)[len(type(self.algorithm).__name__):]}")

    def config(self):
        """``{"name", "options", "seed"}``: enough to rebuild an equal handle with
        ``Compression.get(name, seed=seed, **options)`` (Keras ``get_config``). Options
        given as dataclasses (``auto``'s ``link``) appear as dicts of their fields, so
        that the config serialises to JSON; the compressors take them back as dicts."""
        options = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in self._options.items()}
        return {"name": self.name, "options": options, "seed": self.seed}

    def algorithm_for(self, adaptive=False):
        """The method an owner's buckets run: ``algorithm``, or for an adaptive optimizer
        (Adam and kin) ``algorithm.for_adaptive_optimizer()``."""
        return self.algorithm.for_adaptive_optimizer() if adaptive else self.algorithm

    def make_runner(self, make_variable=None, strict=None, device=None, adaptive=False):
        """A new runner (fresh state and random streams) for a new owner; ``strict``: see
        :func:`~hvd_quant.core.runner.strict_default`; ``device``: where the runner's
        state lives (a framework that places tensors, torch: ``make_backend(device)``);
        ``adaptive``: the owner is an adaptive optimizer, and the runner runs
        ``algorithm.for_adaptive_optimizer()``."""
        backend = self.make_backend() if device is None else self.make_backend(device)
        return CompressorRunner(self.algorithm_for(adaptive), backend, seed=self.seed,
                                make_variable=make_variable, scope=new_scope(), strict=strict)

    # --- owners of the stock path and the TF tapes ----------------------------------------
    def owned(self, owner):
        """The :class:`Owned` record of ``owner``, created on first use.

        ``owner`` is one object (an optimizer) or a list/tuple of variables (order does not
        matter). ``None`` is the handle itself (calls that name no owner)."""
        if owner is None:
            if self._anonymous is None:
                self._anonymous = Owned(self.make_runner())
            return self._anonymous
        objects = _owner_objects(owner)
        key = tuple(sorted(id(o) for o in objects))
        entry = self._owners.get(key)
        if entry is not None and all(ref() is obj for ref, obj in zip(entry[0], _by_id(objects))):
            return entry[1]
        owned = Owned(self.make_runner())
        self._owners[key] = (_weak_refs(_by_id(objects), self._owners, key, owned), owned)
        return owned

    def _find(self, owner):
        if owner is not None:
            return self.owned(owner)
        live = list(self._live_owners())
        if len(live) == 1:
            return live[0]
        raise ValueError(
            f"{self!r} is used by {len(live)} owners; pass the one you mean: the optimizer "
            "(Horovod's stock torch optimizer) or the list of variables (TensorFlow tapes and "
            "Horovod's tf-keras optimizer), e.g. compression.state_dict(model.trainable_variables)")

    def _live_owners(self):
        for refs, owned in list(self._owners.values()):
            if all(r() is not None for r in refs):
                yield owned
        if self._anonymous is not None:
            yield self._anonymous

    def state_dict(self, owner=None):
        """This rank's state for ``owner`` (see :meth:`owned`): error feedback keyed
        ``"param/key"`` (per-buffer state such as ``onebit``'s error buffers keyed
        ``"hvd_quant.buffer/<layout>/rank<r>of<n>/key"``, see :mod:`hvd_quant.core.state`)
        and random-stream positions keyed ``"hvd_quant.rng/<rank>/calls"``, as numpy arrays. ``owner`` may be left out while the handle has at most one owner."""
        if owner is None and not list(self._live_owners()):
            return {}
        runner = self._find(owner).runner
        out = dict(runner.state_dict())
        for rank, calls in runner.rng_state().items():
            out[f"{RNG_PREFIX}{rank}/calls"] = calls
        return out

    def load_state_dict(self, state, owner=None):
        """Restore :meth:`state_dict` output into ``owner``'s state (before its first step,
        or at any time after). ``owner`` is required unless the handle has one owner."""
        if owner is None and not list(self._live_owners()):
            raise TypeError(f"{self!r}.load_state_dict(state, owner): pass the owner the state "
                            "belongs to (the optimizer, or the list of variables a tape reduces)")
        runner = self._find(owner).runner
        plain, rng = split_rng_state(state)
        runner.load_state_dict(plain)
        runner.load_rng_state(rng)

    @property
    def bytes_sent(self):
        """Bytes this rank sent through this handle on Horovod's stock optimizers and tapes,
        summed over its live owners (cost model of :class:`~hvd_quant.core.comm.WireMeter`;
        under ``tf.function`` counted when the reduction is traced). See
        :meth:`bytes_sent_by` for one owner."""
        return sum(o.bytes_sent for o in self._live_owners())

    def bytes_sent_by(self, owner):
        return self.owned(owner).bytes_sent

    def _count_horovod_cast(self, owned, nbytes, world_size):
        owned.horovod_bytes += 2.0 * (world_size - 1) / world_size * nbytes


def split_rng_state(state):
    """``(state without random-stream entries, {rank: calls})``."""
    plain, rng = {}, {}
    for key, value in state.items():
        if key.startswith(RNG_PREFIX):
            rank = key[len(RNG_PREFIX):].split("/")[0]
            rng[int(rank)] = int(_scalar(value))
        else:
            plain[key] = value
    return plain, rng


def _scalar(value):
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "numpy"):
        return value.numpy()
    return value


def _owner_objects(owner):
    if isinstance(owner, (list, tuple)):
        if not owner:
            raise ValueError("an owner given as variables needs at least one variable")
        return list(owner)
    return [owner]


def _by_id(objects):
    return sorted(objects, key=id)


def _weak_refs(objects, table, key, owned):
    """Weak references that drop ``table[key]`` when any object dies (a model or an
    optimizer that is gone takes its compressor state with it)."""
    def drop(_ref):
        entry = table.get(key)
        if entry is not None and entry[1] is owned:
            del table[key]

    refs = []
    for obj in objects:
        try:
            refs.append(weakref.ref(obj, drop))
        except TypeError:  # not weakly referenceable: keep it alive with its state
            refs.append(lambda obj=obj: obj)
    return refs


class CompressionNamespace:
    """Mirrors Horovod's ``Compression``: ``Compression.none``, ``.fp16`` and one attribute
    per registered compressor, each access a fresh handle; ``Compression.get(name, **options)``."""

    def __init__(self, handle_cls):
        self._handle_cls = handle_cls

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self.get(name)
        except ValueError as exc:
            raise AttributeError(str(exc)) from None

    def __dir__(self):
        return available() + ["get"]

    def get(self, name, **options):
        return self._handle_cls(name, **options)

    def adopt(self, compression, horovod_compression):
        """``compression`` as an hvd_quant handle where it is one of Horovod's own
        ``Compression.none`` / ``Compression.fp16`` (the class, or an instance; pass the
        framework's ``hvd.Compression`` as ``horovod_compression``): ours cast the same
        way, so a Horovod program's ``compression=hvd.Compression.fp16`` keeps working
        when only its optimizer line changes to hvd_quant's. Anything else is returned
        as given."""
        for name in ("none", "fp16"):
            theirs = getattr(horovod_compression, name, None)
            if theirs is not None and (compression is theirs or type(compression) is theirs):
                return self.get(name)
        return compression

    def require(self, compression, horovod_compression, owner, horovods_own, why=""):
        """:meth:`adopt`, then a ``TypeError`` naming ``owner`` unless the result is one of
        this framework's handles: a Horovod compressor of one's own works only in
        ``horovods_own`` (``why``: what of ours it cannot enter)."""
        compression = self.adopt(compression, horovod_compression)
        if not isinstance(compression, self._handle_cls):
            framework = self._handle_cls.__module__.rsplit(".", 1)[0]
            raise TypeError(
                f"{owner} needs an hvd_quant compressor ({framework}.Compression.<name>), got "
                f"{compression!r}. Horovod's Compression.none and .fp16 are taken as ours; a "
                f"Horovod compressor of your own works only in {horovods_own}{why}")
        return compression
