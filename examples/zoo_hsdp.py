"""Zoo models under HSDP and hpZ on 4 CPU ranks, against eager PyTorch.

    .venv/bin/python -m fxpar.examples.zoo_hsdp [MODEL ...]   (default: the list below)

Each model trains examples/zoo_sweep.STEPS AdamW steps under each plan of PLANS, in one
`fxpar.launch` of 4 ranks, and is compared with eager as the zoo sweep compares
(`zoo_sweep.compare`: losses and every parameter within its tolerances). The two-rank zoo
table (docs/zoo.md) cannot hold these plans: a shard group smaller than dp needs dp >= 4.
"""
from __future__ import annotations

import os
import sys
import time

import fxpar
from fxpar.examples import zoo_sweep

PLANS = {"hsdp 2x2 zero=3": {"dp": 4, "zero": 3, "dp_shard": 2},
         "hpz=2 zero=3": {"dp": 4, "zero": 3, "hpz": 2}}
MODELS = ("mixtral", "qwen2_moe", "deepseek_v3", "qwen3_moe", "olmoe", "llama", "gpt2",
          "gemma2", "bert_mlm", "t5", "resnet", "clip", "where_moe", "lstm", "frozen_unused")


def _rank(name: str) -> dict:
    out = {}
    for key, plan in PLANS.items():
        try:
            losses, state, _ = zoo_sweep.train(name, 4, plan)
            out[key] = ("ran", losses, state if int(os.environ["RANK"]) == 0 else None)
        except Exception as e:  # noqa: BLE001 - every failure is a cell of the table
            out[key] = (*zoo_sweep._failure(e), None)
    return out


def main(names=MODELS) -> None:
    print("| model | " + " | ".join(PLANS) + " |\n|---|" + "---|" * len(PLANS))
    for name in names:
        t0 = time.perf_counter()
        res = fxpar.launch(_rank, 4, name)[0]
        ref_losses, ref_state, quiet = zoo_sweep.eager_reference(name)
        cells = []
        for key in PLANS:
            status, *rest = res[key]
            if status != "ran":
                cells.append(f"{status}: {rest[0][:120]}")
                continue
            diff = zoo_sweep.compare(rest[0], rest[1], ref_losses, ref_state, quiet)
            cells.append("exact" if not diff else f"mismatch: {diff[:120]}")
        print(f"| {name} | " + " | ".join(cells) + f" |  <!-- {time.perf_counter() - t0:.0f} s -->",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or MODELS)
