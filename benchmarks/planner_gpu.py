"""The planner on one NVIDIA GPU: predicted vs measured step time and memory, and fxpar's step
against eager PyTorch and torch.compile of the same model, in one run.

For a GPT-2-small-sized model (12 x 768, T=1024) on one GPU the planner's table holds the
single-device plans (remat choice x microbatches); each is compiled and timed (CUDA-synchronised
mean of --steps after 3 warm-ups) and its allocator peak read. Prints per plan the predicted
and measured step time and step memory with their ratio, the median / worst error, and
the chosen plan's step against eager and torch.compile (ratios, same run).

Run where a GPU is lent: python benchmarks/planner_gpu.py [--precision fp32 bf16] [--limit 6]
[--no-fuse] [--tf32] [--profile]   (--profile: where the chosen plan's and eager's step time
goes, top kernels by GPU time and top ops by host time)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import fxpar
from fxpar.compiler import planner
from fxpar.compiler.compile import planner_stats
from fxpar.examples import models as M
from fxpar.runtime.memtrack import measure

MiB = 2 ** 20


def _time(fn, steps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def _opt(ps):
    return torch.optim.AdamW(ps, lr=1e-4, fused=True)


def _profile(name, fn):
    """Top kernels by GPU time and top ops by host time of one call of fn."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(f"\n--- {name}: top GPU kernels")
    print(ka.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    print(f"--- {name}: top host time")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60))


def run(cfg, rows, precision, steps, limit, fuse=True, profile=False):
    data = [t.cuda() for t in M.gpt_batch(cfg, rows)]
    torch.manual_seed(0)
    constraints = {"precision": precision, "fuse": fuse}
    stats = planner_stats(M.GPT(cfg), M.gpt_batch(cfg, rows), None, "cuda", constraints)
    result = planner.auto_plan(stats, _opt, 1, "cuda", constraints=constraints)
    print(f"\n== {precision}, fuse={fuse}, matmul precision "
          f"{torch.get_float32_matmul_precision()!r}: {len(result.table)} plans, hardware "
          f"{result.hardware}")
    errs, mem_errs, chosen = [], [], None
    for c in result.table[:limit]:
        torch.manual_seed(0)
        pm = fxpar.parallelize(M.GPT(cfg).cuda(), 1, example_batch=data, optimizer=_opt,
                               plan=c.plan)
        pm.step(data)  # the optimizer's state is made; the next step is still eager (a
        _, peak = measure(lambda: pm.step(data))  # replayed CUDA graph allocates nothing)
        t = _time(lambda: pm.step(data), steps)
        est = c.memory.per_stage[0].step_allocated
        errs.append(abs(c.step_s - t) / t)
        mem_errs.append(abs(est - peak) / peak)
        chosen = chosen or (pm, t)
        print(f"  {c.row()}\n      step predicted {c.step_s * 1e3:8.2f} ms  measured "
              f"{t * 1e3:8.2f} ms  ({c.step_s / t:4.2f}x)   step memory predicted "
              f"{est / MiB:8.0f} MiB  measured {peak / MiB:8.0f} MiB ({est / peak:4.2f}x)")
        if pm is not chosen[0]:
            del pm
        torch.cuda.empty_cache()
    print(f"  step time error median {statistics.median(errs):.1%} worst {max(errs):.1%};  "
          f"step memory error median {statistics.median(mem_errs):.1%} worst "
          f"{max(mem_errs):.1%}")
    # the peers: eager and torch.compile of the same model, same optimizer, same precision
    torch.manual_seed(0)
    model = M.GPT(cfg).cuda()
    opt = _opt(model.parameters())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def step(m):
        def go():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                loss = m(data)
            loss.backward()
            opt.step()
        return go
    times = {"fxpar (planner's choice)": chosen[1], "eager": _time(step(model), steps),
             "torch.compile": _time(step(torch.compile(model)), steps)}
    for k, t in times.items():
        print(f"  {k:<26}{t * 1e3:9.2f} ms   {t / chosen[1]:5.2f}x fxpar's")
    if profile:  # where the time goes: fxpar's chosen plan, then eager
        _profile(f"fxpar {precision} fuse={fuse}", lambda: chosen[0].step(data))
        _profile(f"eager {precision}", step(model))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tf32", action="store_true", help="allow TF32 for fp32 matmuls")
    ap.add_argument("--no-fuse", action="store_true", help="plans with Plan(fuse=False)")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler tables of the chosen plan's step and eager's")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/planner_gpu.py needs an NVIDIA GPU (torch.cuda is not "
                         "available here); on CPU ranks use benchmarks/planner_accuracy.py")
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    cfg = M.GPTConfig(vocab_size=50304, block_size=1024, n_layer=args.layers, n_head=12,
                      n_embd=768)
    for p in args.precision:
        run(cfg, 8, p, args.steps, args.limit, fuse=not args.no_fuse, profile=args.profile)


if __name__ == "__main__":
    main()
