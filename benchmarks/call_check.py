"""What the collective-call check (runtime/calls.py) costs per call, next to a step.

Every collective pm method first all-gathers a 16-byte fingerprint on a gloo side group so
that ranks calling different methods fail at once instead of hanging or answering wrongly.
This times that agreement alone (median of many) and the demo GPT's dp=2 step, in one run on
2 CPU ranks (gloo), and prints the ratio.

    .venv/bin/python benchmarks/call_check.py [--nprocs 2] [--calls 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import fxpar
from fxpar.examples import models as M
from fxpar.runtime import calls


def _rank(n_calls: int, nprocs: int):
    cfg = M.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)
    batch = M.gpt_batch(cfg, 8)
    pm = fxpar.parallelize(M.GPT(cfg), nprocs, example_batch=batch, plan={"dp": nprocs})
    for _ in range(5):
        pm.step(batch)
    steps = []
    for _ in range(20):
        t = time.perf_counter()
        pm.step(batch)
        steps.append(time.perf_counter() - t)
    agree = []
    for _ in range(n_calls):
        t = time.perf_counter()
        calls.agree(pm._call_id, "step")  # what each pm.step does first
        agree.append(time.perf_counter() - t)
    return statistics.median(agree), statistics.median(steps)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    res = fxpar.launch(_rank, args.nprocs, args.calls, args.nprocs)
    agree = max(a for a, _ in res.values())
    step = max(s for _, s in res.values())
    print(f"call check: {agree * 1e6:.0f} us per call; demo GPT dp={args.nprocs} step "
          f"{step * 1e3:.2f} ms (check included); check / step = {agree / step:.4f}")


if __name__ == "__main__":
    main()
