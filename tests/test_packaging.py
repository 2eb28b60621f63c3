"""hvd_quant as a user installs it: ``python -m build`` makes an sdist and a wheel (the wheel
from the sdist, so the sdist holds what a build needs), and the wheel installs into a
fresh virtual environment next to an already built Horovod, then works from outside the
checkout: the adapters import, the fused kernels are on, and a one-rank Horovod reduction
runs through ``hq.DistributedOptimizer``.

The fresh environment sees the torch, TensorFlow, Horovod, numpy and numba that this
project's environment already has, as a user's own environment would: a ``.pth`` file runs
``site.addsitedir`` on a directory of symbolic links to the project environment's
site-packages, less hvd_quant's own (editable) install. Nothing is copied (the frameworks
are gigabytes) and pip installs only into the fresh environment. ``--system-site-packages``
would not do: it shows the base interpreter's packages, not the project environment's.
pip runs with ``--no-index`` and without any configuration file (no find-links, no
index): the wheel's dependencies must already be satisfied, as the README says they are
in a Horovod environment, and nothing is downloaded.

About 20 s here, most of it the kernels compiling for the fresh install (numba's cache
is per installed copy; one serial flavour, HVD_QUANT_THREADS=1) and TensorFlow's import.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAME = "hvd_quant-0.1.0"
# Left out of the copy that is built: version control, environments, build outputs.
_SKIP_TOP = {".git", ".venv", "venv", "build", "dist", "results", ".pytest_cache", ".hypothesis"}


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "HOROVOD_", "HVD_QUANT_")) and k != "PYTHONPATH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               TF_CPP_MIN_LOG_LEVEL="3", **extra)
    return env


def _run(cmd, cwd, env=None, timeout=300):
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or _clean_env(),
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    path = tmp_path_factory.mktemp("packaging")
    yield path
    shutil.rmtree(path, ignore_errors=True)  # the venv and the build


@pytest.fixture(scope="module")
def dists(work):
    """``python -m build --no-isolation`` on a copy of the checkout (the build writes
    hvd_quant.egg-info/ next to the sources): the sdist, then the wheel built from it.
    Without isolation the build uses this environment's setuptools (>= 77, like the
    build-system table); isolated builds take twice as long here (setuptools is
    installed into two fresh environments) and are what pip does for users."""
    src = work / "src"

    def ignore(folder, names):
        top = Path(folder) == ROOT
        return [n for n in names if (top and n in _SKIP_TOP) or n.endswith(".egg-info")]

    shutil.copytree(ROOT, src, ignore=ignore, symlinks=True)
    out = work / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, src], cwd=work)
    sdist, wheel = out / f"{NAME}.tar.gz", out / f"{NAME}-py3-none-any.whl"
    assert sdist.is_file() and wheel.is_file(), sorted(p.name for p in out.iterdir())
    return sdist, wheel


def _package_sources(work):
    src = work / "src"  # the copy that was built (others may be editing the checkout)
    return {p.relative_to(src).as_posix() for p in (src / "hvd_quant").rglob("*.py")}


def test_sdist_holds_the_package_and_what_a_build_needs(dists, work):
    sdist, _ = dists
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    top = {n.split("/")[0] for n in names if not n.startswith(("LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS"))}
    assert top == {"PKG-INFO", "README.md", "pyproject.toml", "MANIFEST.in", "setup.cfg",
                   "hvd_quant", "hvd_quant.egg-info"}, top
    files = {n for n in names if n.startswith("hvd_quant/") and n.endswith(".py")}
    assert files == _package_sources(work)
    junk = [n for n in names if n.endswith((".pyc", ".nbi", ".nbc", ".so")) or "__pycache__" in n]
    assert not junk


def test_wheel_holds_only_the_package(dists, work):
    _, wheel = dists
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(f"{NAME}.dist-info/METADATA").decode()
    assert {n.split("/")[0] for n in names} == {"hvd_quant", f"{NAME}.dist-info"}
    assert {n for n in names if n.startswith("hvd_quant/")} == _package_sources(work)
    requires = sorted(line.split(":", 1)[1].strip() for line in metadata.splitlines()
                      if line.startswith("Requires-Dist:") and "extra ==" not in line)
    assert requires == ["numba>=0.60", "numpy>=2.0"]
    assert "Requires-Python: >=3.10" in metadata


def _make_venv(work, name):
    """A new venv (no pip: this environment's pip installs into it with ``--python``) whose
    site-packages also see this environment's packages, hvd_quant's own install excepted."""
    farm = work / "outer-site-packages"
    if not farm.exists():
        farm.mkdir()
        for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
            if not entry.name.startswith(("hvd_quant", "__editable__.hvd_quant", "__editable___hvd_quant")):
                (farm / entry.name).symlink_to(entry)
    venv = work / name
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=work)
    python = venv / "bin" / "python"
    venv_site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          cwd=work).stdout.strip())
    (venv_site / "_outer_environment.pth").write_text(f"import site; site.addsitedir({str(farm)!r})\n")
    return python, venv_site


def _pip(python, *args, cwd):
    return _run([sys.executable, "-m", "pip", "--python", python, *args], cwd=cwd)


_SMOKE = r"""
import json, logging, sys
import hvd_quant, hvd_quant.torch as hq, hvd_quant.tensorflow as hqt
from hvd_quant import kernels
import torch, horovod.torch as hvd

hvd.init()
model = torch.nn.Linear(4, 2)
with torch.no_grad():
    model.weight.fill_(1.0)
    model.bias.fill_(0.5)
opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(),
                              compression=hq.Compression.ef_sign)
model(torch.ones(3, 4)).sum().backward()   # every gradient entry is 3
opt.step()
print(json.dumps({"file": hvd_quant.__file__, "size": hvd.size(), "enabled": kernels.enabled(),
                  "why": kernels.why_disabled(), "signatures": kernels.loaded_signatures(),
                  "weight": model.weight.flatten().tolist(), "bias": model.bias.tolist(),
                  "tf_compression": type(hqt.Compression.none).__name__}))
"""


# A fresh install compiles its own kernels and imports TensorFlow (~18 s): the full tier (CI).
@pytest.mark.slow
def test_wheel_installs_next_to_horovod_and_runs(dists, work):
    _, wheel = dists
    python, venv_site = _make_venv(work, "venv")
    out = _pip(python, "install", "--no-index", wheel, cwd=work)
    # Satisfied by the environment that was there, not downloaded (there is no index).
    assert "Requirement already satisfied: numba>=0.60" in out.stdout, out.stdout
    assert (venv_site / "hvd_quant" / "__init__.py").is_file()

    run_dir = work / "elsewhere"  # outside the checkout: it cannot shadow the installed package
    run_dir.mkdir(exist_ok=True)
    smoke = _run([python, "-c", _SMOKE], cwd=run_dir, env=_clean_env(HVD_QUANT_THREADS="1"))
    result = json.loads(smoke.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).resolve() == (venv_site / "hvd_quant" / "__init__.py").resolve()
    assert result["size"] == 1
    numba_installed = any(p.name.startswith("numba-") for p in Path(sysconfig.get_paths()["purelib"]).iterdir())
    if numba_installed:
        assert result["enabled"] is True and result["why"] == "" and result["signatures"] > 0
    else:  # the one log line says why
        lines = [line for line in smoke.stderr.splitlines() if "fused CPU kernels off" in line]
        assert len(lines) == 1 and "numba" in lines[0], smoke.stderr[-3000:]
    # EF-SignSGD of a constant gradient on one rank: mean|g| * sign(g) = g, so SGD's step.
    assert result["weight"] == pytest.approx([1.0 - 0.3] * 8)
    assert result["bias"] == pytest.approx([0.5 - 0.3] * 2)
    assert result["tf_compression"] == "TFCompressor"


def test_editable_install_as_the_bootstrap_does_it(dists, work):
    """scripts/bootstrap.sh: ``pip install --no-deps --no-build-isolation -e .`` with this
    metadata and this environment's setuptools."""
    python, _ = _make_venv(work, "venv-editable")
    src = work / "src"
    _pip(python, "install", "--no-deps", "--no-build-isolation", "-e", src, cwd=work)
    (work / "elsewhere").mkdir(exist_ok=True)
    out = _run([python, "-c", "import hvd_quant; print(hvd_quant.__file__)"], cwd=work / "elsewhere")
    assert Path(out.stdout.strip()).resolve() == (src / "hvd_quant" / "__init__.py").resolve()


def test_horovod_build_follows_the_installed_mpi(tmp_path):
    """scripts/build_horovod.sh builds Gloo and MPI where an MPI compiler wrapper (mpicxx) is
    on PATH, Gloo alone elsewhere (its wheel cache is keyed by that), and takes an override;
    the Horovod installed here has what this machine's build would have."""
    script = ROOT / "scripts" / "build_horovod.sh"

    def controllers(path, **env):
        proc = subprocess.run(["/bin/bash", str(script), "--controllers"], capture_output=True, text=True,
                              timeout=60, env={"PATH": str(path), **env})
        return proc.returncode, proc.stdout.strip() or proc.stderr.strip()

    bare = tmp_path / "bin"
    bare.mkdir()
    assert controllers(bare) == (0, "Gloo")
    assert controllers(bare, HVD_QUANT_HOROVOD_MPI="1") == (0, "Gloo, MPI")  # a cached MPI wheel will do
    (bare / "mpicxx").write_text("#!/bin/sh\n")
    (bare / "mpicxx").chmod(0o755)
    assert controllers(bare) == (0, "Gloo, MPI")
    assert controllers(bare, HVD_QUANT_HOROVOD_MPI="0") == (0, "Gloo")
    code, message = controllers(bare, HVD_QUANT_HOROVOD_MPI="yes")
    assert code == 2 and "auto, 0 or 1" in message
    import horovod.torch as hvd
    here = controllers(os.environ.get("PATH", ""))[1]
    assert hvd.gloo_built() and bool(hvd.mpi_built()) == (here == "Gloo, MPI"), \
        f"this machine builds {here}; the installed Horovod has MPI: {hvd.mpi_built()} (run scripts/bootstrap.sh)"
