"""fxpar's logging, switched like torch's TORCH_LOGS, and the compile-phase clock.

Every module logs to `logging.getLogger(__name__)`: fxpar.compiler.capture,
fxpar.compiler.planner, fxpar.passes.remat, fxpar.runtime.pipeline, ... The FXPAR_LOGS
environment variable picks what is shown (comma-separated):

    FXPAR_LOGS="planner,+passes"   planner at INFO, every pass (and the pass manager) at DEBUG
    FXPAR_LOGS="+all"              everything at DEBUG ("all": INFO, "-all": errors only)
    FXPAR_LOGS="-runtime"          the runtime's errors only, the rest at WARNING

`name` = INFO, `+name` = DEBUG, `-name` = ERROR only; a name is an alias of ALIASES or a
module (`passes.remat`, `fxpar.runtime.pipeline`). Components not named stay at WARNING.
Without FXPAR_LOGS: INFO on rank 0 -- a few lines: the plan the planner chose and why, the
compile summary, progress of phases over 2 s -- and WARNING on the other ranks
(FXPAR_DEBUG=1 is the old spelling of "+all"). Lines from rank r > 0 start with "[rank r]".

Python warnings (`warnings.warn`: from passes, the api, torch) bypass the logger. In a job of
several processes `configure` routes them the same way (`show_warning`): a line from rank
r > 0 starts with "[rank r]", and each message is printed once per job - by the first rank
to reach it (the job's c10d store decides; each rank also remembers what it printed) -
instead of once per rank and again at each repeat. Not where the program replaced
`warnings.showwarning` itself; `warnings.catch_warnings(record=True)` still records all.

One stderr handler goes on the "fxpar" logger (never the root logger), once, and only where
the program has not configured logging itself (handlers on "fxpar" or the root logger, or a
level set on "fxpar"); with it "fxpar" stops propagating (as torch's loggers do), so a root
handler the program adds later prints no second copy. Where the program configured logging,
fxpar's records go to the program's handlers at the program's levels: only FXPAR_LOGS's
levels are set (without it, nothing: `logging.basicConfig(level=WARNING)` stays quiet).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import sys
import threading
import time
import warnings

import torch.distributed as dist

log = logging.getLogger(__name__)

ALIASES = {
    "all": ["fxpar"],
    "compile": ["fxpar.compiler", "fxpar.core", "fxpar.api"],
    "capture": ["fxpar.compiler.capture"],
    "planner": ["fxpar.compiler.planner"],
    "passes": ["fxpar.passes", "fxpar.compiler.pass_manager"],
    "sharding": ["fxpar.core.sharding"],
    "runtime": ["fxpar.runtime"],
    "kernels": ["fxpar.kernels"],
}
PROGRESS_S = 2.0  # a compile phase longer than this prints a line at INFO


def rank() -> int:
    """This process's global rank: the process group's, else torchrun's / fxpar.launch's
    RANK, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def world_size() -> int:
    """The job's number of processes: the process group's, else WORLD_SIZE, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _names(name: str) -> list[str]:
    if name in ALIASES:
        return ALIASES[name]
    full = name if name.split(".")[0] == "fxpar" else f"fxpar.{name}"
    try:
        found = importlib.util.find_spec(full) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ValueError(f"FXPAR_LOGS: unknown component {name!r}; use one of "
                         f"{sorted(ALIASES)} or an fxpar module such as passes.remat")
    return [full]


def parse(spec: str) -> dict[str, int]:
    """FXPAR_LOGS -> {logger name: level}."""
    levels = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        level = {"+": logging.DEBUG, "-": logging.ERROR}.get(item[0], logging.INFO)
        for name in _names(item.lstrip("+-")):
            levels[name] = level
    return levels


class _Stderr(logging.StreamHandler):
    """Writes to the sys.stderr of the moment (pytest and notebooks swap it)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(_Format())

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


class _Format(logging.Formatter):
    def format(self, record):
        r = rank()
        who = "fxpar" if record.levelno >= logging.INFO else record.name
        kind = f" {record.levelname.lower()}" if record.levelno >= logging.WARNING else ""
        return (f"[rank {r}] " if r else "") + f"{who}{kind}: {super().format(record)}"


_warned: set[str] = set()  # warnings this process printed (or another rank did)


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning in a job of several processes: once per message per job, a line
    from rank r > 0 prefixed "[rank r]" (as the logger's); one process: Python's own."""
    if world_size() <= 1:
        return warnings._showwarning_orig(message, category, filename, lineno, file, line)
    key = f"{category.__name__}: {message}"
    if key in _warned:
        return None
    _warned.add(key)
    if not _first_in_job(key):
        return None
    r = rank()
    text = warnings.formatwarning(message, category, filename, lineno, line)
    try:
        (file or sys.stderr).write((f"[rank {r}] " if r else "") + text)
    except OSError:  # (as Python's: a closed stderr loses the warning, not the program)
        pass
    return None


def _first_in_job(key: str) -> bool:
    """Whether no other rank printed this warning yet (an atomic counter in the job's c10d
    store); True when there is no store to ask."""
    try:
        store = dist.distributed_c10d._get_default_store()
        digest = hashlib.sha1(key.encode()).hexdigest()[:16]
        return store.add(f"fxpar/warned/{digest}", 1) == 1
    except Exception:  # noqa: BLE001 - no process group (yet), or its store is gone
        return True


def _route_warnings() -> None:
    """Install show_warning, unless the program replaced warnings.showwarning itself."""
    if warnings.showwarning is warnings._showwarning_orig:
        warnings.showwarning = show_warning


_handler: logging.Handler | None = None
_configured = False
_levels_set: set[str] = set()  # loggers whose level configure() set


def configure(force: bool = False) -> None:
    """Apply FXPAR_LOGS (see the module docstring). Idempotent: the first call decides;
    parallelize, compile and the command line call it. force: read the environment again."""
    global _handler, _configured
    if _configured and not force:
        return
    top = logging.getLogger("fxpar")
    spec = os.environ.get("FXPAR_LOGS") or ("+all" if os.environ.get("FXPAR_DEBUG") else "")
    levels = {"fxpar": logging.WARNING, **parse(spec)} if spec else None  # (may raise)
    _configured = True
    _route_warnings()
    ours = _handler is not None and _handler in top.handlers
    user_level = top.level != logging.NOTSET and "fxpar" not in _levels_set
    configured_by_program = bool(top.handlers and not ours or logging.getLogger().handlers
                                 or user_level)
    if not ours and not configured_by_program:
        _handler = _Stderr()
        top.addHandler(_handler)
        ours = True
    # as torch's loggers: with fxpar's handler, a root handler added later prints no copy
    top.propagate = not (_handler is not None and _handler in top.handlers)
    if levels is None:  # the program's logging config decides, else INFO on rank 0
        levels = {} if configured_by_program else {
            "fxpar": logging.INFO if rank() == 0 else logging.WARNING}
    for name in _levels_set - set(levels):  # set by an earlier call
        logging.getLogger(name).setLevel(logging.NOTSET)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    _levels_set.clear()
    _levels_set.update(levels)


class Ticker:
    """Progress of a long loop while it runs: tick() logs at INFO at most every `every`
    seconds, nothing before (cheap: one clock read a call)."""

    def __init__(self, logger: logging.Logger, every: float = 5.0):
        self.logger, self.every = logger, every
        self.t0 = self.last = time.perf_counter()

    def tick(self, msg: str, *args) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self.logger.info(msg + " (%.0f s so far)", *args, now - self.t0)


@contextlib.contextmanager
def announce(logger: logging.Logger, what: str):
    """A line saying what is running, printed only if it is still running after PROGRESS_S
    (a phase that may take seconds or minutes, e.g. capturing a large model: the user sees
    what the process is doing before phase_done says how long it took; short phases stay
    quiet). From a timer thread, cancelled when the phase ends."""
    timer = threading.Timer(PROGRESS_S, logger.info, ("%s ...", what))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def phase_done(logger: logging.Logger, name: str, seconds: float, detail: str = "") -> None:
    """One line per phase: INFO when it took over PROGRESS_S, DEBUG otherwise."""
    level = logging.INFO if seconds > PROGRESS_S else logging.DEBUG
    took = f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"
    logger.log(level, "%s %s%s", name, took, f" ({detail})" if detail else "")


class Clock:
    """The compile phases' rows (name, seconds, nodes or None) for pm.compile_times, adding
    up to the wall time since the clock started: `with clock("phase"):` times one, `add`
    takes a row measured elsewhere, `rows()` ends with "other" for what no phase covered."""

    def __init__(self, logger: logging.Logger):
        self.logger, self.t0, self.times = logger, time.perf_counter(), []

    @contextlib.contextmanager
    def __call__(self, name: str, nodes: int | None = None):
        t = time.perf_counter()
        with announce(self.logger, name):
            yield
        self.add(name, time.perf_counter() - t, nodes)

    def add(self, name: str, seconds: float, nodes: int | None = None, detail: str = "",
            quiet: bool = False) -> None:
        """quiet: the row was reported where it was measured."""
        self.times.append((name, seconds, nodes))
        if not quiet:
            phase_done(self.logger, name, seconds, detail)

    def extend(self, rows) -> None:
        """Rows timed (and reported) by an inner clock: compile's within parallelize's."""
        for row in rows:
            self.add(*row, quiet=True)

    def finish(self) -> list[tuple[str, float, int | None]]:
        """The rows, "other" last; says "compiled in" with the longest phases at INFO."""
        rows = self.rows()
        big = sorted(rows, key=lambda r: -r[1])[:3]
        self.logger.info("compiled in %.2f s (%s)", self.wall(),
                         ", ".join(f"{name} {s:.2f} s" for name, s, _ in big))
        return rows

    def wall(self) -> float:
        return time.perf_counter() - self.t0

    def rows(self, other: bool = True) -> list[tuple[str, float, int | None]]:
        """other=False: the phases only (a clock nested in another's phase: the outer
        clock's "other" takes the rest)."""
        rest = self.wall() - sum(s for _, s, _ in self.times)
        return [*self.times, *([("other", max(rest, 0.0), None)] if other else [])]
