"""Process groups, device mesh, backend choice (NCCL for CUDA, gloo for CPU), launch.

Every group gets a timeout (FXPAR_TIMEOUT seconds, default 600), the mesh's sub-groups too
(`_timed_groups`), so a dead or hung rank ends the job with an error instead of a hang: it
bounds every collective and every send/recv wait (gloo applies it to P2P waits as well).

CPU ranks share the host's cores: each gets cores / local ranks intra-op threads unless
OMP_NUM_THREADS says otherwise (`_share_cores`). torch's default (every core per process)
oversubscribes the host, and OpenMP's spinning threads then make a 4-rank step 5-15x slower
on 2 cores (measured: dp=4 GPT step 604 ms -> 44 ms); torchrun sets OMP_NUM_THREADS=1 for
the same reason, but fxpar.launch and hand-spawned ranks do not go through it.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import traceback
import uuid
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from fxpar.core.errors import FxparError, PlanError
from fxpar.core.plan import world_of
from fxpar.runtime import calls

log = logging.getLogger(__name__)


def timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("FXPAR_TIMEOUT", "600")))


@dataclasses.dataclass
class World:
    size: int
    rank: int
    device: torch.device
    mesh: Any = None  # torch DeviceMesh when size > 1
    # the process group of the ranks this World spans: None for the default group; Plan.ps's
    # workers (the first ranks) see a World of the workers alone
    group: Any = None

    def _has(self, dim: str) -> bool:
        # (HSDP's "dp" is the flattened ("dp_rep", "dp_shard"): `setup`)
        return self.mesh is not None and (dim in (self.mesh.mesh_dim_names or ()) or
                                          dim in getattr(self.mesh, "_flatten_mapping", {}))

    def group_name(self, dim: str) -> str | None:
        return self.mesh.get_group(dim).group_name if self._has(dim) else None

    def coordinate(self, dim: str) -> int:
        """This rank's index along mesh dim `dim` (0 for a dim the mesh does not have)."""
        return self.mesh.get_local_rank(dim) if self._has(dim) else 0


_opened = 0  # process groups fxpar has opened in this process
_from_rank_0: dict[str, int] = {}  # from_rank_0 calls per group (its ranks count alike)


def from_rank_0(make: Callable[[], Any], group=None) -> Any:
    """make() run on rank 0 alone, its (picklable) value returned on every rank of `group`
    (default: the job's; it must hold global rank 0); an exception it raises is raised on
    every rank. Every rank of `group` calls it as often as the others (the store's keys are
    counted per group in each process).

    The other ranks wait for rank 0 to begin within FXPAR_TIMEOUT, as for any collective,
    then for make() however long it takes, up to an hour or FXPAR_TIMEOUT if longer: they
    block on keys of the job's c10d store, whose waits take a timeout each (the groups'
    collectives are bounded by FXPAR_TIMEOUT), then take the value by broadcast (a tree over
    the ranks, not each one reading the store's single server)."""
    name = "world" if group is None else group.group_name
    n = _from_rank_0[name] = _from_rank_0.get(name, -1) + 1
    key = f"fxpar/from_rank_0/{name}/{n}"
    store = dist.distributed_c10d._get_default_store()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        store.set(key + "/begun", "1")
        try:
            box[0] = ("value", make())
        except BaseException as e:
            box[0] = ("error", _portable(e))
            try:
                store.set(key, "error")
                dist.broadcast_object_list(box, src=0, group=group)
            except Exception as comm:  # noqa: BLE001 - make()'s error is the one to see
                log.warning("rank 0 could not send its error to the other ranks: %s", comm)
            raise
        store.set(key, "value")
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0][1]
    long = max(timeout(), datetime.timedelta(hours=1))
    for k, limit, what in ((key + "/begun", timeout(), "to begin compiling the Program"),
                           (key, long, "to compile the Program")):
        try:
            store.wait([k], limit)
        except Exception as e:  # noqa: BLE001 - c10d's timeout error names no cause
            raise FxparError(
                f"rank {dist.get_rank()} waited {limit.total_seconds():.0f} s for rank 0 {what}"
                f": rank 0 failed or is stuck before it, see its log ({type(e).__name__}: "
                f"{e})") from None
    dist.broadcast_object_list(box, src=0, group=group)
    kind, value = box[0]
    if kind == "error":
        value.add_note("(raised on rank 0, where the Program is compiled, and sent here)")
        raise value
    return value


def _portable(e: BaseException) -> BaseException:
    """e as it can be pickled to the other ranks: itself, or an FxparError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - an exception whose arguments do not pickle
        return FxparError(f"{type(e).__name__}: {e}")


def _open_default_group(backend: str) -> None:
    """init_process_group from the environment (torchrun's, fxpar.launch's), its keys under a
    prefix of their own each time: under torchrun the ranks share the agent's store, where a
    group opened before in this process (one a failed parallelize closed) left its ranks'
    addresses under the keys a new default group reads (the group count restarts at 0), and
    a rank connected to its peer's old, closed address ("Connection refused")."""
    global _opened
    store, rank, size = next(dist.rendezvous("env://", timeout=timeout()))
    dist.init_process_group(backend, store=dist.PrefixStore(f"fxpar{_opened}", store),
                            rank=rank, world_size=size, timeout=timeout())
    _opened += 1


def setup(devices, dims: Sequence[tuple[str, int]] | None = None) -> World:
    """Resolve `devices` (int | device strings | DeviceMesh) into this rank's World.

    `dims` = [(name, degree)] for the mesh (e.g. [("dp", 2)]); their product is the world
    size, or less: the mesh then spans the first ranks (Plan.ps's workers; the last ranks,
    its servers, hold the mesh with no coordinate on it). HSDP's dims ("dp_rep", "dp_shard")
    are also flattened into one "dp" dimension (the whole dp group: rank r of shard group g
    is dp rank g * dp_shard + r), and expert ("edp", "ep") and context parallelism's
    ("cdp", "cp") likewise; HSDP with either ("dp_rep", "edp_shard", "ep") also into
    "dp_shard" and "edp" (with cp: "cdp_shard", "cdp"); ep with cp ("edp", "ecp", "cp" or
    "cdp", "cep", "ep": the smaller group inside the larger) into the larger group, the dp
    groups across each and "dp".
    """
    size, dev_type = world_of(devices)
    if size == 1:
        dev = torch.device(devices[0]) if isinstance(devices, (list, tuple)) else torch.device(
            dev_type)
        return World(1, 0, dev)

    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise PlanError(
                f"devices={devices!r} asks for {size} ranks but this is a single process. Run the "
                f"script with `torchrun --nproc-per-node {size} script.py`, or call "
                f"fxpar.launch(fn, {size}) to spawn local ranks.")
        _open_default_group("nccl" if dev_type == "cuda" else "gloo")
        # fxpar opened the group, so fxpar closes it: a process group left to the interpreter's
        # exit can abort the process after a correct run under torchrun ("terminate called
        # without an active exception", seen 1 run in 4 with gloo)
        atexit.register(_destroy_at_exit)
    world = dist.get_world_size()
    if world != size:
        raise PlanError(f"devices asks for {size} ranks but the job has world size {world}; "
                        f"launch with --nproc-per-node {size} or pass devices={world}.")
    rank = dist.get_rank()
    if dev_type == "cpu":
        _share_cores()
    if isinstance(devices, (list, tuple)):
        dev = torch.device(devices[rank])
    elif dev_type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    else:
        dev = torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    mesh = None
    if dims:
        from torch.distributed.device_mesh import init_device_mesh
        names = tuple(n for n, _ in dims)
        shape = tuple(d for _, d in dims)
        over = _timed_groups(dev.type, names)
        n = 1
        for d in shape:
            n *= d
        user = hasattr(devices, "get_group")
        if user and devices.mesh_dim_names == names and tuple(devices.mesh.shape) == shape:
            mesh = devices
        elif user and "dp_shard" in (devices.mesh_dim_names or ()):
            raise PlanError(
                f"the DeviceMesh passed as devices has dims {devices.mesh_dim_names} of sizes "
                f"{tuple(devices.mesh.shape)}, but the plan needs {names} of sizes {shape}: "
                "pass a mesh of the plan's shape and order, or give the plan the mesh's "
                "degrees.")
        elif n < world:  # the first n ranks (every rank builds it: new_group is collective)
            from torch.distributed.device_mesh import DeviceMesh
            mesh = DeviceMesh(dev.type, torch.arange(n).view(shape), mesh_dim_names=names,
                              backend_override=tuple(over[k] for k in names))
        else:
            mesh = init_device_mesh(dev.type, shape, mesh_dim_names=names,
                                    backend_override=dict(over))  # (it empties the dict)
        inner = next((n for n in ("edp_shard", "cdp_shard") if n in names), None)
        axis = inner and names[names.index(inner) + 1]  # (HSDP with ep or cp)
        both = next((n for n in ("ecp", "cep") if n in names), None)  # (ep with cp)
        if both:  # (the larger group, the dp groups across each, dp)
            big, small, across = ("ep", "cp", "cdp") if both == "ecp" else ("cp", "ep", "edp")
            flat = ((big, (both, small)), (across, (names[names.index(both) - 1], both)),
                    ("dp", (names[names.index(both) - 1], both, small)))
        elif inner:
            flat = (("dp_shard", (inner, axis)), (inner.removesuffix("_shard"),
                                                 ("dp_rep", inner)),
                    ("dp", ("dp_rep", inner, axis)))
        else:
            flat = [("dp", d) for d in (("dp_rep", "dp_shard"), ("edp", "ep"), ("cdp", "cp"))
                    if d[1] in names and "dp" not in names]
        for name, parts in flat:  # (HSDP with ep / cp: shard groups, "edp" / "cdp", dp)
            if name not in getattr(mesh, "_flatten_mapping", {}):
                mesh[parts]._flatten(name, backend_override=over[parts[-1]])
    return World(world, rank, dev, mesh)


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway (e.g. after a rank failure)
            pass
    # and free what still holds a group or a work handle now, while the interpreter is whole:
    # a ParallelModel is in reference cycles (its re-fit callback), so its groups and works
    # were freed by the interpreter's last collection, during finalization, where a gloo
    # object's destructor aborted the process ("terminate called without an active
    # exception", about 1 torchrun run in 6 of the quick start)
    gc.collect()


def _share_cores() -> None:
    """Give this CPU rank its share of the host's cores (see the module docstring)."""
    if "OMP_NUM_THREADS" in os.environ:
        return  # the user's (or torchrun's) choice
    local, cores = local_ranks_and_cores()
    torch.set_num_threads(max(1, cores // local))


def local_ranks_and_cores() -> tuple[int, int]:
    """The ranks on this host (torchrun's / fxpar.launch's LOCAL_WORLD_SIZE) and the cores
    this process may run on."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(local, 1), cores or 1


def _timed_groups(device_type: str, names) -> dict:
    """Options giving every mesh sub-group the FXPAR_TIMEOUT too: DeviceMesh creates its groups
    with torch's default timeout (30 min), not the default group's."""
    from torch._C._distributed_c10d import Backend as C10dBackend
    if device_type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout()
        return {n: ("nccl", opts) for n in names}
    return {n: ("gloo", C10dBackend.Options("gloo", timeout())) for n in names}


# --- launching local ranks ------------------------------------------------------------------

class LaunchError(FxparError):
    """A spawned rank failed; the message names the rank and its error."""


def _entry(payload: bytes):
    from torch.distributed.elastic.multiprocessing.errors import record
    return record(_run)(payload)


def _run(payload: bytes):
    """A launched rank: take on the caller's process state, unpickle fn and its args (by
    value: cloudpickle, so functions defined in a notebook or a script's __main__ work), run
    it, and write any exception to the progress folder so the launcher can put the real cause
    first."""
    caller, payload = pickle.loads(payload)
    _take_on(caller)
    os.environ.setdefault("FXPAR_DEVICE", "cpu")
    os.environ["FXPAR_LAUNCHED_RANK"] = os.environ.get("RANK", "0")
    try:
        fn, args = pickle.loads(payload)
        result = fn(*args)
        calls.end_of_program()  # a peer still calling fxpar fails now, not at the timeout
        return result
    except BaseException as e:
        _write_error(e, traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# The ranks are forked from a server process that imported torch and fxpar once (launching
# 2 ranks took 8-10 s on 2 cores when each imported them itself, most of a short job's time).
# A forked rank has the server's environment, working directory and sys.path, from when the
# server started: `_caller` sends the launching process's current ones, `_take_on` restores
# them, keeping the variables the launcher set for this rank (RANK, MASTER_PORT, ...: those
# that differ from the server's own, recorded by `_SERVER_ENV` when it imported this module).
_SERVER_ENV = dict(os.environ)


def _caller() -> dict:
    return {"env": dict(os.environ), "cwd": os.getcwd(), "sys_path": list(sys.path)}


def _take_on(caller: dict) -> None:
    launcher = {k: v for k, v in os.environ.items() if _SERVER_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update({**caller["env"], **launcher})
    os.chdir(caller["cwd"])
    sys.path[:] = caller["sys_path"]
    if "OMP_NUM_THREADS" in os.environ:  # OpenMP read it when the server loaded torch
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


# Model libraries whose import costs each rank seconds: when the caller has imported them (its
# model is built from them), the forkserver imports their loaded modules once, beside torch.
MODEL_LIBRARIES = ("transformers", "timm", "torchtitan", "litgpt", "torchvision", "diffusers")


def _start_method() -> str:
    """forkserver where the platform has it, spawn elsewhere. The forkserver (started at the
    first launch, kept for the later ones) imports torch, fxpar and runtime/preload.py's
    modules once, so each rank forks with them loaded rather than importing them itself."""
    import multiprocessing
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "fxpar", "fxpar.runtime.preload"])
    return "forkserver"


def _model_library_modules() -> str:
    """The caller's loaded modules of MODEL_LIBRARIES, for runtime/preload.py: the leaves
    only (importing one imports its packages), to keep the variable short."""
    names = sorted(m for m, mod in list(sys.modules.items())
                   if m.partition(".")[0] in MODEL_LIBRARIES and getattr(mod, "__file__", None))
    # (sorted, a package's modules follow it at once: "a", "a.b", "a0")
    return ",".join(m for m, after in zip(names, names[1:] + [""])
                    if not after.startswith(m + "."))


def _write_error(e: BaseException, tb: str) -> None:
    folder = os.environ.get("FXPAR_PROGRESS_DIR")
    if folder and not isinstance(e, KeyboardInterrupt):
        line = "".join(traceback.format_exception_only(type(e), e)).strip()
        with open(os.path.join(folder, f"error{os.environ.get('RANK', '0')}"), "w") as f:
            f.write(line + "\n\n" + tb)


def _guard_recursion() -> None:
    """launch inside a spawned rank would spawn ranks from every rank."""
    if "FXPAR_LAUNCHED_RANK" in os.environ:
        err = LaunchError(
            "fxpar.launch was called inside a rank it spawned (fn calls launch again, or a "
            "module the ranks import calls it at import time): call launch once, from the "
            "main process, e.g. under `if __name__ == \"__main__\":`.")
        _write_error(err, "")
        raise err


@contextlib.contextmanager
def _main_not_imported():
    """Spawned ranks need nothing from the caller's script (fn and args travel by value), so
    multiprocessing is kept from re-importing it in each rank: it would run the script's
    top-level code again (an unguarded `fxpar.launch(...)` call, model building, ...)."""
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if hasattr(main, k)}
    try:
        if main is not None and "__file__" in saved:
            del main.__file__
            main.__spec__ = None
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


@contextlib.contextmanager
def _elastic_quiet():
    """torch-elastic logs every child failure as a ~40-line traceback of its own poll loop;
    launch raises LaunchError with the child's real error instead, so those logs go quiet
    while it runs (set FXPAR_LAUNCH_VERBOSE=1 to keep them)."""
    if os.environ.get("FXPAR_LAUNCH_VERBOSE"):
        yield
        return
    elastic = logging.getLogger("torch.distributed.elastic")
    old = elastic.level
    elastic.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        elastic.setLevel(old)


def launch(fn: Callable, nprocs: int, *args) -> dict[int, Any]:
    """Run fn(*args) on `nprocs` local ranks (torchrun's elastic launcher, standalone mode).

    Returns {rank: return value}. fn and args are pickled by value (cloudpickle): a function
    defined in a notebook or in the calling script works, and the ranks do not re-import the
    script (an unguarded top-level call works too). If a rank fails, the others are
    stopped and LaunchError names the failing rank and its exception first, its traceback
    after.
    """
    import cloudpickle
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _guard_recursion()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs,
                          run_id=f"fxpar-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          start_method=_start_method())
    progress = tempfile.mkdtemp(prefix="fxpar-progress-")  # ranks write their step here
    env = {"FXPAR_PROGRESS_DIR": progress, "FXPAR_PRELOAD": _model_library_modules()}
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        # fn and args apart: a rank unpickles them once it has the caller's sys.path (`_run`)
        payload = pickle.dumps((_caller(), cloudpickle.dumps((fn, args))))
        with _elastic_quiet(), _main_not_imported():
            results = elastic_launch(config, _entry)(payload)
        return dict(sorted(results.items()))  # rank order, whichever rank finished first
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        killed = sorted((r, f) for r, f in e.failures.items()  # by a signal, not the agent's:
                        if f.exitcode is not None and f.exitcode < 0  # the cause (its peers
                        and f.exitcode != -signal.SIGTERM)  # fail on the dead connection)
        if killed:
            rank, failure = killed[0]
        errors = sorted((os.path.getmtime(os.path.join(progress, f)), int(f[5:]))
                        for f in os.listdir(progress) if f.startswith("error"))
        if errors and failure.exitcode == -signal.SIGTERM:  # a rank the agent stopped:
            rank = errors[0][1]  # the first rank that raised is the cause
            failure = e.failures.get(rank, failure)
        msg = failure.message if isinstance(failure.message, str) else \
            failure.message.get("message", str(failure.message)) if failure.message else ""
        try:
            with open(os.path.join(progress, f"error{rank}")) as f:
                line, _, tb = f.read().partition("\n\n")
            msg = line + (f"\n\nrank {rank}'s traceback:\n{tb.strip()}" if tb.strip() else "")
        except OSError:
            pass
        code = failure.exitcode
        how = f"exit code {code}" if code is None or code >= 0 else \
            f"killed by {signal.Signals(-code).name}"
        try:
            with open(os.path.join(progress, f"rank{rank}")) as f:
                how += f", its last pm.step begun: step {f.read().strip()}"
        except OSError:
            how += ", before any pm.step"
        raise LaunchError(f"rank {rank} failed ({how}): {msg or 'see its log above'}") from None
    finally:
        shutil.rmtree(progress, ignore_errors=True)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def under_torchrun() -> bool:
    """Whether this process is a rank torchrun (torch.distributed.run) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "FXPAR_LAUNCHED_RANK" not in os.environ


def launch_or_join(fn: Callable, nprocs: int, *args) -> dict[int, Any] | None:
    """Run fn(*args) on `nprocs` ranks: in the ranks torchrun started when the script runs
    under torchrun (several nodes, on one host or many), else on ranks `launch` spawns.

    A script written for `launch` then runs unchanged on torchrun's nodes (FXPAR_DEVICE
    defaults to cpu there too). Returns
    {rank: value} where `launch` would (under torchrun: on rank 0, the values gathered over
    the default group) and None on torchrun's other ranks.
    """
    if not under_torchrun():
        return launch(fn, nprocs, *args)
    world = int(os.environ["WORLD_SIZE"])
    if nprocs != world:
        raise LaunchError(f"{nprocs} ranks were asked for, but torchrun started {world}: pass "
                          f"{world} (torchrun's --nnodes x --nproc-per-node)")
    os.environ.setdefault("FXPAR_DEVICE", "cpu")  # (as a launched rank: `_run`)
    if not dist.is_initialized():
        _open_default_group("gloo")
        atexit.register(_destroy_at_exit)  # (as setup does: a gloo group left to the
        # interpreter's teardown can abort the process after a correct run)
    mine = fn(*args)
    every = [None] * world
    dist.all_gather_object(every, mine)
    calls.end_of_program()
    return dict(enumerate(every)) if dist.get_rank() == 0 else None
