"""fxpar dp=2 vs torch DDP, same model, same batches, gloo on this machine, in one run.

Prints the median step time of each and the ratio fxpar / DDP. Both models live in the same
spawned ranks and their steps alternate (one each per round), so the ratio compares like
with like on a machine whose speed drifts.

    .venv/bin/python benchmarks/dp_vs_ddp.py [--steps 30] [--layers 4] [--embd 256]
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


def _cfg(args):
    return M.GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4,
                       n_embd=args.embd)


def bench(args):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ["WORLD_SIZE"])))
    cfg = _cfg(args)
    data = [M.gpt_batch(cfg, args.batch, seed=s) for s in range(4)]
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731

    torch.manual_seed(0)
    pm = fxpar.parallelize(M.GPT(cfg), world, example_batch=data[0], optimizer=opt,
                           plan=dict(dp=world, bucket_mb=args.fxpar_bucket_mb))
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(M.GPT(cfg), bucket_cap_mb=25)
    o = opt(ddp.parameters())
    per = args.batch // world

    def fx_step(s):
        return pm.step(data[s % 4]).item()

    def ddp_step(s):
        idx, tgt = data[s % 4]
        o.zero_grad()
        loss = ddp((idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per]))
        loss.backward()
        o.step()
        red = loss.detach().clone()
        dist.all_reduce(red)
        return (red / world).item()

    # interleaved, alternating which goes first: both see the same machine speed each round
    # (this VM drifts +-40% over seconds; one block after the other compared two speeds)
    times = {"fxpar": [], "ddp": []}
    losses = {"fxpar": [], "ddp": []}
    for s in range(args.warmup + args.steps):
        order = (("fxpar", fx_step), ("ddp", ddp_step))
        for name, fn in (order if s % 2 == 0 else order[::-1]):
            dist.barrier()
            t = time.perf_counter()
            losses[name].append(fn(s))
            if s >= args.warmup:
                times[name].append(time.perf_counter() - t)
    return times, losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--fxpar-bucket-mb", type=float, default=None,
                    help="fxpar's Plan.bucket_mb (default: sized by its cost model)")
    args = ap.parse_args()
    res = fxpar.launch(bench, args.nprocs, args)
    times, losses = res[0]
    fx, ddp = statistics.median(times["fxpar"]), statistics.median(times["ddp"])
    paired = statistics.median(a / b for a, b in zip(times["fxpar"], times["ddp"]))
    n_params = sum(p.numel() for p in M.GPT(_cfg(args)).parameters())
    print(f"GPT {args.layers}x{args.embd} ({n_params / 1e6:.2f} M params), global batch "
          f"{args.batch}, dp={args.nprocs}, gloo, {args.steps} timed steps (interleaved)")
    print(f"fxpar  median step {fx * 1e3:8.1f} ms")
    print(f"DDP    median step {ddp * 1e3:8.1f} ms")
    print(f"ratio fxpar/DDP = {paired:.3f} (median of paired steps; of medians {fx / ddp:.3f})"
          f"   (max |loss diff| = "
          f"{max(abs(a - b) for a, b in zip(losses['fxpar'], losses['ddp'])):.2e})")

if __name__ == "__main__":
    main()
