"""The pass manager orders and checks the passes from their contracts alone (core/ir.PassContract):
which passes a plan runs, in what order, and the refusal of a pass whose required keys nobody
provides, before any graph is touched."""
from __future__ import annotations

import dataclasses

import pytest

from fxpar.compiler.pass_manager import PASSES, _pass_list, order
from fxpar.core import ir
from fxpar.core.errors import PassError
from fxpar.core.plan import Plan, pass_options, resolve

FULL = {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2, "remat": "sqrt", "precision": "bf16"}
DECLARED = {v for k, v in vars(ir).items() if k.isupper() and isinstance(v, str)}


@dataclasses.dataclass(frozen=True)
class _NoOptions:
    pass


def _contract(name, **kw):
    return ir.PassContract(name, _NoOptions, **{k: frozenset(v) for k, v in kw.items()})


def test_the_plan_decides_which_passes_run_and_the_contracts_their_order():
    names = lambda plan, world, **kw: [c.name for c, _, _ in _pass_list(  # noqa: E731
        resolve(plan, world), "cpu", "inductor", **kw)[0]]
    full = ["batched_experts", "grouped_experts", "precision", "remat", "pipeline_split", "tensor_parallel",
            "data_parallel", "overlap", "fusion"]
    assert names(FULL, 8) == full
    # the same list given backwards comes out in the order the contracts require
    assert names(FULL, 8, passes=PASSES[::-1]) == full
    assert names({"dp": 2}, 2) == ["batched_experts", "grouped_experts", "data_parallel",
                                    "overlap", "fusion"]
    assert names({"dp": 1, "fuse": False}, 1) == ["batched_experts", "grouped_experts",
                                                  "data_parallel"]
    # (batched_experts and grouped_experts run where the graph has experts picking their
    # weights per row, or routed by torch.where: ir.finds; under ep too, before expert
    # parallelism splits their stacks, and under tp, which splits each stack's experts alike)
    assert names({"dp": 2, "ep": 2}, 2) == ["batched_experts", "grouped_experts",
                                             "expert_parallel", "data_parallel", "overlap",
                                             "fusion"]
    assert names({"tp": 2}, 2)[:3] == ["batched_experts", "grouped_experts",
                                       "tensor_parallel"]


def test_a_pass_whose_required_key_nobody_provides_is_refused():
    reader = _contract("reader", requires={ir.STAGE})
    with pytest.raises(PassError, match=r"pass reader requires the graph keys \['stage'\]"):
        order([reader])
    # once its provider runs, it runs after it whatever the given order
    split = _contract("split", provides={ir.STAGE})
    assert [c.name for c in order([reader, split])] == ["split", "reader"]
    # a key it only reads where present orders it, and is not required
    maybe = _contract("maybe", reads={ir.BUCKET})
    assert [c.name for c in order([maybe])] == ["maybe"]
    assert [c.name for c in order([maybe, _contract("dp", provides={ir.BUCKET})])] == [
        "dp", "maybe"]


def test_contradicting_contracts_are_refused_with_the_cycle():
    a = _contract("a", provides={ir.STAGE}, requires={ir.BUCKET})
    b = _contract("b", provides={ir.BUCKET}, requires={ir.STAGE})
    with pytest.raises(PassError, match=r"contradict.*(a before b|b before a)"):
        order([a, b])


@pytest.mark.parametrize("module", PASSES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_each_pass_declares_its_keys_in_ir_and_its_options_as_plan_fields(module):
    c = module.CONTRACT
    assert c.name == module.__name__.rsplit(".", 1)[1]
    assert (c.requires | c.reads | c.provides) <= DECLARED, (
        (c.requires | c.reads | c.provides) - DECLARED)
    assert {f.name for f in dataclasses.fields(c.options)} <= {
        f.name for f in dataclasses.fields(Plan)}
    assert c.before | c.after <= {m.CONTRACT.name for m in PASSES}
    # a pass's options: the plan's values of the fields it reads, and nothing to change
    plan = resolve(FULL, 8)
    options = pass_options(c.options, plan)
    assert dataclasses.asdict(options) == {
        f.name: getattr(plan, f.name) for f in dataclasses.fields(c.options)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.x = 1
