"""User-facing exceptions. Each message names the cause and the fix."""
import os

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fxpar's own code, by folder (not by a "/fxpar/" in the path: a user's project or a clone
# named fxpar holds the user's model code too); examples/ is model code, the user's kind
OWN_CODE = (*(os.path.join(_ROOT, d) + os.sep for d in sorted(os.listdir(_ROOT))
              if d not in ("examples", "tests", "benchmarks")
              and os.path.isfile(os.path.join(_ROOT, d, "__init__.py"))),
            os.path.join(_ROOT, "__init__.py"), os.path.join(_ROOT, "__main__.py"))


def user_line(frames) -> str:
    """'file:line: code' of the innermost frame of user code (outside torch and fxpar) among
    `frames` (traceback.FrameSummary, outermost first), '' if there is none: where an error
    about the model's code points."""
    import torch  # (core/errors is imported before anything needs torch)
    not_user = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, *OWN_CODE)
    mine = [f for f in frames if not os.path.abspath(f.filename).startswith(not_user)]
    return f"{mine[-1].filename}:{mine[-1].lineno}: {mine[-1].line}" if mine else ""



class FxparError(Exception):
    """Base class of every error fxpar raises on bad input."""


class TraceError(FxparError):
    """The model (or its loss) cannot be captured as one static joint graph."""


class PlanError(FxparError, ValueError):
    """The Plan is invalid or does not match the devices / batch."""


class ShardingError(FxparError):
    """No sharding could be decided for an op of the graph."""


class BatchError(FxparError, ValueError):
    """A batch given to step()/evaluate() does not match the example batch."""


class BatchIndexError(BatchError, IndexError):
    """A batch value used as an index (an embedding id, a class target) is outside the range
    its op accepts; the message names the op, its module and the values."""


class CheckpointError(FxparError):
    """A checkpoint is missing, incomplete, unsafe, or does not fit the model being loaded."""


class RankFailure(FxparError, RuntimeError):
    """A training step failed because a rank died, raised, or stopped answering; the message
    names the rank(s) and the step."""


class NonFiniteLossError(FxparError, FloatingPointError):
    """The loss of a step was NaN or inf (before the optimizer applied it)."""


class PassError(FxparError):
    """A pass produced an inconsistent graph (a bug in fxpar: please report it)."""


class CollectiveMisuse(FxparError, RuntimeError):
    """Ranks called different collective methods (or one rank skipped a call): raised on
    every rank, naming what each rank called, before any wrong answer or hang."""


class VerifyError(FxparError, RuntimeError):
    """Plan.verify: the first step under the plan differs from one plain process on the same
    batch (a bug in fxpar: the message names the first tensor that differs)."""


class CodegenError(FxparError):
    """Inductor could not compile a part of the graph."""
