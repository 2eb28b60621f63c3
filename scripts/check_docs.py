"""Run every command and snippet the README and the docs show, as a user would type them.

    .venv/bin/python scripts/check_docs.py               # README.md and docs/**/*.md
    .venv/bin/python scripts/check_docs.py --list        # what would run, and what is skipped why
    .venv/bin/python scripts/check_docs.py README.md -k cluster

Every fenced ``bash`` or ``python`` block in those files must be preceded by a marker
comment saying what the check does with it (an unmarked block is an error, so a new
command cannot slip in unchecked)::

    <!-- check: run timeout=120 expect="final test accuracy" args="--epochs 1" -->
    <!-- check: run np=2 prelude=torch_model expect="step 1" -->
    <!-- check: skip needs a GPU -->

``run``
    Bash blocks: each command (a line, with ``\\`` continuations) runs with ``bash -c`` in
    a fresh copy of the repository's tracked files (the working tree as committed or
    modified, nothing untracked: what a clone holds), with the project's ``.venv`` linked
    in, in order, under ``timeout`` seconds for the block (default 120). ``args`` is
    appended to every command: small sizes (``--epochs 1``) for commands whose defaults
    take minutes; the command text itself is never edited. Python blocks run as one
    script (after the named ``prelude`` from :data:`PRELUDES`, which defines what a
    fragment assumes, such as a model), under ``horovodrun -np N --gloo`` when ``np`` is
    given. Python blocks without ``np`` share one interpreter (imports are paid once), each
    in fresh globals; ``fresh`` gives a block its own process (e.g. one that sets
    TensorFlow's threads, which only works before TensorFlow runs anything). ``expect``: a
    text the output must contain (repeatable, ``|``-separated).
``skip``
    Not run; the reason is printed with ``--list`` and in the test's report.

A command shown on several pages (with the same appended ``args``) runs once; each block
still checks its own ``expect`` against that output.

Commands that show ``sudo`` run as written where ``sudo`` exists; where it does not and
the check runs as root (the CI machines), ``sudo`` is dropped, which is what it would
do. ``mpirun`` commands get ``--allow-run-as-root`` when the check runs as root, as the
pages tell root to do. ``needs=mpi``: a block that needs MPI (mpirun, and Horovod built
with it) is skipped, saying so, where there is none, and fails under
``HVD_QUANT_REQUIRE_MPI=1`` (set by .ci/run, which installs OpenMPI). Exit status: 0 when everything marked ``run`` passed, 1 otherwise; every failure
prints the block's file and line, the command, and the output's tail.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!--\s*check:\s*(.*?)\s*-->", re.S)
FENCE = re.compile(r"^(\s*)```\s*([A-Za-z0-9_+-]*)\s*$")
CHECKED_LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "console": "bash", "python": "python",
                     "py": "python"}

#: What a Python fragment of the docs assumes exists, by name (``prelude=NAME``).
_TORCH = """
import torch
import horovod.torch as hvd
import hvd_quant
import hvd_quant.torch as hq
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
base_opt = opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
loss_fn = torch.nn.CrossEntropyLoss()
"""
_KERAS = """
import numpy as np
import keras
import tensorflow as tf
import horovod.tensorflow as hvd
import hvd_quant
import hvd_quant.tensorflow as hq
hvd.init()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(4, activation="softmax")])
x = np.random.default_rng(hvd.rank()).standard_normal((64, 16)).astype("float32")
y = np.random.default_rng(hvd.rank()).integers(0, 4, 64)
loss_fn = keras.losses.SparseCategoricalCrossentropy()
opt = keras.optimizers.SGD(0.05)
"""

#: What a Python fragment of the docs assumes exists, by name (``prelude=NAME``): the
#: imports a page's earlier blocks made (``hvd``, ``hq``, ...), a small model with data
#: (``model``, ``x``, ``y``, ``loss_fn``), and an optimizer to wrap (``opt``, ``base_opt``).
PRELUDES = {
    "torch_model": _TORCH,
    "keras_model": _KERAS,
    # A page that shows both frameworks: torch's names, plus hq_tf and tf.
    "both": _TORCH + "import tensorflow as tf\nimport hvd_quant.tensorflow as hq_tf\n",
}


@dataclass
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    language: str      # "bash" or "python"
    text: str
    directive: str     # "run", "skip" or "" (unmarked)
    options: dict = field(default_factory=dict)
    reason: str = ""

    @property
    def where(self):
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


def parse_marker(text):
    """``"run timeout=60 expect=\\"a b\\""`` -> ``("run", {"timeout": "60", "expect": "a b"}, "")``;
    ``"skip needs a GPU"`` -> ``("skip", {}, "needs a GPU")``."""
    words = shlex.split(text)
    if not words or words[0] not in ("run", "skip"):
        raise ValueError(f"a check marker starts with 'run' or 'skip', got {text!r}")
    if words[0] == "skip":
        reason = text.split(None, 1)[1].strip() if len(words) > 1 else ""
        if not reason:
            raise ValueError("'check: skip' needs a reason")
        return "skip", {}, reason
    options = {}
    for w in words[1:]:
        key, sep, value = w.partition("=")
        if w == "fresh":  # a Python block that needs a process of its own
            options["fresh"] = "1"
            continue
        if not sep or key not in ("timeout", "expect", "args", "np", "prelude", "cwd", "needs"):
            raise ValueError(f"unknown check option {w!r}")
        if key == "needs" and value != "mpi":
            raise ValueError(f"needs= takes 'mpi', got {value!r}")
        options[key] = value
    if "prelude" in options and options["prelude"] not in PRELUDES:
        raise ValueError(f"unknown prelude {options['prelude']!r}; known: {', '.join(PRELUDES)}")
    return "run", options, ""


def blocks(path):
    """Every fenced block of a checked language in ``path``, with its marker."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        language, start = m.group(2).lower(), i
        j = i + 1
        while j < len(lines) and not FENCE.match(lines[j]):
            j += 1
        body = "\n".join(lines[i + 1:j])
        i = j + 1
        if language not in CHECKED_LANGUAGES:
            continue
        # The marker: the nearest comment ending on the lines just above the fence.
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        directive, options, reason = "", {}, ""
        if k >= 0 and lines[k].rstrip().endswith("-->"):
            back = k
            while back > 0 and "<!--" not in lines[back]:
                back -= 1
            marker = MARKER.search("\n".join(lines[back:k + 1]))
            if marker:
                directive, options, reason = parse_marker(marker.group(1))
        out.append(Block(path, start + 1, CHECKED_LANGUAGES[language], body, directive, options, reason))
    return out


def commands(text):
    """The commands of a bash block: lines joined at ``\\`` continuations, without
    comments, blank lines and ``$ `` prompts."""
    out, current = [], ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("$ "):
            line = line.lstrip()[2:]
        if line.endswith("\\"):
            current += line[:-1].strip() + " "
            continue
        out.append((current + line.strip()).strip())
        current = ""
    if current.strip():
        out.append(current.strip())
    return out


def as_run_here(command):
    """The command as this machine runs it: ``sudo`` dropped where there is none and we
    are root (what sudo would do); ``mpirun`` given ``--allow-run-as-root`` when we are
    root (what the pages tell root to add: OpenMPI refuses to start without it)."""
    if command.startswith("sudo ") and shutil.which("sudo") is None and os.geteuid() == 0:
        command = command[len("sudo "):]
    if command.startswith("mpirun ") and os.geteuid() == 0:
        command = "mpirun --allow-run-as-root " + command[len("mpirun "):]
    return command


def mpi_missing(venv):
    """Why ``needs=mpi`` blocks cannot run with ``venv``, or ``None``."""
    if shutil.which("mpirun") is None:
        return "no MPI installed (mpirun not found)"
    proc = subprocess.run([str(Path(venv) / "bin" / "python"), "-c",
                           "import horovod.torch as h; print(h.mpi_built())"], capture_output=True, text=True)
    if proc.stdout.strip() != "True":
        return "Horovod in the environment was built without MPI"
    return None


def with_args(command, args):
    """``command`` with ``args`` appended before any trailing ``# comment`` (which would
    otherwise swallow them)."""
    if not args:
        return command
    words = shlex.split(command, comments=True)
    return shlex.join(words) + " " + args


def make_tree(venv):
    """A temporary copy of the tracked files (as they are in the working tree) with
    ``.venv`` linked in: what a fresh clone holds, plus the environment. The package
    directory is linked rather than copied: the environment's editable install points at
    it anyway, and its compiled-kernel cache (numba's, keyed by the source's path) stays
    valid instead of costing a recompilation in every check."""
    tree = Path(tempfile.mkdtemp(prefix="hvdq-docs-"))
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = ROOT / rel
        if src.is_file() and not rel.startswith("hvd_quant/"):
            dst = tree / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    (tree / "hvd_quant").symlink_to(ROOT / "hvd_quant")
    (tree / ".venv").symlink_to(venv)
    return tree


def run_block(block, tree, default_timeout=120.0, cache=None):
    """Run one marked block in ``tree``; return ``(ok, seconds, message)``. ``cache``
    maps a command (with its appended ``args``) that already passed to its output: a
    command shown on several pages runs once."""
    cache = {} if cache is None else cache
    timeout = float(block.options.get("timeout", default_timeout))
    expect = [e for e in block.options.get("expect", "").split("|") if e]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # the copy's files, as a user's shell would have them
    if block.options.get("needs") == "mpi":  # Horovod's defaults under MPI (tests/conftest.py sets Gloo)
        env.pop("HOROVOD_CONTROLLER", None)
        env.pop("HOROVOD_CPU_OPERATIONS", None)
    cwd = tree / block.options.get("cwd", ".")
    start = time.monotonic()
    output = []
    if block.language == "bash":
        runs = [with_args(as_run_here(c), block.options.get("args", "")) for c in commands(block.text)]
    else:
        script = tree / f".doc_snippet_{block.line}.py"
        script.write_text(PRELUDES.get(block.options.get("prelude"), "") + "\n" + block.text + "\n")
        np_ = block.options.get("np")
        runs = [f"{tree}/.venv/bin/horovodrun -np {np_} -H localhost:{np_} --gloo {tree}/.venv/bin/python {script}"
                if np_ else f"{tree}/.venv/bin/python {script}"]
    for command in runs:
        if command in cache:
            output.append(cache[command])
            continue
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            return False, time.monotonic() - start, f"time limit {timeout:g} s reached before: {command}"
        try:
            proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=left, start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            tail = _tail((exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes)
                         else (exc.stdout or ""))
            return False, time.monotonic() - start, f"timed out after {timeout:g} s: {command}\n{tail}"
        output.append(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            return False, time.monotonic() - start, (f"exit {proc.returncode}: {command}\n"
                                                    + _tail(proc.stdout + proc.stderr))
        if block.language == "bash":
            cache[command] = output[-1]
    text = "\n".join(output)
    missing = [e for e in expect if e not in text]
    if missing:
        return False, time.monotonic() - start, f"output lacks {missing}: {runs}\n{_tail(text)}"
    return True, time.monotonic() - start, ""


BATCH_RUNNER = r"""
import contextlib, io, json, sys, time, traceback
results = []
for path, name in json.loads(sys.argv[1]):
    out = io.StringIO()
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = compile(open(path).read(), name, "exec")
            exec(code, {"__name__": "__main__", "__file__": path})
        ok = True
    except BaseException:
        ok = False
        out.write(traceback.format_exc())
    results.append({"name": name, "ok": ok, "seconds": time.monotonic() - start, "output": out.getvalue()})
    print("@@CHECK@@" + json.dumps(results[-1]), flush=True)
"""


def run_shared(batch, tree, timeout=300.0):
    """Run Python blocks (no ``np``, not ``fresh``) in one interpreter, each in fresh
    globals, in order; return ``{block: (ok, seconds, message)}``."""
    scripts = []
    for b in batch:
        script = tree / f".doc_snippet_{len(scripts)}.py"
        script.write_text(PRELUDES.get(b.options.get("prelude"), "") + "\n" + b.text + "\n")
        scripts.append((str(script), b.where))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    try:
        proc = subprocess.run([str(tree / ".venv" / "bin" / "python"), "-c", BATCH_RUNNER, json.dumps(scripts)],
                              cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        text = proc.stdout
    except subprocess.TimeoutExpired as exc:
        text = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    rows = {json.loads(line[len("@@CHECK@@"):])["name"]: json.loads(line[len("@@CHECK@@"):])
            for line in text.splitlines() if line.startswith("@@CHECK@@")}
    out = {}
    for b in batch:
        row = rows.get(b.where)
        if row is None:
            out[b.where] = (False, 0.0, f"not reached: the shared interpreter ended first\n{_tail(text)}")
            continue
        expect = [e for e in b.options.get("expect", "").split("|") if e]
        missing = [e for e in expect if e not in row["output"]]
        message = "" if row["ok"] and not missing else (
            (f"output lacks {missing}\n" if missing else "") + _tail(row["output"]))
        out[b.where] = (row["ok"] and not missing, row["seconds"], message)
    return out


def _tail(text, lines=25):
    keep = [l for l in text.splitlines() if "I0000" not in l and "absl::InitializeLog" not in l]
    return "\n".join(keep[-lines:])


def documents(paths=None):
    if paths:
        return [Path(p).resolve() for p in paths]
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", help="markdown files (default: README.md and docs/**/*.md)")
    p.add_argument("--list", action="store_true", help="list the blocks and what the check does; run nothing")
    p.add_argument("-k", default="", help="only blocks whose file:line or text contains this")
    p.add_argument("--venv", default=str(ROOT / ".venv"))
    args = p.parse_args(argv)
    found, errors = [], []
    for path in documents(args.files):
        try:
            found += blocks(path)
        except ValueError as exc:
            errors.append(f"{path}: {exc}")
    found = [b for b in found if args.k in b.where or args.k in b.text]
    unmarked = [b for b in found if not b.directive]
    errors += [f"{b.where}: a {b.language} block with no '<!-- check: run|skip ... -->' marker" for b in unmarked]
    if args.list:
        for b in found:
            what = {"run": f"run {b.options}", "skip": f"skip: {b.reason}", "": "UNMARKED"}[b.directive]
            print(f"{b.where:40s} {b.language:6s} {what}")
        print("\n".join(errors), file=sys.stderr)
        return 1 if errors else 0
    tree = make_tree(Path(args.venv).resolve())
    failed = 0
    start = time.monotonic()

    def report(where, ok, seconds, message):
        nonlocal failed
        print(f"[check] {'ok  ' if ok else 'FAIL'} {where} ({seconds:.0f} s)", flush=True)
        if not ok:
            failed += 1
            print(message, flush=True)
    try:
        shared = [b for b in found if b.directive == "run" and b.language == "python"
                  and "np" not in b.options and "fresh" not in b.options and "needs" not in b.options]
        if shared:
            for where, result in run_shared(shared, tree).items():
                report(where, *result)
        cache = {}  # a command shown on several pages runs once
        no_mpi = mpi_missing(args.venv) if any(b.options.get("needs") == "mpi" for b in found) else None
        for b in found:
            if b.directive == "skip":
                print(f"[check] skip {b.where}: {b.reason}", flush=True)
            elif b.directive == "run" and b.options.get("needs") == "mpi" and no_mpi:
                if os.environ.get("HVD_QUANT_REQUIRE_MPI") == "1":
                    report(b.where, False, 0.0, f"needs MPI: {no_mpi} [HVD_QUANT_REQUIRE_MPI=1]")
                else:
                    print(f"[check] skip {b.where}: needs MPI: {no_mpi}", flush=True)
            elif b.directive == "run" and b not in shared:
                report(b.where, *run_block(b, tree, cache=cache))
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    print(f"[check] {len(found)} blocks, {failed} failed, {len(errors)} errors, "
          f"{time.monotonic() - start:.0f} s", flush=True)
    for e in errors:
        print(f"[check] ERROR {e}", flush=True)
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
