"""The first steps against a steady one, at a real vocabulary size: fxpar vs eager vs
torch.compile on one device, each in a fresh process.

A Qwen2-style causal LM (by default width 256, GQA 4/2, a 32,768-token tied head: the logits
and the cross-entropy dominate the activations), or with --model mixtral a Mixtral-style MoE
of that width (8 experts, top-2), AdamW, batch 4 x 256. Per variant: seconds from
the start of `parallelize` / `torch.compile` to the end of the first step ("to step 1 s",
with empty compile caches unless --warm-cache),
the peak memory above the model's weights over that build and the first 3 steps ("first
steps MiB"), and over 3 steady steps after them ("steady MiB"), and their ratio. Memory is
the device's own count: on a GPU the allocator's peak; on CPU the process's peak resident
set (VmHWM, reset between the two phases through /proc/self/clear_refs), which sees
Inductor's buffers and every library's, where a tensor tracker would not.

    .venv/bin/python benchmarks/first_steps.py [--layers 6,24] [--device cpu] [--model mixtral]
    ... --layers 24 --width 896 --vocab 151936 --batch 8 --seq 1024
                                  # (Qwen2.5-0.5B's depth, width and vocabulary)

Prints one row per variant and depth, and fxpar's ratios to eager's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("eager", "torch.compile", "fxpar")


SIZE = {"width": 256, "vocab": 32768, "batch": 4, "seq": 256}  # (--width ... override)


def model_and_batch(layers: int, device: str, width: int, vocab: int, batch: int, seq: int,
                    arch: str = "qwen2"):
    """arch "qwen2": the dense LM above; "mixtral": a Mixtral-style MoE of the same width
    (8 experts of width x 2, top-2, HF's routing by integer indices; untied head)."""
    import torch
    import transformers
    heads = max(2, width // 64)
    common = dict(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=heads // 2,
                  max_position_embeddings=seq)
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=width * 2,
                                         num_local_experts=8, num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    else:
        cfg = transformers.Qwen2Config(**common, intermediate_size=width * 11 // 4,
                                       tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).to(device)
    rows = batch

    def batch_of(step):
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, cfg.vocab_size, (rows, seq), generator=g).to(device)
        return {"input_ids": ids, "labels": ids}
    return model, batch_of


class Peak:
    """Peak memory of this process's device since the last `reset`, in MiB."""

    def __init__(self, device: str):
        import torch
        self.cuda = device.startswith("cuda")
        self.torch = torch

    def _status(self, key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    def now(self) -> int:
        if self.cuda:
            return self.torch.cuda.memory_allocated()
        return self._status("VmRSS:")

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set

    def peak(self) -> int:
        if self.cuda:
            return self.torch.cuda.max_memory_allocated()
        return self._status("VmHWM:")


def child(variant: str, layers: int, device: str, size: dict, arch: str) -> None:
    import torch
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    model, batch = model_and_batch(layers, device, **size, arch=arch)
    mem = Peak(device)
    base = mem.now()
    mem.reset()
    t0 = time.perf_counter()
    if variant == "fxpar":
        import fxpar
        pm = fxpar.parallelize(model, 1, example_batch=batch(0),
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
        step = pm.step
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fwd = torch.compile(model) if variant == "torch.compile" else model

        def step(b):
            opt.zero_grad(set_to_none=True)
            loss = fwd(**b).loss
            loss.backward()
            opt.step()
            return loss
    losses = []
    for s in range(3):
        losses.append(float(step(batch(s))))
        if s == 0:
            first = time.perf_counter() - t0
    warm = mem.peak() - base
    mem.reset()
    for s in range(3, 6):
        losses.append(float(step(batch(s))))
    steady = mem.peak() - base
    print("RESULT " + json.dumps({"first_s": first, "warm": warm / 2**20,
                                  "steady": steady / 2**20, "losses": losses}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="6,24")
    ap.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    ap.add_argument("--only", default=",".join(VARIANTS))
    ap.add_argument("--model", choices=["qwen2", "mixtral"], default="qwen2")
    for k, v in SIZE.items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--warm-cache", action="store_true",
                    help="use the compile caches as they are (default: each process an empty "
                         "one, so 'to step 1' is a first job's)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = {k: getattr(args, k) for k in SIZE}
    if args.child:
        return child(args.child[0], int(args.child[1]), args.device, size, args.model)
    what = ("Mixtral-style MoE (8 experts, top-2)" if args.model == "mixtral" else
            "Qwen2-style LM") + f", width {args.width}, vocab {args.vocab}"
    print(f"device {args.device}; {what} ({'untied' if args.model == 'mixtral' else 'tied'}), "
          f"batch {args.batch} x {args.seq}, AdamW, fp32")
    print(f"{'variant':>14} {'layers':>6} {'to step 1 s':>11} {'first steps MiB':>15} "
          f"{'steady MiB':>10} {'first/steady':>12} {'loss 6':>8}")
    for layers in (int(x) for x in args.layers.split(",")):
        rows = {}
        for v in args.only.split(","):
            with tempfile.TemporaryDirectory(prefix="first-steps-") as cache:
                env = dict(os.environ) if args.warm_cache else {
                    **os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "FXPAR_CACHE_DIR": cache}
                out = subprocess.run([sys.executable, __file__, "--child", v, str(layers),
                                      "--device", args.device, "--model", args.model,
                                      *(f"--{k}={x}" for k, x in size.items())],
                                     capture_output=True, text=True, env=env)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                why = (out.stderr.strip().splitlines() or [""])[-1]
                print(f"{v:>14} {layers:>6} failed: {why}")
                continue
            r = rows[v] = json.loads(line[len("RESULT "):])
            print(f"{v:>14} {layers:>6} {r['first_s']:>11.1f} {r['warm']:>15.0f} "
                  f"{r['steady']:>10.0f} {r['warm'] / max(r['steady'], 1):>12.2f} "
                  f"{r['losses'][-1]:>8.4f}", flush=True)
        if "fxpar" in rows and "eager" in rows:
            f, e = rows["fxpar"], rows["eager"]
            print(f"{'fxpar/eager':>14} {layers:>6} {f['first_s'] / e['first_s']:>11.2f} "
                  f"{f['warm'] / max(e['warm'], 1):>15.2f} "
                  f"{f['steady'] / max(e['steady'], 1):>10.2f}")


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    main()
