"""Failures that end a training job cleanly: a dead or raising rank, a non-finite loss.

Timeouts: every process group gets FXPAR_TIMEOUT (runtime/dist.py), which bounds every
collective and every pipeline send/recv (gloo applies the group's timeout to a P2P wait), so
a rank that stops answering makes the others fail within that time instead of hanging.

What the user sees. `pm.step` runs inside `step_context`:
- a rank whose step raises (a bug, out of memory, a NaN check) re-raises its own exception,
  with a note naming its rank and the step, after publishing "rank r raised at step n: ..."
  in the job's c10d store;
- a rank whose collective or transfer fails (the peer's socket closed because it died, or
  the timeout passed) raises RankFailure naming the step and the culprit: a rank that
  published an error, or a rank whose process is gone (each rank records its host and pid in
  the store at its first step; same-host processes are checked), else "no rank reported an
  error" (a hung rank or one on another host).
- `fxpar.launch` and torchrun (torch's elastic agent) stop the remaining ranks with SIGTERM
  as soon as one fails; torchrun's report names the root-cause rank and its signal or exit
  code, each stopped rank prints the step it was in (a SIGTERM handler installed at the
  first step when none is set), and fxpar.launch raises LaunchError with the failing rank,
  its signal/exit code and its step (ranks write their step to a progress file the launcher
  reads: FXPAR_PROGRESS_DIR).

NaN/inf loss (fp32/bf16; fp16's loss scaler skips such steps instead): `check_loss` runs
after the forward and backward, before the optimizer step, and raises NonFiniteLossError
with the step number on every rank alike (the loss is the same on all ranks). With
FXPAR_DEBUG_NAN=1 every graph runs under a checking fx.Interpreter (slow: a debug mode, like
torch.autograd.detect_anomaly) that records the first node whose output is not finite, and
the error names it per rank: node name, op, module path (meta["module"]) and region.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.fx
import torch.utils._pytree as pytree

from fxpar.core.errors import CollectiveMisuse, NonFiniteLossError, RankFailure

_first: dict | None = None   # this step's first non-finite value on this rank (debug mode)
_registered: set = set()
_COMM_WORDS = ("connection closed", "connection reset", "timed out", "timeout", "gloo",
               "nccl", "broken pipe", "socket", "peer")


def debug_nan() -> bool:
    return os.environ.get("FXPAR_DEBUG_NAN", "0") not in ("", "0")


# --- non-finite losses ------------------------------------------------------------------

class _Watch(torch.fx.Interpreter):
    """Runs a graph node by node and records the first non-finite floating-point output."""

    def run_node(self, n):
        out = super().run_node(n)
        global _first
        if _first is None:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and \
                        not bool(torch.isfinite(t).all()):
                    op = f"input {n.meta.get('fqn') or n.name}" if n.op == "placeholder" \
                        else str(n.target) if isinstance(n.target, torch._ops.OpOverload) \
                        else getattr(n.target, "__name__", str(n.target))
                    _first = {"node": n.name, "op": op, "module": n.meta.get("module") or "-",
                              "region": n.meta.get("region") or n.meta.get("role") or "?",
                              "value": "nan" if bool(torch.isnan(t).any()) else "inf"}
                    break
        return out


def run(gm: torch.fx.GraphModule, *args):
    """gm(*args), or under the non-finite watcher in debug mode."""
    if debug_nan():
        return _Watch(gm).run(*args)
    return gm(*args)


def check_loss(loss: torch.Tensor | None, plan) -> None:
    """Raise NonFiniteLossError (same on every rank) if the step's loss is NaN/inf."""
    if loss is None or plan.precision == "fp16" or bool(torch.isfinite(loss).all()):
        return
    where = ""
    if debug_nan():
        firsts = [_first]
        if dist.is_initialized() and dist.get_world_size() > 1:
            firsts = [None] * dist.get_world_size()
            dist.all_gather_object(firsts, _first)
        found = [f"rank {r}: node {f['node']} ({f['op']}, module {f['module']!r}, "
                 f"{f['region']}) made {f['value']}" for r, f in enumerate(firsts) if f]
        where = (" First non-finite value per rank: " + "; ".join(found) + ".") if found else \
            " No graph node made a non-finite value (the loss combined them)."
    else:
        where = " Set FXPAR_DEBUG_NAN=1 to find the first graph node that makes it."
    raise NonFiniteLossError(
        f"step {_current}: the loss is {loss.item()} (not finite); the optimizer step was not "
        f"applied.{where} Usual causes: a too large learning rate, bad input data, a log/div "
        "of zero in the loss.")


# --- failing ranks ----------------------------------------------------------------------

_current = 0


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def _register(world) -> None:
    """Record this rank's host and pid in the job's store once, so the others can tell a dead
    process from a hung one."""
    if world.size == 1 or world.rank in _registered:
        return
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    store = _store()
    if store is not None:
        store.set(f"fxpar/proc/{world.rank}", f"{socket.gethostname()} {os.getpid()}")
    _registered.add(world.rank)


def _on_sigterm(signum, frame):
    """torchrun / fxpar.launch end the other ranks with SIGTERM when one fails: say where this
    rank was, then die of SIGTERM as before (the launcher's report stays the same)."""
    rank = os.environ.get("RANK", "?")
    sys.stderr.write(f"fxpar: rank {rank} stopped by SIGTERM in or after step {_current} (the "
                     "launcher ends every rank when one fails: see its root-cause rank).\n")
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _progress(world, step) -> None:
    d = os.environ.get("FXPAR_PROGRESS_DIR")
    if d:
        path = os.path.join(d, f"rank{world.rank}")
        with open(path + ".tmp", "w") as f:  # atomic: a rank killed meanwhile leaves the last
            f.write(str(step))
        os.replace(path + ".tmp", path)


@contextlib.contextmanager
def step_context(world, step: int):
    """Around one pm.step: numbers it, and turns a failure into an error naming rank and step."""
    global _first, _current
    _first, _current = None, step
    _register(world)
    _progress(world, step)
    try:
        yield
    except (NonFiniteLossError, CollectiveMisuse):  # raised alike on every rank
        raise
    except Exception as e:
        if world.size == 1:
            raise
        if _is_comm_failure(e):
            msg, peer_died = _explain(world, step, e)
            if peer_died:  # a peer was killed: its launcher (fxpar.launch, torchrun) sees
                time.sleep(0.5)  # that exit first and names it as the cause, not this one
            raise RankFailure(msg) from e
        _publish(world.rank, f"raised at step {step}: {type(e).__name__}: {e}")
        e.add_note(f"fxpar: raised on rank {world.rank} at step {step}; the other ranks stop "
                   "with a RankFailure naming this rank.")
        raise


def _is_comm_failure(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, dist.DistError) or any(w in str(e).lower() for w in _COMM_WORDS):
            return True
        e = e.__cause__ or e.__context__
    return False


def _publish(rank: int, msg: str) -> None:
    store = _store()
    if store is None:
        return
    try:
        store.set_timeout(datetime.timedelta(seconds=5))
        store.set(f"fxpar/failed/{rank}", msg[:800])
    except Exception:  # the store may be gone too; the exception itself still propagates
        pass


def _gone(host_pid: str) -> bool:
    host, pid = host_pid.split()
    if host != socket.gethostname():
        return False  # cannot tell from here
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # zombie / dead
    except FileNotFoundError:
        return True


def _explain(world, step: int, e: BaseException) -> tuple[str, bool]:
    """Who made this rank's collective fail: a rank that published an error, a rank whose
    process is gone, or nobody known (a hang: the timeout passed); and whether a peer died."""
    me, others = world.rank, [r for r in range(world.size) if r != world.rank]
    store = _store()
    culprits: dict[int, str] = {}
    note, died = "", False
    if store is not None:
        try:
            store.set_timeout(datetime.timedelta(seconds=5))
            deadline = time.time() + 3.0  # a raising rank publishes as it exits
            while not culprits:
                for r in others:
                    if store.check([f"fxpar/failed/{r}"]):
                        culprits[r] = store.get(f"fxpar/failed/{r}").decode()
                    elif store.check([f"fxpar/proc/{r}"]):
                        hp = store.get(f"fxpar/proc/{r}").decode()
                        if _gone(hp):
                            died = True
                            culprits[r] = (f"died (its process {hp.split()[1]} is gone: it "
                                           "exited, or was killed, e.g. by SIGKILL or the "
                                           "out-of-memory killer; see its log)")
                if culprits or time.time() > deadline:
                    break
                time.sleep(0.2)
        except Exception as se:  # the store's host (rank 0 / the launcher) may be the dead one
            note = f" (the job's store is unreachable too: {type(se).__name__})"
    tmo = os.environ.get("FXPAR_TIMEOUT", "600")
    if culprits:
        who = "; ".join(f"rank {r} {why}" for r, why in sorted(culprits.items()))
    else:
        who = (f"no other rank reported an error{note}: a rank is hung or slow (no answer "
               f"within FXPAR_TIMEOUT={tmo} s), or died on another host")
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    who = who.rstrip().rstrip(".")  # (a quoted error's own full stop: not "..")
    return (f"step {step} stopped on rank {me} of {world.size}: {who}. Its collective/transfer "
            f"failed with: {first}"), died
