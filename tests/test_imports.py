"""The import graph of nxgates has no cycles, and nxgates imports no generic top-level name of its own layers.

The graph is built from the sources with ``ast`` (nothing is imported): a node per module of the installed layout
(``nxgates.gates.cli`` is ``gates/cli.py``), an edge per ``import`` / ``from ... import`` anywhere in the module,
function-level (lazy) imports included, ``if TYPE_CHECKING:`` blocks excluded (they never run). ``from pkg import sub``
is an edge to the module ``pkg.sub`` when that is a module, else to ``pkg``; a package's ``__init__`` is the node
``pkg``, and importing a submodule does not count as an edge to its parent package.

Run: ``python -m pytest tests/test_imports.py -q``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The installed layout (pyproject.toml [tool.setuptools.package-dir]): package -> folder of this repository.
LAYERS = {"nxgates": "nxgates", "nxgates.reference": "reference", "nxgates.kernels": "kernels",
          "nxgates.model": "model", "nxgates.gates": "gates", "nxgates.fixtures": "fixtures"}


def modules() -> dict[str, pathlib.Path]:
    """Every module of nxgates, dotted name -> file."""
    out = {}
    for package, folder in LAYERS.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((package, *rel))] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(path: pathlib.Path, module: str, is_package: bool, mods=()) -> set[str]:
    """The dotted names ``path`` imports (relative imports resolved), outside ``if TYPE_CHECKING:`` blocks.
    ``from X import a``: ``X.a`` when that is one of ``mods`` (a submodule), else ``X``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = module.split(".") if is_package else module.split(".")[:-1]
                    parts = parts[: len(parts) - (child.level - 1)]
                    base = ".".join([*parts, child.module] if child.module else parts)
                else:
                    base = child.module
                for alias in child.names:
                    names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
            visit(child)

    visit(tree)
    return names


def _string_constants(path: pathlib.Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def _calls_import_module(path: pathlib.Path) -> bool:
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Call):
            f = n.func
            if (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
                    isinstance(f, ast.Name) and f.id == "import_module"):
                return True
    return False


def import_graph() -> dict[str, set[str]]:
    """module -> the nxgates modules it imports. A module that calls ``importlib.import_module`` also depends on every
    module named by a string in it or in the modules it imports (e.g. a table of case modules)."""
    mods = modules()
    graph = {name: {m for m in imported_names(path, name, path.name == "__init__.py", mods) if m in mods} - {name}
             for name, path in mods.items()}
    for name, path in mods.items():
        if _calls_import_module(path):
            named = set().union(*(_string_constants(mods[m]) for m in {name, *graph[name]}))
            graph[name] |= (named & set(mods)) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return out


def test_the_import_graph_has_no_cycles():
    graph = import_graph()
    assert len(graph) > 40 and "nxgates.gates.cli" in graph["nxgates.gates.__main__"]
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    """A check that cannot fail is worse than none: the finder reports a planted cycle, and the graph builder sees a
    lazy (function-level) import such as the one that used to tie gates.calibrate and gates.cli."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert "nxgates.gates.calibrate" in import_graph()["nxgates.gates.cli"]  # cli imports calibrate inside main()


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_generic_top_level_import(name):
    """nxgates imports its layers as ``nxgates.<layer>``, never as the generic top-level ``model``, ``gates``, ..."""
    mods = modules()
    path = mods[name]
    bad = sorted(n for n in imported_names(path, name, path.name == "__init__.py")
                 if n.split(".")[0] in ("model", "gates", "kernels", "reference", "fixtures"))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


LAYER_ORDER = ("nxgates.fixtures", "nxgates.reference", "nxgates.kernels", "nxgates.model", "nxgates.gates")


def _layer(module: str) -> int | None:
    for i, layer in enumerate(LAYER_ORDER):
        if module == layer or module.startswith(layer + "."):
            return i
    return None


def test_each_layer_imports_only_the_layers_below_it():
    """reference -> kernels -> model -> gates (docs/design.md, "Architecture"): never upwards."""
    graph = import_graph()
    upward = sorted((a, b) for a, edges in graph.items() for b in edges
                    if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a))
    assert upward == []
    assert _layer("nxgates.model.rules") == 3 and _layer("nxgates") is None
