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
    file as its last test ends - its outcomes, worker and time - in place of the dots, which
    name no file."""

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

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::")[0]
        self.started.setdefault(path, time.perf_counter())
        if report.when == "call" or report.when == "setup" and not report.passed or \
                report.when == "teardown" and report.failed:
            xfail = hasattr(report, "wasxfail")
            self.outcomes[path]["error" if report.failed and report.when != "call" else
                                ("xfailed" if report.skipped else "xpassed") if xfail else
                                report.outcome] += 1
        if report.when != "teardown" or self.left is None:
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


@functools.cache
def _starting_ranks() -> frozenset[tuple[str, str]]:
    """(file, function) of every function of tests/ that starts rank processes, itself or
    through another function of tests/ or examples/ (a helper imported from another file:
    test_parity._check_plans, workers.check_resumed_and_resharded, zoo_sweep.plan_cells),
    matched by name (a namesake of such a function marks a few tests that start none: they
    only run in make test-slow's one-at-a-time part)."""
    import ast
    funcs = {}
    here = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(here, "*.py"))
                       + glob.glob(os.path.join(here, os.pardir, "examples", "*.py"))):
        for f in ast.walk(ast.parse(open(path).read())):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            called = {c.func.attr if isinstance(c.func, ast.Attribute) else c.func.id
                      for c in ast.walk(f) if isinstance(c, ast.Call)
                      and isinstance(c.func, (ast.Attribute, ast.Name))}
            # fxpar.launch, torchrun (--nproc-per-node) or raw ranks (a WORLD_SIZE in
            # their env)
            if any(isinstance(n, ast.Constant) and n.value == "--nproc-per-node"
                   or isinstance(n, ast.keyword) and n.arg == "WORLD_SIZE"
                   for n in ast.walk(f)):
                called.add("launch")
            funcs[(path, f.name)] = called
    found = {"launch"}
    while True:
        more = {name for (_, name), called in funcs.items() if called & found} - found
        if not more:
            return frozenset(key for key, called in funcs.items() if called & found)
        found |= more


def pytest_collection_modifyitems(config, items):
    """Markers that say what a test is, beside `slow` (the time tier): `multiprocess` on every
    test that starts rank processes, found from its file's source."""
    import pytest
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
