"""The external zoo (examples/external_zoo.py): torchtitan's, timm's, litgpt's and nanoGPT's own
model code under every plan against eager PyTorch, by the zoo's sweep (examples/zoo_sweep.py)
at its tolerances. Each cell is exact, or the refusal REFUSED lists for it, or "rounding" by
the sweep's controls for a cell ROUNDING lists, or the known defect BUGS lists (xfail while it
fails); a model whose library is not installed skips, naming it (scripts/setup.sh installs
pyproject's `zoo` extra).
The table is docs/external_zoo.md."""
import dataclasses
import re

import pytest
import torch

from fxpar.examples import external_zoo, zoo_sweep

# (model, plan column) -> regex of the refusal: fxpar declining a plan on purpose; the cell
# must be that refusal.
TITAN_MOES = ("titan_deepseek_v3", "titan_qwen3_moe", "titan_kimi_k2")
BN_MODELS = ("timm_resnet", "timm_efficientnet", "timm_mobilenetv3")
REFUSED = {
    # timm's BatchNorm running statistics would be updated once per microbatch
    **{(m, "pp=2 m=2"): "update the buffers .*running_mean" for m in BN_MODELS},
}
# models whose cells may be "rounding" (zoo_sweep's controls: eager from weights one ulp
# apart differs from eager as much, or Plan.verify passes the first step). BatchNorm's
# statistics as sums over a split batch (no order is eager's) behind zero-initialised
# scales; torchtitan's experts run in bf16 inside the fp32 model, so an fp32 reordering
# upstream (tp's split sums in attention, dp's gradient sum) flips bf16 roundings and the
# router's near-ties, which AdamW turns into lr-sized moves. One device runs eager's own
# BatchNorm kernels and is exact.
# Their controls are wide (router flips, lr-sized moves of near-zero gradients): those cells
# check the losses and each tensor's spread against eager's own, not 1e-5.
ROUNDING = {(m, p) for m in (*TITAN_MOES, *BN_MODELS)
            for p in ("dp=2", "tp=2", "pp=2 m=2", "dp=2 zero=3", "auto (2)")}
# (model, plan column) -> (status, regex of the detail, why): known defects, reported while
# they are looked at (the cell may be that failure, reported as xfail, or pass). None known.
BUGS: dict[tuple[str, str], tuple[str, str, str]] = {}

# in `make test`: timm's ViT on one device, and nanoGPT (vendored, no heavy import in the
# spawned ranks) under one 2-rank plan (litgpt's import alone takes ~11 s)
FAST = [("timm_vit", "1 device"), ("nanogpt", "dp=2")]

def _check(cells):
    known = []
    for c in cells:
        if c.status == "skipped":
            pytest.skip(c.detail)
        why = REFUSED.get((c.model, c.plan))
        bug = BUGS.get((c.model, c.plan))
        if why is not None:
            assert c.status == "refused" and re.search(why, c.detail), \
                f"{c.model} under {c.plan}: expected a refusal ({why}), got {c.status}: {c.detail}"
        elif c.status == "rounding" and (c.model, c.plan) in ROUNDING:
            continue
        elif c.status != "exact":
            assert bug is not None and c.status == bug[0] and re.search(bug[1], c.detail), \
                f"{c.model} under {c.plan}: {c.status}: {c.detail}"
            known.append(f"{c.plan}: {bug[2]}")
    if known:
        pytest.xfail("known: " + "; ".join(known))


@pytest.mark.parametrize("name,plan", FAST)
@pytest.mark.slow  # (make test's 6 minutes)
def test_external_model(name, plan):
    _check(zoo_sweep.sweep_model(name, [plan]))


# every model under every plan (one eager reference, one device, then one 2-rank launch for
# the five 2-rank plans; docs/external_zoo.md's table) in `make test-full` (about 20 minutes
# on 2 cores; torchtitan's Qwen 3 MoE alone 1.5 minutes): CI runs FAST's two cells
EXTERNAL_PLANS = [k for k in zoo_sweep.PLANS if k not in zoo_sweep.DROPOUT]


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("name", list(external_zoo.models()))
def test_external_model_under_every_plan(name):
    """Each library's own model code (state-dict hooks under tp and ZeRO-3, pipelines cut
    through each library's blocks, MoE dispatch by grouped matmuls and by torch.where,
    BatchNorm) under every plan against eager PyTorch."""
    _check(zoo_sweep.sweep_model(name, EXTERNAL_PLANS))


def test_the_fast_selection_names_real_cells():
    assert all(n in external_zoo.models() and p in EXTERNAL_PLANS for n, p in FAST)


def test_a_missing_library_skips_the_model_and_says_which(monkeypatch):
    spec = dataclasses.replace(external_zoo.models()["timm_vit"], requires=("no_such_module_x",))
    monkeypatch.setattr(external_zoo, "models", lambda: {"timm_vit": spec})
    why = external_zoo.missing(external_zoo.models()["timm_vit"])
    assert "timm is not installed" in why and "no_such_module_x" in why
    cells = zoo_sweep.sweep_model("timm_vit", ["1 device", "dp=2"])
    assert [c.status for c in cells] == ["skipped", "skipped"] and cells[0].detail == why


def test_timm_imports_without_torchvision_and_leaves_no_stand_in():
    if external_zoo.missing(external_zoo.models()["timm_vit"]):
        pytest.skip("timm is not installed")
    import importlib.util
    import sys
    timm = external_zoo.import_timm()
    assert hasattr(timm, "create_model")
    if importlib.util.find_spec("torchvision") is None:  # the stand-in was used and removed
        assert not [n for n in sys.modules if n.split(".")[0] == "torchvision"]


def test_the_external_zoo_covers_what_it_promises():
    libs = [m.library for m in external_zoo.models().values()]
    assert libs.count("torchtitan") >= 3 and libs.count("timm") >= 6
    assert libs.count("litgpt") >= 3 and any(lib.startswith("nanoGPT") for lib in libs)
    for m in external_zoo.models().values():
        assert m.loss_fn is not None and m.requires
        b = m.batch(0)
        assert all(isinstance(v, torch.Tensor) and v.shape[0] == 8 for v in b.values())
