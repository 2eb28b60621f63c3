"""A deadline on every blocking collective, so that a dead or hung peer ends the job.

Horovod over Gloo waits in a collective for as long as its peers take: a rank that hangs
(a deadlock in user code, a stuck file system, a stopped container) leaves every other
rank waiting forever, and Horovod 0.28's stall inspector did not end such a job in our
runs (tests/test_failure_bounds.py). So every collective hvd_quant issues eagerly runs
under a deadline: a daemon thread watches it and, if it has not completed in time, prints
which collective on which rank timed out and ends the process with exit code
:data:`EXIT_CODE`. The launcher (``horovodrun``, or ``mpirun`` under MPI) then terminates
the other ranks, so the whole job ends within the timeout plus the launcher's own reaction
time. Under MPI this deadline is the only bound: MPI's collectives have no timeout.

A rank that dies needs no deadline: its peers' connections break and the launcher ends
the job as soon as one process exits with an error.

The timeout comes from ``HVD_QUANT_COLLECTIVE_TIMEOUT`` (seconds, default
:data:`DEFAULT_TIMEOUT`; ``0`` turns the watchdog off). It bounds one collective, not a
step, so it must exceed the slowest single collective (about 8 s for 100 MB at
100 Mbit/s) plus start-up skew between ranks on the first one. Collectives inside a
TensorFlow graph run after Python has returned; there the Keras callback
``hvd_quant.tensorflow.callbacks.CollectiveWatchdog`` guards whole training batches.
"""

import os
import sys
import threading
import time
from contextlib import contextmanager

DEFAULT_TIMEOUT = 600.0
EXIT_CODE = 124


def default_timeout():
    """Seconds from ``HVD_QUANT_COLLECTIVE_TIMEOUT`` (0 or less: no deadline)."""
    value = os.environ.get("HVD_QUANT_COLLECTIVE_TIMEOUT", "")
    try:
        return float(value) if value else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(f"HVD_QUANT_COLLECTIVE_TIMEOUT must be a number of seconds, got {value!r}") from None


class Watchdog:
    """Ends this process when a guarded wait outlives its deadline (one per process)."""

    def __init__(self, poll=0.5):
        self._poll = poll
        self._lock = threading.Lock()
        self._armed = {}
        self._thread = None

    @contextmanager
    def guard(self, label, timeout=None):
        """Run the body under a deadline of ``timeout`` seconds (default: the
        environment's); ``label`` names the wait in the message."""
        token = self.arm(label, timeout)
        try:
            yield
        finally:
            self.disarm(token)

    def arm(self, label, timeout=None):
        """Start a deadline; returns a token for :meth:`disarm` (``None``: no deadline).
        For waits that do not fit a ``with`` block, such as a Keras training batch."""
        timeout = default_timeout() if timeout is None else float(timeout)
        if timeout <= 0:
            return None
        token = object()
        with self._lock:
            self._armed[token] = (time.monotonic() + timeout, label, timeout)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._watch, name="hvd_quant-watchdog", daemon=True)
                self._thread.start()
        return token

    def disarm(self, token):
        if token is not None:
            with self._lock:
                self._armed.pop(token, None)

    def _watch(self):
        while True:
            time.sleep(self._poll)
            now = time.monotonic()
            with self._lock:
                expired = [v for v in self._armed.values() if v[0] <= now]
            if expired:
                _, label, timeout = expired[0]
                rank = _rank()
                sys.stderr.write(
                    f"hvd_quant: rank {rank}: {label} did not complete within {timeout:g} s; a peer "
                    "rank is dead or hung (HVD_QUANT_COLLECTIVE_TIMEOUT sets this limit). Ending this "
                    f"process (exit code {EXIT_CODE}) so that the job ends.\n")
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(EXIT_CODE)


def _rank():
    """This process's rank for the message: Horovod's, else the launcher's variable
    (``HOROVOD_RANK`` under horovodrun --gloo, ``OMPI_COMM_WORLD_RANK`` under mpirun)."""
    try:
        from ..kernels.threads import this_rank  # only when a watchdog fires
        return this_rank()
    except Exception:  # the message matters more than its rank
        return os.environ.get("HOROVOD_RANK", "?")


#: The process-wide watchdog every communicator uses.
WATCHDOG = Watchdog()
