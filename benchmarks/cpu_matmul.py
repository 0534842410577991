"""How close the CPU step's matmuls run to this machine's matmul rate.

At the step_vs_eager CPU rows (HF GPT-2 / Llama 4 x 256, 4 x 128 tokens, vocabulary 8192)
ATen's matmuls are 65-78% of eager's step (docs/benchmarks.md, "what bounds the CPU step"),
and eager, torch.compile and fxpar all call them: Inductor's own CPU GEMM template
(max_autotune's "CPP" backend) takes only a constant second operand
(`torch._inductor.utils.use_cpp_gemm_template(require_constant_mat2=True)`: frozen weights,
inference), so training's matmuls have ATen as their one choice. This prints each shape's
rate next to a large product's (2048^3), interleaved, median of the rounds: a shape far
below the large product would be room a layout or a kernel could take.

    .venv/bin/python benchmarks/cpu_matmul.py [--rounds 30]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

# (M, K, N) of mm(a [M, K], b [K, N]): the forward's projections (512 tokens), the
# backward's input and weight gradients, the LM head and its two gradients
SHAPES = [(512, 256, 768), (512, 256, 256), (512, 256, 1024), (512, 1024, 256),
          (256, 512, 768), (768, 512, 256), (256, 512, 1024), (1024, 512, 256),
          (512, 256, 8192), (512, 8192, 256), (8192, 512, 256), (2048, 2048, 2048)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    pairs = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in SHAPES]
    times = [[] for _ in SHAPES]
    for a, b in pairs:  # warm-up: MKL's buffers and threads
        a @ b
    for _ in range(args.rounds):
        for i, (a, b) in enumerate(pairs):
            t0 = time.perf_counter()
            a @ b
            times[i].append(time.perf_counter() - t0)
    rates = [2 * m * k * n / statistics.median(t) / 1e9 for (m, k, n), t in zip(SHAPES, times)]
    peak = rates[-1]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32")
    print(f"{'M x K x N':>18s} {'ms':>8s} {'GFLOP/s':>8s} {'x 2048^3':>9s}")
    for (m, k, n), t, r in zip(SHAPES, times, rates):
        print(f"{f'{m} x {k} x {n}':>18s} {statistics.median(t) * 1e3:8.3f} {r:8.0f} "
              f"{r / peak:9.2f}")
    flops = sum(2 * m * k * n for m, k, n in SHAPES[:-1])
    secs = sum(statistics.median(t) for t in times[:-1])
    print(f"the step's shapes together: {flops / secs / 1e9:.0f} GFLOP/s, "
          f"{flops / secs / 1e9 / peak:.2f}x the 2048^3 rate")


if __name__ == "__main__":
    main()
