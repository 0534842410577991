"""Fusion side by side: bytes moved, kernel bandwidth, fxpar vs eager vs torch.compile.

1. Memory traffic (any machine): the cost model's bytes read + written by one training step of
   a GPT, op by op (eager) vs after fxpar's fusion pass, and per kernel kind. The fusion pass
   only needs to know Triton could run (it does not launch anything), so this runs on CPU.
2. On an NVIDIA GPU (skipped without one): achieved bandwidth of each hand-written kernel
   (bytes in + out / time) against the measured device-to-device copy bandwidth, and fxpar's
   kernel vs the eager ATen op vs torch.compile of the same function, for softmax, layer norm,
   cross-entropy (forward + backward) and attention (forward + backward); then one training
   step of a GPT with fusion on vs off vs torch.compile of the eager step.

    .venv/bin/python benchmarks/kernels.py [--quick]
"""
from __future__ import annotations

import argparse
import collections
import os

import torch

from fxpar.compiler import capture as cap
from fxpar.core import cost
from fxpar.compiler.pass_manager import PassContext
from fxpar.core.plan import Plan
from fxpar.examples import models as M
from fxpar.kernels.jit import interpreter
from fxpar.passes import fusion

aten = torch.ops.aten
MiB = 2 ** 20


def traffic(name: str, model, batch):
    gm, sig = cap.capture(model, batch)
    before = sum(sum(cost.node_bytes(n)) for n in gm.graph.nodes)
    with interpreter():  # lets the pass run on CPU; it only rewrites the graph
        gm = fusion.run(gm, fusion.Options(), PassContext(signature=sig, device="cpu"))
    after = sum(sum(cost.node_bytes(n)) for n in gm.graph.nodes)
    d = gm.meta["fusion"]
    per_kind = collections.defaultdict(lambda: [0, 0, 0])
    for g in d.groups:
        k = per_kind[g.kind]
        k[0] += 1
        k[1] += g.bytes_unfused
        k[2] += g.bytes_fused
    print(f"\n{name}: bytes moved per training step (cost model) {before / MiB:.1f} MiB op by "
          f"op -> {after / MiB:.1f} MiB fused = {after / before:.3f}x ({len(d.groups)} kernels)")
    print(f"  {'kernel':<26}{'count':>6}{'unfused MiB':>13}{'fused MiB':>11}{'ratio':>8}")
    for kind, (n, b, a) in sorted(per_kind.items(), key=lambda kv: -kv[1][1]):
        print(f"  {kind:<26}{n:>6}{b / MiB:>13.2f}{a / MiB:>11.2f}{a / b:>8.3f}")
    return after / before


# --- GPU ----------------------------------------------------------------------------------------

def _bench(fn, reps=50):
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=reps) * 1e-3  # seconds


def _nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def gpu_kernels(quick: bool):
    from fxpar.kernels import attention, cross_entropy, layernorm, softmax
    dev = "cuda"
    n = 64 * MiB
    src, dst = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8,
                                                                          device=dev)
    copy_bw = 2 * n / _bench(lambda: dst.copy_(src))
    print(f"\n{torch.cuda.get_device_name()}: device-to-device copy {copy_bw / 1e9:.0f} GB/s")
    M_, N_ = (4096, 4096) if quick else (16384, 4096)
    x = torch.randn(M_, N_, device=dev)
    w, b = torch.randn(N_, device=dev), torch.randn(N_, device=dev)
    V = 32768
    logits = torch.randn(4096 if quick else 8192, V, device=dev, dtype=torch.bfloat16)
    target = torch.randint(0, V, (logits.shape[0],), device=dev)
    B, H, L, D = (4, 16, 1024, 64) if quick else (8, 16, 2048, 128)
    q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16) for _ in range(3))

    def ce_eager(x_, t_):
        return torch.nn.functional.cross_entropy(x_.float(), t_)

    def ce_fx(x_, t_):
        return cross_entropy.cross_entropy_forward(x_, t_, 1, -100)[0]

    def attn_eager(q_, k_, v_):
        return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=True)

    cases = [
        ("softmax", lambda: softmax.softmax_forward(x, -1), lambda: torch.softmax(x, -1),
         lambda x_: torch.softmax(x_, -1), (x,), _nbytes(x) * 2),
        ("layer_norm", lambda: layernorm.layer_norm_forward(x, [N_], w, b, 1e-5),
         lambda: torch.nn.functional.layer_norm(x, [N_], w, b),
         lambda x_: torch.nn.functional.layer_norm(x_, [N_], w, b), (x,), _nbytes(x) * 2),
        ("cross_entropy", lambda: ce_fx(logits, target), lambda: ce_eager(logits, target),
         ce_eager, (logits, target), _nbytes(logits, target)),
        ("attention (causal)", lambda: attention.flash_attention_forward(q, k, v, True),
         lambda: attn_eager(q, k, v), attn_eager, (q, k, v), _nbytes(q, k, v) * 4 // 3),
    ]
    print(f"  {'kernel':<20}{'fxpar ms':>10}{'eager ms':>10}{'compile ms':>12}"
          f"{'fxpar GB/s':>12}{'of copy':>9}{'vs eager':>10}{'vs compile':>12}")
    for name, fx, eager, fn, args, nbytes in cases:
        compiled = torch.compile(fn)
        t_fx, t_eager = _bench(fx), _bench(eager)
        t_c = _bench(lambda: compiled(*args))
        bw = nbytes / t_fx
        print(f"  {name:<20}{t_fx * 1e3:>10.3f}{t_eager * 1e3:>10.3f}{t_c * 1e3:>12.3f}"
              f"{bw / 1e9:>12.0f}{bw / copy_bw:>9.2f}{t_eager / t_fx:>9.2f}x{t_c / t_fx:>11.2f}x")


def gpu_training_step(quick: bool):
    import fxpar
    cfg = M.GPTConfig(vocab_size=8192, block_size=256 if quick else 512, n_layer=4 if quick else 8,
                      n_head=8, n_embd=512)
    batch = [t.cuda() for t in M.gpt_batch(cfg, 8)]
    times = {}
    for fuse in (False, True):
        torch.manual_seed(0)
        model = M.GPT(cfg).cuda()
        pm = fxpar.parallelize(model, 1, example_batch=batch, plan=fxpar.Plan(fuse=fuse),
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
        times["fxpar fused" if fuse else "fxpar unfused"] = _bench(lambda: pm.step(batch), 20)
    torch.manual_seed(0)
    model = M.GPT(cfg).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def eager_step():
        opt.zero_grad(set_to_none=True)
        model(batch).backward()
        opt.step()
    times["eager"] = _bench(eager_step, 20)
    compiled = torch.compile(model)

    def compiled_step():
        opt.zero_grad(set_to_none=True)
        compiled(batch).backward()
        opt.step()
    times["torch.compile"] = _bench(compiled_step, 20)
    base = times["fxpar fused"]
    print(f"\nGPT {cfg.n_layer}x{cfg.n_embd}, T={cfg.block_size}, batch 8, one training step:")
    for k, t in times.items():
        print(f"  {k:<16}{t * 1e3:>9.2f} ms   fxpar fused is {t / base:.2f}x faster")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gpu-only", action="store_true", help="skip the bytes-moved tables")
    args = ap.parse_args()
    torch.manual_seed(0)
    ratios = {}
    if args.gpu_only:
        gpu_kernels(args.quick)
        gpu_training_step(args.quick)
        return
    for name, cfg, batch in (("small GPT 2x32, T=32, batch 4", M.GPTConfig(), 4),
                             ("GPT 4x512, T=256, batch 8", M.GPTConfig(
                                 vocab_size=8192, block_size=256, n_layer=4, n_head=8,
                                 n_embd=512), 8),
                             ("GPT 4x512 with dropout 0.1", M.GPTConfig(
                                 vocab_size=8192, block_size=256, n_layer=4, n_head=8,
                                 n_embd=512, dropout=0.1), 8)):
        ratios[name] = traffic(name, M.GPT(cfg), M.gpt_batch(cfg, batch))
    name = "HF Llama 4x512 (GQA 8/4 heads), T=256, batch 8"
    ratios[name] = traffic(name, M.hf_llama(vocab=8192, hidden=512, layers=4, heads=8,
                                            kv_heads=4, max_pos=256),
                           M.hf_lm_batch(8192, 8, 256))
    print("\nfused/unfused bytes per step: " + ", ".join(f"{k}: {v:.3f}" for k, v in
                                                       ratios.items()))
    if torch.cuda.is_available() and os.environ.get("FXPAR_DEVICE") != "cpu":
        gpu_kernels(args.quick)
        gpu_training_step(args.quick)
    else:
        print("\nno CUDA GPU here: kernel bandwidth and fxpar vs eager vs torch.compile timings "
              "need an NVIDIA GPU (run this script there)")


if __name__ == "__main__":
    main()
