"""fxpar: make any PyTorch model train on many devices without hand-written parallel code.

The names below load their layer when first used, so importing one layer (the runtime, to run
a saved Program) does not import the others (the compiler)."""
import importlib

_WHERE = {
    "parallelize": "fxpar.api.parallelize", "compile": "fxpar.compiler.compile",
    "Plan": "fxpar.core.plan", "launch": "fxpar.runtime.dist",
    "ParallelModel": "fxpar.runtime.trainer",
    "save_program": "fxpar.core.program_io", "load_program": "fxpar.core.program_io",
    **{name: "fxpar.core.errors" for name in (
        "TraceError", "PlanError", "ShardingError", "BatchError", "FxparError",
        "CheckpointError", "RankFailure", "NonFiniteLossError", "VerifyError")},
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'fxpar' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_WHERE])
