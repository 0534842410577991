"""The zoo's MoE models (and the external zoo's) under expert parallelism, against eager.

    .venv/bin/python -m fxpar.examples.zoo_ep [MODEL ...]   (default: the list below)

Each model trains examples/zoo_sweep.STEPS AdamW steps under each plan of PLANS (plain dp=4,
the MoE dispatch on each rank's own rows; ep=2 on 2 ranks; ep=2 and ep=4 carved out of dp=4
on 4 ranks; ep=2 x dp=4 with ZeRO-3, alone and inside HSDP's shard groups of 2), one
`fxpar.launch` per plan, and
is compared with eager as the zoo sweep compares (`zoo_sweep.compare`, a difference judged
by the same controls: "rounding" where eager from weights one ulp apart, or with each
batch's halves run apart, moves as far, or where its first step passes Plan.verify). A
model whose experts are not grouped matmuls is a refusal naming the cause.
"""
from __future__ import annotations

import sys

from fxpar.examples import zoo_sweep

PLANS = {"dp=4 (no ep)": (4, {"dp": 4}),
         "ep=2 (dp=2)": (2, {"dp": 2, "ep": 2}),
         "ep=2 x dp=4": (4, {"dp": 4, "ep": 2}),
         "ep=4 (dp=4)": (4, {"dp": 4, "ep": 4}),
         "ep=2 x dp=4, ZeRO-3": (4, {"dp": 4, "ep": 2, "zero": 3}),
         "ep=2 x HSDP 2 x 2, ZeRO-3": (4, {"dp": 4, "ep": 2, "zero": 3, "dp_shard": 2})}
MODELS = ("mixtral", "qwen2_moe", "deepseek_v3", "qwen3_moe", "olmoe", "titan_qwen3_moe",
          "titan_deepseek_v3", "titan_kimi_k2", "litgpt_mixtral", "where_moe")


def main(names=MODELS) -> None:
    zoo_sweep.plan_table(names, PLANS)


if __name__ == "__main__":
    main(sys.argv[1:] or MODELS)
