"""What the collective-call check (runtime/calls.py) costs per call, next to a step.

Every collective pm method first all-gathers a 16-byte fingerprint on a gloo side group so
that ranks calling different methods fail at once instead of hanging or answering wrongly.
pm.step begins that exchange as it starts and settles it just before its first collective, so
it travels while the forward computes; the other methods check before they start. This times
the demo GPT's dp=2 step with and without the check (interleaved rounds, medians) and the
blocking check alone, in one run on 2 CPU ranks (gloo), and prints the ratio.

    .venv/bin/python benchmarks/call_check.py [--nprocs 2] [--layers 2 --embd 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import fxpar
from fxpar.examples import models as M
from fxpar.runtime import calls


def _rank(n_calls: int, nprocs: int, layers: int, embd: int, rounds: int = 15, steps: int = 10):
    cfg = M.GPTConfig(vocab_size=512, block_size=64, n_layer=layers, n_head=4, n_embd=embd)
    torch.manual_seed(0)
    batch = M.gpt_batch(cfg, 8)
    pm = fxpar.parallelize(M.GPT(cfg), nprocs, example_batch=batch, plan={"dp": nprocs})
    for _ in range(5):
        pm.step(batch)
    begin = calls.begin

    def blocking(*a, **k):
        begin(*a, **k)
        calls.settle()
    modes = {"checked": begin, "blocking": blocking, "unchecked": lambda *a, **k: None}
    times = {m: [] for m in modes}
    for _ in range(rounds):  # interleaved, the same on every rank
        for mode in times:
            calls.begin = modes[mode]
            t = time.perf_counter()
            for _ in range(steps):
                pm.step(batch)
            times[mode].append((time.perf_counter() - t) / steps)
    calls.begin = begin
    agree = []
    for _ in range(n_calls):
        t = time.perf_counter()
        calls.agree(pm._call_id, "evaluate")  # a blocking check, as the other methods do
        agree.append(time.perf_counter() - t)
    return (statistics.median(agree), statistics.median(times["checked"]),
            statistics.median(times["unchecked"]), statistics.median(times["blocking"]))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=64, help="192 with --layers 4: the demo's GPT")
    args = ap.parse_args(argv)
    res = fxpar.launch(_rank, args.nprocs, args.calls, args.nprocs, args.layers,
                       args.embd)
    agree = max(r[0] for r in res.values())
    checked = max(r[1] for r in res.values())
    unchecked = max(r[2] for r in res.values())
    print(f"blocking call check (evaluate, save, ...): {agree * 1e6:.0f} us per call")
    print(f"GPT {args.layers}x{args.embd} dp={args.nprocs} step: {checked * 1e3:.2f} ms checked "
          "(begun at the step's "
          f"start, settled before its first collective), {unchecked * 1e3:.2f} ms without: "
          f"ratio {checked / unchecked:.3f}; checked before the step starts instead: "
          f"ratio {max(r[3] for r in res.values()) / unchecked:.3f}")


if __name__ == "__main__":
    main()
