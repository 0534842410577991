"""fxpar dp=2 vs torch DDP, same model, same batches, gloo on this machine, in one run.

Variants: fxpar with Plan.codegen "inductor" (Inductor's kernels between its collectives)
and "eager" (op by op); DDP eager and DDP under torch.compile (DDPOptimizer splits its graph
at the gradient buckets). All live in the same spawned ranks and their steps alternate (one
each per round, the order rotating), so the ratios compare like with like on a machine whose
speed drifts. Prints each median step, the paired ratios to DDP and to compiled DDP, and the
losses' largest difference to DDP's. --one-update adds fxpar stepping the optimizer once after
its graph (a step hook forces it) instead of each gradient bucket as soon as it is reduced.
--zero 1|2 gives fxpar's sides Plan.zero (the optimizer state sharded) and adds torch's own
ZeRO-1 as a peer: DDP with torch.distributed.optim.ZeroRedundancyOptimizer (fxpar steps the
shards after the graph: --one-update adds the same code a second time). --microbatches M:
gradient accumulation, fxpar's Plan.microbatches against DDP's `no_sync()` for the first M-1
microbatches; fxpar also as it ran before its reduction moved inside the last microbatch's
backward ("reduction after the last backward": the same program, the reduction part run
after it).

    .venv/bin/python benchmarks/dp_vs_ddp.py [--steps 30] [--layers 4] [--embd 256] [--one-update]
        [--zero 0|1|2] [--microbatches M]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist

import fxpar
from fxpar.examples import models as M


def _cfg(args):
    return M.GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4,
                       n_embd=args.embd)


def bench(args):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ["WORLD_SIZE"])))
    cfg = _cfg(args)
    data = [M.gpt_batch(cfg, args.batch, seed=s) for s in range(4)]
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    per = args.batch // world
    steps, compile_s = {}, {}

    def fxpar_variant(codegen, one_update=False, reduce_after=False):
        torch.manual_seed(0)
        t = time.perf_counter()
        pm = fxpar.parallelize(M.GPT(cfg), world, example_batch=data[0], optimizer=opt,
                               plan=dict(dp=world, bucket_mb=args.fxpar_bucket_mb,
                                         codegen=codegen, zero=args.zero,
                                         microbatches=args.microbatches))
        if one_update:  # a step hook makes fxpar step every bucket at once, after the graph
            pm.optimizer.register_step_post_hook(lambda *a: None)
        if reduce_after:  # the reduction part after the last backward, not inside it
            pm.pipeline_runner._fusable = lambda n, key: ()
        name = f"fxpar codegen={codegen}" + (f" zero={args.zero}" if args.zero else "") + \
            (", one update" if one_update else "") + \
            (", reduction after the last backward" if reduce_after else "")
        compile_s[name] = time.perf_counter() - t
        return name, lambda s: pm.step(data[s % 4]).item()

    def ddp_variant(compiled, zero=False):
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(M.GPT(cfg), bucket_cap_mb=25)
        if zero:  # torch's ZeRO-1: each rank steps its share, then broadcasts it
            from torch.distributed.optim import ZeroRedundancyOptimizer
            o = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                        lr=1e-3)
        else:
            o = opt(ddp.parameters())
        fwd = torch.compile(ddp) if compiled else ddp

        m = args.microbatches

        def step(s):
            idx, tgt = data[s % 4]
            idx, tgt = idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per]
            o.zero_grad()
            red = torch.zeros(())
            for k in range(m):  # gradient accumulation: reduced with the last backward
                rows = slice(k * per // m, (k + 1) * per // m)
                with ddp.no_sync() if k < m - 1 else contextlib.nullcontext():
                    loss = fwd((idx[rows], tgt[rows])) / m
                    loss.backward()
                red += loss.detach()
            o.step()
            dist.all_reduce(red)
            return (red / world).item()
        return step

    for codegen in args.codegen:
        name, fn = fxpar_variant(codegen)
        steps[name] = fn
    if args.one_update:
        name, fn = fxpar_variant(args.codegen[0], one_update=True)
        steps[name] = fn
    if args.microbatches > 1:
        name, fn = fxpar_variant(args.codegen[0], reduce_after=True)
        steps[name] = fn
    steps["DDP"] = ddp_variant(False)
    steps["DDP + torch.compile"] = ddp_variant(True)
    if args.zero:
        steps["DDP + ZeroRedundancyOptimizer"] = ddp_variant(False, zero=True)
    # interleaved, the order rotating: every variant sees the same machine speed each round
    # (this VM drifts +-40% over seconds; one block after the other compared two speeds)
    names = list(steps)
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    for s in range(args.warmup + args.steps):
        k = s % len(names)
        for name in names[k:] + names[:k]:
            dist.barrier()
            t = time.perf_counter()
            losses[name].append(steps[name](s))
            if s >= args.warmup:
                times[name].append(time.perf_counter() - t)
    return times, losses, compile_s


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--codegen", nargs="+", default=["inductor", "eager"],
                    choices=["inductor", "eager"], help="fxpar's Plan.codegen variants")
    ap.add_argument("--one-update", action="store_true",
                    help="also fxpar stepping every bucket after the graph (not each bucket "
                         "while the later ones are still reduced)")
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2],
                    help="fxpar's Plan.zero (1/2: torch's ZeroRedundancyOptimizer joins)")
    ap.add_argument("--microbatches", type=int, default=1,
                    help="gradient accumulation: fxpar's Plan.microbatches, DDP's no_sync()")
    ap.add_argument("--fxpar-bucket-mb", type=float, default=None,
                    help="fxpar's Plan.bucket_mb (default: sized by its cost model)")
    args = ap.parse_args(argv)
    res = fxpar.launch(bench, args.nprocs, args)
    times, losses, compile_s = res[0]
    n_params = sum(p.numel() for p in M.GPT(_cfg(args)).parameters())
    print(f"GPT {args.layers}x{args.embd} ({n_params / 1e6:.2f} M params), global batch "
          f"{args.batch}" + (f" in {args.microbatches} microbatches" if args.microbatches > 1
                             else "")
          + f", dp={args.nprocs}, gloo, {args.steps} timed steps (interleaved)")
    refs = ["DDP", "DDP + torch.compile"] + (["DDP + ZeroRedundancyOptimizer"] if args.zero
                                             else [])
    w = max(36, *map(len, times))
    print(f"{'variant':{w}s} {'step ms':>9s} {'x DDP':>7s} {'x DDP+compile':>14s} "
          + (f"{'x DDP+ZeRO-1':>13s} " if args.zero else "")
          + f"{'max|dloss|':>11s} {'set-up s':>9s}")
    out = {}
    for name, ts in times.items():
        vs = {ref: statistics.median(a / b for a, b in zip(ts, times[ref])) for ref in refs}
        dl = max(abs(a - b) for a, b in zip(losses[name], losses["DDP"]))
        setup = f"{compile_s[name]:9.1f}" if name in compile_s else f"{'':9s}"
        print(f"{name:{w}s} {statistics.median(ts) * 1e3:9.1f} {vs['DDP']:7.3f} "
              f"{vs['DDP + torch.compile']:14.3f} "
              + (f"{vs['DDP + ZeroRedundancyOptimizer']:13.3f} " if args.zero else "")
              + f"{dl:11.2e} {setup}")
        out[name] = dict(step_s=statistics.median(ts), vs_ddp=vs["DDP"],
                         vs_compiled_ddp=vs["DDP + torch.compile"], max_dloss=dl)
    print("(x: median of paired per-step ratios; set-up: fxpar.parallelize on rank 0, "
          "codegen included)")
    return out


if __name__ == "__main__":
    main()
