"""Checkpoints (runtime/checkpoint.py): pm.save / pm.load with torch DCP, plan-independent.

Slow tests run real gloo processes: the uninterrupted run saves at step 5; new processes load
it and continue: steps 6-10 bit-identical for dp (ZeRO-2, with dropout: the RNG state is
restored), pp and tp plans; a dp=2 x pp=2 checkpoint loaded at tp=2 x dp=2
(ZeRO-1) and into plain single-process PyTorch takes the same next step (rtol 1e-6, AdamW
moments included)."""
import json
import os
import pickle

import pytest
import torch

import fxpar
from fxpar.runtime import checkpoint as ck

import workers
from workers import OPTIMIZERS, build


def _pm(name="mlp", plan=None):
    model, batch_fn, loss_fn = build(name)
    pm = fxpar.parallelize(model, 1, example_batch=batch_fn(0), loss_fn=loss_fn,
                           optimizer=OPTIMIZERS["adamw"], plan={"fuse": False, **(plan or {})})
    return pm, batch_fn


def test_resume_single_process_bit_identical(tmp_path):
    """devices=1 (no process group): save at 5, a new model loads and continues: identical,
    dropout masks included (RNG restored); extra and step_count come back."""
    for name in ("mlp", "mlp_dropout"):
        pm, batch_fn = _pm(name)
        torch.manual_seed(99)
        ref = []
        for s in range(8):
            ref.append(pm.step(batch_fn(s)))
            if pm.step_count == 5:
                pm.save(tmp_path / name, extra={"epoch": 2, "order": torch.arange(4), "t": (1, "a")})
        pm2, _ = _pm(name)
        torch.manual_seed(0)
        extra = pm2.load(tmp_path / name)
        assert pm2.step_count == 5
        assert extra["epoch"] == 2 and extra["t"] == (1, "a")
        assert torch.equal(extra["order"], torch.arange(4))
        got = [pm2.step(batch_fn(s)) for s in range(5, 8)]
        assert all(torch.equal(a, b) for a, b in zip(ref[5:], got)), (ref[5:], got)
        a, b = pm.full_state_dict(), pm2.full_state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_layout_is_torch_fqn_convention(tmp_path):
    pm, batch_fn = _pm("mlp")
    pm.step(batch_fn(0))
    pm.save(tmp_path / "c")
    meta, _, md = ck.read_meta(tmp_path / "c")
    names = [n for n, _ in pm.model.named_parameters()]
    assert {f"model.{k}" for k in pm.model.state_dict()} <= set(md)
    assert {f"optim.state.{n}.{k}" for n in names for k in ("exp_avg", "exp_avg_sq", "step")} \
        <= set(md)
    assert meta["step_count"] == 1 and meta["param_groups"][0]["params"] == names
    assert not [k for k, m in md.items() if not hasattr(m, "chunks")]  # tensors only, no pickles
    model_state, optim_state = ck.load_plain(tmp_path / "c")
    assert set(model_state) == set(pm.model.state_dict())
    assert set(optim_state["state"]) == set(names)
    assert optim_state["param_groups"][0]["lr"] == pytest.approx(1e-3)


def test_load_plain_into_plain_pytorch_matches_next_step(tmp_path):
    """fxpar checkpoint -> plain model + AdamW (load_plain): the next eager step equals fxpar's."""
    pm, batch_fn = _pm("mlp")
    for s in range(3):
        pm.step(batch_fn(s))
    pm.save(tmp_path / "c")
    ref_loss = pm.step(batch_fn(3))
    model, _, _ = build("mlp")
    opt = OPTIMIZERS["adamw"](model.parameters())
    ck.load_plain(tmp_path / "c", model=model, optimizer=opt)
    x, y = batch_fn(3)
    loss = model((x, y))
    loss.backward()
    opt.step()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=0)
    for k, v in pm.full_state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-6, atol=1e-7)


def test_bad_checkpoints_are_refused(tmp_path):
    pm, batch_fn = _pm("mlp")
    with pytest.raises(fxpar.CheckpointError, match="not a directory"):
        pm.load(tmp_path / "nothing")
    pm.save(tmp_path / "c")
    os.remove(tmp_path / "c" / "fxpar.json")  # as if the save crashed before finishing
    with pytest.raises(fxpar.CheckpointError, match="incomplete save"):
        pm.load(tmp_path / "c")
    pm.save(tmp_path / "c")
    other, _ = _pm("sum_loss")
    other.model.fc9 = torch.nn.Linear(2, 2)  # not in the checkpoint
    with pytest.raises(fxpar.CheckpointError, match="different model"):
        ck.load(other, tmp_path / "c")
    sgd = fxpar.parallelize(build("mlp")[0], 1, example_batch=batch_fn(0),
                            optimizer=OPTIMIZERS["sgd"], plan={"fuse": False})
    with pytest.raises(fxpar.CheckpointError, match="holds AdamW state, but this model's "
                                                    "optimizer is SGD"):
        sgd.load(tmp_path / "c")
    with pytest.raises(fxpar.CheckpointError, match="JSON values"):
        pm.save(tmp_path / "d", extra={"loader": object()})


def test_metadata_unpickler_refuses_code(tmp_path):
    """DCP reads its .metadata with pickle.load; fxpar's reader resolves only DCP's metadata
    classes, so a crafted file that would run a function is refused, never executed."""
    pm, _ = _pm("mlp")
    pm.save(tmp_path / "c")

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))
    with open(tmp_path / "c" / ".metadata", "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(fxpar.CheckpointError, match="posix.system|os.system|refusing"):
        pm.load(tmp_path / "c")
    assert not (tmp_path / "pwned").exists()


RESUME_CASES = [  # (case, model, plan) at 4 ranks
    ("dp", "mlp_dropout", {"dp": 4, "zero": 2}),
    ("pp", "gpt", {"dp": 2, "pp": 2, "microbatches": 2}),
    ("tp", "gpt", {"dp": 2, "tp": 2, "zero": 1}),
]


@pytest.mark.slow
def test_resume_and_reshard_real_processes(tmp_path):
    """Launch 1 trains each case 10 steps, saving at 5. Launch 2 (new processes): the dp and
    pp cases load their own checkpoint; the tp=2 x dp=2 (ZeRO-1) model first loads the
    dp=2 x pp=2 checkpoint (resharded) and takes the next step, then loads its own checkpoint
    into the same model and continues; the dp=2 x pp=2 plan with the stages outermost on the
    mesh (Plan.pp_outer) loads the dp=2 x pp=2 checkpoint and takes the same next step."""
    saved = fxpar.launch(workers.resume_save_rank, 4, RESUME_CASES, str(tmp_path))[0]
    loads = [("dp", ["dp"], "mlp_dropout", RESUME_CASES[0][2]),
             ("pp", ["pp"], "gpt", RESUME_CASES[1][2]),
             ("tp", ["pp", "tp"], "gpt", RESUME_CASES[2][2]),
             ("pp_outer", ["pp"], "gpt", {**RESUME_CASES[1][2], "pp_outer": True})]
    resumed = fxpar.launch(workers.resume_load_rank, 4, loads, str(tmp_path))[0]
    k = workers.SAVE_AT
    for case, _, _ in RESUME_CASES:  # same plan: steps 6-10 bit-identical
        ref_losses, _, ref_final = saved[case]
        losses, _, final, extra, start = resumed[(case, case)]
        assert start == k and extra["case"] == case and int(extra["seen"]) == k - 1
        assert torch.equal(losses, ref_losses[k:]), (case, losses, ref_losses[k:])
        assert all(torch.equal(final[n], ref_final[n]) for n in ref_final), case
    # resharded: dp2 x pp2 -> tp2 x dp2 (ZeRO-1), and into the mesh's other order (the
    # stages outermost): the next step equals the saved run's next step
    ref_losses, ref_next, _ = saved["pp"]
    for into in ("tp", "pp_outer"):
        losses, after_next, _, _, _ = resumed[(into, "pp")]
        torch.testing.assert_close(losses[0], ref_losses[k], rtol=1e-6, atol=0)
        for n, v in ref_next.items():
            torch.testing.assert_close(after_next[n], v, rtol=1e-6, atol=1e-7, msg=(into, n))
    # and into plain single-process PyTorch (params + AdamW moments from the checkpoint)
    model, batch_fn, _ = build("gpt")
    opt = OPTIMIZERS["adamw"](model.parameters())
    ck.load_plain(tmp_path / "pp", model=model, optimizer=opt)
    assert all(len(opt.state[p]) == 3 for p in model.parameters())
    loss = model(batch_fn(k))
    loss.backward()
    opt.step()
    torch.testing.assert_close(loss.detach(), ref_losses[k], rtol=1e-6, atol=0)
    for n, v in ref_next.items():
        torch.testing.assert_close(model.state_dict()[n], v, rtol=1e-6, atol=1e-7, msg=n)
    assert json.load(open(tmp_path / "pp" / "fxpar.json"))["plan"]["pp"] == 2


def test_fp16_loss_scaler_state_round_trips(tmp_path):
    """precision="fp16": the dynamic loss scale, its growth counter and the skipped steps are
    saved and restored, so a resumed run scales (and skips) exactly as the saved one would."""
    pm, batch_fn = _pm("mlp", {"precision": "fp16"})
    pm.scaler.growth_interval = 2           # make the scale move within a few steps
    for s in range(3):
        pm.step(batch_fn(s))
    pm.scaler.scale /= 4                     # a state the defaults would not give
    saved = pm.scaler.state_dict()
    pm.save(tmp_path / "fp16")
    ref = [pm.step(batch_fn(s)) for s in range(3, 5)]
    pm2, _ = _pm("mlp", {"precision": "fp16"})
    assert pm2.scaler.state_dict() != saved
    pm2.load(tmp_path / "fp16")
    assert pm2.scaler.state_dict() == saved
    got = [pm2.step(batch_fn(s)) for s in range(3, 5)]
    assert pm2.scaler.state_dict() == pm.scaler.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


# --- exact resume: the settings that change the numbers travel with the checkpoint ---------

CLIP = {"max_grad_norm": 0.5}  # the mlp's gradient norm is ~0.8: every step clips


def _train(pm, batch_fn, steps, save_at=None, path=None, sched=None):
    """Losses of `steps` steps from pm.step_count on; saves (with the scheduler's state in
    `extra`, as torch users keep it) after step `save_at`."""
    losses = []
    for s in range(pm.step_count, steps):
        losses.append(pm.step(batch_fn(s)))
        if sched is not None:
            sched.step()
        if pm.step_count == save_at:
            pm.save(path, extra={"sched": sched.state_dict()} if sched is not None else None)
    return losses


def test_resume_under_another_plan_with_the_same_settings_continues_the_run(tmp_path):
    """Saved at microbatches=1, resumed at microbatches=2, both clipping at 0.5: the settings
    match (the microbatch count is not one of them under batch_stats="whole") and the
    resumed steps equal the uninterrupted ones up to the microbatches' summation order."""
    pm, batch_fn = _pm("mlp", CLIP)
    ref = _train(pm, batch_fn, 6, save_at=3, path=tmp_path / "c")
    pm2, _ = _pm("mlp", {**CLIP, "microbatches": 2})
    pm2.load(tmp_path / "c")
    got = _train(pm2, batch_fn, 6)
    torch.testing.assert_close(torch.stack(got), torch.stack(ref[3:]), rtol=1e-6, atol=0)
    a, b = pm.full_state_dict(), pm2.full_state_dict()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-7, msg=k)


def test_resume_under_other_settings_is_refused_naming_them(tmp_path, caplog):
    """The reported case at one process: saved clipping at 0.5, loaded without clipping (and
    in bf16): refused, naming each difference and the fix; allow_changed_settings=True loads
    with a warning. A checkpoint without the record loads with a warning."""
    pm, batch_fn = _pm("mlp", CLIP)
    _train(pm, batch_fn, 2, save_at=2, path=tmp_path / "c")
    assert ck.read_meta(tmp_path / "c")[0]["settings"] == {
        "max_grad_norm": 0.5, "precision": "fp32", "batch_stats": "whole",
        "comm_quantization": "none", "grad_compression": "none"}
    other, _ = _pm("mlp", {"precision": "bf16"})
    with pytest.raises(fxpar.CheckpointError) as e:
        other.load(tmp_path / "c")
    msg = str(e.value)
    assert "max_grad_norm: checkpoint 0.5, this plan None" in msg
    assert "precision: checkpoint 'fp32', this plan 'bf16'" in msg
    assert "allow_changed_settings=True" in msg and "batch_stats" not in msg
    assert other.step_count == 0  # refused before anything was read
    with caplog.at_level("WARNING", logger="fxpar"):
        other.load(tmp_path / "c", allow_changed_settings=True)
    assert other.step_count == 2 and "max_grad_norm: checkpoint 0.5" in caplog.text
    meta_path = tmp_path / "c" / "fxpar.json"
    meta = json.load(open(meta_path))
    del meta["settings"]  # as an older fxpar wrote it
    json.dump(meta, open(meta_path, "w"))
    caplog.clear()
    with caplog.at_level("WARNING", logger="fxpar"):
        other.load(tmp_path / "c")
    assert "records no training settings" in caplog.text


def test_resume_restores_optimizer_hyperparameters_and_scheduler(tmp_path, caplog):
    """The lr a scheduler moved and a weight decay changed in training come back from the
    checkpoint over the ones the new optimizer was built with (torch's load_state_dict does
    the same); the scheduler's own state travels in `extra`. The resumed run is the
    uninterrupted one, bit for bit."""
    pm, batch_fn = _pm("mlp")
    pm.optimizer.param_groups[0]["weight_decay"] = 0.1
    sched = torch.optim.lr_scheduler.StepLR(pm.optimizer, step_size=2, gamma=0.5)
    ref = _train(pm, batch_fn, 6, save_at=3, path=tmp_path / "c", sched=sched)
    pm2, _ = _pm("mlp")  # AdamW(lr=1e-3, weight_decay=0.01)
    sched2 = torch.optim.lr_scheduler.StepLR(pm2.optimizer, step_size=2, gamma=0.5)
    with caplog.at_level("INFO", logger="fxpar"):
        extra = pm2.load(tmp_path / "c")
    sched2.load_state_dict(extra["sched"])
    group = pm2.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(5e-4) and group["weight_decay"] == 0.1
    assert "weight_decay 0.01 -> 0.1" in caplog.text
    got = _train(pm2, batch_fn, 6, sched=sched2)
    assert all(torch.equal(a, b) for a, b in zip(ref[3:], got)), (ref[3:], got)
    assert pm2.optimizer.param_groups[0]["lr"] == pm.optimizer.param_groups[0]["lr"]
    a, b = pm.full_state_dict(), pm2.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
