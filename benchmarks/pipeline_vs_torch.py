"""fxpar pp=2 vs torch.distributed.pipelining, same model, same split, same schedule, in one run.

The model is the small GPT (lm_head untied: torch's pipelining has no cross-stage weight
tying). fxpar cuts the joint graph itself; the torch side is then given the same cut (the
blocks whose weights fxpar put on stage 0) as two hand-built stage modules, which is what a
torch user writes by hand. Both run the same schedule and microbatch count on the same spawned
gloo ranks, one after the other, with AdamW and the same batches. Prints per schedule the
median step time of each, the ratio fxpar / torch, the peak memory a step allocates per rank
(MemoryTracker: activations, stashes, gradients, receive buffers; torch's preallocated receive
buffers are outside the step and not counted), and the largest loss difference. Code
generation: fxpar also with Plan.codegen="inductor", torch also with each stage module under
torch.compile (time only: the tracker does not see buffers Inductor's code allocates).

    .venv/bin/python benchmarks/pipeline_vs_torch.py [--steps 20] [--layers 8] [--embd 256]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.examples import models as M
from fxpar.runtime.memtrack import MemoryTracker

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def _cfg(args):
    return M.GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4,
                       n_embd=args.embd)


def _model(cfg):
    torch.manual_seed(0)
    model = M.GPT(cfg)
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())  # untie
    return model


class First(nn.Module):
    """Stage 0 for torch: embeddings and the first blocks (idx -> hidden)."""

    def __init__(self, model, blocks):
        super().__init__()
        self.wte, self.wpe, self.h = model.wte, model.wpe, nn.ModuleList(blocks)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        return x


class Last(nn.Module):
    """Stage 1 for torch: the other blocks, ln_f and the head (hidden -> logits)."""

    def __init__(self, model, blocks):
        super().__init__()
        self.h, self.ln_f, self.lm_head = nn.ModuleList(blocks), model.ln_f, model.lm_head

    def forward(self, x):
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def _first_stage_blocks(pm, n_layer) -> int:
    """How many transformer blocks fxpar's cut put on stage 0 (checked to be a prefix)."""
    stages = pm.program.pipeline.param_stages
    names = pm.program.signature.param_names
    on0 = [all(0 in stages.get(i, {0}) for i, n in enumerate(names) if n.startswith(f"h.{b}."))
           for b in range(n_layer)]
    k = on0.index(False) if False in on0 else n_layer
    if any(on0[k:]):
        raise SystemExit(f"fxpar's cut is not a block prefix: {on0}")
    return k


def _time(fn, warmup, steps, tracker_step):
    times, losses, peak = [], [], 0
    for s in range(warmup + steps):
        dist.barrier()
        if s == tracker_step:
            with MemoryTracker() as mt:
                loss = fn(s)
            peak = mt.peak()
        else:
            t = time.perf_counter()
            loss = fn(s)
            if s >= warmup:
                times.append(time.perf_counter() - t)
        losses.append(loss)
    return statistics.median(times), losses, peak


def bench(args):
    torch.set_num_threads(1)
    cfg = _cfg(args)
    data = [M.gpt_batch(cfg, args.batch, seed=s) for s in range(4)]
    rank = int(os.environ["RANK"])
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    ctx = (args, cfg, data, rank, opt)
    out = {}
    for sched in args.schedules:
        def fxpar_run(codegen, tracked):
            pm = fxpar.parallelize(_model(cfg), 2, example_batch=data[0], optimizer=opt,
                                   plan=fxpar.Plan(pp=2, microbatches=args.microbatches,
                                                   schedule=sched, codegen=codegen))
            return _time(lambda s: pm.step(data[s % 4]).item(), args.warmup, args.steps,
                         args.warmup + args.steps - 1 if tracked else -1), \
                _first_stage_blocks(pm, cfg.n_layer)
        fx, k = fxpar_run("eager", True)
        fxi, _ = fxpar_run("inductor", False)
        out[sched] = (fx, torch_run(ctx, k, sched, compiled=False), k, fxi,
                      torch_run(ctx, k, sched, compiled=True))
    return out


def torch_run(ctx, k, sched, compiled):
    """torch.distributed.pipelining with the cut fxpar found (stage modules compiled or not);
    a failure to compile is returned as its message."""
    from torch.distributed import pipelining as tp
    args, cfg, data, rank, opt = ctx
    try:
        model = _model(cfg)
        sub = First(model, model.h[:k]) if rank == 0 else Last(model, model.h[k:])
        stage = tp.PipelineStage(torch.compile(sub) if compiled else sub, rank, 2,
                                 torch.device("cpu"))
        loss_fn = lambda logits, tgt: F.cross_entropy(  # noqa: E731
            logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))
        schedule = getattr(tp, SCHEDULES[sched])(stage, args.microbatches, loss_fn=loss_fn)
        o = opt(sub.parameters())

        def torch_step(s):
            idx, tgt = data[s % 4]
            o.zero_grad(set_to_none=True)
            losses = []
            if rank == 0:
                schedule.step(idx)
            else:
                schedule.step(target=tgt, losses=losses)
            o.step()
            loss = torch.stack(losses).mean() if losses else torch.zeros(())
            dist.broadcast(loss, src=1)
            return loss.item()

        return _time(torch_step, args.warmup, args.steps,
                     -1 if compiled else args.warmup + args.steps - 1)
    except Exception as e:  # noqa: BLE001 - a peer variant that cannot run here is a row
        if not compiled:
            raise
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    args = ap.parse_args()
    res = fxpar.launch(bench, 2, args)
    n_params = sum(p.numel() for p in _model(_cfg(args)).parameters())
    print(f"GPT {args.layers}x{args.embd} ({n_params / 1e6:.2f} M params, untied head), global "
          f"batch {args.batch}, pp=2, {args.microbatches} microbatches, gloo, 1 thread per "
          f"rank, AdamW, {args.steps} timed steps")
    print(f"{'schedule':9s} {'cut':>4s} {'fxpar ms':>9s} {'torch ms':>9s} {'ratio':>6s}   "
          f"{'fxpar peak MiB r0/r1':>20s} {'torch peak MiB r0/r1':>20s}  max|loss diff|")
    for sched in args.schedules:
        (fx_t, fx_l, _), (th_t, th_l, _), k, _, _ = res[0][sched]
        peaks = [(res[r][sched][0][2] / 2**20, res[r][sched][1][2] / 2**20) for r in (0, 1)]
        diff = max(abs(a - b) for a, b in zip(fx_l, th_l))
        print(f"{sched:9s} {k:>4d} {fx_t * 1e3:9.1f} {th_t * 1e3:9.1f} {fx_t / th_t:6.3f}   "
              f"{peaks[0][0]:9.1f}/{peaks[1][0]:<10.1f} {peaks[0][1]:9.1f}/{peaks[1][1]:<10.1f}"
              f"  {diff:.1e}")
    print("code generation (time only):")
    print(f"{'schedule':9s} {'fxpar inductor ms':>18s} {'torch + compile ms':>19s} "
          f"{'x torch':>8s} {'x torch+compile':>16s}  max|loss diff| vs torch")
    for sched in args.schedules:
        _, (th_t, th_l, _), _, (fi_t, fi_l, _), tc = res[0][sched]
        diff = max(abs(a - b) for a, b in zip(fi_l, th_l))
        if isinstance(tc, str):
            print(f"{sched:9s} {fi_t * 1e3:18.1f} {'failed':>19s} {fi_t / th_t:8.3f} "
                  f"{'-':>16s}  {diff:.1e}   (torch + compile: {tc})")
        else:
            print(f"{sched:9s} {fi_t * 1e3:18.1f} {tc[0] * 1e3:19.1f} {fi_t / th_t:8.3f} "
                  f"{fi_t / tc[0]:16.3f}  {diff:.1e}")
    print("(variants run one after the other, not interleaved: ratios carry the drift)")


if __name__ == "__main__":
    main()
