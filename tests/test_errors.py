"""Bad input gets a clear exception; a failing rank ends every rank, never a hang."""
import os
import subprocess
import sys
import time

import pytest
import torch

import fxpar
from fxpar.examples import models as M


def _mlp():
    return M.MLP(), (torch.randn(8, 16), torch.randn(8, 4))


def test_world_size_must_match_plan():
    model, batch = _mlp()
    with pytest.raises(fxpar.PlanError, match="world size 1 does not match the plan"):
        fxpar.parallelize(model, 1, example_batch=batch, plan={"dp": 2})


def test_unknown_plan_field():
    model, batch = _mlp()
    with pytest.raises(fxpar.PlanError, match=r"unknown Plan field\(s\) \['dpp'\]"):
        fxpar.parallelize(model, 1, example_batch=batch, plan={"dpp": 1})


def test_unimplemented_plan_feature_is_refused_not_ignored():
    with pytest.raises(fxpar.PlanError, match="does not implement zero=3 with tp=2"):
        fxpar.Plan(dp=1, tp=2, pp=1, zero=3).validate(2)


def test_multi_rank_devices_without_launcher():
    model, batch = _mlp()
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    code = ("import torch, fxpar; from fxpar.examples.models import MLP\n"
            "fxpar.parallelize(MLP(), 2, example_batch=(torch.randn(8,16), torch.randn(8,4)))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "torchrun --nproc-per-node 2" in r.stderr


def test_loss_fn_returning_non_scalar():
    model, batch = _mlp()
    with pytest.raises(fxpar.TraceError, match="scalar"):
        fxpar.parallelize(model, 1, example_batch=batch,
                          loss_fn=lambda m, b: (m.fc3(m.fc1(b[0]).relu() @ m.fc2.weight) ** 2))


def test_step_batch_structure_must_match_example():
    model, batch = _mlp()
    pm = fxpar.parallelize(model, 1, example_batch=batch)
    with pytest.raises(fxpar.BatchError, match="structure"):
        pm.step({"x": batch[0], "y": batch[1]})
    with pytest.raises(fxpar.BatchError, match="example_batch had"):
        pm.step((torch.randn(4, 16), torch.randn(4, 4)))


def test_untraceable_model_via_parallelize():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.fc(x).mean() if self.fc(x).sum().item() > 0 else self.fc(x).sum()

    with pytest.raises(fxpar.TraceError, match="data-dependent"):
        fxpar.parallelize(Bad(), 1, example_batch=torch.randn(2, 4))


@pytest.mark.slow
def test_launch_reports_failing_rank():
    from workers import failing_rank
    with pytest.raises(fxpar.FxparError, match=r"rank 1 failed.*injected failure at step 2"):
        fxpar.launch(failing_rank, 2, 1, 2)


@pytest.mark.slow
def test_rank_raising_mid_step_ends_all_ranks_without_hang(tmp_path):
    """Raw processes (no elastic agent watching them): the survivor's collective must fail
    on its own, within the group timeout, with a non-zero exit."""
    timeout_s = 30
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               FXPAR_TIMEOUT=str(timeout_s), FXPAR_DEVICE="cpu")
    tests_dir = os.path.dirname(__file__)
    code = (f"import sys; sys.path.insert(0, {tests_dir!r}); from workers import failing_rank; "
            "failing_rank(1, 2)")
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(r),
                              LOCAL_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(2)]
    codes = [p.wait(timeout=timeout_s + 90) for p in procs]
    assert all(c != 0 for c in codes), codes
    assert time.time() - t0 < timeout_s + 90
    assert b"injected failure at step 2" in procs[1].stderr.read()


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_zero_refuses_an_optimizer_instance():
    from workers import zero_with_optimizer_instance
    with pytest.raises(fxpar.runtime.dist.LaunchError, match="pass a factory"):
        fxpar.launch(zero_with_optimizer_instance, 2)
