"""The package's layers (docs/development.md, "Layout"): imports run one way, from
``kernels`` up through ``core``, the methods (``compressors``, ``optimizers``,
``registry``), to the framework adapters, and no modules import each other in a loop.

Read from the source with ``ast`` (every import, those inside functions too, since a
function-level import is a dependency all the same), so the test needs no framework.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hvd_quant"

#: Layer of each top-level part of the package; a module may import its own layer or below.
LAYERS = {"kernels": 0, "core": 1, "compressors": 2, "optimizers": 2, "registry": 2,
          "process_sets": 2, "torch": 3, "tensorflow": 3, "cluster": 3, "_requirements": 0}


def module_names():
    """``{dotted name: path}`` of every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("hvd_quant",) + path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name, path, modules):
    """The package's modules that ``name`` imports, anywhere in its source."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # "from pkg import sub" imports the submodule pkg.sub, else a name of pkg
            subs = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in modules]
            targets = subs + ([module] if len(subs) < len(node.names) else [])
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


@pytest.fixture(scope="module")
def graph():
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer(name):
    parts = name.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_imports_run_one_way(graph):
    """No module imports from a layer above its own (the package's own ``__init__``, which
    gathers the public names, is above every layer)."""
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if layer(m) is not None and (layer(t) is None or layer(t) > layer(m)))
    assert upward == []


def test_core_names_no_method(graph):
    """The core serves every method through one interface: it imports neither the
    methods nor the table that names them."""
    assert sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if layer(m) == LAYERS["core"] and layer(t) == LAYERS["compressors"]) == []


def test_no_import_loops(graph):
    """No strongly connected set of modules (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, loops, counter = {}, {}, set(), [], [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    loops.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    assert loops == []


def test_the_reader_sees_every_layer(graph):
    """The test reads real imports: the adapters import the core, the core the kernels."""
    assert any(t.startswith("hvd_quant.core") for t in graph["hvd_quant.torch.backend"])
    assert any(layer(t) == LAYERS["kernels"] for m in graph if layer(m) == LAYERS["core"] for t in graph[m])
