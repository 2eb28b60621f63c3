"""Runs a :class:`Compressor` on one rank: state, randomness and cross-rank agreement.

Both framework adapters hold one :class:`CompressorRunner` per compressor instance; the
adapter supplies the backend and the communicator, the runner does the rest the same way
for torch and TensorFlow.
"""

import hashlib

import numpy as np

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
    """One rank's execution state for a compressor.

    Parameters
    ----------
    compressor : Compressor
    backend : Backend
    seed : int
        Base seed; rank ``r`` draws from ``seed + 1_000_003 * r`` so ranks are independent
        and runs are reproducible.
    """

    def __init__(self, compressor, backend, seed=0):
        self.compressor = compressor
        self.backend = backend
        self.seed = int(seed)
        self.store = StateStore(backend) if compressor.stateful else None
        self._rng = {}
        self._checked = set()

    def rng(self, rank):
        if rank not in self._rng:
            self._rng[rank] = self.backend.generator(self.seed + 1_000_003 * rank)
        return self._rng[rank]

    def check_once(self, comm, key, digests=lambda: (0, 0)):
        """Verify, once per ``key``, that all ranks use the same compressor and options,
        the same parameter structure and the same parameter values.

        ``digests()`` returns ``(structure_digest, value_digest)``; it is called only the
        first time, so hashing the parameters costs nothing on later steps."""
        if key in self._checked:
            return
        self.compressor.validate(comm.size)
        row = np.array([self.compressor.fingerprint(), *digests()], dtype=np.int64)
        gathered = comm.allgather(self.backend.constant(row, "int64"), f"hvd_quant.check.{key}")
        check_agreement(
            self.backend.to_numpy(gathered).reshape(comm.size, 3),
            ["the compressor or its options", "the model's parameter names/shapes/dtypes",
             "the model's parameter values"],
            [f"This rank uses {self.compressor!r}; pass the same compression to every rank.",
             "Build the same model on every rank.",
             "Broadcast them before training: hvd.broadcast_parameters(model.state_dict(), "
             "root_rank=0) for torch, hvd_quant.tensorflow.broadcast_variables(model.variables, "
             "root_rank=0) for TensorFlow (Keras 2 or 3)."])
        self._checked.add(key)

    def reduce(self, flat, comm, group, segments):
        """Mean over ranks of the flat float32 buffer ``flat`` made of ``segments``."""
        state = self.store.view(group, segments) if self.store is not None else None
        ctx = ReduceContext(self.backend, comm, group, segments, state=state, rng=self.rng(comm.rank))
        return self.compressor.reduce(flat, ctx)

    def state_dict(self):
        return self.store.state_dict() if self.store is not None else {}

    def load_state_dict(self, state):
        if self.store is None:
            if state:
                raise ValueError(f"{self.compressor!r} keeps no state, but state was given")
            return
        self.store.load_state_dict(state)
