"""A model whose state dict its own hooks compute (runtime/model_state.py).

HookedGPT's attention holds one fused, interleaved `wqkv` and saves `wq/wk/wv` through a
state-dict post hook (torchtitan's FusedQKVLinear does this). full_state_dict, save_pretrained
and save must equal the single-process model's `state_dict()` under every plan: built by
tensor identity from a sharded module, these entries come out as a tp slice, a stale copy of
another pipeline stage's weight, or an IndexError on an empty ZeRO-3 shard."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import fxpar
from fxpar.examples import models as M
from fxpar.runtime import checkpoint as ck
from fxpar.runtime import model_state

import workers
from workers import OPTIMIZERS, build, eager_reference

PLANS = [{"tp": 2}, {"pp": 2, "microbatches": 2}, {"dp": 2, "zero": 3}]


def test_is_plain_tells_hooked_state_dicts_apart():
    def meta(model):
        return {n: torch.empty(t.shape, dtype=t.dtype, device="meta")
                for n, t in model_state.own_tensors(model).items()}
    gpt, hooked = M.GPT(), M.HookedGPT()
    assert model_state.is_plain(gpt, meta(gpt))  # tied lm_head / wte: still its own tensors
    assert not model_state.is_plain(hooked, meta(hooked))


def test_holding_puts_the_modules_tensors_back():
    model = M.HookedGPT()
    before = {n: t for n, t in model_state.own_tensors(model).items()}
    whole = {n: torch.zeros_like(t) for n, t in before.items()}
    with model_state.holding(model, whole) as held:
        assert all(torch.equal(t, torch.zeros_like(t)) for t in held.values())
        assert isinstance(model.layers[0]["qkv"].wqkv.weight, torch.nn.Parameter)
    assert all(model_state.own_tensors(model)[n] is t for n, t in before.items())


def test_state_dict_of_and_its_inverse_run_the_models_hooks():
    model = M.HookedGPT()
    ref = model.state_dict()
    assert "layers.0.qkv.wq.weight" in ref and "layers.0.qkv.wqkv.weight" not in ref
    whole = {n: t.detach().clone() for n, t in model_state.own_tensors(model).items()}
    got = model_state.state_dict_of(model, whole)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    own = model_state.own_tensors(model, persistent_only=True)
    back = model_state.whole_from_state_dict(model, ref, {n: t.shape for n, t in own.items()},
                                             {n: t.dtype for n, t in own.items()}, "cpu")
    assert all(torch.equal(back[n], t) for n, t in own.items())


@pytest.mark.slow  # (make test's 6 minutes)
def test_one_device_state_dict_save_pretrained_and_resume_match_eager(tmp_path):
    """devices=1: full_state_dict has the hooks' keys and eager's values; save_pretrained
    writes them; a DCP checkpoint resumes into a new model bit for bit and load_plain fills a
    plain model; weights= loads the saved file into a meta-device model through its hooks,
    and names a missing entry."""
    ref_losses, ref = eager_reference("hooked_gpt", "adamw", steps=3)
    model, batch_fn, _ = build("hooked_gpt")
    pm = fxpar.parallelize(model, 1, example_batch=batch_fn(0), optimizer=OPTIMIZERS["adamw"],
                           plan={})
    losses = [pm.step(batch_fn(s)).item() for s in range(3)]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    state = pm.full_state_dict()
    assert state.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(state[k], ref[k], rtol=1e-5, atol=1e-6)
    pm.save_pretrained(str(tmp_path / "hf"))
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert saved.keys() == ref.keys()
    assert all(torch.equal(saved[k], state[k]) for k in ref)
    pm.save(str(tmp_path / "ck"))
    next_loss = pm.step(batch_fn(3))
    model2, _, _ = build("hooked_gpt")
    pm2 = fxpar.parallelize(model2, 1, example_batch=batch_fn(0), optimizer=OPTIMIZERS["adamw"],
                            plan={})
    pm2.load(str(tmp_path / "ck"))
    assert torch.equal(pm2.step(batch_fn(3)), next_loss)
    plain, _ = ck.load_plain(str(tmp_path / "ck"), model=M.HookedGPT())
    assert plain.keys() == ref.keys() and all(torch.equal(plain[k], state[k]) for k in ref)
    # weights= reads the saved wq/wk/wv into a meta-device model through its load hook
    with torch.device("meta"):
        meta_model = M.HookedGPT()
    pm3 = fxpar.parallelize(meta_model, 1, example_batch=batch_fn(0), plan={},
                            weights=str(tmp_path / "hf"))
    got = pm3.full_state_dict()
    assert all(torch.equal(got[k], state[k]) for k in ref)
    os.remove(tmp_path / "hf" / "model.safetensors")
    save_file({k: v for k, v in saved.items() if k != "layers.1.qkv.wk.weight"},
              str(tmp_path / "hf" / "model.safetensors"))
    with torch.device("meta"):
        meta_model = M.HookedGPT()
    with pytest.raises(fxpar.CheckpointError, match="has no 'layers.1.qkv.wk.weight'"):
        fxpar.parallelize(meta_model, 1, example_batch=batch_fn(0), plan={},
                          weights=str(tmp_path / "hf"))


def hooked_rank(root):
    """Every rank: train hooked_gpt 3 steps under each plan, then full_state_dict,
    save_pretrained and save; the ZeRO-3 checkpoint is loaded under tp=2 and steps once.
    Rank 0 returns {plan: state}, the files' tensors, and the resumed run's results."""
    rank = int(os.environ["RANK"])
    out = {}
    for plan in PLANS:
        model, batch_fn, _ = build("hooked_gpt")
        pm = fxpar.parallelize(model, 2, example_batch=batch_fn(0),
                               optimizer=OPTIMIZERS["adamw"], plan=plan)
        for s in range(3):
            pm.step(batch_fn(s))
        state = pm.full_state_dict()
        d = os.path.join(root, "_".join(f"{k}{v}" for k, v in plan.items()))
        pm.save_pretrained(d + "_hf")
        pm.save(d + "_ck")
        if rank == 0:
            files = {}
            for f in os.listdir(d + "_hf"):
                if f.endswith(".safetensors"):
                    files.update(load_file(os.path.join(d + "_hf", f)))
            out[repr(plan)] = (state, files)
    model, batch_fn, _ = build("hooked_gpt")
    pm = fxpar.parallelize(model, 2, example_batch=batch_fn(0), optimizer=OPTIMIZERS["adamw"],
                           plan={"tp": 2})
    pm.load(os.path.join(root, "dp2_zero3_ck"))
    loaded = pm.full_state_dict()
    loss = pm.step(batch_fn(3)).item()
    if rank == 0:
        out["resumed"] = (loaded, loss)
        return out
    return None


@pytest.mark.slow
def test_state_dict_with_hooks_equals_single_process_under_every_plan(tmp_path):
    """tp=2, pp=2 m=2, dp=2 ZeRO-3 on 2 ranks: full_state_dict and save_pretrained's files
    equal eager's `state_dict()` (the hooks' wq/wk/wv); a ZeRO-3 checkpoint loads at tp=2
    and takes eager's fourth step."""
    ref_losses, ref = eager_reference("hooked_gpt", "adamw", steps=3)
    ref4_losses, _ = eager_reference("hooked_gpt", "adamw", steps=4)
    out = fxpar.launch(hooked_rank, 2, str(tmp_path))[0]
    for plan in PLANS:
        state, files = out[repr(plan)]
        for got in (state, files):
            assert got.keys() == ref.keys(), (plan, set(got) ^ set(ref))
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{plan} {k}: {m}")
    loaded, loss = out["resumed"]
    for k in ref:
        torch.testing.assert_close(loaded[k], ref[k], rtol=1e-5, atol=1e-6)
    assert loss == pytest.approx(ref4_losses[3], rel=1e-5)
    index = json.loads(open(tmp_path / "tp2_ck" / "fxpar.json").read())
    assert index["step_count"] == 3


class TiedHookedGPT(M.HookedGPT):
    """HookedGPT with its head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.out.weight = self.tok.weight


def test_weights_of_a_hooked_model_with_one_copy_of_a_tied_weight(tmp_path):
    """transformers' and safetensors' saves keep one of tied names: weights= reads the
    other's entry for it (was: CheckpointError, the file "has no 'out.weight'")."""
    torch.manual_seed(0)
    model = TiedHookedGPT()
    ref = model.state_dict()
    save_file({k: v.contiguous() for k, v in ref.items() if k != "out.weight"},
              str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        meta_model = TiedHookedGPT()
    batch = M.gpt_batch(M.GPTConfig(), 8)
    pm = fxpar.parallelize(meta_model, 1, example_batch=batch, plan={},
                           weights=str(tmp_path / "model.safetensors"))
    got = pm.full_state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert pm.model.out.weight is pm.model.tok.weight
