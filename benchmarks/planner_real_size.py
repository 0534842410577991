"""The planner's price of each plan against the measured step, at a real model's size.

A Hugging Face model at its published size, built on the meta device and loaded with
weights= from a save_pretrained directory (each rank reads only its part), on 2 gloo CPU
ranks, AdamW: plan="auto" (the planner's ranked table: its price of every legal plan), then
each plan named below, timed over --steps steps (the first two, which compile and check,
left out; median). Beside them, one process training the same model eagerly on the whole
batch. Prints per plan the predicted and measured seconds and their ratio (what the planner
gets wrong at this size: docs/benchmarks.md, "At a real model's size on CPU"), the largest
difference of its losses from eager's, and for the first plan ("auto", in fresh processes)
each rank's peak resident memory above its own before the model was built (VmHWM; the
later plans reuse the heap the first grew, so theirs is not printed).

    .venv/bin/python benchmarks/planner_real_size.py [--model gpt2|qwen2.5-0.5b]
        [--steps 7] [--layers N]

gpt2: GPT-2 small (124 M parameters, vocabulary 50257), batch 4 x 128. qwen2.5-0.5b:
Qwen2.5-0.5B's configuration (494 M, 24 layers x 896, GQA 14/2, a tied 151,936-token
head), batch 2 x 128: eager's AdamW state is 7.4 GiB.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import fxpar

PLANS = ["auto", {"dp": 2}, {"dp": 2, "zero": 3}, {"tp": 2}, {"pp": 2, "microbatches": 2}]
# name: (vocabulary, rows, sequence)
MODELS = {"gpt2": (50257, 4, 128), "qwen2.5-0.5b": (151936, 2, 128)}


def _model(name: str, layers: int | None):
    import transformers as T
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=layers or 12, resid_pdrop=0.0,
                                              embd_pdrop=0.0, attn_pdrop=0.0))
    cfg = T.Qwen2Config(  # Qwen/Qwen2.5-0.5B's config.json
        vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=layers or 24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_dropout=0.0)
    return T.Qwen2ForCausalLM(cfg)


def _key(plan) -> tuple:
    return tuple(getattr(plan, f) for f in ("dp", "tp", "pp", "microbatches", "schedule",
                                           "zero"))


def _batches(name: str, steps: int) -> list:
    vocab, rows, seq = MODELS[name]
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _peak_reset() -> int:
    """Resident bytes now; the high-water mark reset to them (Linux's clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return 1024 * next(int(x.split()[1]) for x in f if x.startswith(field + ":"))


def _optimizer(ps):
    return torch.optim.AdamW(ps, lr=1e-4)


def eager_main(weights, name, layers, steps):
    """One process, the whole batch: losses, median step, peak bytes."""
    import transformers as T
    before = _peak_reset()
    model = T.AutoModelForCausalLM.from_pretrained(weights, torch_dtype=torch.float32,
                                                   attn_implementation="sdpa")
    opt = _optimizer(model.parameters())
    losses, ts = [], []
    for b in _batches(name, steps):
        t0 = time.perf_counter()
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ts.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, statistics.median(ts[2:]), _status("VmHWM") - before


def rank_main(weights, name, layers, steps):
    batches = _batches(name, steps)
    out, table = {}, None
    rows = MODELS[name][1]  # (and the pipeline with as many microbatches as rows)
    for plan in [*PLANS, {"pp": 2, "microbatches": rows, "schedule": "zero-bubble"}]:
        before = _peak_reset()
        with torch.device("meta"):
            model = _model(name, layers)
        pm = fxpar.parallelize(model, 2, example_batch=batches[0], plan=plan,
                               optimizer=_optimizer, weights=weights)
        ts, losses = [], []
        for b in batches:
            t0 = time.perf_counter()
            losses.append(pm.step(b).item())
            ts.append(time.perf_counter() - t0)
        if pm.plan_report is not None:
            table = {_key(c.plan): c.step_s for c in pm.plan_report.table}
        out[json.dumps(plan)] = (_key(pm.plan), statistics.median(ts[2:]), losses,
                                 _status("VmHWM") - before)
        del pm, model
    return out, table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--layers", type=int, help="default: the model's own depth")
    args = ap.parse_args()
    steps = max(args.steps, 3)
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        _model(args.model, args.layers).save_pretrained(d)
        e_losses, e_step, e_peak = fxpar.launch(eager_main, 1, d, args.model, args.layers,
                                                steps)[0]
        runs = fxpar.launch(rank_main, 2, d, args.model, args.layers, steps)
    (out, table), peaks = runs[0], {r: {k: v[3] for k, v in got[0].items()}
                                    for r, got in runs.items()}
    vocab, rows, seq = MODELS[args.model]
    n = sum(p.numel() for p in _meta_model(args.model, args.layers).parameters())
    print(f"{args.model}: {n / 1e6:.0f} M parameters, vocabulary {vocab}, 2 CPU ranks, "
          f"batch {rows} x {seq}, AdamW")
    print(f"eager, one process: step {e_step:.2f} s, peak {e_peak / 2**30:.2f} GiB, "
          f"losses {', '.join(f'{x:.4f}' for x in e_losses)}")
    print(f"{'plan':40s} {'chosen':28s} {'predicted s':>11s} {'measured s':>10s} {'x':>6s} "
          f"{'/ eager':>7s} {'max |loss - eager|':>18s} {'peak GiB r0, r1':>15s}")
    for i, (name, (key, measured, losses, _)) in enumerate(out.items()):
        pred = table.get(tuple(key)) if table else None
        chosen = "dp={} tp={} pp={} m={} {} zero={}".format(*key)
        diff = max(abs(a - b) for a, b in zip(losses, e_losses))
        peak = ", ".join(f"{peaks[r][name] / 2**30:.2f}" for r in sorted(peaks)) if i == 0 \
            else "-"
        print(f"{name:40s} {chosen:28s} {pred or float('nan'):11.2f} {measured:10.2f} "
              f"{measured / pred if pred else float('nan'):6.2f} {measured / e_step:7.2f} "
              f"{diff:18.2e} {peak:>15s}")


def _meta_model(name, layers):
    with torch.device("meta"):
        return _model(name, layers)


if __name__ == "__main__":
    main()
