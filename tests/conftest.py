import importlib
import os

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


def _starting_ranks(path: str) -> frozenset[str]:
    """The functions of a test file that start rank processes, themselves or through another
    function of the file."""
    import ast
    tree = ast.parse(open(path).read())
    funcs = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    calls = {f.name: {c.func.attr if isinstance(c.func, ast.Attribute) else c.func.id
                      for c in ast.walk(f) if isinstance(c, ast.Call)
                      and isinstance(c.func, (ast.Attribute, ast.Name))} for f in funcs}
    # fxpar.launch, torchrun (--nproc-per-node) or raw ranks (a WORLD_SIZE in their env)
    by_hand = {f.name for f in funcs if any(
        isinstance(n, ast.Constant) and n.value == "--nproc-per-node"
        or isinstance(n, ast.keyword) and n.arg == "WORLD_SIZE" for n in ast.walk(f))}
    found = {name for name, called in calls.items() if "launch" in called} | by_hand
    while True:
        more = {name for name, called in calls.items() if called & found} - found
        if not more:
            return frozenset(found)
        found |= more


def pytest_collection_modifyitems(config, items):
    """Markers that say what a test is, beside `slow` (the time tier): `multiprocess` on every
    test that starts rank processes, found from its file's source."""
    import pytest
    seen = {}
    for item in items:
        path = str(item.fspath)
        if path not in seen:
            seen[path] = _starting_ranks(path)
        fn = getattr(item, "function", None)
        if fn is not None and fn.__name__ in seen[path]:
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
