"""The commands and snippets in the README and the docs run as written (scripts/check_docs.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import check_docs  # noqa: E402


def write(tmp_path, text):
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


def test_markers_commands_and_unmarked_blocks(tmp_path):
    page = write(tmp_path, """# A page

<!-- check: run timeout=30 expect="hello|world" args="--small" -->
```bash
# a comment
echo hello \\
   world
$ echo again
```

<!--
check: skip needs a GPU
-->
```python
import torch
```

```text
not checked
```

```bash
echo unmarked
```
""")
    found = check_docs.blocks(page)
    assert [(b.line, b.language, b.directive) for b in found] == [(4, "bash", "run"), (14, "python", "skip"),
                                                                   (22, "bash", "")]
    run, skip, _ = found
    assert run.options == {"timeout": "30", "expect": "hello|world", "args": "--small"}
    assert check_docs.commands(run.text) == ["echo hello world", "echo again"]
    assert skip.reason == "needs a GPU"


@pytest.mark.parametrize("marker, message", [
    ("walk", "starts with 'run' or 'skip'"), ("skip", "needs a reason"),
    ("run speed=fast", "unknown check option"), ("run prelude=nope", "unknown prelude"),
    ("run needs=gpu", "needs= takes 'mpi'")])
def test_bad_markers_are_refused(marker, message):
    with pytest.raises(ValueError, match=message):
        check_docs.parse_marker(marker)


def test_sudo_is_dropped_only_as_root_without_sudo(monkeypatch):
    monkeypatch.setattr(check_docs.shutil, "which", lambda name: None)
    monkeypatch.setattr(check_docs.os, "geteuid", lambda: 0)
    assert check_docs.as_run_here("sudo .venv/bin/python x.py") == ".venv/bin/python x.py"
    monkeypatch.setattr(check_docs.os, "geteuid", lambda: 1000)
    assert check_docs.as_run_here("sudo .venv/bin/python x.py") == "sudo .venv/bin/python x.py"


def test_mpirun_gets_allow_run_as_root_only_as_root(monkeypatch):
    monkeypatch.setattr(check_docs.os, "geteuid", lambda: 0)
    assert check_docs.as_run_here("mpirun -np 2 python x.py") == "mpirun --allow-run-as-root -np 2 python x.py"
    monkeypatch.setattr(check_docs.os, "geteuid", lambda: 1000)
    assert check_docs.as_run_here("mpirun -np 2 python x.py") == "mpirun -np 2 python x.py"


@pytest.mark.timeout(120)
def test_blocks_that_need_mpi_skip_without_it_and_fail_where_it_is_required(tmp_path, monkeypatch, capsys):
    page = write(tmp_path, """
<!-- check: run needs=mpi -->
```bash
mpirun -np 2 true
```
""")
    monkeypatch.setattr(check_docs, "mpi_missing", lambda venv: "no MPI installed (mpirun not found)")
    monkeypatch.delenv("HVD_QUANT_REQUIRE_MPI", raising=False)
    assert check_docs.main([str(page)]) == 0
    assert f"skip {page}:3: needs MPI: no MPI installed" in capsys.readouterr().out
    monkeypatch.setenv("HVD_QUANT_REQUIRE_MPI", "1")
    assert check_docs.main([str(page)]) == 1
    assert f"FAIL {page}:3" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_a_failing_command_or_missing_output_fails_with_its_place(tmp_path):
    page = write(tmp_path, """
<!-- check: run expect="present" -->
```bash
echo present
test -f README.md && test ! -e benchmarks/results && test -L .venv
```

<!-- check: run expect="absent" -->
```bash
echo present
```

<!-- check: run -->
```bash
false
```

<!-- check: run expect="3" -->
```python
print(1 + 2)
```
""")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_docs.py"), str(page)],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 1
    out = proc.stdout
    assert "ok   " in out and f"{page}:3" in out  # ran in a copy of the tracked files
    assert f"FAIL {page}:9" in out and "output lacks ['absent']" in out
    assert f"FAIL {page}:14" in out and "exit 1: false" in out
    assert f"ok   {page}:19" in out


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_every_documented_command_runs(documented_commands):
    """Every bash and python block of README.md and docs/ is marked run or skip (with a
    reason), and every one marked run passes within its time limit (the check itself:
    tests/conftest.py's ``documented_commands``; ``scripts/test.sh --full`` starts it at
    collection). The full tier only: alone it takes about 7 minutes, the quick tier's budget."""
    returncode, output = documented_commands
    assert returncode == 0, output[-8000:]
