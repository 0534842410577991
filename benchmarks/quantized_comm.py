"""Quantized collectives (Plan.comm_quantization, ZeRO++'s qwZ / qgZ) vs the same ZeRO plan
uncompressed, in one run: bytes on the wire per step, step time, and the loss after training.

The GPT learns 4 batches in turn (AdamW); each plan trains from the same weights, the plans
interleaved step by step so the machine's load falls on all alike. Bytes are the runtime's
per-collective record of the last step (all-gathers count their output, reductions and
all-to-alls their input); step time is the median of the steps after the first two; the loss
the mean of the last 10 steps.

    .venv/bin/python benchmarks/quantized_comm.py [--nprocs 2] [--steps 200] [--layers 4]
        [--embd 256] [--batch 8]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import fxpar
from fxpar.examples import models as M
from fxpar.runtime.trace import COMM

PLANS = [("ZeRO-3", {"zero": 3}), ("ZeRO-3 qwZ + qgZ", {"zero": 3,
                                                         "comm_quantization": "weights+gradients"}),
         ("ZeRO-3 qwZ", {"zero": 3, "comm_quantization": "weights"}),
         ("ZeRO-2", {"zero": 2}), ("ZeRO-2 qgZ", {"zero": 2, "comm_quantization": "gradients"})]


def bench(args):
    torch.set_num_threads(max(1, torch.get_num_threads() // args.nprocs))
    cfg = M.GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4,
                      n_embd=args.embd)
    batches = [M.gpt_batch(cfg, args.batch, seed=s) for s in range(4)]
    pms = {}
    for name, plan in PLANS:
        torch.manual_seed(0)
        pms[name] = fxpar.parallelize(M.GPT(cfg), args.nprocs, example_batch=batches[0],
                                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                      plan={"dp": args.nprocs, **plan})
    losses = {name: [] for name in pms}
    for s in range(args.steps):
        for name, pm in pms.items():
            dist.barrier()
            losses[name].append(pm.step(batches[s % 4]).item())
    out = {}
    for name, pm in pms.items():
        wire = sum(sp.args["bytes"] for sp in pm.recorder.steps[-1][3] if sp.track == COMM)
        step = statistics.median(st.time_s for st in list(pm.step_stats)[2:])
        out[name] = (wire, step, sum(losses[name][-10:]) / 10, losses[name][0])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    res = fxpar.launch(bench, args.nprocs, args)[0]
    print(f"GPT {args.layers}x{args.embd} (vocab 512, seq 64), batch {args.batch}, "
          f"dp={args.nprocs} on gloo, AdamW, {args.steps} steps (rank 0)")
    print(f"{'plan':<18} {'bytes/step':>11} {'x plain':>8} {'step ms':>8} {'x plain':>8} "
          f"{'loss':>7} {'x plain':>8}")
    for name, _ in PLANS:
        wire, step, loss, first = res[name]
        base = res[name.split()[0]]
        print(f"{name:<18} {wire:11,d} {wire / base[0]:8.3f} {step * 1e3:8.1f} "
              f"{step / base[1]:8.3f} {loss:7.4f} {loss / base[2]:8.4f}")
    print(f"(loss at the first step {res['ZeRO-3'][3]:.4f})")


if __name__ == "__main__":
    main()
