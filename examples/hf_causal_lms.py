"""Every Hugging Face causal LM the zoo does not build, at the zoo's tiny size, generically:
the architectures no one picked, under context parallelism and a plain dp=2 control.

    .venv/bin/python -m fxpar.examples.zoo_cp --generic [NAME ...] [--plans KEY,...]
    .venv/bin/python -m fxpar.examples.hf_causal_lms --list [NAME ...]

The candidates are transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES whose model class no zoo
model builds (multimodal classes, *ForConditionalGeneration, left out: they take other
inputs). Each is its config class's defaults with the common size fields it has overridden
(`tiny_overrides`: vocabulary zoo.VOCAB, width zoo.HIDDEN, 2 layers, 4 heads, 2 KV heads,
head_dim 8, 64 positions, dropouts 0, small MoE / latent-attention / state-space fields,
per-layer lists cut to 2 layers keeping two layer kinds), plus the few fields one
architecture needs besides (`_EXTRA`), with SDPA where the class takes it, else eager
attention. Nothing is chosen per model by hand beyond `_EXTRA`.

`models()` / `build(name)` / `loss_of` are the zoo's interface (examples/zoo_sweep.registry
finds these models, in launched ranks too). `eager_check(name)` runs one eager forward +
backward twice on zoo.lm_batch(0): '' where it trains (a finite loss, the same twice,
gradients), else why not; `--list` prints both kinds. examples/zoo_cp.py --generic runs those
eager trains under cp=2 and a dp=2 control (a cell that is rounding under cp but exact under
dp is cp's order of sums; docs/zoo.md).
"""
from __future__ import annotations

import functools
import math
import sys
import warnings

import torch

from fxpar.examples import zoo

MAX_PARAMS = 4_000_000  # (a size field the overrides missed: not a tiny model)

# every name of a group the config stores (or maps to a stored name through its
# attribute_map) gets the group's value
_SIZES: list[tuple[tuple[str, ...], object]] = [
    (("vocab_size",), zoo.VOCAB),
    (("hidden_size", "n_embd", "d_model", "n_embed", "model_dim"), zoo.HIDDEN),
    (("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim",
      "intermediate_size_mlp", "d_inner"), 2 * zoo.HIDDEN),
    (_LAYERS := ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"),
     2),
    (("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads"), 4),
    (("num_key_value_heads", "n_kv_heads", "num_kv_heads", "kv_n_heads",
      "num_key_value_heads_per_layer"), 2),
    (("head_dim", "kv_channels", "d_head", "d_kv"), 8),
    (("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx",
      "max_sequence_length"), 64),
    (("pad_token_id",), 0), (("bos_token_id",), 1), (("eos_token_id",), 2),
    (("embedding_size", "word_embed_proj_dim"), zoo.HIDDEN),
    # mixtures of experts
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    (("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "num_selected_experts"), 2),
    (("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
      "shared_intermediate_size"), zoo.HIDDEN),
    (("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    (("n_group", "topk_group"), 1),
    (("router_aux_loss_coef", "aux_loss_coef", "router_jitter_noise", "input_jitter_noise",
      "router_z_loss_coef"), 0.0),
    # multi-head latent attention
    (("kv_lora_rank",), 16), (("qk_rope_head_dim",), 4), (("qk_nope_head_dim",), 8),
    (("v_head_dim",), 8),
    # linear attention, state spaces
    (("linear_key_head_dim", "linear_value_head_dim"), 8), (("linear_num_key_heads",), 2),
    (("linear_num_value_heads",), 4), (("linear_conv_kernel_dim", "conv_kernel"), 4),
    (("state_size", "mamba_d_state", "ssm_state_size"), 8),
]
# only where the default sets them (None switches the feature off)
_IF_SET: list[tuple[tuple[str, ...], object]] = [
    (("q_lora_rank",), 16),
    (("sliding_window", "local_attention", "attention_chunk_size", "window_size"), 8),
]
_LAYER_LISTS_KEEP = ("rope_parameters", "rope_scaling")

# the fields the generic sizes get wrong for one architecture (its own shape constraints)
_EXTRA: dict[str, dict] = {
    "minicpm3": dict(num_key_value_heads=4),  # latent attention: as many KV heads as heads
    "youtu": dict(num_key_value_heads=4, qk_rope_head_dim=8),
    "gemma3n_text": dict(num_kv_shared_layers=0, vocab_size_per_layer_input=zoo.VOCAB,
                         hidden_size_per_layer_input=8),
    "mamba2": dict(num_heads=8, head_dim=8, expand=2, n_groups=1, chunk_size=8),
    "falcon_mamba": dict(time_step_rank=4, expand=2),
    "bamba": dict(mamba_n_heads=8, mamba_d_head=8, mamba_expand=2, mamba_n_groups=1,
                  mamba_chunk_size=8, attn_layer_indices=[1]),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=8, mamba_expand=2, mamba_n_groups=1,
                      mamba_chunk_size=8, mamba_d_ssm=64),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=8, n_groups=1, chunk_size=8,
                       hybrid_override_pattern="M*", layers_block_type=None),
    "zamba": dict(mamba_expand=2, mamba_dt_rank=4, attn_layer_period=2, attn_layer_offset=1,
                  n_mamba_heads=2),
    "zamba2": dict(mamba_expand=2, n_mamba_heads=8, mamba_headdim=8, mamba_ngroups=1,
                   chunk_size=8, hybrid_layer_ids=[1], num_mem_blocks=1),
    "recurrent_gemma": dict(lru_width=32, attention_window_size=8,
                            block_types=["recurrent", "attention"]),
    "rwkv": dict(attention_hidden_size=32, context_length=64),
    "reformer": dict(axial_pos_shape=[4, 4], axial_pos_embds_dim=[16, 16],
                     attn_layers=["local", "lsh"], local_attn_chunk_length=8,
                     lsh_attn_chunk_length=8, is_decoder=True, num_buckets=4),
    "xlstm": dict(embedding_dim=32, num_blocks=2, num_heads=4, qk_dim_factor=0.5,
                  v_dim_factor=1.0, mode="train", chunkwise_kernel="chunkwise--native_autograd",
                  sequence_kernel="native_sequence__native", step_kernel="native",
                  chunk_size=8),
}


def _is_dropout(key: str) -> bool:
    return zoo._is_dropout(key) or "layerdrop" in key or key.endswith("drop_path_rate")


def _two_layers(values: list) -> list:
    """A per-layer list cut to 2 layers: its first entry and the first different one (a
    hybrid keeps a layer of each of its first two kinds), else its first two."""
    other = next((v for v in values[1:] if v != values[0]), None)
    return [values[0], other] if other is not None else list(values[:2])


def _config_class(model_cls: str):
    """The model class's own config class (a multimodal model type's text model takes its
    text config)."""
    import transformers
    return getattr(transformers, model_cls).config_class


def tiny_overrides(model_type: str, model_cls: str) -> dict:
    """The config kwargs that make `model_type`'s `model_cls` tiny (the module's docstring)."""
    cls = _config_class(model_cls)
    stored = cls().to_dict()
    amap = getattr(cls, "attribute_map", {}) or {}

    def real(name):
        return name if name in stored else amap[name] if amap.get(name) in stored else None
    out = {}
    for names, value in _SIZES:
        for r in filter(None, map(real, names)):
            if not isinstance(stored[r], (list, dict)):
                out[r] = value
    for names, value in _IF_SET:
        for r in filter(None, map(real, names)):
            if isinstance(stored[r], int) and not isinstance(stored[r], bool):
                out[r] = value
    out.update({k: 0.0 for k, v in stored.items() if _is_dropout(k) and isinstance(v, float)})
    if "is_decoder" in stored:
        out["is_decoder"] = True  # (encoders built as causal LMs: BertLMHeadModel, ...)
    layers = next((stored[r] for r in filter(None, map(real, _LAYERS))
                   if isinstance(stored[r], int)), None)
    for k, v in stored.items():
        if isinstance(v, list) and layers and layers > 2 and len(v) == layers \
                and k not in _LAYER_LISTS_KEEP:
            out[k] = _two_layers(v)
    return {**out, **_EXTRA.get(model_type, {})}


def _factory(model_type: str, model_cls: str):
    def make():
        import transformers
        cls = getattr(transformers, model_cls)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = _config_class(model_cls)(**tiny_overrides(model_type, model_cls))
            cfg._attn_implementation = "sdpa" if getattr(cls, "_supports_sdpa", False) \
                else "eager"
            return cls(cfg)
    return make


def _zoo_classes() -> set[str]:
    """The Hugging Face model classes the zoo's models build (zoo._hf / zoo._hf_eager)."""
    return {c for spec in zoo.models().values()
            if (c := getattr(spec.factory, "model_cls", None)) is not None}


@functools.cache
def candidates() -> tuple[tuple[str, str, str], ...]:
    """(name, model_type, model class) of every causal LM the zoo does not build, one per
    model class (several model types of one class: the first); none without transformers."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return ()
    skip, taken, out = _zoo_classes(), set(zoo.models()), []
    for mt, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if cls in skip or "ForConditionalGeneration" in cls:
            continue
        skip.add(cls)
        name = mt.replace("-", "_")
        out.append((name + "_clm" if name in taken else name, mt, cls))
    return tuple(out)


@functools.cache
def models() -> dict[str, zoo.ZooModel]:
    """Every candidate by name (built when its factory is called)."""
    return {name: zoo.ZooModel(name, "causal-lm", _factory(mt, cls), zoo.lm_batch,
                               note=f"generic tiny {mt} ({cls})")
            for name, mt, cls in candidates()}


def build(name: str, seed: int = 1234, dropout: bool = False):
    if dropout:
        raise ValueError(f"{name}: the generic causal LMs are built without dropout")
    spec = models()[name]
    torch.manual_seed(seed)
    return spec.factory(), spec


loss_of = zoo.loss_of


def eager_check(name: str) -> str:
    """'' where eager PyTorch trains `name`: a finite loss, the same twice, gradients; else
    why not (an exception's first line, or what went wrong)."""
    import logging
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        spec = models()[name]
        with torch.device("meta"):
            n = sum(p.numel() for p in spec.factory().parameters())
        if n > MAX_PARAMS:
            return f"not tiny: {n / 1e6:.1f}M parameters at the generic sizes"
        model, _ = build(name)
        losses = []
        for _ in range(2):
            model.zero_grad()
            loss = loss_of(model, spec, spec.batch(0))
            if not torch.is_tensor(loss):
                return "no loss from its labels"
            loss.backward()
            losses.append(loss.item())
        if not all(math.isfinite(x) for x in losses):
            return f"loss not finite: {losses}"
        if losses[0] != losses[1]:
            return f"forward not deterministic: {losses}"
        if all(p.grad is None for p in model.parameters()):
            return "no gradients"
        return ""
    except Exception as e:  # noqa: BLE001 - the reason is the listing's
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def main(argv) -> None:
    """--list [NAME ...]: which candidates eager PyTorch trains, and why not the others."""
    names = [a for a in argv if a != "--list"] or list(models())
    unknown = [n for n in names if n not in models()]
    if unknown:
        sys.exit(f"hf_causal_lms: not a candidate: {unknown}")
    why = {n: eager_check(n) for n in names}
    good = [n for n in names if not why[n]]
    print(f"{len(good)} eager trains:")
    for n in good:
        print(f"  {n:28s} {models()[n].note}")
    print(f"{len(names) - len(good)} eager cannot train at these sizes:")
    for n in names:
        if why[n]:
            print(f"  {n:28s} {why[n]}")


if __name__ == "__main__":
    main(sys.argv[1:])
