"""Compile time: capture (AOTAutograd's joint trace) and the passes, HF GPT-2 at 768 wide.

    python benchmarks/compile_time.py [--layers 2,12,48] [--seq 128]

Prints, per depth, the seconds of capture and of the passes (one device, fusion off: the
CPU path) and the milliseconds per graph node, so a cost that grows faster than the graph
shows as a rising ms/node. docs/benchmarks.md records the figures.
"""
from __future__ import annotations

import argparse
import os

import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def gpt2(layers: int, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=layers, n_embd=768, n_head=12, n_positions=seq, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def main():
    import fxpar
    from fxpar.compiler import ir
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="2,12,48")
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    print(f"{'layers':>6} {'nodes':>6} {'capture s':>10} {'passes s':>9} {'ms/node':>8}")
    for layers in (int(x) for x in args.layers.split(",")):
        torch.manual_seed(0)
        model = gpt2(layers, args.seq)
        ids = torch.randint(0, 50257, (2, args.seq))
        batch = {"input_ids": ids, "labels": ids}
        fxpar.compile(model, 1, example_batch=batch, plan={"fuse": False})  # warm: imports
        prog = fxpar.compile(model, 1, example_batch=batch, plan={"fuse": False})
        t0, t1 = 0.0, dict((name, t) for name, t, _ in prog.compile_times)["capture"]
        t2 = t1 + sum(t for _, t, _ in prog.graph.meta[ir.PASS_TIMES])  # verify + passes
        gm = prog.graph
        n = len(gm.graph.nodes)
        print(f"{layers:>6} {n:>6} {t1 - t0:>10.2f} {t2 - t1:>9.2f} "
              f"{1e3 * (t2 - t0) / n:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
