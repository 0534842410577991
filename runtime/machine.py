"""The machine a plan="auto" job plans for, measured by the runtime and handed to the planner
as values (cost.Hardware, timings): the planner itself opens no process group and times
nothing.

On CPU ranks every measurement runs on every rank at once (each sees its share of the
cores, as the job's steps will) and rank 0's figures are broadcast, so every rank prices
with the same numbers and picks the same plan. On GPUs the data sheet's rates are used and
only the memory per device is agreed on.

What was measured is remembered on disk (`remembered`: FXPAR_CACHE_DIR, else fxpar/ in
Inductor's cache directory, as compiled code is), keyed by this machine, the job's shape and
fxpar's own code: a job launched again on the same machine skips the measuring (seconds of
its start-up) and, priced with the same figures, picks the same plan - one measurement's
noise no longer changes the choice between launches. FXPAR_PLAN_CACHE=0 measures again
(and remembers nothing).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
import platform
import socket
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from fxpar.core import cost
from fxpar.core.logs import announce
from fxpar.core.source_version import source_version
from fxpar.runtime import comm, optim
from fxpar.runtime import dist as rdist

log = logging.getLogger(__name__)


def machine_key() -> list[str]:
    """What the figures measured here depend on: the host and its CPU, the cores this rank
    may use and the ranks sharing them, the job's world size, torch and its threads, and
    fxpar's code (its measurements and what it derives from them)."""
    ranks, cores = rdist.local_ranks_and_cores()
    world = dist.get_world_size() if dist.is_initialized() else 1
    return [socket.gethostname(), platform.processor() or platform.machine(), _cpu_model(),
            f"cores={cores} local={ranks} world={world}", torch.__version__,
            f"threads={torch.get_num_threads()}", code_version()]


def remembered(kind: str, key: list[str], compute: Callable[[], Any]) -> tuple[Any, bool]:
    """(compute()'s value, whether it came from the disk). Collective: rank 0 looks `key` up
    and every rank learns whether it was found (a measurement runs on every rank together
    or on none); found, every rank gets rank 0's value; else every rank computes and rank 0
    stores its value (picklable). FXPAR_PLAN_CACHE=0: always computed, never stored."""
    on = os.environ.get("FXPAR_PLAN_CACHE", "1") != "0"
    path = os.path.join(_cache_dir(), f"{kind}-"
                        + hashlib.sha256("\0".join(key).encode()).hexdigest()[:32] + ".pkl")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    found = [None]
    if on and rank0 and os.path.exists(path):
        try:
            with open(path, "rb") as f:
                found = [pickle.load(f)]
        except Exception as e:  # noqa: BLE001 - a stale or partial entry: measure again
            log.debug("planner cache entry %s unreadable (%s): measuring", path, e)
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        return found[0], True
    value = compute()
    if on and rank0:  # (only rank 0 writes: nothing here may raise, or the others would wait)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                pickle.dump(value, f)
            os.replace(tmp, path)  # atomic: a job reading it never sees half a file
        except Exception as e:  # noqa: BLE001 - a read-only cache: measured, not remembered
            log.debug("planner: could not remember %s in %s: %s", kind, path, e)
            try:
                os.remove(tmp)
            except OSError:
                pass
    return value, False


def _cache_dir() -> str:
    """Beside fxpar's compiled code (compiler/codegen.cache_dir): FXPAR_CACHE_DIR, else
    fxpar/ in Inductor's cache directory; the planner's figures in its planner/ folder."""
    if os.environ.get("FXPAR_CACHE_DIR"):
        return os.path.join(os.environ["FXPAR_CACHE_DIR"], "planner")
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_dir
    return os.path.join(inductor_dir(), "fxpar", "planner")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "")
    except OSError:
        return ""


def code_version() -> str:
    """A hash of the compiler's, the passes' and the runtime's source (what measures, what
    the probes run and what prices): any change to it measures again."""
    return source_version("compiler", "runtime", "passes")


def measure(device: torch.device) -> cost.Hardware:
    """`device`'s rates, the collectives' times on this job's process group (CPU ranks), the
    fewest bytes of memory any rank has. CPU figures are remembered per machine and job
    shape (`remembered`)."""
    if device.type == "cuda":
        hw = cost.gpu_hardware(device)
    else:
        hw, cached = remembered("machine", machine_key(), _measure_cpu)
        if cached:
            hw = dataclasses.replace(hw, calibrated=hw.calibrated + " (remembered: "
                                     "FXPAR_PLAN_CACHE=0 measures again)")
    hw.memory = cost.device_memory(device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if dist.is_initialized() and 0 < local < dist.get_world_size():  # torchrun over nodes:
        hw.devices_per_node = local  # groups spanning more ranks cross the nodes' network
    if dist.is_initialized():
        mem = torch.tensor([hw.memory], dtype=torch.float64)
        dist.all_reduce(mem, op=dist.ReduceOp.MIN)
        hw.memory = int(mem.item())
    return hw


def _measure_cpu() -> cost.Hardware:
    """This CPU's matmul and copy rates and the collectives' times on the job's group."""
    if dist.is_initialized():  # all ranks measure at once: each sees its share of the CPU
        dist.barrier()
    hw = cost.cpu_hardware()
    if dist.is_initialized():
        with announce(log, "planner: timing this machine's collectives"):
            table = comm.measure_collectives()
        link = cost.link_from_table(table, dist.get_world_size()) or hw.intra
        ranks, cores = rdist.local_ranks_and_cores()
        peak, bandwidth, overhead = broadcast_figures(
            [hw.peak_flops["fp32"], hw.mem_bandwidth, hw.node_overhead])
        hw = dataclasses.replace(hw, peak_flops={"fp32": peak, "bf16": peak / 4,
                                                 "fp16": peak / 8},
                                 mem_bandwidth=bandwidth, node_overhead=overhead,
                                 intra=link, inter=link, collectives=table, overlap=0.0,
                                 core_share=min(1.0, cores / max(ranks, 1)))
    return hw


def broadcast_figures(values: list[float | None]) -> list[float | None]:
    """Rank 0's numbers on every rank (None passes as None): the same prices, the same plan."""
    if not dist.is_initialized():
        return list(values)
    v = torch.tensor([-1.0 if x is None else float(x) for x in values], dtype=torch.float64)
    dist.broadcast(v, src=0)
    return [None if y < 0 else float(y) for y in v.tolist()]  # (times, rates: >= 0)


def time_in_lock_step(fn: Callable[[], Any], reps: int = 3) -> tuple[float, float]:
    """fn's median time over `reps` runs after one warm-up, every rank starting each run
    together (a barrier), and its spread ((slowest - fastest) / median)."""
    sync = dist.barrier if dist.is_initialized() else (lambda: None)
    fn()
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2], (ts[-1] - ts[0]) / ts[len(ts) // 2]


def time_alone(fn: Callable[[], Any], reps: int = 2) -> float | None:
    """fn's median time on rank 0 while the other ranks wait (as a pipeline rank runs while
    the others are in a bubble); None without other ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    dist.barrier()
    t = -1.0
    if dist.get_rank() == 0:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        t = sorted(ts)[len(ts) // 2]
    dist.barrier()
    return t


def time_model(graph: Callable, args: list, params: list[torch.Tensor], optimizer,
               fused: bool = False, small: tuple[Callable, list] | None = None,
               alone: bool = True
               ) -> tuple[float, float, float | None, float | None, float | None]:
    """The captured joint graph run on real tensors and the optimizer's step on copies of the
    parameters, each timed in lock step: (graph seconds, its spread, step seconds or None
    when `optimizer` is a built instance, which cannot be re-made on copies, the graph's
    seconds on rank 0 alone or None on one rank, the seconds of `small` = (the graph at fewer
    of the batch's rows, its inputs) or None). `fused`: the runtime will run the optimizer as
    torch's fused kernel (Inductor's codegen), so it is timed so. `alone` False: not timed
    alone (None; where the ranks oversubscribe the cores the planner prices the shared
    cores instead, and on 4 ranks over 2 cores the two runs took 0.6 s of planning). Rank
    0's figures, on every rank."""
    with torch.no_grad():
        t_graph, spread = time_in_lock_step(lambda: graph(*args))
        t_alone = time_alone(lambda: graph(*args)) if alone else None
        # (a few rows: cheap, so timed more often; the planner's per-call price rests on it)
        t_small = time_in_lock_step(lambda: small[0](*small[1]), reps=5)[0] if small else None
    step_s = None
    if optimizer is None or not isinstance(optimizer, torch.optim.Optimizer):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for p in ps:
            p.grad = torch.zeros_like(p)
        opt = (optimizer or (lambda q: torch.optim.SGD(q, lr=1e-3)))(ps)
        if fused:  # ~3x faster on CPU than torch's loop over the tensors (runtime/optim)
            optim.prefer_fused(opt)
        with torch.no_grad():
            step_s = time_in_lock_step(opt.step)[0]
    return tuple(broadcast_figures([t_graph, spread, step_s, t_alone, t_small]))


def shared_over_ranks(jobs: list[Callable[[], Any]]) -> list:
    """Run each job on one rank and give every rank every job's (picklable) result: work
    each rank would otherwise repeat alike, in about 1/world of the time. The jobs come
    heaviest first and are dealt in snake order (ranks 0..w-1, then w-1..0, ...), so on 2
    ranks the heaviest runs alone and the next two share a rank."""
    if not dist.is_initialized():
        return [job() for job in jobs]
    world, rank = dist.get_world_size(), dist.get_rank()

    def owner(i):
        turn, k = divmod(i, world)
        return k if turn % 2 == 0 else world - 1 - k
    mine = {i: job() for i, job in enumerate(jobs) if owner(i) == rank}
    every = [None] * world
    dist.all_gather_object(every, mine)
    return [every[owner(i)][i] for i in range(len(jobs))]


def every_rank(obj) -> list:
    """Each rank's `obj` (picklable), on every rank ([obj] without a process group)."""
    if not dist.is_initialized():
        return [obj]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every
