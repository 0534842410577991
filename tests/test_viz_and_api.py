"""Pictures, the CLI, evaluate() and the optimizer contract."""
import copy
import os

import pytest
import torch

import fxpar
from fxpar.compiler.capture import capture
from fxpar.core.errors import PlanError
from fxpar.compiler.pass_manager import PassContext, run_passes
from fxpar.core.plan import resolve
from fxpar.examples import models as M
from fxpar.viz.graph import is_collective, summary, to_dot, write_snapshots


def _dp_graphs(dp=2):
    gm, sig = capture(M.MLP(), (torch.randn(8, 16), torch.randn(8, 4)))
    snaps = {}
    run_passes(gm, resolve({"dp": dp}, dp), PassContext(sig, group_names={"dp": "g"}), "dp", snaps)
    return snaps


def test_dot_colours_regions_highlights_collectives_and_clusters_modules():
    snaps = _dp_graphs()
    gm = snaps["data_parallel"]["dp"]
    src = to_dot(gm, "t").source
    assert "cluster_fc1" in src and "cluster_fc3" in src
    assert "#cfe8ff" in src and "#ffe3c4" in src       # forward / backward colours
    n_coll = sum(is_collective(n) for n in gm.graph.nodes)
    assert n_coll == 4 and src.count("penwidth=3") == n_coll
    assert "S(0)" in src and "P(sum)" in src            # placements are labelled
    assert summary(gm)["collective"] == 4


def test_write_snapshots_renders_svg(tmp_path):
    paths = write_snapshots(_dp_graphs(), str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["00_capture_joint.svg",
                                                    "01_data_parallel_dp.svg",
                                                    "02_overlap_dp.svg"]
    for p in paths:
        assert open(p).read().lstrip().startswith(("<?xml", "<svg"))
        assert os.path.exists(p[:-4] + ".dot")


def test_cli_viz(tmp_path):
    from fxpar.__main__ import main
    main(["viz", "--example", "convbn", "--dp", "2", "--batch", "4", "--out", str(tmp_path)])
    assert sorted(f for f in os.listdir(tmp_path) if "." in f) == [
        "00_capture_joint.dot", "00_capture_joint.svg", "01_data_parallel_dp.dot",
        "01_data_parallel_dp.svg", "02_overlap_dp.dot", "02_overlap_dp.svg"]
    # the layer views' per-module drawings (overlap changed no module: it links to earlier ones)
    assert "conv1.svg" in os.listdir(tmp_path / "00_capture_joint")


def test_evaluate_is_forward_only_and_does_not_update():
    torch.manual_seed(0)
    model = M.ConvBN()
    batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))
    ref = copy.deepcopy(model)
    pm = fxpar.parallelize(model, 1, example_batch=batch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = pm.evaluate(batch)
    with torch.no_grad():
        torch.testing.assert_close(loss, ref(batch))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_default_optimizer_and_lr_changes_behave_as_in_eager():
    torch.manual_seed(0)
    model = M.MLP()
    ref = copy.deepcopy(model)
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    pm = fxpar.parallelize(model, 1, example_batch=batch,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        if step == 2:  # a user lowering the lr mid-training
            pm.optimizer.param_groups[0]["lr"] = 0.01
            opt.param_groups[0]["lr"] = 0.01
        pm.step(batch)
        opt.zero_grad()
        ref(batch).backward()
        opt.step()
    for (k, v), (_, r) in zip(pm.full_state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(v, r, msg=k)
    # the default optimizer is SGD(lr=1e-3)
    pm2 = fxpar.parallelize(M.MLP(), 1, example_batch=batch)
    assert isinstance(pm2.optimizer, torch.optim.SGD)
    assert pm2.optimizer.param_groups[0]["lr"] == 1e-3


def test_plan_auto_is_pure_data_parallel():
    assert resolve("auto", 4) == fxpar.Plan(dp=4, tp=1, pp=1)
    assert resolve({"dp": 2}, 2).dp == 2


def test_cli_viz_remat_marks_recompute_and_plots_memory(tmp_path):
    from fxpar.__main__ import main
    main(["viz", "--example", "gpt", "--dp", "2", "--remat", "sqrt", "--out", str(tmp_path)])
    files = sorted(os.listdir(tmp_path))
    assert "01_remat_dp.svg" in files and "memory_remat.png" in files
    svg = open(tmp_path / "01_remat_dp.svg").read()
    assert "recomputed" in svg and "saved" in svg  # the layer view's badges
    nodes = "".join(p.read_text() for p in (tmp_path / "01_remat_dp").glob("*.svg"))
    assert "(recompute)" in nodes and "[saved]" in nodes  # the per-module drawings
    assert open(tmp_path / "memory_remat.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_memory_plot_aligns_both_graphs_on_the_backward_boundary():
    """Remat adds recomputed nodes to the backward, so the graphs before and after it have
    different node counts: each curve is drawn against its own phases (forward over [0, 1),
    backward over [1, 2]), so both cross into the backward at x = 1."""
    from fxpar.core import ir
    from fxpar.examples import models as M
    from fxpar.viz import memory_plot
    cfg = M.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    prog = fxpar.compile(M.GPT(cfg), 1, example_batch=M.gpt_batch(cfg, 2),
                         plan={"remat": "sqrt"})
    before, after = prog.stage_graphs["capture"]["joint"], prog.stage_graphs["remat"]["dp"]
    for gm in (before, after):
        nodes = list(gm.graph.nodes)
        k = memory_plot.backward_start(gm)
        assert nodes[k].meta[ir.REGION] != ir.FORWARD
        assert all(n.meta.get(ir.REGION, ir.FORWARD) == ir.FORWARD for n in nodes[:k]
                   if n.op == "call_function")
        xs = memory_plot.phase_positions(len(nodes), k)
        assert xs[0] == 0 and xs[k - 1] < 1 == xs[k] and xs[-1] == 2
    assert len(after.graph.nodes) > len(before.graph.nodes)  # (the recomputed nodes)


def test_cli_viz_zero3_shows_gathers_and_reduce_scatters(tmp_path):
    from fxpar.__main__ import main
    main(["viz", "--example", "mlp", "--dp", "2", "--zero", "3", "--out", str(tmp_path)])
    svg = open(tmp_path / "01_data_parallel_dp.svg").read()
    assert "all_gather_into_tensor" in svg and "reduce_scatter_tensor" in svg


def test_cli_viz_pipeline_colours_stages_and_shows_transfers(tmp_path):
    from fxpar.__main__ import main
    from fxpar.viz.graph import STAGE_COLORS
    main(["viz", "--example", "gpt", "--dp", "1", "--pp", "2", "--microbatches", "2",
          "--schedule", "zero-bubble", "--out", str(tmp_path)])
    svg = open(tmp_path / "01_pipeline_split_dp.svg").read()
    assert "send s0 &#45;&gt; recv s1" in svg and "send s1 &#45;&gt; recv s0" in svg
    assert STAGE_COLORS[0] in svg and STAGE_COLORS[1] in svg
    nodes = "".join(p.read_text() for p in tmp_path.glob("01_pipeline_split_dp/*.svg"))
    assert "[W1]" in nodes and "[I1]" in nodes and "[F0]" in nodes


def test_plan_errors_for_pipeline():
    with pytest.raises(PlanError, match="multiple of pp"):
        resolve({"pp": 2, "dp": 1, "schedule": "interleaved", "microbatches": 3}, 2)


def test_report_shows_plan_passes_and_predicted_vs_measured(tmp_path):
    from fxpar.runtime.memtrack import measure
    from fxpar.viz.report import predict, write_report
    cfg = M.GPTConfig()
    torch.manual_seed(0)
    batch = M.gpt_batch(cfg, 4)
    pm = fxpar.parallelize(M.GPT(cfg), 1, example_batch=batch, plan={"remat": "sqrt"})
    for _ in range(3):
        pm.step(batch)
    _, peak = measure(lambda: pm.step(batch))
    svgs = write_snapshots(pm.stage_graphs, str(tmp_path))
    path = write_report(pm, str(tmp_path), svgs=svgs, images=[], measured_memory=peak)
    page = open(path).read()
    for text in ('<h2 id="plan">Plan</h2>', "remat", "checkpoints", "data_parallel",
                 "Predicted vs measured", "01_remat_dp.svg", "fusion</h3><p>not run: ",
                 "activation peak per rank", "<b>tensor_parallel</b>: not run: tp=1",
                 "<div class=\"zoom\"><svg", "<td><b>total</b></td>"):
        assert text in page, text
    # every graph inline once, the passes' lines say what they did
    assert page.count('<div class="zoom">') == sum(len(r) for r in pm.stage_graphs.values())
    assert "the model and its loss traced into one joint graph" in page
    pred = predict(pm.stage_graphs["data_parallel"]["dp"], "cpu", 1)
    assert pred.step_s > 0 and pred.comm_s == 0 and pred.memory_bytes > 0
    # the liveness simulation and the tracker see the same allocations (optimizer temporaries
    # and the loss aside): within a factor of 2 on this tiny model
    assert 0.5 * peak <= pred.memory_bytes <= 2 * peak, (pred.memory_bytes, peak)
