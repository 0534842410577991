"""fxpar context parallelism vs the same model's dp and tp plans and PyTorch's context_parallel.

    .venv/bin/python benchmarks/cp_vs_dp.py [--steps 10] [--warmup 2] [--layers 2]
        [--hidden 256] [--seq 1024] [--rows 2] [--nprocs 2] [--codegen eager] [--remat none]

One launch of `--nprocs` gloo CPU ranks trains a Hugging Face Llama (SDPA causal attention,
RoPE, grouped-query attention; sizes from the flags) with AdamW (lr 1e-3) from the same
initial weights on the same batches of `--rows` sequences of `--seq` tokens, under:

    Plan(dp=world)            each rank its rows' whole sequences (needs rows >= world)
    Plan(dp=world, cp=world)  each rank every row's world-th of the sequence; attention on
                              the keys/values all-gathered over the ranks (cp_attention=
                              "gather"), and as ring attention ("cp ring": the keys/values
                              passed around the ranks, never gathered), and as the cost
                              model picks per attention ("cp auto", the default)
    Plan(tp=world, sequence_parallel=True)  the heads and MLP split, the rest of the
                              residual stream split along the sequence
    torch context_parallel    PyTorch's ring attention (torch.distributed.tensor.experimental
                              .context_parallel) around the eager model, gradients
                              all-reduced: it runs only on CUDA's attention kernels, and the
                              script reports its error where it does not run

Under torchrun (several "nodes" on one host or on many) the script runs in the ranks torchrun
started instead of launching its own (`--nprocs` is torchrun's world). Two "nodes" of 2 ranks
on localhost:

    for n in 0 1; do .venv/bin/python -m torch.distributed.run --nnodes 2 --node-rank $n \
        --nproc-per-node 2 --master-addr localhost --master-port 29536 \
        benchmarks/cp_vs_dp.py & done; wait

Timing: median wall time of `--steps` steps after `--warmup` warm-up steps and one memory
step, a barrier before each, the sides' steps interleaved (the order rotating); rank 0's.
Memory (max over ranks): runtime/memtrack.StepMemory from the weights the rank holds after
parallelize: peak = the most live during one step. Ratios are cp over each other plan, in
this one run; "loss diff" is the largest difference of any step's loss from dp's (or tp's
where dp cannot split the rows).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

import fxpar
from fxpar.core import ir
from fxpar.runtime import dist as rdist
from fxpar.runtime.memtrack import warm_steps_measured

VOCAB = 512


def _plans(world, rows, cg, remat):
    extra = {"codegen": cg, "remat": remat}
    plans = {"cp": {"dp": world, "cp": world, "cp_attention": "gather", **extra},
             "cp ring": {"dp": world, "cp": world, "cp_attention": "ring", **extra},
             "cp auto": {"dp": world, "cp": world, **extra},
             "tp": {"tp": world, "sequence_parallel": True, **extra}}
    if rows % world == 0:
        plans = {"dp": {"dp": world, **extra}, **plans}
    return plans


def _model(args):
    import transformers
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=args.seq)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _batches(args):
    out = []
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(0, VOCAB, (args.rows, args.seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _prepare(plan, args, data, world):
    model = _model(args)
    pm = fxpar.parallelize(model, world, example_batch=data[0],
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), plan=plan)
    z = pm.sharded_optimizer
    losses, tracker = warm_steps_measured(
        pm.step, data, args.warmup,
        [*(z.shards if z is not None else []), *model.parameters(), *model.buffers()])
    cp = (pm.program.graph.meta.get(ir.CP_REPORT) if pm.program.graph is not None else
          None) or {}
    way = (f"ring fwd {cp['ring']}, ring bwd {cp['ring_backward']}, gathered fwd "
           f"{len(cp['attention']) - cp['ring']}" if cp else "")
    return pm.step, {"losses": losses, "times": [], "peak": tracker.peak_live, "way": way}


def _torch_context_parallel(args, data, world):
    """PyTorch's own: the eager model, its sequence buffers sharded by context_parallel,
    gradients all-reduced and averaged (DDP's reduction), AdamW. Returns (step, result) or
    (None, the error it raised)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    model = _model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))

    def step(batch):
        ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
        opt.zero_grad()
        with context_parallel(mesh, buffers=[ids, labels], buffer_seq_dims=[1, 1]):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        dist.all_reduce(loss.detach())
        return loss.detach() / world

    try:
        losses = [step(data[s % len(data)]).item() for s in range(args.warmup + 1)]
    except Exception as e:  # noqa: BLE001 - the peer's refusal is the result
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"{type(e).__name__}: {msg}"
    return step, {"losses": losses, "times": [], "peak": float("nan")}


def bench(args):
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=rdist.timeout())
    data = _batches(args)
    sides = [(k, *_prepare(p, args, data, world))
             for k, p in _plans(world, args.rows, args.codegen, args.remat).items()]
    step, res = _torch_context_parallel(args, data, world)
    if step is not None:
        sides.append(("torch cp", step, res))
    for s in range(args.warmup + 1, args.warmup + 1 + args.steps):
        batch = data[s % len(data)]
        k = s % len(sides)
        for _, fn, r in sides[k:] + sides[:k]:
            dist.barrier()
            t = time.perf_counter()
            r["losses"].append(fn(batch).item())
            r["times"].append(time.perf_counter() - t)
    out = {}
    for kind, _, r in sides:
        r["time"] = statistics.median(r.pop("times"))
        out[kind] = r
    if step is None:
        out["torch cp"] = res
    del sides
    gc.collect()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--codegen", default="eager", choices=("eager", "inductor"))
    ap.add_argument("--remat", default="none", help='Plan.remat of every fxpar plan ("sqrt": '
                    "cp gathers each attention's keys and values again in the backward)")
    args = ap.parse_args()
    torchrun = rdist.under_torchrun()  # (then the script runs in the ranks torchrun started)
    if torchrun:
        args.nprocs = int(os.environ["WORLD_SIZE"])
    if args.seq % (2 * args.nprocs):
        ap.error("--seq must be a multiple of 2 x --nprocs")
    res = rdist.launch_or_join(bench, args.nprocs, args)
    if res is None:  # (torchrun's other ranks: rank 0 prints)
        return
    if torchrun:
        print(f"torchrun: {args.nprocs // int(os.environ['LOCAL_WORLD_SIZE'])} nodes of "
              f"{os.environ['LOCAL_WORLD_SIZE']} ranks")
    ranks = sorted(res)
    n = sum(p.numel() for p in _model(args).parameters())
    print(f"HF Llama {args.layers} layers x {args.hidden} ({n / 1e6:.2f} M params), "
          f"{args.rows} rows x {args.seq} tokens, {args.nprocs} gloo CPU ranks, AdamW, "
          f"codegen={args.codegen}, remat={args.remat}, {args.steps} timed steps")
    print(f"{'plan':9s} {'median step':>12s} {'peak MiB':>9s} {'last loss':>10s}")
    kinds = [k for k in res[0] if isinstance(res[0][k], dict)]
    for kind in kinds:
        r = [res[k][kind] for k in ranks]
        print(f"{kind:9s} {r[0]['time'] * 1e3:9.1f} ms {max(x['peak'] for x in r) / 2**20:9.1f} "
              f"{r[0]['losses'][-1]:10.5f}  {r[0].get('way', '')}")
    if isinstance(res[0]["torch cp"], str):
        print(f"torch cp  did not run: {res[0]['torch cp']}")
    print()
    ref = "dp" if "dp" in kinds else "tp"
    for mine in ("cp", "cp ring", "cp auto"):
        for kind in [k for k in kinds if k != mine and not (mine != "cp" and k.startswith("cp"))
                     or (mine == "cp ring" and k == "cp")]:
            step = res[0][mine]["time"] / res[0][kind]["time"]
            peak = max(res[k][mine]["peak"] for k in ranks) / max(res[k][kind]["peak"]
                                                                   for k in ranks)
            print(f"{mine} / {kind:8s}: step {step:.3f}x, peak {peak:.3f}x")
        diff = max(abs(a - b) for k in ranks
                   for a, b in zip(res[k][mine]["losses"], res[k][ref]["losses"]))
        print(f"{mine}'s max |loss diff| from {ref}: {diff:.2e}")


if __name__ == "__main__":
    main()
