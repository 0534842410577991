"""The layering rules of DESIGN.md section 2, read from the source: data flows one way
(capture -> passes -> Program -> runtime); no pass imports another pass; the runtime imports
no pass, not the planner and not the compiler's front door; nothing in the library imports
examples/; no import cycles, counting imports inside functions too."""
from __future__ import annotations

import ast
import functools
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ("compiler", "passes", "runtime", "kernels", "viz")
# what the runtime may not reach: it runs Programs and nothing else
NOT_FOR_RUNTIME = ("fxpar.passes", "fxpar.compiler.planner", "fxpar.compiler.compile",
                   "fxpar.compiler.api", "fxpar.compiler.pass_manager",
                   "fxpar.compiler.capture")


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
            # `from fxpar.compiler import ir` names a module; `from fxpar.compiler.ir import X`
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


def test_runtime_imports_no_pass_and_no_planner():
    _, g, edges = _graph()
    bad = [(a, b, edges[(a, b)]) for a, b in g.edges if a.startswith("fxpar.runtime")
           and b.startswith(NOT_FOR_RUNTIME)]
    assert not bad, bad


def test_library_imports_no_examples():
    files, _, _ = _graph()
    bad = [(m, name, line) for m, p in files.items() for name, line, _ in _imports(p)
           if name.startswith("fxpar.examples")]
    assert not bad, bad


@pytest.mark.parametrize("layer", ["passes", "compiler", "runtime"])
def test_function_level_imports_only_defer_optional_dependencies(layer):
    """An fxpar import inside a function hides a dependency (and, before, hid cycles): the
    library imports its own modules at the top."""
    files, _, _ = _graph()
    bad = [(m, name, line) for m, p in files.items() if m.startswith(f"fxpar.{layer}")
           for name, line, top in _imports(p) if not top]
    assert not bad, bad


def test_the_planner_opens_no_process_group():
    """The machine is measured by the runtime (runtime/machine.py) and handed to the planner
    as values; the planner reads the runtime's schedule simulator and nothing else of it."""
    files, g, edges = _graph()
    runtime = sorted(b for b in g.successors("fxpar.compiler.planner")
                     if b.startswith("fxpar.runtime."))  # (not the package, named on the way)
    assert runtime == ["fxpar.runtime.schedules"], runtime
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
