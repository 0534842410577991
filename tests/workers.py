"""Model zoo and rank functions for the multi-process tests (importable by spawned ranks)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import fxpar
from fxpar.examples import models as M

GLOBAL_BATCH = 8
STEPS = 5


def _lm(vocab=128, seq=16):
    def batches(step):
        return M.hf_lm_batch(vocab, GLOBAL_BATCH, seq, seed=step)
    return batches


def zoo():
    """name -> (model factory, batch_for_step(step), loss_fn or None)."""
    cfg = M.GPTConfig()
    return {
        "mlp": (M.MLP, lambda s: _xy(s, (16,), (4,)), None),
        "sum_loss": (M.SumLossMLP, lambda s: _xy(s, (16,), (4,)), None),
        "gpt": (lambda: M.GPT(cfg), lambda s: M.gpt_batch(cfg, GLOBAL_BATCH, seed=s), None),
        "gpt_padded": (lambda: M.GPT(cfg), lambda s: _padded(cfg, s), None),
        "convbn": (M.ConvBN, lambda s: _img(s), None),
        "hf_gpt2": (M.hf_gpt2, _lm(), None),
        "hf_llama": (M.hf_llama, _lm(), None),
        "hooked_gpt": (M.HookedGPT, lambda s: M.gpt_batch(cfg, GLOBAL_BATCH, seed=s), None),
    }


def sized_zoo():
    """Models at a size where a pass takes the path it takes on real models (each for the test
    that needs it, not in zoo()'s parametrized ones). hf_llama_3x64: a layer's weights outweigh
    the activations at 4 rows over dp=4, as a 12 x 1024 Llama's do: ZeRO-3's overlap prefetch
    is stopped by the memory limit at backward gathers' packing copies."""
    return {"hf_llama_3x64": (lambda: M.hf_llama(vocab=256, hidden=64, layers=3),
                              lambda s: M.hf_lm_batch(256, 4, 16, seed=s), None),
            # Hugging Face MoE models (expert parallelism): the model zoo's configs
            **{name: (lambda name=name: _zoo_model(name), _lm(), None)
               for name in ("mixtral", "qwen2_moe", "deepseek_v3", "jetmoe", "llama4")},
            # with the router's load-balancing loss in the loss (outside the experts)
            "mixtral_aux": (_mixtral_aux, _lm(), None),
            # one sequence a step (context parallelism's long-context case: its tokens
            # flattened are a plain shard of the sequence)
            "mixtral_one_row": (lambda: _zoo_model("mixtral"),
                                lambda s: M.hf_lm_batch(128, 1, 16, seed=s), None),
            # right-padded rows: an attention mask and ignored labels on the padding
            "hf_llama_padded": (M.hf_llama, _padded_lm, None),
            # an MoE whose dispatch reads every row (a capacity): its rows stay gathered
            "capacity_moe": (CapacityMoE, _capacity_batch, capacity_loss),
            # every expert on every token (batched matmuls by [experts, ...] parameters)
            "every_token_moe": (EveryTokenMoE, _capacity_batch, capacity_loss),
            # a scan within chunks of the sequence (context parallelism runs it whole)
            "chunked_scan": (ChunkedScan, _capacity_batch, capacity_loss),
            # MoEs whose experts are an nn.ModuleList, routed by torch.where
            **{name: _zoo_entry(name) for name in ("where_moe", "litgpt_mixtral",
                                                     "stacked_loop_moe")},
            # a norm and an MLP on tokens flattened behind the batch (context parallelism
            # carries the sequence split through them)
            "opt": _zoo_entry("opt"),
            "where_moe_slots": (_where_moe_slots, *_zoo_entry("where_moe")[1:]),
            # experts run in a loop over those nonzero() found hit: transformers' eager
            # experts (Mixtral's), DBRX's
            "mixtral_eager_experts": (_eager_experts, _lm(), None),
            # (GPT-OSS's: expert biases, gate and up interleaved feature by feature)
            "gpt_oss_eager_experts": (lambda: _eager_experts("gpt_oss"), _lm(), None),
            # experts that pick a copy of their weights per row (transformers' batched_mm)
            "mixtral_batched_experts": (lambda: _eager_experts("mixtral", "batched_mm"),
                                        _lm(), None),
            "gpt_oss_batched_experts": (lambda: _eager_experts("gpt_oss", "batched_mm"),
                                        _lm(), None),
            "dbrx": _zoo_entry("dbrx")}


def _where_moe_slots():
    """where_moe with experts 6 features wide, which aten._grouped_mm cannot take (16-byte
    strides): they run as traced, and under ep in slots (passes/expert_parallel)."""
    model = _zoo_model("where_moe")
    d = model.emb.embedding_dim
    torch.manual_seed(1)
    model.experts = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(d, 6), torch.nn.GELU(), torch.nn.Linear(6, d))
        for _ in model.experts)
    return model


def _eager_experts(name="mixtral", implementation="eager"):
    model = _zoo_model(name)
    model.config._experts_implementation = implementation
    return model


def _zoo_entry(name):
    """(factory, batch_for_step, loss_fn) of a model of the zoo or the external zoo."""
    from fxpar.examples import zoo_sweep
    spec = zoo_sweep.registry(name).models()[name]
    return lambda: _zoo_model(name), spec.batch, spec.loss_fn


def _capacity_batch(step):
    g = torch.Generator().manual_seed(step)
    return {"ids": torch.randint(0, 32, (GLOBAL_BATCH, 16), generator=g),
            "labels": torch.randint(0, 32, (GLOBAL_BATCH, 16), generator=g)}


def _padded_lm(step, vocab=128, seq=16):
    b = M.hf_lm_batch(vocab, GLOBAL_BATCH, seq, seed=step)
    mask = torch.ones_like(b["input_ids"])
    for row in range(0, GLOBAL_BATCH, 2):  # every other row padded, by 3 to 9 tokens
        mask[row, seq - 3 - (row + step) % 7:] = 0
    return {**b, "attention_mask": mask, "labels": b["labels"].masked_fill(mask == 0, -100)}


def _mixtral_aux():
    model = _zoo_model("mixtral")
    model.config.router_aux_loss_coef = 0.02
    model.config.output_router_logits = True
    model.router_aux_loss_coef = 0.02
    return model


def _zoo_model(name):
    from fxpar.examples import zoo_sweep
    return zoo_sweep.registry(name).build(name)[0]


def dropout_zoo():
    """Models with dropout > 0 (not comparable to eager: masks are drawn per rank)."""
    cfg = M.GPTConfig(dropout=0.1)
    return {"gpt_dropout": (lambda: M.GPT(cfg), lambda s: M.gpt_batch(cfg, GLOBAL_BATCH, seed=s),
                            None),
            "mlp_dropout": (DropMLP, lambda s: _xy(s, (16,), (4,)), None)}


class DropMLP(torch.nn.Module):
    """An MLP with dropout 0.3 (resuming must replay the same masks: RNG state restored)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.3), torch.nn.Linear(32, 4))

    def forward(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


def _padded(cfg, step):
    """A GPT batch whose first rows are mostly padding (targets -100, ignored by the loss):
    data-parallel ranks count different numbers of targets, so the mean loss is exact only
    if it divides the global sum by the global count."""
    idx, targets = M.gpt_batch(cfg, GLOBAL_BATCH, seed=step)
    targets[: GLOBAL_BATCH // 4, 3 + step:] = -100
    return idx, targets


def _xy(step, xs, ys):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, *xs, generator=g), torch.randn(GLOBAL_BATCH, *ys, generator=g)


def _img(step):
    g = torch.Generator().manual_seed(200 + step)
    return (torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g),
            torch.randint(0, 5, (GLOBAL_BATCH,), generator=g))


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    # eps=1e-6, not 1e-8: some parameters have an exactly-zero true gradient (the key bias
    # under softmax, a bias before BatchNorm), so their gradient is pure rounding noise
    # (~1e-9) that Adam normalises into lr-sized steps; any reordering of float sums (which
    # data parallelism must do) then moves them by O(lr). A larger eps keeps such noise noise.
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-6),
}


def build(name):
    torch.manual_seed(1234)
    factory, batch_fn, loss_fn = {**zoo(), **dropout_zoo(), **sized_zoo()}[name]
    return factory(), batch_fn, loss_fn


def eager_reference(name, opt_name, steps=STEPS):
    model, batch_fn, loss_fn = build(name)
    opt = OPTIMIZERS[opt_name](model.parameters())
    losses = []
    for s in range(steps):
        opt.zero_grad()
        b = batch_fn(s)
        out = loss_fn(model, b) if loss_fn else (model(**b) if isinstance(b, dict) else model(b))
        loss = out.loss if hasattr(out, "loss") else out
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def fxpar_train(name, opt_name, devices, steps=STEPS, plan=None, info=None):
    model, batch_fn, loss_fn = build(name)
    pm = fxpar.parallelize(model, devices, example_batch=batch_fn(0), loss_fn=loss_fn,
                           optimizer=OPTIMIZERS[opt_name],
                           plan="auto" if plan is None else plan)
    if info is not None and "fusion" in pm.stage_graphs:
        d = next(iter(pm.stage_graphs["fusion"].values())).meta["fusion"]
        info["fused_kernels"] = [g.kind for g in d.groups]
    if info is not None and "remat" in pm.stage_graphs:
        info["recomputed"] = len(pm.stage_graphs["remat"]["dp"].meta["remat"].recomputed)
    torch.manual_seed(99)  # dropout masks: the same stream for every plan
    losses = [pm.step(batch_fn(s)).item() for s in range(steps)]
    if info is not None:
        info["eval"] = pm.evaluate(batch_fn(0)).item()  # forward-only program, same plan
    if info is not None and pm.codegen_result is not None:  # (compiled runs, cache hits)
        runs = pm.codegen_result.runs
        info["codegen_runs"] = (len(runs), sum(r.cached or r.reused for r in runs))
    if info is not None and pm.host_optimizer is not None:  # Plan.offload_optimizer
        h, held = pm.host_optimizer, {id(t) for t in pm.params}
        stepped = [t for g in pm.optimizer.param_groups for t in g["params"]]
        info["offloaded"] = {"state_bytes": h.state_bytes(),
                             "steps_masters": not any(id(t) in held for t in stepped),
                             "bytes_out": h.stats["bytes_out"]}
    if info is not None and pm.sharded_optimizer is not None and pm.sharded_optimizer.shards:
        z = pm.sharded_optimizer
        full = 2 * sum(shape.numel() for shape in z.shapes) * z.shards[0].element_size()  # m, v
        info["opt_state_fraction"] = z.state_bytes() / full
        if z.shard_params:  # ZeRO-3: what this rank holds of params + grads + Adam state
            held = sum(s.numel() * s.element_size() for s in z.param_shards) * 2 + z.state_bytes()
            info["model_state_fraction"] = held / (2 * full)  # full: params + grads + m + v
    return losses, pm.full_state_dict()


def plans_rank(cases):
    """Runs on every rank: train each (model, optimizer, plan dict) case; rank 0 returns."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    out = {}
    for name, opt_name, plan in cases:
        info = {}
        losses, state = fxpar_train(name, opt_name, world, plan=plan, info=info)
        out[(name, opt_name, repr(plan))] = (losses, state if rank == 0 else None, info)
    return out


def fusion_rank(cases, steps=3):
    """Each case twice in one launch: fusion off, then on with Triton's interpreter (so the
    fusion pass fuses on CPU). Rank 0 returns {case: (off, on)}."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    out = {}
    for name, opt_name, plan in cases:
        runs = []
        for fuse in (False, True):
            os.environ["TRITON_INTERPRET"] = "1" if fuse else "0"
            info = {}
            losses, state = fxpar_train(name, opt_name, world, steps=steps,
                                        plan={**plan, "fuse": fuse}, info=info)
            runs.append((losses, state if rank == 0 else None, info))
        out[(name, opt_name, repr(plan))] = runs
    return out


def zero_memory_rank(zero):
    """Measured with the tracker on this rank: parameters + gradients + optimizer state.
    Optimizer state = what the first step allocates and leaves alive (AdamW's moments are
    created lazily); gradients = the storages of the graph's gradient outputs; parameters =
    the storages the step reads (full weights, or ZeRO-3 shards)."""
    from fxpar.runtime.memtrack import MemoryTracker
    model, batch_fn, loss_fn = build("gpt")
    pm = fxpar.parallelize(model, int(os.environ["WORLD_SIZE"]), example_batch=batch_fn(0),
                           loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"], plan={"zero": zero})
    with MemoryTracker() as mt:
        pm.step(batch_fn(0))
    opt_state = mt.live_bytes()
    with MemoryTracker() as mt:
        outs = pm._run(pm.program, batch_fn(1))
        n_g = len(pm.program.zero_buckets) if pm.sharded_optimizer else len(pm.params)
        grad_storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                         for t in outs[1:1 + n_g] if t is not None and mt.key(t) is not None}
    held = pm.sharded_optimizer.param_shards if pm.program.params_sharded else pm.params
    params = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for t in held}.values())
    return {"params": params, "grads": sum(grad_storages.values()), "optimizer": opt_state}


def parity_rank(cases, dp):
    """Runs on every rank: train each (model, optimizer) case; rank 0 returns the states."""
    rank = int(os.environ.get("RANK", 0))
    out = {}
    for name, opt_name in cases:
        losses, state = fxpar_train(name, opt_name, dp)
        out[(name, opt_name)] = (losses, state if rank == 0 else None)
    return out


def failing_rank(fail_rank, fail_step):
    """Trains the MLP; `fail_rank` raises at `fail_step` mid-training."""
    model, batch_fn, _ = build("mlp")
    world = int(os.environ["WORLD_SIZE"])
    pm = fxpar.parallelize(model, world, example_batch=batch_fn(0))
    for s in range(5):
        if int(os.environ["RANK"]) == fail_rank and s == fail_step:
            raise RuntimeError(f"injected failure at step {s}")
        pm.step(batch_fn(s))
    return "done"


def zero_with_optimizer_instance():
    """ZeRO needs an optimizer factory; an instance over the full parameters is refused."""
    model, batch_fn, _ = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fxpar.parallelize(model, int(os.environ["WORLD_SIZE"]), example_batch=batch_fn(0),
                      optimizer=opt, plan={"zero": 1})


def overlap_rank(trace_path, zero=0, steps=8, layers=4, embd=256, batch=8, bucket_mb=1e-6):
    """overlap off vs on, same model and batches (one bucket per gradient: communication spread
    over the backward, where overlap has something to hide behind): losses and the median exposed-communication
    fraction of the steps after two warm-up steps (measured by the runtime's recorder)."""
    import statistics
    import torch.distributed as dist
    torch.set_num_threads(1)
    cfg = M.GPTConfig(vocab_size=512, block_size=64, n_layer=layers, n_head=4, n_embd=embd)
    data = M.gpt_batch(cfg, batch)
    out = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        pm = fxpar.parallelize(M.GPT(cfg), int(os.environ["WORLD_SIZE"]), example_batch=data,
                               optimizer=OPTIMIZERS["adamw"],
                               plan={"zero": zero, "overlap": overlap, "bucket_mb": bucket_mb})
        losses = []
        for _ in range(steps):
            dist.barrier()
            losses.append(pm.step(data).item())
        stats = pm.step_stats[2:]
        out[overlap] = {"losses": losses,
                        "exposed": statistics.median(s.exposed_fraction for s in stats),
                        "comm_s": statistics.median(s.comm_s for s in stats),
                        "time_s": statistics.median(s.time_s for s in stats)}
        if overlap:
            pm.trace(trace_path)
    return out


class MatChain(torch.nn.Module):
    """8 equal matmul layers: stage times the roofline model predicts well on a CPU."""

    def __init__(self, n=8, width=512):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False)
                                          for _ in range(n))

    def forward(self, batch):
        x, y = batch
        for lin in self.layers:
            x = torch.relu(lin(x))
        return torch.nn.functional.mse_loss(x, y)


def bubble_rank(trace_dir, schedules=("gpipe", "1f1b", "zero-bubble"), microbatches=4, steps=6,
                rows=2048):
    """pp = world, equal stages (8 equal matmul layers): the idle fraction measured from the
    trace, per schedule: the median over the last three steps (one step on this 2-core VM
    can be off by a few points when a thread is descheduled)."""
    import torch.distributed as dist
    from fxpar.runtime.trace import pipeline_bubble
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    batch = (torch.randn(rows, 512), torch.randn(rows, 512))
    out = {}
    for schedule in schedules:
        model = MatChain()
        pm = fxpar.parallelize(model, world, example_batch=batch, optimizer=OPTIMIZERS["sgd"],
                               plan={"pp": world, "microbatches": microbatches,
                                     "schedule": schedule})
        for _ in range(steps):
            dist.barrier()
            pm.step(batch)
        path = os.path.join(trace_dir, f"{schedule}.json")
        pm.trace(path)
        dist.barrier()
        import json
        from fxpar.core import schedules
        from fxpar.runtime.trace import COMPUTE, last_step_actions, on_track, transfer_latency
        events = json.load(open(path))["traceEvents"]
        took = last_step_actions(events)
        sim = schedules.simulate_schedule(schedules.build(schedule, world, microbatches),
                                 lambda a: took.get((a.kind, a.stage, a.microbatch), 0.0),
                                 p2p_latency=transfer_latency(events))
        rank = int(os.environ["RANK"])
        order = sorted(((e["ts"], e["name"]) for e in events if e.get("pid") == rank
                        and on_track(e, COMPUTE) and e["name"][:1] in "FBIW"
                        and " s" in e["name"] and e["ts"] >= min(
                            x["ts"] for x in events if x.get("cat") == "step"
                            and x["pid"] == rank and x["name"] == f"step {steps - 1}")))
        measured = sorted(pipeline_bubble(events, k) for k in (-1, -2, -3))[1]
        out[schedule] = {"measured": measured, "simulated": sim.bubble_fraction,
                         "ran": [name for _, name in order],
                         "planned": [f"{a.kind}{a.microbatch} s{a.stage}" for a in
                                     schedules.build(schedule, world, microbatches)[rank]
                                     if a.is_compute and took.get((a.kind, a.stage,
                                                                   a.microbatch))],
                         "latency": transfer_latency(events),
                         "imbalance": pm.stage_graphs["pipeline_split"]["dp"].meta[
                             "pipeline"].imbalance}
    return out


def offload_rank(plans, steps=3, layers=4, embd=64, batch=16):
    """Per plan: losses, final params, this rank's peak memory during a step measured with the
    tracker (device memory: host copies are not counted) and the bytes held on host when that
    peak was reached, plus the step's offload statistics.

    The peak leaves out the storages handed to sends (activations and gradients for the other
    stage). A send's buffer is freed when the send completes, and a gloo send completes only
    once the peer has posted its receive and the helper thread waiting on it has run
    (runtime/pipeline._Sends): how many such buffers are still alive at a given point of the
    schedule depends on the other rank's progress and on thread scheduling, so with them the
    peak moves by a few activations from run to run, with or without offloading, and the
    difference of two runs' peaks is not the offloading's alone. Sent values are never
    offloaded (runtime/pipeline._offload), so leaving them out of both runs keeps
    `peak(off) - peak(on) >= host_at_peak(on)` a statement about what offloading moved."""
    import warnings
    from unittest import mock

    import torch.distributed as dist

    from fxpar.runtime.memtrack import MemoryTracker

    class Tracker(MemoryTracker):  # notes the host-resident bytes at each allocation
        def __init__(self, stash):
            super().__init__()
            self.stash, self.host, self.sent = stash, {}, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            first = self._next
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for key in range(first, self._next):
                self.host[key] = self.stash._host_bytes if self.stash else 0
            return out

        def isend(self, t, *args, **kwargs):
            self.sent.add(self.key(t))
            return isend(t, *args, **kwargs)

        def peak_and_host(self):
            """(peak of the live bytes, sent storages left out; host bytes at that peak)"""
            cur = best = host = 0
            for nbytes, key in self.events:  # frees on other threads: sends only, skipped
                if key in self.sent:
                    continue
                cur += nbytes
                if cur > best:
                    best, host = cur, self.host[key]
            return best, host

    isend = dist.isend
    out = []
    for plan in plans:
        torch.manual_seed(0)
        cfg = M.GPTConfig(n_layer=layers, n_embd=embd, block_size=32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = fxpar.parallelize(M.GPT(cfg), int(os.environ.get("WORLD_SIZE", 1)),
                                   example_batch=M.gpt_batch(cfg, batch, seed=0),
                                   optimizer=OPTIMIZERS["adamw"], plan=plan)
        losses = [pm.step(M.gpt_batch(cfg, batch, seed=0))]  # AdamW state made here
        stash = pm.pipeline_runner.stash
        with Tracker(stash) as mt, mock.patch.object(dist, "isend", mt.isend):
            losses.append(pm.step(M.gpt_batch(cfg, batch, seed=1)))
        losses += [pm.step(M.gpt_batch(cfg, batch, seed=s)) for s in range(2, steps)]
        peak, host_at_peak = mt.peak_and_host()
        out.append({"losses": torch.stack(losses), "peak": peak, "host_at_peak": host_at_peak,
                    "stats": dict(stash.stats) if stash is not None else None,
                    "params": {k: v.clone() for k, v in pm.full_state_dict().items()}})
    return out


# --- mixed precision, loss scaling, clipping (tests/test_precision.py) -----------------------

CURVE_LR = 3e-3


def _curve_optimizer(ps):
    return torch.optim.AdamW(ps, lr=CURVE_LR, eps=1e-6)


def _loss_of(model, loss_fn, b):
    out = loss_fn(model, b) if loss_fn else (model(**b) if isinstance(b, dict) else model(b))
    return out.loss if hasattr(out, "loss") else out


def precision_eager_curve(name, steps):
    """fp32 single-process losses over `steps` steps cycling over 4 batches (so the loss
    falls: a learning curve to track, not noise)."""
    model, batch_fn, loss_fn = build(name)
    opt = _curve_optimizer(model.parameters())
    losses = []
    for s in range(steps):
        opt.zero_grad()
        loss = _loss_of(model, loss_fn, batch_fn(s % 4))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def precision_curve_rank(cases, steps):
    """Runs on every rank: each (model, plan) trained like precision_eager_curve; returns
    {(model, repr(plan)): losses} (every rank)."""
    out = {}
    for name, plan in cases:
        model, batch_fn, loss_fn = build(name)
        pm = fxpar.parallelize(model, int(os.environ.get("WORLD_SIZE", 1)),
                               example_batch=batch_fn(0), loss_fn=loss_fn,
                               optimizer=_curve_optimizer, plan=plan)
        out[(name, repr(plan))] = [pm.step(batch_fn(s % 4)).item() for s in range(steps)]
    return out


def clip_eager_reference(name, opt_name, max_norm, steps=STEPS):
    """Single-process training with torch.nn.utils.clip_grad_norm_ before each step:
    (losses, final state, norms)."""
    model, batch_fn, loss_fn = build(name)
    opt = OPTIMIZERS[opt_name](model.parameters())
    losses, norms = [], []
    for s in range(steps):
        opt.zero_grad()
        loss = _loss_of(model, loss_fn, batch_fn(s))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def fp16_overflow_rank(cases, inject_step, steps):
    """fp16 training; at `inject_step` the LAST rank's gradients are made inf (an overflow on
    one rank only, injected where the program hands its gradients to the optimizer step).
    Returns {repr(plan): per step: skipped?, scale after, parameters unchanged?, loss}."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    out = {}
    for name, plan in cases:
        model, batch_fn, loss_fn = build(name)
        pm = fxpar.parallelize(model, world, example_batch=batch_fn(0), loss_fn=loss_fn,
                               optimizer=OPTIMIZERS["adamw"],
                               plan={"precision": "fp16", **plan})
        state = {"step": 0}

        def poison(grads):
            if state["step"] == inject_step and rank == world - 1:
                g = next(g for g in grads if g is not None)
                g.fill_(float("inf"))

        if pm.pipeline_runner is not None:
            run_pipeline = pm._run_pipeline

            def patched(*a, **k):
                loss, grads, bufs = run_pipeline(*a, **k)
                poison(grads)
                return loss, grads, bufs
            pm._run_pipeline = patched
        else:
            run = pm._run

            def patched(program, batch):
                outs = run(program, batch)
                if program is pm.program:
                    poison(outs[1:])
                return outs
            pm._run = patched
        rec = {"skipped": [], "scales": [], "unchanged": [], "losses": []}
        held = pm.sharded_optimizer.param_shards if pm.sharded_optimizer is not None and pm.sharded_optimizer.shard_params \
            else pm.params  # ZeRO-3: this rank's parameter shards
        for s in range(steps):
            state["step"] = s
            before = [p.detach().clone() for p in held]
            skipped = pm.scaler.skipped_steps
            rec["losses"].append(pm.step(batch_fn(s)).item())
            rec["skipped"].append(pm.scaler.skipped_steps > skipped)
            rec["scales"].append(pm.scaler.scale)
            rec["unchanged"].append(all(torch.equal(a, p) for a, p in zip(before, held)))
        rec["eval"] = pm.evaluate(batch_fn(0)).item()
        out[repr(plan)] = rec
    return out


def clip_rank(cases, max_norm, steps):
    """Runs on every rank: each (model, plan) trained with SGD and Plan.max_grad_norm;
    returns {(model, repr(plan)): (losses, norms, full state on rank 0)}."""
    rank = int(os.environ.get("RANK", 0))
    out = {}
    for name, plan in cases:
        model, batch_fn, loss_fn = build(name)
        pm = fxpar.parallelize(model, int(os.environ.get("WORLD_SIZE", 1)),
                               example_batch=batch_fn(0), loss_fn=loss_fn,
                               optimizer=OPTIMIZERS["sgd"],
                               plan={**plan, "max_grad_norm": max_norm})
        losses, norms = [], []
        for s in range(steps):
            losses.append(pm.step(batch_fn(s)).item())
            norms.append(pm.last_grad_norm.item())
        state = pm.full_state_dict()
        out[(name, repr(plan))] = (losses, norms, state if rank == 0 else None)
    return out


def check_clipping(world, cases, max_norm=0.1, steps=3):
    """Each (model, plan) of `cases` trained by clip_rank on `world` ranks: every rank's losses
    and norms agree and equal single-process training with torch.nn.utils.clip_grad_norm_
    (fp32, rtol 1e-5), final parameters too; the clip is active on every step."""
    res = fxpar.launch(clip_rank, world, cases, max_norm, steps)
    for name, plan in cases:
        losses, norms, state = res[0][(name, repr(plan))]
        for r in range(1, world):
            assert res[r][(name, repr(plan))][:2] == (losses, norms), (name, plan)
        ref_losses, ref_state, ref_norms = clip_eager_reference(name, "sgd", max_norm, steps)
        assert min(ref_norms) > max_norm
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5,
                                   atol=0, msg=lambda m: f"{name} {plan} norms: {m}")
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{name} {plan}: {m}")
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name} {plan} {k}: {m}")


# --- checkpoints (tests/test_checkpoint.py) ---------------------------------------------------

RESUME_STEPS, SAVE_AT = 10, 5


def _resume_pm(name, plan, world):
    model, batch_fn, loss_fn = build(name)
    pm = fxpar.parallelize(model, world, example_batch=batch_fn(0), loss_fn=loss_fn,
                           optimizer=OPTIMIZERS["adamw"], plan={**plan, "fuse": False})
    return pm, batch_fn


def resume_save_rank(cases, root):
    """The uninterrupted runs: RESUME_STEPS steps, saving at step SAVE_AT into root/<case>.
    Rank 0 returns {case: (losses, full state after SAVE_AT + 1 steps, final full state)}."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    out = {}
    for case, name, plan in cases:
        pm, batch_fn = _resume_pm(name, plan, world)
        torch.manual_seed(99)
        losses, after_next = [], None
        for s in range(RESUME_STEPS):
            losses.append(pm.step(batch_fn(s)))
            if pm.step_count == SAVE_AT:
                pm.save(os.path.join(root, case), extra={"case": case, "seen": torch.tensor(s)})
            if pm.step_count == SAVE_AT + 1:
                after_next = pm.full_state_dict()
        final = pm.full_state_dict()
        out[case] = (torch.stack(losses), after_next, final) if rank == 0 else None
    return out if rank == 0 else None


def check_resumed_and_resharded(world, model, plan, other, root):
    """Save `plan`'s run at SAVE_AT, then in new processes: `plan` resumes bit for bit, and
    `other` (another plan) loads the same checkpoint and takes the saved run's next step."""
    saved = fxpar.launch(resume_save_rank, world, [("saved", model, plan)], root)[0]
    loads = [("same", ["saved"], model, plan), ("other", ["saved"], model, other)]
    resumed = fxpar.launch(resume_load_rank, world, loads, root)[0]
    k = SAVE_AT
    ref_losses, ref_next, ref_final = saved["saved"]
    losses, _, final, _, start = resumed[("same", "saved")]
    assert start == k and torch.equal(losses, ref_losses[k:])
    assert all(torch.equal(final[n], ref_final[n]) for n in ref_final)
    losses, after_next, _, _, _ = resumed[("other", "saved")]
    torch.testing.assert_close(losses[0], ref_losses[k], rtol=1e-6, atol=0)
    for n, v in ref_next.items():
        torch.testing.assert_close(after_next[n], v, rtol=1e-6, atol=1e-7, msg=n)


def resume_load_rank(cases, root):
    """New processes: build, then for each source checkpoint in turn load it into the same
    model and train to RESUME_STEPS. Rank 0 returns {(case, source): (losses of the steps after
    the checkpoint, full state after one step, final state, extra, step_count after loading)}."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    out = {}
    for case, sources, name, plan in cases:
        pm, batch_fn = _resume_pm(name, plan, world)
        for source in sources:
            torch.manual_seed(12345)  # overwritten by the checkpoint's RNG states
            extra = pm.load(os.path.join(root, source))
            start = pm.step_count
            losses, after_next = [], None
            for s in range(start, RESUME_STEPS):
                losses.append(pm.step(batch_fn(s)))
                if pm.step_count == start + 1:
                    after_next = pm.full_state_dict()
            final = pm.full_state_dict()
            out[(case, source)] = (torch.stack(losses), after_next, final, extra, start) \
                if rank == 0 else None
    return out if rank == 0 else None


# --- faults (tests/test_errors.py) -------------------------------------------------------------

def fault_rank(mode, bad_rank=1, at_step=3, steps=400, plan=None):
    """Trains a 4-layer MLP (plan: dp = world by default); on `bad_rank` at pm.step number
    `at_step`: "kill": a timer SIGKILLs this process 2 ms into the step (mid-step);
    "raise": the step raises (a failing collective input: the batch is the wrong shape);
    "hang": the rank sleeps before the step (a stuck rank: the others hit FXPAR_TIMEOUT)."""
    import signal
    import sys
    import threading
    import time
    torch.manual_seed(0)
    model = MatChain(n=4, width=256)  # compiles fast; a step takes milliseconds

    def batch_fn(s):
        g = torch.Generator().manual_seed(s)
        return torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    pm = fxpar.parallelize(model, world, example_batch=batch_fn(0),
                           plan={"fuse": False, **(plan or {})})
    for s in range(steps):
        if rank == bad_rank and pm.step_count + 1 == at_step:
            if mode == "kill":
                threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGKILL)).start()
            elif mode == "hang":
                time.sleep(3600)
            elif mode == "raise":
                pm.step(tuple(t[:, :3] for t in batch_fn(s)))
        pm.step(batch_fn(s))
        if s == 0:
            print("fxpar-test: first step done", flush=True, file=sys.stderr)
    return "done"


def nan_rank():
    """dp = world: one rank's half of the batch makes log() of a negative number: every rank
    raises NonFiniteLossError at step 2 naming the node (FXPAR_DEBUG_NAN=1)."""
    os.environ["FXPAR_DEBUG_NAN"] = "1"
    model = LogNet()
    x = torch.ones(8, 4)
    pm = fxpar.parallelize(model, int(os.environ["WORLD_SIZE"]), example_batch=x)
    pm.step(x)
    x = x.clone()
    x[-1] = -100.0  # the last rank's shard
    pm.step(x)


class _Log(torch.nn.Module):
    def forward(self, h):
        return torch.log(h)


class LogNet(torch.nn.Module):
    """A loss that is NaN for inputs below zero: log of a positive linear map."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        torch.nn.init.eye_(self.fc.weight)
        torch.nn.init.constant_(self.fc.bias, 1.0)
        self.act = _Log()

    def forward(self, x):
        return self.act(self.fc(x)).mean()


def meta_weights_rank(cases, weights_dir, save_root=None, steps=3):
    """Every rank: build each zoo model on the meta device, parallelize it with
    weights=weights_dir/<name> (saved by save_pretrained from `build(name)`), train `steps`
    AdamW steps; optionally pm.save_pretrained to save_root/<name>/<plan>. Rank 0 returns
    {(name, plan): (losses, full state)}."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    out = {}
    for name, plan, batch_mode in cases:
        factory, batch_fn, loss_fn = {**zoo(), **dropout_zoo(), **sized_zoo()}[name]
        with torch.device("meta"):
            model = factory()
        pm = fxpar.parallelize(model, world, example_batch=batch_fn(0), loss_fn=loss_fn,
                               optimizer=OPTIMIZERS["adamw"], plan=plan,
                               weights=os.path.join(weights_dir, name), batch=batch_mode)
        losses = []
        for s in range(steps):
            b = batch_fn(s)
            if batch_mode == "local":  # this rank's rows, as a DistributedSampler gives
                b = torch.utils._pytree.tree_map_only(
                    torch.Tensor, lambda t: t.chunk(pm.dp_size)[pm.dp_rank] if t.dim() else t, b)
            losses.append(pm.step(b).item())
        if save_root is not None:
            pm.save_pretrained(os.path.join(save_root, name, repr(sorted(plan.items()))))
        state = pm.full_state_dict()
        out[(name, repr(plan), batch_mode)] = (losses, state if rank == 0 else None)
    return out


def misuse_rank(mode, plan="auto"):
    """Rank 0 makes a collective call the other ranks do not (the everyday "print the loss on
    rank 0" mistake); every rank returns the CollectiveMisuse message it got (None: none)."""
    from fxpar.core.errors import CollectiveMisuse
    model, batch_fn, _ = build("mlp")
    pm = fxpar.parallelize(model, int(os.environ["WORLD_SIZE"]), example_batch=batch_fn(0),
                           plan=plan)
    pm.step(batch_fn(0))
    rank = int(os.environ["RANK"])
    try:
        if rank == 0:
            getattr(pm, mode)(batch_fn(1)) if mode == "evaluate" else getattr(pm, mode)()
        if mode != "full_state_dict":  # the others go on training
            pm.step(batch_fn(1))
    except CollectiveMisuse as e:
        return str(e)
    return None


def timeline_rank(runs, steps=2):
    """Per (trace path, plan): a small GPT trained `steps` steps; rank 0 writes the trace."""
    cfg = M.GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
    batch = M.gpt_batch(cfg, 4)
    for path, plan in runs:
        torch.manual_seed(0)
        pm = fxpar.parallelize(M.GPT(cfg), int(os.environ["WORLD_SIZE"]),
                               example_batch=batch, plan=plan)
        for _ in range(steps):
            pm.step(batch)
        pm.trace(path)


def hub_layout_rank(name, weights_dir, plans, steps=2, save_root=None):
    """Every rank: the zoo model `name` built on the meta device and loaded with
    weights=weights_dir (written by transformers' save_pretrained: the Hub's layout), trained
    `steps` AdamW steps under each plan, then (with save_root) pm.save_pretrained to
    save_root/<plan index>. Rank 0 returns {plan: (losses, full state)}."""
    from fxpar.examples import zoo
    spec = zoo.models()[name]
    out = {}
    for plan in plans:
        with torch.device("meta"):
            model = spec.factory()
        pm = fxpar.parallelize(model, int(os.environ.get("WORLD_SIZE", 1)),
                               example_batch=spec.batch(0), loss_fn=spec.loss_fn,
                               optimizer=OPTIMIZERS["adamw"], plan=plan, weights=weights_dir)
        losses = [pm.step(spec.batch(s)).item() for s in range(steps)]
        state = pm.full_state_dict()
        if save_root is not None:
            pm.save_pretrained(os.path.join(save_root, str(plans.index(plan))),
                               max_shard_size=200_000)
        out[repr(plan)] = (losses, state if int(os.environ.get("RANK", 0)) == 0 else None)
    return out


class SortedRowsHalfMatmul(torch.nn.Module):
    """Rows sorted over the whole batch, then a bf16 matmul inside an fp32 model: an MoE's
    token dispatch ahead of its bf16 experts (torchtitan's), at its smallest."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(64, 256, generator=g) * 0.05)

    def forward(self, x):
        t = x.flatten(0, 1)
        r = t[torch.argsort(t[:, 0], stable=True)]
        return (r.bfloat16() @ self.w.bfloat16().t()).float().pow(2).mean()


def sorted_rows_batch():
    return torch.randn(8, 16, 256, generator=torch.Generator().manual_seed(1))


def sorted_rows_rank():
    """One SGD step (lr 1: the update is the gradient) of SortedRowsHalfMatmul under dp=2:
    (loss, w after the step)."""
    pm = fxpar.parallelize(SortedRowsHalfMatmul(), 2, example_batch=sorted_rows_batch(),
                           plan={"dp": 2}, optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    loss = pm.step(sorted_rows_batch()).item()
    return loss, pm.full_state_dict()["w"]


def differing_plans_rank(planned: bool):
    """The PlanError each rank got. planned=False: rank 0 fixes dp=2, rank 1 pp=2 (different
    arguments); True: the same arguments, but rank 1's planner is made to choose otherwise
    (as inputs differing in a way the arguments do not show would)."""
    from fxpar.compiler import planner
    from fxpar.core.errors import PlanError
    model, batch_fn, _ = build("gpt")
    rank = int(os.environ["RANK"])
    fixed = {"dp": 2} if rank == 0 or planned else {"pp": 2}
    if planned and rank == 1:
        planner.auto_plan = _choose_runner_up(planner.auto_plan)
    try:
        fxpar.parallelize(model, 2, example_batch=batch_fn(0), plan=fixed if not planned
                          else "auto")
    except PlanError as e:
        return str(e)
    return None


def _choose_runner_up(auto_plan):
    def wrapped(*args, **kw):
        result = auto_plan(*args, **kw)
        result.best = result.table[1]
        return result
    return wrapped


def sends_rank(nbytes: int) -> tuple:
    """A pipeline send (runtime/pipeline._Sends on gloo) lets go of its tensor once the
    peer has received it, before the step waits on its sends, and its helper thread ends
    with it: (freed before wait_all and the thread gone after, the peer's sum)."""
    import time
    import weakref

    import torch.distributed as dist

    from fxpar.runtime.pipeline import _Sends
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    n = nbytes // 4
    if dist.get_rank() == 0:
        sends, freed = _Sends(threaded=True), []
        t = torch.ones(n)
        weakref.finalize(t.untyped_storage(), freed.append, True)
        sends.add(dist.isend(t, dst=1, tag=7), 1)
        del t
        dist.recv(torch.empty(1), src=1, tag=8)  # the peer has its copy
        deadline = time.time() + 30
        while not freed and time.time() < deadline:
            time.sleep(0.005)
        early = bool(freed)
        sends.wait_all()
        del sends
        import gc
        import threading
        gc.collect()
        deadline = time.time() + 30
        while any(t.name == "fxpar-sends-to-1" for t in threading.enumerate()) \
                and time.time() < deadline:
            time.sleep(0.005)
        gone = not any(t.name == "fxpar-sends-to-1" for t in threading.enumerate())
        return early and gone, None
    buf = torch.empty(n)
    dist.recv(buf, src=0, tag=7)
    dist.send(torch.ones(1), dst=0, tag=8)
    return None, float(buf.sum())


def quantized_rank(plans, steps, data="memorize", lr=1e-3, model=None):
    """Each plan trains the example GPT (or the zoo's `model`) `steps` AdamW steps on 4
    batches in turn (so the loss falls well below its start), or with data="markov" on a
    fresh batch of a Markov chain's language each step (examples/models.markov_batch); AdamW
    at `lr`. Returns {plan: (losses, {collective kind: bytes on the wire in the last step})}
    (Plan.comm_quantization: tests/test_quantized_comm.py, test_expert_parallel.py)."""
    from fxpar.runtime.trace import COMM
    world = int(os.environ["WORLD_SIZE"])
    cfg = M.GPTConfig()
    if model is None:
        build, batch = lambda: M.GPT(cfg), (
            (lambda s: M.gpt_batch(cfg, GLOBAL_BATCH, seed=s % 4)) if data == "memorize" else
            (lambda s: M.markov_batch(cfg, GLOBAL_BATCH, seed=s)))
    else:
        from fxpar.examples import zoo
        spec = zoo.build(model)[1]
        build, batch = (lambda: zoo.build(model)[0]), (lambda s: spec.batch(s % 4))
    out = {}
    for plan in plans:
        torch.manual_seed(1234)
        pm = fxpar.parallelize(build(), world, example_batch=batch(0),
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr, eps=1e-6),
                               plan=plan)
        losses = [pm.step(batch(s)).item() for s in range(steps)]
        kinds: dict = {}
        for span in pm.recorder.steps[-1][3]:
            if span.track == COMM:
                kind = span.name.split()[0]
                kinds[kind] = kinds.get(kind, 0) + span.args["bytes"]
        out[repr(plan)] = (losses, kinds)
    return out


def onebit_mean_rank(steps):
    """1-bit Adam's compressed mean (runtime/onebit_adam.compressed_mean) of the same
    per-rank vectors, `steps` times with the errors carried. Returns (this rank's x, the
    results)."""
    import torch.distributed as dist
    from fxpar.runtime import onebit_adam as ob
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # a vector with blocks of very different magnitudes, as a model's tensors are
    x = torch.randn(4 * world * ob.BLOCK, generator=torch.Generator().manual_seed(rank)) * \
        torch.logspace(-3, 0, 4 * world).repeat_interleave(ob.BLOCK)
    we, se = torch.zeros_like(x), torch.zeros(x.numel() // world)
    blocks = ob.Blocks(torch.full((x.numel() // ob.BLOCK,), float(ob.BLOCK)))
    group = dist.group.WORLD.group_name
    return x, [ob.compressed_mean(x, we, se, blocks, world, rank, group) for _ in range(steps)]


def onebit_exact_mean_rank(name, warmup, steps, plan=None):
    """1-bit Adam with its compressed mean replaced by the exact mean (an all-reduce): what
    is left is the update with the frozen second moment, comparable to a single-process
    reference. The MLP, dp = world (or `plan`'s degrees), optimizer `name` of
    ONEBIT_OPTIMIZERS; returns the losses and the final parameters."""
    import torch.distributed as dist
    from fxpar.runtime import onebit_adam as ob
    world = int(os.environ["WORLD_SIZE"])

    def exact(x, we, se, blocks, dp, rank, group):
        y = x.clone()
        dist.all_reduce(y, group=dist.distributed_c10d._resolve_process_group(group))
        return y / dp
    ob.compressed_mean = exact
    torch.manual_seed(0)
    pm = fxpar.parallelize(M.MLP(), world, example_batch=onebit_batch(0),
                           optimizer=ONEBIT_OPTIMIZERS[name],
                           plan={**(plan or {"dp": world}), "grad_compression": "1bit-adam",
                                 "compression_warmup": warmup})
    losses = [pm.step(onebit_batch(s)).item() for s in range(steps)]
    return losses, pm.full_state_dict()


def onebit_batch(step):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


ONEBIT_OPTIMIZERS = {
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    # (eps: a dead ReLU unit has v = 0 after a 3-step warm-up; its first gradient after it
    # would be divided by eps alone: 1-bit Adam needs a warm-up long enough to see it move)
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99),
                                          eps=1e-3),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, eps=1e-3),
}


def onebit_resume_rank(path, plan, steps_before, steps_after, load_plan=None):
    """Train the example GPT `steps_before` steps under `plan`, save to `path`, build a
    fresh model (under `load_plan`, default `plan`), load it and train `steps_after` more. Returns (losses before, losses after
    the load, whether the 1-bit errors were reset, the optimizer's step count)."""
    world = int(os.environ["WORLD_SIZE"])
    cfg = M.GPTConfig()
    opt = OPTIMIZERS["adamw"]

    def make(plan):
        torch.manual_seed(1234)
        return fxpar.parallelize(M.GPT(cfg), world, example_batch=M.gpt_batch(cfg, GLOBAL_BATCH),
                                 optimizer=opt, plan=plan)
    pm = make(plan)
    before = [pm.step(M.gpt_batch(cfg, GLOBAL_BATCH, seed=s % 4)).item()
              for s in range(steps_before)]
    pm.save(path)
    pm2 = make(load_plan or plan)
    pm2.load(path)
    reset = pm2.onebit.worker_error is None
    after = [pm2.step(M.gpt_batch(cfg, GLOBAL_BATCH, seed=s % 4)).item()
             for s in range(steps_before, steps_before + steps_after)]
    step = int(next(iter(pm2.optimizer.state.values()))["step"])
    return before, after, reset, step


def param_server_rank(plan, steps, slow_rank=None, trace_path=None):
    """The example GPT trained `steps` AdamW steps under `plan` (Plan.ps; rank `slow_rank`
    sleeps 0.2 s before each step: a straggler), then evaluated (and its timeline written to
    `trace_path`). Returns (losses, evaluate's loss, the worker's model state or the server's
    share, pm.ps_stats, why pm.save_pretrained was refused)."""
    import time
    rank = int(os.environ["RANK"])
    cfg = M.GPTConfig()
    torch.manual_seed(1234)
    pm = fxpar.parallelize(M.GPT(cfg), int(os.environ["WORLD_SIZE"]),
                           example_batch=M.gpt_batch(cfg, GLOBAL_BATCH),
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), plan=plan)
    losses = []
    for s in range(steps):
        if rank == slow_rank:
            time.sleep(0.2)
        loss = pm.step(M.gpt_batch(cfg, GLOBAL_BATCH, seed=s))
        losses.append(None if loss is None else loss.item())
    ev = pm.evaluate(M.gpt_batch(cfg, GLOBAL_BATCH, seed=99))
    state = pm.full_state_dict()  # (a server: its share)
    try:  # refused on every rank, before any collective
        pm.save_pretrained("/nonexistent")
        refused = ""
    except fxpar.PlanError as e:
        refused = str(e)
    if trace_path is not None:
        pm.trace(trace_path)
    return (losses, None if ev is None else ev.item(),
            {k: v.detach().clone() for k, v in state.items()}, pm.ps_stats, refused)


def param_server_reference(steps):
    """param_server_rank's training in one eager process on the whole batch."""
    cfg = M.GPTConfig()
    torch.manual_seed(1234)
    model = M.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for s in range(steps):
        loss = model(M.gpt_batch(cfg, GLOBAL_BATCH, seed=s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        ev = model(M.gpt_batch(cfg, GLOBAL_BATCH, seed=99)).item()
    return losses, ev, model.state_dict()


def param_server_convergence_rank(plans, steps, lr):
    """Each plan (Plan.ps) trains a 2-layer GPT on a fresh batch of a Markov chain's language
    each step, AdamW at `lr`, from the same weights; returns {plan: the held-out loss}."""
    cfg = M.GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128)
    out = {}
    for plan in plans:
        torch.manual_seed(0)
        pm = fxpar.parallelize(M.GPT(cfg), int(os.environ["WORLD_SIZE"]),
                               example_batch=M.markov_batch(cfg, 12),
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr), plan=plan)
        for s in range(steps):
            pm.step(M.markov_batch(cfg, 12, seed=s))
        held_out = [pm.evaluate(M.markov_batch(cfg, 12, seed=10_000 + i)) for i in range(4)]
        out[repr(plan)] = None if held_out[0] is None else \
            sum(x.item() for x in held_out) / len(held_out)
    return out


def param_server_checkpoint_rank(plan, path, steps=2):
    """Plan.ps: `steps` steps, save, `steps` more; load, the same `steps` again. Returns
    (the losses after the save, those after the load, the extra load returned)."""
    cfg = M.GPTConfig()
    torch.manual_seed(1234)
    pm = fxpar.parallelize(M.GPT(cfg), int(os.environ["WORLD_SIZE"]),
                           example_batch=M.gpt_batch(cfg, GLOBAL_BATCH),
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), plan=plan)

    def run(first):
        out = [pm.step(M.gpt_batch(cfg, GLOBAL_BATCH, seed=first + s)) for s in range(steps)]
        return [None if x is None else x.item() for x in out]
    run(0)
    pm.save(path, extra={"position": steps})
    after_save = run(steps)
    extra = pm.load(path)
    return after_save, run(steps), extra, pm.step_count


class CapacityMoE(torch.nn.Module):
    """Top-1 routing with an expert capacity (Switch Transformer's): a pair's place in its
    expert's queue, read from the sorted rows, drops those past `capacity`. Which pairs
    drop depends on every row of the batch, so the dispatch cannot run on a rank's rows."""

    def __init__(self, vocab=32, d=16, experts=4, capacity=40):
        super().__init__()
        self.experts, self.capacity = experts, capacity
        self.emb = torch.nn.Embedding(vocab, d)
        self.gate = torch.nn.Linear(d, experts)
        self.w = torch.nn.Parameter(torch.randn(experts, d, d) * 0.1)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids).flatten(0, 1)
        score, expert = self.gate(x).softmax(-1).max(-1)
        ordered, perm = expert.sort()
        counts = torch.histc(ordered.float(), bins=self.experts, min=0, max=self.experts - 1)
        offs = counts.cumsum(0).to(torch.int32)
        place = torch.arange(len(perm)) - (offs.long() - counts.long())[ordered]
        rows = x[perm] * (place < self.capacity).unsqueeze(-1)
        y = torch._grouped_mm(rows, self.w, offs) * score[perm].unsqueeze(-1)
        return self.head(x + torch.zeros_like(x).index_put((perm,), y, accumulate=True))


class EveryTokenMoE(torch.nn.Module):
    """Every expert on every token, each weighted by a softmax over the experts (Llama 4's
    experts also run every token, its top-1 score zeroing the others' inputs), written by
    other hands: the second matrix first (`W h^T`, the tokens on dim 2), a GELU between."""

    def __init__(self, vocab=32, d=16, hidden=32, experts=4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.gate = torch.nn.Linear(d, experts)
        self.w_in = torch.nn.Parameter(torch.randn(experts, d, hidden) / d ** 0.5)
        self.w_out = torch.nn.Parameter(torch.randn(experts, d, hidden) / hidden ** 0.5)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids).flatten(0, 1)
        routed = x.unsqueeze(0) * self.gate(x).softmax(-1).t().unsqueeze(-1)  # [E, T, d]
        h = F.gelu(torch.bmm(routed, self.w_in), approximate="tanh")
        y = torch.bmm(self.w_out, h.transpose(1, 2))  # [E, d, T]
        return self.head(x + y.sum(0).t())


class ChunkedScan(torch.nn.Module):
    """A running sum within chunks of the sequence, the sequence viewed as (chunks, chunk)
    (a linear attention's blocks, Mamba-2's chunked scan): under cp the chunks dim (2 of 8
    tokens here) cannot hold a front and a back piece per rank, so the scan runs whole."""

    def __init__(self, vocab=32, d=16, chunk=8):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(vocab, d), torch.nn.Linear(d, vocab)
        self.chunk = chunk

    def forward(self, ids):
        x = self.emb(ids)
        b, s, d = x.shape
        h = x.view(b, s // self.chunk, self.chunk, d).cumsum(2).view(b, s, d)
        return self.head(torch.tanh(h)).flatten(0, 1)


def capacity_loss(model, batch):
    return F.cross_entropy(model(batch["ids"]), batch["labels"].flatten())


def ring_attention_rank(dtype=torch.float64):
    """fxpar::ring_attention and its backward, causal and not (and causal in float32), on
    this rank's chunks (zigzag) of one q, k, v seeded alike on every rank: {(causal,
    dtype): ((out, grad_q, grad_k, grad_v), the same of SDPA on the whole sequence, cut to
    this rank's chunks)}."""
    import torch.distributed as dist

    from fxpar.core import context_attention  # noqa: F401  (registers the ops)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    n, group = dist.get_world_size(), dist.group.WORLD.group_name
    ops, res = torch.ops.fxpar, {}
    for causal in (True, False, "float32"):  # (causal in float32: its float32 merges)
        dtype, causal = (torch.float32, True) if causal == "float32" else (dtype, causal)
        torch.manual_seed(0)
        B, H, S, D = 2, 3, 8 * n, 4
        q, k, v = (torch.randn(B, H, S, D, dtype=dtype, requires_grad=True) for _ in range(3))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        go = torch.randn_like(ref)
        ref.backward(go)
        qc, kc, vc, gc = (ops.zigzag_chunk(t.detach(), 2, n, group) for t in (q, k, v, go))
        out, lse = ops.ring_attention(qc, kc, vc, 0.0, causal, None, group)
        dq, dk, dv = ops.ring_attention_backward(gc, qc, kc, vc, out, lse, 0.0, causal, None,
                                                 group)
        res[causal, dtype] = ([out, dq, dk, dv], [ops.zigzag_chunk(t.detach(), 2, n, group)
                                                  for t in (ref, q.grad, k.grad, v.grad)])
    return res


def pretrained_round_trip_rank(name, plan, path):
    """Train 2 steps under `plan`, save_pretrained to `path`, and build the model again on the
    meta device from it (parallelize(weights=path)), whose own save_pretrained writes the
    same tensors. Returns (full state, the files' tensors, the reloaded model's full state,
    both models' next loss)."""
    from safetensors.torch import load_file
    model, batch_fn, loss_fn = build(name)
    world = int(os.environ["WORLD_SIZE"])
    pm = fxpar.parallelize(model, world, example_batch=batch_fn(0), loss_fn=loss_fn,
                           optimizer=OPTIMIZERS["adamw"], plan=plan)
    for s in range(2):
        pm.step(batch_fn(s))
    full = {k: v.cpu() for k, v in pm.full_state_dict().items()}
    pm.save_pretrained(path)
    torch.distributed.barrier()
    saved = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            saved.update(load_file(os.path.join(path, f)))
    with torch.device("meta"):
        again = build(name)[0]
    pm2 = fxpar.parallelize(again, world, example_batch=batch_fn(0), loss_fn=loss_fn,
                            optimizer=OPTIMIZERS["adamw"], plan=plan, weights=path)
    reloaded = {k: v.cpu() for k, v in pm2.full_state_dict().items()}
    pm2.save_pretrained(path + "_again")  # (a materialised meta-device model's own save)
    torch.distributed.barrier()
    for f in sorted(os.listdir(path + "_again")):
        if f.endswith(".safetensors"):
            again = load_file(os.path.join(path + "_again", f))
            assert all(torch.equal(v, saved[k]) for k, v in again.items()), f
    return full, saved, reloaded, (pm.step(batch_fn(2)).item(), pm2.step(batch_fn(2)).item())
