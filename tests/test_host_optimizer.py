"""Optimizer offload (Plan.offload_optimizer, runtime/host_optimizer.py): the optimizer steps
host copies of this rank's tensors. Checked here on one process: a step through the host
copies equals the same optimizer stepping the tensors themselves; a parallelized model trains
as eager does; a checkpoint loaded into an offloaded model (or saved from one) continues the
run, so the host copies follow a load; the plan errors. Multi-process parity under dp, ZeRO,
pp and tp: tests/test_parity.py::test_offload_optimizer_equals_single_process."""
import pytest
import torch

import fxpar
from fxpar.core.errors import PlanError
from fxpar.runtime.host_optimizer import HostOptimizer
from fxpar.runtime.optim import apply_gradients

from workers import OPTIMIZERS, build, eager_reference, fxpar_train

pytestmark = pytest.mark.filterwarnings("ignore:Plan.offload_optimizer on a CPU device")


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_a_step_through_host_copies_equals_the_optimizer_on_the_tensors(opt_name):
    torch.manual_seed(0)
    ref = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2)]
    dev = [t.clone() for t in ref]
    ref_opt = OPTIMIZERS[opt_name](ref)
    host = HostOptimizer(OPTIMIZERS[opt_name], dev, torch.device("cpu"))
    for step in range(3):
        grads = [torch.randn_like(t) for t in ref]
        grads[1] = None if step == 1 else grads[1]  # a tensor without a gradient is not moved
        apply_gradients(ref_opt, ref, grads)
        apply_gradients(host, dev, grads)
        assert all(torch.equal(a, b) for a, b in zip(ref, dev)), step
    # the state is the host copies', none of it on the device tensors' storage
    assert set(map(id, host.optimizer.state)) == set(map(id, host.masters))
    assert not {m.untyped_storage().data_ptr() for m in host.masters} & \
        {t.untyped_storage().data_ptr() for t in dev}
    assert host.master_of(dev[0]) is host.masters[0] and host.state_bytes() > 0
    assert host.stats["bytes_out"] == sum(t.numel() * 4 for t in dev)
    with torch.no_grad():  # written from outside the step: pull brings the copies along
        dev[0].add_(1.0)
    host.pull()
    assert torch.equal(host.masters[0], dev[0])


def test_one_device_trains_as_eager_with_the_state_on_host_copies():
    info = {}
    losses, state = fxpar_train("gpt", "adamw", 1, plan={"offload_optimizer": True}, info=info)
    ref_losses, ref_state = eager_reference("gpt", "adamw")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                               atol=1e-6)
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-5, msg=k)
    off = info["offloaded"]
    assert off["steps_masters"] and off["state_bytes"] > 0 and off["bytes_out"] > 0


def _pm(offload):
    model, batch_fn, loss_fn = build("mlp")
    return fxpar.parallelize(model, 1, example_batch=batch_fn(0), loss_fn=loss_fn,
                             optimizer=OPTIMIZERS["adamw"],
                             plan={"offload_optimizer": offload}), batch_fn


@pytest.mark.parametrize("saved,loaded", [(False, True), (True, False)])
def test_a_checkpoint_continues_the_run_across_offloading(tmp_path, saved, loaded):
    """Saved with or without offloading, loaded into a model with the other setting: the
    steps after the load equal the uninterrupted run's (to the fused CPU kernel's rounding
    the offloaded optimizer uses) - the host copies take the loaded weights and state."""
    pm, batch_fn = _pm(saved)
    ref = []
    for s in range(6):
        ref.append(pm.step(batch_fn(s)))
        if pm.step_count == 3:
            pm.save(tmp_path / "c")
    pm2, _ = _pm(loaded)
    pm2.load(tmp_path / "c")
    got = [pm2.step(batch_fn(s)) for s in range(3, 6)]
    torch.testing.assert_close(torch.stack(got), torch.stack(ref[3:]), rtol=1e-6, atol=0)
    a, b = pm.full_state_dict(), pm2.full_state_dict()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-7, msg=k)


def test_frozen_parameters_get_no_host_copy_and_a_replaced_optimizer_is_used():
    """A frozen layer (a LoRA base, a frozen embedding) is never stepped: no host copy or
    gradient buffer for it; training matches eager. A pm.optimizer the user replaced steps
    instead of the host copies' one."""
    def build_frozen():
        model, batch_fn, loss_fn = build("mlp")
        next(model.parameters()).requires_grad_(False)
        return model, batch_fn, loss_fn
    model, batch_fn, loss_fn = build_frozen()
    pm = fxpar.parallelize(model, 1, example_batch=batch_fn(0), loss_fn=loss_fn,
                           optimizer=OPTIMIZERS["adamw"], plan={"offload_optimizer": True})
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(pm.host_optimizer.masters) == len(trainable) < len(list(model.parameters()))
    got = [pm.step(batch_fn(s)).item() for s in range(3)]
    ref_model, _, _ = build_frozen()
    opt = OPTIMIZERS["adamw"](ref_model.parameters())
    want = []
    for s in range(3):
        opt.zero_grad()
        loss = ref_model(batch_fn(s)) if loss_fn is None else loss_fn(ref_model, batch_fn(s))
        loss.backward()
        opt.step()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-7)
    pm.optimizer = torch.optim.SGD([p for p in pm.params if p.requires_grad], lr=0.1)
    before = [m.clone() for m in pm.host_optimizer.masters]
    w = [p.detach().clone() for p in pm.params]
    pm.step(batch_fn(3))
    assert any(not torch.equal(a, p) for a, p in zip(w, pm.params))  # SGD stepped them
    assert all(torch.equal(a, m) for a, m in zip(before, pm.host_optimizer.masters))


def test_a_sparse_gradient_is_refused_by_name():
    t = torch.zeros(4, 3)
    host = HostOptimizer(OPTIMIZERS["sgd"], [t], torch.device("cpu"))
    t.grad = torch.sparse_coo_tensor([[1]], torch.ones(1, 3), (4, 3))
    with pytest.raises(PlanError, match="sparse"):
        host.step()


def test_offload_optimizer_needs_a_factory_and_a_bool():
    model, batch_fn, loss_fn = build("mlp")
    with pytest.raises(PlanError, match="pass a factory"):
        fxpar.parallelize(model, 1, example_batch=batch_fn(0), loss_fn=loss_fn,
                          optimizer=torch.optim.AdamW(model.parameters()),
                          plan={"offload_optimizer": True})
    with pytest.raises(PlanError, match="True or False"):
        fxpar.Plan(dp=1, tp=1, pp=1, offload_optimizer="yes").validate(1)


def test_one_gpu_under_auto_puts_the_optimizer_state_on_the_host_only_where_it_must(
        monkeypatch):
    """plan="auto" on one device has no planner: the state goes to the host where params +
    grads + AdamW's moments exceed 90% of a GPU's memory and params + grads do not; never on
    a CPU device, with an optimizer instance, or where the model fits as it is."""
    from fxpar.api.parallelize import optimizer_state_needs_host
    model, _, _ = build("gpt")
    p_bytes = sum(p.numel() * 4 for p in model.parameters())
    adamw = OPTIMIZERS["adamw"]
    cuda = torch.device("cuda")  # (FXPAR_MEMORY_PER_DEVICE: no GPU is asked)
    for gib_per_p, want in ((3.0, True), (5.0, False), (1.5, False)):
        monkeypatch.setenv("FXPAR_MEMORY_PER_DEVICE", str(gib_per_p * p_bytes / 0.9 / 2**30))
        assert optimizer_state_needs_host(model, adamw, cuda) is want, gib_per_p
    monkeypatch.setenv("FXPAR_MEMORY_PER_DEVICE", str(3.0 * p_bytes / 0.9 / 2**30))
    assert not optimizer_state_needs_host(model, adamw, torch.device("cpu"))
    assert not optimizer_state_needs_host(model, adamw(model.parameters()), cuda)
    monkeypatch.setenv("FXPAR_MEMORY_PER_DEVICE", str(3.5 * p_bytes / 0.9 / 2**30))
    assert optimizer_state_needs_host(model, adamw, cuda)  # 2 moments: 4 p over 3.5 p
    assert not optimizer_state_needs_host(model, OPTIMIZERS["sgd"], cuda)  # momentum: 3 p
