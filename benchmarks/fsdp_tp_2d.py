"""2-D parallelism: fxpar {"dp": 2, "zero": 3, "tp": 2} vs FSDP2 over DTensor tensor parallelism.

    .venv/bin/python benchmarks/fsdp_tp_2d.py [--steps 20] [--warmup 3] [--hidden 256]
        [--layers 4] [--batch 8] [--seq 64]

The peer is torchtitan's recipe for large models, written by hand: a 2-D DeviceMesh
("dp", "tp") of 4 gloo CPU ranks; per decoder layer q/k/v/gate/up ColwiseParallel and
o/down RowwiseParallel (`parallelize_module` on the "tp" mesh), the embedding RowwiseParallel
and the LM head ColwiseParallel with replicated logits; then `fully_shard` of every layer and
of the root over the "dp" mesh (FSDP2 defaults: reshard after forward, fp32). fxpar gets the
model and the plan dict and finds its split on the graph. Both train the same HF Llama (same
seed) with AdamW on the same batches inside one launch; the peer gets its dp rank's half of
each global batch and reports the dp-mean loss. The two sides' timed steps alternate (order
swapped every step), a barrier before each; median of `--steps`. Memory: per rank, the live
tensor bytes over one step, held state included (runtime/memtrack.StepMemory: the same dispatch-
mode tracker for both sides, from the fresh model on); max over ranks.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import fxpar
from fxpar.examples import models as M
from fxpar.runtime import dist as rdist
from fxpar.runtime.memtrack import StepMemory

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_vs_dtensor import hand_plan  # noqa: E402


def _model(args):
    torch.manual_seed(0)
    return M.hf_llama(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=8,
                      kv_heads=4, max_pos=args.seq)


def _peer(model, mesh, opt_factory):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    tp, dp = mesh["tp"], mesh["dp"]
    layer_plan = hand_plan()
    for layer in model.model.layers:
        parallelize_module(layer, tp, layer_plan)
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate())})
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = opt_factory(model.parameters())
    dp_rank, dp_group = dp.get_local_rank(), dp.get_group()

    def step(batch):
        local = {k: v.chunk(2)[dp_rank] for k, v in batch.items()}
        opt.zero_grad(set_to_none=True)
        loss = model(**local).loss
        loss.backward()
        opt.step()
        red = loss.detach().clone()
        dist.all_reduce(red, group=dp_group)
        return (red / 2).item()
    return step


def _side(kind, args, data, mesh, opt):
    model = _model(args)
    tracker = StepMemory([*model.parameters(), *model.buffers()])
    tracker.__enter__()
    if kind == "fxpar":
        pm = fxpar.parallelize(model, 4, example_batch=data[0], optimizer=opt,
                               plan={"dp": 2, "zero": 3, "tp": 2})
        step = lambda b: pm.step(b).item()  # noqa: E731
    else:
        step = _peer(model, mesh, opt)
    losses = [step(data[s % len(data)]) for s in range(args.warmup)]
    dist.barrier()
    with tracker.window():
        losses.append(step(data[args.warmup % len(data)]))
    tracker.__exit__(None, None, None)
    return step, {"losses": losses, "times": [], "peak": tracker.peak_live, "held": tracker.held}


def bench(args):
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=rdist.timeout())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    data = [M.hf_lm_batch(args.vocab, args.batch, args.seq, seed=s) for s in range(4)]
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    sides = [(k, *_side(k, args, data, mesh, opt)) for k in ("fxpar", "peer")]
    for s in range(args.warmup + 1, args.warmup + 1 + args.steps):
        for kind, step, res in (sides if s % 2 else sides[::-1]):
            dist.barrier()
            t = time.perf_counter()
            res["losses"].append(step(data[s % len(data)]))
            res["times"].append(time.perf_counter() - t)
    out = {kind: {**res, "time": statistics.median(res.pop("times"))} for kind, _, res in sides}
    del sides
    gc.collect()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    args = ap.parse_args()
    res = fxpar.launch(bench, 4, args)
    n = sum(p.numel() for p in _model(args).parameters())
    print(f"HF Llama {args.layers} x {args.hidden} (8 heads, 4 kv heads, vocab {args.vocab}: "
          f"{n / 1e6:.2f} M params), global batch {args.batch} x {args.seq}, 4 gloo CPU ranks "
          f"(dp 2 x tp 2), AdamW, {args.steps} timed steps, alternating")
    print(f"{'':28s} {'median step':>12s} {'held MiB':>9s} {'peak MiB':>9s}   peak per rank")
    for kind, name in (("fxpar", "fxpar dp2 zero3 tp2"), ("peer", "FSDP2 + DTensor TP")):
        r = [res[k][kind] for k in sorted(res)]
        print(f"{name:28s} {r[0]['time'] * 1e3:9.1f} ms {max(x['held'] for x in r) / 2**20:9.2f} "
              f"{max(x['peak'] for x in r) / 2**20:9.2f}   "
              + " ".join(f"{x['peak'] / 2**20:.2f}" for x in r))
    t = res[0]["fxpar"]["time"] / res[0]["peer"]["time"]
    m = max(res[k]["fxpar"]["peak"] for k in res) / max(res[k]["peer"]["peak"] for k in res)
    diff = max(abs(a - b) for a, b in zip(res[0]["fxpar"]["losses"], res[0]["peer"]["losses"]))
    fl = res[0]["fxpar"]["losses"]
    print(f"fxpar / FSDP2+TP: time ratio {t:.3f}   peak-memory ratio {m:.3f}   (loss "
          f"{fl[0]:.4f} -> {fl[-1]:.4f}, max |loss diff| = {diff:.2e})")


if __name__ == "__main__":
    main()
