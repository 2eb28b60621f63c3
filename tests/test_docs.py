"""The documentation builds without a single warning, the READMEs' links resolve, and the
reference runs' index lists every folder.

``mkdocs build --strict`` (mkdocs.yml, docs/) fails on any warning: a broken link or
anchor between pages, a page missing from the navigation, a docstring that griffe cannot
parse for the API reference. The build reads the docstrings statically, so it needs
neither torch, TensorFlow nor Horovod, and takes a few seconds. The README and
docker/README.md live outside docs/, so their relative links are checked here.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_docs_build_strict(tmp_path):
    try:  # a missing tool is a failure, not a skip: scripts/bootstrap.sh installs them
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"the documentation tools are missing ({exc}); run scripts/bootstrap.sh")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's end-of-life banner
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    warnings = [line for line in output.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert proc.returncode == 0 and not warnings, (
        f"mkdocs build --strict failed (exit {proc.returncode}):\n" + "\n".join(warnings or [output[-4000:]]))
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "api" / "torch" / "index.html").exists()


def _heading_anchors(markdown):
    """The anchors MkDocs' toc extension gives the headings of a Markdown file."""
    anchors = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            title = re.sub(r"[^\w\s-]", "", title)
            anchors.add(re.sub(r"[-\s]+", "-", title).strip("-"))
    return anchors


@pytest.mark.parametrize("readme", ["README.md", "docker/README.md"])
def test_readme_links_resolve(readme):
    path = ROOT / readme
    text = path.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve()
        if not resolved.exists():
            broken.append(target)
        elif anchor and anchor not in _heading_anchors(resolved.read_text()):
            broken.append(target)
    assert not broken, f"{readme}: links that do not resolve: {broken}"


def test_reference_index_lists_every_folder():
    """benchmarks/reference/README.md is the history's index: every folder under it is listed,
    and every folder it lists exists (a run copied in without its line is history nobody
    finds)."""
    reference = ROOT / "benchmarks" / "reference"
    index = (reference / "README.md").read_text()
    folders = {p.name for p in reference.iterdir() if p.is_dir()}
    named = set(re.findall(r"`([^`/\s]+)/`", index))  # a table's row, or a sentence that names it
    rows = set(re.findall(r"^\| `([^`/]+)/` \|", index, re.M))
    assert not folders - named, f"folders missing from benchmarks/reference/README.md: {sorted(folders - named)}"
    assert not rows - folders, f"benchmarks/reference/README.md has rows for missing folders: {sorted(rows - folders)}"
