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
    into the same model and continues."""
    saved = fxpar.launch(workers.resume_save_rank, 4, RESUME_CASES, str(tmp_path))[0]
    loads = [("dp", ["dp"], "mlp_dropout", RESUME_CASES[0][2]),
             ("pp", ["pp"], "gpt", RESUME_CASES[1][2]),
             ("tp", ["pp", "tp"], "gpt", RESUME_CASES[2][2])]
    resumed = fxpar.launch(workers.resume_load_rank, 4, loads, str(tmp_path))[0]
    k = workers.SAVE_AT
    for case, _, _ in RESUME_CASES:  # same plan: steps 6-10 bit-identical
        ref_losses, _, ref_final = saved[case]
        losses, _, final, extra, start = resumed[(case, case)]
        assert start == k and extra["case"] == case and int(extra["seen"]) == k - 1
        assert torch.equal(losses, ref_losses[k:]), (case, losses, ref_losses[k:])
        assert all(torch.equal(final[n], ref_final[n]) for n in ref_final), case
    # resharded: dp2 x pp2 -> tp2 x dp2 (ZeRO-1): the next step equals the saved run's next step
    ref_losses, ref_next, _ = saved["pp"]
    losses, after_next, _, _, _ = resumed[("tp", "pp")]
    torch.testing.assert_close(losses[0], ref_losses[k], rtol=1e-6, atol=0)
    for n, v in ref_next.items():
        torch.testing.assert_close(after_next[n], v, rtol=1e-6, atol=1e-7, msg=n)
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
