"""The model zoo: real architectures at tiny sizes, built from configs (no downloads).

Each entry is a `ZooModel`: a factory, a batch for step s (a GLOBAL batch of 8 rows, so it
splits over dp=2 x microbatches=2), an optional loss_fn, and a family. `fxpar zoo` (and the
tests in tests/test_zoo.py) trains every model under every plan against plain single-process
PyTorch on the same batches; docs/zoo.md is the table it writes.

Dropout is 0 in every config; `build(name, dropout=True)` gives a Hugging Face model its
library's default dropouts instead (the sweep's "tp=2 dropout" column: tensor parallelism
draws single-process training's masks, so the cell is compared with eager bit for bit).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

BATCH, SEQ, VOCAB, HIDDEN = 8, 16, 128, 32


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    family: str  # "causal-lm", "moe", "encoder", "encoder-decoder", "vision", "pytorch"
    factory: Callable[[], nn.Module]
    batch: Callable[[int], object]
    loss_fn: Callable | None = None
    note: str = ""  # what the model exercises


# --- batches ------------------------------------------------------------------------------------

def lm_batch(step: int, vocab: int = VOCAB, seq: int = SEQ) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (BATCH, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def mlm_batch(step: int) -> dict:
    """Masked LM: 1 in 4 positions carries a label, the rest -100 (ignored)."""
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.full_like(ids, -100)
    pick = torch.rand(BATCH, SEQ, generator=g) < 0.25
    pick[:, 0] = True  # every row has a target
    labels[pick] = ids[pick]
    return {"input_ids": ids, "labels": labels}


def seq2seq_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(3000 + step)
    return {"input_ids": torch.randint(2, VOCAB, (BATCH, SEQ), generator=g),
            "labels": torch.randint(2, VOCAB, (BATCH, SEQ // 2), generator=g)}


def image_batch(step: int, size: int = 32, classes: int = 5) -> dict:
    g = torch.Generator().manual_seed(4000 + step)
    return {"pixel_values": torch.randn(BATCH, 3, size, size, generator=g),
            "labels": torch.randint(0, classes, (BATCH,), generator=g)}


def xy_batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(5000 + step)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def tokens_batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(6000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def audio_batch(step: int) -> dict:
    """Wav2Vec2: 400 raw samples per row, a class per row."""
    g = torch.Generator().manual_seed(7300 + step)
    return {"input_values": torch.randn(BATCH, 400, generator=g),
            "labels": torch.arange(BATCH) % 3}


def speech_batch(step: int) -> dict:
    """Whisper: 8 mel bins x 32 frames per row, a transcript of SEQ // 2 tokens."""
    g = torch.Generator().manual_seed(7000 + step)
    return {"input_features": torch.randn(BATCH, 8, 32, generator=g),
            "labels": torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=g)}


def image_text_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(7100 + step)
    return {"input_ids": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g),
            "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g)}


def contrastive_loss(model, batch):
    """CLIP's symmetric loss: each image against every text of the batch and back."""
    return model(**batch, return_loss=True).loss


# --- Hugging Face models --------------------------------------------------------------------------

_DENSE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
              num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)


def _is_dropout(key: str) -> bool:
    """A config key that sets a dropout probability (not LayerDrop or SpecAugment's masks,
    whose draws decide Python control flow)."""
    return ("dropout" in key or "pdrop" in key) and "layerdrop" not in key


def _hf(config_cls: str, model_cls: str, **kw) -> Callable[[], nn.Module]:
    eager_attn = kw.pop("_eager_attn", False)

    def make():
        import transformers
        cfg = getattr(transformers, config_cls)(**kw)
        cfg._attn_implementation = "eager" if eager_attn else "sdpa"
        return getattr(transformers, model_cls)(cfg)
    make.model_cls = model_cls
    if any(_is_dropout(k) for k in kw):
        make.with_default_dropout = _hf(config_cls, model_cls, _eager_attn=eager_attn, **{
            k: v for k, v in kw.items() if not _is_dropout(k)})
    return make


def _hf_eager(config_cls: str, model_cls: str, **kw) -> Callable[[], nn.Module]:
    """A model whose attention only has the eager implementation in transformers."""
    def make():
        import transformers
        cfg = getattr(transformers, config_cls)(**kw)
        return getattr(transformers, model_cls)(cfg)
    make.model_cls = model_cls
    if any(_is_dropout(k) for k in kw):
        make.with_default_dropout = _hf_eager(config_cls, model_cls, **{
            k: v for k, v in kw.items() if not _is_dropout(k)})
    return make


def _causal_lms() -> list[ZooModel]:
    d = _DENSE
    lm = lm_batch
    return [
        ZooModel("gpt2", "causal-lm", _hf(
            "GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4,
            n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), lm,
            note="learned positions, fused QKV (Conv1D), tied head, biases"),
        ZooModel("llama", "causal-lm", _hf("LlamaConfig", "LlamaForCausalLM", **d,
                                           num_key_value_heads=2), lm, note="RoPE, GQA, SwiGLU"),
        ZooModel("llama_mqa", "causal-lm", _hf("LlamaConfig", "LlamaForCausalLM", **d,
                                               num_key_value_heads=1), lm,
                 note="one KV head (multi-query attention)"),
        ZooModel("mistral", "causal-lm", _hf("MistralConfig", "MistralForCausalLM", **d,
                                             num_key_value_heads=2, sliding_window=8), lm,
                 note="sliding-window attention (window 8 < seq 16)"),
        ZooModel("qwen2", "causal-lm", _hf("Qwen2Config", "Qwen2ForCausalLM", **d,
                                           num_key_value_heads=2, tie_word_embeddings=True), lm,
                 note="QKV biases, tied head"),
        ZooModel("qwen3", "causal-lm", _hf("Qwen3Config", "Qwen3ForCausalLM", **d,
                                           num_key_value_heads=2, head_dim=8), lm,
                 note="RMSNorm on q and k"),
        ZooModel("gemma", "causal-lm", _hf("GemmaConfig", "GemmaForCausalLM", **d,
                                           num_key_value_heads=1, head_dim=8), lm,
                 note="GeGLU, scaled embeddings, (1 + w) RMSNorm, MQA, tied head"),
        ZooModel("gemma2", "causal-lm", _hf(
            "Gemma2Config", "Gemma2ForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
            _eager_attn=True), lm, note="logit soft-capping, alternating sliding window"),
        ZooModel("phi", "causal-lm", _hf("PhiConfig", "PhiForCausalLM", **d,
                                         partial_rotary_factor=0.5, resid_pdrop=0.0,
                                         embd_pdrop=0.0), lm,
                 note="parallel attention + MLP, partial rotary, biases"),
        ZooModel("phi3", "causal-lm", _hf("Phi3Config", "Phi3ForCausalLM", **d,
                                          num_key_value_heads=2, pad_token_id=0), lm,
                 note="fused QKV and gate_up projections"),
        ZooModel("gpt_neox", "causal-lm", _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **d,
                                              rotary_pct=0.5, use_parallel_residual=True), lm,
                 note="parallel residual, fused interleaved QKV, partial rotary"),
        ZooModel("gptj", "causal-lm", _hf(
            "GPTJConfig", "GPTJForCausalLM", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4,
            n_positions=64, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), lm,
            note="parallel attention + MLP, interleaved rotary"),
        ZooModel("bloom", "causal-lm", _hf_eager(
            "BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2,
            n_head=4, hidden_dropout=0.0, attention_dropout=0.0), lm,
            note="ALiBi, embedding LayerNorm"),
        ZooModel("falcon", "causal-lm", _hf(
            "FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
            num_hidden_layers=2, num_attention_heads=4, alibi=True, multi_query=True,
            parallel_attn=True, bias=False, hidden_dropout=0.0, attention_dropout=0.0), lm,
            note="ALiBi, multi-query, parallel attention"),
        ZooModel("opt", "causal-lm", _hf(
            "OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
            num_hidden_layers=2, ffn_dim=2 * HIDDEN, num_attention_heads=4,
            max_position_embeddings=64, word_embed_proj_dim=HIDDEN, dropout=0.0,
            attention_dropout=0.0), lm, note="learned positions with offset, ReLU MLP"),
        ZooModel("gpt_bigcode", "causal-lm", _hf(
            "GPTBigCodeConfig", "GPTBigCodeForCausalLM", vocab_size=VOCAB, n_embd=HIDDEN,
            n_layer=2, n_head=4, n_positions=64, multi_query=True, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0), lm, note="multi-query attention, fused QKV"),
        ZooModel("stablelm", "causal-lm", _hf("StableLmConfig", "StableLmForCausalLM", **d,
                                              num_key_value_heads=2, partial_rotary_factor=0.25,
                                              hidden_dropout=0.0, attention_dropout=0.0), lm,
                 note="LayerNorm, partial rotary"),
        ZooModel("olmo2", "causal-lm", _hf("Olmo2Config", "Olmo2ForCausalLM", **d,
                                           num_key_value_heads=2, pad_token_id=0), lm,
                 note="post-norm blocks, q/k RMSNorm over all heads"),
        ZooModel("gemma3", "causal-lm", _hf(
            "Gemma3TextConfig", "Gemma3ForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=8, final_logit_softcapping=30.0, _eager_attn=True,
            pad_token_id=0, bos_token_id=1, eos_token_id=2), lm,
            note="local / global layers with two RoPE bases, q/k norm, soft-capping"),
        ZooModel("codegen", "causal-lm", _hf(
            "CodeGenConfig", "CodeGenForCausalLM", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2,
            n_head=4, n_inner=2 * HIDDEN, n_positions=64, rotary_dim=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2), lm,
            note="fused QKV viewed in groups before its split, interleaved partial rotary"),
        ZooModel("mamba", "causal-lm", _hf_eager(
            "MambaConfig", "MambaForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
            state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, time_step_rank=4,
            use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2), lm,
            note="state-space model: selective scan (a loop over the sequence), causal conv"),
        ZooModel("gpt_neo", "causal-lm", _hf_eager(
            "GPTNeoConfig", "GPTNeoForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
            num_layers=2, num_heads=4, intermediate_size=2 * HIDDEN,
            attention_types=[[["global", "local"], 1]], window_size=8,
            max_position_embeddings=64, embed_dropout=0.0, attention_dropout=0.0,
            resid_dropout=0.0, bos_token_id=1, eos_token_id=2), lm,
            note="global / local (window 8) layers, unscaled attention scores"),
        ZooModel("granite", "causal-lm", _hf(
            "GraniteConfig", "GraniteForCausalLM", **d, num_key_value_heads=2,
            embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
            logits_scaling=8.0, pad_token_id=0, bos_token_id=1, eos_token_id=2), lm,
            note="embedding, residual, attention and logit multipliers"),
        ZooModel("cohere", "causal-lm", _hf(
            "CohereConfig", "CohereForCausalLM", **d, num_key_value_heads=2, logit_scale=0.0625,
            pad_token_id=0, bos_token_id=1, eos_token_id=2), lm,
            note="attention and MLP in parallel from one LayerNorm, interleaved RoPE, logit "
                 "scale, tied head"),
        ZooModel("mpt", "causal-lm", _hf_eager(
            "MptConfig", "MptForCausalLM", vocab_size=VOCAB, d_model=HIDDEN, n_heads=4,
            n_layers=2, expansion_ratio=2, max_seq_len=64, no_bias=True,
            attn_config={"alibi": True, "attn_pdrop": 0}, resid_pdrop=0, emb_pdrop=0,
            pad_token_id=0, bos_token_id=1, eos_token_id=2), lm,
            note="ALiBi position biases, no biases, tied head"),
    ]


def _moes() -> list[ZooModel]:
    d = _DENSE
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return [
        ZooModel("mixtral", "moe", _hf("MixtralConfig", "MixtralForCausalLM", **d,
                                       num_key_value_heads=2, num_local_experts=4,
                                       num_experts_per_tok=2, router_aux_loss_coef=0.0), lm_batch,
                 note="top-2 of 4 experts"),
        ZooModel("qwen2_moe", "moe", _hf(
            "Qwen2MoeConfig", "Qwen2MoeForCausalLM", **d, num_key_value_heads=2, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=HIDDEN, router_aux_loss_coef=0.0), lm_batch,
            note="top-2 of 4 experts plus a gated shared expert"),
        ZooModel("deepseek_v3", "moe", _hf(
            "DeepseekV3Config", "DeepseekV3ForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, rope_scaling=None,
            pad_token_id=0, bos_token_id=1, eos_token_id=2), lm_batch,
            note="MLA (low-rank q / kv), group-limited top-k routing, shared expert"),
        ZooModel("qwen3_moe", "moe", _hf(
            "Qwen3MoeConfig", "Qwen3MoeForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
            router_aux_loss_coef=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2),
            lm_batch, note="per-head q/k RMSNorm, top-2 of 4 experts, renormalised weights"),
        ZooModel("olmoe", "moe", _hf(
            "OlmoeConfig", "OlmoeForCausalLM", **d, num_key_value_heads=4, num_experts=4,
            num_experts_per_tok=2, router_aux_loss_coef=0.0, pad_token_id=0, bos_token_id=1,
            eos_token_id=2), lm_batch,
            note="q/k RMSNorm over all heads, top-2 of 4 experts"),
        ZooModel("gpt_oss", "moe", _hf(
            "GptOssConfig", "GptOssForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            router_aux_loss_coef=0.0, attention_dropout=0.0, _eager_attn=True, **ids), lm_batch,
            note="expert biases, clamped SwiGLU, attention sinks, sliding / full layers"),
        ZooModel("glm4_moe", "moe", _hf(
            "Glm4MoeConfig", "Glm4MoeForCausalLM", **d, num_key_value_heads=2,
            moe_intermediate_size=HIDDEN, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            norm_topk_prob=True, use_qk_norm=True, attention_dropout=0.0, **ids), lm_batch,
            note="sigmoid router with a correction bias, group-limited top-k, shared expert"),
        ZooModel("granitemoe", "moe", _hf(
            "GraniteMoeConfig", "GraniteMoeForCausalLM", **d, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0,
            attention_dropout=0.0, embedding_multiplier=12.0, residual_multiplier=0.22,
            attention_multiplier=0.0625, logits_scaling=8.0, **ids), lm_batch,
            note="experts as one parallel-experts linear, Granite's multipliers"),
        ZooModel("phimoe", "moe", _hf(
            "PhimoeConfig", "PhimoeForCausalLM", **d, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0,
            router_jitter_noise=0.0, input_jitter_noise=0.0, attention_dropout=0.0,
            sliding_window=None, **ids), lm_batch,
            note="sparsemixer routing, LayerNorm, biases"),
        ZooModel("ernie4_5_moe", "moe", _hf(
            "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", **d, num_key_value_heads=2,
            moe_intermediate_size=HIDDEN, moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
            moe_layer_start_index=0, moe_layer_interval=1, router_aux_loss_coef=0.0, **ids),
            lm_batch, note="router bias correction (squeezed), shared expert"),
        ZooModel("hunyuan_v1_moe", "moe", _hf(
            "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", **d, num_key_value_heads=2,
            head_dim=8, num_experts=4, moe_topk=2, attention_dropout=0.0, **ids), lm_batch,
            note="q/k norm, a shared MLP beside the experts"),
        ZooModel("dots1", "moe", _hf(
            "Dots1Config", "Dots1ForCausalLM", **d, num_key_value_heads=2,
            moe_intermediate_size=HIDDEN, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            norm_topk_prob=True, attention_dropout=0.0, **ids), lm_batch,
            note="DeepSeek-V3's routing, q/k norm, a dense first layer"),
        ZooModel("minimax", "moe", _hf(
            "MiniMaxConfig", "MiniMaxForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0,
            router_jitter_noise=0.0, attention_dropout=0.0, block_size=8,
            layer_types=["linear_attention", "full_attention"], **ids), lm_batch,
            note="lightning (linear) attention and full attention layers"),
        ZooModel("llama4", "moe", _hf(
            "Llama4TextConfig", "Llama4ForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            intermediate_size_mlp=2 * HIDDEN, num_local_experts=4, num_experts_per_tok=2,
            interleave_moe_layer_step=1, router_aux_loss_coef=0.0, router_jitter_noise=0.0,
            attention_dropout=0.0, attention_chunk_size=8, **ids), lm_batch,
            note="every expert on every token (batched matmuls), shared expert, chunked "
                 "attention, no-RoPE layers"),
        ZooModel("jetmoe", "moe", _hf(
            "JetMoeConfig", "JetMoeForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN, num_hidden_layers=2, num_key_value_heads=2,
            kv_channels=8, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=64, aux_loss_coef=0.0, attention_dropout=0.0, **ids),
            lm_batch, note="experts and attention experts split by counts.tolist(), a tied "
                           "head"),
        ZooModel("dbrx", "moe", _hf(
            "DbrxConfig", "DbrxForCausalLM", d_model=HIDDEN, n_heads=4, n_layers=2,
            max_seq_len=64, vocab_size=VOCAB, resid_pdrop=0.0, emb_pdrop=0.0,
            attn_config=dict(kv_n_heads=2, clip_qkv=8.0, attn_pdrop=0.0, rope_theta=10000.0),
            ffn_config=dict(ffn_hidden_size=2 * HIDDEN, moe_num_experts=4, moe_top_k=2,
                            moe_loss_weight=0.0), **ids), lm_batch,
            note="a loop over the experts some token picked, QKV clipping"),
    ]



def more_moes() -> list[ZooModel]:
    """More of Hugging Face's MoE architectures, each at the zoo's tiny size with MoE in every
    layer: examples/zoo_ep.py runs them under ep (docs/zoo.md)."""
    d = _DENSE
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    inkling2 = dict(
        vocab_size=VOCAB, unpadded_vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=8, d_rel=4,
        rel_extent=16, log_scaling_n_floor=16, layer_types=["hybrid_sliding", "hybrid"],
        max_position_embeddings=64, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_layers_per_attn_res_block=1, attention_dropout=0.0,
        _eager_attn=True, **ids)
    granite = dict(  # GraniteMoE's experts and scalings, a shared MLP beside them
        **d, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=HIDDEN, router_aux_loss_coef=0.0, attention_dropout=0.0,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
        logits_scaling=8.0, **ids)
    mla = dict(  # DeepSeek-V3-like: multi-head latent attention, routed and shared experts
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        max_position_embeddings=64, attention_dropout=0.0, **ids)
    return [
        ZooModel("deepseek_v2", "moe", _hf(
            "DeepseekV2Config", "DeepseekV2ForCausalLM", **mla, topk_method="greedy",
            first_k_dense_replace=0), lm_batch,
            note="MLA, greedy top-2 of 4 experts, shared expert"),
        ZooModel("qwen3_next", "moe", _hf(
            "Qwen3NextConfig", "Qwen3NextForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=HIDDEN, decoder_sparse_step=1, mlp_only_layers=[],
            layer_types=["linear_attention", "full_attention"], router_aux_loss_coef=0.0,
            attention_dropout=0.0, **ids), lm_batch,
            note="gated DeltaNet + gated full attention, top-2 of 4 experts, shared expert"),
        ZooModel("qwen3_5_moe", "moe", _hf(
            "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", **d, num_key_value_heads=2,
            head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=HIDDEN,
            layer_types=["linear_attention", "full_attention"], router_aux_loss_coef=0.0,
            attention_dropout=0.0, **ids), lm_batch,
            note="Qwen3.5 text: gated DeltaNet + full attention, experts + shared expert"),
        ZooModel("granitemoeshared", "moe", _hf(
            "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", **granite), lm_batch,
            note="GraniteMoe plus a shared MLP"),
        ZooModel("flex_olmo", "moe", _hf(
            "FlexOlmoConfig", "FlexOlmoForCausalLM", **d, num_key_value_heads=4, num_experts=4,
            num_experts_per_tok=2, router_aux_loss_coef=0.0, attention_dropout=0.0, **ids),
            lm_batch, note="OLMoE-style, post-norm blocks, top-2 of 4"),
        ZooModel("lfm2_moe", "moe", _hf(
            "Lfm2MoeConfig", "Lfm2MoeForCausalLM", **d, num_key_value_heads=2,
            moe_intermediate_size=HIDDEN, num_dense_layers=0, num_experts=4,
            num_experts_per_tok=2, use_expert_bias=True, norm_topk_prob=True,
            layer_types=["conv", "full_attention"], **ids), lm_batch,
            note="short-conv + attention layers, sigmoid router with expert bias"),
        ZooModel("minimax_m2", "moe", _hf(
            "MiniMaxM2Config", "MiniMaxM2ForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0,
            router_jitter_noise=0.0, attention_dropout=0.0, **ids), lm_batch,
            note="sigmoid router with a correction bias, q/k norm, partial rotary"),
        ZooModel("longcat_flash", "moe", _hf(
            "LongcatFlashConfig", "LongcatFlashForCausalLM", vocab_size=VOCAB,
            hidden_size=HIDDEN, num_layers=2, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=64, ffn_hidden_size=2 * HIDDEN, q_lora_rank=16,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, head_dim=4, v_head_dim=8,
            moe_topk=2, n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=16,
            attention_dropout=0.0, **ids), lm_batch,
            note="shortcut MoE: 2 MLA + 2 MLPs per layer, zero (identity) experts"),
        ZooModel("glm4_moe_lite", "moe", _hf(
            "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", **mla, n_group=1, topk_group=1,
            mlp_layer_types=["sparse", "sparse"]), lm_batch,
            note="MLA (interleaved rope) + GLM-4 MoE routing"),
        ZooModel("mistral4", "moe", _hf(
            "Mistral4Config", "Mistral4ForCausalLM", **mla, n_group=1, topk_group=1,
            first_k_dense_replace=0), lm_batch,
            note="MLA + DeepSeek-V3-style MoE"),
        ZooModel("jamba", "moe", _hf(
            "JambaConfig", "JambaForCausalLM", **d, num_key_value_heads=2, num_experts=4,
            num_experts_per_tok=2, expert_layer_period=1, expert_layer_offset=0,
            attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False,
            mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
            router_aux_loss_coef=0.0, attention_dropout=0.0, **ids), lm_batch,
            note="Mamba + attention layers, top-2 of 4 experts in both"),
        ZooModel("granitemoehybrid", "moe", _hf(
            "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", **granite,
            position_embedding_type="rope", layer_types=["linear_attention", "full_attention"],
            mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=8), lm_batch,
            note="Mamba-2 + attention layers, GraniteMoe experts + shared MLP"),
        ZooModel("afmoe", "moe", _hf(
            "AfmoeConfig", "AfmoeForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            moe_intermediate_size=HIDDEN, num_dense_layers=0, num_experts=4,
            num_experts_per_tok=2, num_shared_experts=1, global_attn_every_n_layers=2,
            sliding_window=8, attention_dropout=0.0, **ids), lm_batch,
            note="Trinity: sigmoid router + expert bias, gated attention, sliding / full"),
        ZooModel("cohere2_moe", "moe", _hf(
            "Cohere2MoeConfig", "Cohere2MoeForCausalLM", **d, num_key_value_heads=2,
            head_dim=8, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["sparse", "sparse"], attention_dropout=0.0, **ids), lm_batch,
            note="parallel attention + MoE block, shared expert averaged, LayerNorm"),
        ZooModel("exaone_moe", "moe", _hf(
            "ExaoneMoeConfig", "ExaoneMoeForCausalLM", **d, num_key_value_heads=2,
            head_dim=8, moe_intermediate_size=HIDDEN, num_experts=4, num_experts_per_tok=2,
            num_shared_experts=1, first_k_dense_replace=0,
            mlp_layer_types=["sparse", "sparse"], sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], n_group=1, topk_group=1,
            attention_dropout=0.0, **ids), lm_batch,
            note="sigmoid router + correction bias, shared expert, sliding / full"),
        ZooModel("solar_open", "moe", _hf(
            "SolarOpenConfig", "SolarOpenForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            moe_intermediate_size=HIDDEN, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, attention_dropout=0.0, **ids),
            lm_batch, note="GLM-4 MoE routing in every layer"),
        ZooModel("deepseek_v32", "moe", _hf(
            "DeepseekV32Config", "DeepseekV32ForCausalLM", **mla, n_group=2, topk_group=1,
            first_k_dense_replace=0, mlp_layer_types=["sparse", "sparse"], index_topk=8,
            index_head_dim=8, index_n_heads=2), lm_batch,
            note="MLA + lightning indexer (top-k sparse attention), V3 routing"),
        ZooModel("mimo_v2_flash", "moe", _hf(
            "MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", **d, num_key_value_heads=2,
            head_dim=8, v_head_dim=8, moe_intermediate_size=HIDDEN, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["sparse", "sparse"], attention_dropout=0.0, _eager_attn=True,
            **ids), lm_batch, note="sliding / full attention with sinks, sigmoid router"),
        ZooModel("kimi_linear", "moe", _hf(
            "KimiLinearConfig", "KimiLinearForCausalLM", **d, num_key_value_heads=4,
            moe_intermediate_size=16, n_shared_experts=1, num_local_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, linear_head_dim=8,
            linear_num_heads=4, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"],
            mlp_layer_types=["sparse", "sparse"], attention_dropout=0.0, **ids), lm_batch,
            note="Kimi delta attention (KDA) + MLA layers, V3-style MoE"),
        ZooModel("bailing_hybrid", "moe", _hf(
            "BailingHybridConfig", "BailingHybridForCausalLM", **d, num_key_value_heads=4,
            moe_intermediate_size=16, n_shared_experts=1, num_local_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
            v_head_dim=8, head_dim=8, num_mtp_layers=0, mtp_loss_scaling_factor=0.0,
            layer_types=["linear_attention", "full_attention"],
            mlp_layer_types=["sparse", "sparse"], attention_dropout=0.0, **ids), lm_batch,
            note="KDA linear attention + MLA, group-limited routing"),
        ZooModel("nemotron_h", "moe", _hf(
            "NemotronHConfig", "NemotronHForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=64,
            layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
            ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
            chunk_size=8, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16, num_experts_per_tok=2, n_group=1,
            topk_group=1, hidden_dropout=0.0, attention_dropout=0.0, **ids), lm_batch,
            note="Nemotron-H: Mamba-2 / attention / MoE blocks (4 blocks, 2 MoE)"),
        ZooModel("axk1", "moe", _hf(
            "AXK1Config", "AXK1ForCausalLM", **mla, n_group=2, topk_group=1,
            mlp_layer_types=["sparse", "sparse"]), lm_batch,
            note="A.X-K1: DeepSeek-V3-style MLA + MoE"),
        ZooModel("axk2", "moe", _hf(
            "AXK2Config", "AXK2ForCausalLM", **mla, mlp_layer_types=["sparse", "sparse"],
            index_topk=8, index_head_dim=8, index_n_heads=2, gated_norm_rank=4), lm_batch,
            note="A.X-K2: MLA + DSA indexer + gated norm, MoE"),
        ZooModel("beam", "moe", _hf(
            "BeamConfig", "BeamForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            moe_intermediate_size=HIDDEN, num_experts=4, num_experts_per_tok=2, n_group=2,
            topk_group=1, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["sparse", "sparse"], attention_dropout=0.0, **ids), lm_batch,
            note="Beam: sliding (rope) / full (NoPE) layers, group-limited routing, softcap"),
        ZooModel("deepseek_v4", "moe", _hf(
            "DeepseekV4Config", "DeepseekV4ForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
            moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, head_dim=8, partial_rotary_factor=0.5, q_lora_rank=16,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            max_position_embeddings=64, sliding_window=8, o_groups=2, o_lora_rank=16,
            index_n_heads=2, index_head_dim=8, index_topk=4, hc_mult=2, hc_sinkhorn_iters=3,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
            mlp_layer_types=["hash_moe", "moe"], num_nextn_predict_layers=0,
            router_aux_loss_coef=0.0, router_jitter_noise=0.0, attention_dropout=0.0,
            _eager_attn=True, **ids), lm_batch,
            note="V4: mHC streams, compressed sparse attention, hash + learned MoE"),
        ZooModel("doge", "moe", _hf(
            "DogeConfig", "DogeForCausalLM", **d, num_key_value_heads=2, is_moe=True,
            num_experts=16, num_experts_per_tok=2, keep_window_size=16, hidden_dropout=0.0,
            attention_dropout=0.0, router_aux_loss_coef=0.0, **ids), lm_batch,
            note="Doge CDMoE: product-key retrieval of 16 embedding experts"),
        ZooModel("ergo", "moe", _hf(
            "ErgoConfig", "ErgoForCausalLM", **d, num_key_value_heads=2,
            moe_intermediate_size=HIDDEN, shared_intermediate_size=HIDDEN, num_dense_blocks=0,
            first_dense_intermediate_size=2 * HIDDEN, num_experts=4, num_experts_per_tok=2,
            sliding_window=8, global_attention_every_n_layers=2, **ids), lm_batch,
            note="Ergo: expert norms, residual gates, shared expert"),
        ZooModel("flint", "moe", _hf(
            "FlintConfig", "FlintForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN,
            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
            sliding_window=8, layer_types=["full_attention", "sliding_attention"],
            router_aux_loss_coef=0.0, attention_dropout=0.0, _eager_attn=True, **ids),
            lm_batch, note="Qwen-MoE-style with shared expert, sliding / full"),
        ZooModel("glm_moe_dsa", "moe", _hf(
            "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", **mla, first_k_dense_replace=0,
            index_topk=8, index_head_dim=8, index_n_heads=2), lm_batch,
            note="GLM-5: MLA + DSA indexer, sigmoid routing"),
        ZooModel("granitemoe_swa", "moe", _hf(
            "GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", **granite, sliding_window=8,
            layer_types=["full_attention", "sliding_attention"], _eager_attn=True), lm_batch,
            note="GraniteMoe with sliding / full attention"),
        ZooModel("hy_v3", "moe", _hf(
            "HYV3Config", "HYV3ForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
            moe_intermediate_size=HIDDEN, mlp_layer_types=["sparse", "sparse"],
            attention_dropout=0.0, **ids), lm_batch,
            note="Hy3: fp32 combine, shared expert"),
        ZooModel("hy_v4", "moe", _hf(
            "HYV4Config", "HYV4ForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_topk=8,
            index_head_dim=8, index_n_heads=2, hc_mult=2, max_position_embeddings=64,
            mlp_layer_types=["sparse", "sparse"], attention_dropout=0.0, _eager_attn=True,
            **ids), lm_batch, note="Hy4: MLA + DSA indexer, mHC streams, sinks, clamped SwiGLU"),
        ZooModel("kolibri1", "moe", _hf(
            "Kolibri1Config", "Kolibri1ForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN,
            num_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], attention_dropout=0.0, **ids),
            lm_batch, note="Kolibri-1: sliding / full, shared expert"),
        ZooModel("laguna", "moe", _hf(
            "LagunaConfig", "LagunaForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN,
            num_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["sparse", "sparse"], num_attention_heads_per_layer=[4, 2],
            router_aux_loss_coef=0.0, attention_dropout=0.0, **ids), lm_batch,
            note="Laguna: gated attention, per-layer head counts, shared expert"),
        ZooModel("lara_mini", "moe", _hf(
            "LaraMiniConfig", "LaraMiniForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_conv_kernel_dim=4, moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=HIDDEN, num_experts=4, num_experts_per_tok=2,
            sliding_window=8, layer_types=["linear_attention", "sliding_attention"],
            router_aux_loss_coef=0.0, attention_dropout=0.0, **ids), lm_batch,
            note="Lara: gated DeltaNet + sliding attention, shared expert"),
        ZooModel("mellum", "moe", _hf(
            "MellumConfig", "MellumForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            moe_intermediate_size=HIDDEN, num_experts=4, num_experts_per_tok=2,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["sparse", "sparse"], router_aux_loss_coef=0.0,
            attention_dropout=0.0, **ids), lm_batch, note="Mellum 2: sliding / full MoE"),
        ZooModel("minicpm5_moe", "moe", _hf(
            "MiniCPM5MoeConfig", "MiniCPM5MoeForCausalLM", **d, num_key_value_heads=2,
            head_dim=8, moe_intermediate_size=HIDDEN, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1,
            mlp_layer_types=["sparse", "sparse"], attention_dropout=0.0, **ids), lm_batch,
            note="MiniCPM5: sigmoid routing with correction bias, shared expert"),
        ZooModel("zaya", "moe", _hf(
            "ZayaConfig", "ZayaForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            moe_intermediate_size=HIDDEN, num_experts=4, num_experts_per_tok=1,
            router_hidden_size=16, attention_dropout=0.0, **ids), lm_batch,
            note="ZAYA1: CCA attention, MLP router, top-1 of 4"),
        ZooModel("gemma4_moe", "moe", _hf(
            "Gemma4TextConfig", "Gemma4ForCausalLM", **d, num_key_value_heads=2, head_dim=8,
            global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB,
            enable_moe_block=True, num_experts=4, top_k_experts=2,
            moe_intermediate_size=HIDDEN, final_logit_softcapping=30.0,
            attention_dropout=0.0, **ids), lm_batch,
            note="Gemma 4 26B-A4B style: dense MLP + MoE block per layer, k=v global layers"),
        ZooModel("inkling2", "moe", _hf(
            "Inkling2TextConfig", "Inkling2ForCausalLM", **inkling2), lm_batch,
            note="Inkling-2: relative-position hybrid attention, softcapped experts"),
        ZooModel("inkling", "moe", _hf(
            "InklingTextConfig", "InklingForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
            sliding_window_size=8, d_rel=4, rel_extent=16,
            layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["sparse", "sparse"],
            max_position_embeddings=64, intermediate_size=2 * HIDDEN,
            moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, shared_expert_sink=True, num_mtp_layers=0,
            attention_dropout=0.0, _eager_attn=True, **ids), lm_batch,
            note="Inkling: shared experts scored by the router as a sink"),
        ZooModel("inkling2_loop", "moe", _hf(
            "Inkling2LoopTextConfig", "Inkling2LoopForCausalLM", **inkling2,
            loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2,
            loop_gate_rank=4, use_cache=False), lm_batch,
            note="a looped layer run twice (its MoE twice); use_cache=False: its forward "
                 "deep-copies the KV cache"),
    ]


def _encoders() -> list[ZooModel]:
    enc = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=2 * HIDDEN, max_position_embeddings=64,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return [
        ZooModel("bert_mlm", "encoder", _hf("BertConfig", "BertForMaskedLM", **enc), mlm_batch,
                 note="masked-LM head tied to the embeddings"),
        ZooModel("bert_cls", "encoder", _hf("BertConfig", "BertForSequenceClassification", **enc,
                                            num_labels=3),
                 lambda s: {**lm_batch(s), "labels": torch.arange(BATCH) % 3},
                 note="pooler + classifier"),
        ZooModel("roberta_mlm", "encoder", _hf("RobertaConfig", "RobertaForMaskedLM", **enc,
                                               pad_token_id=1), mlm_batch,
                 note="position ids from the padding mask"),
        ZooModel("albert", "encoder", _hf("AlbertConfig", "AlbertForMaskedLM", **enc,
                                          embedding_size=16), mlm_batch,
                 note="one layer's weights shared by every layer, factorised embedding"),
        ZooModel("deberta_v2", "encoder", _hf_eager(
            "DebertaV2Config", "DebertaV2ForMaskedLM", **enc, relative_attention=True,
            position_buckets=8, pos_att_type=["p2c", "c2p"], max_relative_positions=16),
            mlm_batch, note="disentangled attention, relative-position buckets"),
        ZooModel("distilbert", "encoder", _hf_eager(
            "DistilBertConfig", "DistilBertForMaskedLM", vocab_size=VOCAB, dim=HIDDEN, n_layers=2,
            n_heads=4, hidden_dim=2 * HIDDEN, max_position_embeddings=64, dropout=0.0,
            attention_dropout=0.0), mlm_batch, note="no token types"),
        ZooModel("electra", "encoder", _hf("ElectraConfig", "ElectraForMaskedLM", **enc,
                                           embedding_size=16), mlm_batch,
                 note="embedding projection"),
        ZooModel("modernbert", "encoder", _hf(
            "ModernBertConfig", "ModernBertForMaskedLM", vocab_size=VOCAB, hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=8,
            embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0,
            reference_compile=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            cls_token_id=1, sep_token_id=2), mlm_batch,
            note="alternating local (window 8) / global attention, GeGLU, no biases"),
    ]


def _encoder_decoders() -> list[ZooModel]:
    return [
        ZooModel("t5", "encoder-decoder", _hf_eager(
            "T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=HIDDEN, d_kv=8,
            d_ff=2 * HIDDEN, num_layers=2, num_heads=4, dropout_rate=0.0,
            relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0),
            seq2seq_batch, note="relative-position bias, tied embeddings, cross-attention"),
        ZooModel("bart", "encoder-decoder", _hf(
            "BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=HIDDEN,
            encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=2 * HIDDEN, decoder_ffn_dim=2 * HIDDEN,
            max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0), seq2seq_batch, note="learned positions, tied head"),
        ZooModel("whisper", "encoder-decoder", _hf(
            "WhisperConfig", "WhisperForConditionalGeneration", vocab_size=VOCAB,
            num_mel_bins=8, d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * HIDDEN,
            decoder_ffn_dim=2 * HIDDEN, max_source_positions=16, max_target_positions=32,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None,
            pad_token_id=0, bos_token_id=1, eos_token_id=2), speech_batch,
            note="speech: conv1d frontend over mel frames, sinusoidal positions"),
        ZooModel("wav2vec2", "encoder", _hf(
            "Wav2Vec2Config", "Wav2Vec2ForSequenceClassification", hidden_size=HIDDEN,
            num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * HIDDEN,
            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, hidden_dropout=0.0,
            activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0,
            final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, num_labels=3,
            classifier_proj_size=16), audio_batch,
            note="raw audio: conv feature extractor, GroupNorm, weight-normed conv positions"),
    ]


def _visions() -> list[ZooModel]:
    return [
        ZooModel("vit", "vision", _hf(
            "ViTConfig", "ViTForImageClassification", image_size=32, patch_size=8,
            hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=2 * HIDDEN, num_labels=5, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0), image_batch, note="patch transformer, class token"),
        ZooModel("swin", "vision", _hf_eager(
            "SwinConfig", "SwinForImageClassification", image_size=32, patch_size=4,
            embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=5,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0),
            image_batch, note="shifted windows, relative-position table, patch merging"),
        ZooModel("resnet", "vision", _hf_eager(
            "ResNetConfig", "ResNetForImageClassification", embedding_size=8,
            hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=5),
            image_batch, note="convolutions, BatchNorm (running stats updated)"),
        ZooModel("convnext", "vision", _hf_eager(
            "ConvNextConfig", "ConvNextForImageClassification", num_channels=3, patch_size=4,
            hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=5,
            image_size=32),
            image_batch, note="depthwise convolutions, channels-last LayerNorm, layer scale"),
        ZooModel("clip", "vision", _hf(
            "CLIPConfig", "CLIPModel", projection_dim=16,
            text_config=dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                             num_hidden_layers=2, num_attention_heads=4,
                             max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2),
            vision_config=dict(image_size=32, patch_size=8, hidden_size=HIDDEN,
                               intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                               num_attention_heads=4)),
            image_text_batch, loss_fn=contrastive_loss,
            note="two towers, contrastive loss over the whole batch, learned temperature"),
    ]


# --- mid sizes --------------------------------------------------------------------------------------

MID_VOCAB, MID_HIDDEN = 8192, 256


def _mid_lm(step: int) -> dict:
    return lm_batch(step, vocab=MID_VOCAB)


def _mid_mlm(step: int) -> dict:
    """Every position labelled, ids over the whole vocabulary (the tied table's split rows
    are all read)."""
    g = torch.Generator().manual_seed(2100 + step)
    ids = torch.randint(0, MID_VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _mid_seq2seq(step: int) -> dict:
    g = torch.Generator().manual_seed(3100 + step)
    return {"input_ids": torch.randint(2, MID_VOCAB, (BATCH, SEQ), generator=g),
            "labels": torch.randint(2, MID_VOCAB, (BATCH, SEQ // 2), generator=g)}


def _mid_sizes() -> list[ZooModel]:
    """One model per family at a size where the cost model's choices (which linears tp
    splits, how ZeRO and the reduction bucket, where a pipeline cuts) differ from the tiny
    ones': vocabulary 8192, width 256 (the tiny zoo: 128 and 32)."""
    v, h = MID_VOCAB, MID_HIDDEN
    d = dict(vocab_size=v, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64)
    note = f"mid size (vocabulary {v}, width {h}): "
    return [
        ZooModel("gpt2_mid", "causal-lm", _hf(
            "GPT2Config", "GPT2LMHeadModel", vocab_size=v, n_embd=h, n_layer=2, n_head=4,
            n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), _mid_lm,
            note=note + "GPT-2, tied head"),
        ZooModel("llama_mid", "causal-lm", _hf("LlamaConfig", "LlamaForCausalLM", **d,
                                               num_key_value_heads=2), _mid_lm,
                 note=note + "Llama, GQA, untied head"),
        ZooModel("mixtral_mid", "moe", _hf(
            "MixtralConfig", "MixtralForCausalLM", **d, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0), _mid_lm,
            note=note + "Mixtral, top-2 of 4 experts"),
        ZooModel("bert_mlm_mid", "encoder", _hf(
            "BertConfig", "BertForMaskedLM", **d, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0), _mid_mlm,
            note=note + "BERT masked LM, every position labelled, tied decoder"),
        ZooModel("t5_mid", "encoder-decoder", _hf_eager(
            "T5Config", "T5ForConditionalGeneration", vocab_size=v, d_model=h, d_kv=64,
            d_ff=2 * h, num_layers=2, num_heads=4, dropout_rate=0.0,
            relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0),
            _mid_seq2seq, note=note + "T5, tied embeddings"),
        ZooModel("vit_mid", "vision", _hf(
            "ViTConfig", "ViTForImageClassification", image_size=64, patch_size=8,
            hidden_size=h, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * h,
            num_labels=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
            lambda s: image_batch(s, size=64, classes=100),
            note="mid size (width 256, 64 px, 100 classes): ViT"),
    ]


# --- plain PyTorch models -------------------------------------------------------------------------

class TorchViT(nn.Module):
    """A ViT from nn.TransformerEncoder (norm_first, batch_first) with a class token."""

    def __init__(self, size=32, patch=8, dim=HIDDEN, classes=5):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, pixel_values, labels):
        x = self.patch(pixel_values).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return F.cross_entropy(self.head(self.encoder(x)[:, 0]), labels)


class Seq2SeqTransformer(nn.Module):
    """nn.Transformer with embeddings, a causal target mask and an LM head."""

    def __init__(self, dim=HIDDEN):
        super().__init__()
        self.src = nn.Embedding(VOCAB, dim)
        self.tgt = nn.Embedding(VOCAB, dim)
        self.core = nn.Transformer(dim, 4, 2, 2, 2 * dim, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids, labels):
        dec_in = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
        mask = nn.Transformer.generate_square_subsequent_mask(dec_in.shape[1])
        h = self.core(self.src(input_ids), self.tgt(dec_in), tgt_mask=mask, tgt_is_causal=True)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class LSTMLM(nn.Module):
    def __init__(self, dim=HIDDEN):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.rnn = nn.LSTM(dim, dim, num_layers=2, batch_first=True)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, batch):
        ids, targets = batch
        h, _ = self.rnn(self.emb(ids))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class GRUClassifier(nn.Module):
    def __init__(self, dim=HIDDEN):
        super().__init__()
        self.rnn = nn.GRU(dim, dim, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * dim, 5)

    def forward(self, batch):
        x, y = batch
        h, _ = self.rnn(x)
        return F.cross_entropy(self.head(h.mean(1)), y)


class FrozenUnusedBuffers(nn.Module):
    """A frozen embedding (requires_grad=False), a head the loss never reaches, a tied
    alias, and buffers read by the forward (one of them updated every step)."""

    def __init__(self, dim=HIDDEN):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.emb.weight.requires_grad_(False)
        self.proj = nn.Linear(dim, dim)
        self.unused_head = nn.Linear(dim, 7)  # e.g. a pooler or an auxiliary head
        self.out = nn.Linear(dim, VOCAB, bias=False)
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, batch):
        ids, targets = batch
        self.calls.add_(1)
        h = torch.tanh(self.proj(self.emb(ids))) * self.scale
        return F.cross_entropy(self.out(h).flatten(0, 1), targets.flatten())


class ConvBN(nn.Module):
    """Conv -> BatchNorm -> ReLU -> pool -> linear (BatchNorm's batch statistics across ranks).
    The conv has no bias, as before any BatchNorm: its gradient would be zero up to rounding,
    which Adam turns into lr-sized steps that differ with any summation order (and the
    running mean follows them), so no two correct programs agree on it."""

    def __init__(self, classes=5, running_stats=True):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8, track_running_stats=running_stats)
        self.fc = nn.Linear(8, classes)

    def forward(self, pixel_values, labels):
        h = F.relu(self.bn(self.conv(pixel_values))).mean((2, 3))
        return F.cross_entropy(self.fc(h), labels)


class WhereRoutedMoE(nn.Module):
    """An MoE language model routed as hand-written MoE code routes (DeepSeek's and Mistral's
    reference code, litgpt): each expert's tokens picked by torch.where over the top-k ids,
    a shape that depends on the routing (fxpar traces it padded: compiler/padded_nonzero.py)."""

    def __init__(self, dim=HIDDEN, experts=4, k=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(experts))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)
        self.k = k

    def forward(self, batch):
        ids, targets = batch
        x = self.emb(ids).flatten(0, 1)
        weights, indices = self.gate(x).softmax(-1).topk(self.k, -1)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            idx, top = torch.where(indices == i)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        h = self.norm(x + y).view(*ids.shape, -1)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class HitLoopMoE(WhereRoutedMoE):
    """Routed as Hugging Face's MoE models were before transformers 5 (and code copied from
    them): a loop over the experts some token picked (a count set by the data), each looked
    up in the ModuleList by a tensor, its tokens by torch.where over a one_hot's row
    (compiler/padded_nonzero.py runs every expert, proving the absent ones change nothing)."""

    def forward(self, batch):
        ids, targets = batch
        x = self.emb(ids).flatten(0, 1)
        weights, indices = self.gate(x).softmax(-1).topk(self.k, -1)
        y = torch.zeros_like(x)
        mask = F.one_hot(indices, len(self.experts)).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            top, idx = torch.where(mask[e].squeeze(0))
            y.index_add_(0, idx, self.experts[e](x[idx]) * weights[idx, top, None])
        h = self.norm(x + y).view(*ids.shape, -1)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())

class StackedExperts(nn.Module):
    """Hugging Face's eager experts (transformers 5's `_experts_implementation="eager"`, the
    form every HF MoE model can run in): each projection of all experts stacked in one
    parameter [experts, out, in], a loop over the experts some token picked reading each
    expert's matrices by a 0-d tensor index."""

    def __init__(self, dim=HIDDEN, experts=4):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 4 * dim, dim) * dim ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, dim, 2 * dim) * (2 * dim) ** -0.5)

    def forward(self, x, indices, weights):
        y = torch.zeros_like(x)
        mask = F.one_hot(indices, len(self.gate_up_proj)).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            e = e[0]
            top, idx = torch.where(mask[e])
            gate, up = F.linear(x[idx], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.down_proj[e])
            y.index_add_(0, idx, h * weights[idx, top, None])
        return y


class StackedLoopMoE(WhereRoutedMoE):
    """An MoE language model whose experts are Hugging Face's eager experts (StackedExperts):
    compiler/padded_nonzero runs the loop once per expert reading a view of the stack, and
    passes/grouped_experts runs them as grouped matmuls over the stack itself."""

    def __init__(self, dim=HIDDEN, experts=4, k=2):
        super().__init__(dim, experts, k)
        self.experts = StackedExperts(dim, experts)

    def forward(self, batch):
        ids, targets = batch
        x = self.emb(ids).flatten(0, 1)
        weights, indices = self.gate(x).softmax(-1).topk(self.k, -1)
        h = self.norm(x + self.experts(x, indices, weights)).view(*ids.shape, -1)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _pytorch() -> list[ZooModel]:
    return [
        ZooModel("torch_vit", "pytorch", TorchViT, image_batch,
                 note="nn.TransformerEncoder (norm_first, batch_first), class token"),
        ZooModel("nn_transformer", "pytorch", Seq2SeqTransformer, seq2seq_batch,
                 note="nn.Transformer encoder-decoder, causal mask"),
        ZooModel("lstm", "pytorch", LSTMLM, tokens_batch, note="2-layer nn.LSTM language model"),
        ZooModel("gru", "pytorch", GRUClassifier, xy_batch, note="bidirectional nn.GRU"),
        ZooModel("frozen_unused", "pytorch", FrozenUnusedBuffers, tokens_batch,
                 note="frozen embedding, a parameter with no gradient, buffers"),
        ZooModel("convbn", "pytorch", ConvBN, image_batch,
                 note="BatchNorm statistics over the global batch"),
        ZooModel("convbn_nostats", "pytorch", lambda: ConvBN(running_stats=False), image_batch,
                 note="BatchNorm without running buffers: batch statistics, nothing mutated"),
        ZooModel("where_moe", "pytorch", WhereRoutedMoE, tokens_batch,
                 note="MoE routed by torch.where over top-k ids (data-dependent shapes)"),
        ZooModel("hit_loop_moe", "pytorch", HitLoopMoE, tokens_batch,
                 note="MoE looping over the experts some token picked (a data-set count)"),
        ZooModel("stacked_loop_moe", "pytorch", StackedLoopMoE, tokens_batch,
                 note="MoE with stacked experts a loop reads one by one (HF's eager experts)"),
    ]


def models() -> dict[str, ZooModel]:
    """Every zoo model by name."""
    out = {}
    for m in (*_causal_lms(), *_moes(), *more_moes(), *_encoders(), *_encoder_decoders(),
              *_visions(), *_pytorch(), *_mid_sizes()):
        out[m.name] = m
    return out


def build(name: str, seed: int = 1234, dropout: bool = False) -> tuple[nn.Module, ZooModel]:
    """The model, initialised from `seed` (the same weights every time). dropout=True: with
    the dropouts its library's config has by default (`has_default_dropout`)."""
    spec = models()[name]
    torch.manual_seed(seed)
    if dropout:
        return spec.factory.with_default_dropout(), spec
    return spec.factory(), spec


def has_default_dropout(name: str) -> bool:
    """Whether the model's library config has dropouts the zoo sets to 0."""
    return hasattr(models()[name].factory, "with_default_dropout")


def loss_of(model: nn.Module, spec: ZooModel, batch) -> torch.Tensor:
    """The loss eager PyTorch computes for `batch` (what fxpar's default loss_fn does)."""
    if spec.loss_fn is not None:
        out = spec.loss_fn(model, batch)
    else:
        out = model(**batch) if isinstance(batch, dict) else model(batch)
    return out.loss if hasattr(out, "loss") else out
