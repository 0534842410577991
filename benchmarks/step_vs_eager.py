"""fxpar's training step on one device vs eager PyTorch and torch.compile, in one run.

Rows, per model (Hugging Face GPT2LMHeadModel and LlamaForCausalLM from configs) and
precision (fp32; bf16 = autocast for eager/torch.compile, Plan.precision="bf16" for fxpar):
eager, torch.compile (default; also mode="reduce-overhead" on CUDA), fxpar with each
Plan.codegen ("inductor": Inductor's kernels; on CUDA "auto", the default, which is Inductor
with any run it refuses left op by op; "eager": op by op), on CUDA also with its
hand-written Triton kernels on/off (codegen="eager") and CUDA graphs on/off. fxpar's compile time (its
codegen row: Inductor, or a load from fxpar's cache) is printed per variant. Every variant
trains its own copy of the same initial weights with AdamW on the same batches. All are built
and warmed up first (the warm-up steps' peak memory above the resident weights is the "peak"
column: it includes a CUDA-graph capture and fxpar's first-call check; "step MiB" is a steady
step's peak: on CUDA above the same weights, so with the gradients, optimizer state and
CUDA-graph pools training holds from then on; on CPU what the step allocates, by the
tracker), then timed interleaved, one step of each per round: this machine's speed drifts, so
the ratio to eager is the median of per-round ratios. Losses are compared with eager's, step
by step.

    .venv/bin/python benchmarks/step_vs_eager.py            # GPU: GPT-2 small + a small Llama
    .venv/bin/python benchmarks/step_vs_eager.py            # CPU: 4 layers x 256, seq 128
    .venv/bin/python benchmarks/step_vs_eager.py --small    # tiny configs (2 x 64, seq 64)
    ... --only "torch.compile,fxpar codegen=inductor" --profile   # some rows; where time goes
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import re
import statistics
import time
import traceback
from unittest import mock

import torch

import fxpar
from fxpar.examples import models as M
from fxpar.runtime.memtrack import measure

SIZES = {  # (model kwargs, rows, sequence length)
    ("gpt2", False): (dict(vocab=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024),
                      8, 1024),
    ("llama", False): (dict(vocab=32000, hidden=768, layers=12, heads=12, kv_heads=4,
                            max_pos=1024), 8, 1024),
    ("gpt2", True): (dict(vocab=512, n_embd=64, n_layer=2, n_head=4, n_positions=64), 4, 64),
    ("llama", True): (dict(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, max_pos=64),
                      4, 64),
    # the CPU default (issue targets): 4 layers x 256, sequence 128, an 8192-token vocabulary
    ("gpt2", "cpu"): (dict(vocab=8192, n_embd=256, n_layer=4, n_head=4, n_positions=128),
                      4, 128),
    ("llama", "cpu"): (dict(vocab=8192, hidden=256, layers=4, heads=4, kv_heads=2,
                            max_pos=128), 4, 128),
}


def _opt(device, fused=None):
    """AdamW as a user writes it: on CUDA fused=True on every side; on CPU torch's default
    (a loop over the tensors) unless `fused` (the peers' "fused AdamW" rows). fxpar with
    codegen="inductor" picks the fused kernel itself where the implementation is left to
    torch (runtime/optim.prefer_fused)."""
    if device.type == "cuda" or fused:
        return lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)
    return lambda ps: torch.optim.AdamW(ps, lr=1e-4)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def variants(base, batch, device, precision, small):
    """name -> a step() returning the loss tensor, each over its own copy of `base`."""
    cuda = device.type == "cuda"
    half = precision == "bf16"

    def eager_like(compile_mode, fused=None):
        model = copy.deepcopy(base).to(device)
        opt = _opt(device, fused)(model.parameters())
        fwd = model if compile_mode is False else torch.compile(model, mode=compile_mode)

        def step():
            opt.zero_grad(set_to_none=True)
            ctx = torch.autocast(device.type, torch.bfloat16) if half else \
                contextlib.nullcontext()
            with ctx:
                loss = fwd(**batch).loss
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    def fx(fuse, graphs, codegen, remat="none", inductor=None, ce_closed=False):
        def build():
            from torch._inductor import config  # (inductor: Inductor settings to compile with)
            from fxpar.passes import fusion
            # ce_closed: an experiment, not a Plan field - the cross-entropy in the closed
            # form Inductor fuses (as on CPU) where fxpar's kernel would be called
            ce = fusion.cross_entropy_for_inductor
            closed = mock.patch.object(fusion, "cross_entropy_for_inductor", lambda gm, triton:
                                       ce(gm, triton=False)) if ce_closed else \
                contextlib.nullcontext()
            with config.patch(inductor or {}), closed:
                pm = fxpar.parallelize(copy.deepcopy(base).to(device), [str(device)],
                                       example_batch=batch, optimizer=_opt(device),
                                       plan=dict(precision=precision, fuse=fuse, remat=remat,
                                                 cuda_graphs=graphs, codegen=codegen))
            step = lambda: pm.step(batch)  # noqa: E731
            step.pm = pm
            return step
        return build

    out = {"eager": lambda: eager_like(False),
           "torch.compile": lambda: eager_like(None)}
    if cuda:
        out["torch.compile reduce-overhead"] = lambda: eager_like("reduce-overhead")
        for graphs in (True, False):  # "auto" (the default): a run Inductor refuses on
            # this GPU stays op by op instead of failing the row (codegen.generate)
            out[f"fxpar codegen=auto graphs={'on' if graphs else 'off'}"] = \
                fx(True, graphs, "auto")
        # remat="auto" with memory to spare: the min-cut recomputes cheap (pointwise, view)
        # ops in the backward where that saves bytes, as torch.compile's partitioner does
        # by default (GPT-2's activation peak -33% at the CPU sizes)
        out["fxpar codegen=auto remat=auto graphs=on"] = fx(True, True, "auto", "auto")
        # every matmul padded to aligned sizes (Inductor pads only where its benchmark says
        # so: on an H100 one of GPT-2's three 50257-wide LM-head matmuls ran 5x slower)
        out["fxpar codegen=auto shape-pad graphs=on"] = fx(True, True, "auto",
                                                           inductor={"force_shape_pad": True})
        # the cross-entropy in closed form instead of fxpar's kernel: on an H200 the kernel's
        # rows had a [N, V] ATen copy and two padding kernels more per step
        out["fxpar codegen=auto ce=closed graphs=on"] = fx(True, True, "auto", ce_closed=True)
        for fuse in (True, False):
            for graphs in (True, False):
                out[f"fxpar codegen=eager fuse={'on' if fuse else 'off'} "
                    f"graphs={'on' if graphs else 'off'}"] = fx(fuse, graphs, "eager")
    else:  # (Triton's fusion only interprets on CPU; CPU ranks never capture)
        out["eager, fused AdamW"] = lambda: eager_like(False, True)
        out["torch.compile, fused AdamW"] = lambda: eager_like(None, True)
        out["fxpar codegen=inductor"] = fx(True, False, "inductor")  # (fuse: the default)
        out["fxpar codegen=inductor remat=auto"] = fx(True, False, "inductor", "auto")
        # without the fusion pass: the cross-entropy as autograd records it, not its closed form
        out["fxpar codegen=inductor fuse=off"] = fx(False, False, "inductor")
        out["fxpar codegen=eager"] = fx(False, False, "eager")
    return out


def run(model_name, precision, device, small, steps, warmup, only=None):
    """small: True (tiny), "cpu" (the CPU default) or False (GPU sizes); only: the variant
    names to run (None: all)."""
    kw, rows, seq = SIZES[(model_name, small)]
    torch.manual_seed(0)
    base = (M.hf_gpt2 if model_name == "gpt2" else M.hf_llama)(**kw)
    vocab = kw["vocab"]
    batch = {k: v.to(device) for k, v in M.hf_lm_batch(vocab, rows, seq).items()}
    steps_of, peak, steady, failed = {}, {}, {}, {}
    built = variants(base, batch, device, precision, small)
    if only is not None and only - set(built):
        raise SystemExit(f"--only: no variant named {sorted(only - set(built))} here; the "
                         f"variants are {list(built)}")
    for name, build in built.items():
        if only is not None and name not in only:
            continue
        try:
            step = build()
            if device.type == "cuda":
                torch.cuda.synchronize()
                resident = torch.cuda.memory_allocated()  # this variant's weights (+ others')
            # CPU memory is tracked with a dispatch mode, which Inductor's code bypasses (and
            # which makes dynamo fall back): no peak for torch.compile's and fxpar's Inductor
            # rows there
            tracked = device.type == "cuda" or not ("torch.compile" in name or
                                                    "inductor" in name)
            p = 0
            for _ in range(warmup):  # compiles, autotunes, captures
                if tracked:
                    _, used = measure(step)
                    p = max(p, used)
                else:
                    step()
            steps_of[name], peak[name] = step, p if tracked else None
            if device.type == "cuda":  # a steady step: what training holds from now on
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                steady[name] = torch.cuda.max_memory_allocated() - resident
            elif tracked:
                steady[name] = measure(step)[1]
            else:  # (every variant takes the same steps: the losses line up)
                step()
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here is a row, not a crash
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            traceback.print_exc()  # the whole story in the log; the table keeps one line
        _sync(device)
    times = {n: [] for n in steps_of}
    losses = {n: [] for n in steps_of}
    names = list(steps_of)
    for r in range(steps):
        for name in (names if r % 2 == 0 else names[::-1]):
            _sync(device)
            t = time.perf_counter()
            loss = steps_of[name]()
            losses[name].append(loss.item())  # syncs
            times[name].append(time.perf_counter() - t)
    return times, losses, peak, steady, failed, steps_of


def report(model_name, precision, device, res, small):
    times, losses, peak, steady, failed, steps_of = res
    kw, rows, seq = SIZES[(model_name, small)]
    print(f"\n{model_name} {kw} rows={rows} seq={seq} {precision} on {device}")
    print(f"{'variant':42s} {'step ms':>9s} {'x eager':>8s} {'peak MiB':>9s} "
          f"{'step MiB':>9s} {'max|dloss|':>11s}  note")
    ref = times.get("eager")
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        ratio = statistics.median(a / b for a, b in zip(ts, ref)) if ref else float("nan")
        dl = max(abs(a - b) for a, b in zip(losses[name], losses["eager"])) \
            if "eager" in losses else float("nan")
        note = ""
        pm = getattr(steps_of[name], "pm", None)
        if pm is not None:
            gen = sum(t for phase, t, *_ in pm.compile_times if phase.startswith("codegen"))
            note = f"compile {sum(t for phase, t, *_ in pm.compile_times if phase != 'other'):.1f} s"
            note += f" (codegen {gen:.1f} s)" if gen else ""
            note += ", captured" if pm.cuda_graphs.capture else ""
            dev = [s.device_s for s in pm.step_stats[-len(ts):] if s.device_s]
            if dev:
                note += f", device busy {statistics.median(dev) / med:.0%}"
            fused = pm.stage_graphs.get("fusion")
            if fused:
                d = next(iter(fused.values())).meta["fusion"]
                note += f", fusion: {d.describe().split(';')[0]}" + (
                    f", {len(d.unpaid)} ops unpaid" if d.unpaid else "")
        mib = f"{peak[name] / 2**20:9.1f}" if peak[name] is not None else f"{'n/a':>9s}"
        held = steady.get(name)
        held_mib = f"{held / 2**20:9.1f}" if held is not None else f"{'n/a':>9s}"
        print(f"{name:42s} {med * 1e3:9.2f} {ratio:8.3f} {mib} {held_mib} "
              f"{dl:11.2e}  {note}")
        out[name] = dict(step_s=med, ratio=ratio, peak=peak[name], step_peak=held,
                         max_dloss=dl)
    for name, why in failed.items():
        print(f"{name:42s} {'-':>9s} {'-':>8s} {'-':>9s} {'-':>9s} {'-':>11s}  failed: {why}")
    return out


def profile(steps_of, device, rows=15):
    """Where each variant's step time goes: torch.profiler over 3 steps, the top kernels by
    device time (CUDA) or ops by CPU time, one table per variant (--profile)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name, step in steps_of.items():
        _sync(device)
        with torch_profile(activities=acts, record_shapes=cuda) as prof:
            for _ in range(3):
                step()
            _sync(device)
        table = prof.key_averages().table(
            sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
            row_limit=rows)
        print(f"\n--- profile: {name} (3 steps) ---\n{table}")
        if cuda:  # which ATen op, on which shapes, launched the costly kernels (the
            # compiled graphs' own rows left out: they hold everything)
            aten_ops = sorted((e for e in prof.key_averages(group_by_input_shape=True)
                               if e.key.startswith("aten::") and e.self_device_time_total),
                              key=lambda e: -e.self_device_time_total)[:20]
            print(f"\n--- {name}: ATen ops by their own GPU time, with input shapes ---")
            for e in aten_ops:
                print(f"{e.self_device_time_total / 1e3:9.3f} ms  x{e.count:<5d} "
                      f"{e.key:40.40s} {str(e.input_shapes)[:110]}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["gpt2", "llama", "both"], default="both")
    ap.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    ap.add_argument("--small", action="store_true",
                    help="tiny configs (2 layers x 64, sequence 64)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default=None,
                    help="comma-separated variant names to run (a comma followed by a "
                         "space is part of a name: 'eager, fused AdamW'; e.g. to fit a GPU "
                         "lease); "
                         "'eager' is always run (the ratios' reference)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timings, each variant's top kernels (CUDA) or ops (CPU) "
                         "by time over 3 steps (torch.profiler)")
    args = ap.parse_args(argv)
    only = None if args.only is None else {  # (", " inside a name: "eager, fused AdamW")
        "eager", *(s.strip() for s in re.split(r",(?! )", args.only))}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = True if args.small else "cpu" if device.type == "cpu" else False
    if device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    results = {}
    for model_name in (["gpt2", "llama"] if args.model == "both" else [args.model]):
        for precision in (["fp32", "bf16"] if args.precision == "both" else [args.precision]):
            res = run(model_name, precision, device, small, args.steps, args.warmup, only)
            results[(model_name, precision)] = report(model_name, precision, device, res,
                                                      small)
            if args.profile:
                profile(res[-1], device)
            del res  # the models, optimizer states and CUDA graph pools of this row set:
            gc.collect()  # held into the next one, they filled an 80 GB GPU (OOM)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
