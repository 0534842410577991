"""What a mixed-precision step keeps and moves: fxpar's bf16 program vs its fp32 program.

For Hugging Face GPT-2 small and a 12 x 768 Llama at the GPU benchmark's size (8 x 1024
tokens), built on the meta device (nothing runs, any machine): the joint graph after fxpar's
passes, as one device runs it, counted op by op by the cost model (core/cost.py):
- activation peak: cost.simulate_liveness's peak of live activations (what remat budgets);
- bytes written: every op's outputs (views free);
- fp32 [N, V]: fp32 tensors of the logits' size (a copy of the logits, its gradient).
bf16 should keep about half of fp32's bytes; more means fp32 values kept where autocast keeps
half ones. `--triton`: the graph as a GPU with Triton gets it (fxpar's cross-entropy kernel,
planned under TRITON_INTERPRET=1; nothing is launched), else as Inductor's closed form (CPU).

    .venv/bin/python benchmarks/precision_memory.py [--triton] [--small]
"""
from __future__ import annotations

import argparse
import os

import torch

import fxpar
from fxpar.core import cost
from fxpar.examples import models as M

GiB = 2 ** 30
MODELS = {  # name -> (model, vocabulary, rows, sequence)
    "gpt2": (lambda: M.hf_gpt2(vocab=50257, n_embd=768, n_layer=12, n_head=12,
                               n_positions=1024), 50257, 8, 1024),
    "llama": (lambda: M.hf_llama(vocab=32000, hidden=768, layers=12, heads=12, kv_heads=4,
                                 max_pos=1024), 32000, 8, 1024),
}
SMALL = {  # --small (the test's): 2 layers x 64
    "gpt2": (lambda: M.hf_gpt2(vocab=512, n_embd=64, n_layer=2, n_head=4, n_positions=64),
             512, 4, 64),
    "llama": (lambda: M.hf_llama(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2,
                                 max_pos=64), 512, 4, 64),
}


def count(gm: torch.fx.GraphModule, vocab: int, tokens: int) -> tuple[int, int, int]:
    """(activation peak, bytes written, fp32 [N, V] tensors) of a program graph."""
    peak = cost.simulate_liveness(gm, count_inputs=False).peak["activations"]
    written, logits = 0, 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or cost.is_view(n):
            continue
        written += cost.node_bytes(n)[1]
        v = n.meta.get("val")
        logits += isinstance(v, torch.Tensor) and v.dtype == torch.float32 and \
            v.dim() >= 2 and v.shape[-1] == vocab and v.numel() >= tokens * vocab
    return peak, written, logits


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--triton", action="store_true")
    ap.add_argument("--small", action="store_true", help="2 layers x 64 (the test's)")
    args = ap.parse_args(argv)
    old = os.environ.get("TRITON_INTERPRET")
    if args.triton:
        os.environ["TRITON_INTERPRET"] = "1"  # lets the fusion pass plan Triton kernels
    print(f"{'model':6s} {'precision':9s} {'act. peak GiB':>13s} {'written GiB':>12s} "
          f"{'fp32 [N,V]':>10s}")
    out = {}
    try:
        for name, (make, vocab, rows, seq) in (SMALL if args.small else MODELS).items():
            torch.manual_seed(0)
            model = make().to("meta")
            batch = M.hf_lm_batch(vocab, rows, seq)
            for precision in ("fp32", "bf16"):
                prog = fxpar.compile(model, 1, example_batch=batch,
                                     plan=dict(precision=precision, codegen="inductor"))
                out[name, precision] = peak, written, logits = count(prog.graph, vocab,
                                                                     rows * seq)
                print(f"{name:6s} {precision:9s} {peak / GiB:13.2f} {written / GiB:12.2f} "
                      f"{logits:10d}")
            print(f"{name:6s} bf16/fp32 {out[name, 'bf16'][0] / out[name, 'fp32'][0]:13.3f} "
                  f"{out[name, 'bf16'][1] / out[name, 'fp32'][1]:12.3f}")
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return out


if __name__ == "__main__":
    main()
