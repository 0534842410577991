"""1-bit Adam (Plan.grad_compression="1bit-adam") vs the same dp plan with AdamW, in one run:
bytes on the wire per step, step time and the loss after training.

The GPT learns a Markov chain's language from a fresh batch each step
(examples/models.markov_batch); both plans train from the same weights, interleaved step by
step so the machine's load falls on both alike. 1-bit Adam's first `--warmup` steps are
AdamW exactly; bytes are the runtime's per-collective record of the last step (all-reduces
and all-to-alls count their input, all-gathers their output); step time is the median of
the steps after the warm-up (and its first compressed step, which compiles the graph
without gradient all-reduces); the loss the mean of the last 10 steps.

    .venv/bin/python benchmarks/onebit_adam.py [--nprocs 2] [--steps 200] [--warmup 80]
        [--layers 4] [--embd 256] [--batch 8] [--lr 3e-3]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import fxpar
from fxpar.examples import models as M
from fxpar.runtime.trace import COMM


def bench(args):
    torch.set_num_threads(max(1, torch.get_num_threads() // args.nprocs))
    cfg = M.GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4,
                      n_embd=args.embd)
    plans = {"AdamW": {"dp": args.nprocs},
             "1-bit Adam": {"dp": args.nprocs, "grad_compression": "1bit-adam",
                            "compression_warmup": args.warmup}}
    pms = {}
    for name, plan in plans.items():
        torch.manual_seed(0)
        pms[name] = fxpar.parallelize(
            M.GPT(cfg), args.nprocs, example_batch=M.markov_batch(cfg, args.batch),
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr), plan=plan)
    losses = {name: [] for name in pms}
    for s in range(args.steps):
        batch = M.markov_batch(cfg, args.batch, seed=s)
        for name, pm in pms.items():
            dist.barrier()
            losses[name].append(pm.step(batch).item())
    out = {}
    for name, pm in pms.items():
        wire = sum(sp.args["bytes"] for sp in pm.recorder.steps[-1][3] if sp.track == COMM)
        # the last 20 steps: compressed ones (--steps >= --warmup + 21), but for a refresh
        step = statistics.median(st.time_s for st in pm.step_stats)
        out[name] = (wire, step, sum(losses[name][-10:]) / 10, losses[name][0])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=80)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    if args.steps < args.warmup + 21:
        ap.error("--steps must be at least --warmup + 21 (step times are the last 20 steps')")
    res = fxpar.launch(bench, args.nprocs, args)[0]
    print(f"GPT {args.layers}x{args.embd} (vocab 512, seq 64), batch {args.batch}, "
          f"dp={args.nprocs} on gloo, lr {args.lr}, {args.steps} steps, 1-bit Adam after "
          f"{args.warmup} (rank 0)")
    print(f"{'optimizer':<12} {'bytes/step':>11} {'x AdamW':>8} {'step ms':>8} {'x AdamW':>8} "
          f"{'loss':>7} {'x AdamW':>8}")
    base = res["AdamW"]
    for name, (wire, step, loss, first) in res.items():
        print(f"{name:<12} {wire:11,d} {wire / base[0]:8.3f} {step * 1e3:8.1f} "
              f"{step / base[1]:8.3f} {loss:7.4f} {loss / base[2]:8.4f}")
    print(f"(loss at the first step {base[3]:.4f}; the language's entropy {2 * 0.6931:.4f})")


if __name__ == "__main__":
    main()
