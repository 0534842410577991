"""Colours and node kinds shared by the node-level (viz/graph.py) and layer-level
(viz/layer_graph.py) pictures, so both read the same."""
from __future__ import annotations

import torch
import torch.fx

from fxpar.core import ir

REGION_COLORS = {ir.FORWARD: "#cfe8ff", ir.BACKWARD: "#ffe3c4", ir.OPTIMIZER: "#e0f5d0",
                 ir.COMM: "#ffd0d0"}  # comm: bucket packing etc.; collectives are bold red
COLLECTIVE_COLOR = "#d62728"
MOVED_COLOR, MOVED_FILL = "#1b9e3a", "#dff5e3"  # what the overlap pass moved (layer view)
RECOMPUTE_COLOR = "#e4d4ff"   # nodes remat copied into the backward
SAVED_BORDER = "#1f4fd6"      # forward values kept for the backward (thick blue border)
FUSED_BORDER = "#2ca02c"      # one Triton kernel (fusion pass): green 3-D box
FUSED_COLOR = "#d8f5d0"
INDUCTOR_COLOR = "#ffe0f0"    # ops compiled into Inductor runs (pm.stage_graphs["codegen"])
RUN_BORDERS = ["#c2185b", "#7b1fa2", "#00838f", "#ef6c00", "#2e7d32", "#1565c0"]  # by run
TP_COLOR = "#fff1a8"          # tensor-parallel sharded weights
COLLECTIVE_PREFIXES = ("_c10d_functional.", "c10d_functional.", "fxpar.")

# one colour per pipeline stage (forward and backward of a stage share it)
STAGE_COLORS = ["#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#fb9a99", "#ffff99", "#8dd3c7",
                "#bebada"]


def is_collective(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and str(n.target).startswith(COLLECTIVE_PREFIXES)


def nbytes(n: torch.fx.Node) -> int:
    """Bytes of the node's value (0 when it is not a tensor)."""
    v = n.meta.get(ir.VAL)
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def fmt_bytes(b: int) -> str:
    if b >= 2**20:
        return f"{b / 2**20:.2f} MiB"
    return f"{b / 1024:.1f} KiB" if b >= 1024 else f"{b} B"
