"""Persistent per-parameter state (error feedback, compensation), keyed by parameter name.

Compressors see a :class:`StateView` for the buffer they reduce. A buffer may be one
parameter's gradient or a fusion of many; its *segments* name the parameters it holds, in
order. State is stored flat per buffer (one tensor per key, so the hot path does no
gathering) but exported and imported per parameter, so a checkpoint survives a change of
fusion layout, and restoring never depends on ``id(tensor)``.

Keys in :meth:`StateStore.state_dict` look like ``"fc1.weight/residual"``.

Buffer slots: state whose size depends on the world size
--------------------------------------------------------
Some state is not one value per element. The two-stage 1-bit allreduce
(:mod:`hvd_quant.core.compressed_allreduce`) keeps a worker error of the buffer's *padded* length ``D``
(a multiple of ``n * lcm(n, 8)`` for ``n`` ranks) and, on rank ``j``, the server error of
chunk ``j`` (``D / n`` elements). Its elements do not belong to parameters one to one,
and the padding and the chunk change with ``n``. A compressor declares such tensors in
``Compressor.buffer_slots`` and gives their sizes from ``(numel, world_size)`` in
``Compressor.buffer_state_sizes``. They are stored, saved and restored whole, per buffer:

* the key is ``"hvd_quant.buffer/<layout>/rank<r>of<n>/<slot>"``, where ``<layout>`` is a
  digest of the buffer's ``(parameter name, size)`` list (:func:`buffer_key`);
* a saved entry is restored only into a buffer with the same parameters, on the same
  rank, in a world of the same size. An entry for the same parameters saved on another
  rank or at another world size is **dropped**, with a warning, and the slot starts
  from zeros (DeepSpeed itself always drops these buffers when a checkpoint is loaded);
  entries for buffers that do not exist yet wait for them, like per-parameter state;
* if the world size or rank of a live store changes (an elastic job that resized), its
  buffer slots restart from zeros the same way, with a warning. A store whose tensors
  the owner made (Keras optimizer variables, fixed shapes) cannot grow a tensor by
  itself: on first use at another size it raises ``ValueError``. An owner that knows
  the world changed calls :meth:`StateStore.adapt_world` first, with a ``resize`` hook
  that gives back a zero tensor of the new size (the Keras optimizers do this on an
  elastic reset, :mod:`hvd_quant.tensorflow.elastic`).

Who creates the tensors
-----------------------
By default the store creates its tensors itself (``backend.variable``), the first time a
compressor asks for one. An owner that must hold the state in its own objects passes a
``make_variable(name, initial) -> variable`` factory and calls :meth:`StateStore.allocate`
up front. The Keras optimizer does this: its state must be Keras optimizer variables,
created when the optimizer is built (outside any ``tf.function``), so that
``optimizer.variables``, ``model.save`` and ``ModelCheckpoint`` include them. A store
with a factory never creates a tensor lazily: a key that was not allocated is an error
rather than a variable that checkpoints would silently miss.
"""

import hashlib
import warnings

import numpy as np

#: Prefix of the state-dict keys of buffer slots (see the module docstring).
BUFFER_PREFIX = "hvd_quant.buffer/"


class StateView:
    """The state of one buffer: a handful of named flat tensors of the buffer's length,
    and the buffer slots named in ``buffer_sizes`` (``{key: size}``), which belong to
    this rank of a world of ``world = (rank, size)``."""

    def __init__(self, store, group, segments, world=None, buffer_sizes=None):
        self._store = store
        self.group = group
        self.segments = segments
        self.numel = sum(n for _, n in segments)
        self.world = world
        self.buffer_sizes = dict(buffer_sizes or {})

    def get(self, key, dtype="float32"):
        """The tensor stored under ``key``, created (zeros, or restored from a checkpoint
        loaded earlier) on first use."""
        if key in self.buffer_sizes:
            var = self._store._buffer_slot(self.group, self.segments, key, dtype,
                                           self.buffer_sizes[key], self.world)
        else:
            var = self._store._slot(self.group, self.segments, key, dtype)
        return self._store.backend.read(var)

    def set(self, key, value):
        var = self._store._groups[self.group]["vars"][key]
        return self._store.backend.assign(var, value)


class StateStore:
    """All persistent state of one compressor on one rank, for one owner.

    Parameters
    ----------
    backend : Backend
        Reads and writes the tensors (``backend.read`` / ``backend.assign``).
    make_variable : callable, optional
        ``make_variable(name, initial) -> variable``, with ``initial`` a numpy array; the
        variable must work with ``backend.read`` / ``backend.assign``. When given, tensors
        are created only by :meth:`allocate` (see the module docstring).
    """

    def __init__(self, backend, make_variable=None):
        self.backend = backend
        self.make_variable = make_variable
        self._groups = {}
        self._restored = {}  # "param/key" -> numpy array, waiting for its buffer

    def view(self, group, segments, world=None, buffer_sizes=None):
        return StateView(self, group, _normalise(segments), world, buffer_sizes)

    def allocate(self, group, segments, keys, buffer_sizes=None, world=None):
        """Create the tensors of buffer ``group`` now: ``keys`` maps key to dtype name.
        Keys named in ``buffer_sizes`` (``{key: size}``) are buffer slots of this rank of
        ``world = (rank, size)`` (see the module docstring).

        Restored values waiting for these parameters (:meth:`load_state_dict` before the
        buffer existed) become the initial values."""
        segments = _normalise(segments)
        buffer_sizes = buffer_sizes or {}
        for key, dtype in keys.items():
            if key in buffer_sizes:
                self._buffer_slot(group, segments, key, dtype, buffer_sizes[key], world, allocating=True)
            else:
                self._slot(group, segments, key, dtype, allocating=True)

    def adapt_world(self, world, sizes_of, resize=None):
        """Move every buffer's buffer slots to ``world = (rank, size)``, from zeros.

        The same rule as a change seen on first use (module docstring), done up front so
        that an owner with fixed-shape tensors can resize them. ``sizes_of(segments)``
        gives ``{key: size}`` of a buffer's slots in the new world. Tensors the store
        made are dropped (made again, at the new size, on first use); the owner's are
        zeroed in place when their size holds, else replaced by
        ``resize(tensor, size)``, which returns a zero tensor of ``size`` elements (it
        may be the same object, reshaped). Buffers already in ``world`` are untouched:
        a rank whose ``(rank, size)`` did not change keeps its state."""
        world = (int(world[0]), int(world[1]))
        for group, slots in self._groups.items():
            if not slots["buffer"] or slots["world"] in (None, world):
                continue
            sizes = sizes_of(slots["segments"])
            _warn_dropped(slots["segments"], sorted(slots["buffer"]), slots["world"], world)
            for key, (size, dtype) in list(slots["buffer"].items()):
                new = int(sizes[key])
                if self.make_variable is None:
                    del slots["vars"][key]
                    del slots["buffer"][key]
                elif new == size:
                    self.backend.assign(slots["vars"][key], self.backend.zeros(size, dtype))
                elif resize is None:
                    raise ValueError(
                        f"hvd_quant: state {key!r} of buffer {group!r} needs {new} elements "
                        f"as rank {world[0]} of {world[1]}, its owner made it with {size}, "
                        "and no resize hook was given")
                else:
                    slots["vars"][key] = resize(slots["vars"][key], new)
                    slots["buffer"][key] = (new, dtype)
            slots["world"] = world

    def variables(self):
        """Every tensor this store holds, in creation order."""
        return [var for slots in self._groups.values() for var in slots["vars"].values()]

    def _group(self, group, segments):
        slots = self._groups.setdefault(group, {"segments": segments, "vars": {}, "buffer": {},
                                                "world": None})
        if slots["segments"] != segments:
            raise ValueError(f"state group {group!r} was created for parameters "
                             f"{[n for n, _ in slots['segments']]}, now used for "
                             f"{[n for n, _ in segments]}")
        return slots

    def _create(self, group, key, initial, allocating, declared_in):
        if self.make_variable is None:
            return self.backend.variable(initial)
        if allocating:
            return self.make_variable(f"{group}_{key}", initial)
        raise KeyError(
            f"hvd_quant: state {key!r} of buffer {group!r} was not allocated when its "
            f"owner was built; the compressor must declare it in Compressor.{declared_in}")

    def _slot(self, group, segments, key, dtype, allocating=False):
        slots = self._group(group, segments)
        if key in slots["buffer"]:
            raise KeyError(f"hvd_quant: state {key!r} of buffer {group!r} is a buffer slot; "
                           "read it through a view that gives its size")
        var = slots["vars"].get(key)
        if var is None:
            initial = self._initial(segments, key, dtype)
            var = self._create(group, key, initial, allocating, "state_slots")
            slots["vars"][key] = var
        return var

    def _buffer_slot(self, group, segments, key, dtype, size, world, allocating=False):
        """The tensor of buffer slot ``key`` (``size`` elements) of this rank of ``world``."""
        if world is None:
            raise ValueError(f"hvd_quant: buffer slot {key!r} needs the rank and world size")
        world, size = (int(world[0]), int(world[1])), int(size)
        slots = self._group(group, segments)
        if slots["world"] is not None and slots["world"] != world and slots["buffer"]:
            self._restart_buffer_slots(slots, world)
        slots["world"] = world
        var = slots["vars"].get(key)
        if var is None:
            initial = self._initial_buffer(segments, key, dtype, size, world)
            var = self._create(group, key, initial, allocating, "buffer_slots")
            slots["vars"][key] = var
            slots["buffer"][key] = (size, dtype)
        elif slots["buffer"][key][0] != size:
            raise ValueError(
                f"hvd_quant: state {key!r} of buffer {group!r} has {slots['buffer'][key][0]} "
                f"elements, but rank {world[0]} of {world[1]} needs {size}: its owner made it "
                "with a fixed shape for another world size. Build the optimizer again for "
                "the new world size (its error feedback restarts from zero).")
        return var

    def _restart_buffer_slots(self, slots, world):
        """The world changed under a live buffer: its buffer slots restart from zero."""
        _warn_dropped(slots["segments"], sorted(slots["buffer"]), slots["world"], world)
        for key, (size, dtype) in list(slots["buffer"].items()):
            if self.make_variable is None:  # created again, for the new world, on first use
                del slots["vars"][key]
                del slots["buffer"][key]
            else:  # the owner's tensor has a fixed shape: zero it (a size change is refused)
                self.backend.assign(slots["vars"][key], self.backend.zeros(size, dtype))

    def _initial_buffer(self, segments, key, dtype, size, world):
        wanted = buffer_key(segments, world, key)
        saved = self._restored.pop(wanted, None)
        self._drop_stale(segments, world)
        if saved is None:
            return np.zeros(size, dtype=dtype)
        saved = np.asarray(saved, dtype=dtype).reshape(-1)
        if saved.size != size:
            raise ValueError(f"checkpoint state {wanted} has {saved.size} elements, the buffer "
                             f"needs {size}")
        return saved

    def _drop_stale(self, segments, world, state=None):
        """Remove (and warn about) entries of this buffer saved for another rank or world
        size, from ``state`` or the restored entries waiting for their buffer."""
        state = self._restored if state is None else state
        prefix = BUFFER_PREFIX + layout_digest(segments) + "/"
        here = _world_tag(world)
        stale = [k for k in state if k.startswith(prefix) and k[len(prefix):].split("/")[0] != here]
        if stale:
            tags = sorted({k[len(prefix):].split("/")[0] for k in stale})
            _warn_dropped(segments, sorted({k.rsplit("/", 1)[1] for k in stale}), tags, world)
            for k in stale:
                del state[k]

    def _initial(self, segments, key, dtype):
        # One zeroed allocation (calloc: its pages are faulted in by the first write, not
        # here) filled with what a checkpoint restored; concatenating per-parameter zeros
        # instead wrote every byte twice (200 ms for a 127 MB residual at set-up).
        flat = np.zeros(sum(n for _, n in segments), dtype=dtype)
        offset = 0
        for pname, n in segments:
            saved = self._restored.pop(f"{pname}/{key}", None)
            if saved is not None:
                saved = np.asarray(saved, dtype=dtype).reshape(-1)
                if saved.size != n:
                    raise ValueError(f"checkpoint state {pname}/{key} has {saved.size} elements, "
                                     f"the parameter has {n}")
                flat[offset:offset + n] = saved
            offset += n
        return flat

    def state_dict(self):
        """``{"param/key": numpy array}`` for every parameter with state."""
        out = dict(self._restored)  # restored but not yet used: keep it in the next save
        for slots in self._groups.values():
            for key, var in slots["vars"].items():
                flat = self.backend.to_numpy(self.backend.read(var))
                if key in slots["buffer"]:  # whole, tagged with its layout, rank and world
                    out[buffer_key(slots["segments"], slots["world"], key)] = flat.copy()
                    continue
                offset = 0
                for pname, n in slots["segments"]:
                    out[f"{pname}/{key}"] = flat[offset:offset + n].copy()
                    offset += n
        return out

    def load_state_dict(self, state):
        """Restore from :meth:`state_dict` output (values may be numpy, torch or TF)."""
        state = {k: _to_numpy(v) for k, v in state.items()}
        for slots in self._groups.values():
            for key, var in slots["vars"].items():
                if key in slots["buffer"]:
                    full = buffer_key(slots["segments"], slots["world"], key)
                    if full in state:
                        saved = np.asarray(state.pop(full), dtype=slots["buffer"][key][1]).reshape(-1)
                        if saved.size != slots["buffer"][key][0]:
                            raise ValueError(f"checkpoint state {full} has {saved.size} elements, "
                                             f"the buffer needs {slots['buffer'][key][0]}")
                        self.backend.assign(var, self.backend.constant(saved, saved.dtype.name))
                    continue
                names = [f"{p}/{key}" for p, _ in slots["segments"]]
                if any(n in state for n in names):
                    flat = self.backend.to_numpy(self.backend.read(var)).copy()
                    offset = 0
                    for (pname, n), full in zip(slots["segments"], names):
                        if full in state:
                            saved = np.asarray(state.pop(full)).reshape(-1)
                            if saved.size != n:
                                raise ValueError(f"checkpoint state {full} has {saved.size} "
                                                 f"elements, the parameter has {n}")
                            flat[offset:offset + n] = saved
                        offset += n
                    self.backend.assign(var, self.backend.constant(flat, flat.dtype.name))
        for slots in self._groups.values():
            if slots["buffer"]:
                self._drop_stale(slots["segments"], slots["world"], state)
        self._restored.update(state)


def layout_digest(segments):
    """16 hex digits identifying a buffer by its ``(parameter name, size)`` list."""
    h = hashlib.sha256()
    for name, n in _normalise(segments):
        h.update(f"{name}\0{n}\0".encode())
    return h.hexdigest()[:16]


def buffer_key(segments, world, key):
    """The state-dict key of buffer slot ``key`` of the buffer made of ``segments``, on
    rank ``world[0]`` of a world of ``world[1]`` ranks."""
    return f"{BUFFER_PREFIX}{layout_digest(segments)}/{_world_tag(world)}/{key}"


def _world_tag(world):
    return f"rank{int(world[0])}of{int(world[1])}"


def _warn_dropped(segments, keys, saved_for, now):
    names = [n for n, _ in segments]
    label = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    saved = saved_for if isinstance(saved_for, list) else [_world_tag(saved_for)]
    warnings.warn(
        f"hvd_quant: dropped the state {keys} of the buffer of [{label}], kept for "
        f"{', '.join(saved)}; the buffer now runs as {_world_tag(now)}, so it restarts "
        "from zero (this state depends on the rank and the world size)", stacklevel=4)


def _normalise(segments):
    return [(str(n), int(c)) for n, c in segments]


def _to_numpy(value):
    if hasattr(value, "detach"):  # torch
        value = value.detach().cpu()
    elif hasattr(value, "numpy") and not isinstance(value, np.ndarray):  # TF / Keras
        value = value.numpy()
    return np.asarray(value)
