"""fxpar dp=2 vs torch DDP, same model, same batches, gloo on this machine, in one run.

Prints the median step time of each and the ratio fxpar / DDP. Both runs use the same
spawned ranks one after the other, so the ratio compares like with like.

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
    pm = fxpar.parallelize(M.GPT(cfg), world, example_batch=data[0], optimizer=opt)
    fx_times, fx_losses = [], []
    for s in range(args.warmup + args.steps):
        dist.barrier()
        t = time.perf_counter()
        fx_losses.append(pm.step(data[s % 4]).item())
        if s >= args.warmup:
            fx_times.append(time.perf_counter() - t)

    torch.manual_seed(0)
    model = M.GPT(cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    o = opt(ddp.parameters())
    ddp_times, ddp_losses = [], []
    per = args.batch // world
    for s in range(args.warmup + args.steps):
        idx, tgt = data[s % 4]
        local = (idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per])
        dist.barrier()
        t = time.perf_counter()
        o.zero_grad()
        loss = ddp(local)
        loss.backward()
        o.step()
        red = loss.detach().clone()
        dist.all_reduce(red)
        ddp_losses.append((red / world).item())
        if s >= args.warmup:
            ddp_times.append(time.perf_counter() - t)
    return statistics.median(fx_times), statistics.median(ddp_times), fx_losses, ddp_losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--nprocs", type=int, default=2)
    args = ap.parse_args()
    res = fxpar.launch(bench, args.nprocs, args)
    fx, ddp, fl, dl = res[0]
    n_params = sum(p.numel() for p in M.GPT(_cfg(args)).parameters())
    print(f"GPT {args.layers}x{args.embd} ({n_params / 1e6:.2f} M params), global batch "
          f"{args.batch}, dp={args.nprocs}, gloo, {args.steps} timed steps")
    print(f"fxpar  median step {fx * 1e3:8.1f} ms")
    print(f"DDP    median step {ddp * 1e3:8.1f} ms")
    print(f"ratio fxpar/DDP = {fx / ddp:.3f}   (max |loss diff| = "
          f"{max(abs(a - b) for a, b in zip(fl, dl)):.2e})")


if __name__ == "__main__":
    main()
