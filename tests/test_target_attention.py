"""Planning a GPU from a CPU: attention traced as the CUDA kernel it would run there
(compiler/target_attention.py), not the CPU's math composite with its saved probabilities."""
import collections

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar.compiler import capture as cap
from fxpar.compiler import target_attention as ta
from fxpar.compiler.compile import planner_stats
from fxpar.core import cost

aten = torch.ops.aten


class MLAttention(nn.Module):
    """Attention whose query/key head dim differs from the value's (DeepSeek's MLA: 192 and
    128), which the CPU runs as the math composite."""

    def __init__(self, d=64, heads=4, qk=24, v=16, vocab=64):
        super().__init__()
        self.heads, self.qk, self.v = heads, qk, v
        self.emb = nn.Embedding(vocab, d)
        self.q = nn.Linear(d, heads * qk)
        self.k = nn.Linear(d, heads * qk)
        self.vp = nn.Linear(d, heads * v)
        self.o = nn.Linear(heads * v, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, labels):
        x = self.emb(ids)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.qk).transpose(1, 2)
        k = self.k(x).view(b, s, self.heads, self.qk).transpose(1, 2)
        v = self.vp(x).view(b, s, self.heads, self.v).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return F.cross_entropy(self.head(y).flatten(0, 1), labels.flatten())


def _targets(gm):
    return collections.Counter(str(n.target) for n in gm.graph.nodes
                               if n.op == "call_function")


def test_the_kernel_cuda_would_pick():
    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")
    q, k = t(2, 4, 8, 64), t(2, 4, 8, 64)
    assert ta.kernel(q, k, t(2, 4, 8, 64), None) == "flash"
    assert ta.kernel(q, k, t(2, 4, 8, 32), None) == "efficient"  # (value's own head dim)
    assert ta.kernel(q, k, t(2, 4, 8, 64), t(2, 1, 8, 8)) == "efficient"  # (a mask)
    q32, k32 = t(2, 4, 8, 64, dtype=torch.float32), t(2, 4, 8, 64, dtype=torch.float32)
    assert ta.kernel(q32, k32, t(2, 4, 8, 64, dtype=torch.float32), None) == "efficient"
    assert ta.kernel(t(2, 4, 8, 304), t(2, 4, 8, 304), t(2, 4, 8, 304), None) == "efficient"
    assert ta.kernel(t(2, 4, 8, 20), t(2, 4, 8, 20), t(2, 4, 8, 20), None) == "flash"
    assert ta.kernel(t(2, 4, 8, 20), t(2, 4, 8, 20), t(2, 4, 8, 12), None) == "math"


def test_a_gpu_plan_prices_the_fused_kernel_not_the_cpu_composite():
    torch.manual_seed(0)
    model, seq = MLAttention(), 256
    ids = torch.randint(0, 64, (2, seq))
    batch = {"ids": ids, "labels": ids}
    cpu = planner_stats(model, batch, device="cpu")
    gpu = planner_stats(model, batch, device="cuda")
    on_cpu, on_gpu = _targets(cpu.graph[0]), _targets(gpu.graph[0])
    assert on_cpu["aten._safe_softmax.default"] == 1  # (the math composite, on this CPU)
    assert on_gpu["aten._scaled_dot_product_efficient_attention.default"] == 1
    assert on_gpu["aten._scaled_dot_product_efficient_attention_backward.default"] == 1
    assert not on_gpu["aten._safe_softmax.default"] and not on_gpu["aten.bmm.default"]
    # the probabilities (2 x 4 heads x 256 x 256 fp32 = 2 MiB) are what the CPU saves beyond
    # the GPU's output and log-sum-exp (8 KiB)
    probs = 2 * 4 * seq * seq * 4
    saved_cpu = sum(s.saved for s in cpu.segments)
    saved_gpu = sum(s.saved for s in gpu.segments)
    assert saved_cpu - saved_gpu >= 0.99 * probs, (saved_cpu, saved_gpu)
    # the attention's FLOPs (q k^T and p v, forward and backward), now seen as attention
    assert sum(s.n_attn for s in gpu.segments) == 1
    flops = {n.target: cost.node_flops(n) for n in gpu.graph[0].graph.nodes
             if "efficient_attention" in str(n.target)}
    fwd = flops[aten._scaled_dot_product_efficient_attention.default]
    # (every query against the keys up to it: (L+1)/2L of FlopCounterMode's pairs)
    assert fwd == int(2 * 2 * 4 * seq * seq * (24 + 16) * (seq + 1) / (2 * seq)), fwd


def test_flash_where_the_head_dims_match_in_half_precision():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(32, 96, dtype=torch.bfloat16)

        def forward(self, x):
            q, k, v = self.w(x).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).float().square().mean()
    gm, _ = cap.capture_as_is(Attn(), torch.randn(2, 16, 32, dtype=torch.bfloat16),
                              lambda m, b: m(b), target="cuda")
    targets = _targets(gm)
    assert targets["aten._scaled_dot_product_flash_attention.default"] == 1
    assert targets["aten._scaled_dot_product_flash_attention_backward.default"] == 1
    # a plan for the CPU keeps the CPU's kernel
    gm, _ = cap.capture_as_is(Attn(), torch.randn(2, 16, 32, dtype=torch.bfloat16),
                              lambda m, b: m(b), target="cpu")
    assert _targets(gm)["aten._scaled_dot_product_flash_attention_for_cpu.default"] == 1
