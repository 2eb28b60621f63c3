"""Start one process per rank inside the host namespaces; collect, prefix and stream their
output; fail fast; enforce a hard time limit.

Each rank is ``ip netns exec <host-ns> <command>`` in a session of its own, so its whole
process tree can be signalled as a group. The launcher polls the ranks: the first rank
that exits non-zero makes the launcher stop all the others at once (SIGTERM, then SIGKILL
after a grace period), so a failing rank ends the job promptly with its error in the
output instead of leaving the other ranks waiting in a collective. Past the time limit
every rank is killed and :class:`JobTimeout` is raised.
"""

import os
import signal
import subprocess
import sys
import threading
import time


class JobTimeout(TimeoutError):
    """The job ran past its time limit and was killed. ``result`` holds its output."""

    def __init__(self, message, result):
        super().__init__(message)
        self.result = result


class JobFailed(RuntimeError):
    """A rank exited non-zero (raised by ``run(..., check=True)``). ``result`` holds the job."""

    def __init__(self, message, result):
        super().__init__(message)
        self.result = result


class JobResult(subprocess.CompletedProcess):
    """``subprocess.CompletedProcess`` of the whole job, plus per-rank details.

    Attributes
    ----------
    returncode : int
        0 when every rank succeeded; else the exit status of the first rank that failed
        (a rank killed by signal ``s`` reports ``-s``); 124 after a timeout.
    stdout : str
        All ranks' output (stdout and stderr), line by line as it arrived, each line
        prefixed with ``[r<rank>@h<host>]``.
    rank_output : list of str
        Each rank's own output, unprefixed.
    rank_returncodes : list of int or None
        Per rank (``None``: it was still running when the job ended).
    failed_rank : int or None
        The rank whose failure ended the job.
    timed_out : bool
    elapsed : float
        Seconds from the first start to the end of the job.
    """

    def __init__(self, args, returncode, stdout, rank_output, rank_returncodes, failed_rank,
                 timed_out, elapsed):
        super().__init__(args, returncode, stdout, None)
        self.rank_output = rank_output
        self.rank_returncodes = rank_returncodes
        self.failed_rank = failed_rank
        self.timed_out = timed_out
        self.elapsed = elapsed

    def tail(self, lines=60):
        """The last ``lines`` lines of the combined output (for error messages)."""
        return "\n".join(self.stdout.splitlines()[-lines:])


def run_ranks(commands, envs, labels, timeout, stream=None, grace=3.0, poll=0.05):
    """Run ``commands[r]`` with ``envs[r]`` for every rank ``r``; return a :class:`JobResult`.

    Parameters
    ----------
    commands : list of list of str
        Full argument vectors (already wrapped in ``ip netns exec``).
    envs : list of dict
        Complete environments, one per rank.
    labels : list of str
        Output prefixes, one per rank.
    timeout : float
        Hard limit in seconds for the whole job; past it every rank is killed and
        :class:`JobTimeout` is raised.
    stream : file-like or None
        Where to echo prefixed lines as they arrive (e.g. ``sys.stdout``), or nowhere.
    grace : float
        Seconds between SIGTERM and SIGKILL when stopping the remaining ranks.
    """
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    output = _RankOutput(labels, len(commands), stream)
    procs = []
    start = time.monotonic()
    failed_rank, timed_out = None, False
    try:
        _start_ranks(commands, envs, procs, output)
        failed_rank, timed_out = _wait_for_ranks(procs, start, timeout, poll)
    finally:
        # Normal end, failure, timeout or an exception in the launcher (Ctrl-C): every rank
        # still running is stopped, its whole process group included.
        stop_processes(procs, grace=0.0 if timed_out else grace)
        output.join(timeout=5)

    result = _job_result(commands, procs, output, failed_rank, timed_out, start)
    if timed_out:
        raise JobTimeout(f"job exceeded its time limit of {timeout:g}s and was killed\n"
                         + result.tail(), result)
    return result


class _RankOutput:
    """The ranks' output as it arrives: one reader thread per rank appends each line to
    the rank's own list and, prefixed with the rank's label, to the combined list, and
    echoes it to ``stream`` when there is one. One lock orders the combined lines."""

    def __init__(self, labels, ranks, stream):
        self.labels = labels
        self.stream = stream
        self.lock = threading.Lock()
        self.combined = []
        self.per_rank = [[] for _ in range(ranks)]
        self.readers = []

    def read(self, rank, pipe):
        """Start the thread that reads ``pipe`` (rank ``rank``'s stdout) to its end."""
        reader = threading.Thread(target=self._pump, args=(rank, pipe), daemon=True)
        reader.start()
        self.readers.append(reader)

    def _pump(self, rank, pipe):
        for line in iter(pipe.readline, ""):
            line = line.rstrip("\n")
            with self.lock:
                self.per_rank[rank].append(line)
                self.combined.append(f"[{self.labels[rank]}] {line}")
                if self.stream is not None:
                    try:
                        self.stream.write(f"[{self.labels[rank]}] {line}\n")
                        self.stream.flush()
                    except (OSError, ValueError):  # a closed or broken echo must not stop the job
                        pass
        pipe.close()

    def join(self, timeout):
        for reader in self.readers:
            reader.join(timeout=timeout)


def _start_ranks(commands, envs, procs, output):
    """Start every rank in a session of its own (so its process group can be signalled),
    stdout and stderr into one pipe read by ``output``. Each process is appended to
    ``procs`` as soon as it starts, so the caller stops the ones already running if a
    later start fails."""
    for rank, (cmd, env) in enumerate(zip(commands, envs)):
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True)
        procs.append(proc)
        output.read(rank, proc.stdout)


def _wait_for_ranks(procs, start, timeout, poll):
    """Poll the ranks every ``poll`` seconds until all succeed, one fails (fail fast: the
    lowest rank among those found failed in the same poll) or ``timeout`` seconds have
    passed since ``start``. Returns ``(failed_rank, timed_out)``."""
    while True:
        codes = [p.poll() for p in procs]
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            return bad[0], False
        if all(c == 0 for c in codes):
            return None, False
        if time.monotonic() - start > timeout:
            return None, True
        time.sleep(poll)


def _job_result(commands, procs, output, failed_rank, timed_out, start):
    """The :class:`JobResult` of a finished job: 124 after a timeout, else the failed
    rank's exit status, else 0."""
    codes = [p.returncode for p in procs]
    if timed_out:
        returncode = 124
    elif failed_rank is not None:
        returncode = codes[failed_rank]
    else:
        returncode = 0
    with output.lock:
        combined = output.combined
        return JobResult(commands, returncode, "\n".join(combined) + ("\n" if combined else ""),
                         ["\n".join(lines) for lines in output.per_rank], codes, failed_rank,
                         timed_out, time.monotonic() - start)


def stop_processes(procs, grace=3.0):
    """SIGTERM each live process group, wait up to ``grace`` s, then SIGKILL what is left;
    reap everything. Safe on processes that already exited."""
    live = [p for p in procs if p.poll() is None]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if sig == signal.SIGTERM and grace <= 0:
            continue
        for p in live:
            _signal_group(p, sig)
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            live = [p for p in live if p.poll() is None]
            if live:
                time.sleep(0.05)
    for p in procs:
        # Stragglers the rank left in its group (a finished rank's children) go too.
        _signal_group(p, signal.SIGKILL)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            print(f"[cluster] warning: process {p.pid} did not exit after SIGKILL", file=sys.stderr)


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
