"""Memory per device of a plan, from the graph statistics (compiler/graphstats.py).

Per rank of pipeline stage s:
  parameters   elements held (tp divides the split ones) x bytes per element; / dp under ZeRO-3
  gradients    the same elements x gradient bytes; / dp under ZeRO-2 and -3
  optimizer    per element: SGD 0, SGD with momentum 4 B, Adam/AdamW 8 B (two fp32 moments),
               + 4 B of fp32 master weights when training in 16 bits; / dp under ZeRO >= 1
               (EleutherAI's "Transformer Math 101": 2 + 2 + 12 = 16 B per parameter for
               mixed-precision Adam)
  activations  the saved activations of the stage's layers (the graph's forward values read by
               its backward) x the microbatches the schedule holds in flight on that stage
               (1F1B: stage i holds min(pp - i, m); GPipe: m), after remat; plus the working
               memory of one microbatch beyond the saved values (per segment: the liveness
               simulator's live bytes while it runs less the saved values alive then; e.g.
               the logits at the loss), the largest of the stage's segments
  buffers      the gradient bucket being packed, ZeRO-3's gathered parameters of two layers,
               pipeline send/receive buffers of the boundary activation and its gradient,
               and with microbatches under a pipeline one microbatch's gradients beside
               the accumulated sum (without one, the sum is accumulated in place: whole
               until the reduce-scatter under ZeRO-2/3, the buckets after the last one).
The step's peak: activations + gradients + buffers with several microbatches (gradients
accumulate while later microbatches' activations live), max(activations, gradients + buffers)
with one (the backward frees activations as it makes gradients).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math

import sympy
import torch

from fxpar.compiler.graphstats import GraphStats, Segment

# fp32 values kept per parameter by each optimizer (besides the parameter itself)
OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2, "adagrad": 1,
                    "rmsprop": 1}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# parameter-sized temporaries torch's optimizers allocate per tensor in their step, tensor
# by tensor (torch's default off CUDA: Adam's denominator, exp_avg_sq.sqrt() / bias
# correction; Adagrad's and RMSprop's sqrt); the foreach implementations (its default on
# CUDA) make one list of them for every tensor at once and work on it in place
OPTIMIZER_TEMPORARIES = {"sgd": 0, "sgd_momentum": 0, "adam": 2, "adamw": 2, "adagrad": 1,
                         "rmsprop": 1}


def state_bytes_per_param(optimizer: str, precision: str) -> int:
    """Optimizer state bytes per parameter: its fp32 states, and in half precision an fp32
    master copy (`s` of `state_formula`)."""
    return 4 * OPTIMIZER_STATES.get(optimizer, 2) + (4 if precision != "fp32" else 0)


def optimizer_kind(factory) -> str:
    """'sgd' | 'sgd_momentum' | 'adam' | 'adamw' | ... of an optimizer factory (built once on a
    one-element parameter to look), or of an optimizer instance; default SGD as fxpar's."""
    if factory is None:
        return "sgd"
    opt = factory if isinstance(factory, torch.optim.Optimizer) else factory(
        [torch.nn.Parameter(torch.zeros(1))])
    name = type(opt).__name__.lower()
    if name == "sgd":
        return "sgd_momentum" if opt.defaults.get("momentum", 0) else "sgd"
    if name not in OPTIMIZER_STATES:
        return "adam"  # unknown: assume the common worst case (two states)
    return name


# The model state per device, kept symbolic (sympy) in the stage's sizes so that the
# planner's explanation prints the formula next to the figure; the figures are computed from
# the same expressions (`model_state`), so the two cannot disagree.
# N: parameters of the stage on this rank (tp splits the split ones), dp: data-parallel
# degree, b: bytes per parameter element, s: optimizer bytes per parameter
N, DP, B, S = sympy.symbols("N dp b s", positive=True)


@functools.lru_cache(maxsize=None)
def state_formula(zero: int) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr]:
    """(parameters, gradients, optimizer state) bytes per device: ZeRO-1 divides the
    optimizer state by dp, ZeRO-2 also the gradients, ZeRO-3 also the parameters."""
    return (N * B / (DP if zero >= 3 else 1), N * B / (DP if zero >= 2 else 1),
            N * S / (DP if zero >= 1 else 1))


@functools.lru_cache(maxsize=None)
def _state_fn(zero: int):
    return sympy.lambdify((N, DP, B, S), state_formula(zero))


def model_state(n: float, dp: int, elem: int, per: int, zero: int) -> tuple[float, ...]:
    """The numbers of `state_formula(zero)` at these sizes."""
    return tuple(float(x) for x in _state_fn(zero)(n, dp, elem, per))


@dataclasses.dataclass
class MemoryEstimate:
    """Bytes per device on the fullest stage (and the total of every stage in `per_stage`)."""
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    stage: int = 0
    per_stage: list = dataclasses.field(default_factory=list)
    accumulate: bool = True  # gradients live while activations do (microbatches > 1)
    working: float = 0.0     # of `activations`: the working memory beyond the saved values
    # at the backward's end, beside every gradient and the buckets: the first segment's saved
    # values and working memory, or a middle segment's working memory (stage_memory);
    # None: `working`
    working_end: float | None = None
    in_flight: int = 1       # microbatches whose activations `activations` holds at once
    microbatches: int = 1
    at_end: float = 0.0      # beside the gradient sums after the last microbatch (dp buckets)
    optimizer_step: float = 0.0  # beside the gradients: the optimizer step's temporaries
    gathered: float = 0.0    # of `buffers`: ZeRO-3's gathered parameters (live beside the
    #                          activations too)
    # the model state's formula and the values of its symbols (sympy), for explanations
    state: tuple = ()
    sizes: dict = dataclasses.field(default_factory=dict)

    def __copy__(self):  # (copy.copy's generic path is the planner's hot spot)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def formula(self) -> str:
        """'params + grads + optimizer = <formula> with N = ..., dp = ..., ...'."""
        if not self.state:
            return ""
        expr = sympy.factor(sum(self.state))
        vals = ", ".join(f"{k} = {v:,.0f}" if k == "N" else f"{k} = {v:g}"
                         for k, v in self.sizes.items())
        return f"params + grads + optimizer = {expr} bytes, with {vals}"

    @property
    def total(self) -> float:
        return self.params + self.optimizer + self.step_allocated

    @property
    def step_allocated(self) -> float:
        """What one training step allocates once the optimizer state exists (what a tracker
        sees on a later step). With one microbatch the backward frees activations as it makes
        gradients: the peak is the larger of the activations (start of the backward) and the
        gradients with the reduction buckets and the last segment's working memory (its end:
        where a model's gradients outweigh its activations, as a GPT's under remat, the
        peak is there). With several, the gradient sums are held
        while later microbatches' activations live (below)."""
        if not self.accumulate:
            end = self.working if self.working_end is None else self.working_end
            return max(self.activations + self.gathered, self.grads + self.buffers + end,
                       self.grads + self.at_end, self.grads + self.optimizer_step)
        # each part frees the activations it was handed as it makes their gradients (the
        # pipeline runs parts boxed), added in place into the sums: once the sums exist
        # (after the first backward) at most min(in_flight, microbatches - 1) microbatches'
        # activations are live beside them (one microbatch at a time without a pipeline: the
        # sums plus its activations); after the last, the sums beside `at_end`
        one = (self.activations - self.working) / self.in_flight
        held = min(self.in_flight, self.microbatches - 1)
        return max(max(self.activations, self.grads + held * one + self.working,
                       self.grads + self.at_end) + self.buffers,
                   self.grads + self.optimizer_step)

    def describe(self) -> str:
        g, u = (2 ** 30, "GiB") if self.total >= 2 ** 28 else (2 ** 20, "MiB")
        return (f"{self.total / g:.2f} {u} (params {self.params / g:.2f}, grads "
                f"{self.grads / g:.2f}, optimizer {self.optimizer / g:.2f}, activations "
                f"{self.activations / g:.2f}, buffers {self.buffers / g:.2f}; stage {self.stage})")


def activation_bytes(segs: list[Segment], stats: GraphStats, rows: float, tp: int,
                     act_scale: float = 1.0, dp: int = 1) -> float:
    """Saved activation bytes of one microbatch of `rows` rows of a rank of a dp group of
    `dp` through these segments (what the dp pass keeps of the gathered batch: dp x the
    rows; an MoE's routed tokens under HF Mixtral's whole-batch routing)."""
    f = rows / stats.rows * act_scale
    return sum((s.saved - s.saved_split) + s.saved_split / tp + (dp - 1) * s.saved_whole
               for s in segs) * f


@dataclasses.dataclass(frozen=True)
class SavedActivations:
    """What one microbatch through a stage's segments saves, priced for any number of
    microbatches in flight under any remat choice (`under`)."""
    per_microbatch: float   # every saved value
    one_layer: float        # the largest single layer's
    boundary: float         # a layer's input (what per-layer checkpointing keeps)
    layers: int             # layers (an aggregate segment stands for several)
    checkpoints_per_layer: int

    def under(self, remat, in_flight: int) -> tuple[float, float]:
        """(activation bytes, fraction of the forward recomputed) under a remat choice.

        "none": everything saved for every microbatch in flight. "sqrt" (Chen et al.): the
        n layers are n c pieces between the pass's checkpoint candidates (c per layer, e.g.
        2 in a transformer block); a checkpoint every sqrt(n c) pieces kept per microbatch
        in flight, one segment rebuilt at a time; the whole forward recomputed. A byte
        budget: the remat pass recomputes the least that fits, between "none" and
        per-layer checkpointing (keep each layer's input, rebuild one layer)."""
        full = self.per_microbatch * in_flight
        if remat == "none" or not self.layers:
            return full, 0.0
        n, boundary, one_layer = self.layers, self.boundary, self.one_layer
        if remat == "sqrt":  # over the pass's checkpoint candidates: n c pieces
            c = self.checkpoints_per_layer
            k = max(1, round(math.sqrt(n * c)))
            return in_flight * math.ceil(n * c / k) * boundary + k * one_layer / c, 1.0
        floor = in_flight * n * boundary + one_layer
        budget = float(remat)
        if budget >= full:
            return full, 0.0
        if budget <= floor:
            return floor, 1.0
        return budget, (full - budget) / max(full - floor, 1.0)


def saved_activations(segs, stats, rows, tp, act_scale=1.0, dp=1) -> SavedActivations:
    layers = [s for s in segs if s.name not in ("pre", "post", "ends")]
    f = rows / stats.rows * act_scale
    return SavedActivations(
        activation_bytes(segs, stats, rows, tp, act_scale, dp),
        max((activation_bytes([s], stats, rows, tp, act_scale, dp) for s in layers
             if not getattr(s, "layer_count", 0)), default=0.0),
        max((s.boundary for s in layers), default=0.0) * f,
        sum(getattr(s, "layer_count", 1) for s in layers),
        max(1, stats.checkpoints_per_layer))


def stage_memory(segs: list[Segment], stats: GraphStats, *, in_flight: int, remat="none",
                 **kw) -> tuple[MemoryEstimate, float]:
    """Memory of one rank of the stage holding `segs` (`stage_state`'s arguments), and its
    recompute fraction."""
    return with_activations(*stage_state(segs, stats, remat_none=remat == "none", **kw),
                            in_flight, remat)


def with_activations(state: MemoryEstimate, saved: SavedActivations, in_flight: int,
                     remat) -> tuple[MemoryEstimate, float]:
    """`stage_state`'s estimate with `in_flight` microbatches' activations under `remat`
    (the planner prices a pipeline's ranks from one state per kind of stage)."""
    acts, recompute = saved.under(remat, in_flight)
    mem = copy.copy(state)
    mem.activations, mem.in_flight = acts + state.working, in_flight
    return mem, recompute


def stage_state(segs: list[Segment], stats: GraphStats, *, tp: int, dp: int, zero: int,
                rows: float, precision: str, optimizer: str, remat_none: bool = True,
                transient: bool = True, bucket_bytes: float = 25 * 2 ** 20, pp: int = 1,
                microbatches: int = 1, sends_held: float = 0.0, saved_factor: float = 1.0,
                received_at_end: float = 0.0, weight_copies: float = 0.0,
                optimizer_foreach: bool = False, shard_dp: int | None = None
                ) -> tuple[MemoryEstimate, SavedActivations]:
    """Memory of one rank of the stage holding `segs` without its saved activations (its
    `activations` are the working memory alone), and what one microbatch saves.
    `remat_none`: no recompute (the working memory is then paired with the values saved
    beside it).
    `sends_held`: bytes of weight-shaped transfers this rank holds over the step (a tied
    head's summed gradient part); `received_at_end`: what it receives after the last
    microbatch (that part, on the embedding's rank). `saved_factor`: what the pipeline
    pass's cut saves on this rank over what `segs` save. `weight_copies`: elements of
    shared weights this rank holds a copy of and steps (priced with another stage).
    `optimizer_foreach`: the optimizer steps all its tensors at once (torch's default on
    CUDA), so its temporaries are parameter-sized for all of them, not the largest.
    `shard_dp`: the ranks ZeRO shards over where not all dp ranks (HSDP's shard group); dp
    still sizes what the batch's split keeps."""
    sdp = shard_dp or dp
    elem = DTYPE_BYTES[precision]
    n = sum((s.params - s.params_split) + s.params_split / tp for s in segs) + weight_copies
    per = state_bytes_per_param(optimizer, precision)
    params, grads, opt = model_state(n, sdp, elem, per, zero)
    stepped = n / sdp if zero >= 1 else n  # (the fp32 master elements this rank steps)
    largest = max([s.largest_param for s in segs] + [weight_copies])
    per_tensor = OPTIMIZER_TEMPORARIES.get(optimizer, 2)
    step_temp = 4 * (min(per_tensor, 1) * stepped if optimizer_foreach
                     else per_tensor * min(largest, stepped))
    act_scale = (1.0 if stats.activations_precision == precision
                 else elem / stats.param_bytes_per_elem)
    saved = saved_activations(segs, stats, rows, tp, act_scale * saved_factor, dp)
    working, working_end = 0.0, None
    if transient:  # the working memory of one microbatch's segments
        f = rows / stats.rows * act_scale
        w = [s.working(tp) * f for s in segs]
        working = max(w, default=0.0)
        if remat_none and segs:
            # in the order the segments run (planner._rank_aggregates keeps it): in the
            # forward a segment works beside the values saved before it (the later ones
            # have saved nothing yet); the backward ends at the first segment, beside its
            # saved values and every gradient, and the last starts it before any gradient
            # is made (its working memory, a loss's logits, is the forward's peak). Paired
            # with every saved value and every gradient, the logits and a conv stem's
            # working memory were priced at 1.1-1.4x what a step allocates.
            kept = [activation_bytes([s], stats, rows, tp, act_scale * saved_factor, dp)
                    for s in segs]
            working = max(0.0, max(w[k] - sum(kept[k + 1:]) for k in range(len(segs))))
            used = [k for k in range(len(segs)) if kept[k] or w[k]]
            if used:
                first, last = used[0], used[-1]
                working_end = max([kept[first] + w[first]]
                                  + [w[k] for k in used if first < k < last])
    # one bucket beside the gradients, never more than the gradients it packs: the
    # reduction runs in place on the packed bucket (runtime/comm.start_all_reduce, owned)
    # and the gradients become views of it, so only while a bucket is packed are its
    # gradients there twice (priced as a packed bucket and a reduced copy, plain dp came out
    # 1.14-1.22x what it allocates). `bucket_bytes`: the largest bucket the dp pass made on
    # this model (planner's dp probe); priced at 25 MiB where the pass makes 4-6 MiB ones,
    # plain dp was 1.28x. (ZeRO-2/3 reduce-scatter whole gradients: below.)
    buckets = min(bucket_bytes, n * elem) if dp > 1 else 0.0
    buffers, at_end = buckets, 0.0
    if dp > 1 and zero == 2 and not (microbatches > 1 and pp == 1):  # (that case: below)
        # each gradient is whole until its bucket's reduce-scatter (a pipeline stage's sums
        # until its R part): during the backward a rank can hold what plain dp holds; the
        # shard is what stays
        buffers += n * elem - grads
    gathered = 0.0
    if dp > 1 and zero >= 3:
        # the parameters of the segment running and the next one, gathered whole, beside
        # the activations too (a tied LM head's at the loss, beside the gradients)
        sizes = sorted(((s.params - s.params_split) + s.params_split / tp
                        for s in segs if not getattr(s, "layer_count", 0)), reverse=True)
        gathered = (sizes[0] + sizes[min(1, len(sizes) - 1)]) * elem if sizes else 0.0
        buffers += gathered
    if pp > 1:
        f = rows / stats.rows * act_scale
        buffers += 2 * max((s.boundary for s in segs), default=0.0) * f + sends_held
    if microbatches > 1 and pp == 1:
        # one part accumulates in place (runtime/pipeline._accumulating: each gradient added
        # into the running sum as it is made): at ZeRO 0/1 the sum is the gradients counted
        # above; at ZeRO 2/3 it is whole (its tp slices) until the reduce-scatter after the
        # last microbatch. The reduction's buckets are packed inside the last microbatch's
        # backward as their sums are final (runtime/pipeline.with_reductions), and their
        # waits come at its end (`at_end`), not beside the activations (docs/benchmarks.md,
        # "Memory per plan", has each plan's estimate against the tracker).
        buffers += (n * elem - grads if zero >= 2 else 0.0) - buckets
        if dp > 1 and zero < 3:
            # by the end of the last backward every bucket is packed before the first
            # reduction returns: the sums beside a packed copy of all of them and, under
            # ZeRO-1/2, the reduced shards it keeps
            at_end = n * elem + (max(n * elem - bucket_bytes, 0.0) / sdp if zero else 0.0)
            # the last gradient is made beside the others' packed buckets: its parts live
            # at once before they are summed (a tied embedding's and head's: the peak is
            # the sums, the others packed and both parts)
            last, parts = stats.last_grad
            at_end += (parts - 1) * min(last * elem, n * elem)
    at_end = max(at_end, received_at_end)
    # (pipeline stages sum their gradients in place too: the sums are `grads`)
    return MemoryEstimate(params, grads, opt, working, buffers,
                          accumulate=microbatches > 1, working=working,
                          working_end=working_end, optimizer_step=step_temp,
                          gathered=gathered, microbatches=microbatches, at_end=at_end,
                          state=state_formula(zero),
                          sizes={"N": n, "dp": sdp, "b": elem, "s": per}), saved
