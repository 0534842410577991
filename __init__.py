"""fxpar: make any PyTorch model train on many devices without hand-written parallel code."""
from fxpar.api.parallelize import parallelize  # noqa: F401
from fxpar.compiler.compile import compile  # noqa: F401
from fxpar.core.errors import TraceError, PlanError, ShardingError, BatchError, FxparError  # noqa: F401
from fxpar.core.errors import CheckpointError, RankFailure, NonFiniteLossError  # noqa: F401
from fxpar.core.errors import VerifyError  # noqa: F401
from fxpar.core.plan import Plan  # noqa: F401
from fxpar.runtime.dist import launch  # noqa: F401
from fxpar.runtime.trainer import ParallelModel  # noqa: F401

__all__ = ["parallelize", "compile", "Plan", "launch", "ParallelModel", "TraceError", "PlanError",
           "ShardingError", "BatchError", "FxparError",
           "CheckpointError", "RankFailure", "NonFiniteLossError"]
