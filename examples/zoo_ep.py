"""The zoo's MoE models (and the external zoo's) under expert parallelism, against eager.

    .venv/bin/python -m fxpar.examples.zoo_ep [MODEL ...]   (default: the list below)

Each model trains examples/zoo_sweep.STEPS AdamW steps under each plan of PLANS (ep=2 on 2
ranks; ep=2 and ep=4 carved out of dp=4 on 4 ranks), one `fxpar.launch` per plan, and
is compared with eager as the zoo sweep compares (`zoo_sweep.compare`, a difference judged
by the same controls: "rounding" where eager from weights one ulp apart, or with each
batch's halves run apart, moves as far, or where its first step passes Plan.verify). A
model whose experts are not grouped matmuls is a refusal naming the cause.
"""
from __future__ import annotations

import os
import sys
import time

import fxpar
from fxpar.examples import zoo_sweep

PLANS = {"ep=2 (dp=2)": (2, {"dp": 2, "ep": 2}),
         "ep=2 x dp=4": (4, {"dp": 4, "ep": 2}),
         "ep=4 (dp=4)": (4, {"dp": 4, "ep": 4})}
MODELS = ("mixtral", "qwen2_moe", "deepseek_v3", "qwen3_moe", "olmoe", "titan_qwen3_moe",
          "titan_deepseek_v3", "titan_kimi_k2", "litgpt_mixtral", "where_moe")


def _rank(name: str, keys: list) -> dict:
    out = {}
    for key in keys:
        world, plan = PLANS[key]
        try:
            losses, state, chosen = zoo_sweep.train(name, world, plan)
            out[key] = ("ran", losses, state if int(os.environ["RANK"]) == 0 else None, chosen)
        except Exception as e:  # noqa: BLE001 - every failure is a cell of the table
            out[key] = (*zoo_sweep._failure(e), None, None)
    return out


def _verify_rank(name: str, keys: list) -> dict:
    """Each plan's first step under Plan.verify: '' where it passes, else what it found."""
    out = {}
    for key in keys:
        world, plan = PLANS[key]
        try:
            zoo_sweep.train(name, world, plan, steps=1, verify=True)
            out[key] = ""
        except Exception as e:  # noqa: BLE001 - what verify found, or why it could not run
            out[key] = f"{type(e).__name__}: {e}"
    return out


def cells(name: str) -> dict:
    """{plan key: cell text} for one model."""
    why = zoo_sweep.skip_reason(name)
    if why:
        return {key: f"skipped: {why}" for key in PLANS}
    res = {}
    for key, (world, _) in PLANS.items():  # (one launch each: a process group opened again
        # after a refused parallelize can hang in gloo's connect)
        res.update(fxpar.launch(_rank, world, name, [key])[0])
    eager = zoo_sweep.eager_reference(name)
    out, controls = {}, {}
    for key in PLANS:
        status, *rest = res[key]
        if status != "ran":
            out[key] = f"{status}: {rest[0][:160]}"
            continue
        losses, state, chosen = rest
        diff = zoo_sweep.compare(losses, state, *eager)
        if not diff:
            out[key] = "exact"
            continue
        status, detail = zoo_sweep._judged(name, key, diff, losses, state, eager, chosen,
                                           controls)
        out[key] = status if status == "rounding" else f"{status}: {detail[:160]}"
    # a mismatch the controls confirm, checked as the zoo sweep checks it: its first step
    # under Plan.verify (gradients and optimizer state within what rounding makes them)
    again = [k for k, v in out.items() if v.startswith("mismatch")]
    for k in again:
        found = fxpar.launch(_verify_rank, PLANS[k][0], name, [k])[0][k]
        out[k] = "rounding (Plan.verify)" if not found else \
            f"{out[k]}; under Plan.verify: {found[:300]}"
    return out


def main(names=MODELS) -> None:
    print("| model | " + " | ".join(PLANS) + " |\n|---|" + "---|" * len(PLANS))
    for name in names:
        t0 = time.perf_counter()
        row = cells(name)
        print(f"| {name} | " + " | ".join(row[k] for k in PLANS) +
              f" |  <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or MODELS)
