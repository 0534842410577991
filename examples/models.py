"""Small models used by the demo, the tests and the benchmarks (nanoGPT-style GPT included)."""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """batch = (x, y); mean-squared-error loss."""

    def __init__(self, d_in=16, d_hidden=32, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, batch):
        x, y = batch
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return F.mse_loss(self.fc3(h), y)


class DeepMLP(nn.Module):
    """`n_blocks` residual blocks x + W2 gelu(W1 x); batch = (x, y); MSE loss. For remat:
    activation memory grows linearly in n_blocks without it."""

    def __init__(self, n_blocks=8, width=64, d_in=16, d_out=4):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                  nn.Linear(2 * width, width))
                                    for _ in range(n_blocks))
        self.out = nn.Linear(width, d_out)

    def forward(self, batch):
        x, y = batch
        h = self.inp(x)
        for blk in self.blocks:
            h = h + blk(h)
        return F.mse_loss(self.out(h), y)


class SumLossMLP(MLP):
    """Same MLP, loss = sum over the batch (not a mean)."""

    def forward(self, batch):
        x, y = batch
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return ((self.fc3(h) - y) ** 2).sum()


class ConvBN(nn.Module):
    """A small conv net with BatchNorm (batch statistics couple the samples)."""

    def __init__(self, classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # BN follows: a bias has ~0 grad
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, classes)

    def forward(self, batch):
        x, y = batch
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return F.cross_entropy(self.head(h.mean(dim=(2, 3))), y)


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 128
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    # "sdpa": F.scaled_dot_product_attention (flash kernels); "manual": softmax(QK^T/sqrt(d))V
    # written out with attention dropout, as in Megatron-LM (whose activation-memory formula
    # the planner's tests check against this form)
    attention: str = "sdpa"


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.manual = cfg.attention == "manual"
        self.attn_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.manual:  # the causal mask is added (an add's backward saves nothing)
            pos = torch.arange(T, device=x.device)
            bias = torch.zeros(T, T, device=x.device, dtype=q.dtype).masked_fill(
                pos[None, :] > pos[:, None], float("-inf"))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1))) + bias
            y = self.attn_dropout(att.softmax(dim=-1)) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT in miniature. batch = (idx, targets), both (B, T) int64; returns the loss."""

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        cfg = cfg or GPTConfig()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        for m in self.modules():  # nanoGPT's init: N(0, 0.02) weights, zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, batch):
        idx, targets = batch
        T = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class FusedQKV(nn.Module):
    """One fused projection for q, k and v, held interleaved per key/value head as
    torchtitan's FusedQKVLinear holds it ((n_kv_heads, heads_per_kv + 2, head_dim, dim)),
    and saved in the stock layout: a state-dict post hook writes `wq/wk/wv.weight` cut from
    `wqkv.weight`, a load pre-hook joins them again. A state dict built by tensor identity
    from a sharded module gets these entries wrong; the model's own hooks on whole tensors
    get them right."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.head_dim, self.n_kv, self.per_kv = dim // n_heads, n_kv_heads, n_heads // n_kv_heads
        self.wqkv = nn.Linear(dim, n_kv_heads * (self.per_kv + 2) * self.head_dim, bias=False)
        self.register_state_dict_post_hook(FusedQKV._split_on_save)
        self.register_load_state_dict_pre_hook(FusedQKV._join_on_load)

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.wqkv(x).view(B, T, -1, self.per_kv + 2, self.head_dim)
        q, k, v = qkv.split([self.per_kv, 1, 1], dim=3)
        return (q.reshape(B, T, -1, self.head_dim), k.reshape(B, T, -1, self.head_dim),
                v.reshape(B, T, -1, self.head_dim))

    @staticmethod
    def _split_on_save(module, state_dict, prefix, local_metadata):
        w = state_dict.pop(prefix + "wqkv.weight")
        w = w.view(module.n_kv, module.per_kv + 2, module.head_dim, -1)
        dim = w.shape[-1]
        state_dict[prefix + "wq.weight"] = w[:, :module.per_kv].reshape(-1, dim).contiguous()
        state_dict[prefix + "wk.weight"] = w[:, module.per_kv].reshape(-1, dim).contiguous()
        state_dict[prefix + "wv.weight"] = w[:, module.per_kv + 1].reshape(-1, dim).contiguous()

    @staticmethod
    def _join_on_load(module, state_dict, prefix, *args):
        if prefix + "wq.weight" not in state_dict:
            return
        q, k, v = (state_dict.pop(prefix + f"w{n}.weight") for n in "qkv")
        dim, shape = q.shape[-1], (module.n_kv, -1, module.head_dim, q.shape[-1])
        state_dict[prefix + "wqkv.weight"] = torch.cat(
            [q.view(shape), k.view(shape), v.view(shape)], dim=1).reshape(-1, dim)


class HookedGPT(nn.Module):
    """A causal LM whose attention is FusedQKV (state-dict hooks, GQA), RMSNorm and an
    untied head: the shape of torchtitan's Llama 3 at a tiny size. batch = (idx, targets)."""

    def __init__(self, vocab=128, dim=32, n_layer=2, n_heads=4, n_kv_heads=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            norm=nn.RMSNorm(dim), qkv=FusedQKV(dim, n_heads, n_kv_heads),
            wo=nn.Linear(dim, dim, bias=False), ffn_norm=nn.RMSNorm(dim),
            ffn=nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.SiLU(),
                              nn.Linear(4 * dim, dim, bias=False)))) for _ in range(n_layer))
        self.norm, self.out = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.n_rep = n_heads // n_kv_heads

    def forward(self, batch):
        idx, targets = batch
        x = self.tok(idx)
        B, T, C = x.shape
        for layer in self.layers:
            q, k, v = (t.transpose(1, 2) for t in layer["qkv"](layer["norm"](x)))
            k, v = (t.repeat_interleave(self.n_rep, dim=1) for t in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + layer["wo"](y.transpose(1, 2).reshape(B, T, C))
            x = x + layer["ffn"](layer["ffn_norm"](x))
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt_batch(cfg: GPTConfig, batch_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def markov_batch(cfg: GPTConfig, batch_size: int, seed: int = 0, successors: int = 4):
    """Token sequences from one fixed random Markov chain (each token followed by one of
    `successors` tokens, equally likely): a language a small LM learns down to its entropy,
    log(successors), from fresh batches - convergence tests compare optimizers on it."""
    nxt = torch.randint(0, cfg.vocab_size, (cfg.vocab_size, successors),
                        generator=torch.Generator().manual_seed(12345))
    g = torch.Generator().manual_seed(seed)
    idx = torch.empty(batch_size, cfg.block_size + 1, dtype=torch.long)
    idx[:, 0] = torch.randint(0, cfg.vocab_size, (batch_size,), generator=g)
    pick = torch.randint(0, successors, (batch_size, cfg.block_size), generator=g)
    for t in range(cfg.block_size):
        idx[:, t + 1] = nxt[idx[:, t], pick[:, t]]
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


# --- Hugging Face transformers models from small configs (no downloads) ---------------------

def hf_gpt2(vocab=128, n_embd=32, n_layer=2, n_head=4, n_positions=32):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                     n_positions=n_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def hf_llama(vocab=128, hidden=32, layers=2, heads=4, kv_heads=2, max_pos=64):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=max_pos)
    return LlamaForCausalLM(cfg)


def hf_bert(vocab=128, hidden=32, layers=2, heads=4, max_pos=64, labels=3):
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=2 * hidden,
                     max_position_embeddings=max_pos, num_labels=labels,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def hf_lm_batch(vocab: int, batch_size: int, seq: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
