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
