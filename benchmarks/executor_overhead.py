"""The executor's own cost per graph node against eager PyTorch's, on a model too small to
compute anything (so host dispatch is all there is), in one run.

Rows: eager forward+backward (autograd dispatches the backward from C++) against the fxpar
graph alone (its generated Python calling one ATen op per node); a whole eager step against
fxpar's (batch slicing, recorder, loss check, the optimizer: SGD at lr 0) and on CUDA the
fxpar step replayed as a CUDA graph. All per node of the joint graph, timed interleaved (median of rounds).

    .venv/bin/python benchmarks/executor_overhead.py [--layers 4] [--rounds 9]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import fxpar
from fxpar.examples import models as M
from fxpar.runtime import executor


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)
    cfg = M.GPTConfig(vocab_size=64, block_size=8, n_layer=args.layers, n_head=2, n_embd=16)
    batch = [t.to(device) for t in M.gpt_batch(cfg, 2)]
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.0)  # noqa: E731 - the optimizer's share is tiny

    torch.manual_seed(0)
    model = M.GPT(cfg).to(device)
    pms = {}
    for graphs in ((False, True) if device.type == "cuda" else (False,)):
        torch.manual_seed(0)
        pms[graphs] = fxpar.parallelize(M.GPT(cfg).to(device), [str(device)],
                                        example_batch=batch, optimizer=sgd,
                                        plan=dict(fuse=False, cuda_graphs=graphs))
    pm = pms[False]
    gm = pm.program.graph
    nodes = sum(n.op == "call_function" for n in gm.graph.nodes)
    args_ = [*pm.params, *pm.buffers, *batch]

    opt = sgd(model.parameters())

    def eager():
        model(batch).backward()
        model.zero_grad(set_to_none=True)

    def eager_step():
        opt.zero_grad(set_to_none=True)
        loss = model(batch)
        loss.backward()
        opt.step()
        return loss.detach()

    fns = {"eager forward+backward": eager,
           "fxpar graph alone": lambda: executor.run_graph(gm, args_, (), ()),
           "eager step (+ SGD)": eager_step,
           "fxpar step (+ SGD)": lambda: pm.step(batch)}
    if True in pms:
        fns["fxpar step, CUDA graph replay"] = lambda: pms[True].step(batch)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for f in fns.values():
        for _ in range(5):
            f()
    times = {k: [] for k in fns}
    for r in range(args.rounds):
        for k, f in fns.items():
            sync()
            t = time.perf_counter()
            for _ in range(args.reps):
                f()
            sync()
            times[k].append((time.perf_counter() - t) / args.reps)
    print(f"GPT {args.layers} layers x 16 wide on {device}: {nodes} call nodes in the joint "
          f"graph (compute negligible)")
    ref = statistics.median(times["eager forward+backward"])
    out = {}
    for k, ts in times.items():
        med = statistics.median(ts)
        out[k] = med / nodes
        print(f"{k:32s} {med * 1e3:8.3f} ms  {med / nodes * 1e6:6.2f} us/node  "
              f"{med / ref:5.2f}x eager")
    return out


if __name__ == "__main__":
    main()
