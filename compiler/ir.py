"""Names shared by capture, passes and runtime: node.meta keys and the Program.

Passes talk to each other only through the graph and these meta keys; the runtime only
through `Program`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

# ops that only reshape or alias a tensor (same elements, same storage): passes look through them
RESHAPES = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                      torch.ops.aten.reshape.default, torch.ops.aten.alias.default})

# node.meta keys (DESIGN.md section 3)
VAL = "val"              # fake tensor: shape, dtype, device
REGION = "region"        # "forward" | "backward" | "optimizer" | "comm"
MODULE = "module"        # source module path, e.g. "transformer.h.3.mlp.c_fc"
RECOMPUTE = "recompute"  # set by remat
STAGE = "stage"          # set by pipeline_split
SHARD = "shard"          # placements of the value, tuple of Placement (one per mesh dim)
FUSED_GROUP = "fused_group"
COST = "cost"            # {"flops": int, "bytes": int}
PHASE = "pipe_phase"    # set by pipeline_split: "F" | "B" | "I" | "W" (part of a stage)
TRANSFER = "transfer"    # set by pipeline_split on stage-boundary nodes: (src stage, dst stage)
VOCAB_SHARD = "vocab_shard"  # set by tensor_parallel on a vocab-split table's lookup backward
BUCKET = "bucket"        # set by data_parallel on gradient-reduction nodes (packing, collective)
ROLE = "role"            # placeholder/output role: "param" | "buffer" | "batch" | "loss" | "grad" | "buffer_update"

FORWARD, BACKWARD, OPTIMIZER, COMM = "forward", "backward", "optimizer", "comm"


@dataclasses.dataclass
class GraphSignature:
    """Which placeholders/outputs of the joint graph are what.

    Placeholders: params (in `param_names` order), buffers, then batch leaves.
    Outputs: (loss, *grads in param order, *updated buffers in `mutated_buffers` order).
    """
    param_names: list[str]
    buffer_names: list[str]
    batch_spec: Any                 # pytree spec of the batch
    batch_leaf_meta: list[Any]      # per leaf: (shape, dtype) for tensors, the value otherwise
    mutated_buffers: list[str]

    @property
    def num_params(self) -> int:
        return len(self.param_names)


@dataclasses.dataclass
class Program:
    """What the runtime executes on one rank.

    `graph` takes (params, buffers, local batch leaves) and returns
    (loss, grads, updated buffers) with every collective as an explicit node.
    `batch_shard_dims[i]` is the dim along which batch leaf i is split over the dp group
    (None = replicated). Parameters are whole on every rank (no ZeRO-3/tp yet).
    """
    graph: torch.fx.GraphModule
    signature: GraphSignature
    dp: int
    batch_shard_dims: list[int | None]
    group_name: str | None = None
    # ZeRO (stage 1/2, dp > 1): the gradient outputs are one flat shard per bucket instead of
    # one tensor per parameter; bucket k holds the parameters zero_buckets[k] (indices into
    # signature.param_names) flattened in that order, padded to a multiple of dp, and this
    # rank owns the k-th 1/dp slice. Parameters with no gradient are in no bucket.
    zero: int = 0
    zero_buckets: list[list[int]] = dataclasses.field(default_factory=list)
    # ZeRO-3: every parameter input is this rank's slice of the flat, padded parameter
    params_sharded: bool = False
    # Pipeline (pp > 1 or microbatches > 1): the graph cut into parts per (phase, stage)
    # (compiler/stages.PipelineProgram), run per microbatch in the order of `schedule`
    # (runtime/schedules.py) over the pp group; `graph` is then the whole joint graph, for
    # pictures only. Batch leaves are split into `microbatches` along dim 0 first.
    pipeline: Any = None
    pp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    offload: bool = False  # Plan.offload: waiting microbatches' saved values to host memory
    # Tensor parallelism (tp > 1): per parameter None (whole) or a layout (shard_dim,
    # interleave_dim, k) saying which slice of the user's weight this tp rank's program reads
    # (runtime/tp.py); gradient outputs are placed the same way.
    tp: int = 1
    tp_layouts: list = dataclasses.field(default_factory=list)
    tp_group_name: str | None = None
    pp_group_name: str | None = None
    # Mixed precision (passes/precision.py): fp16's graph takes one more batch input after
    # the batch leaves, the 0-dim fp32 loss scale (runtime/amp.GradScaler feeds it).
    loss_scale: bool = False
    # Microbatches with a mean cross-entropy (passes/data_parallel.py): a program counting a
    # microbatch's targets; the graph takes the step's count / microbatches as its last
    # batch input (after the loss scale), so the m microbatch means average to the batch mean.
    loss_count: Any = None
