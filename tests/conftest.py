import collections
import functools
import glob
import importlib
import os
import time

import pytest

os.environ.setdefault("FXPAR_DEVICE", "cpu")   # tests run the CPU/gloo path
os.environ.setdefault("FXPAR_TIMEOUT", "120")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Plan.codegen="auto" compiles every graph with Inductor (seconds to minutes per model on a
# 2-core machine): the suite runs op by op unless a test is about code generation and asks
# for codegen="inductor" itself (tests/test_codegen.py, the codegen parity tests)
os.environ.setdefault("FXPAR_CODEGEN", "eager")
# plan="auto" measures the machine and times the model every time (tests replace those
# measurements and check what the planner makes of them); the planner's disk cache has its
# own tests, in a temporary directory (tests/test_planner.py)
os.environ.setdefault("FXPAR_PLAN_CACHE", "0")


def pytest_runtest_logreport(report):
    """A failure's cause printed as it happens, not only in the summary at the end: a CI run
    stopped by its time limit never reaches the summary."""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        why = crash.message.splitlines()[0] if crash is not None else str(report.longrepr)[-300:]
        print(f"\nFAILED {report.nodeid} ({report.when}): {why[:400]}", flush=True)


class _FileProgress:
    """Under pytest-xdist (make test runs on 2 workers, whole files each), one line per test
    file as its last test ends - its outcomes, the worker of its last test, the time from its
    first test's start - in place of the dots, which name no file."""

    def __init__(self, reporter):
        self.reporter = reporter
        self.left: collections.Counter | None = None
        self.outcomes = collections.defaultdict(collections.Counter)
        self.started: dict[str, float] = {}
        self.letters = False  # (a letter written since the last line: F, E, x)

    def pytest_xdist_node_collection_finished(self, node, ids):
        if self.left is None:  # (every worker collects the same ids)
            self.left = collections.Counter(i.split("::")[0] for i in ids)

    def pytest_report_teststatus(self, report, config):
        """No letter for a pass or a skip: the file's line counts them."""
        if report.passed and report.when == "call" and not hasattr(report, "wasxfail"):
            return "passed", "", "PASSED"
        if report.skipped and not hasattr(report, "wasxfail"):
            return "skipped", "", "SKIPPED"
        self.letters |= report.when == "call" or not report.passed
        return None

    def pytest_runtest_logstart(self, nodeid, location):
        self.started.setdefault(nodeid.split("::")[0], time.perf_counter())

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::")[0]
        self.started.setdefault(path, time.perf_counter())
        if report.when == "???":  # (its worker crashed: no teardown follows)
            self.outcomes[path]["crashed"] += 1
        elif report.when == "call" or report.when == "setup" and not report.passed or \
                report.when == "teardown" and report.failed:
            xfail = hasattr(report, "wasxfail")
            self.outcomes[path]["error" if report.failed and report.when != "call" else
                                ("xfailed" if report.skipped else "xpassed") if xfail else
                                report.outcome] += 1
        if report.when not in ("teardown", "???") or self.left is None:
            return
        self.left[path] -= 1
        if self.left[path] == 0:
            if self.letters:
                self.reporter.write("\n")
                self.letters = False
            said = ", ".join(f"{n} {k}" for k, n in sorted(self.outcomes[path].items()))
            self.reporter.write_line(
                f"{path}: {said} ({getattr(report, 'node', None) and report.node.gateway.id}, "
                f"{time.perf_counter() - self.started[path]:.0f} s)")


@pytest.hookimpl(trylast=True)  # (after the terminal reporter is registered)
def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.register(_FileProgress(reporter), "fxpar-file-progress")


def _launches(node, scripts: set) -> bool:
    """Whether `node` starts ranks itself: fxpar.launch, torchrun (--nproc-per-node), raw
    ranks (a WORLD_SIZE in their env) or a script of the file that calls fxpar.launch."""
    import ast
    return any(isinstance(n, ast.Call) and (isinstance(n.func, ast.Attribute) and n.func.attr
                                            or getattr(n.func, "id", None)) == "launch"
               or isinstance(n, ast.Constant) and n.value == "--nproc-per-node"
               or isinstance(n, ast.keyword) and n.arg == "WORLD_SIZE"
               or isinstance(n, ast.Name) and n.id in scripts for n in ast.walk(node))


def _imports(nodes) -> tuple[dict, dict]:
    """({name: (module, name)}, {alias: module}) the import statements among `nodes` bind
    (`from pkg import x` binds both: x may be a module or a function)."""
    import ast
    names, modules = {}, {}
    for n in nodes:
        if isinstance(n, ast.ImportFrom):
            for a in n.names:
                modules[a.asname or a.name] = a.name
                names[a.asname or a.name] = ((n.module or "").rpartition(".")[2], a.name)
        elif isinstance(n, ast.Import):
            for a in n.names:
                modules[a.asname or a.name] = a.name.rpartition(".")[2]
    return names, modules


@functools.cache
def _starting_ranks() -> frozenset[tuple[str, str]]:
    """(file, function) of every function of tests/ that starts rank processes, itself or
    through the functions it calls in tests/ or examples/ (by the names it defines or
    imports: test_parity._check_plans, workers.check_resumed_and_resharded,
    zoo_sweep.plan_cells)."""
    import ast
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [p for p in sorted(glob.glob(os.path.join(here, "*.py")))
             if os.path.basename(p) != "conftest.py"]
    paths += sorted(glob.glob(os.path.join(here, os.pardir, "examples", "*.py")))
    calls: dict[tuple[str, str], set] = {}  # (module, function) -> (module, function)s
    roots: set[tuple[str, str]] = set()
    files: dict[tuple[str, str], str] = {}
    for path in paths:
        mod = os.path.basename(path)[:-3]
        tree = ast.parse(open(path).read())
        defined = {f.name for f in tree.body
                   if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        top = _imports(tree.body)
        scripts = {t.id for n in tree.body if isinstance(n, ast.Assign)
                   and isinstance(n.value, ast.Constant) and "fxpar.launch(" in str(n.value.value)
                   for t in n.targets if isinstance(t, ast.Name)}
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            key = (mod, f.name)
            files[key] = path
            if _launches(f, scripts):
                roots.add(key)
            out = calls.setdefault(key, set())
            inner = _imports(ast.walk(f))  # (a function's own imports first)
            names, modules = {**top[0], **inner[0]}, {**top[1], **inner[1]}
            for c in ast.walk(f):
                if not isinstance(c, ast.Call):
                    continue
                if isinstance(c.func, ast.Name):
                    if c.func.id in defined:
                        out.add((mod, c.func.id))
                    elif c.func.id in names:
                        out.add(names[c.func.id])
                elif isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name) \
                        and c.func.value.id in modules:
                    out.add((modules[c.func.value.id], c.func.attr))
    found = set(roots)
    while True:
        more = {k for k, out in calls.items() if out & found} - found
        if not more:
            return frozenset((os.path.abspath(files[k]), k[1]) for k in found)
        found |= more


def pytest_collection_modifyitems(config, items):
    """Markers that say what a test is, beside `slow` (the time tier): `multiprocess` on every
    test that starts rank processes, found from the sources of tests/ and examples/."""
    starting = _starting_ranks()
    for item in items:
        fn = getattr(item, "function", None)
        if fn is not None and (os.path.abspath(str(item.fspath)), fn.__name__) in starting:
            item.add_marker(pytest.mark.multiprocess)


# the Hugging Face models the multi-process tests build (tests/workers.py)
LAUNCHED_MODELS = ("llama", "gpt2", "mixtral", "qwen2_moe", "deepseek_v3")


def pytest_collection_finish(session):
    """Their modeling modules imported before the first fxpar.launch: its forkserver then
    imports them once for every rank (runtime/preload.py) rather than each rank importing
    them (seconds per rank). After -m / -k deselection: a session whose selected tests
    start no rank processes skips it."""
    if not any(item.get_closest_marker("multiprocess") for item in session.items):
        return
    for name in LAUNCHED_MODELS:
        try:
            importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:  # (transformers missing or older: those tests skip or fail alone)
            pass
