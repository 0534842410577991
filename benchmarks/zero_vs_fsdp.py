"""fxpar ZeRO-3 vs torch FSDP2, and fxpar ZeRO-0 (plain dp) vs torch DDP: time, memory, loss.

    .venv/bin/python benchmarks/zero_vs_fsdp.py [--steps 30] [--warmup 3] [--layers 4]
        [--embd 256] [--batch 16] [--nprocs 2]

One launch of `--nprocs` gloo CPU ranks runs eight trainings, group by group, in the same
ranks, each from the same initial weights (torch.manual_seed(0) before building the GPT), on
the same batches, with the same optimizer (AdamW, lr 1e-3, built by a factory):

    fxpar Plan(dp=world, zero=3), codegen   vs  FSDP2: fully_shard(block) for every
    "eager" and "inductor"                      transformer block, then fully_shard(model)
                                                (defaults: reshard_after_forward=True, fp32,
                                                no CPU offload); eager and torch.compile(model)
    fxpar Plan(dp=world, zero=0), codegen   vs  DDP(bucket_cap_mb=25), eager and
    "eager" and "inductor"                      torch.compile(ddp)

With `--dp-shard N` the launch runs HSDP instead: fxpar Plan(dp=world, zero=3, dp_shard=N)
(eager and inductor) vs FSDP2's HSDP, `fully_shard` of every block and the root over a 2-D
DeviceMesh ("replicate" world/N x "shard" N; eager and torch.compile).

Under torchrun (several "nodes" on one host or on many) the script runs in the ranks torchrun
started instead of launching its own, and `--dp-shard node` makes each node one shard group:
fxpar's Plan(dp_shard="node") and FSDP2's mesh both take the node's size from torchrun's
LOCAL_WORLD_SIZE. Two "nodes" of 2 ranks on localhost:

    for n in 0 1; do .venv/bin/python -m torch.distributed.run --nnodes 2 --node-rank $n \
        --nproc-per-node 2 --master-addr localhost --master-port 29533 \
        benchmarks/zero_vs_fsdp.py --dp-shard node & done; wait

fxpar's `pm.step` takes the GLOBAL batch; FSDP2 and DDP get this rank's 1/world slice of it
and report the all-reduced mean loss, so all sides report the mean loss of the same batch.

FSDP2 on CPU/gloo (torch 2.13): it needs no special option. With a CPU DeviceMesh (the
default mesh when no accelerator is present) FSDP2 takes the CPU device
(`_get_device_from_mesh`), its streams/events are no-ops, and gloo supports the all-gather
and the reduce-scatter it issues, including ReduceOp.AVG (fp32 gradients use AVG; checked
by the loss agreement printed below). The tied embedding / lm_head weight lives in the root
group.

Timing: median wall time of `--steps` steps after `--warmup` warm-up steps and one memory
step; a dist.barrier() before each step; each step includes the loss all-reduce of the peers.
The four sides of a group are all built first, then their timed steps alternate (step s of
each side back to back, the order rotating), so a change in the machine's load during the
run hits all sides alike; times and the ratios fxpar / peer are rank 0's (the barrier keeps
the ranks in step).

Memory (per rank, CPU, measured, the same way for all four sides): a MemoryTracker
(fxpar.runtime.memtrack's TorchDispatchMode) is entered right after the plain GPT is built
and stays on through the wrapping (fxpar.parallelize / fully_shard / DDP(...)), the warm-up
steps and one measured step. It starts from the storages of the fresh model's parameters
and buffers and adds every storage any op allocates from then on (C++ allocations too: DDP's
reducer buckets, FSDP2's all-gather buffers, optimizer state), each held by weak reference
until it dies. During the measured step, after every op, it sums the *current* nbytes of all
live tracked storages (current, not at allocation: FSDP2 frees and re-allocates unsharded
parameters by resizing their storages in place, which no dispatcher op shows). Reported:
  held   = live bytes just before the step (parameters, gradients kept between steps,
           optimizer state, communication buckets: everything persistent),
  peak   = the maximum over the step, held state included (params + grads + optimizer state
           + activations + communication buffers),
both the maximum over ranks (peak is the number to compare: torch keeps .grad between steps
until the next zero_grad(set_to_none) frees it at the step's start, so DDP's and FSDP2's held
include gradients, fxpar's gradients are graph outputs freed after the update). Outputs of tensor subclasses (FSDP2's DTensor parameters and
optimizer state) are counted through their local tensors; fake / meta tensors (fxpar's
tracing) have no memory and are skipped. Python cyclic garbage is collected before the
measured step. The tracker slows that one step; it is not among the timed steps. Code that
Inductor generated (fxpar codegen="inductor", torch.compile) allocates its buffers below the
dispatcher, where the tracker cannot see them: those sides print no memory ("n/a"), and the
memory ratios compare the op-by-op sides.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

import fxpar
from fxpar.examples import models as M
from fxpar.runtime import dist as rdist
from fxpar.runtime.memtrack import StepMemory


def _cfg(args):
    return M.GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4,
                       n_embd=args.embd)


# --- memory -------------------------------------------------------------------------------

# --- the four trainings -------------------------------------------------------------------

def _local(batch, rank, world):
    per = batch[0].shape[0] // world
    return tuple(t[rank * per:(rank + 1) * per] for t in batch)


def _peer_step(module, opt, rank, world):
    def step(batch):
        opt.zero_grad()
        loss = module(_local(batch, rank, world))
        loss.backward()
        opt.step()
        red = loss.detach().clone()
        dist.all_reduce(red)
        return (red / world).item()
    return step


def _build(kind, cfg, data, world, rank, opt_factory, dp_shard=None):
    """Wrap a fresh GPT (seed 0) for `kind`; return (step(global_batch) -> float loss)."""
    torch.manual_seed(0)
    model = M.GPT(cfg)
    initial = [*model.parameters(), *model.buffers()]
    tracker = StepMemory(initial)
    del initial
    tracker.__enter__()
    if kind.startswith("fxpar"):
        hsdp = kind[5] == "h"
        plan = fxpar.Plan(dp=world, zero=3 if hsdp else int(kind[5]),
                          dp_shard=dp_shard if hsdp else None,
                          codegen="inductor" if kind.endswith("i") else "eager")
        pm = fxpar.parallelize(model, world, example_batch=data[0], optimizer=opt_factory,
                               plan=plan)
        step = lambda b: pm.step(b).item()  # noqa: E731
    elif kind.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        # HSDP: a 2-D mesh (replicate, shard), the shard dim innermost as fxpar's
        shard = int(os.environ["LOCAL_WORLD_SIZE"]) if dp_shard == "node" else dp_shard
        mesh = init_device_mesh("cpu", (world // shard, shard),
                                mesh_dim_names=("replicate", "shard")) \
            if kind.startswith("fsdp2h") else None
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fwd = torch.compile(model) if kind.endswith("c") else model
        step = _peer_step(fwd, opt_factory(model.parameters()), rank, world)
    elif kind.startswith("ddp"):
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        fwd = torch.compile(ddp) if kind.endswith("c") else ddp
        step = _peer_step(fwd, opt_factory(ddp.parameters()), rank, world)
    else:
        raise ValueError(kind)
    return step, tracker


def _prepare(kind, args, cfg, data, world, rank, opt_factory):
    """Build `kind`, run the warm-up steps and the memory step (all under its tracker)."""
    step, tracker = _build(kind, cfg, data, world, rank, opt_factory, args.dp_shard)
    losses = []
    for s in range(args.warmup + 1):
        batch = data[s % len(data)]
        if s < args.warmup:
            losses.append(step(batch))
        else:  # the memory step, under the tracker's window
            dist.barrier()
            with tracker.window():
                losses.append(step(batch))
    tracker.__exit__(None, None, None)
    return step, {"losses": losses, "times": [], "held": tracker.held, "peak": tracker.peak_live}


def _group(kinds, args, cfg, data, world, rank, opt_factory):
    """All sides of a group built and warmed up, then timed steps interleaved: step s runs
    the same batch on each side, the order rotating, so a change in the machine's load hits
    all alike."""
    sides = [_prepare(k, args, cfg, data, world, rank, opt_factory) for k in kinds]
    for s in range(args.warmup + 1, args.warmup + 1 + args.steps):
        batch = data[s % len(data)]
        k = s % len(sides)
        for step, res in sides[k:] + sides[:k]:
            dist.barrier()
            t = time.perf_counter()
            res["losses"].append(step(batch))
            res["times"].append(time.perf_counter() - t)
    out = {}
    for kind, (_, res) in zip(kinds, sides):
        res["time"] = statistics.median(res.pop("times"))
        out[kind] = res
    del sides
    gc.collect()
    return out


# (name, kind) per side: fxpar op by op, fxpar with Inductor, the peer, the peer compiled
GROUPS = ((("fxpar zero=3", "fxpar3"), ("fxpar zero=3 inductor", "fxpar3i"), ("FSDP2", "fsdp2"),
           ("FSDP2 + compile", "fsdp2c")),
          (("fxpar zero=0", "fxpar0"), ("fxpar zero=0 inductor", "fxpar0i"), ("DDP", "ddp"),
           ("DDP + compile", "ddpc")))
HSDP = (("fxpar HSDP", "fxparh"), ("fxpar HSDP inductor", "fxparhi"), ("FSDP2 HSDP", "fsdp2h"),
        ("FSDP2 HSDP + compile", "fsdp2hc"))
GENERATED = ("fxpar3i", "fsdp2c", "fxpar0i", "ddpc", "fxparhi", "fsdp2hc")  # (docstring)


def _groups(args):
    return (HSDP,) if args.dp_shard else GROUPS


def bench(args):
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if not dist.is_initialized():  # the peers need the group even before fxpar makes it
        dist.init_process_group("gloo", timeout=rdist.timeout())
    cfg = _cfg(args)
    data = [M.gpt_batch(cfg, args.batch, seed=s) for s in range(4)]
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    out = {}
    for group in _groups(args):
        out.update(_group([k for _, k in group], args, cfg, data, world, rank, opt))
    return out


def _mib(n):
    return n / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--dp-shard", type=lambda v: v if v == "node" else int(v), default=None,
                    help="instead: HSDP with shard groups of this many ranks, or 'node' "
                    "under torchrun (fxpar Plan(zero=3, dp_shard=N) vs FSDP2's fully_shard "
                    "over a 2-D mesh)")
    args = ap.parse_args()
    torchrun = rdist.under_torchrun()  # (then the script runs in the ranks torchrun started)
    if torchrun:
        args.nprocs = int(os.environ["WORLD_SIZE"])
    shard = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) if args.dp_shard == "node" \
        else args.dp_shard
    if args.dp_shard == "node" and not torchrun:
        ap.error("--dp-shard node takes the node's size from torchrun: run under torchrun")
    if shard and (args.nprocs % shard or shard >= args.nprocs):
        ap.error(f"--dp-shard {shard} must divide --nprocs {args.nprocs} and be less")
    if args.batch % args.nprocs:
        ap.error(f"--batch {args.batch} must be a multiple of --nprocs {args.nprocs}")
    res = rdist.launch_or_join(bench, args.nprocs, args)
    if res is None:  # (torchrun's other ranks: rank 0 prints)
        return
    if torchrun:
        nodes = args.nprocs // int(os.environ["LOCAL_WORLD_SIZE"])
        print(f"torchrun: {nodes} nodes of {os.environ['LOCAL_WORLD_SIZE']} ranks")
    ranks = sorted(res)
    n_params = sum(p.numel() for p in M.GPT(_cfg(args)).parameters())
    p_mib = _mib(4 * n_params)
    print(f"GPT {args.layers}x{args.embd} ({n_params / 1e6:.2f} M params = {p_mib:.1f} MiB fp32),"
          f" global batch {args.batch}, dp={args.nprocs}"
          f"{f' (HSDP: shard groups of {shard})' if args.dp_shard else ''}, "
          f"gloo/CPU, AdamW, {args.steps} timed "
          f"steps")
    print("memory per rank (max over ranks): held = live before a step (params, grads, "
          "optimizer state, buckets); peak = max during the step, held included")
    print(f"{'':22s} {'median step':>12s} {'held MiB':>9s} {'peak MiB':>9s}   "
          f"peak per rank MiB")
    ratios = []
    for group in _groups(args):
        for name, kind in group:
            r = [res[k][kind] for k in ranks]
            mem = (f"{'n/a':>9s} {'n/a':>9s}" if kind in GENERATED else
                   f"{_mib(max(x['held'] for x in r)):9.1f} {_mib(max(x['peak'] for x in r)):9.1f}"
                   "   " + " ".join(f"{_mib(x['peak']):.1f}" for x in r))
            print(f"{name:22s} {r[0]['time'] * 1e3:9.1f} ms {mem}")
        (fx_name, fx), (fxi_name, fxi), (peer_name, peer), (peerc_name, peerc) = group
        for a_name, a, b_name, b in ((fx_name, fx, peer_name, peer),
                                     (fxi_name, fxi, peer_name, peer),
                                     (fxi_name, fxi, peerc_name, peerc)):
            diff = max(abs(x - y) for k in ranks
                       for x, y in zip(res[k][a]["losses"], res[k][b]["losses"]))
            t = res[0][a]["time"] / res[0][b]["time"]
            m = None if a in GENERATED or b in GENERATED else \
                max(res[k][a]["peak"] for k in ranks) / max(res[k][b]["peak"] for k in ranks)
            fl = res[0][a]["losses"]
            ratios.append((a_name, b_name, t, m, diff, fl[0], fl[-1]))
    print()
    for a_name, b_name, t, m, diff, first, last in ratios:
        mem = f"peak-memory ratio {m:.3f}" if m is not None else f"{'':23s}"
        print(f"{a_name:22s} / {b_name:15s}: time ratio {t:.3f}   {mem}   "
              f"(loss {first:.4f} -> {last:.4f}, max |loss diff| = {diff:.2e})")


if __name__ == "__main__":
    main()
