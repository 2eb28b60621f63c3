"""What hvd_quant needs from the environment it is imported into, checked when an adapter
(``hvd_quant.torch``, ``hvd_quant.tensorflow``) is imported.

hvd_quant is installed into environments that already hold a framework and a Horovod
built against it (usually by the user: Horovod compiles its framework ops against the
framework's headers). So pip does not install the framework or Horovod for us
(``pyproject.toml`` lists only numpy and numba): an install must never replace the user's
torch or TensorFlow (a GPU build, a second TensorFlow next to ``tensorflow-cpu``) or try to
compile Horovod. This module checks them at import instead and raises one
:class:`ImportError` that names every package that is missing or too old, the version
found and the range needed. A version newer than the range hvd_quant relies on (see
``warn_from`` below) only logs one warning per process, on rank 0.

``HVD_QUANT_IGNORE_VERSIONS=1`` turns "too old" into that warning as well (to try an
untested combination at your own risk); a missing package or a Horovod without the
framework's ops still raises.

numba is the one dependency that is optional at run time: without it the generic path
runs, several times slower, and :func:`hvd_quant.kernels.enabled` logs why once per
process when the first optimizer, tape or compressor is set up. A numba that is installed
but too old raises here (it would fail later, inside a training step). Its version is read
from the package metadata, never by importing it: the kernels' thread policy must be set
before numba is first imported (:mod:`hvd_quant.kernels.threads`).

What each bound is based on (``tested``: this project's environment, ``scripts/bootstrap.sh``,
where the whole test suite runs on Python 3.11; "expected": not run here):

=========== ========= ========== ========= =====================================================
package     minimum   tested     warn from why the minimum / the warning
=========== ========= ========== ========= =====================================================
numpy       2.0       2.4.6      3         numpy 2 semantics (NEP 50 scalar promotion) in the
                                           numpy oracle and kernels' callers; 2.0.2 ran the
                                           kernel tests (with numba 0.60.0)
numba       0.60      0.68.1     1         first numba for numpy 2; 0.60.0 passed
                                           tests/test_kernels.py; the kernels use only njit,
                                           prange and set_num_threads
torch       2.4       2.13.0     3         torch.amp.GradScaler("cpu") (2.3) subclassed at
                                           import; first torch built for numpy 2 (2.4).
                                           Expected, not tested, from 2.4 to 2.12; only public
                                           API plus GradScaler's ``_per_optimizer_states``
tensorflow  2.18      2.21.0     3         Keras 3 by default (2.16) and numpy 2 (2.18).
                                           Expected, not tested, from 2.18 to 2.20
keras       3.8       3.15.1     3.16      the Keras 3 adapter relies on Keras internals
                                           (LossScaleOptimizer's apply path, the TensorFlow
                                           train step that JitCompileCallback mirrors, which
                                           has its 3.8 form); newer minors may move them
horovod     0.28.1    0.28.1     0.29      the last release (master also says 0.28.1); the
                                           first with torch 2 support is 0.28.0, and it needs
                                           the same build fixes as 0.28.1
=========== ========= ========== ========= =====================================================

``pyproject.toml``'s ``numpy`` and ``numba`` minima are the same (a test checks it).
"""

import importlib
import importlib.metadata
import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger("hvd_quant")


@dataclass(frozen=True)
class Requirement:
    """One package hvd_quant needs: ``minimum`` <= version, tested at ``tested``; from
    ``warn_from`` on (when set) it is newer than hvd_quant is known to work with."""
    name: str
    minimum: str
    tested: str
    warn_from: str = None
    hint: str = ""  # how to get it, for the error message

    def describe(self):
        return (f"needs {self.name}>={self.minimum}, tested with {self.tested}"
                + (f", untested from {self.warn_from} on" if self.warn_from else ""))


_PIP = "pip install -U"
_HOROVOD_BUILD = ("build Horovod from source with the framework already installed, e.g. "
                  "HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 "
                  "pip install --no-cache-dir --no-binary=horovod --no-build-isolation 'horovod>=0.28.1' "
                  "(hvd_quant's README lists the fixes current frameworks need)")

REQUIREMENTS = {
    "numpy": Requirement("numpy", "2.0", "2.4.6", "3", f"{_PIP} 'numpy>=2.0'"),
    "numba": Requirement("numba", "0.60", "0.68.1", "1",
                         f"{_PIP} 'numba>=0.60', or uninstall numba (or set HVD_QUANT_KERNELS=0) "
                         "to run the generic path, several times slower"),
    "torch": Requirement("torch", "2.4", "2.13.0", "3",
                         "install the torch build for your platform (pytorch.org), then rebuild "
                         "Horovod against it"),
    "tensorflow": Requirement("tensorflow", "2.18", "2.21.0", "3",
                              "install tensorflow (or tensorflow-cpu), then rebuild Horovod against it"),
    "keras": Requirement("keras", "3.8", "3.15.1", "3.16",
                         f"{_PIP} 'keras>=3.8' (hvd_quant.tensorflow is for Keras 3; under "
                         "tf-keras use Horovod's own optimizers with hvd_quant's Compression)"),
    "horovod": Requirement("horovod", "0.28.1", "0.28.1", "0.29", _HOROVOD_BUILD),
}

#: Horovod's build switch for each adapter's framework.
_HOROVOD_SWITCH = {"torch": "HOROVOD_WITH_PYTORCH=1", "tensorflow": "HOROVOD_WITH_TENSORFLOW=1"}
_FRAMEWORK_NAME = {"torch": "PyTorch", "tensorflow": "TensorFlow"}

_checked = {}  # framework -> None, or why Horovod is not usable (horovod_optional)
_warned = set()


def release(version):
    """The release numbers of a version string as a tuple of ints (``"2.13.0+cpu"`` ->
    ``(2, 13, 0)``, ``"2.19.0rc1"`` -> ``(2, 19, 0)``); ``None`` when it has none."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if not match:
        return None
    return tuple(int(part) for part in match.group(1).split("."))


def _cmp(a, b):
    n = max(len(a), len(b))
    a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
    return (a > b) - (a < b)


def verdict(name, version):
    """``"ok"``, ``"old"``, ``"new"`` (at or past ``warn_from``) or ``"unknown"`` (no
    release numbers in ``version``) for package ``name``."""
    req = REQUIREMENTS[name]
    found = release(version)
    if found is None:
        return "unknown"
    if _cmp(found, release(req.minimum)) < 0:
        return "old"
    if req.warn_from and _cmp(found, release(req.warn_from)) >= 0:
        return "new"
    return "ok"


def _too_old(name, version):
    req = REQUIREMENTS[name]
    return (f"{name} {version} is too old: hvd_quant needs {name}>={req.minimum} (tested with "
            f"{req.tested}); {req.hint}")


def _warn_once(key, message, *args):
    if key in _warned:
        return
    _warned.add(key)
    from .kernels.threads import this_rank  # no numba import; launcher variables at import time

    log.log(logging.WARNING if this_rank() == 0 else logging.DEBUG, message, *args)


def _judge(name, version, problems):
    state = verdict(name, version)
    req = REQUIREMENTS[name]
    if state == "old":
        if os.environ.get("HVD_QUANT_IGNORE_VERSIONS") == "1":
            _warn_once((name, version), "hvd_quant: %s (HVD_QUANT_IGNORE_VERSIONS=1: going on anyway)",
                       _too_old(name, version))
        else:
            problems.append(_too_old(name, version))
    elif state == "new":
        _warn_once((name, version), "hvd_quant: %s %s is newer than hvd_quant was tested with (%s): "
                   "expected to work, but untested; please report problems", name, version, req.describe())
    elif state == "unknown":
        log.debug("hvd_quant: cannot read a version from %s %r; not checked", name, version)


def _version_of(module):
    version = getattr(module, "__version__", None)
    return str(version) if version is not None else "unknown"


def installed_version(dist):
    """The installed version of distribution ``dist`` from its metadata (no import), or
    ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import(module):
    return importlib.import_module(module)


def check(framework, horovod_optional=False):
    """Check the environment for the ``framework`` adapter (``"torch"`` or
    ``"tensorflow"``), once per process; raise :class:`ImportError` naming every problem.
    Imports what the adapter imports anyway (numpy, the framework, Keras, Horovod), and
    never numba.

    ``horovod_optional``: Horovod's problems (missing, too old, built without the
    framework) are returned as one message instead of raised, for an adapter that also
    works without it (torch over ``torch.distributed``); ``None`` when Horovod is usable."""
    if framework not in _HOROVOD_SWITCH:
        raise ValueError(f"framework must be 'torch' or 'tensorflow', got {framework!r}")
    if framework in _checked:
        if _checked[framework] is not None and not horovod_optional:
            raise ImportError(_checked[framework])
        return _checked[framework]
    problems = []
    adapter = f"hvd_quant.{framework}"

    _judge("numpy", _version_of(_import("numpy")), problems)

    if os.environ.get("HVD_QUANT_KERNELS", "1") != "0":
        numba_version = installed_version("numba")
        if numba_version is not None:  # missing: the kernels log it when they are first used
            _judge("numba", numba_version, problems)

    modules = ["torch"] if framework == "torch" else ["tensorflow", "keras"]
    before_framework = len(problems)
    for name in modules:
        try:
            module = _import(name)
        except ImportError as exc:
            req = REQUIREMENTS[name]
            problems.append(f"{name} is not importable ({_first_line(exc)}): {adapter} needs "
                            f"{name}>={req.minimum} (tested with {req.tested}); {req.hint}")
            continue
        _judge(name, _version_of(module), problems)
    framework_ok = len(problems) == before_framework

    horovod_ok = False
    before_horovod = len(problems)
    try:
        horovod = _import("horovod")
    except ImportError as exc:
        problems.append(f"Horovod is not importable ({_first_line(exc)}): {adapter} needs "
                        f"horovod>={REQUIREMENTS['horovod'].minimum} built with "
                        f"{_FRAMEWORK_NAME[framework]} support; {_HOROVOD_BUILD}")
    else:
        before = len(problems)
        _judge("horovod", _version_of(horovod), problems)
        horovod_ok = len(problems) == before
    if horovod_ok and framework_ok:  # with the framework missing or too old this would mislead
        try:
            _import(f"horovod.{framework}")
        except (ImportError, OSError) as exc:
            problems.append(
                f"horovod {_version_of(horovod)} is installed, but 'import horovod.{framework}' "
                f"failed: {_first_line(exc)}. Horovod must be built with "
                f"{_FRAMEWORK_NAME[framework]} support ({_HOROVOD_SWITCH[framework]}) against "
                f"the {_FRAMEWORK_NAME[framework]} installed now (a rebuild is needed after the "
                f"framework is upgraded); `horovodrun --check-build` lists what it has")

    horovod_problems = []
    if horovod_optional:
        problems, horovod_problems = problems[:before_horovod], problems[before_horovod:]
    if problems:
        raise ImportError(_message(adapter, problems))
    why = _message(f"{adapter}'s Horovod entry points", horovod_problems) if horovod_problems else None
    _checked[framework] = why
    return why


def _message(what, problems):
    trailer = ("\n(HVD_QUANT_IGNORE_VERSIONS=1 goes on with versions that are too old, "
               "untested, at your own risk)" if any(" is too old: " in p for p in problems) else "")
    return f"{what} cannot be used in this environment:\n" + "\n".join(f"  - {p}" for p in problems) + trailer


def _first_line(exc):
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def report(frameworks=("torch", "tensorflow")):
    """One line per package: the version found (or "missing"), the range hvd_quant
    supports and the version it was tested with. Imports the frameworks, never numba."""
    lines = []
    for name, req in REQUIREMENTS.items():
        if name in ("numpy", "numba", "horovod"):
            version = installed_version(name)
        elif name == "keras":
            version = installed_version("keras") if "tensorflow" in frameworks else None
        elif name in frameworks:
            try:
                version = _version_of(_import(name))
            except ImportError:
                version = None
        else:
            continue
        state = "missing" if version is None else verdict(name, version)
        lines.append(f"{name:<11} {version or '-':<16} {state:<8} {req.describe()}")
    return lines


if __name__ == "__main__":  # python -m hvd_quant._requirements
    print("\n".join(report()))
