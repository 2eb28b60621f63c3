"""Persistent per-parameter state (error feedback, compensation), keyed by parameter name.

Compressors see a :class:`StateView` for the buffer they reduce. A buffer may be one
parameter's gradient or a fusion of many; its *segments* name the parameters it holds, in
order. State is stored flat per buffer (one tensor per key, so the hot path does no
gathering) but exported and imported per parameter, so a checkpoint survives a change of
fusion layout, and restoring never depends on ``id(tensor)``.

Keys in :meth:`StateStore.state_dict` look like ``"fc1.weight/residual"``.

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

import numpy as np


class StateView:
    """The state of one buffer: a handful of named flat tensors of the buffer's length."""

    def __init__(self, store, group, segments):
        self._store = store
        self.group = group
        self.segments = segments
        self.numel = sum(n for _, n in segments)

    def get(self, key, dtype="float32"):
        """The tensor stored under ``key``, created (zeros, or restored from a checkpoint
        loaded earlier) on first use."""
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

    def view(self, group, segments):
        return StateView(self, group, _normalise(segments))

    def allocate(self, group, segments, keys):
        """Create the tensors of buffer ``group`` now: ``keys`` maps key to dtype name.

        Restored values waiting for these parameters (:meth:`load_state_dict` before the
        buffer existed) become the initial values."""
        segments = _normalise(segments)
        for key, dtype in keys.items():
            self._slot(group, segments, key, dtype, allocating=True)

    def variables(self):
        """Every tensor this store holds, in creation order."""
        return [var for slots in self._groups.values() for var in slots["vars"].values()]

    def _slot(self, group, segments, key, dtype, allocating=False):
        slots = self._groups.setdefault(group, {"segments": segments, "vars": {}})
        if slots["segments"] != segments:
            raise ValueError(f"state group {group!r} was created for parameters "
                             f"{[n for n, _ in slots['segments']]}, now used for "
                             f"{[n for n, _ in segments]}")
        var = slots["vars"].get(key)
        if var is None:
            initial = self._initial(segments, key, dtype)
            if self.make_variable is None:
                var = self.backend.variable(initial)
            elif allocating:
                var = self.make_variable(f"{group}_{key}", initial)
            else:
                raise KeyError(
                    f"hvd_quant: state {key!r} of buffer {group!r} was not allocated when its "
                    "owner was built; the compressor must declare it in Compressor.state_slots")
            slots["vars"][key] = var
        return var

    def _initial(self, segments, key, dtype):
        pieces = []
        for pname, n in segments:
            saved = self._restored.pop(f"{pname}/{key}", None)
            if saved is None:
                pieces.append(np.zeros(n, dtype=dtype))
            else:
                saved = np.asarray(saved, dtype=dtype).reshape(-1)
                if saved.size != n:
                    raise ValueError(f"checkpoint state {pname}/{key} has {saved.size} elements, "
                                     f"the parameter has {n}")
                pieces.append(saved)
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)

    def state_dict(self):
        """``{"param/key": numpy array}`` for every parameter with state."""
        out = dict(self._restored)  # restored but not yet used: keep it in the next save
        for slots in self._groups.values():
            for key, var in slots["vars"].items():
                flat = self.backend.to_numpy(self.backend.read(var))
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
        self._restored.update(state)


def _normalise(segments):
    return [(str(n), int(c)) for n, c in segments]


def _to_numpy(value):
    if hasattr(value, "detach"):  # torch
        value = value.detach().cpu()
    elif hasattr(value, "numpy") and not isinstance(value, np.ndarray):  # TF / Keras
        value = value.numpy()
    return np.asarray(value)
