"""The demo: train the small GPT on 2 CPU ranks for 20 steps with fxpar.

Plans dp x tp with the planner (remat, pp and schedule given) and prints its ranked table
and why it chose; prints the plan, the compile time per pass, the loss per step and how much
communication the overlap pass hid; writes the graph SVGs of every pass, the memory timeline
before/after rematerialization (PNG), the timeline of the last steps of every rank (Chrome
trace JSON for Perfetto, and a PNG), and report.html (all of it on one page, with the cost
model's predicted step time and memory next to the measured ones) under --out. Run:
`make demo` or `python -m fxpar demo --out out`.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

import fxpar
from fxpar.examples import models as M
from fxpar.runtime.memtrack import measure
from fxpar.viz.report import untracked, write_report


def train(out_dir: str, steps: int, global_batch: int, remat="sqrt", pp: int = 1,
          schedule: str = "1f1b"):
    rank = int(os.environ.get("RANK", 0))
    # 1.9M parameters: big enough that data_parallel's alpha-beta sizing splits the gradients
    # into two buckets (so the overlap pass has a reduction to move), small enough to train
    # in seconds on 2 CPU cores
    cfg = M.GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=192)
    torch.manual_seed(0)
    model = M.GPT(cfg)
    data = [M.gpt_batch(cfg, global_batch, seed=s % 4) for s in range(steps)]
    t0 = time.perf_counter()
    pm = fxpar.parallelize(model, int(os.environ.get("WORLD_SIZE", 1)), example_batch=data[0],
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                           # the planner picks dp x tp for the pp given (and re-fits its
                           # cost model to the measured steps after 8 of them)
                           plan={"dp": "auto", "tp": "auto", "remat": remat, "pp": pp,
                                 "schedule": schedule, "microbatches": 4 if pp > 1 else 1})
    if rank == 0:  # (fxpar's log above named the chosen plan and the runner-up)
        print(pm.plan_report.format(4))
        print(f"plan: {pm.plan}")
        width = max(len(name) for name, _, _ in pm.compile_times)
        print(f"compiled in {time.perf_counter() - t0:.2f} s, every phase:")
        for name, dt, nodes in pm.compile_times:
            print(f"  {name:<{width}} {dt * 1e3:8.1f} ms" + (f"   {nodes} nodes" if nodes else ""))
    losses = []
    for s, batch in enumerate(data):
        t = time.perf_counter()
        loss = pm.step(batch).item()
        losses.append(loss)
        if rank == 0:
            print(f"step {s:2d}  loss {loss:.4f}  ({(time.perf_counter() - t) * 1e3:.0f} ms)")
    os.makedirs(out_dir, exist_ok=True)
    trace = pm.trace(os.path.join(out_dir, "trace.json"))  # every rank takes part
    if rank == 0:
        from fxpar.viz.graph import summary, write_snapshots
        from fxpar.viz.timeline import plot_timeline
        paths = write_snapshots(pm.stage_graphs, out_dir)
        final = pm.stage_graphs["data_parallel"]["dp"]
        print(f"graph after data_parallel: {summary(final)}")
        if "pipeline_split" in pm.stage_graphs:
            sp = pm.stage_graphs["pipeline_split"]["dp"].meta["pipeline"]
            print(f"pipeline: {sp.n_stages} stages cut after {sp.cuts}, slowest/mean stage "
                  f"{sp.imbalance:.3f}, {len(sp.transfers)} transfers, schedule "
                  f"{pm.plan.schedule} with {pm.plan.microbatches} microbatches")
        if "overlap" in pm.stage_graphs:
            d = pm.stage_graphs["overlap"]["dp"].meta.get("overlap")
            if d is not None:
                print("overlap: " + d.describe())
        if "fusion" in pm.stage_graphs:
            print("fusion: " + pm.stage_graphs["fusion"]["dp"].meta["fusion"].describe())
        elif pm.plan.fuse:
            print(f"fusion: off ({pm.fusion_skipped})")
        print(f"codegen: {pm.codegen_summary}")
        st = pm.step_stats[-5:]
        print("last steps: collectives in flight {:.1f} ms; compute thread blocked on them "
              "(issuing + waiting: the exposed communication) {:.1f} ms; step {:.1f} ms"
              .format(*(1e3 * sum(getattr(x, k) for x in st) / len(st)
                        for k in ("comm_s", "exposed_comm_s", "time_s"))))
        if "remat" in pm.stage_graphs:
            paths.append(write_remat_memory(pm, os.path.join(out_dir, "memory_remat.png")))
        paths += [trace, plot_timeline(trace, os.path.join(out_dir, "timeline.png"))]
    # one more step under the memory tracker (every rank takes part), for the report
    step_s = statistics.median(s.time_s for s in pm.step_stats[-5:])
    # (not under Inductor on CPU: its code allocates below the dispatcher, where the tracker
    # cannot see; the report says so)
    peak = None if untracked(pm) else measure(lambda: pm.step(data[0]))[1]
    if rank == 0:
        svgs = [p for p in paths if p.endswith(".svg")]
        report = write_report(pm, out_dir, svgs=svgs,
                              images=[p for p in paths if p.endswith(".png")],
                              measured_step_s=step_s, measured_memory=peak)
        print("wrote " + ", ".join(paths + [report]))
    return losses


def write_remat_memory(pm, path: str) -> str:
    """What remat decided, and the memory timeline before/after it (PNG)."""
    from fxpar.viz.memory_plot import plot_remat
    d = pm.stage_graphs["remat"]["dp"].meta["remat"]
    print(f"remat {d.mode}: {len(d.checkpoints)} checkpoints, {len(d.recomputed)} nodes "
          f"recomputed ({d.recompute_flops / 1e6:.1f} MFLOP), activation peak per rank "
          f"{d.peak_before / 2**20:.2f} -> {d.peak_after / 2**20:.2f} MiB (memory_remat.png "
          "plots the whole joint graph's activations + gradients at the global batch)")
    return plot_remat(pm.stage_graphs, path)


def main(out_dir: str = "out", nprocs: int = 2, steps: int = 20, global_batch: int = 8,
         remat="sqrt", pp: int = 1, schedule: str = "1f1b"):
    res = fxpar.launch(train, nprocs, os.path.abspath(out_dir), steps, global_batch, remat, pp,
                       schedule)
    first, last = res[0][0], res[0][-1]
    assert all(r == res[0] for r in res.values()), "ranks disagree on the loss"
    print(f"loss {first:.4f} -> {last:.4f} over {steps} steps on {nprocs} ranks "
          f"(identical on every rank)")
    return res[0]


if __name__ == "__main__":
    main()
