"""Rematerialization side by side: fxpar vs torch.utils.checkpoint vs PyTorch's min-cut partitioner.

Same model weights, same batch, one run. For each method we measure, on CPU:
  * peak activation memory: the peak bytes allocated during one forward+backward
    (fxpar.runtime.memtrack.measure, a TorchDispatchMode), leaving out the gradients, which
    every method must produce anyway. fxpar's budget is on the same quantity (the joint graph's
    activation peak without gradients), so "fxpar budgeted at M bytes" is comparable with a peer
    that measured M bytes;
  * recompute FLOPs: FlopCounterMode FLOPs of forward+backward minus those of the eager run
    without remat (matmul-like ops only, as FlopCounterMode counts; CPU attention is counted
    with torch's flash-attention formula), also as a fraction of one forward's FLOPs;
  * that the loss and every gradient equal the eager no-remat ones (allclose, rtol 1e-5).
"sim MiB" is fxpar's simulated activation peak (what its budget constrains); "time s" is the
fxpar pass (capture excluded) or the min-cut trace + partition.

Methods: eager without remat; torch.utils.checkpoint around every block; checkpoint_sequential
with round(sqrt(N)) segments (its last segment is not checkpointed); AOTAutograd's
min_cut_rematerialization_partition at several activation_memory_budget values (compiler = run
the fx graphs as they are, no Inductor); fxpar's remat pass on the joint graph, "sqrt" and
budgeted at the memory each peer reached. For DeepMLP a "block" is the residual function
h -> h + blk(h); for GPT it is a transformer Block.

    .venv/bin/python benchmarks/remat.py [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch
import torch.nn.functional as F
from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch.utils.checkpoint import checkpoint, checkpoint_sequential
from torch.utils.flop_counter import FlopCounterMode

from fxpar.compiler import capture as cap
from fxpar.core import cost
from fxpar.core.errors import PlanError
from fxpar.compiler.pass_manager import PassContext
from fxpar.examples import models as M
from fxpar.passes import remat
from fxpar.runtime.memtrack import measure

aten = torch.ops.aten


CPU_SDPA_FLOPS = cost.EXTRA_FLOP_FORMULAS  # torch's flash formulas for CPU attention
MiB = 2 ** 20


class _NoRngReplay(torch.fx.Interpreter):
    """Runs an fxpar graph with its RNG-replay wrappers unwrapped (FlopCounterMode cannot run
    those higher-order ops; the ops inside are the same)."""

    def call_function(self, target, args, kwargs):
        if target is run_and_save_rng_state:
            return torch.get_rng_state(), args[0](*args[1:], **kwargs)
        if target is run_with_rng_state:
            return args[1](*args[2:], **kwargs)
        return super().call_function(target, args, kwargs)


def flops(fn):
    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS) as fc:
        fn()
    return fc.get_total_flops()


# --- the models, written as stem -> blocks -> head so the peers can wrap the blocks ----------

def deep_mlp(quick):
    n, width, bs = (8, 64, 32) if quick else (16, 256, 64)
    torch.manual_seed(0)
    m = M.DeepMLP(n_blocks=n, width=width)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(bs, 16, generator=g), torch.randn(bs, 4, generator=g))
    stem = lambda b: m.inp(b[0])  # noqa: E731
    blocks = [lambda h, blk=blk: h + blk(h) for blk in m.blocks]
    head = lambda h, b: F.mse_loss(m.out(h), b[1])  # noqa: E731
    return f"DeepMLP N={n} width={width} batch={bs}", m, batch, stem, blocks, head


def gpt(quick):
    cfg = (M.GPTConfig(vocab_size=128, block_size=32, n_layer=4, n_head=4, n_embd=64) if quick
           else M.GPTConfig(vocab_size=512, block_size=64, n_layer=8, n_head=4, n_embd=128))
    bs = 4 if quick else 8
    torch.manual_seed(0)
    m = M.GPT(cfg)
    batch = M.gpt_batch(cfg, bs, seed=0)

    def stem(b):
        return m.drop(m.wte(b[0]) + m.wpe(torch.arange(b[0].shape[1])))

    def head(h, b):
        logits = m.lm_head(m.ln_f(h))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), b[1].view(-1))
    name = f"GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} T={cfg.block_size} batch={bs}"
    return name, m, batch, stem, list(m.h), head


# --- runners -----------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    label: str
    peak: int | None         # measured activation peak, bytes (None: infeasible)
    flops: int = 0           # FLOPs of forward+backward
    sim: int | None = None   # fxpar's simulated activation peak
    secs: float | None = None  # fxpar pass / min-cut trace+partition time
    ok: bool = True          # loss and grads equal the eager no-remat ones
    peer: bool = False


def eager_step(model, params, fn):
    for p in model.parameters():
        p.grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), [p.grad for p in params]


def eager_run(model, params, fn):
    """(loss, grads), activation peak (grads left out), FLOPs of one forward+backward."""
    grads = lambda _: [p.grad for p in model.parameters() if p.grad is not None]  # noqa: E731
    out, peak = measure(lambda: eager_step(model, params, fn), exclude=grads)
    return out, peak, flops(lambda: eager_step(model, params, fn))


def bench(name, model, batch, stem, blocks, head, budgets):
    t = time.perf_counter()
    gm, sig = cap.capture(model, batch, None)
    capture_s = time.perf_counter() - t
    P = dict(model.named_parameters(remove_duplicate=False))
    B = dict(model.named_buffers(remove_duplicate=False))
    params = [P[n] for n in sig.param_names]
    inputs = params + [B[n] for n in sig.buffer_names] + cap.flatten_batch(batch, sig)
    n, segs = len(blocks), max(1, round(math.sqrt(len(blocks))))

    def forward(run_blocks):
        return lambda: head(run_blocks(stem(batch)), batch)

    def plain(h):
        for blk in blocks:
            h = blk(h)
        return h

    def per_block(h):
        for blk in blocks:
            h = checkpoint(blk, h, use_reentrant=False)
        return h

    def sequential(h):
        return checkpoint_sequential(blocks, segs, h, use_reentrant=False)

    with torch.no_grad():
        fwd_flops = flops(lambda: model(batch))
    (ref_loss, ref_grads), base_peak, base_flops = eager_run(model, params, forward(plain))
    assert torch.equal(ref_loss, model(batch).detach()), "stem/blocks/head != model.forward"

    def same(loss, grads):
        return all(torch.allclose(a, b, rtol=1e-5)
                   for a, b in zip([loss, *grads], [ref_loss, *ref_grads], strict=True))

    # --- peers
    rows = [Row("no remat (eager)", base_peak, base_flops, peer=True)]
    for label, run_blocks in ((f"checkpoint per block ({n})", per_block),
                              (f"checkpoint_sequential {segs} segments", sequential)):
        out, peak, fl = eager_run(model, params, forward(run_blocks))
        rows.append(Row(label, peak, fl, ok=same(*out), peer=True))
    nop = lambda g, _: make_boxed_func(g.forward)  # noqa: E731  run the partitioned graphs as-is
    named = dict(model.named_parameters())  # tied weights once
    functional = lambda ps, b: torch.func.functional_call(model, ps, (b,))  # noqa: E731
    for b in budgets:
        t = time.perf_counter()
        with torch._functorch.config.patch(activation_memory_budget=b):
            compiled = aot_function(functional, fw_compiler=nop, bw_compiler=nop,
                                    partition_fn=min_cut_rematerialization_partition)
            eager_step(model, params, lambda: compiled(named, batch))  # traces and partitions
        secs = time.perf_counter() - t
        out, peak, fl = eager_run(model, params, lambda: compiled(named, batch))
        rows.append(Row(f"min-cut budget {b}", peak, fl, secs=secs, ok=same(*out), peer=True))
    peers = [r for r in rows if r.peer]

    # --- fxpar on the joint graph: no remat, "sqrt", and budgeted at each peer's memory
    def fx(label, mode):
        t = time.perf_counter()
        try:
            g = gm if mode == "none" else remat.run(gm, remat.Options(remat=mode, dp=1),
                                                    PassContext(signature=sig))
        except PlanError:
            return Row(label, None)
        g.recompile()
        secs = time.perf_counter() - t
        with torch.no_grad():
            outs, peak = measure(lambda: g(*inputs), exclude=lambda o: o[1:1 + len(params)])
            fl = flops(lambda: _NoRngReplay(g).run(*inputs))
        sim = g.meta["remat"].peak_after if "remat" in g.meta else None
        return Row(label, peak, fl, sim, secs, same(outs[0], outs[1:1 + len(params)]))

    rows += [fx("fxpar no remat (joint graph)", "none"), fx('fxpar "sqrt"', "sqrt")]
    at = {}  # budget -> fxpar row
    for r in peers:
        if r.peak not in at:
            at[r.peak] = fx(f"fxpar budget {r.peak / MiB:.2f} MiB", r.peak)
            rows.append(at[r.peak])

    print(f"\n{name}: one forward = {fwd_flops / 1e6:.0f} MFLOP, eager fwd+bwd = "
          f"{base_flops / 1e6:.0f} MFLOP, fxpar capture {capture_s:.1f} s")
    print(f"{'method':<36} {'act MiB':>8} {'/ none':>7} {'sim MiB':>8} {'recompute MFLOP':>16} "
          f"{'/ fwd':>6} {'time s':>7}  loss+grads")
    for r in rows:
        if r.peak is None:
            print(f"{r.label:<36} {'infeasible (PlanError)':>8}")
            continue
        rf = r.flops - base_flops
        print(f"{r.label:<36} {r.peak / MiB:>8.2f} {r.peak / base_peak:>7.2f} "
              f"{'' if r.sim is None else f'{r.sim / MiB:.2f}':>8} {rf / 1e6:>16.1f} "
              f"{rf / fwd_flops:>6.2f} {'' if r.secs is None else f'{r.secs:.2f}':>7}  "
              f"{'equal' if r.ok else 'MISMATCH'}")

    print(f"\n{name}: fxpar budgeted at each peer's memory M vs the best peer within M (MFLOP)")
    wins = 0
    for r in peers:
        best = min(p.flops for p in peers if p.peak <= r.peak) - base_flops
        f = at[r.peak]
        if f.peak is None:
            verdict, fxs = "NO (infeasible)", "infeasible"
        else:
            ok = f.flops - base_flops <= best and f.peak <= r.peak
            wins += ok
            verdict = "yes" if ok else "NO"
            fxs = f"{(f.flops - base_flops) / 1e6:.1f} at {f.peak / MiB:.2f} MiB"
        print(f"  {r.label:<34} M={r.peak / MiB:6.2f} MiB  peer {(r.flops - base_flops) / 1e6:7.1f}"
              f"  best<=M {best / 1e6:7.1f}  fxpar {fxs:<20}  fxpar<=best: {verdict}")
    print(f"  fxpar <= best peer at {wins}/{len(peers)} memory points")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)  # FLOP counts and memory do not depend on it; steadier timings
    budgets = [1.0, 0.3, 0.0] if args.quick else [1.0, 0.5, 0.3, 0.1, 0.0]
    print(f"torch {torch.__version__}, CPU")
    for make in (deep_mlp, gpt):
        bench(*make(args.quick), budgets)


if __name__ == "__main__":
    main()
