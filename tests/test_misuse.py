"""Misuse of collective methods fails fast on every rank (runtime/calls.py), and fxpar.launch
runs functions a notebook or script defines and reports a rank's real exception first."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

import fxpar

pytestmark = pytest.mark.slow  # each test spawns ranks


@pytest.mark.parametrize("plan", ["auto", {"pp": 2}])
def test_collective_called_on_one_rank_fails_fast_on_every_rank(plan):
    """Rank 0 evaluates alone while rank 1 goes on training: both raise at once, naming
    both calls (before the fix rank 0 returned a wrong loss, rank 1 then died). In a
    pipeline the step checks at its first transfer (the first stage's forward runs first)."""
    from workers import misuse_rank
    t0 = time.time()
    got = fxpar.launch(misuse_rank, 2, "evaluate", plan)
    assert time.time() - t0 < 60
    for rank, msg in got.items():
        assert msg is not None, f"rank {rank} got no error"
        assert "rank 0: pm.evaluate" in msg and "rank 1: pm.step" in msg, msg
        assert "call each on every rank" in msg, msg


def test_collective_called_after_a_peer_ended_fails_fast():
    """Rank 0 gathers the state alone and rank 1's program ends: not a wait for the timeout
    (600 s) but an error at once, on rank 0 (returned here) and on rank 1 (launch raises)."""
    from workers import misuse_rank
    t0 = time.time()
    with pytest.raises(fxpar.FxparError) as e:
        fxpar.launch(misuse_rank, 2, "full_state_dict")
    assert time.time() - t0 < 60
    msg = str(e.value).splitlines()[0]
    assert msg.startswith("rank 1 failed") and "CollectiveMisuse" in msg, msg
    assert "rank 0: pm.full_state_dict" in msg and "rank 1: its program ended" in msg, msg


def test_launch_puts_the_ranks_exception_first():
    from workers import failing_rank
    with pytest.raises(fxpar.FxparError) as e:
        fxpar.launch(failing_rank, 2, 1, 2)
    first = str(e.value).splitlines()[0]
    assert first.startswith("rank 1 failed") and "RuntimeError: injected failure at step 2" \
        in first, first
    assert "rank 1's traceback" in str(e.value) and "failing_rank" in str(e.value)


def _run_script(tmp_path, code, args=()):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, *(args or [str(script)])], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, FXPAR_DEVICE="cpu"))


NOTEBOOK = """
import torch, fxpar
def double(x):                       # defined in __main__, as in a notebook cell
    return (torch.ones(1) * x * 2).item()
print("result", fxpar.launch(double, 2, 21))
"""


def test_launch_runs_functions_defined_in_main(tmp_path):
    # an unguarded script (ranks must not re-run its top level) and `python -c` (no file)
    for args in ((), ("-c", NOTEBOOK)):
        r = _run_script(tmp_path, NOTEBOOK, args)
        assert r.returncode == 0 and "result {0: 42.0, 1: 42.0}" in r.stdout, r.stderr[-3000:]


def test_ranks_given_different_plans_or_choosing_differently_get_one_clear_error():
    """Ranks that compile different programs would hang in their first collective (a store
    timeout two minutes later): different plan arguments, or planners whose choices differ,
    raise a PlanError on every rank naming both instead."""
    from workers import differing_plans_rank
    t0 = time.time()
    got = fxpar.launch(differing_plans_rank, 2, False)
    assert time.time() - t0 < 60
    for msg in got.values():
        assert msg is not None and "different plan: {'dp': 2} vs {'pp': 2}" in msg, msg
    got = fxpar.launch(differing_plans_rank, 2, True)
    for msg in got.values():
        assert msg is not None and "chose different plans" in msg, msg
