"""The timeline: compute segments named by the region they ran (forward, backward,
optimizer) from the graph's region markers, pipeline actions with their stage, microbatch and
phase, and the PNG drawn from the trace (its legend: only the categories present)."""

import json

import pytest
import torch

import fxpar
from fxpar.examples import models as M
from fxpar.runtime import comm, executor
from fxpar.runtime.trace import COMM, COMPUTE, on_track
from fxpar.viz import timeline

CFG = M.GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    batch = M.gpt_batch(CFG, 4)
    pm = fxpar.parallelize(M.GPT(CFG), 1, example_batch=batch, plan={"dp": 1})
    for _ in range(2):
        pm.step(batch)
    return pm, batch


def _steps(events, pid=0):
    """Per step of rank `pid`: its step event and its compute spans, in time order."""
    mine = [e for e in events if e.get("pid") == pid]
    steps = sorted((e for e in mine if e.get("cat") == "step"), key=lambda e: e["ts"])
    compute = sorted((e for e in mine if on_track(e, COMPUTE)), key=lambda e: e["ts"])
    return [(s, [e for e in compute if s["ts"] <= e["ts"] < s["ts"] + s["dur"]])
            for s in steps]


def _check_actions(events, stages):
    """Stage computations keep their name ("F1 s0"), carry stage, microbatch and phase, and
    their cat is their phase's; `stages`: the (rank, stage) pairs expected."""
    actions = [e for e in events if on_track(e, COMPUTE) and "microbatch" in e.get("args", {})]
    assert {(e["pid"], e["args"]["stage"]) for e in actions} == stages
    want = {"F": "forward", "B": "backward"}
    for e in actions:
        a = e["args"]
        assert e["name"] == f"{a['phase']}{a['microbatch']} s{a['stage']}"
        assert e["cat"] == want[a["phase"]]
    assert {e["args"]["microbatch"] for e in actions} == {0, 1}
    assert {e["args"]["phase"] for e in actions} == {"F", "B"}


def test_step_segments_follow_regions(trained, tmp_path):
    """Each step: forward, backward, optimizer, in that order, each taking time, together
    the whole step; the step statistics are unchanged (no communication at one rank)."""
    pm, _ = trained
    events = json.load(open(pm.trace(str(tmp_path / "t.json"))))["traceEvents"]
    steps = _steps(events)
    assert len(steps) == 2
    for step, spans in steps:
        assert [e["cat"] for e in spans] == ["forward", "backward", "optimizer"]
        assert [e["name"] for e in spans] == ["forward", "backward", "optimizer"]
        assert all(e["dur"] > 0 for e in spans)
        assert sum(e["dur"] for e in spans) == pytest.approx(step["dur"], rel=0.02)
    for st, (step, _) in zip(pm.step_stats, steps):
        assert st.time_s * 1e6 == pytest.approx(step["dur"])
        assert st.comm_s == st.exposed_comm_s == 0.0
    # the markers: one per region change of the lowered graph, nothing else added
    lowered = pm._lowered[id(pm.program)]
    marks = [n.args[0] for n in lowered.graph.nodes if n.target is comm.mark]
    assert marks == ["forward", "backward"]


def test_evaluate_runs_forward_only(trained):
    """pm.evaluate's forward-only graph marks only forward (recorded here by hand: evaluate
    itself records no step), and gives the training graph's loss."""
    pm, batch = trained
    before = len(pm.step_stats)
    loss = pm.evaluate(batch)
    assert len(pm.step_stats) == before  # evaluation is not a training step
    with executor.recording(pm.recorder):
        assert torch.equal(pm.evaluate(batch), loss)
    spans = pm.recorder.steps[-1][3]
    assert {s.cat for s in spans} == {"forward"} and spans
    pm.recorder.steps.pop(), pm.recorder.stats.pop()


def test_markers_under_debug_nan(trained, monkeypatch):
    """FXPAR_DEBUG_NAN runs the lowered graph node by node: the markers run there too."""
    pm, batch = trained
    monkeypatch.setenv("FXPAR_DEBUG_NAN", "1")
    pm.step(batch)
    spans = pm.recorder.steps[-1][3]
    assert [s.cat for s in spans] == ["forward", "backward", "optimizer"]


def test_png_and_legend(trained, tmp_path):
    """The PNG renders; its legend lists exactly the categories drawn (no weight grad or
    comm at one rank without a pipeline)."""
    pm, _ = trained
    path = pm.trace(str(tmp_path / "t.json"))
    spans, steps, _ = timeline.last_spans(json.load(open(path))["traceEvents"])
    assert len(steps) == 2
    labels = [h.get_label() for h in timeline.legend_handles(spans)]
    assert labels == ["forward", "backward", "optimizer"]
    png = timeline.plot_timeline(path, str(tmp_path / "t.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_legend_handles_only_present():
    fake = [{"ph": "X", "tid": 0, "cat": "weight grad"}, {"ph": "X", "tid": 1, "cat": "comm"},
            {"ph": "X", "tid": 0, "cat": "forward"}, {"ph": "X", "tid": 0, "cat": "blocked"}]
    assert [h.get_label() for h in timeline.legend_handles(fake)] == [
        "forward", "weight grad", "blocked", "comm"]


def test_waiting_for_a_peer_is_its_own_colour_and_every_ranks_idle_time_is_counted():
    """A pipeline recv is the bubble, not a collective: its own colour (not blocked's red);
    the title's per-rank figures count each rank's blocked and waiting time per step;
    action labels take one style throughout ("F0 s1" only where every bar fits it)."""
    assert timeline.COLORS["waiting for a peer"] != timeline.COLORS["blocked"]
    steps = [{"pid": p, "ts": t, "dur": 1000, "cat": "step"} for p in (0, 1) for t in (0, 1000)]
    spans = [{"pid": 0, "tid": 0, "ts": 0, "dur": 200, "cat": "blocked"},
             {"pid": 1, "tid": 0, "ts": 0, "dur": 600, "cat": "waiting for a peer"},
             {"pid": 1, "tid": 0, "ts": 600, "dur": 100, "cat": "blocked"},
             {"pid": 1, "tid": 1, "ts": 0, "dur": 900, "cat": "comm"}]  # (the comm track)
    assert timeline.idle_per_step(spans, steps) == {0: (0.1, 0.0), 1: (0.05, 0.3)}
    wide, narrow = {"name": "F0 s1", "args": {"microbatch": 0}}, {"name": "F0 s1",
                                                                  "args": {"microbatch": 0}}
    assert timeline._label(wide, 100, full=True) == "F0 s1"
    assert timeline._label(narrow, 100, full=False) == "F0"
    assert timeline._label(narrow, 5, full=False) is None


def test_microbatched_actions_carry_stage_and_microbatch(tmp_path):
    """One rank, 2 microbatches (the pipeline runner): actions F0 s0, F1 s0, B.. with their
    args; the optimizer follows; the PNG labels them and its legend has no weight grad."""
    torch.manual_seed(0)
    batch = M.gpt_batch(CFG, 4)
    pm = fxpar.parallelize(M.GPT(CFG), 1, example_batch=batch,
                           plan={"dp": 1, "tp": 1, "pp": 1, "microbatches": 2})
    for _ in range(2):
        pm.step(batch)
    path = pm.trace(str(tmp_path / "mb.json"))
    events = json.load(open(path))["traceEvents"]
    _check_actions(events, {(0, 0)})
    for _, spans in _steps(events):
        assert spans[-1]["cat"] == "optimizer"
        assert [e["name"] for e in spans if "microbatch" in e.get("args", {})] == [
            "F0 s0", "B0 s0", "F1 s0", "B1 s0"]
    spans, _, _ = timeline.last_spans(events)
    labels = [h.get_label() for h in timeline.legend_handles(spans)]
    assert "weight grad" not in labels and labels[:2] == ["forward", "backward"]
    assert timeline.plot_timeline(path, str(tmp_path / "mb.png"))


@pytest.mark.slow
def test_two_ranks_pipeline_and_data_parallel(tmp_path):
    """On 2 ranks (~13 s). pp=2, 2 microbatches: each rank's stage computations with their
    args, transfers as comm events with bytes, the PNG drawn. dp=2: forward, backward, the
    gradient bucket's packing, optimizer, in that order; the all-reduce on the comm track."""
    from workers import timeline_rank
    pp, dp = str(tmp_path / "pp.json"), str(tmp_path / "dp.json")
    fxpar.launch(timeline_rank, 2, [(pp, {"dp": 1, "tp": 1, "pp": 2, "microbatches": 2}),
                                    (dp, {"dp": 2, "tp": 1, "pp": 1})])
    events = json.load(open(pp))["traceEvents"]
    _check_actions(events, {(0, 0), (1, 1)})
    comm_ev = [e for e in events if on_track(e, COMM)]
    assert comm_ev and all(e["cat"] == "comm" and e["args"]["bytes"] > 0 for e in comm_ev)
    spans, _, _ = timeline.last_spans(events)
    labels = {h.get_label() for h in timeline.legend_handles(spans)}
    assert {"forward", "backward", "comm"} <= labels and "weight grad" not in labels
    assert timeline.plot_timeline(pp, str(tmp_path / "pp.png"))

    events = json.load(open(dp))["traceEvents"]
    for pid in (0, 1):
        for _, spans in _steps(events, pid):
            order = [c for c in (e["cat"] for e in spans) if c != "blocked"]
            order = [c for i, c in enumerate(order) if i == 0 or c != order[i - 1]]
            assert order[0] == "forward" and order[-3:] == ["backward", "packing", "optimizer"]
    assert any(e["name"].startswith("all_reduce") for e in events if on_track(e, COMM))
