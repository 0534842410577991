"""Optimizer offload (Plan.offload_optimizer) vs the optimizer on the device, in one run: step
time, the device memory a step's state holds, and the losses.

One device (CUDA where there is one, else the CPU, where host and device are one memory: the
ratio there is what the copies and the host-side bookkeeping cost, nothing is saved), the
example GPT, AdamW; each variant trains from the same weights on the same batch, the two
interleaved step by step. Memory: what the device holds after the steps beyond what it held
before the model was built (CUDA allocator; on CPU not measured). Step: median after the
first two.

    .venv/bin/python benchmarks/offload_optimizer.py [--steps 12] [--layers 8] [--embd 1024]
        [--batch 8] [--seq 256]
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import fxpar
from fxpar.examples import models as M


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda:0" if cuda else "cpu"
    cfg = M.GPTConfig(vocab_size=8192, block_size=args.seq, n_layer=args.layers, n_head=16,
                      n_embd=args.embd)
    data = [t.to(dev) for t in M.gpt_batch(cfg, args.batch)]
    pms, held = {}, {}
    for offload in (False, True):
        base = torch.cuda.memory_allocated() if cuda else 0
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (offload on a CPU device: saves nothing)
            pm = fxpar.parallelize(M.GPT(cfg).to(dev), [dev], example_batch=data,
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                                   plan={"offload_optimizer": offload})
        pms[offload] = (pm, base)
    times, losses = {False: [], True: []}, {False: [], True: []}
    for _ in range(args.steps):
        for offload, (pm, _) in pms.items():
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses[offload].append(pm.step(data).item())
            times[offload].append(time.perf_counter() - t0)
    for offload, (pm, base) in pms.items():
        held[offload] = (torch.cuda.memory_allocated() - base) if cuda else None
    n = sum(p.numel() for p in pms[False][0].params)
    print(f"GPT {args.layers}x{args.embd} ({n / 1e6:.0f}M parameters), batch {args.batch} x "
          f"{args.seq}, AdamW, fp32, one {torch.cuda.get_device_name() if cuda else 'CPU'}")
    step = {k: statistics.median(v[2:]) for k, v in times.items()}
    print(f"step: {step[False] * 1e3:.1f} ms on the device, {step[True] * 1e3:.1f} ms "
          f"offloaded = {step[True] / step[False]:.3f}x")
    if cuda:
        moments = 2 * 4 * n
        print(f"device memory held: {held[False] / 2**30:.2f} GiB vs {held[True] / 2**30:.2f} "
              f"GiB offloaded = {held[True] / held[False]:.3f}x (AdamW's moments: "
              f"{moments / 2**30:.2f} GiB; saved {(held[False] - held[True]) / moments:.2f} of "
              "them)")
    worst = max(abs(a - b) / abs(a) for a, b in zip(losses[False], losses[True]))
    print(f"losses: largest relative difference {worst:.2e} over {args.steps} steps "
          f"(the host's fused AdamW against the device's)")


if __name__ == "__main__":
    main()
