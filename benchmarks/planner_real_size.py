"""The planner's price of each plan against the measured step, at a real model's size.

HF GPT-2 small (124 M parameters, vocabulary 50257), built on the meta device and loaded
with weights= from a save_pretrained directory (each rank reads only its part), on 2 gloo
CPU ranks, batch 4 x 128, AdamW: plan="auto" (the planner's ranked table: its price of
every legal plan), then each plan named below, timed over --steps steps (the first two,
which compile and check, left out; median). Prints predicted and measured seconds per plan
and their ratio: what the planner gets wrong at this size (docs/benchmarks.md, "At a real
model's size on CPU").

    .venv/bin/python benchmarks/planner_real_size.py [--steps 7] [--layers 12]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import fxpar

PLANS = ["auto", {"dp": 2}, {"dp": 2, "zero": 3}, {"tp": 2},
         {"pp": 2, "microbatches": 2}, {"pp": 2, "microbatches": 4, "schedule": "zero-bubble"}]


def _model(layers):
    import transformers as T
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=layers, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0))


def _key(plan) -> tuple:
    return tuple(getattr(plan, f) for f in ("dp", "tp", "pp", "microbatches", "schedule",
                                           "zero"))


def rank_main(weights, layers, steps):
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, 50257, (4, 128), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    out, table = {}, None
    for plan in PLANS:
        with torch.device("meta"):
            model = _model(layers)
        pm = fxpar.parallelize(model, 2, example_batch=batches[0], plan=plan,
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                               weights=weights)
        ts = []
        for b in batches:
            t0 = time.perf_counter()
            pm.step(b)
            ts.append(time.perf_counter() - t0)
        if pm.plan_report is not None:
            table = {_key(c.plan): c.step_s for c in pm.plan_report.table}
        out[json.dumps(plan)] = (_key(pm.plan), statistics.median(ts[2:]))
        del pm
    return out, table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        _model(args.layers).save_pretrained(d)
        out, table = fxpar.launch(rank_main, 2, d, args.layers, max(args.steps, 3))[0]
    print(f"HF GPT-2 {args.layers} x 768, vocabulary 50257, 2 CPU ranks, batch 4 x 128, AdamW")
    print(f"{'plan':40s} {'chosen':28s} {'predicted s':>11s} {'measured s':>10s} {'x':>6s}")
    for name, (key, measured) in out.items():
        pred = table.get(tuple(key)) if table else None
        chosen = "dp={} tp={} pp={} m={} {} zero={}".format(*key)
        print(f"{name:40s} {chosen:28s} {pred or float('nan'):11.2f} {measured:10.2f} "
              f"{measured / pred if pred else float('nan'):6.2f}")


if __name__ == "__main__":
    main()
