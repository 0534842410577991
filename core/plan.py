"""fxpar.Plan: how to parallelize; validation with messages that say how to fix the plan."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from fxpar.core.errors import PlanError
from fxpar.core import schedules

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
REMATS = ("none", "sqrt", "auto")
PRECISIONS = ("fp32", "bf16", "fp16")
TP_STYLES = ("auto", "all-reduce", "all-gather")
CODEGENS = ("auto", "inductor", "eager")
CP_ATTENTIONS = ("auto", "gather", "ring")
COMM_QUANTIZATIONS = ("none", "weights", "gradients", "weights+gradients")
GRAD_COMPRESSIONS = ("none", "1bit-adam")


@dataclasses.dataclass
class Plan:
    """Parallelization plan. Degrees multiply to the world size: dp * tp * pp (+ ps) == world.

    dp, tp, pp:     data / tensor / pipeline parallel degrees (None = decided by "auto").
    microbatches:   pipeline microbatches per step.
    schedule:       pipeline schedule: "gpipe" | "1f1b" | "interleaved" | "zero-bubble".
    remat:          "none" | "sqrt" | "auto" | memory budget in bytes.
    zero:           ZeRO stage 0..3 over the dp group (over its shard groups with dp_shard).
    dp_shard:       hierarchical sharding (HSDP, MiCS): with zero >= 1, ZeRO shards over
                    groups of dp_shard ranks (neighbouring ranks: one node when dp_shard is the
                    GPUs per node) and the dp // dp_shard groups hold replicas. A bucket's
                    gradients are reduce-scattered within the shard group and the shard
                    all-reduced across the replicas; ZeRO-3's parameter all-gathers stay
                    within the shard group. None (default): one shard group of all dp ranks.
                    "node": the dp ranks of one node (the launcher's LOCAL_WORLD_SIZE, as
                    torchrun sets it; on one node that is all of them: plain ZeRO).
    hpz:            ZeRO++'s hierarchical partitioning (hpZ), with zero=3: each layer's
                    weights, all-gathered over every dp rank for the forward, also leave a
                    secondary shard of 1/hpz on each rank (groups of hpz neighbouring dp
                    ranks: a node), kept to the backward, whose all-gathers then run within
                    the group. Costs 1/hpz of the parameters per rank between forward and
                    backward; parameters, gradients and optimizer state stay 1/dp. None
                    (default): off. pp = 1 and one microbatch.
    ep:             expert parallelism, carved out of dp: the experts of every MoE layer
                    (found on the graph as grouped matmuls: Hugging Face's default experts)
                    split over groups of ep neighbouring dp ranks, each rank holding and
                    computing E/ep of them; the layer's routed rows are summed over the group
                    where they leave it (passes/expert_parallel.py). 1 (default): off. Divides
                    dp (with HSDP, dp_shard: each expert group inside a shard group); composes
                    with tp, pp and ZeRO (an expert weight's gradients reduced and sharded over
                    the dp / ep ranks holding the same experts; with HSDP over those of its
                    shard group, then across the replicas) and cp (each rank's own tokens
                    sent to their experts; one of ep and cp dividing the other, not with HSDP
                    as well); not yet with ps, hpZ or gradient compression.
    cp:             context parallelism, carved out of dp: groups of cp neighbouring dp ranks
                    take the same rows of the batch and split their sequence, each rank
                    holding 1/cp of every activation but attention's keys and values, which
                    reach every rank (Plan.cp_attention; passes/context_parallel.py). 1
                    (default): off. Divides dp; the sequence splits into 2 x cp chunks (each
                    rank a front and a back one); composes with dp, tp, pp, microbatches,
                    ZeRO, HSDP (cp dividing dp_shard: each cp group inside a shard group)
                    and ep (Plan.ep), not yet with ps, hpZ or gradient compression.
    cp_attention:   how cp's attention reads the whole sequence's keys and values: "gather"
                    (all-gathered over the cp group, their gradients reduce-scattered),
                    "ring" (ring attention: each rank's blocks passed around the group by
                    send/recv beside the blocks' kernels, never gathered: no rank holds the
                    whole keys/values, which at long sequences do not fit; attention without
                    a mask or dropout), "auto" (default): ring where it can run and the cost
                    model prices it no slower, per attention (plan="auto" searches both).
    pp_outer:       the device mesh's order. False (default): tp innermost (neighbouring
                    ranks), then pp, then dp (a pipeline's stages on neighbouring ranks, the
                    dp groups and the ep, cp and shard groups carved from them spanning
                    tp x pp ranks). True: pp outermost, as Megatron-Core orders them (each
                    stage's dp group on tp x dp neighbouring ranks, a node where that is the
                    GPUs per node; the pipeline's sends crossing nodes). Needs pp > 1 and
                    dp > 1 (plan="auto" prices both orders against the topology).
    precision:      "fp32" | "bf16" | "fp16".
    codegen:        "auto" (default) | "inductor" | "eager": how each rank's graph runs.
                    "inductor": the compute between collectives compiled by Inductor (fused
                    C++/OpenMP kernels on CPU, Triton on GPUs; compiler/codegen.py), once per
                    role and cached on disk; "eager": op by op. "auto": Inductor where a C++
                    compiler (CPU) or Triton (GPU) is there; FXPAR_CODEGEN=eager|inductor
                    overrides "auto".
    fuse:           Triton fusion pass on/off (default on). With codegen="eager": softmax,
                    norms, cross-entropy, attention as fxpar's hand-written Triton kernels
                    on GPUs (on CPU only under TRITON_INTERPRET=1, otherwise the pass
                    logs why and fuses nothing). With Inductor (one fuser), only the hand-
                    written cross-entropy kernel (measured faster than torch.compile's) stays;
                    where it cannot run (CPU) the cross-entropy becomes its closed form for
                    Inductor to fuse. fuse=False leaves both out.
    overlap:        communication/computation overlap pass on/off (on: collectives start as
                    early and are waited on as late as dependencies and memory allow).
    bucket_mb:      gradient bucket size in MiB; None = sized by the cost model's alpha-beta
                    estimate against the backward's compute time.
    sequence_parallel: with tp > 1, the activations between the split matmuls (norms,
                    dropout, residual adds) are split over the sequence dimension too: each
                    all-reduce becomes a reduce-scatter + all-gather (same bytes, 1/tp of
                    those activations per rank).
    tp_style:       "all-reduce": column -> row pairs (the row output all-reduced), other
                    linears whole; "all-gather": every linear split by output features and its
                    output all-gathered right away (no row splits); "auto" (default): pairs,
                    and a linear without a row partner split + gathered where the cost model
                    says that beats computing it whole on every rank.
    offload:        with pp > 1 or microbatches > 1: the activations a microbatch keeps for
                    its backward move to host memory while other microbatches run, and come
                    back one action before that backward (runtime/offload.py).
    offload_optimizer: the optimizer's state and a master copy of what it steps (this rank's
                    parameters, with ZeRO its shards) live in host memory; each step copies
                    the gradients out, steps on the CPU and copies the updated tensors back
                    (DeepSpeed's ZeRO-Offload; runtime/host_optimizer.py). Saves the state's
                    device memory (AdamW: twice the parameters) for PCIe copies and a CPU step.
                    Needs an optimizer factory. On a CPU device it saves nothing.
    comm_quantization: ZeRO++'s compressed collectives, lossy by design (never chosen by
                    "auto"; not with Plan.verify): "weights" (qwZ): ZeRO-3's parameter
                    all-gathers carry int8 values in blocks of 256 with a 2-byte scale each
                    (~0.254x fp32's bytes); "gradients" (qgZ): ZeRO-2/3's gradient
                    reduce-scatters become an all-to-all of int4 values in blocks of 64
                    (~0.141x), each rank dequantizing and summing its shard in fp32;
                    "weights+gradients"; "none" (default; core/quantized_comm.py).
    grad_compression: "1bit-adam" (lossy by design, never chosen by "auto"): 1-bit Adam
                    (Tang et al. 2021, DeepSpeed's OneBitAdam) with the user's torch.optim
                    Adam / AdamW. The first `compression_warmup` steps are the user's Adam
                    exactly (gradients all-reduced); then Adam's second moment is frozen and
                    each rank folds its own gradient into the momentum, which is averaged over
                    the dp group as one sign bit per value plus a scale per block of 256, with
                    error feedback on every rank (~0.035x the all-reduce's bytes;
                    runtime/onebit_adam.py). Needs dp > 1, zero=0, one microbatch, pp=1, no
                    max_grad_norm, no fp16 and an optimizer factory. "none" (default).
    compression_warmup: steps of exact Adam before grad_compression starts (default 100;
                    >= 1: the frozen second moment comes from them).
    max_grad_norm:  clip gradients by their global norm over the whole model (every tp / pp /
                    ZeRO shard counted once), as torch.nn.utils.clip_grad_norm_; None = off.
    cuda_graphs:    "auto" (default) | True | False: on CUDA devices, after two warm-up steps
                    the forward+backward graph is captured as a CUDA graph and replayed each
                    step (one launch instead of one Python dispatch per op; runtime/cudagraph.py).
                    "auto" captures where the program allows it (pp=1, microbatches=1, NCCL
                    collectives, no data-dependent shapes) and logs why not elsewhere; True
                    also captures each pipeline part, and raises a PlanError naming what
                    prevents a capture; CPU ranks never capture.
    batch_stats:    "whole" (default) | "microbatch": with microbatches > 1, what batch
                    statistics mean. "whole": one step equals one step on the whole batch, so
                    a model whose forward couples the batch's rows (BatchNorm's statistics) or
                    whose buffers move by more than a sum (BatchNorm's running statistics) is
                    refused; buffers that only add (an MoE's tokens-per-expert counter) are
                    summed over the microbatches, exactly. "microbatch": as gradient
                    accumulation in eager PyTorch: each microbatch normalises by its own
                    statistics (over its rows on every dp rank) and updates the running
                    buffers, in order - not what one step on the whole batch does.
    ps:             parameter-server data parallelism (runtime/param_server.py): this many
                    server ranks (the last ps ranks of the job) own the parameters - each a
                    share of them, whole tensors - and the optimizer; the dp worker ranks
                    push their gradients to them and pull the updated parameters back. 0
                    (default): all-reduce data parallelism. Never chosen by "auto". Needs
                    tp = pp = 1, one microbatch, zero=0, an optimizer factory, no
                    max_grad_norm, fp16, verify, offload_optimizer or compression.
    ps_staleness:   with ps > 0: 0 (default) is synchronous and exact (step t's update is the
                    sum of every worker's gradient, as all-reduce dp's); k > 0 is
                    asynchronous with bounded staleness k: a worker's step t reads the newest
                    parameters the servers hold, at least those after update t-k, and update t
                    averages the step-t gradients of the workers that pushed them before a
                    worker needed it (a worker k steps past t); a worker left out skips the
                    steps already applied (its pm.step returns None for them). See
                    docs/reference.md, "Parameter servers".
    verify:         check the first step against one plain process on the same batch (rank 0
                    runs the model in eager PyTorch on the whole weights) and raise
                    VerifyError naming the first tensor that differs (runtime/verify.py;
                    FXPAR_VERIFY=1 turns it on for any plan). Costs one whole copy of the
                    model's training state on rank 0, once.
    """
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    microbatches: int = 1
    schedule: str = "1f1b"
    remat: Any = "none"
    zero: int = 0
    dp_shard: int | None = None
    hpz: int | None = None
    ep: int = 1
    cp: int = 1
    cp_attention: str = "auto"
    pp_outer: bool = False
    precision: str = "fp32"
    codegen: str = "auto"
    fuse: bool = True
    overlap: bool = True
    bucket_mb: float | None = None
    sequence_parallel: bool = False
    tp_style: str = "auto"
    offload: bool = False
    offload_optimizer: bool = False
    comm_quantization: str = "none"
    grad_compression: str = "none"
    compression_warmup: int = 100
    max_grad_norm: float | None = None
    cuda_graphs: Any = "auto"
    batch_stats: str = "whole"
    verify: bool = False
    ps: int = 0
    ps_staleness: int = 0

    @classmethod
    def from_any(cls, plan: Any) -> "Plan | str":
        if plan is None or plan == "auto":
            return "auto"
        if isinstance(plan, Plan):
            return dataclasses.replace(plan)
        if isinstance(plan, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(plan) - known)
            if unknown:
                raise PlanError(f"unknown Plan field(s) {unknown}; valid fields are "
                                f"{sorted(known)}.")
            return cls(**plan)
        raise PlanError(f"plan must be 'auto', a fxpar.Plan or a dict of Plan fields, "
                        f"not {type(plan).__name__}.")

    @property
    def shard_ranks(self) -> int:
        """The ranks ZeRO shards over: dp, or its shard groups' size with dp_shard (HSDP)."""
        return self.dp_shard if self.hsdp else self.dp

    @property
    def node_group(self) -> int | None:
        """The size of the dp sub-group of neighbouring ranks (the device mesh's "dp_shard"):
        HSDP's shard group or hpZ's secondary partition; None without either."""
        return self.dp_shard if self.hsdp else self.hpz

    @property
    def hsdp(self) -> bool:
        """ZeRO shards within groups smaller than dp and replicates across them."""
        return bool(self.dp_shard) and self.dp_shard < self.dp

    @property
    def microbatched(self) -> bool:
        """The step runs as parts per microbatch and stage (runtime/pipeline.py), gradients
        summed over the microbatches and reduced once in the R part; else one joint graph."""
        return self.pp > 1 or self.microbatches > 1

    def validate(self, world_size: int) -> "Plan":
        for name in ("dp", "tp", "pp", "microbatches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"Plan.{name} must be a positive integer, got {v!r}.")
        for name in ("ps", "ps_staleness"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise PlanError(f"Plan.{name} must be an integer >= 0, got {v!r}.")
        ranks = self.dp * self.tp * self.pp + self.ps
        if ranks != world_size:
            servers = f" + ps = {self.ps}" if self.ps else ""
            raise PlanError(
                f"world size {world_size} does not match the plan: dp*tp*pp{' + ps' if self.ps else ''}"
                f" = {self.dp}*{self.tp}*{self.pp}{servers} = {ranks}. Launch "
                f"{ranks} ranks (torchrun --nproc-per-node {ranks}) or change the degrees so "
                f"they make {world_size}.")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"Plan.schedule {self.schedule!r} unknown; choose one of {SCHEDULES}.")
        if self.microbatched:
            try:  # e.g. interleaved needs microbatches to be a multiple of pp
                schedules.build(self.schedule, self.pp, self.microbatches,
                                2 if self.schedule == "interleaved" else 1)
            except ValueError as e:
                raise PlanError(f"Plan.schedule={self.schedule!r} with pp={self.pp}, "
                                f"microbatches={self.microbatches}: {e}") from None
        if not (self.remat in REMATS or (isinstance(self.remat, (int, float))
                                         and not isinstance(self.remat, bool) and self.remat > 0)):
            raise PlanError(f"Plan.remat must be one of {REMATS} or a memory budget in bytes, "
                            f"got {self.remat!r}.")
        if self.zero not in (0, 1, 2, 3):
            raise PlanError(f"Plan.zero must be 0, 1, 2 or 3, got {self.zero!r}.")
        misfit = hsdp_misfit(self.dp_shard, self.dp, self.zero) or hpz_misfit(
            self.hpz, self.dp, self.zero, self.pp, self.microbatches, self.dp_shard)
        if misfit:
            raise PlanError(misfit)
        misfit = ep_misfit(self) or cp_misfit(self)
        if misfit:
            raise PlanError(misfit)
        if self.cp_attention not in CP_ATTENTIONS:
            raise PlanError(f"Plan.cp_attention must be one of {CP_ATTENTIONS}, got "
                            f"{self.cp_attention!r}.")
        if self.cp_attention != "auto" and self.cp == 1:
            raise PlanError(f"Plan.cp_attention={self.cp_attention!r} says how context "
                            "parallelism's attention reads the keys and values, but cp=1 "
                            "splits no sequence. Set cp > 1, or leave cp_attention 'auto'.")
        if self.precision not in PRECISIONS:
            raise PlanError(f"Plan.precision must be one of {PRECISIONS}, got {self.precision!r}.")
        if self.bucket_mb is not None and not (
                isinstance(self.bucket_mb, (int, float)) and self.bucket_mb > 0):
            raise PlanError(f"Plan.bucket_mb must be a positive number of MiB or None (sized by "
                            f"the cost model), got {self.bucket_mb!r}.")
        if not isinstance(self.overlap, bool):
            raise PlanError(f"Plan.overlap must be True or False, got {self.overlap!r}.")
        if self.sequence_parallel not in (True, False):
            raise PlanError("Plan.sequence_parallel must be True or False, got "
                            f"{self.sequence_parallel!r}.")
        if self.offload not in (True, False):
            raise PlanError(f"Plan.offload must be True or False, got {self.offload!r}.")
        if self.offload and self.pp == 1 and self.microbatches == 1:
            raise PlanError("Plan.offload moves the saved activations of microbatches that wait "
                            "for their backward to host memory; with pp=1 and microbatches=1 "
                            "none wait. Use microbatches > 1 (e.g. with schedule='gpipe') or "
                            "pp > 1, or remat to save activation memory instead.")
        if self.pp_outer not in (True, False):
            raise PlanError(f"Plan.pp_outer must be True or False, got {self.pp_outer!r}.")
        if self.pp_outer and (self.pp == 1 or self.dp == 1):
            raise PlanError(f"Plan.pp_outer=True orders the pipeline's stages outside the dp "
                            f"groups; with pp={self.pp} and dp={self.dp} there is no such "
                            "order to choose. Leave pp_outer False, or use pp > 1 and dp > 1.")
        if self.offload_optimizer not in (True, False):
            raise PlanError(f"Plan.offload_optimizer must be True or False, got "
                            f"{self.offload_optimizer!r}.")
        if self.comm_quantization not in COMM_QUANTIZATIONS:
            raise PlanError(f"Plan.comm_quantization must be one of {COMM_QUANTIZATIONS}, got "
                            f"{self.comm_quantization!r}.")
        misfit = quantization_misfit(self.comm_quantization, self.zero, self.dp)
        if misfit:
            raise PlanError(misfit)
        if self.verify and self.comm_quantization != "none":
            raise PlanError("Plan.verify checks the first step against exact single-process "
                            f"training; comm_quantization={self.comm_quantization!r} is lossy "
                            "by design and would fail it. Verify the plan without it first.")
        misfit = compression_misfit(self) or server_misfit(self)
        if misfit:
            raise PlanError(misfit)
        if self.max_grad_norm is not None and not (
                isinstance(self.max_grad_norm, (int, float)) and
                not isinstance(self.max_grad_norm, bool) and self.max_grad_norm > 0):
            raise PlanError(f"Plan.max_grad_norm must be a positive number (clip the gradients' "
                            f"global norm to it) or None (no clipping), got "
                            f"{self.max_grad_norm!r}.")
        if self.codegen not in CODEGENS:
            raise PlanError(f"Plan.codegen must be one of {CODEGENS}, got {self.codegen!r}.")
        if not (self.cuda_graphs == "auto" or isinstance(self.cuda_graphs, bool)):
            raise PlanError(f"Plan.cuda_graphs must be 'auto', True or False, got "
                            f"{self.cuda_graphs!r}.")
        if self.batch_stats not in ("whole", "microbatch"):
            raise PlanError(f"Plan.batch_stats must be 'whole' or 'microbatch', got "
                            f"{self.batch_stats!r}.")
        if not isinstance(self.verify, bool):
            raise PlanError(f"Plan.verify must be True or False, got {self.verify!r}.")
        if self.tp_style not in TP_STYLES:
            raise PlanError(f"Plan.tp_style must be one of {TP_STYLES}, got {self.tp_style!r}.")
        if self.sequence_parallel and self.tp_style == "all-gather":
            raise PlanError("Plan.sequence_parallel splits the activations between a row split "
                            "and the next column split; tp_style='all-gather' has no row "
                            "splits. Use tp_style='auto' or 'all-reduce' with it.")
        if self.sequence_parallel and self.tp == 1:
            raise PlanError("Plan.sequence_parallel splits the activations between tensor-"
                            "parallel matmuls over the sequence: it needs tp > 1.")
        return self


def hsdp_misfit(dp_shard, dp: int, zero: int) -> str | None:
    """Why Plan.dp_shard cannot run with this dp and ZeRO stage, or None: the one rule
    Plan.validate and the planner's candidates share."""
    if dp_shard is None:
        return None
    if not isinstance(dp_shard, int) or isinstance(dp_shard, bool) or dp_shard < 1:
        return (f"Plan.dp_shard must be a positive integer, 'node' or None, got "
                f"{dp_shard!r}.")
    if dp_shard == 1 or dp % dp_shard:
        return (f"Plan.dp_shard={dp_shard} must divide dp={dp} into shard groups of at least "
                f"2 ranks (each group holds one copy of the ZeRO shards): use a divisor of "
                f"{dp} between 2 and {dp}, or zero=0 for plain data parallelism.")
    if dp_shard < dp and not zero:
        return (f"Plan.dp_shard={dp_shard} shards ZeRO's state within groups of {dp_shard} "
                f"ranks, but zero=0 shards nothing: use zero=1, 2 or 3 with it (zero=3 is "
                "HSDP), or leave dp_shard unset.")
    return None


def hpz_misfit(hpz, dp: int, zero: int, pp: int, microbatches: int,
               dp_shard=None) -> str | None:
    """Why Plan.hpz cannot run with these fields, or None (None or 0: off): the one rule
    Plan.validate and the planner's candidates share."""
    h = hpz
    if h is None or (type(h) is int and h == 0):
        return None
    if not isinstance(h, int) or isinstance(h, bool):
        return f"Plan.hpz must be a positive integer or None, got {h!r}."
    why = "hpZ keeps a secondary shard of each layer's weights for its backward gather"
    if zero != 3:
        return f"Plan.hpz={h}: {why}; it needs zero=3 (got zero={zero})."
    if not 1 < h < dp or dp % h:
        return (f"Plan.hpz={h} must divide dp={dp} into groups of at least 2 ranks and "
                "fewer than dp (e.g. the GPUs per node).")
    if dp_shard and dp_shard < dp:
        return ("Plan.hpz and dp_shard < dp cannot be combined: HSDP already keeps ZeRO's "
                "gathers within its shard groups. Use one of them.")
    if pp > 1 or microbatches > 1:
        return (f"Plan.hpz={h}: {why} inside one graph; it runs with pp=1 and one "
                f"microbatch (got pp={pp}, microbatches={microbatches}).")
    return None


def _carved_misfit(plan: "Plan", axis: str, what: str) -> tuple[int, str | None]:
    """(degree, why not or None) of an axis carved out of dp (Plan.ep, Plan.cp): a positive
    integer dividing dp and, with HSDP, its shard groups; never with ps, hpZ or gradient
    compression. The why is then `... this plan also has <fields>`."""
    n = getattr(plan, axis)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return 1, f"Plan.{axis} must be a positive integer (1: off), got {n!r}."
    if n == 1:
        return 1, None
    if plan.dp % n:
        return n, (f"Plan.{axis}={n} splits {what} over groups of {axis} data-parallel ranks: "
                   f"it must divide dp={plan.dp}. Use an {axis} that divides dp, or a larger dp.")
    if plan.hsdp and plan.dp_shard % n:
        return n, (f"Plan.{axis}={n} with HSDP (dp_shard={plan.dp_shard}): each group of {axis} "
                   f"ranks lies inside a shard group, so {axis} must divide dp_shard. Use an "
                   f"{axis} that divides {plan.dp_shard}, or a larger dp_shard.")
    others = [f"ps={plan.ps}"] if plan.ps else []
    if plan.hpz:
        others.append(f"hpz={plan.hpz}")
    if plan.grad_compression != "none":
        others.append(f"grad_compression={plan.grad_compression!r}")
    return n, (f"this plan also has {', '.join(others)}" if others else None)


def ep_misfit(plan: "Plan") -> str | None:
    """Why Plan.ep cannot run with the plan's other fields, or None: the one rule Plan.validate
    and the planner's candidates share."""
    ep, why = _carved_misfit(plan, "ep", "the experts")
    if why is None or why.startswith("Plan."):
        return why
    return (f"Plan.ep={ep} runs with dp, tp, pp, ZeRO, HSDP and cp, but not yet with ps, hpZ or "
            f"gradient compression; {why}. Drop those fields, or use ep=1 (the experts are "
            "then ZeRO-sharded or replicated like any weight).")


def cp_misfit(plan: "Plan") -> str | None:
    """Why Plan.cp cannot run with the plan's other fields, or None: the one rule Plan.validate
    and the planner's candidates share."""
    cp, why = _carved_misfit(plan, "cp", "the sequence")
    if why is None and cp > 1 and isinstance(plan.ep, int) and plan.ep > 1:
        if max(cp, plan.ep) % min(cp, plan.ep):
            return (f"Plan.cp={cp} with ep={plan.ep}: the smaller of the sequence's and the "
                    "experts' groups lies inside the larger, so one must divide the other. "
                    "Use degrees that nest (e.g. cp=2 with ep=2 or 4).")
        if plan.hsdp:
            why = f"this plan also has ep={plan.ep} and dp_shard={plan.dp_shard}"
    if why is None or why.startswith("Plan."):
        return why
    return (f"Plan.cp={cp} runs with dp, tp, pp, microbatches, ZeRO, HSDP and ep (not HSDP "
            f"and ep both at once), but not yet with ps, hpZ or gradient compression; {why}. "
            "Drop those fields, or use cp=1.")


def quantization_misfit(comm_quantization: str, zero: int, dp: int) -> str | None:
    """Why Plan.comm_quantization cannot run with this ZeRO stage and dp degree, or None:
    the one rule Plan.validate and the planner's what-if pricing share."""
    if "weights" in comm_quantization and (zero != 3 or dp == 1):
        return ("Plan.comm_quantization='weights' quantizes ZeRO-3's parameter all-gathers: "
                "it needs zero=3 and dp > 1.")
    if "gradients" in comm_quantization and (zero < 2 or dp == 1):
        return ("Plan.comm_quantization='gradients' quantizes ZeRO-2/3's gradient "
                "reduce-scatters: it needs zero=2 or 3 and dp > 1.")
    return None


def compression_misfit(plan: "Plan") -> str | None:
    """Why Plan.grad_compression cannot run with the rest of `plan`, or None."""
    if plan.grad_compression not in GRAD_COMPRESSIONS:
        return (f"Plan.grad_compression must be one of {GRAD_COMPRESSIONS}, got "
                f"{plan.grad_compression!r}.")
    w = plan.compression_warmup
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        return (f"Plan.compression_warmup must be a positive number of steps (1-bit Adam "
                f"freezes the second moment those steps of exact Adam made), got {w!r}.")
    if plan.grad_compression == "none":
        return None
    why = "1-bit Adam compresses the momentum it averages over the dp group"
    if plan.dp == 1:
        return f"Plan.grad_compression='1bit-adam': {why}; it needs dp > 1."
    if plan.zero:
        return (f"Plan.grad_compression='1bit-adam': {why}, which every rank keeps whole; "
                f"it does not run with ZeRO (zero={plan.zero}). Use zero=0, or ZeRO++'s "
                "comm_quantization='gradients' with zero=2 to compress a sharded plan.")
    if plan.microbatched:
        return (f"Plan.grad_compression='1bit-adam' runs with pp=1 and one microbatch (got "
                f"pp={plan.pp}, microbatches={plan.microbatches}): the compressed phase "
                "needs each rank's own gradient of the whole step in one graph.")
    if plan.max_grad_norm is not None:
        return ("Plan.grad_compression='1bit-adam' never forms the averaged gradient after "
                "its warm-up, so there is no global norm to clip by: use max_grad_norm=None "
                "with it.")
    if plan.precision == "fp16":
        return ("Plan.grad_compression='1bit-adam' with precision='fp16': an overflowed "
                "step would enter the compression's error feedback. Use bf16 or fp32.")
    if plan.offload_optimizer:
        return ("Plan.grad_compression='1bit-adam' steps Adam itself on the device: it does "
                "not run with offload_optimizer=True.")
    if plan.comm_quantization != "none":
        return "Plan.grad_compression and comm_quantization cannot be combined."
    return None


def server_misfit(plan: "Plan") -> str | None:
    """Why Plan.ps (parameter servers) cannot run with the rest of `plan`, or None: the
    servers step whole parameters with the user's optimizer on the sum of the workers'
    gradients, so every worker must hold every parameter whole and send one gradient a step."""
    if plan.ps == 0:
        if plan.ps_staleness:
            return (f"Plan.ps_staleness={plan.ps_staleness} bounds how stale the parameters a "
                    "parameter-server worker reads may be: it needs ps > 0 server ranks.")
        return None
    why = [f"{k}={getattr(plan, k)!r}" for k, bad in (
        ("tp", plan.tp != 1), ("pp", plan.pp != 1), ("microbatches", plan.microbatches != 1),
        ("zero", plan.zero != 0), ("offload_optimizer", plan.offload_optimizer),
        ("grad_compression", plan.grad_compression != "none"),
        ("comm_quantization", plan.comm_quantization != "none"),
        ("max_grad_norm", plan.max_grad_norm is not None), ("precision", plan.precision == "fp16"),
        ("verify", plan.verify)) if bad]
    if why:
        return (f"Plan.ps={plan.ps} (parameter servers) runs with whole-model workers: "
                f"tp = pp = microbatches = 1, zero=0, fp32 or bf16, no offload_optimizer, "
                f"compression, max_grad_norm or verify; got {', '.join(why)}. Drop those, or "
                "use all-reduce data parallelism (ps=0) for them.")
    return None


def replays_step(cuda_graphs: Any, pp: int | None, microbatches: int) -> bool:
    """Whether Plan.cuda_graphs asks for the step to be replayed as CUDA graphs on a GPU
    (runtime/cudagraph.decide may still fall back): "auto" at pp=1 with one microbatch (a
    pipeline part would copy each microbatch in and out), True everywhere. The one rule the
    runtime, the planner's host cost and the fusion pass's launch price share."""
    if cuda_graphs == "auto":
        return (pp or 1) == 1 and microbatches == 1
    return cuda_graphs is True


def resolve(plan: Any, world_size: int) -> Plan:
    """'auto' / dict / Plan -> a validated Plan for this world size, without searching:
    unset (or "auto") degrees mean tp = pp = 1 and dp = the rest. fxpar.parallelize asks the
    planner (compiler/planner.py) first when the plan is "auto" or has "auto" degrees; this is
    what a plan means when no search runs (one device, or `fxpar viz`)."""
    p = Plan.from_any(plan)
    if p == "auto":
        p = Plan()
    for name in ("dp", "tp", "pp"):
        if getattr(p, name) == "auto":
            setattr(p, name, None)
    if p.tp is None:
        p.tp = 1
    if p.pp is None:
        p.pp = 1
    if p.dp is None:
        servers = p.ps if isinstance(p.ps, int) and p.ps > 0 else 0
        workers = world_size - servers
        if workers < 1 or workers % (p.tp * p.pp):
            raise PlanError(f"world size {world_size}" + (
                f" minus ps = {servers} server ranks" if servers else "")
                + f" is not a positive multiple of tp*pp = {p.tp * p.pp}.")
        p.dp = workers // (p.tp * p.pp)
    if p.dp_shard == "node":
        p.dp_shard = node_shard(p.dp, dp_stride(p.tp, p.pp, p.pp_outer))
    return p.validate(world_size)


def dp_stride(tp: int, pp: int, pp_outer: bool) -> int:
    """How many ranks apart neighbouring dp ranks are on the mesh (api/parallelize.mesh_dims):
    tp x pp, or tp where pp is outermost (Plan.pp_outer). The one rule the runtime's node
    groups and the planner's link prices share."""
    return tp * (1 if pp_outer else pp)


def node_shard(dp: int, inner: int) -> int | None:
    """Plan.dp_shard="node": the dp ranks one node holds (LOCAL_WORLD_SIZE ranks, `inner` of
    them per dp rank: the mesh puts those innermost, `dp_stride`), or None where one node
    holds every dp rank or the launcher does not say (one process: a single node)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local <= 0 or local % inner or not 1 < local // inner < dp:
        return None  # (a node of one dp rank: nothing to shard within it)
    if dp % (local // inner):
        raise PlanError(f"Plan.dp_shard='node': a node holds {local // inner} dp ranks "
                        f"(LOCAL_WORLD_SIZE={local}, {inner} ranks per dp rank), which does "
                        f"not divide dp={dp}: give dp_shard as a number, or a dp that nodes "
                        "divide.")
    return local // inner


def world_of(devices) -> tuple[int, str]:
    """`devices` (int | device strings | DeviceMesh) -> (world size, device type), without a
    process group: what fxpar.compile needs, and what the runtime's setup checks against."""
    if hasattr(devices, "mesh") and hasattr(devices, "get_group"):  # a DeviceMesh
        size, dev_type = devices.size(), devices.device_type
    elif isinstance(devices, int) and not isinstance(devices, bool):
        size = devices
        dev_type = "cuda" if torch.cuda.is_available() and \
            os.environ.get("FXPAR_DEVICE") != "cpu" else "cpu"
    elif isinstance(devices, (list, tuple)) and devices and all(isinstance(d, (str, torch.device))
                                                                  for d in devices):
        size, dev_type = len(devices), torch.device(devices[0]).type
    else:
        raise PlanError(f"devices must be an int (world size), a sequence of device strings or a "
                        f"torch DeviceMesh, not {devices!r}.")
    if size < 1:
        raise PlanError(f"devices must name at least one device, got {devices!r}.")
    return size, dev_type


def needs_search(plan) -> bool:
    """plan="auto" (or None), or a dict / Plan with "auto" as a parallel degree (e.g.
    {"pp": 2, "dp": "auto", "tp": "auto"}): the planner searches, the fields given (not "auto")
    constrain it. Any other dict / Plan is taken as written (unset degrees: tp = pp = 1, dp =
    the rest), so a plan never changes with the machine it is compiled on. One device has
    nothing to search."""
    if plan is None or plan == "auto":
        return True
    get = plan.get if isinstance(plan, dict) else (
        lambda k, d=None: getattr(plan, k, d)) if isinstance(plan, Plan) else None
    if get is None or not any(get(k) == "auto" for k in ("dp", "tp", "pp")):
        return False
    if get("ps", 0):
        raise PlanError("Plan.ps (parameter servers) is never searched: give its degrees "
                        "(dp workers, or leave dp unset for the ranks the servers leave), "
                        "not 'auto'.")
    return True


# the fields plan="auto" searches: what tells one of its plans from another
SEARCHED = ("dp", "tp", "pp", "microbatches", "schedule", "zero", "dp_shard", "hpz", "ep",
            "cp", "cp_attention", "pp_outer", "remat", "precision", "offload_optimizer")


def plan_dict(p: Plan) -> dict:
    """The searched fields of a plan, as a dict fxpar.parallelize(plan=...) takes (and what
    tells a table's plan from another)."""
    return {k: getattr(p, k) for k in SEARCHED}


def pass_options(options_type: type, plan: Plan):
    """A pass's options (its PassContract.options: a dataclass naming the Plan fields the pass
    reads) filled from `plan`: a pass sees those fields and no others."""
    return options_type(**{f.name: getattr(plan, f.name)
                           for f in dataclasses.fields(options_type)})
