"""The zoo's causal LMs (and the external zoo's) under context parallelism, against eager.

    .venv/bin/python -m fxpar.examples.zoo_cp [MODEL ...]   (default: the list below)

Each model trains examples/zoo_sweep.STEPS AdamW steps under each plan of PLANS (cp=2 on 2
ranks: each rank a front and a back quarter of every sequence; cp=2 carved out of dp=4 on 4
ranks), one `fxpar.launch` per plan, and is compared with eager as the zoo sweep compares
(`zoo_sweep.plan_cells`). A model the pass cannot split is a refusal naming the cause.
"""
from __future__ import annotations

import sys

from fxpar.examples import zoo_sweep

PLANS = {"cp=2 (dp=2)": (2, {"dp": 2, "cp": 2}),
         "cp=2 x dp=4": (4, {"dp": 4, "cp": 2})}
MODELS = ("gpt2", "llama", "llama_mqa", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
          "phi", "phi3", "gpt_neox", "gptj", "bloom", "falcon", "opt", "gpt_bigcode",
          "stablelm", "olmo2", "gemma3", "codegen", "mamba", "gpt_neo", "granite", "cohere",
          "mpt", "mixtral", "titan_llama3", "titan_qwen3", "nanogpt", "litgpt_llama3",
          "litgpt_pythia")


def main(names=MODELS) -> None:
    zoo_sweep.plan_table(names, PLANS)


if __name__ == "__main__":
    main(sys.argv[1:] or MODELS)
