"""When expert parallelism, context parallelism and HSDP win, by simulation at scale.

Hugging Face models at their published sizes, built on the meta device and traced a few
blocks deep on fake tensors (attention as the GPU's fused kernel: compiler/target_attention),
scaled to their depth (GraphStats.with_depth), and planned for H100-SXM nodes (8 GPUs, NVLink
inside, one 400 Gb/s NIC per GPU between; core/cost.HARDWARE["h100"]): for each the plan the
search picks over everything, and the best plan with the axis off and at each fixed degree.

- A DeepSeek-V3 (671 B parameters, 256 routed experts top-8 and a shared one, MLA attention,
  3 dense layers then 58 MoE ones) on 256 GPUs, 1024 sequences of 4096 tokens a step; and
  64 sequences of 32k tokens (64 rows cannot feed 256 dp ranks: cp with ep, each rank's own
  tokens sent to their experts).
- A Llama-3-8B at 128k tokens a sequence on 64 GPUs, 8 sequences a step (dp alone cannot
  split 8 rows over 64 ranks).
- The same Llama at 1M tokens on 64 GPUs, one sequence a step: context parallelism's
  attention gathered against ring attention.
- The same Llama at 8k tokens on 64 GPUs (8 nodes), 512 sequences: ZeRO-3 over all 64 ranks
  against HSDP's shard groups; and a 2-stage pipeline with the mesh's dp groups outermost
  (each spanning both stages' nodes) or the stages outermost (Plan.pp_outer).

Run: python benchmarks/planner_axes_at_scale.py [--only ds3,ds3_long,llama_long,llama_1m,llama_hsdp]
(CPU only, about 2-4 minutes)
"""
from __future__ import annotations

import argparse
import time

import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar.compiler import planner
from fxpar.compiler.compile import planner_stats
from fxpar.core import cost
from fxpar.core.errors import PlanError


def deepseek_v3(layers: int, seq: int):
    cfg = transformers.DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
        num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, max_position_embeddings=seq)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return transformers.DeepseekV3ForCausalLM(cfg)


def llama3_8b(layers: int, seq: int):
    cfg = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=seq, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


# key, name, factory, traced layers, depth, first blocks kept, seq, GPUs, rows, variants
CASES = [
    ("ds3", "DeepSeek-V3 671B", deepseek_v3, 6, 61, 3, 4096, 256, 1024, [
        ("everything", {}), ("ep off", {"ep": 1}), ("ep=8", {"ep": 8}),
        ("ep=32", {"ep": 32}), ("ep=64", {"ep": 64})]),
    ("ds3_long", "DeepSeek-V3 671B, 32k tokens", deepseek_v3, 6, 61, 3, 32768, 256, 64, [
        ("everything", {}), ("cp off", {"cp": 1}), ("ep off", {"ep": 1}),
        ("cp=4, ep off", {"cp": 4, "ep": 1}), ("cp=4 x ep=8", {"cp": 4, "ep": 8})]),
    ("llama_long", "Llama-3-8B, 128k tokens", llama3_8b, 3, 32, 0, 131072, 64, 8, [
        ("everything", {}), ("cp off", {"cp": 1}), ("cp=2", {"cp": 2}), ("cp=4", {"cp": 4}),
        ("cp=8", {"cp": 8}), ("cp=8, gathered", {"cp": 8, "cp_attention": "gather"}),
        ("cp=8, ring", {"cp": 8, "cp_attention": "ring"})]),
    ("llama_1m", "Llama-3-8B, 1M tokens", llama3_8b, 3, 32, 0, 1048576, 64, 1, [
        ("everything", {}), ("gathered", {"cp_attention": "gather"}),
        ("ring", {"cp_attention": "ring"})]),
    ("llama_hsdp", "Llama-3-8B, 8k tokens", llama3_8b, 3, 32, 0, 8192, 64, 512, [
        # (a shard group of all 64 ranks is plain ZeRO; hpz=0: none)
        ("everything", {}), ("ZeRO-3 over all 64", {"zero": 3, "dp_shard": 64, "hpz": 0}),
        ("ZeRO-3, HSDP shard 8", {"zero": 3, "dp_shard": 8, "hpz": 0}),
        ("ZeRO-3, hpZ 8", {"zero": 3, "dp_shard": 64, "hpz": 8}),
        ("ZeRO-1 over all 64", {"zero": 1, "dp_shard": 64, "hpz": 0}),
        # the mesh's order at pp=2: each HSDP shard group of 8 dp ranks spread over two
        # nodes (the stages neighbours), or on one node (the stages outermost)
        ("pp=2, HSDP shard 8, dp outermost", {"pp": 2, "dp_shard": 8, "hpz": 0,
                                               "pp_outer": False}),
        ("pp=2, HSDP shard 8, pp outermost", {"pp": 2, "dp_shard": 8, "hpz": 0,
                                               "pp_outer": True})]),
]


def stats_of(factory, traced, depth, keep_first, seq):
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = factory(traced, seq)
        ids = torch.randint(0, model.config.vocab_size, (1, seq))
    stats = planner_stats(model, {"input_ids": ids, "labels": ids}, device="cuda",
                          precision="bf16")
    return stats.with_depth(depth, keep_first=keep_first)


def _plan(p) -> str:
    out = f"dp={p.dp} tp={p.tp} pp={p.pp} m={p.microbatches} {p.schedule} ZeRO-{p.zero}"
    out += f" shard {p.dp_shard}" if p.hsdp else ""
    out += f" hpz {p.hpz}" if p.hpz else ""
    out += f" ep={p.ep}" if p.ep > 1 else ""
    out += f" cp={p.cp} ({p.cp_attention})" if p.cp > 1 else ""
    out += ", pp outermost" if p.pp_outer else ""
    r = p.remat if isinstance(p.remat, str) else f"{p.remat / 2**30:.0f} GiB"
    return out + f", remat {r}" + (", optimizer on host" if p.offload_optimizer else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    hw = cost.HARDWARE["h100"]
    print("| model | GPUs | tokens a step | searched | plan | predicted step | MFU | "
          "memory/GPU | search |")
    print("|---|---:|---:|---|---|---:|---:|---:|---:|")
    for key, name, factory, traced, depth, keep, seq, gpus, rows, variants in CASES:
        if args.only and key not in args.only.split(","):
            continue
        stats = stats_of(factory, traced, depth, keep, seq)
        best = None
        for label, cons in variants:
            t0 = time.perf_counter()
            try:
                c = planner.search(stats, gpus, hw, batch_rows=rows, precision="bf16",
                                   executable=False, constraints=cons).best
            except PlanError as e:
                print(f"| {name} | {gpus} | {rows * seq:,} | {label} | "
                      f"{str(e)[:160]} | - | - | - | {time.perf_counter() - t0:.0f} s |")
                continue
            dt = time.perf_counter() - t0
            best = best or c
            print(f"| {name} | {gpus} | {rows * seq:,} | {label} | {_plan(c.plan)} | "
                  f"{c.step_s:.2f} s ({c.step_s / best.step_s:.2f}x) | {c.mfu * 100:.1f}% | "
                  f"{c.memory.total / 2**30:.0f} GiB | {dt:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
