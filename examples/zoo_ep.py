"""The zoo's MoE models (and the external zoo's) under expert parallelism, against eager.

    .venv/bin/python -m fxpar.examples.zoo_ep [--plans "NAME,..."] [--more | MODEL ...]
    (default: every plan below, every model of the list below; --more: the zoo's further
    Hugging Face MoE architectures, zoo.more_moes())

Each model trains examples/zoo_sweep.STEPS AdamW steps under each plan of PLANS (plain dp=4,
the MoE dispatch on each rank's own rows; ep=2 on 2 ranks; ep=2 and ep=4 carved out of dp=4
on 4 ranks; ep=2 x dp=4 with ZeRO-3, alone and inside HSDP's shard groups of 2; ep=2 x
tp=2, tp inside each rank's experts where the tp pass splits them; ep=2 with cp=2, each
rank's own tokens of its sequence chunks sent to their experts, on 2 ranks and inside
dp=4), one `fxpar.launch` per plan, and
is compared with eager as the zoo sweep compares (`zoo_sweep.compare`, a difference judged
by the same controls: "rounding" where eager from weights one ulp apart, or with each
batch's halves run apart, moves as far, or where its first step passes Plan.verify). A
model whose experts are not grouped matmuls is a refusal naming the cause.
"""
from __future__ import annotations

import sys

from fxpar.examples import zoo, zoo_sweep

PLANS = {"dp=4 (no ep)": (4, {"dp": 4}),
         "ep=2 (dp=2)": (2, {"dp": 2, "ep": 2}),
         "ep=2 x dp=4": (4, {"dp": 4, "ep": 2}),
         "ep=4 (dp=4)": (4, {"dp": 4, "ep": 4}),
         "ep=2 x dp=4, ZeRO-3": (4, {"dp": 4, "ep": 2, "zero": 3}),
         "ep=2 x HSDP 2 x 2, ZeRO-3": (4, {"dp": 4, "ep": 2, "zero": 3, "dp_shard": 2}),
         "ep=2 x tp=2 (dp=2)": (4, {"dp": 2, "ep": 2, "tp": 2}),
         "cp=2 ep=2 (dp=2)": (2, {"dp": 2, "cp": 2, "ep": 2}),
         "cp=2 ep=2 x dp=4": (4, {"dp": 4, "cp": 2, "ep": 2})}
MODELS = ("mixtral", "qwen2_moe", "deepseek_v3", "qwen3_moe", "olmoe", "gpt_oss", "glm4_moe",
          "granitemoe", "phimoe", "ernie4_5_moe", "hunyuan_v1_moe", "dots1", "minimax", "llama4",
          "jetmoe", "dbrx",
          "titan_qwen3_moe", "titan_deepseek_v3", "titan_kimi_k2", "litgpt_mixtral", "where_moe",
          "hit_loop_moe", "stacked_loop_moe")


def main(names=MODELS, plans=tuple(PLANS)) -> None:
    zoo_sweep.plan_table(names, {k: PLANS[k] for k in plans})


if __name__ == "__main__":
    args = sys.argv[1:]
    plans = tuple(PLANS)
    if args[:1] == ["--plans"]:
        plans, args = tuple(p.strip() for p in args[1].split(",")), args[2:]
        unknown = [p for p in plans if p not in PLANS]
        if unknown:
            sys.exit(f"unknown plans {unknown}; choose among {list(PLANS)}")
    if args == ["--more"]:
        args = [m.name for m in zoo.more_moes()]
    main(args or MODELS, plans)
