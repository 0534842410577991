"""Experts routed by torch.where and run one by one, one device: eager vs torch.compile vs
fxpar with its experts grouped (passes/grouped_experts, the default) and padded (each expert
over every routed position: compiler/padded_nonzero as traced, the grouped pass turned off),
in one run. `--model litgpt`: litgpt's Mixtral (an nn.ModuleList of experts); `--model
hf_eager`: Hugging Face's Mixtral with `config._experts_implementation = "eager"` (the
experts' weights stacked, a loop over the experts hit reading each one's), the same sizes.

Every variant trains its own copy of the same weights with AdamW on the same batches, timed
interleaved (one step of each per round, the order reversed every other round); "x eager" is
the median of per-round ratios. GFLOP/step: eager's by torch's FlopCounterMode on one step
(each expert on its own tokens), fxpar's from its program graph (core/cost's formulas).

    .venv/bin/python benchmarks/listed_experts.py            # 2 layers x 256, 8 experts, top-2
    .venv/bin/python benchmarks/listed_experts.py --small    # 1 layer x 64, 4 experts
    .venv/bin/python benchmarks/listed_experts.py --model hf_eager
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from unittest import mock

import torch

import fxpar
from fxpar.passes import grouped_experts

SIZES = {False: dict(n_layer=2, n_embd=256, intermediate_size=512, n_head=4, n_query_groups=2,
                     n_expert=8, n_expert_per_token=2, vocab=4096, rows=4, seq=128),
         True: dict(n_layer=1, n_embd=64, intermediate_size=128, n_head=4, n_query_groups=2,
                    n_expert=4, n_expert_per_token=2, vocab=512, rows=2, seq=64)}


def build(size):
    from litgpt.config import Config
    from litgpt.model import GPT
    kw = dict(size)
    vocab, rows, seq = kw.pop("vocab"), kw.pop("rows"), kw.pop("seq")
    cfg = Config.from_name("Mixtral-8x7B-v0.1", block_size=seq, vocab_size=vocab,
                           padded_vocab_size=vocab, head_size=kw["n_embd"] // kw["n_head"],
                           **kw)
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (rows, seq + 1), generator=g) for _ in range(4)]
    return model, batches


def build_hf_eager(size):
    """Hugging Face's Mixtral at litgpt's sizes, its experts in transformers' eager form."""
    import transformers
    kw = dict(size)
    cfg = transformers.MixtralConfig(
        vocab_size=kw["vocab"], hidden_size=kw["n_embd"], intermediate_size=kw[
            "intermediate_size"], num_hidden_layers=kw["n_layer"], num_attention_heads=kw[
            "n_head"], num_key_value_heads=kw["n_query_groups"], num_local_experts=kw[
            "n_expert"], num_experts_per_tok=kw["n_expert_per_token"],
        max_position_embeddings=kw["seq"], router_aux_loss_coef=0.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    model.config._experts_implementation = "eager"
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, kw["vocab"], (kw["rows"], kw["seq"] + 1), generator=g)
               for _ in range(4)]
    return model, batches


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    logits = getattr(logits, "logits", logits)  # (Hugging Face's output)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def graph_flops(pm) -> int:
    """FLOPs of fxpar's program graph per step (core/cost's formulas, grouped matmuls too)."""
    from fxpar.core import cost
    return sum(cost.node_flops(n) for n in pm.program.graph.graph.nodes)


def eager_flops(model, batch) -> int:
    """FLOPs eager runs in one forward + backward (each expert on its own tokens)."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        loss_fn(model, batch).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", choices=("litgpt", "hf_eager"), default="litgpt")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    base, batches = (build if args.model == "litgpt" else build_hf_eager)(SIZES[args.small])

    def eager(compiled):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fwd = torch.compile(model) if compiled else model

        def step(b):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(fwd, b)
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    def fx(grouped):
        off = mock.patch.object(grouped_experts, "_rewrite",
                                lambda graph, lst: "turned off for the benchmark")
        with (contextlib.nullcontext() if grouped else off):
            pm = fxpar.parallelize(copy.deepcopy(base), ["cpu"], example_batch=batches[0],
                                   loss_fn=loss_fn,
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        step = lambda b: pm.step(b)  # noqa: E731
        step.flops = graph_flops(pm)
        return step

    variants = {"eager": lambda: eager(False), "torch.compile": lambda: eager(True),
                "fxpar grouped": lambda: fx(True), "fxpar padded": lambda: fx(False)}
    steps, flops = {}, {"eager": eager_flops(copy.deepcopy(base), batches[0])}
    for name, make in variants.items():
        steps[name] = make()
        flops.setdefault(name, getattr(steps[name], "flops", None))
        for b in batches[:2]:  # warm-up (compiles)
            steps[name](b)
    times = {n: [] for n in steps}
    losses = {n: [] for n in steps}
    names = list(steps)
    for r in range(args.steps):
        b = batches[r % len(batches)]
        for name in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            losses[name].append(steps[name](b).item())
            times[name].append(time.perf_counter() - t)
    size = SIZES[args.small]
    print(f"\n{args.model} Mixtral {size}, AdamW, {args.steps} timed steps, "
          f"{torch.get_num_threads()} threads")
    print(f"| variant | step ms | x eager | GFLOP/step | max abs dloss vs eager |")
    print("|---|---:|---:|---:|---:|")
    ref = times["eager"]
    for name, ts in times.items():
        ratio = statistics.median(a / b for a, b in zip(ts, ref))
        dl = max(abs(a - b) for a, b in zip(losses[name], losses["eager"]))
        f = flops[name]
        print(f"| {name} | {statistics.median(ts) * 1e3:.1f} | {ratio:.3f} | "
              f"{'-' if f is None else f'{f / 1e9:.2f}'} | {dl:.1e} |")


if __name__ == "__main__":
    main()
