"""Where Triton is for the processes that run it, and their environment.

Triton is not installed on the test environment's path: ``scripts/bootstrap.sh
--with-triton`` puts it in ``.venv/triton`` (``pip install --target``). torch imports
Triton whenever it finds it (an optimizer's step does, in torch 2.13), and a process that
loaded TensorFlow first then aborts: both bundle LLVM, whose command-line options get
registered twice ("Option 'bitcode-mdindex-threshold' registered more than once",
TensorFlow 2.21, Triton 3.9.0). The suite's own process and the jobs it starts import
both frameworks; the GPU kernels' interpreter tests and the GPU benchmark's harness run
in processes of their own, which import no TensorFlow, with this folder on their path.
"""

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def triton_folder():
    """The folder to put on ``PYTHONPATH`` for Triton: ``HVD_QUANT_TRITON_PATH``, else
    ``<venv>/triton``; ``None`` where neither holds it."""
    folder = Path(os.environ.get("HVD_QUANT_TRITON_PATH") or Path(sys.prefix) / "triton")
    return folder if (folder / "triton" / "__init__.py").exists() else None


def triton_env():
    """This process's environment for a child that imports Triton (its folder and the
    repository first on ``PYTHONPATH``), or ``None`` where Triton is nowhere (neither in
    its folder nor importable as installed)."""
    folder = triton_folder()
    if folder is None and importlib.util.find_spec("triton") is None:
        return None
    paths = ([str(folder)] if folder else []) + [str(ROOT)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env
