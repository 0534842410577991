"""fxpar expert parallelism vs the same MoE model's dp, ZeRO-3 and tp plans: time, memory, loss.

    .venv/bin/python benchmarks/ep_vs_zero.py [--steps 20] [--warmup 3] [--layers 2]
        [--hidden 256] [--experts 8] [--batch 8] [--seq 64] [--nprocs 2] [--codegen eager]
        [--model hf|hf_eager|hf_batched|litgpt|deepseek|llama4]

One launch of `--nprocs` gloo CPU ranks trains a Hugging Face Mixtral (grouped_mm experts,
top-2 routing; sizes from the flags; `--model hf_eager`: the same with
`config._experts_implementation = "eager"`, a loop over the experts some token picked;
`--model hf_batched`: `"batched_mm"`, each routed row's expert matrices picked by index and
multiplied by bmm, which fxpar runs grouped, plus a "dp picked" plan: dp with the rows'
picked copies as traced, passes/batched_experts off), or with `--model litgpt` litgpt's
Mixtral (its experts an nn.ModuleList, each run on the rows torch.where picks for it:
grouped, each rank routing its own tokens, and ep runs each rank's experts in slots), or
with `--model deepseek` a Hugging Face DeepSeek-V3 (MLA attention, a shared expert beside
the routed ones), or with `--model llama4` a Hugging Face Llama 4 text model (every expert
runs every token, the top-1 routing score zeroing the others' inputs, beside a shared
expert: ep sends each rank's tokens to every expert's rank by equal all-to-alls), under six
plans (seven from 4 ranks; "dp picked" too with hf_batched),
each from the same initial weights on the same batches with AdamW (lr 1e-3):

    Plan(dp=world)             every rank holds every expert and computes its own routed rows;
                               the expert gradients all-reduced
    Plan(dp=world, zero=3)     every weight (experts included) 1/world per rank, gathered
                               before its use forward and backward
    Plan(dp=world, ep=world)   each rank holds world-th of the experts; the routed rows go to
                               their experts' ranks and back by all-to-all
    Plan(dp=world, ep=world,   the same, each all-to-all waited on right where it is issued
         overlap=False)        ("ep blocking": what the overlap pass's moves gain)
    Plan(tp=world)             the attention, dense layers and experts split (each expert's
                               linears, Hugging Face's grouped stacks along their features)
    Plan(dp=world, zero=3,     ZeRO-3 with ep = world / 2 (2 at 2 ranks): an expert weight is
         ep=max(2, world/2))   1/ep of the experts, ZeRO-sharded over the dp / ep ranks holding
                               them (none more at ep = dp), the other weights over all ranks
    Plan(dp=world/2, ep=2,     (from 4 ranks) half the experts per rank, each split over tp
         tp=2)

Under torchrun (several "nodes" on one host or on many) the script runs in the ranks torchrun
started instead of launching its own (`--nprocs` is torchrun's world). Two "nodes" of 2 ranks
on localhost:

    for n in 0 1; do .venv/bin/python -m torch.distributed.run --nnodes 2 --node-rank $n \
        --nproc-per-node 2 --master-addr localhost --master-port 29535 \
        benchmarks/ep_vs_zero.py & done; wait

Timing: median wall time of `--steps` steps after `--warmup` warm-up steps and one memory
step, a barrier before each step, the sides' steps interleaved (the order rotating) so a
change in the machine's load hits all alike; rank 0's times. Memory (max over ranks): the
same tracker as benchmarks/zero_vs_fsdp.py (runtime/memtrack.StepMemory), entered after
parallelize (tracing a Hugging Face model under it fails), from the weights the rank then
holds (its slices, ZeRO's shards) and every storage the steps allocate (optimizer state
included): held = live before a step, peak = the maximum during one. "experts/rank" = the
bytes of expert weights plus their AdamW state this rank holds (parameters as its program
holds them: its experts under ep, its flat shard under ZeRO-3; two AdamW moments each),
from the tensors themselves. "exposed": the fraction of the step rank 0's compute thread
waited on communication (the runtime's recorder, median). Ratios are ep (and ep with ZeRO-3)
over the other plans, in this one run.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

import fxpar
from fxpar.runtime import dist as rdist
from fxpar.runtime.memtrack import warm_steps_measured

PLANS = {"dp": lambda w, cg: {"dp": w, "codegen": cg},
         "zero=3": lambda w, cg: {"dp": w, "zero": 3, "codegen": cg},
         "ep": lambda w, cg: {"dp": w, "ep": w, "codegen": cg},
         "ep blocking": lambda w, cg: {"dp": w, "ep": w, "overlap": False, "codegen": cg},
         "tp": lambda w, cg: {"tp": w, "codegen": cg},
         "ep+zero=3": lambda w, cg: {"dp": w, "ep": max(2, w // 2), "zero": 3, "codegen": cg},
         "ep x tp": lambda w, cg: {"dp": w // 2, "ep": 2, "tp": 2, "codegen": cg}}


PICKED = "dp picked"  # (--model hf_batched: dp, batched_mm's per-row copies as traced)


def _plans(world: int, model: str = "hf") -> list[str]:
    """The plans run on `world` ranks (ep x tp from 4; "dp picked" for batched_mm experts)."""
    return [k for k in PLANS if k != "ep x tp" or world >= 4] + \
        ([PICKED] if model == "hf_batched" else [])


def _model(args):
    if args.model == "litgpt":
        from litgpt.config import Config
        from litgpt.model import GPT
        torch.manual_seed(0)
        return GPT(Config.from_name(
            "Mixtral-8x7B-v0.1", n_layer=args.layers, n_embd=args.hidden, n_head=4,
            n_query_groups=2, block_size=args.seq, vocab_size=512, padded_vocab_size=512,
            intermediate_size=2 * args.hidden, n_expert=args.experts, n_expert_per_token=2))
    import transformers
    if args.model == "llama4":
        cfg = transformers.Llama4TextConfig(
            vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden,
            intermediate_size_mlp=2 * args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
            num_local_experts=args.experts, num_experts_per_tok=1,
            interleave_moe_layer_step=1, router_aux_loss_coef=0.0, router_jitter_noise=0.0,
            attention_chunk_size=args.seq, max_position_embeddings=args.seq,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        return transformers.Llama4ForCausalLM(cfg)
    if args.model == "deepseek":
        cfg = transformers.DeepseekV3Config(
            vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            moe_intermediate_size=args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=args.experts, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=0, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16,
            qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=args.seq,
            rope_scaling=None, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        return transformers.DeepseekV3ForCausalLM(cfg)
    cfg = transformers.MixtralConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=args.experts, num_experts_per_tok=2, router_aux_loss_coef=0.0,
        max_position_embeddings=args.seq)
    cfg._attn_implementation = "sdpa"
    if args.model in ("hf_eager", "hf_batched"):
        cfg._experts_implementation = "eager" if args.model == "hf_eager" else "batched_mm"
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def _batches(args):
    out = []
    for s in range(4):
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(0, 512, (args.batch, args.seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _expert_bytes(pm) -> int:
    """Expert weights + their AdamW moments as this rank holds them (3 tensors each)."""
    z = pm.sharded_optimizer
    total = 0
    for i, name in enumerate(pm.program.signature.param_names):
        if ".experts." not in name:
            continue
        t = z.param_shards[i] if z is not None and z.shard_params else pm.params[i]
        total += 3 * t.numel() * t.element_size()
    return total


def _prepare(kind, args, data, world):
    from fxpar.examples.external_zoo import logits_loss
    from unittest import mock
    from fxpar.passes import batched_experts
    model = _model(args)
    # (PICKED: the batched_mm experts left as traced, no layer found to group)
    with mock.patch.object(batched_experts, "find", lambda gm: []) if kind == PICKED else \
            contextlib.nullcontext():
        pm = fxpar.parallelize(model, world, example_batch=data[0],
                               loss_fn=logits_loss if args.model == "litgpt" else None,
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                               plan=PLANS["dp" if kind == PICKED else kind](world,
                                                                            args.codegen))
    # (tracking starts from what the rank holds after parallelize: its weights as its
    # program holds them; tracing HF's model under the tracker fails on fake storages)
    z = pm.sharded_optimizer
    losses, tracker = warm_steps_measured(
        pm.step, data, args.warmup,
        [*(z.param_shards if z is not None and z.shard_params else []),
         *(z.shards if z is not None else []), *model.parameters(), *model.buffers()])
    return pm, {"losses": losses, "times": [], "held": tracker.held,
                "peak": tracker.peak_live, "experts": _expert_bytes(pm)}


def bench(args):
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=rdist.timeout())
    data = _batches(args)
    sides = [(k, *_prepare(k, args, data, world)) for k in _plans(world, args.model)]
    for s in range(args.warmup + 1, args.warmup + 1 + args.steps):
        batch = data[s % len(data)]
        k = s % len(sides)
        for _, pm, res in sides[k:] + sides[:k]:
            dist.barrier()
            t = time.perf_counter()
            res["losses"].append(pm.step(batch).item())
            res["times"].append(time.perf_counter() - t)
    out = {}
    for kind, pm, res in sides:
        res["time"] = statistics.median(res.pop("times"))
        res["exposed"] = statistics.median(s.exposed_fraction
                                           for s in pm.step_stats[-args.steps:])
        out[kind] = res
    del sides
    gc.collect()
    return out


def _mib(n):
    return n / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--codegen", default="eager", choices=("eager", "inductor"))
    ap.add_argument("--model", default="hf",
                    choices=("hf", "hf_eager", "hf_batched", "litgpt", "deepseek", "llama4"))
    args = ap.parse_args()
    torchrun = rdist.under_torchrun()  # (then the script runs in the ranks torchrun started)
    if torchrun:
        args.nprocs = int(os.environ["WORLD_SIZE"])
    if args.batch % args.nprocs or args.experts % args.nprocs:
        ap.error("--batch and --experts must be multiples of --nprocs")
    res = rdist.launch_or_join(bench, args.nprocs, args)
    if res is None:  # (torchrun's other ranks: rank 0 prints)
        return
    if torchrun:
        print(f"torchrun: {args.nprocs // int(os.environ['LOCAL_WORLD_SIZE'])} nodes of "
              f"{os.environ['LOCAL_WORLD_SIZE']} ranks")
    ranks = sorted(res)
    n = sum(p.numel() for p in _model(args).parameters())
    title = {"hf": "HF Mixtral", "hf_eager": "HF Mixtral (eager experts)",
             "hf_batched": "HF Mixtral (batched_mm experts)",
             "litgpt": "litgpt Mixtral",
             "deepseek": "HF DeepSeek-V3 (1 shared expert)",
             "llama4": "HF Llama 4 (every expert on every token, 1 shared expert)"}[args.model]
    k = 1 if args.model == "llama4" else 2
    print(f"{title} {args.layers} layers x {args.hidden}, {args.experts} experts top-{k} "
          f"({n / 1e6:.2f} M params), batch {args.batch} x {args.seq} tokens, "
          f"{args.nprocs} gloo CPU ranks, AdamW, codegen={args.codegen}, {args.steps} timed steps")
    print(f"{'plan':11s} {'median step':>12s} {'held MiB':>9s} {'peak MiB':>9s} "
          f"{'experts/rank MiB':>17s} {'last loss':>10s} {'exposed':>8s}")
    for kind in _plans(args.nprocs, args.model):
        r = [res[k][kind] for k in ranks]
        print(f"{kind:11s} {r[0]['time'] * 1e3:9.1f} ms {_mib(max(x['held'] for x in r)):9.1f} "
              f"{_mib(max(x['peak'] for x in r)):9.1f} {_mib(max(x['experts'] for x in r)):17.2f}"
              f" {r[0]['losses'][-1]:10.5f} {r[0]['exposed']:8.3f}")
    print()
    pairs = [("ep", "dp"), ("ep", "zero=3"), ("ep", "tp"), ("ep", "ep blocking"),
             ("ep+zero=3", "zero=3"), ("ep+zero=3", "ep")]
    if "ep x tp" in _plans(args.nprocs):
        pairs += [("ep x tp", "tp"), ("ep x tp", "ep"), ("ep x tp", "zero=3")]
    if args.model == "hf_batched":
        pairs += [("dp", PICKED), ("ep", PICKED)]
    for mine, kind in pairs:
        diff = max(abs(a - b) for k in ranks
                   for a, b in zip(res[k][mine]["losses"], res[k][kind]["losses"]))
        mem = max(res[k][mine]["experts"] for k in ranks) / \
            max(res[k][kind]["experts"] for k in ranks)
        peak = max(res[k][mine]["peak"] for k in ranks) / max(res[k][kind]["peak"] for k in ranks)
        held = max(res[k][mine]["held"] for k in ranks) / max(res[k][kind]["held"] for k in ranks)
        print(f"{mine} / {kind}: step {res[0][mine]['time'] / res[0][kind]['time']:.3f}x, "
              f"experts/rank {mem:.3f}x, held {held:.3f}x, peak {peak:.3f}x, "
              f"max |loss diff| {diff:.2e}")


if __name__ == "__main__":
    main()
