"""The zoo's sequence models (and the external zoo's) under context parallelism, against eager.

    .venv/bin/python -m fxpar.examples.zoo_cp [--more | MODEL ...] [--plans KEY,...]
        (default: the models below, every column; --more: the zoo's further Hugging Face
        MoE causal LMs, zoo.more_moes())
    .venv/bin/python -m fxpar.examples.zoo_cp --generic [MODEL ...] [--plans KEY,...]
        (every other Hugging Face causal LM, built generically at the zoo's size, that eager
        PyTorch trains there: examples/hf_causal_lms.py; columns "cp=2 (dp=2)" and a
        "dp=2" control)

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
"dp=2" (CONTROL) runs the same model without cp: a cell rounding under cp and exact there is
cp's order of sums.
"""
from __future__ import annotations

import sys

from fxpar.examples import hf_causal_lms, zoo, zoo_sweep

PLANS = {"cp=2 (dp=2)": (2, {"dp": 2, "cp": 2}),
         "cp=2 x dp=4": (4, {"dp": 4, "cp": 2}),
         "cp=2 ring (dp=2)": (2, {"dp": 2, "cp": 2, "cp_attention": "ring"})}
CONTROL = {"dp=2": (2, {"dp": 2})}
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
    zoo_sweep.plan_table(names, {k: {**PLANS, **CONTROL}[k] for k in plans})


def generic(names, plans) -> None:
    """hf_causal_lms's models (`names`, default every one) that eager trains, under `plans`;
    those it cannot train listed first with the reason."""
    names = names or list(hf_causal_lms.models())
    unknown = [n for n in names if n not in hf_causal_lms.models()]
    if unknown:
        sys.exit(f"zoo_cp: not among hf_causal_lms's models: {unknown}")
    why = {n: hf_causal_lms.eager_check(n) for n in names}
    for n in names:
        if why[n]:
            print(f"{n}: left out, eager PyTorch cannot train it at these sizes: {why[n]}")
    main([n for n in names if not why[n]], plans)


if __name__ == "__main__":
    args = sys.argv[1:]
    keys = None
    if "--plans" in args:
        i = args.index("--plans")
        keys = tuple(args[i + 1].split(","))
        args = args[:i] + args[i + 2:]
        unknown = [k for k in keys if k not in {**PLANS, **CONTROL}]
        if unknown:
            sys.exit(f"zoo_cp: unknown plan column(s) {unknown}; choose from "
                     f"{list({**PLANS, **CONTROL})}")
    if args[:1] == ["--generic"]:
        generic(args[1:], keys or ("cp=2 (dp=2)", *CONTROL))
    else:
        if args == ["--more"]:
            args = [m.name for m in zoo.more_moes()]
        main(args or MODELS, keys or tuple(PLANS))
