"""The zoo's sequence models (and the external zoo's) under context parallelism, against eager.

    .venv/bin/python -m fxpar.examples.zoo_cp [--more | MODEL ...] [--plans KEY,...]
        (default: the models below, every column; --more: the zoo's further Hugging Face
        MoE causal LMs, zoo.more_moes())

The models: every causal LM, dense and MoE (RoPE, learned positions, ALiBi, sliding windows,
soft-capping, a state-space scan, an LSTM), every encoder (BERT's family, DeBERTa's relative
positions, ModernBERT, raw audio, a bidirectional GRU, CLIP's text tower) and encoder-decoder
(T5, BART, Whisper, nn.Transformer).

Each model trains examples/zoo_sweep.STEPS AdamW steps under each plan of PLANS (cp=2 on 2
ranks: each rank a front and a back quarter of every sequence; cp=2 carved out of dp=4 on 4
ranks; and cp=2 with ring attention, the keys/values passed around instead of gathered),
one `fxpar.launch` per plan, and is compared with eager as the zoo sweep compares
(`zoo_sweep.plan_cells`). A model the pass cannot split (or whose attention cannot go
around the ring) is a refusal naming the cause. `--plans KEY[,KEY]` runs some columns.
"""
from __future__ import annotations

import sys

from fxpar.examples import zoo, zoo_sweep

PLANS = {"cp=2 (dp=2)": (2, {"dp": 2, "cp": 2}),
         "cp=2 x dp=4": (4, {"dp": 4, "cp": 2}),
         "cp=2 ring (dp=2)": (2, {"dp": 2, "cp": 2, "cp_attention": "ring"})}
MODELS = ("gpt2", "llama", "llama_mqa", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
          "phi", "phi3", "gpt_neox", "gptj", "bloom", "falcon", "opt", "gpt_bigcode",
          "stablelm", "olmo2", "gemma3", "codegen", "mamba", "gpt_neo", "granite", "cohere",
          "mpt", "mixtral", "titan_llama3", "titan_qwen3", "nanogpt", "litgpt_llama3",
          "litgpt_pythia",
          # MoE causal LMs, mid sizes, the external zoo's other LMs, an LSTM
          "qwen2_moe", "deepseek_v3", "qwen3_moe", "olmoe", "jetmoe", "dbrx", "where_moe",
          "hit_loop_moe", "stacked_loop_moe", "titan_qwen3_moe",
          "titan_deepseek_v3", "titan_kimi_k2", "litgpt_mixtral", "titan_qwen3_unfused",
          "litgpt_gemma2", "litgpt_gemma3", "gpt2_mid", "llama_mid", "mixtral_mid", "lstm",
          # encoders (bidirectional attention) and encoder-decoders
          "bert_mlm", "bert_cls", "roberta_mlm", "albert", "deberta_v2", "distilbert",
          "electra", "modernbert", "bert_mlm_mid", "wav2vec2", "t5", "bart", "whisper",
          "nn_transformer", "t5_mid", "gru", "clip")


def main(names=MODELS, plans=tuple(PLANS)) -> None:
    zoo_sweep.plan_table(names, {k: PLANS[k] for k in plans})


if __name__ == "__main__":
    args = sys.argv[1:]
    keys = tuple(PLANS)
    if "--plans" in args:
        i = args.index("--plans")
        keys = tuple(args[i + 1].split(","))
        args = args[:i] + args[i + 2:]
        unknown = [k for k in keys if k not in PLANS]
        if unknown:
            sys.exit(f"zoo_cp: unknown plan column(s) {unknown}; choose from {list(PLANS)}")
    if args == ["--more"]:
        args = [m.name for m in zoo.more_moes()]
    main(args or MODELS, keys)
