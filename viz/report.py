"""One HTML page that shows what fxpar did: the plan, each pass's decision and graph, the
timeline of the last steps, the memory plots, and the cost model's prediction of step time
and memory next to what was measured.

The page links the SVG/PNG files written beside it (open `report.html` in a browser from the
same folder). Predictions come from compiler/cost.py (roofline time per node and alpha-beta
collectives against DeviceProfile; the liveness simulator for memory) on this rank's graph.
"""
from __future__ import annotations

import dataclasses
import html
import os
import statistics

import torch

from fxpar.compiler import cost, ir
from fxpar.viz.graph import is_collective, summary

MiB = 2 ** 20


@dataclasses.dataclass
class Prediction:
    step_s: float           # roofline compute + alpha-beta collectives, in graph order
    compute_s: float
    comm_s: float
    memory_bytes: int       # peak of gradients + activations the step allocates (simulated)


def predict(gm: torch.fx.GraphModule, device, group_size: int) -> Prediction:
    """The cost model's view of one step of this rank's (unsplit) graph."""
    profile = cost.DeviceProfile.for_device(device)
    compute = comm = 0.0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in cost.COLLECTIVES:
            comm += cost.comm_time(n.target, cost.tensor_bytes(n.args[0].meta.get(ir.VAL)),
                                   group_size, profile)
        elif not is_collective(n):
            compute += cost.node_time(n, profile)
    tl = cost.simulate_liveness(gm, count_inputs=False)
    grads, acts = tl.live.get("grads", []), tl.live.get("activations", [])
    memory = max((g + a for g, a in zip(grads, acts)), default=0)
    return Prediction(compute + comm, compute, comm, memory)


def _planner_candidate(pm):
    result = getattr(pm, "plan_report", None)
    if result is None:
        return None
    from fxpar.compiler.planner import plan_dict
    ran = plan_dict(pm.plan)
    return next((c for c in result.table if plan_dict(c.plan) == ran), None)


def _planner_rows(pm, measured_s, measured_memory) -> list:
    """The planner's calibrated prediction for the plan that runs, if the planner chose it."""
    from fxpar.compiler.planner import plan_dict
    c = _planner_candidate(pm)
    if c is None:
        return []
    parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in c.parts.items())
    err = f" ({(c.step_s / measured_s - 1) * 100:+.0f}%)" if measured_s else ""
    mem_err = (f" ({(c.memory.step_allocated / measured_memory - 1) * 100:+.0f}%)"
               if measured_memory else "")
    rows = [("step time (planner, calibrated)", f"{c.step_s * 1e3:.2f} ms{err}: {parts}",
             f"{measured_s * 1e3:.2f} ms" if measured_s else "-")]
    result = pm.plan_report
    first = result.start_up and next((s for s in result.start_up.table
                                      if plan_dict(s.plan) == plan_dict(c.plan)), None)
    if first is not None:  # the planner was re-fitted (compiler/api._refit_planner): both
        rows[0] = (f"step time (planner, {result.refit})", *rows[0][1:])
        err0 = f" ({(first.step_s / measured_s - 1) * 100:+.0f}%)" if measured_s else ""
        rows.append(("step time (planner, start-up calibration)",
                     f"{first.step_s * 1e3:.2f} ms{err0}", rows[0][2]))
    return rows + [
            ("memory a step allocates (planner: gradients + activations + buffers, fullest "
             "stage)", f"{c.memory.step_allocated / MiB:.2f} MiB{mem_err}",
             f"{measured_memory / MiB:.2f} MiB" if measured_memory else "-")]


def _explain_block(pm) -> str:
    result = getattr(pm, "plan_report", None)
    if result is None:
        return ""
    return (f"<h3>Why this plan (planner)</h3><pre>{html.escape(result.explain())}</pre>"
            f"<pre>{html.escape(result.format(8))}</pre>")


def _decision_line(name: str, gm) -> str:
    m = gm.meta
    if name == "remat" and "remat" in m:
        d = m["remat"]
        return (f"{d.mode}: {len(d.checkpoints)} checkpoints, {len(d.recomputed)} nodes "
                f"recomputed ({d.recompute_flops / 1e6:.1f} MFLOP); activation peak "
                f"{d.peak_before / MiB:.2f} -> {d.peak_after / MiB:.2f} MiB")
    if name == "pipeline_split" and "pipeline" in m:
        d = m["pipeline"]
        return (f"{d.n_stages} stages cut after {d.cuts}; slowest/mean stage "
                f"{d.imbalance:.3f}; {len(d.transfers)} transfers")
    if name == "stages":
        calls = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        ins = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
        return f"one part of the step's schedule: {calls} ops, {ins} inputs"
    if name == "tensor_parallel" and "tensor_parallel" in m:
        d = m["tensor_parallel"]
        return (f"tp={d.tp}: {len(d.column)} column-split and {len(d.row)} row-split weights, "
                f"{len(d.replicated)} replicated")
    if name == "overlap" and "overlap" in m:
        d = m["overlap"]
        return (f"{len(d.hoisted)} collectives started earlier, {len(d.sunk)} waits moved "
                f"later (memory limit {d.slack / 1024:.0f} KiB)")
    if name == "precision" and "precision" in m:
        d = m["precision"]
        return (f"{str(d.dtype).replace('torch.', '')}: {len(d.half_nodes)} ops in half, "
                f"{len(d.fp32_nodes)} kept in fp32, {len(d.param_casts)} weights cast once, "
                f"{d.casts} casts" + (", loss scale input" if d.loss_scale else ""))
    if name == "fusion" and "fusion" in m:
        d = m["fusion"]
        hand = sum(g.kind != "generated" for g in d.groups)
        return (f"{len(d.groups)} Triton kernels ({hand} hand-written); bytes moved "
                f"{d.bytes_unfused / MiB:.2f} -> {d.bytes_fused / MiB:.2f} MiB")
    s = summary(gm)
    return ", ".join(f"{v} {k}" for k, v in s.items())


def write_report(pm, out_dir: str, *, svgs: list[str], images: list[str],
                 measured_step_s: float | None = None, measured_memory: int | None = None
                 ) -> str:
    """Write out_dir/report.html (call on one rank, after training steps ran). Measured step
    time: the median of the last recorded steps unless given."""
    plan = pm.plan
    rows = "".join(f"<tr><td>{f.name}</td><td>{html.escape(repr(getattr(plan, f.name)))}</td>"
                   "</tr>" for f in dataclasses.fields(plan))
    timings = "".join(f"<tr><td>{n}</td><td>{dt * 1e3:.1f} ms</td><td>{nodes or ''}</td></tr>"
                      for n, dt, nodes in pm.compile_times)
    passes = []
    for i, (name, roles) in enumerate(pm.stage_graphs.items()):
        for role, gm in roles.items():
            svg = next((p for p in svgs if os.path.basename(p).startswith(f"{i:02d}_{name}_")),
                       None)
            pic = (f'<a href="{os.path.basename(svg)}"><img src="{os.path.basename(svg)}" '
                   'class="graph"></a>' if svg else "")
            passes.append(f"<h3>{i}. {name} ({role})</h3><p>"
                          f"{html.escape(_decision_line(name, gm))}</p>{pic}")
    skipped = getattr(pm, "fusion_skipped", None)
    if plan.fuse and skipped:
        passes.append(f"<h3>fusion</h3><p>left out: {html.escape(skipped)}</p>")

    final = [roles for name, roles in pm.stage_graphs.items() if name != "stages"][-1]
    gm = next(iter(final.values()))  # the whole graph after the last pass (not a part)
    pred = predict(gm, pm.world.device, max(plan.dp, 1))
    stats = pm.step_stats
    measured_s = measured_step_s or (statistics.median(s.time_s for s in stats[-5:])
                                     if stats else None)
    pp_note = (" (pipeline plans: the prediction is the unsplit graph's, one microbatch "
               "schedule not simulated yet)" if plan.pp > 1 or plan.microbatches > 1 else "")
    cmp_rows = [("step time", f"{pred.step_s * 1e3:.2f} ms (compute {pred.compute_s * 1e3:.2f}"
                 f" + communication {pred.comm_s * 1e3:.2f})",
                 f"{measured_s * 1e3:.2f} ms (median of the last steps)" if measured_s else "-")]
    cmp_rows.append(("memory the step allocates (gradients + activations)",
                     f"{pred.memory_bytes / MiB:.2f} MiB",
                     f"{measured_memory / MiB:.2f} MiB" if measured_memory else "-"))
    calibrated = _planner_rows(pm, measured_s, measured_memory)
    if calibrated:
        cmp_rows = calibrated + [(f"{a} (uncalibrated roofline, this rank's graph)", b, c)
                                 for a, b, c in cmp_rows]
    cmp = "".join(f"<tr><td>{a}</td><td>{b}</td><td>{c}</td></tr>" for a, b, c in cmp_rows)
    imgs = "".join(f'<h3>{html.escape(os.path.basename(p))}</h3><img src="{os.path.basename(p)}"'
                   ' class="plot">' for p in images)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>fxpar report</title>
<style>body{{font-family:Helvetica,Arial,sans-serif;margin:2em;max-width:1200px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}
img.graph{{max-width:100%;max-height:500px;border:1px solid #ddd}}img.plot{{max-width:100%}}
</style></head><body>
<h1>fxpar report</h1>
<p>{html.escape(type(pm.model).__name__)} on {pm.world.size} rank(s), device
{html.escape(str(pm.world.device))}.</p>
<h2>Plan</h2><table>{rows}</table>
<h2>Compile</h2><table><tr><th>step</th><th>time</th><th>nodes</th></tr>{timings}</table>
<h2>Passes</h2>{''.join(passes)}
<h2>Predicted vs measured (rank 0)</h2>
<p>Prediction: the cost model on the final graph (roofline per node against the
{html.escape(cost.DeviceProfile.for_device(pm.world.device).name)} profile, alpha-beta
collectives; liveness simulation for memory){html.escape(pp_note)}. When the planner chose the
plan, its calibrated prediction comes first: measured hardware, schedule simulation, memory
estimator (compiler/planner.py).</p>{_explain_block(pm)}
<table><tr><th></th><th>predicted</th><th>measured</th></tr>{cmp}</table>
<h2>Timeline and memory</h2>{imgs}
</body></html>"""
    path = os.path.join(out_dir, "report.html")
    with open(path, "w") as f:
        f.write(page)
    return path
