"""The built-in GPT configurations the planner is shown on (`fxpar plan --model gpt2`,
`--model gpt-175b`, benchmarks/planner_at_scale.py): each traced at two layers on fake tensors and scaled to
its depth. Examples, not library: the planner plans any model's statistics.
"""
from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar.compiler import capture as cap
from fxpar.compiler import planner
from fxpar.core.errors import PlanError
from fxpar.examples import models as M

# Narayanan et al. 2021, Table 1; GPT-3.
# name: (layers, hidden, heads); sequence 2048, vocabulary 51200 as in the paper
GPT_CONFIGS = {
    "gpt-1.7b": (24, 2304, 24), "gpt-3.6b": (30, 3072, 32), "gpt-7.5b": (36, 4096, 32),
    "gpt-18b": (40, 6144, 48), "gpt-39b": (48, 8192, 64), "gpt-76b": (60, 10240, 80),
    "gpt-145b": (80, 12288, 96), "gpt-175b": (96, 12288, 96), "gpt-310b": (96, 16384, 128),
    "gpt-530b": (105, 20480, 128), "gpt-1t": (128, 25600, 160),
}
# GPT-2 (Radford et al. 2019): sequence 1024, vocabulary 50257 padded to 50304 (a multiple
# of 64, as nanoGPT: the lm_head then splits over tp); gpt2 = 124M parameters
GPT2_CONFIGS = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16),
                "gpt2-large": (36, 1280, 20), "gpt2-xl": (48, 1600, 25)}
NAMES = ["small", *GPT2_CONFIGS, *GPT_CONFIGS]


def fake_gpt_stats(cfg, rows: int, dtype=torch.float32) -> planner.GraphStats:
    """Statistics of the example GPT built and traced on fake tensors in `dtype` (nothing
    is allocated), with a batch of `rows` sequences."""
    old = torch.get_default_dtype()
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(dtype)
        try:
            model = M.GPT(cfg)
        finally:
            torch.set_default_dtype(old)
        idx = torch.zeros(rows, cfg.block_size, dtype=torch.long)
    gm, sig = cap.capture(model, (idx, idx))
    roles, refusal = planner.tp_roles(gm, sig)  # (priced as the tp pass splits)
    stats = planner.analyze(gm, rows, roles)
    stats.tp_refusal = refusal
    stats.checkpoints_per_layer = planner.checkpoints_per_layer(gm)
    planner.context_stats(stats, gm)
    return stats


@functools.lru_cache(maxsize=8)
def gpt_stats(name: str, *, seq: int | None = None, vocab: int | None = None,
              precision: str = "bf16",
              traced_layers: int = 2, dropout: float = 0.1) -> planner.GraphStats:
    """Statistics of a built-in GPT config: a `traced_layers`-deep copy is traced on fake
    tensors (nothing is allocated) in `precision`, with Megatron-style attention (softmax and
    attention dropout written out) and one row per microbatch; the repeated block is scaled
    to the full depth. seq / vocab None: the config's own (GPT-2 1024 / 50304, the others
    2048 / 51200). Cached per process (treat the result as read-only)."""
    if name == "small":
        cfg = M.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
        layers, traced_layers = 2, 2
    else:
        if name not in GPT_CONFIGS and name not in GPT2_CONFIGS:
            raise PlanError(f"unknown model {name!r}; built-in GPT configs: "
                            f"{', '.join(NAMES)}, or pass pkg.module:factory")
        gpt2 = name in GPT2_CONFIGS
        layers, h, a = (GPT2_CONFIGS if gpt2 else GPT_CONFIGS)[name]
        seq = seq or (1024 if gpt2 else 2048)
        vocab = vocab or (50304 if gpt2 else 51200)
        cfg = M.GPTConfig(vocab_size=vocab, block_size=seq, n_layer=min(traced_layers, layers),
                          n_head=a, n_embd=h, dropout=dropout, attention="manual")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    stats = fake_gpt_stats(cfg, 1, dtype)
    stats.heads = cfg.n_head
    return stats.with_depth(layers) if layers != cfg.n_layer else stats


