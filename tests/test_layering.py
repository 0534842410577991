"""The layering rules of docs/design.md, read from the source, by folder: each layer imports only
the layers below it (core < kernels < passes < compiler; the runtime on core and kernels; viz
on core; api on top), no pass imports another pass, nothing in the library imports examples/,
no import cycles (imports inside functions counted too)."""
from __future__ import annotations

import ast
import functools
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# each folder of the library and the folders it may import: the whole rule, no exceptions
MAY_IMPORT = {
    "core": {"core"},                                          # the ground
    "kernels": {"core", "kernels"},
    "passes": {"core", "kernels", "passes"},
    "compiler": {"core", "kernels", "passes", "compiler"},
    "runtime": {"core", "kernels", "runtime"},                 # runs Programs, nothing else
    "viz": {"core", "viz"},                                    # draws Programs and reports
    "api": {"core", "kernels", "passes", "compiler", "runtime", "viz", "api"},
}
LIBRARY = tuple(MAY_IMPORT)


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("fxpar",) + parts)


def _imports(path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """(imported fxpar module, line, at module level) for every import in the file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith("fxpar."):
                out.append((name, node.lineno, id(node) in top))
    return out


@functools.lru_cache(maxsize=None)
def _graph():
    files = {_module(p): p for d in LIBRARY for p in (ROOT / d).rglob("*.py")}
    g = nx.DiGraph()
    g.add_nodes_from(files)
    edges = {}
    for mod, path in files.items():
        for name, line, _ in _imports(path):
            # `from fxpar.compiler import ir` names a module; `from fxpar.core.ir import X`
            # names one too (its prefix): take the longest prefix that is a module
            target = max((m for m in files if name == m or name.startswith(m + ".")),
                         key=len, default=None)
            if target is not None and target != mod:
                g.add_edge(mod, target)
                edges.setdefault((mod, target), line)
    return files, g, edges


def test_no_import_cycles():
    _, g, edges = _graph()
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles (module -> module at line):\n" + "\n".join(
        " -> ".join(f"{a} (l.{edges[(a, b)]})" for a, b in zip(c, c[1:] + c[:1]))
        for c in cycles[:10])


def test_no_pass_imports_another_pass():
    _, g, edges = _graph()
    bad = [(a, b) for a, b in g.edges if a.startswith("fxpar.passes.")
           and b.startswith("fxpar.passes.")]
    assert not bad, bad


def test_every_layer_imports_only_the_layers_below_it():
    files, g, edges = _graph()
    layer = lambda m: m.split(".")[1]  # noqa: E731 - fxpar.<folder>.module
    bad = [f"{a} -> {b} (l.{edges[(a, b)]})" for a, b in g.edges
           if layer(b) not in MAY_IMPORT[layer(a)]]
    assert not bad, "imports against the layers:\n" + "\n".join(sorted(bad))


def test_every_library_folder_has_a_layer():
    """A new folder of the library is placed in MAY_IMPORT before anything can import it."""
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert folders - {"examples", "tests", "benchmarks"} == set(LIBRARY), folders


def test_library_imports_no_examples():
    files, _, _ = _graph()
    bad = [(m, name, line) for m, p in files.items() for name, line, _ in _imports(p)
           if name.startswith("fxpar.examples")]
    assert not bad, bad


@pytest.mark.parametrize("layer", ["core", "passes", "compiler", "runtime"])
def test_function_level_imports_only_defer_optional_dependencies(layer):
    """An fxpar import inside a function hides a dependency (and, before, hid cycles): the
    library imports its own modules at the top."""
    files, _, _ = _graph()
    bad = [(m, name, line) for m, p in files.items() if m.startswith(f"fxpar.{layer}")
           for name, line, top in _imports(p) if not top]
    assert not bad, bad


def test_the_planner_opens_no_process_group():
    """The machine is measured by api/autoplan.py (through the runtime) and handed to the
    planner as values."""
    files, _, _ = _graph()
    assert "torch.distributed" not in files["fxpar.compiler.planner"].read_text()


def test_the_planner_captures_nothing():
    """compile captures the model once (compile.planner_stats) and hands the graph to the
    planner, which prices it: neither the planner nor its graph statistics import capture
    (nor compile, which would be a cycle)."""
    _, g, _ = _graph()
    for mod in ("fxpar.compiler.planner", "fxpar.compiler.graphstats"):
        reach = nx.descendants(g, mod)
        assert "fxpar.compiler.capture" not in reach, (mod, "reaches capture")
        assert "fxpar.compiler.compile" not in reach, (mod, "reaches compile")
