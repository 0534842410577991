"""Regret of plan="auto": its choice measured against every other plan, on models of six families.

For each model, one job of N CPU ranks plans as a plan="auto" job does (autoplan.for_parallelize:
the machine and the model timed at start-up, no re-fit), then compiles the chosen plan and
every other legal plan up to --cap (each dp x tp x pp factorization's best-priced variant
first, plain dp always, then the next best-priced), and times them interleaved: round after
round, one step of each plan in a new order each round (a plan timed right after another
met that plan's leftovers: two jobs of one program measured 1.25x apart), every step its
slowest rank's (this VM's speed drifts by tens of percent over seconds; interleaved, each
round meets one speed). A plan's time is its median over the rounds after the first.

Per model: regret = the chosen plan's measured step / the fastest measured step; each plan's
predicted vs measured time, and the memory one step allocates on its busiest rank predicted
vs measured (op by op: `step_memory`); Spearman's rank correlation of the times; the planner's own time
(machine and model timing, pass probes, search; the capture is the compile's own, handed
to it) against the chosen plan's compile time, at a first launch (the compile with empty
fxpar and Inductor caches) and at a launch after it (the machine's figures, the model's
timing and the probes remembered on disk; the compile from the caches).

Run: python benchmarks/planner_regret.py [--nprocs 2] [--models qwen2_tied,...] [--cap 8]
     [--rounds 12] [--out planner_regret_2.json] [--no-memory]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from unittest import mock

import torch
from torch import nn

import fxpar
import fxpar.runtime.dist

BATCH = 8


def _hf(config_cls: str, model_cls: str, **kw):
    import transformers
    cfg = getattr(transformers, config_cls)(**kw)
    return getattr(transformers, model_cls)(cfg)


def _lm_batch(vocab: int, seq: int, rows: int = BATCH) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _image_batch(size: int, classes: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(BATCH, 3, size, size, generator=g),
            "labels": torch.randint(0, classes, (BATCH,), generator=g)}


# Sizes where a step is compute-bound on a CPU (tens to hundreds of ms), configs otherwise as
# the libraries ship them (dropout included).
MODELS = {
    # a causal LM with a tied, large-vocabulary head (Qwen2.5-style: GQA, tied embeddings)
    "qwen2_tied": (lambda: _hf("Qwen2Config", "Qwen2ForCausalLM", vocab_size=16384,
                               hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=2,
                               tie_word_embeddings=True, max_position_embeddings=256),
                   lambda: _lm_batch(16384, 64)),
    # an untied GQA LM (Llama-style)
    "llama_gqa": (lambda: _hf("LlamaConfig", "LlamaForCausalLM", vocab_size=4096,
                              hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=2,
                              max_position_embeddings=256),
                  lambda: _lm_batch(4096, 64)),
    # an encoder (BERT masked LM, every position labelled, its default dropout)
    "bert_mlm": (lambda: _hf("BertConfig", "BertForMaskedLM", vocab_size=8192, hidden_size=256,
                             num_hidden_layers=4, num_attention_heads=8,
                             intermediate_size=1024, max_position_embeddings=128),
                 lambda: _lm_batch(8192, 64)),
    # a vision transformer
    "vit": (lambda: _hf("ViTConfig", "ViTForImageClassification", image_size=64, patch_size=8,
                        hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                        intermediate_size=1024, num_labels=10),
            lambda: _image_batch(64, 10)),
    # a conv net (BatchNorm: no microbatched plan trains as one step does)
    "resnet": (lambda: _hf("ResNetConfig", "ResNetForImageClassification", embedding_size=32,
                           hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1],
                           num_labels=10),
               lambda: _image_batch(64, 10)),
    # a mixture of experts (Mixtral-style, top-2 of 4)
    "mixtral_moe": (lambda: _hf("MixtralConfig", "MixtralForCausalLM", vocab_size=4096,
                                hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=2,
                                num_local_experts=4, num_experts_per_tok=2,
                                max_position_embeddings=256),
                    lambda: _lm_batch(4096, 64)),
    # an MoE whose experts run every token (Llama 4: batched matmuls by [experts, ...]
    # parameters, the top-1 score zeroing the others' inputs; a shared expert beside them)
    "llama4_moe": (lambda: _hf("Llama4TextConfig", "Llama4ForCausalLM", vocab_size=4096,
                               hidden_size=256, intermediate_size=256,
                               intermediate_size_mlp=512, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                               num_local_experts=4, num_experts_per_tok=1,
                               interleave_moe_layer_step=1, attention_chunk_size=64,
                               max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2),
                   lambda: _lm_batch(4096, 64)),
    # the same MoE written with litgpt (its experts an nn.ModuleList, each run on the rows
    # torch.where picks for it; the model returns logits: LOSSES)
    "litgpt_moe": (lambda: _litgpt_mixtral(vocab_size=4096, padded_vocab_size=4096,
                                           n_embd=256, intermediate_size=512, n_layer=4,
                                           n_head=8, n_query_groups=2, n_expert=4,
                                           n_expert_per_token=2, block_size=256),
                   lambda: _lm_batch(4096, 64)),
    # one long sequence (fewer rows than ranks: dp cannot split it; tp, pp or cp can)
    "llama_long": (lambda: _hf("LlamaConfig", "LlamaForCausalLM", vocab_size=4096,
                               hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=2,
                               max_position_embeddings=2048, attn_implementation="sdpa"),
                   lambda: _lm_batch(4096, 2048, rows=1)),
}


def _litgpt_mixtral(**kw):
    from litgpt.config import Config
    from litgpt.model import GPT
    return GPT(Config.from_name("Mixtral-8x7B-v0.1", **kw))


def _logits_loss(model, batch):
    from fxpar.examples.external_zoo import logits_loss
    return logits_loss(model, batch)


# the models that return logits, not a loss: the loss function a user passes
LOSSES = {"litgpt_moe": _logits_loss}


def _pick(result, cap: int) -> list:
    """The chosen plan, each factorization's best-priced plan, plain dp, then the best-priced
    rest, up to `cap` plans (the search's table is ranked by predicted time)."""
    from fxpar.compiler import planner
    table = result.table
    out = [result.best]

    def add(c):
        if len(out) < cap and all(planner.plan_dict(c.plan) != planner.plan_dict(o.plan)
                                  for o in out):
            out.append(c)
    seen = set()
    for c in table:
        key = (c.plan.dp, c.plan.tp, c.plan.pp)
        if key not in seen:
            seen.add(key)
            add(c)
    plain = next((c for c in table if c.plan.tp == 1 and c.plan.pp == 1 and c.plan.zero == 0
                  and c.plan.microbatches == 1), None)
    if plain is not None:
        add(plain)
    for c in table:
        add(c)
    return out


def time_interleaved(pms: list, data, rounds: int, every_round: bool = False):
    """Each ParallelModel's step time, timed interleaved: `rounds` rounds of one step per
    model in a shuffled order, every step its slowest rank's; the median over the rounds
    after the first (the first alone when rounds is 1). every_round: also the times of each
    round after the first ([rounds - 1, models]). Collective: every rank calls it alike."""
    import torch.distributed as dist
    times = torch.zeros(rounds, len(pms), dtype=torch.float64)
    order = torch.Generator().manual_seed(0)  # (the same on every rank)
    for r in range(rounds):
        for i in torch.randperm(len(pms), generator=order).tolist():
            pm = pms[i]
            dist.barrier()
            t0 = time.perf_counter()
            pm.step(data)
            times[r, i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
    med = times[1:].median(dim=0).values if rounds > 1 else times[0]
    return (med, times[1:] if rounds > 1 else times) if every_round else med


def worker(name: str, cap: int, rounds: int, memory: bool = True):
    from fxpar.compiler import planner
    from fxpar.api import autoplan
    factory, batch = MODELS[name]
    loss_fn = LOSSES.get(name)
    world = int(os.environ["WORLD_SIZE"])
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    data = batch()
    torch.manual_seed(0)
    model = factory()  # (building the model is the user's time, not planning's)
    # planning as a job's first launch (nothing remembered: a fresh planner cache) and as a
    # launch after it (machine.remembered's figures); the compiles below keep the user's cache
    # (each rank has its own directory; rank 0's is the one read and written)
    with tempfile.TemporaryDirectory(prefix="fxpar-plan-") as fresh, mock.patch.dict(
            os.environ, FXPAR_CACHE_DIR=fresh, FXPAR_PLAN_CACHE="1"):
        t0 = time.perf_counter()
        _, result, _ = autoplan.for_parallelize(model, world, world, "auto", data, loss_fn,
                                                opt)
        planning_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, again, _ = autoplan.for_parallelize(model, world, world, "auto", data, loss_fn,
                                               opt)
        again_s = time.perf_counter() - t0
    cands = _pick(result, cap)
    models, compile_s, failed, pm = [], {}, [], None
    # the chosen plan's compile at a first launch: nothing compiled before (fresh fxpar and
    # Inductor caches), to set against the first launch's planning
    first_compile_s = _first_compile(factory, world, data, opt, result.best.plan, loss_fn)
    for c in cands:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        try:
            pm = fxpar.parallelize(factory(), world, example_batch=data, optimizer=opt,
                                   plan=c.plan, loss_fn=loss_fn)
            for _ in range(2):  # the first compiles (Inductor) and checks
                pm.step(data)
        except Exception as e:  # noqa: BLE001 - a plan that cannot run is reported, not timed
            failed.append((planner.plan_str(c.plan), f"{type(e).__name__}: {e}"[:300]))
            continue
        compile_s[planner.plan_str(c.plan)] = time.perf_counter() - t0
        models.append((c, pm))
    med, per_round = time_interleaved([pm for _, pm in models], data, rounds, every_round=True)
    timed = [c for c, _ in models]
    del models, pm  # the timed jobs' memory freed before the memory runs
    mem = [step_memory(factory, data, opt, c, loss_fn) if memory else (None, None)
           for c in timed]
    rows = [{"plan": planner.plan_str(c.plan), "chosen": c is result.best,
             "predicted_s": c.step_s, "measured_s": float(med[i]),
             "predicted_mem": c.memory.total,
             "predicted_step_mem": mem[i][0], "measured_step_mem": mem[i][1],
             "parts": {k: float(v) for k, v in c.parts.items()},
             "rounds_s": [float(t) for t in per_round[:, i]],
             "compile_s": compile_s[planner.plan_str(c.plan)]}
            for i, c in enumerate(timed)]
    plain = next((i for i, c in enumerate(result.table) if c.plan.tp == 1 and c.plan.pp == 1
                  and c.plan.zero == 0 and c.plan.microbatches == 1), None)
    return {"model": name, "world": world, "rows": rows, "failed": failed,
            "planning_s": planning_s, "hardware": str(result.hardware),
            "first_compile_s": first_compile_s,
            # the trace is the compile's own capture too (handed to it): not planning's cost
            "trace_s": sum(t for name, t, _ in result.times if name == "planner: trace model"),
            "planning_again_s": again_s - sum(t for name, t, _ in again.times
                                              if name == "planner: trace model"),
            "same_choice_again": planner.plan_dict(again.best.plan)
            == planner.plan_dict(result.best.plan),
            "n_legal": result.n_legal, "n_fit": result.n_fit,
            "plain_dp_rank": None if plain is None else plain + 1,
            "why": result._why() if len(result.table) > 1 else ""}


def _first_compile(factory, world, data, opt, plan, loss_fn=None) -> float | None:
    """Seconds of parallelize + 2 steps of `plan` with empty compile caches (a job's first
    launch); None where it fails (the loop below reports why)."""
    with tempfile.TemporaryDirectory(prefix="fxpar-first-") as fresh, mock.patch.dict(
            os.environ, {k: os.path.join(fresh, k)
                         for k in ("FXPAR_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}):
        try:
            torch.manual_seed(0)
            t0 = time.perf_counter()
            pm = fxpar.parallelize(factory(), world, example_batch=data, optimizer=opt,
                                   plan=plan, loss_fn=loss_fn)
            for _ in range(2):
                pm.step(data)
            return time.perf_counter() - t0
        except Exception:  # noqa: BLE001
            return None


def step_memory(factory, data, opt, c, loss_fn=None) -> tuple[float, float]:
    """(predicted, measured) bytes one step allocates on its busiest rank: the plan compiled
    op by op (codegen="eager": the dispatch tracker sees every allocation, which it does not
    inside Inductor's kernels), one step tracked after a first; predicted = the memory
    model's step_allocated of that rank's stage."""
    import dataclasses
    import torch.distributed as dist
    from fxpar.runtime.memtrack import measure
    torch.manual_seed(0)
    pm = fxpar.parallelize(factory(), int(os.environ["WORLD_SIZE"]), example_batch=data,
                           optimizer=opt, plan=dataclasses.replace(c.plan, codegen="eager"),
                           loss_fn=loss_fn)
    pm.step(data)
    _, peak = measure(lambda: pm.step(data))
    est = (c.memory.per_stage[pm.world.coordinate("pp")] if c.memory.per_stage
           else c.memory).step_allocated
    both = torch.tensor([float(est), float(peak)], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return float(both[0]), float(both[1])


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None under 3 points."""
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    a, b = ranks(xs), ranks(ys)
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va = sum((x - ma) ** 2 for x in a) ** 0.5
    vb = sum((y - mb) ** 2 for y in b) ** 0.5
    return cov / (va * vb) if va and vb else None


def told_apart(rows: list[dict], share: float = 0.8) -> list[tuple[int, int]] | None:
    """The pairs of plans the measurement tells apart, faster first: (i, j) where plan i
    measured faster than plan j in at least `share` of the rounds (each round times every
    plan once, at one speed of the machine: a paired comparison). Plans closer than that
    have no measured order for a prediction to get right or wrong. None without at least 5
    rounds a plan (a count that small orders nothing)."""
    if not rows or any(len(r.get("rounds_s") or ()) < 5 for r in rows):
        return None
    out = []
    for i, a in enumerate(rows):
        for j, b in enumerate(rows):
            ra, rb = a.get("rounds_s"), b.get("rounds_s")
            if i != j and ra and rb and len(ra) == len(rb):
                if sum(x < y for x, y in zip(ra, rb)) >= share * len(ra):
                    out.append((i, j))
    return out


def summarize(res: dict) -> dict:
    rows = res["rows"]
    best = min(r["measured_s"] for r in rows)
    chosen = next((r for r in rows if r["chosen"]), None)
    errs = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows]
    mem_errs = [abs(r["predicted_step_mem"] - r["measured_step_mem"]) / r["measured_step_mem"]
                for r in rows if r.get("measured_step_mem")]
    apart = told_apart(rows)
    fastest = min(range(len(rows)), key=lambda i: rows[i]["measured_s"])
    at = next((i for i, r in enumerate(rows) if r["chosen"]), None)
    return {"regret": chosen["measured_s"] / best if chosen else None,
            # the chosen plan slower than the fastest in at least 80% of the rounds
            "regret_told_apart": None if apart is None else (fastest, at) in apart,
            # of the pairs the measurement orders, those the prediction orders alike
            "pairs_ordered": None if not apart else (
                sum(rows[i]["predicted_s"] < rows[j]["predicted_s"] for i, j in apart),
                len(apart)),
            "median_error": statistics.median(errs) if errs else None,
            "median_mem_error": statistics.median(mem_errs) if mem_errs else None,
            "max_mem_error": max(mem_errs) if mem_errs else None,
            "spearman": spearman([r["predicted_s"] for r in rows],
                                 [r["measured_s"] for r in rows]),
            # a first launch: its planning against its compile with nothing compiled before
            "planning_share": ((res["planning_s"] - res.get("trace_s", 0.0))
                               / (res.get("first_compile_s") or chosen["compile_s"]))
            if chosen else None,
            "planning_again_share": res["planning_again_s"] / chosen["compile_s"]
            if chosen and "planning_again_s" in res else None}


def report(results: list[dict]) -> str:
    out = []
    for res in results:
        s = summarize(res)
        note = "" if s["regret"] in (None, 1) or s["regret_told_apart"] is None else \
            " (told apart: slower in 80% of the rounds)" if s["regret_told_apart"] else \
            " (within the rounds' noise)"
        sp = s["spearman"] if s["spearman"] is None else round(s["spearman"], 2)
        pairs = (f", pairs the rounds tell apart ordered alike {s['pairs_ordered'][0]}/"
                 f"{s['pairs_ordered'][1]}" if s["pairs_ordered"] else "")
        out.append(f"\n{res['model']} on {res['world']} ranks ({res['n_legal']} legal plans, "
                   f"{res['n_fit']} fit; plain dp ranked #{res['plain_dp_rank']}): regret "
                   f"{s['regret']:.2f}{note}, median |error| {s['median_error'] * 100:.0f}%, "
                   f"Spearman {sp}{pairs}, "
                   f"planning {res['planning_s'] - res.get('trace_s', 0.0):.1f} s (besides the "
                   f"shared capture) = {s['planning_share'] * 100:.0f}% of the chosen plan's "
                   f"first compile ({res.get('first_compile_s') or 0:.1f} s, empty caches)"
                   + (f", launched again {res['planning_again_s']:.1f} s = "
                      f"{s['planning_again_share'] * 100:.0f}% (the same choice: "
                      f"{res['same_choice_again']})"
                      if s.get("planning_again_share") is not None else "")
                   + (f"; step memory predicted within {s['median_mem_error'] * 100:.0f}% "
                      f"(median), {s['max_mem_error'] * 100:.0f}% (worst)"
                      if s["median_mem_error"] is not None else ""))
        best = min(r["measured_s"] for r in res["rows"])
        for r in sorted(res["rows"], key=lambda r: r["measured_s"]):
            out.append(f"  {'*' if r['chosen'] else ' '} {r['plan']:<44} predicted "
                       f"{r['predicted_s'] * 1e3:8.1f} ms  measured {r['measured_s'] * 1e3:8.1f}"
                       f" ms  x{r['measured_s'] / best:.2f} of best  "
                       f"meas/pred {r['measured_s'] / r['predicted_s']:.2f}"
                       + (f"  step memory {r['measured_step_mem'] / 2**20:7.1f} MiB "
                          f"(pred/meas {r['predicted_step_mem'] / r['measured_step_mem']:.2f})"
                          if r.get("measured_step_mem") else ""))
        for plan, why in res["failed"]:
            out.append(f"    {plan}: FAILED {why}")
    regrets = [summarize(r)["regret"] for r in results]
    out.append(f"\nworst regret {max(regrets):.2f} over {len(results)} models "
               "(* = the plan \"auto\" chose)")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--cap", type=int, default=8, help="plans measured per model")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", default=None, help="JSON with the numbers")
    ap.add_argument("--no-memory", action="store_true",
                    help="skip each plan's op-by-op step memory run")
    a = ap.parse_args(argv)
    names = [n for n in a.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    results = []
    for name in names:
        t0 = time.perf_counter()
        res = fxpar.launch(worker, a.nprocs, name, a.cap, a.rounds, not a.no_memory)[0]
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        results.append(res)
        if a.out:
            json.dump(results, open(a.out, "w"), indent=1)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
