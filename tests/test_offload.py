"""Activation offloading (Plan.offload, runtime/offload.py): the values a microbatch keeps for
its backward go to host memory while other microbatches run. Checked: results bit-identical to
no offloading, the measured device peak falls by at least the bytes held on host at that
peak, combinations with remat and every pipeline schedule, and the plan errors."""
import pytest
import torch

import fxpar
from fxpar.core.errors import PlanError
from fxpar.runtime.offload import HostStash

import workers


def _check_pair(off, on):
    assert torch.equal(off["losses"], on["losses"])
    assert all(torch.equal(off["params"][k], on["params"][k]) for k in off["params"])
    assert on["stats"]["copies"] > 0
    # the device peak falls by at least what is on host at that moment
    assert off["peak"] - on["peak"] >= on["host_at_peak"]


@pytest.mark.slow  # (make test's 6 minutes)
def test_gradient_accumulation_offload_bit_identical_and_lower_peak():
    base = {"microbatches": 4, "schedule": "gpipe"}
    off, on = workers.offload_rank([base, {**base, "offload": True}], steps=2, layers=3,
                                   embd=32)
    _check_pair(off, on)
    # GPipe over 4 microbatches: 3 of them wait on host during a backward
    assert on["host_at_peak"] >= 0.5 * on["stats"]["bytes_out"]
    assert off["peak"] - on["peak"] >= 0.5 * off["peak"]


def test_host_stash_round_trip_keeps_views_and_strides():
    base = torch.randn(4, 6, 3)
    q, k = base[:, :2].transpose(1, 2), base[:, 2:4]   # two views of one storage
    stash = HostStash(torch.device("cpu"))
    hq, hk = stash.out([q, k])
    assert stash.stats["copies"] == 1 and stash.stats["values"] == 2
    assert stash.stats["bytes_out"] == base.numel() * 4
    q2, k2 = stash.back(hq), stash.back(hk)
    assert torch.equal(q2, q) and q2.stride() == q.stride() and k2.stride() == k.stride()
    assert q2.untyped_storage().data_ptr() == k2.untyped_storage().data_ptr()  # one copy back
    assert stash._host_bytes == 0


def test_offload_without_waiting_microbatches_is_a_plan_error():
    with pytest.raises(PlanError, match="microbatches > 1"):
        fxpar.Plan(dp=1, tp=1, pp=1, offload=True).validate(1)
    with pytest.raises(PlanError, match="True or False"):
        fxpar.Plan(dp=1, tp=1, pp=1, microbatches=2, offload="yes").validate(1)


@pytest.mark.slow
def test_pipeline_offload_every_schedule():
    """pp=2 on 2 ranks: GPipe, 1F1B, zero-bubble (I/W parts read the stash), interleaved
    (two stages per rank), and 1F1B + remat: offloading changes no bit of the result and
    lowers each rank's measured peak by at least the bytes held on host at that peak (the
    peaks leave out the buffers of sends, which are freed when the other rank has received
    them, at a moment that varies from run to run: workers.offload_rank)."""
    cases = [{"pp": 2, "microbatches": 4, "schedule": s} for s in
             ("gpipe", "1f1b", "zero-bubble", "interleaved")] + [
        {"pp": 2, "microbatches": 4, "schedule": "1f1b", "remat": "sqrt"}]
    plans = [p for c in cases for p in (c, {**c, "offload": True})]
    res = fxpar.launch(workers.offload_rank, 2, plans, 2)  # 2 steps: the second is measured
    for rank in (0, 1):
        for i in range(0, len(plans), 2):
            off, on = res[rank][i], res[rank][i + 1]
            assert torch.equal(off["losses"], on["losses"])
            assert all(torch.equal(off["params"][k], on["params"][k]) for k in off["params"])
            assert off["peak"] - on["peak"] >= on["host_at_peak"], (rank, plans[i])
    # the first stage keeps several microbatches under every schedule: it must gain
    for i in range(0, len(plans), 2):
        off, on = res[0][i], res[0][i + 1]
        assert on["stats"]["copies"] > 0 and on["peak"] < off["peak"], plans[i]
    # with remat only the checkpoints are kept, so less goes out
    assert 0 < res[0][-1]["stats"]["bytes_out"] < res[0][3]["stats"]["bytes_out"]
