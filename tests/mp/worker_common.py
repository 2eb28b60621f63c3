"""What the rank-side workers of tests/mp/ share: the framework's Horovod and hvd_quant
modules, a rank's results, each part of which is recorded whether it returns or raises,
and the file each rank writes for the pytest side to judge.

A worker imports it by name (``import worker_common``): Python puts a script's own folder
first on ``sys.path``. tests/mp/mpi_worker.py runs several workers one after the other in
one process (``runpy``), so nothing here reads ``sys.argv`` or keeps state at import: each
worker passes what it was given.
"""

import hashlib
import json
import os
import time
import traceback
from collections import namedtuple
from pathlib import Path

import numpy as np

#: One framework's modules as the workers use them: ``torch`` or ``tf`` (the other None),
#: its Horovod ``hvd``, ``hq`` (hvd_quant's adapter), a ``backend`` instance, the Horovod
#: communicator class ``Comm`` and ``tensor(array)`` (numpy to the framework's tensor).
Framework = namedtuple("Framework", "torch tf hvd hq backend Comm tensor")


def framework(name):
    """Import framework ``name`` (``torch``; anything else is TensorFlow), initialise
    Horovod, and return its :data:`Framework`."""
    if name == "torch":
        import torch
        import horovod.torch as hvd
        import hvd_quant.torch as hq
        from hvd_quant.torch.backend import TorchBackend as Backend
        from hvd_quant.torch.comm import HorovodTorchComm as Comm

        def tensor(a):
            return torch.from_numpy(np.ascontiguousarray(a))
        hvd.init()
        return Framework(torch, None, hvd, hq, Backend(), Comm, tensor)
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import hvd_quant.tensorflow as hq
    from hvd_quant.tensorflow.backend import TFBackend as Backend
    from hvd_quant.tensorflow.comm import HorovodTFComm as Comm

    def tensor(a):
        return tf.constant(a)
    hvd.init()
    return Framework(None, tf, hvd, hq, Backend(), Comm, tensor)


def tf_setup():
    """TensorFlow and its Horovod, initialised, one thread per op pool: every rank of the
    job shares the machine's few cores with the others."""
    import tensorflow as tf
    import horovod.tensorflow as hvd

    hvd.init()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    return tf, hvd


def digest(arrays, dtype=None):
    """A short fingerprint of ``arrays``' values (as ``dtype``, or as they are), for
    comparing ranks and runs bit for bit without shipping the values."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(np.asarray(a, dtype)).tobytes())
    return h.hexdigest()[:16]


def failure(exc, message_chars=None, trace_chars=0):
    """The record of a part that raised ``exc``: its type and message (the first
    ``message_chars``, all if None), and the last ``trace_chars`` of its traceback (none
    if 0). Called from the ``except`` clause."""
    out = {"error": type(exc).__name__, "message": str(exc)[:message_chars]}
    if trace_chars:
        out["trace"] = traceback.format_exc()[-trace_chars:]
    return out


class Results(dict):
    """One rank's results, one entry per part of the worker (plus ``fields``, such as the
    rank and the world size), written to ``OUTDIR/rank{r}.json`` by :meth:`write`.

    :meth:`record` runs a part and stores what it returns, or its :func:`failure`: a part
    that raises is judged by the test, and the worker goes on with the next part, every
    rank having raised at the same collective. ``timing`` says what each part cost, for
    the suite's CI time: ``"stored"`` in ``self["seconds"]``, ``"printed"`` in the job's
    output, or not at all (None)."""

    def __init__(self, message_chars=None, trace_chars=0, timing=None, **fields):
        super().__init__(fields)
        self._limits, self._timing = (message_chars, trace_chars), timing

    def record(self, key, fn):
        start = time.perf_counter()
        try:
            self[key] = fn()
        except Exception as exc:  # recorded for the test to judge
            self[key] = failure(exc, *self._limits)
        seconds = time.perf_counter() - start
        if self._timing == "stored":
            self.setdefault("seconds", {})[key] = round(seconds, 3)
        elif self._timing == "printed":
            print(f"rank {self.get('rank')}: {key} took {seconds:.1f} s", flush=True)

    def write(self, out, rank):
        """``out/rank{rank}.json`` (``out`` made if need be), and a line saying so."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps(self))
        print(f"rank {rank}: wrote {out / f'rank{rank}.json'}")


def kill_second_host_at(step, kill_step, marker):
    """The elastic jobs' failure: the rank whose host is ``127.0.0.1`` (the job's second
    "host") writes ``marker`` and dies at ``kill_step``; the discovery script then lists
    only the first host, and the survivors restore the last commit and go on."""
    if os.environ.get("HOROVOD_HOSTNAME", "") == "127.0.0.1" and step == kill_step:
        Path(marker).write_text("dead")
        os._exit(1)
