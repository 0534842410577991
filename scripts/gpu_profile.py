"""Where one fxpar training step spends its time on a GPU: step time with fusion on / off
and eager's, then the top kernels by GPU time and the top ops by CPU time (torch.profiler).

    python scripts/gpu_profile.py [--precision bf16] [--layers 12]
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fxpar
from fxpar.examples import models as M


def _time(fn, steps=5):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rows", type=int, default=8)
    args = ap.parse_args()
    cfg = M.GPTConfig(vocab_size=50304, block_size=1024, n_layer=args.layers, n_head=12,
                      n_embd=768)
    data = [t.cuda() for t in M.gpt_batch(cfg, args.rows)]
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)  # noqa: E731
    pms = {}
    for fuse in (True, False):
        torch.manual_seed(0)
        pm = fxpar.parallelize(M.GPT(cfg).cuda(), ["cuda:0"], example_batch=data, optimizer=opt,
                               plan=fxpar.Plan(precision=args.precision, fuse=fuse))
        pms[fuse] = pm
        t = _time(lambda: pm.step(data))
        n = sum(len(g.graph.nodes) for g in pm.stage_graphs[list(pm.stage_graphs)[-1]].values())
        print(f"fxpar {args.precision} fuse={fuse}: {t * 1e3:.1f} ms/step, {n} graph nodes")
    torch.manual_seed(0)
    model = M.GPT(cfg).cuda()
    o = opt(model.parameters())
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)

    def eager():
        o.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dt, enabled=dt is not None):
            loss = model(data)
        loss.backward()
        o.step()
    print(f"eager {args.precision}: {_time(eager) * 1e3:.1f} ms/step")
    for name, fn in (("fxpar fused", lambda: pms[True].step(data)), ("eager", eager)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        print(f"\n--- {name}: top GPU kernels")
        print(ka.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
        print(f"--- {name}: top CPU")
        print(ka.table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    main()
