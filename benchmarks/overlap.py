"""Overlap on vs off: exposed communication and step time, fxpar dp=2 on gloo, one run.

For ZeRO 0, 2 and 3, the same GPT and batches are trained with `Plan(overlap=False)` (every
collective waited on where it is issued) and `Plan(overlap=True)` (the overlap pass: starts
early, waits late, within its memory limit). Reported from the runtime's per-step recorder
(`pm.step_stats`), medians over the timed steps: step time, time a collective was in flight,
and the exposed fraction (compute thread blocked on communication / step time).

    .venv/bin/python benchmarks/overlap.py [--steps 10] [--layers 4] [--embd 256] [--batch 8]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import fxpar
from fxpar.examples import models as M


def bench(args):
    torch.set_num_threads(1)
    cfg = M.GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4,
                      n_embd=args.embd)
    data = M.gpt_batch(cfg, args.batch)
    out = {}
    for zero in (0, 2, 3):
        for overlap in (False, True):
            torch.manual_seed(0)
            pm = fxpar.parallelize(M.GPT(cfg), 2, example_batch=data,
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                   plan=fxpar.Plan(dp=2, zero=zero, overlap=overlap))
            losses = []
            for _ in range(args.warmup + args.steps):
                dist.barrier()
                losses.append(pm.step(data).item())
            st = pm.step_stats[-args.steps:]
            out[(zero, overlap)] = (statistics.median(s.time_s for s in st),
                                    statistics.median(s.comm_s for s in st),
                                    statistics.median(s.exposed_fraction for s in st), losses)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    res = fxpar.launch(bench, 2, args)[0]
    print(f"GPT {args.layers}x{args.embd}, global batch {args.batch}, dp=2, gloo, "
          f"{args.steps} timed steps (rank 0)")
    print(f"{'zero':>4} {'overlap':>8} {'step ms':>9} {'comm ms':>9} {'exposed':>8}")
    for (zero, ov), (t, c, x, _) in sorted(res.items()):
        print(f"{zero:>4} {str(ov):>8} {t * 1e3:9.1f} {c * 1e3:9.1f} {x:8.2f}")
    for zero in (0, 2, 3):
        off, on = res[(zero, False)], res[(zero, True)]
        same = off[3] == on[3]
        print(f"zero={zero}: exposed fraction on/off = {on[2] / off[2]:.2f}, step time on/off = "
              f"{on[0] / off[0]:.2f}, losses identical: {same}")


if __name__ == "__main__":
    main()
