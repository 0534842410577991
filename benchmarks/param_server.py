"""Parameter servers (Plan.ps) vs all-reduce data parallelism on the same ranks, in one run:
time per step of the whole job, with and without a straggler, and the loss after training.

Every plan trains the GPT on a Markov chain's language from the same weights and the same
batches (examples/models.markov_batch), one plan after the other in one launch:
  all-reduce dp    every rank a worker (dp = nprocs);
  ps sync          nprocs-1 workers and one server, synchronous (exact: as one process);
  ps async k=K     the same ranks, asynchronous with staleness bound K.
The straggler is worker rank 1 sleeping before each of its steps as long as the all-reduce
plan's median step without a straggler: that rank is slowed 2x. A plan's time per step is
its slowest rank's wall time for the steps after the first 3, divided by their number (the
job ends with its slowest rank); the loss is evaluate() on held-out batches after the last
step (asynchronous workers evaluate the servers' newest parameters).

    .venv/bin/python benchmarks/param_server.py [--nprocs 4] [--steps 200] [--staleness 2]
        [--layers 2] [--embd 128] [--batch 12] [--lr 3e-3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import fxpar
from fxpar.examples import models as M

WARM = 3  # steps left out of the timing (the first compiles and allocates)


def train(args, cfg, plan, delay: float):
    """Train `plan` from seed 0; returns (this rank's seconds per timed step, the held-out
    loss or None on a server, this rank's step times)."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    pm = fxpar.parallelize(M.GPT(cfg), args.nprocs, example_batch=M.markov_batch(cfg, args.batch),
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr), plan=plan)
    times = []
    dist.barrier()
    for s in range(args.steps):
        if s == WARM:
            t0 = time.perf_counter()
        t = time.perf_counter()
        if rank == 1 and delay:
            time.sleep(delay)
        pm.step(M.markov_batch(cfg, args.batch, seed=s))
        times.append(time.perf_counter() - t)
    per_step = (time.perf_counter() - t0) / (args.steps - WARM)
    held_out = [pm.evaluate(M.markov_batch(cfg, args.batch, seed=10_000 + i)) for i in range(4)]
    loss = None if held_out[0] is None else sum(x.item() for x in held_out) / len(held_out)
    stats = pm.ps_stats
    dist.barrier()
    return per_step, loss, times, stats


def bench(args):
    cfg = M.GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4,
                      n_embd=args.embd)
    plans = {"all-reduce dp": {"dp": args.nprocs},
             "ps sync": {"ps": 1},
             f"ps async k={args.staleness}": {"ps": 1, "ps_staleness": args.staleness}}
    out = {}
    delay = 0.0
    for straggler in (False, True):
        for name, plan in plans.items():
            per_step, loss, times, stats = train(args, cfg, plan, delay if straggler else 0.0)
            every = [None] * args.nprocs
            dist.all_gather_object(every, (per_step, loss, stats))
            out[(name, straggler)] = (max(e[0] for e in every), every[0][1],
                                      every[args.nprocs - 1][2])
            if name == "all-reduce dp" and not straggler:
                delay = statistics.median(times[WARM:])
    return out, delay


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    if args.batch % args.nprocs or args.batch % (args.nprocs - 1):
        ap.error(f"--batch must divide by {args.nprocs} and {args.nprocs - 1} (the workers)")
    res, delay = fxpar.launch(bench, args.nprocs, args)[0]
    print(f"GPT {args.layers}x{args.embd} (vocab 512, seq 64), batch {args.batch}, "
          f"{args.nprocs} CPU ranks on gloo, AdamW lr {args.lr}, {args.steps} steps; "
          f"straggler: rank 1 sleeps {delay * 1e3:.0f} ms a step")
    print(f"{'plan':<16} {'straggler':>9} {'ms/step':>8} {'x dp':>6} {'loss':>7} {'x dp':>7}  "
          "servers' stats")
    for straggler in (False, True):
        base = res[("all-reduce dp", straggler)]
        for (name, s), (step, loss, stats) in res.items():
            if s != straggler:
                continue
            print(f"{name:<16} {'yes' if s else 'no':>9} {step * 1e3:8.1f} {step / base[0]:6.2f} "
                  f"{loss:7.4f} {loss / base[1]:7.4f}  {stats or ''}")


if __name__ == "__main__":
    main()
