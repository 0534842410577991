"""The layer-level picture (viz/layer_graph.py): one box per module at layer granularity,
what the passes did shown on the boxes and between them, readable at page width."""
import os
import re

import pytest
import torch

import fxpar
from fxpar.examples import models as M
from fxpar.viz.graph import write_snapshots
from fxpar.viz.layer_graph import box_of, layer_dot, layer_view, repeated_containers

CFG = M.GPTConfig(n_layer=2, n_embd=32)
GPT_BOXES = {"wte", "wpe", "drop", "", "ln_f", "lm_head"} | {
    f"h.{i}{c}" for i in range(2) for c in ("", ".ln_1", ".attn", ".ln_2", ".mlp")}


def _compile(plan, cfg=CFG, batch=4):
    n = plan.get("dp", 1) * plan.get("tp", 1) * plan.get("pp", 1)
    return fxpar.compile(M.GPT(cfg), n, example_batch=M.gpt_batch(cfg, batch), plan=plan)


def _width(svg: str) -> float:
    return float(re.search(r'<svg width="([\d.]+)pt"', svg).group(1))


def test_boxes_cut_at_the_children_of_the_repeated_layer_generically():
    paths = ["h.0.attn.c_attn", "h.0.mlp.0", "h.1.mlp.2", "wte", "ln_f", ""]
    assert repeated_containers(paths) == ["h"]  # not h.0.mlp (its Sequential indices)
    assert box_of("h.1.mlp.2", ["h"]) == ("h.1.mlp", "h.1")
    assert box_of("h.1", ["h"]) == ("h.1", "h.1")
    assert box_of("ln_f", ["h"]) == ("ln_f", None)
    hf = ["bert.embeddings.word_embeddings", "bert.encoder.layer.0.attention.self.query",
          "bert.encoder.layer.1.output.dense", "bert.pooler.dense", "classifier"]
    c = repeated_containers(hf)
    assert c == ["bert.encoder.layer"]
    assert [box_of(p, c)[0] for p in hf] == [
        "bert.embeddings", "bert.encoder.layer.0.attention", "bert.encoder.layer.1.output",
        "bert.pooler", "classifier"]
    assert box_of("model.layers.3.self_attn.q_proj", ["model.layers"])[0] == \
        "model.layers.3.self_attn"
    assert repeated_containers(["fc1", "fc2"]) == []
    assert box_of("fc1", []) == ("fc1", None)


def test_remat_and_dp_recomputed_counts_and_gradient_collectives(tmp_path):
    prog = _compile({"dp": 2, "remat": "sqrt"})
    gm = prog.stage_graphs["data_parallel"]["dp"]
    view = layer_view(gm)
    assert {b.path for b in view.boxes.values()} == GPT_BOXES
    # the recomputed counts are the nodes remat marked, on the boxes of their modules
    for b in view.boxes.values():
        assert b.recomputed == sum(bool(n.meta.get("recompute")) for n in b.nodes)
    assert sum(b.recomputed for b in view.boxes.values()) == sum(
        bool(n.meta.get("recompute")) for n in gm.graph.nodes)
    assert view.boxes[(None, "h.0.attn")].recomputed > 0
    assert all(b.recomputed == 0 for b in layer_view(
        prog.stage_graphs["capture"]["joint"]).boxes.values())
    grads = [lk for lk in view.links if "(grads)" in lk.kind]
    assert grads and all(lk.kind.startswith("all_reduce") and lk.nbytes > 0 for lk in grads)
    src = layer_dot(view, "t").source
    assert f"{view.boxes[(None, 'h.0.attn')].recomputed} recomputed" in src
    assert "all_reduce (grads)" in src and "KiB" in src and "legend" in src


def test_tensor_parallel_labels_column_row_and_its_all_reduces():
    view = layer_view(_compile({"tp": 2}).stage_graphs["tensor_parallel"]["dp"])
    assert view.boxes[(None, "h.0.attn")].tp == {"column c_attn", "row c_proj"}
    assert view.boxes[(None, "h.1.mlp")].tp == {"column 0", "row 2"}
    assert view.boxes[(None, "wte")].tp == {"vocab"}
    # Megatron: row-parallel c_proj's partial sum is all-reduced into the residual add
    fwd = [lk for lk in view.links if lk.kind == "all_reduce" and not lk.backward
           and (None, "h.0.attn") in lk.srcs]
    assert fwd and (None, "h.0") in fwd[0].dsts
    assert fwd[0].nbytes == 4 * 32 * 32 * 4  # (batch, seq, n_embd) fp32
    src = layer_dot(view).source
    assert "tp: column c_attn, row c_proj" in src and "all_reduce" in src


def test_pipeline_one_cluster_per_stage_and_send_recv_with_bytes():
    gm = _compile({"pp": 2, "microbatches": 2}).stage_graphs["pipeline_split"]["dp"]
    view = layer_view(gm)
    assert view.staged and {b.stage for b in view.boxes.values()} == {0, 1}
    sends = [lk for lk in view.links if lk.transfer]
    assert {lk.kind for lk in sends} == {"send s0 -> recv s1", "send s1 -> recv s0"}
    expect = sum(n.meta["val"].numel() * 4 for n in gm.graph.nodes if "transfer" in n.meta)
    assert sum(lk.nbytes for lk in sends) == expect
    src = layer_dot(view).source
    assert src.count("subgraph cluster_stage") == 2
    assert "send s0 -> recv s1" in src and "stage 1" in src


def test_write_snapshots_links_every_box_to_an_existing_drawing(tmp_path):
    prog = _compile({"dp": 2, "remat": "sqrt"})
    paths = write_snapshots(prog.stage_graphs, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == [
        "00_capture_joint.svg", "01_remat_dp.svg", "02_data_parallel_dp.svg",
        "03_overlap_dp.svg"]
    for p in paths:
        svg = open(p).read()
        hrefs = re.findall(r'xlink:href="([^"]+)"', svg)
        assert len(hrefs) == len(GPT_BOXES) and "legend" in svg
        for h in hrefs:
            assert os.path.isfile(os.path.join(tmp_path, h)), h
    # overlap moves no op to another module: its boxes reuse the earlier drawings
    assert not os.path.exists(tmp_path / "03_overlap_dp")
    detail = open(tmp_path / "01_remat_dp" / "h.0.mlp.svg").read()
    assert "(recompute)" in detail and "h.0.mlp.0" in detail


@pytest.mark.slow  # two 12-layer compiles: 16 s of make test's 6 minutes
@pytest.mark.parametrize("plan", [{"dp": 2, "remat": "sqrt"},
                                  pytest.param({"pp": 2, "microbatches": 2},
                                               marks=pytest.mark.full)])
def test_twelve_layers_fit_a_page(plan):
    cfg = M.GPTConfig(n_layer=12, n_embd=32)
    prog = _compile(plan, cfg)
    name = "overlap" if plan.get("dp") else "pipeline_split"
    gm = prog.stage_graphs[name]["dp"]
    svg = layer_dot(gm, f"after {name}").pipe(format="svg").decode()
    assert _width(svg) <= 1400, _width(svg)
    assert svg.count("<title>h.") >= 12  # every layer row drawn


def test_plain_models_draw_without_repeated_layers(tmp_path):
    gm = fxpar.compile(M.MLP(), 2, example_batch=(torch.randn(8, 16), torch.randn(8, 4)),
                       plan={"dp": 2}).stage_graphs["data_parallel"]["dp"]
    view = layer_view(gm)
    assert {"fc1", "fc2", "fc3"} <= {b.path for b in view.boxes.values()}
    blocks = fxpar.compile(M.DeepMLP(n_blocks=3), 1,
                           example_batch=(torch.randn(8, 16), torch.randn(8, 4))).graph
    rows = {b.layer for b in layer_view(blocks).boxes.values()} - {None}
    assert rows == {"blocks.0", "blocks.1", "blocks.2"}


def test_overlap_picture_marks_what_moved_and_says_so_in_its_title(tmp_path):
    """The overlap snapshot looked like the data-parallel one with another title: now the
    collectives the pass moved are green with how many moved, and the title sums it up."""
    prog = _compile({"dp": 2, "bucket_mb": 0.01}, cfg=M.GPTConfig(n_layer=4, n_embd=64))
    gm = prog.stage_graphs["overlap"]["dp"]
    d = gm.meta["overlap"]
    assert d.hoisted or d.sunk, d.why
    view = layer_view(gm)
    assert sum(lk.earlier for lk in view.links) == len(d.hoisted)
    assert sum(lk.later for lk in view.links) == len(d.sunk)
    src = layer_dot(view, "t").source
    assert "moved: " in src and "the overlap pass moved it" in src
    before = layer_dot(layer_view(prog.stage_graphs["data_parallel"]["dp"]), "t").source
    assert "moved: " not in before and "the overlap pass moved it" not in before
    paths = write_snapshots({"overlap": {"dp": gm}}, str(tmp_path), details=False)
    title = open(paths[0].replace(".svg", ".dot")).read()
    assert (f"{len(d.hoisted)} collectives started earlier" if d.hoisted else
            f"{len(d.sunk)} waits moved later") in title


def test_pp_by_tp_keeps_every_box_inside_a_stage():
    """Ops tensor parallelism inserts after the stage split (the vocabulary-parallel lookup's
    id masking, its gathers) carry no stage of their own: their boxes floated outside every
    stage cluster. They take their neighbours' stage."""
    prog = _compile({"pp": 2, "tp": 2, "microbatches": 2})
    for name in ("tensor_parallel", "data_parallel"):
        view = layer_view(prog.stage_graphs[name]["dp"])
        assert view.staged and all(b.stage in (0, 1) for b in view.boxes.values()), [
            b.path for b in view.boxes.values() if b.stage not in (0, 1)]
    assert view.boxes[(0, "wte")] and view.boxes[(1, "lm_head")]
    # ... and so do the collectives (the tp all-reduces are inserted after the split too):
    # each badge is declared inside its stage's cluster; only transfers sit between them
    assert all(link.stage in (0, 1) for link in view.links if not link.transfer)
    src = layer_dot(view, "t").source
    clusters = re.split(r"subgraph cluster_stage", src)
    inside = "".join(c.split("\n\t}")[0] for c in clusters[1:])
    for i, link in enumerate(view.links):
        declared = re.search(rf"^\s*link{i} \[", inside, re.M) is not None
        assert declared == (not link.transfer), (link.kind, link.stage)


@pytest.mark.slow  # (make test's 6 minutes)
def test_the_codegen_picture_shows_each_box_s_inductor_runs(tmp_path):
    """With Inductor (Plan.codegen), pm.stage_graphs["codegen"] is the graph the rank runs
    with every compiled node marked by its run: the boxes count them, the node drawings
    name the run, the title says what Inductor compiled."""
    from fxpar.compiler import codegen
    from fxpar.core import ir
    cfg = M.GPTConfig(n_layer=1, n_embd=32)
    pm = fxpar.parallelize(M.GPT(cfg), 1, example_batch=M.gpt_batch(cfg, 2),
                           plan={"codegen": "inductor"})
    gm = pm.stage_graphs["codegen"]["joint"]
    generated = pm._generated[id(pm.program)]
    origin = {o: m.name for m in generated.modules() if isinstance(m, codegen.CompiledRun)
              for o in m.origin}
    marked = {n.name: n.meta[ir.CODEGEN_RUN] for n in gm.graph.nodes
              if ir.CODEGEN_RUN in n.meta}
    assert origin and marked == origin
    view = layer_view(gm)
    assert sum(sum(b.compiled.values()) for b in view.boxes.values()) == sum(
        1 for n in gm.graph.nodes if n.name in marked and n.op == "call_function"
        and any(n in b.nodes for b in view.boxes.values()))
    dot = layer_dot(view, "codegen").source
    assert "Inductor run" in dot
    svg = write_snapshots({"codegen": pm.stage_graphs["codegen"]}, str(tmp_path))[0]
    text = open(svg).read()
    assert "compiled runs holding" in text  # the title: Generated.summary()
    mlp = open(os.path.join(tmp_path, "00_codegen_joint", "h.0.attn.svg")).read()
    assert re.search(r"\[compiled_\d+\]", mlp)
