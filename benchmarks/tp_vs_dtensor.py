"""fxpar tp=2 vs DTensor `parallelize_module` with the hand plan, same model, one run.

Model: HF Llama (GQA) from a small config. DTensor gets the plan a torchtitan user writes by
hand: q/k/v/gate/up ColwiseParallel, o/down RowwiseParallel, per decoder layer; fxpar finds
its plan on the graph (it picks the same weights). Both train with AdamW on the same batches
on the same spawned gloo ranks, one after the other. Prints the median step time of each,
the ratio fxpar / DTensor, the bytes each rank sends per step on a ring for the collectives
it issues (a dispatch mode sees both sides' collective ops), and the largest loss
difference; fxpar with
sequence parallelism as a third row. Code generation: fxpar with Plan.codegen "eager" (op by
op) and "inductor", DTensor eager and under torch.compile (the model compiled after
parallelize_module).

    .venv/bin/python benchmarks/tp_vs_dtensor.py [--steps 20] [--hidden 256] [--layers 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import fxpar
from fxpar.examples import models as M

COLLECTIVES = ("_c10d_functional.all_reduce", "_c10d_functional.all_gather_into_tensor",
               "_c10d_functional.reduce_scatter_tensor", "c10d.allreduce_",
               "c10d._allgather_base_", "c10d._reduce_scatter_base_", "c10d.allgather_",
               "c10d.reduce_scatter_")


class CommBytes(TorchDispatchMode):
    """Bytes each rank sends on a ring for the collective ops it issues (all-reduce of S:
    2(n-1)/n S; all-gather of a shard s: (n-1) s; reduce-scatter of S: (n-1)/n S), and the
    number of calls."""

    def __init__(self, n):
        super().__init__()
        self.n, self.bytes, self.calls = n, 0.0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if any(name.startswith(c) for c in COLLECTIVES):
            # the tensor handed in: functional ops take it first; c10d's in-place ops take
            # (outputs, inputs) for gathers/scatters and the tensors themselves for all-reduce
            src = args[1] if ("allgather" in name or "reduce_scatter_" in name) and \
                name.startswith("c10d.") else args[0]
            ts = src if isinstance(src, (list, tuple)) else [src]
            ts = [t for x in ts for t in (x if isinstance(x, (list, tuple)) else [x])]
            size = sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))
            n = self.n
            factor = 2 * (n - 1) / n if "all_reduce" in name or "allreduce" in name else \
                (n - 1) if "gather" in name else (n - 1) / n
            self.bytes += factor * size
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _model(args):
    torch.manual_seed(0)
    return M.hf_llama(vocab=512, hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                      max_pos=args.seq)


def hand_plan():
    """The per-decoder-layer plan a torchtitan user writes for HF Llama."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}


def _run(step, args):
    times, losses = [], []
    for s in range(args.warmup + args.steps):
        dist.barrier()
        t = time.perf_counter()
        losses.append(step(s))
        if s >= args.warmup:
            times.append(time.perf_counter() - t)
    with CommBytes(int(os.environ["WORLD_SIZE"])) as cb:
        step(0)
    return statistics.median(times), losses, cb.bytes, cb.calls


def bench(args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    torch.set_num_threads(1)
    data = [M.hf_lm_batch(512, args.batch, args.seq, seed=s) for s in range(4)]
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731

    def fxpar_run(**plan):
        pm = fxpar.parallelize(_model(args), 2, example_batch=data[0], optimizer=opt,
                               plan={"tp": 2, **plan})
        found = pm.stage_graphs["tensor_parallel"]["dp"].meta["tensor_parallel"]
        return _run(lambda s: pm.step(data[s % 4]).item(), args), found

    fx, found = fxpar_run(codegen="eager")
    fx_sp, _ = fxpar_run(codegen="eager", sequence_parallel=True)
    fx_ind, _ = fxpar_run(codegen="inductor")
    mesh = init_device_mesh("cpu", (2,))

    def dtensor(compiled):
        model = _model(args)
        plan = hand_plan()
        for layer in model.model.layers:
            parallelize_module(layer, mesh, plan)
        o = opt(model.parameters())
        fwd = torch.compile(model) if compiled else model

        def dtensor_step(s):
            o.zero_grad(set_to_none=True)
            loss = fwd(**data[s % 4]).loss
            loss.backward()
            o.step()
            return loss.item()
        return _run(dtensor_step, args)
    dt = dtensor(False)
    try:
        dt_c = dtensor(True)
    except Exception as e:  # noqa: BLE001 - a peer that cannot compile here is a row
        dt_c = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    return fx, fx_sp, fx_ind, dt, dt_c, (len(found.column), len(found.row))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    res = fxpar.launch(bench, 2, args)
    (fx_t, fx_l, fx_b, fx_c), sp, ind, (dt_t, dt_l, dt_b, dt_c), dtc, (n_col, n_row) = res[0]
    n_params = sum(p.numel() for p in _model(args).parameters())
    print(f"HF Llama {args.layers} layers x {args.hidden} (8 heads, 4 kv heads, "
          f"{n_params / 1e6:.2f} M params), batch {args.batch} x {args.seq}, tp=2, gloo, "
          f"1 thread per rank, AdamW, {args.steps} timed steps")
    print(f"fxpar found {n_col} column + {n_row} row weights "
          f"(hand plan: {5 * args.layers} + {2 * args.layers})")
    print(f"{'':18s} {'median step ms':>15s} {'collective calls':>17s} {'MiB sent/step':>14s}")
    print(f"{'fxpar':18s} {fx_t * 1e3:15.1f} {fx_c:17d} {fx_b / 2**20:14.2f}   (codegen=eager)")
    print(f"{'fxpar SP':18s} {sp[0] * 1e3:15.1f} {sp[3]:17d} {sp[2] / 2**20:14.2f}   "
          "(sequence_parallel=True, codegen=eager)")
    print(f"{'fxpar inductor':18s} {ind[0] * 1e3:15.1f} {ind[3]:17d} {ind[2] / 2**20:14.2f}   "
          "(codegen=inductor)")
    print(f"{'DTensor':18s} {dt_t * 1e3:15.1f} {dt_c:17d} {dt_b / 2**20:14.2f}")
    if isinstance(dtc, str):
        print(f"{'DTensor + compile':18s} failed: {dtc}")
    else:
        print(f"{'DTensor + compile':18s} {dtc[0] * 1e3:15.1f} {dtc[3]:17d} "
              f"{dtc[2] / 2**20:14.2f}")
    print(f"ratio fxpar/DTensor: time {fx_t / dt_t:.3f}, bytes {fx_b / max(dt_b, 1):.3f}   "
          f"(max |loss diff| = {max(abs(a - b) for a, b in zip(fx_l, dt_l)):.2e})")
    print(f"ratio fxpar inductor/DTensor: time {ind[0] / dt_t:.3f}"
          + ("" if isinstance(dtc, str) else
             f"; fxpar inductor/DTensor + compile: time {ind[0] / dtc[0]:.3f}")
          + f"   (max |loss diff| = {max(abs(a - b) for a, b in zip(ind[1], dt_l)):.2e})")
    print("(rows run one after the other, not interleaved: ratios carry this machine's drift)")


if __name__ == "__main__":
    main()
