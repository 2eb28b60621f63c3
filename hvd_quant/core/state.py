"""Persistent per-parameter state (error feedback, compensation), keyed by parameter name.

Compressors see a :class:`StateView` for the buffer they reduce. A buffer may be one
parameter's gradient or a fusion of many; its *segments* name the parameters it holds, in
order. State is stored flat per buffer (one tensor per key, so the hot path does no
gathering) but exported and imported per parameter, so a checkpoint survives a change of
fusion layout, and restoring never depends on ``id(tensor)``.

Keys in :meth:`StateStore.state_dict` look like ``"fc1.weight/residual"``.
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
        slots = self._store._groups.setdefault(self.group, {"segments": self.segments, "vars": {}})
        if slots["segments"] != self.segments:
            raise ValueError(f"state group {self.group!r} was created for parameters "
                             f"{[n for n, _ in slots['segments']]}, now used for "
                             f"{[n for n, _ in self.segments]}")
        var = slots["vars"].get(key)
        if var is None:
            var = self._store.backend.variable(self._store._initial(self.segments, key, dtype))
            slots["vars"][key] = var
        return self._store.backend.read(var)

    def set(self, key, value):
        var = self._store._groups[self.group]["vars"][key]
        return self._store.backend.assign(var, value)


class StateStore:
    """All persistent state of one compressor instance on one rank."""

    def __init__(self, backend):
        self.backend = backend
        self._groups = {}
        self._restored = {}  # "param/key" -> numpy array, waiting for its buffer

    def view(self, group, segments):
        return StateView(self, group, [(str(n), int(c)) for n, c in segments])

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
        state = {k: np.asarray(v.detach().cpu() if hasattr(v, "detach") else v) for k, v in state.items()}
        for slots in self._groups.values():
            for key, var in slots["vars"].items():
                names = [f"{p}/{key}" for p, _ in slots["segments"]]
                if any(n in state for n in names):
                    flat = self.backend.to_numpy(self.backend.read(var)).copy()
                    offset = 0
                    for (pname, n), full in zip(slots["segments"], names):
                        if full in state:
                            flat[offset:offset + n] = np.asarray(state.pop(full)).reshape(-1)
                        offset += n
                    self.backend.assign(var, self.backend.constant(flat, flat.dtype.name))
        self._restored.update(state)
