"""The import-time environment check (hvd_quant/_requirements.py) and the one log line
that says why the fused kernels are off."""

import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hvd_quant import _requirements as req
from hvd_quant.kernels import threads

ROOT = Path(__file__).resolve().parent.parent
TESTED = {"numpy": "2.4.6", "torch": "2.13.0+cpu", "tensorflow": "2.21.0", "keras": "3.15.1",
          "horovod": "0.28.1", "horovod.torch": "0.28.1", "horovod.tensorflow": "0.28.1"}


@pytest.fixture
def fake(monkeypatch):
    """Fake modules and numba metadata: ``fake(torch="2.1.0", numba=None, ...)``; a module
    given as ``ImportError("...")`` fails to import, one left out of TESTED is missing."""
    monkeypatch.setattr(req, "_checked", {})
    monkeypatch.setattr(req, "_warned", set())
    for var in ("HVD_QUANT_KERNELS", "HVD_QUANT_IGNORE_VERSIONS", *threads.RANK_VARS):
        monkeypatch.delenv(var, raising=False)
    imported = []

    def setup(numba="0.68.1", **versions):
        table = dict(TESTED, **{k.replace("__", "."): v for k, v in versions.items()})

        def fake_import(name):
            imported.append(name)
            value = table.get(name)
            if value is None:
                raise ImportError(f"No module named {name!r}")
            if isinstance(value, Exception):
                raise value
            return types.SimpleNamespace(__version__=value)

        monkeypatch.setattr(req, "_import", fake_import)
        monkeypatch.setattr(req, "installed_version", lambda dist: numba if dist == "numba" else None)
        return imported
    return setup


def error(framework):
    with pytest.raises(ImportError) as info:
        req.check(framework)
    return str(info.value)


def error_with(fake, framework, **versions):
    fake(**versions)
    return error(framework)


# --- versions ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("2.13.0+cpu", (2, 13, 0)), ("2.19.0rc1", (2, 19, 0)), ("0.28.1", (0, 28, 1)),
    ("2.14.0a0+git1234abc", (2, 14, 0)), ("3", (3,)), ("v1.2", (1, 2)), ("unknown", None), ("", None),
])
def test_release_numbers(text, expected):
    assert req.release(text) == expected


@pytest.mark.parametrize("name, version, expected", [
    ("torch", "2.4.0", "ok"), ("torch", "2.3.1", "old"), ("torch", "2.15.0+cu128", "ok"),
    ("torch", "3.0.0", "new"), ("keras", "3.15.1", "ok"), ("keras", "3.16.0", "new"),
    ("keras", "3.7.0", "old"), ("keras", "2.15.0", "old"), ("horovod", "0.28.0", "old"),
    ("horovod", "0.29.0", "new"), ("numpy", "1.26.4", "old"), ("numba", "0.60.0", "ok"),
    ("numba", "0.59.1", "old"), ("tensorflow", "2.18.0", "ok"), ("tensorflow", "2.17.1", "old"),
    ("torch", "nightly", "unknown"),
])
def test_verdict(name, version, expected):
    assert req.verdict(name, version) == expected


def test_pyproject_minima_match_the_check():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {d.split(">=")[0].strip(): d.split(">=")[1].strip() for d in meta["dependencies"]}
    assert deps == {"numpy": req.REQUIREMENTS["numpy"].minimum, "numba": req.REQUIREMENTS["numba"].minimum}
    # The frameworks and Horovod are checked at import, never installed by pip.
    everything = " ".join(meta["dependencies"] + sum(meta.get("optional-dependencies", {}).values(), []))
    for name in ("torch", "tensorflow", "horovod", "keras"):
        assert name not in everything


# --- the real environment ------------------------------------------------------------------------
def test_this_environment_passes_without_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(req, "_checked", {})
    monkeypatch.setattr(req, "_warned", set())
    with caplog.at_level(logging.DEBUG, logger="hvd_quant"):
        req.check("torch")
        req.check("tensorflow")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert req._checked == {"torch": None, "tensorflow": None}
    lines = req.report()
    assert [line.split()[0] for line in lines] == list(req.REQUIREMENTS)
    assert all(line.split()[2] == "ok" for line in lines), lines


def test_unknown_framework():
    with pytest.raises(ValueError, match="'torch' or 'tensorflow'"):
        req.check("mxnet")


# --- too old, missing, built without the framework -------------------------------------------------
def test_too_old_framework_names_package_version_and_range(fake):
    imported = fake(torch="2.1.2+cu121")
    text = error("torch")
    assert "hvd_quant.torch cannot be used in this environment" in text
    assert "torch 2.1.2+cu121 is too old: hvd_quant needs torch>=2.4 (tested with 2.13.0)" in text
    # With the framework too old, Horovod's torch ops are not tried: their error would mislead.
    assert "horovod.torch" not in imported


def test_every_problem_in_one_error(fake):
    fake(numpy="1.26.4", tensorflow="2.16.1", keras="3.3.3", horovod="0.27.0")
    text = error("tensorflow")
    for part in ("numpy 1.26.4 is too old", "numpy>=2.0", "tensorflow 2.16.1 is too old",
                 "tensorflow>=2.18", "keras 3.3.3 is too old", "keras>=3.8", "horovod 0.27.0 is too old",
                 "horovod>=0.28.1"):
        assert part in text
    lines = text.splitlines()
    assert len(lines) == 6  # the headline, one line per problem, the way around it
    assert lines[-1].startswith("(HVD_QUANT_IGNORE_VERSIONS=1 goes on")


def test_keras_2_is_refused(fake):
    assert "keras 2.15.0 is too old: hvd_quant needs keras>=3.8" in error_with(fake, "tensorflow", keras="2.15.0")


def test_missing_framework(fake):
    text = error_with(fake, "torch", torch=None)
    assert "torch is not importable (No module named 'torch')" in text
    assert "torch>=2.4" in text
    assert "HVD_QUANT_IGNORE_VERSIONS" not in text  # no use when a package is missing


def test_missing_horovod(fake):
    text = error_with(fake, "tensorflow", horovod=None)
    assert "Horovod is not importable" in text
    assert "built with TensorFlow support" in text and "HOROVOD_WITH_TENSORFLOW=1" in text


@pytest.mark.parametrize("framework, switch", [("torch", "HOROVOD_WITH_PYTORCH=1"),
                                               ("tensorflow", "HOROVOD_WITH_TENSORFLOW=1")])
def test_horovod_built_without_the_framework(fake, framework, switch):
    failure = ImportError(f"Extension horovod.{framework} has not been built: /x/mpi_lib.so not found\n"
                          "If this is not expected, reinstall Horovod with ...")
    text = error_with(fake, framework, **{f"horovod__{framework}": failure})
    assert f"horovod 0.28.1 is installed, but 'import horovod.{framework}' failed: Extension " in text
    assert switch in text and "horovodrun --check-build" in text
    assert "reinstall Horovod with" not in text  # the first line of Horovod's message only


def test_horovod_built_against_another_torch(fake):
    text = error_with(fake, "torch", horovod__torch=ImportError(
        "/site-packages/horovod/torch/mpi_lib_v2.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"))
    assert "undefined symbol" in text and "rebuild is needed after the framework is upgraded" in text


# --- numba -----------------------------------------------------------------------------------------
def test_missing_numba_is_not_an_import_error(fake, caplog):
    fake(numba=None)
    with caplog.at_level(logging.DEBUG, logger="hvd_quant"):
        req.check("torch")  # the kernels say why they are off when first used
    assert not caplog.records


def test_numba_too_old(fake):
    text = error_with(fake, "torch", numba="0.58.1")
    assert "numba 0.58.1 is too old: hvd_quant needs numba>=0.60" in text
    assert "HVD_QUANT_KERNELS=0" in text


def test_numba_not_checked_with_the_kernels_off(fake, monkeypatch):
    fake(numba="0.50.0")
    monkeypatch.setenv("HVD_QUANT_KERNELS", "0")
    req.check("torch")


# --- newer than tested, and the escape hatch -------------------------------------------------------
def test_newer_than_tested_warns_once_on_rank_0(fake, caplog):
    fake(keras="3.16.0")
    with caplog.at_level(logging.DEBUG, logger="hvd_quant"):
        req.check("tensorflow")
        req._checked.clear()
        req.check("tensorflow")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "keras 3.16.0 is newer than hvd_quant was tested with" in message
    assert "needs keras>=3.8, tested with 3.15.1, untested from 3.16 on" in message


def test_newer_than_tested_is_debug_on_other_ranks(fake, caplog, monkeypatch):
    fake(horovod="0.29.0", horovod__torch="0.29.0")
    monkeypatch.setenv("HOROVOD_RANK", "3")
    with caplog.at_level(logging.DEBUG, logger="hvd_quant"):
        req.check("torch")
    assert [r.levelno for r in caplog.records if "newer" in r.getMessage()] == [logging.DEBUG]


def test_ignore_versions_turns_too_old_into_a_warning(fake, caplog, monkeypatch):
    fake(torch="2.3.1")
    monkeypatch.setenv("HVD_QUANT_IGNORE_VERSIONS", "1")
    with caplog.at_level(logging.WARNING, logger="hvd_quant"):
        req.check("torch")
    assert "torch 2.3.1 is too old" in caplog.text and "going on anyway" in caplog.text
    # A missing package still raises: nothing to try.
    req._checked.clear()
    fake(torch=None)
    assert "torch is not importable" in error("torch")


def test_torch_without_horovod_is_a_message_not_an_error(fake):
    """Issue 55: hvd_quant.torch imports without Horovod (its torch.distributed paths work);
    the check hands back why Horovod cannot be used, for the entry points to raise."""
    fake(horovod=None)
    why = req.check("torch", horovod_optional=True)
    assert "Horovod is not importable" in why and "horovod>=0.28.1" in why
    assert req.check("torch", horovod_optional=True) == why  # cached
    with pytest.raises(ImportError, match="Horovod is not importable"):
        req.check("torch")  # an adapter that needs Horovod still raises
    req._checked.clear()
    fake(horovod=None, torch="2.3.1")
    assert "torch 2.3.1 is too old" in error("torch")  # the framework's own problems still raise


def test_unreadable_version_is_not_checked(fake):
    fake(torch="unknown")
    req.check("torch")


def test_the_adapters_run_the_check():
    for framework in ("torch", "tensorflow"):
        source = (ROOT / "hvd_quant" / framework / "__init__.py").read_text()
        assert f'_check_requirements("{framework}"' in source
        assert source.index("_check_requirements(") < source.index("from .backend import")


# --- the fused kernels' log line without numba --------------------------------------------------
_NO_NUMBA = r"""
import sys


class NoNumba:  # numba (and llvmlite) unimportable, as if they were not installed
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("numba", "llvmlite"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, NoNumba())
import torch
import horovod.torch as hvd
import hvd_quant.torch as hq
import hvd_quant.tensorflow as hqt
from hvd_quant import kernels
hvd.init()
model = torch.nn.Linear(4, 2)
for compression in (hq.Compression.ef_sign, hq.Compression.marsit):   # two set-ups
    opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), compression=compression)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
one_bit = hq.ZeroOneAdam(model.parameters(), lr=1e-3, named_parameters=model.named_parameters())
tf_compression = hqt.Compression.ef_sign            # the TensorFlow adapter's set-up
tf_compression.prepare()
print("ENABLED", kernels.enabled(), "|", kernels.why_disabled())
"""


@pytest.mark.full
def test_without_numba_one_line_says_why(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("HVD_QUANT_KERNELS", "PYTHONPATH") and not k.startswith("HOROVOD_")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    out = subprocess.run([sys.executable, "-c", _NO_NUMBA], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ENABLED False | numba is not importable" in out.stdout
    lines = [line for line in out.stderr.splitlines() if "fused CPU kernels off" in line]
    assert len(lines) == 1, out.stderr[-3000:]
    assert "numba is not importable" in lines[0] and "pip install 'numba>=0.60'" in lines[0]
