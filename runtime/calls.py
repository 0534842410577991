"""Collective calls agree before they run: misuse fails fast instead of hanging or, worse,
answering wrongly.

`pm.step`, `evaluate`, `full_state_dict`, `save`, `load`, `trace` and `save_pretrained` are
collective: every rank must call them, in the same order. An everyday mistake breaks that
(`if rank == 0: print(pm.evaluate(batch))`): rank 0's forward collectives then pair with the
other ranks' next `step` and return a wrong loss, or wait out FXPAR_TIMEOUT and end in a raw
gloo timeout. So each such call first all-gathers a 16-byte fingerprint (which
ParallelModel, which method) on a gloo side group of the whole world; if the ranks disagree,
every rank raises CollectiveMisuse naming what each rank called. pm.step issues the exchange
as it starts and checks it just before the step's first communication (the runtime calls
`settle` there), so its latency (one gloo round trip) overlaps the forward; the other
methods check before they start.

A rank whose program ends normally posts an "end of program" fingerprint (fxpar.launch's
rank wrapper, and an atexit hook under torchrun), so a peer still calling fxpar fails at once
too (a rank that ends with an exception does not: its launcher stops the others). A rank
stuck elsewhere (not in fxpar) is only found by the group's FXPAR_TIMEOUT; the message then
says which call waited. The side group is gloo even on NCCL jobs: the check is
host-side and never syncs the GPU; its cost is one small CPU all-gather per call
(benchmarks/call_check.py, docs/benchmarks.md: on a 2-core VM any gloo sync point costs
~1.3 ms, a few percent of the demo's step, more of a toy step's). FXPAR_CHECK_CALLS=0 turns
the check off for pm.step only (the rare methods keep it), as torch keeps its own collective
fingerprinting (TORCH_DISTRIBUTED_DEBUG) opt-in for its cost.
"""
from __future__ import annotations

import atexit
import functools
import os
import sys

import torch
import torch.distributed as dist

from fxpar.core.errors import CollectiveMisuse

METHODS = ("step", "evaluate", "full_state_dict", "save", "load", "trace", "save_pretrained",
           "full_params", "whole_tensors", "end of program")
END = len(METHODS) - 1
_ledger: "_Ledger | None" = None
_raised = False  # the program is ending with an uncaught exception: no end-of-program call


class _Ledger:
    """One per process group: the gloo side group and the number of ParallelModels built."""

    def __init__(self, timeout):
        self.world = dist.group.WORLD
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.size, self.rank = dist.get_world_size(), dist.get_rank()
        self.models = 0
        self.ended = False
        self.calls = 0
        self.broken = ""  # the mismatch that left the ranks out of step
        self.pending = None  # (work, buffers, what, raw_errors) of a begun call

    def begin(self, model_id: int, method: int, what: str, raw_errors: bool = False) -> None:
        """Issue this call's fingerprint exchange (async); `settle` checks it."""
        if self.broken:
            raise CollectiveMisuse(f"the ranks are out of step since {self.broken}; restart "
                                   f"the job. {_HOW}")
        self.settle()
        self.calls += 1
        mine = torch.tensor([model_id, method], dtype=torch.int64)
        got = [torch.empty_like(mine) for _ in range(self.size)]
        try:
            work = dist.all_gather(got, mine, group=self.group, async_op=True)
        except RuntimeError as e:
            self._failed(e, what, raw_errors)
        self.pending = (work, got, what, raw_errors)

    def settle(self) -> None:
        """Wait for the pending exchange (done by now, mostly: it ran while this rank
        computed) and raise CollectiveMisuse on every rank if the calls differ."""
        if self.pending is None:
            return
        work, got, what, raw_errors = self.pending
        self.pending = None
        try:
            work.wait()
        except RuntimeError as e:
            self._failed(e, what, raw_errors)
        seen = [tuple(int(x) for x in t) for t in got]
        if len(set(seen)) > 1:
            called = "; ".join(f"rank {r}: {_name(m, k)}" for r, (m, k) in enumerate(seen))
            self.broken = f"call #{self.calls} ({called})"
            raise CollectiveMisuse(
                f"the ranks made different fxpar calls at call #{self.calls} ({called}). "
                f"{_HOW}")

    def _failed(self, e: RuntimeError, what: str, raw_errors: bool):
        self.broken = f"call #{self.calls} ({what} on rank {self.rank})"
        if raw_errors:  # pm.step: runtime/faults.step_context names the dead/hung rank
            raise e
        raise CollectiveMisuse(
            f"rank {self.rank} called {what} (its fxpar call #{self.calls}) and the other "
            f"ranks did not make a matching call ({_short(e)}): a rank that skips a "
            f"collective call, or whose process ended or died, leaves the others waiting. "
            f"{_HOW}") from None


_HOW = ("pm.step, evaluate, full_state_dict, full_params, save, load, trace and "
        "save_pretrained are collective: call each on every rank, in the same order (e.g. "
        "`loss = pm.evaluate(batch)` on every rank, then `if rank == 0: print(loss)`).")


def _name(model_id: int, method: int) -> str:
    if method == END:
        return "its program ended"
    return f"pm.{METHODS[method]}" + (f" of ParallelModel #{model_id}" if model_id else "")


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return text[-200:]


def _current(timeout=None) -> _Ledger | None:
    global _ledger
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if _ledger is None or _ledger.world is not dist.group.WORLD:
        if timeout is None:
            return None  # no ParallelModel on this process group yet
        first = _ledger is None
        _ledger = _Ledger(timeout)
        if first:
            atexit.register(_at_exit)
            sys.excepthook = _noting_failure(sys.excepthook)
    return _ledger


def register(timeout) -> int:
    """A ParallelModel is being built (collective: every rank builds it): its id, 0 for the
    first of the process (messages name later ones). `timeout` (a timedelta, FXPAR_TIMEOUT)
    bounds the wait for a peer that never calls."""
    ledger = _current(timeout)
    if ledger is None:
        return 0
    ledger.models += 1
    return ledger.models - 1


def agree(model_id: int, method: str, raw_errors: bool = False) -> None:
    """Raise CollectiveMisuse on every rank unless all ranks are calling `method` of the
    same ParallelModel now. No-op in a single process. raw_errors: a peer that does not
    answer (dead, hung) raises the collective's own error, for runtime/faults to explain."""
    _begin(model_id, method, raw_errors)
    settle()


def begin(model_id: int, method: str, raw_errors: bool = False) -> None:
    if method == "step" and os.environ.get("FXPAR_CHECK_CALLS", "1") == "0":
        return  # opted out: see the module docstring
    _begin(model_id, method, raw_errors)


def _begin(model_id: int, method: str, raw_errors: bool = False) -> None:
    """`agree`, with the check deferred to the next `settle`: pm.step begins its call and
    computes while the fingerprints travel; the runtime settles before the step's first
    communication (runtime/comm, the pipeline's transfers, the optimizer), so a mismatch
    still raises before any collective of the step is issued."""
    ledger = _current()
    if ledger is not None and not ledger.ended:
        ledger.begin(model_id, METHODS.index(method), f"pm.{method}", raw_errors)


def settle() -> None:
    """Check a begun call (no-op when none is pending: cheap enough for every collective)."""
    if _ledger is not None and _ledger.pending is not None:
        if not dist.is_initialized() or _ledger.world is not dist.group.WORLD:
            _ledger.pending = None  # begun on a process group since destroyed
            return
        _ledger.settle()


def end_of_program() -> None:
    """This rank's program is done with fxpar: peers still calling fxpar methods fail at once
    (with which call) instead of waiting out the timeout. Ranks that all end agree."""
    ledger = _ledger
    if ledger is None or ledger.ended or ledger.broken or not dist.is_initialized() \
            or ledger.world is not dist.group.WORLD:
        return
    ledger.ended = True
    try:
        ledger.begin(0, END, "the end of its program", raw_errors=True)
        ledger.settle()
    except RuntimeError as e:  # CollectiveMisuse (a peer called something else) propagates
        if isinstance(e, CollectiveMisuse):
            raise
        # a peer still busy outside fxpar past FXPAR_TIMEOUT, or gone: this rank's program
        # was right, so it ends quietly (a peer that calls fxpar later fails on its own)
        print(f"fxpar: rank {ledger.rank} ended while a peer had not ({_short(e)})",
              file=sys.stderr)


def _noting_failure(hook):
    def excepthook(*exc):
        global _raised
        _raised = True  # its launcher stops the peers: waiting for them here would delay that
        hook(*exc)
    return excepthook


def _at_exit() -> None:
    global _ledger
    try:
        if not _raised:
            end_of_program()
    except CollectiveMisuse as e:  # the job already failed on the peers: say why here too
        print(f"fxpar: {e}", file=sys.stderr)
    except Exception:  # noqa: BLE001 - exiting anyway (e.g. the group is gone)
        pass
    finally:  # the side group goes with the others (runtime/dist._destroy_at_exit, next),
        _ledger = None  # not at the interpreter's finalization


def collective(method):
    """Decorator for a ParallelModel method every rank must call: agree first (a nested
    collective method, e.g. save calling full_state_dict, does not agree again)."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if getattr(self, "_in_collective", False):
            return method(self, *args, **kwargs)
        agree(getattr(self, "_call_id", 0), name)
        self._in_collective = True
        try:
            return method(self, *args, **kwargs)
        finally:
            self._in_collective = False
    return wrapper
