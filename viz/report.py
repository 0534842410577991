"""One HTML page that shows what fxpar did: the plan, each pass's decision and graph, the
timeline of the last steps, the memory plots, and the cost model's prediction of step time
and memory next to what was measured.

The page shows the layer-view SVGs written beside it inline (pan with the mouse, zoom with
the wheel, double-click to reset; click a box for its node-level drawing) and links the PNGs
(open `report.html` in a browser from the same folder). Each pass says what it changed and,
where it changed nothing, why; passes the plan does not need are listed with the reason.
Predictions come from core/cost.py (roofline time per node and alpha-beta collectives
against DeviceProfile; the liveness simulator for memory) on this rank's graph. A small
script checks the page as it loads (every image decoded, no script error) and writes the
result into `#selfcheck`, which tests/test_report_browser.py reads from headless Chromium.
"""
from __future__ import annotations

import collections
import dataclasses
import html
import os
import re
import statistics

import torch

from fxpar.core import cost, experts, ir
from fxpar.core.plan import plan_dict
from fxpar.viz.graph import is_collective, summary

MiB = 2 ** 20


@dataclasses.dataclass
class Prediction:
    step_s: float           # roofline compute + alpha-beta collectives, in graph order
    compute_s: float
    comm_s: float
    memory_bytes: int       # peak of gradients + activations the step allocates (simulated)


def predict(gm: torch.fx.GraphModule, device, group_size: int,
            group_sizes: dict[str, int] | None = None) -> Prediction:
    """The cost model's view of one step of this rank's (unsplit) graph. A collective over a
    group named in `group_sizes` (HSDP's shard and replica groups) is priced at its size,
    the others at `group_size`."""
    profile = cost.DeviceProfile.for_device(device)
    compute = comm = 0.0
    sizes = group_sizes or {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in cost.COLLECTIVES:
            size = next((sizes[a] for a in n.args if isinstance(a, str) and a in sizes),
                        group_size)
            nbytes = cost.tensor_bytes(n.args[0].meta.get(ir.VAL))
            if n.target in experts.ASYNC:  # (the rank's own rows: the smaller side; the
                # other's graph value bounds what it may receive)
                nbytes = min(nbytes, cost.tensor_bytes(n.meta.get(ir.VAL)))
            comm += cost.comm_time(n.target, nbytes, size, profile)
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
    ran = plan_dict(pm.plan)
    return next((c for c in result.table if plan_dict(c.plan) == ran), None)


def _planner_rows(pm, measured_s, measured_memory, measured_txt="") -> list:
    """The planner's calibrated prediction for the plan that runs, if the planner chose it."""
    c = _planner_candidate(pm)
    if c is None:
        return []
    parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in c.parts.items())
    err = f" ({(c.step_s / measured_s - 1) * 100:+.0f}%)" if measured_s else ""
    mem_err = (f" ({(c.memory.step_allocated / measured_memory - 1) * 100:+.0f}%)"
               if measured_memory else "")
    rows = [("step time (planner, calibrated)", f"{c.step_s * 1e3:.2f} ms{err}: {parts}",
             f"{measured_s * 1e3:.2f} ms{measured_txt}" if measured_s else "-")]
    result = pm.plan_report
    first = result.start_up and next((s for s in result.start_up.table
                                      if plan_dict(s.plan) == plan_dict(c.plan)), None)
    if first is not None:  # the planner was re-fitted (api/parallelize._refit_planner): both
        rows[0] = (f"step time (planner, {result.refit})", *rows[0][1:])
        err0 = f" ({(first.step_s / measured_s - 1) * 100:+.0f}%)" if measured_s else ""
        rows.append(("step time (planner, start-up calibration)",
                     f"{first.step_s * 1e3:.2f} ms{err0}", rows[0][2]))
    m = c.memory
    parts = (f"gradients {m.grads / MiB:.2f} + activations {m.activations / MiB:.2f} + "
             f"reduction buffers {m.buffers / MiB:.2f}" if m.accumulate else
             f"the larger of activations {m.activations / MiB:.2f} and gradients "
             f"{m.grads / MiB:.2f} + reduction buffers {m.buffers / MiB:.2f} + working "
             f"{m.working / MiB:.2f}")
    return rows + [
            ("memory a step allocates (planner's estimate, fullest stage)",
             f"{m.step_allocated / MiB:.2f} MiB{mem_err}: {parts}",
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
        if not d.recomputed:
            return (f"{d.mode}: nothing recomputed: the activation peak "
                    f"({d.peak_before / MiB:.2f} MiB per rank) is within what {d.mode} allows")
        return (f"{d.mode}: {len(d.checkpoints)} checkpoints, {len(d.recomputed)} nodes "
                f"recomputed ({d.recompute_flops / 1e6:.1f} MFLOP); activation peak per rank "
                f"{d.peak_before / MiB:.2f} -> {d.peak_after / MiB:.2f} MiB (remat's count; "
                "memory_remat.png plots live activations + gradients of the whole joint graph "
                "at the global batch, so its peaks are larger)")
    if name == "pipeline_split" and "pipeline" in m:
        d = m["pipeline"]
        return (f"{d.n_stages} stages cut after {d.cuts}; slowest/mean stage "
                f"{d.imbalance:.3f}; {len(d.transfers)} transfers")
    if name == "codegen" and m.get("codegen") is not None:
        return ("what runs this graph at run time (Plan.codegen): Inductor's "
                f"{m['codegen'].summary()}; each box names the runs its ops went into")
    if name == "stages":
        calls = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        ins = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
        return f"one part of the step's schedule: {calls} ops, {ins} inputs"
    if name == "tensor_parallel" and "tensor_parallel" in m:
        d = m["tensor_parallel"]
        return (f"tp={d.tp}: {len(d.column)} column-split and {len(d.row)} row-split weights, "
                f"{len(d.replicated)} replicated")
    if name == "context_parallel" and "context_parallel" in m:
        d = m["context_parallel"]
        line = (f"cp={d['cp']}: the sequence of {', '.join(d['split'])} split; "
                f"{len(d['attention'])} attention(s) on the rank's chunks ({d['causal']} causal "
                f"chunk, {d['ring']} ring), {len(d['whole_attention'])} whole")
        if d.get("gathered"):
            line += ("; the sequence gathered for " + ", ".join(
                f"{k} ({v})" for k, v in d["gathered"].items()))
        comms = ", ".join(f"{v} {k}" for k, v in d["collectives"].items())
        return line + (f"; over the cp group: {comms}" if comms else "")
    if name == "expert_parallel" and "expert_parallel" in m:
        layers = m["expert_parallel"]
        held = sorted({f"{r['per_rank']} of {r['experts']}" for r in layers})
        ways = collections.Counter(r["dispatch"] for r in layers)
        return (f"{len(layers)} MoE layer(s) split, {', '.join(held)} experts on each rank; "
                "rows moved by " + ", ".join(f"{k} ({v})" for k, v in sorted(ways.items())))
    if name == "overlap" and "overlap" in m:
        return m["overlap"].describe()
    if name == "data_parallel":
        return _data_parallel_line(gm)
    if name == "capture":
        calls = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        regions = summary(gm)
        return (f"the model and its loss traced into one joint graph: {calls} ATen ops "
                f"({regions.get(ir.FORWARD, 0)} forward, {regions.get(ir.BACKWARD, 0)} "
                f"backward, {regions.get(ir.OPTIMIZER, 0)} optimizer)")
    if name == "precision" and "precision" in m:
        d = m["precision"]
        return (f"{str(d.dtype).replace('torch.', '')}: {len(d.half_nodes)} ops in half, "
                f"{len(d.fp32_nodes)} kept in fp32, {len(d.param_casts)} weights cast once, "
                f"{d.casts} casts" + (", loss scale input" if d.loss_scale else ""))
    if name == "fusion" and "fusion" in m:
        return m["fusion"].describe()
    s = summary(gm)
    return ", ".join(f"{v} {k}" for k, v in s.items())


def _data_parallel_line(gm) -> str:
    buckets = [n for n in gm.graph.nodes if n.op == "call_function" and is_collective(n)
               and n.meta.get(ir.BUCKET) and n.target in cost.COLLECTIVES]
    other = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in
             cost.COLLECTIVES and not n.meta.get(ir.BUCKET) and n.target not in experts.ASYNC]
    routed = sum(1 for n in gm.graph.nodes if n.target in experts.ASYNC)
    kinds = sorted({str(n.target).split(".")[1] for n in buckets})
    size = sum(cost.tensor_bytes(n.args[0].meta.get(ir.VAL)) for n in buckets)
    line = (f"the batch split over dp; gradients reduced in {len(buckets)} bucket(s) "
            f"({', '.join(kinds) or '-'}, {size / MiB:.2f} MiB in all)")
    if other:
        line += (f"; {len(other)} more collective(s) for what couples samples (a mean loss's "
                 "count, batch statistics) or ZeRO-3 parameter gathers")
    if routed:
        line += f"; {routed} expert all-to-all(s) of routed rows"
    return line


def _skipped_passes(plan, stage_graphs) -> list[tuple[str, str]]:
    """The passes this plan did not need, with the reason (the Plan field that turns each on)."""
    ran = set(stage_graphs)
    why = [("remat", plan.remat in ("none", None, 0), 'Plan.remat="none"'),
           ("tensor_parallel", plan.tp == 1, "tp=1"),
           ("expert_parallel", plan.ep == 1, "ep=1"),
           ("context_parallel", plan.cp == 1, "cp=1"),
           ("precision", plan.precision == "fp32", 'precision="fp32"'),
           ("data_parallel", plan.dp == 1 and not plan.zero, "dp=1"),
           ("pipeline_split", plan.pp == 1 and plan.microbatches == 1,
            "pp=1 and microbatches=1"),
           ("overlap", not plan.overlap, "Plan.overlap=False"),
           ("fusion", not plan.fuse, "Plan.fuse=False")]
    return [(name, f"not run: {reason}") for name, off, reason in why
            if off and name not in ran]


PAGE_SCRIPT = r"""
window.fxparErrors = [];
window.addEventListener('error', e => { fxparErrors.push(e.message ||
  ('failed to load ' + (e.target && (e.target.src || e.target.href)))); }, true);
function panZoom(svg) {
  const b = svg.viewBox.baseVal; if (!b || !b.width) return;
  const init = [b.x, b.y, b.width, b.height]; let [x, y, w, h] = init;
  svg.removeAttribute('width'); svg.removeAttribute('height');
  svg.style.width = '100%'; svg.style.height = Math.min(560, 1100 * h / w) + 'px';
  const set = () => svg.setAttribute('viewBox', `${x} ${y} ${w} ${h}`);
  const at = e => { const r = svg.getBoundingClientRect();
    return [(e.clientX - r.left) / r.width, (e.clientY - r.top) / r.height]; };
  svg.addEventListener('wheel', e => { e.preventDefault(); const [fx, fy] = at(e);
    const f = e.deltaY > 0 ? 1.2 : 1 / 1.2, px = x + fx * w, py = y + fy * h;
    w *= f; h *= f; x = px - fx * w; y = py - fy * h; set(); }, {passive: false});
  let drag = null;
  svg.addEventListener('mousedown', e => {
    drag = [e.clientX, e.clientY, x, y]; e.preventDefault(); });
  window.addEventListener('mouseup', () => { drag = null; });
  svg.addEventListener('mousemove', e => { if (!drag) return; const r = svg.getBoundingClientRect();
    x = drag[2] - (e.clientX - drag[0]) / r.width * w;
    y = drag[3] - (e.clientY - drag[1]) / r.height * h; set(); });
  svg.addEventListener('dblclick', () => { [x, y, w, h] = init; set(); });
}
window.addEventListener('load', () => {
  document.querySelectorAll('.zoom svg').forEach(panZoom);
  const bad = [...document.images].filter(i => !(i.complete && i.naturalWidth > 0))
    .map(i => i.getAttribute('src'));
  const out = document.getElementById('selfcheck');
  const ok = !bad.length && !fxparErrors.length;
  out.dataset.ok = ok ? 'yes' : 'no';
  out.textContent = ok ? `page check: ${document.images.length} images and `
    + `${document.querySelectorAll('.zoom svg').length} graphs shown, no script error`
    : `page check FAILED: missing images [${bad.join(', ')}]; errors [${fxparErrors.join('; ')}]`;
});
"""


def _inline_svg(path: str) -> str:
    """An SVG file's markup for inlining (its links then work from the page, and the script
    can pan and zoom it): the XML prolog, doctype and comments dropped."""
    with open(path) as f:
        text = f.read()
    text = re.sub(r"<\?xml[^>]*\?>|<!DOCTYPE[^>]*>|<!--.*?-->", "", text, flags=re.S)
    return text.strip()


def _compile_table(rows) -> str:
    total = sum(dt for _, dt, _ in rows) or 1e-9
    body = "".join(f"<tr><td>{html.escape(n)}</td><td>{dt * 1e3:.1f} ms</td>"
                   f"<td>{dt / total * 100:.0f}%</td><td>{nodes or ''}</td></tr>"
                   for n, dt, nodes in rows)
    return (f"<p>Every phase of <code>parallelize</code> on rank 0, {total:.2f} s in all "
            "(the rows add up to the call's wall time; \"other\" is what no phase "
            "timed).</p><table><tr><th>phase</th><th>time</th><th>share</th>"
            f"<th>nodes after it</th></tr>{body}<tr><td><b>total</b></td>"
            f"<td><b>{total * 1e3:.1f} ms</b></td><td></td><td></td></tr></table>")


def write_report(pm, out_dir: str, *, svgs: list[str], images: list[str],
                 measured_step_s: float | None = None, measured_memory: int | None = None
                 ) -> str:
    """Write out_dir/report.html (call on one rank, after training steps ran). Measured step
    time: the median of the last recorded steps unless given. measured_memory: what one step
    allocated on this rank (runtime/memtrack.measure)."""
    plan = pm.plan
    rows = "".join(f"<tr><td>{f.name}</td><td>{html.escape(repr(getattr(plan, f.name)))}</td>"
                   "</tr>" for f in dataclasses.fields(plan))
    passes = []
    for i, (name, roles) in enumerate(pm.stage_graphs.items()):
        for role, gm in roles.items():
            svg = next((p for p in svgs if os.path.basename(p).startswith(f"{i:02d}_{name}_")
                        and os.path.basename(p)[len(f"{i:02d}_{name}_"):-4] == role), None)
            pic = (f'<div class="zoom">{_inline_svg(svg)}</div><p class="small"><a href="'
                   f'{os.path.basename(svg)}">open {os.path.basename(svg)}</a></p>'
                   if svg and os.path.exists(svg) else "")
            passes.append(f"<h3>{i}. {name} ({role})</h3><p>"
                          f"{html.escape(_decision_line(name, gm))}</p>{pic}")
    skipped = getattr(pm, "fusion_skipped", None)
    if plan.fuse and skipped:
        passes.append(f"<h3>fusion</h3><p>not run: {html.escape(skipped)}</p>")
    if hasattr(pm, "codegen_summary"):
        passes.append(f"<h3>code generation (Plan.codegen={plan.codegen!r})</h3><p>"
                      f"{html.escape(pm.codegen_summary)}; compile time per graph in the "
                      f"<a href=\"#compile\">compile table</a> (rows \"codegen ...\")</p>")
    not_run = "".join(f"<li><b>{n}</b>: {html.escape(why)}</li>"
                      for n, why in _skipped_passes(plan, pm.stage_graphs))
    if not_run:
        passes.append(f"<h3>Passes this plan did not need</h3><ul>{not_run}</ul>")

    final = [roles for name, roles in pm.stage_graphs.items()
             if name not in ("stages", "codegen")][-1]
    gm = next(iter(final.values()))  # the whole graph after the last pass (not a part)
    s = plan.node_group or plan.dp
    pred = predict(gm, pm.world.device, max(plan.dp, 1), {
        ir.GROUPS["tp"]: plan.tp, ir.GROUPS["pp"]: plan.pp, ir.GROUPS["dp_shard"]: s,
        ir.GROUPS["dp_rep"]: plan.dp // s})
    stats = pm.step_stats
    measured_s = measured_step_s or (statistics.median(s.time_s for s in stats[-5:])
                                     if stats else None)
    pp_note = (" (pipeline plans: the prediction is the unsplit graph's, one microbatch "
               "schedule not simulated yet)" if plan.microbatched else "")
    # one measured step time on the page, labelled alike in every row that shows it (the
    # re-fit row's label names the other measurement it was fitted to: steps 3-8)
    measured_txt = " (median of the last steps)" if measured_step_s is None else " (measured)"
    cmp_rows = [("step time", f"{pred.step_s * 1e3:.2f} ms (compute {pred.compute_s * 1e3:.2f}"
                 f" + communication {pred.comm_s * 1e3:.2f})",
                 f"{measured_s * 1e3:.2f} ms{measured_txt}" if measured_s else "-")]
    cmp_rows.append(("memory the step allocates (gradients + activations)",
                     f"{pred.memory_bytes / MiB:.2f} MiB",
                     f"{measured_memory / MiB:.2f} MiB" if measured_memory else "-"))
    calibrated = _planner_rows(pm, measured_s, measured_memory, measured_txt)
    if calibrated:
        cmp_rows = calibrated + [(f"{a} (uncalibrated roofline, this rank's graph)", b, c)
                                 for a, b, c in cmp_rows]
    cmp = "".join(f"<tr><td>{a}</td><td>{b}</td><td>{c}</td></tr>" for a, b, c in cmp_rows)
    covers = _memory_sentence(pred, measured_memory, pm)
    imgs = "".join(f'<h3>{html.escape(os.path.basename(p))}</h3><p class="small">'
                   f'{html.escape(_IMAGE_CAPTIONS.get(os.path.basename(p), ""))}</p>'
                   f'<img src="{os.path.basename(p)}" class="plot">' for p in images)
    st = stats[-5:]
    comm_line = ""
    if st:
        avg = {k: 1e3 * sum(getattr(x, k) for x in st) / len(st)
               for k in ("comm_s", "exposed_comm_s", "time_s")}
        comm_line = (f"<p>Last steps on rank 0: {avg['time_s']:.1f} ms a step; collectives in "
                     f"flight {avg['comm_s']:.1f} ms; compute thread blocked on them (issuing + "
                     f"waiting: the exposed communication) {avg['exposed_comm_s']:.1f} ms."
                     "</p>")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>fxpar report</title>
<style>body{{font-family:Helvetica,Arial,sans-serif;margin:2em;max-width:1200px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}
.zoom{{border:1px solid #ddd;overflow:hidden;cursor:grab}}img.plot{{max-width:100%}}
.small{{font-size:85%;color:#555}}#selfcheck{{font-size:80%;color:#777}}
</style><script>{PAGE_SCRIPT}</script></head><body>
<h1>fxpar report</h1>
<p>{html.escape(type(pm.model).__name__)} on {pm.world.size} rank(s), device
{html.escape(str(pm.world.device))}. Contents: <a href="#plan">plan</a>, <a href="#why">why
this plan</a>, <a href="#compile">compile time</a>, <a href="#passes">what each pass did</a>,
<a href="#predicted">predicted vs measured</a>, <a href="#timeline">timeline and memory</a>.</p>
<h2 id="plan">Plan</h2><table>{rows}</table>
<div id="why">{_explain_block(pm) or _GIVEN}</div>
<h2 id="compile">Compile</h2>{_compile_table(pm.compile_times)}
<h2 id="passes">What each pass did</h2>
<p class="small">Pictures: one box per module (a repeated layer is one row), coloured by stage
or region, with what the passes did to it (recomputed, saved, tp split, fused); red nodes are
collectives with their bytes, black ones pipeline transfers; legend in each picture. Wheel to
zoom, drag to pan, double-click to reset; click a box for its ATen ops.</p>{''.join(passes)}
<h2 id="predicted">Predicted vs measured (rank 0)</h2>
<p>Prediction: the cost model on the final graph (roofline per node against the
{html.escape(cost.DeviceProfile.for_device(pm.world.device).name)} profile, alpha-beta
collectives; liveness simulation for memory){html.escape(pp_note)}. When the planner chose the
plan, its calibrated prediction comes first: measured hardware, schedule simulation, memory
estimator (compiler/planner.py). {html.escape(covers)}</p>
<table><tr><th></th><th>predicted</th><th>measured</th></tr>{cmp}</table>
<h2 id="timeline">Timeline and memory</h2>{comm_line}{imgs}
<p id="selfcheck">page check: not run (scripts disabled?)</p>
</body></html>"""
    path = os.path.join(out_dir, "report.html")
    with open(path, "w") as f:
        f.write(page)
    return path


_GIVEN = ("<h3>Why this plan</h3><p>The plan was given, not searched (plan='auto' shows the "
          "planner's ranking here).</p>")
_IMAGE_CAPTIONS = {
    "timeline.png": "The last steps of every rank (pm.trace): compute coloured by region "
                    "(forward, backward, packing, optimizer), blocked time red, collectives on "
                    "each rank's comm row; trace.json opens in https://ui.perfetto.dev.",
    "memory_remat.png": "Simulated live activations + gradients of the whole joint graph at "
                        "the global batch, without and with remat (remat's own line above "
                        "gives activations per rank).",
}


def untracked(pm) -> bool:
    """Inductor's CPU code allocates its buffers below the dispatcher, where runtime/memtrack's
    CPU tracker cannot see them: no memory measurement of such a step (CUDA's allocator
    statistics see everything)."""
    return getattr(pm.program, "codegen", "eager") == "inductor" and \
        pm.world.device.type == "cpu"


def _memory_sentence(pred: Prediction, measured: int | None, pm=None) -> str:
    """What the memory figures cover, and why they may differ."""
    text = ("Memory: the prediction counts the gradients and activations the step's graph "
            "keeps live at its fullest point; the measurement counts every allocation one "
            "step makes on this rank (runtime/memtrack.measure), which also includes the "
            "optimizer's temporaries and new state, collective and bucket buffers, and "
            "the batch slice.")
    if measured is None and pm is not None and untracked(pm):
        text += (" Not measured here: Inductor's CPU code (Plan.codegen) allocates below the "
                 "dispatcher, where the tracker cannot see; codegen='eager' measures it.")
    if measured and pred.memory_bytes:
        err = (pred.memory_bytes / measured - 1) * 100
        if abs(err) > 25:
            text += (f" Here the prediction is {err:+.0f}% off the measurement: for a model "
                     "this small those extra buffers are a large share of the step.")
    return text
