"""The names of a step's timeline: the tracks, categories and waits that runtime/trace.py
records and viz/timeline.py draws (the Chrome-trace events' thread and cat fields)."""
from __future__ import annotations

from fxpar.core import ir

COMPUTE, COMM = "compute", "comm"
TRACKS = (COMPUTE, COMM)
BLOCKED = "blocked"
# blocked on a pipeline peer (its recv, its send still unreceived): the schedule's bubble,
# not communication the overlap pass could hide; drawn apart from BLOCKED (still counted in
# StepStats.exposed_comm_s: the compute thread sat idle either way)
PEER_WAIT = "waiting for a peer"
# what a compute segment is doing, keyed by its nodes' meta["region"] or a pipeline part's
# meta["pipe_phase"]: the Chrome-trace event's cat (and the timeline PNG's colour). Region
# "comm" on the compute thread is the packing around collectives (bucket cat/split, views).
CATEGORY = {ir.FORWARD: "forward", ir.BACKWARD: "backward", ir.OPTIMIZER: "optimizer",
            ir.COMM: "packing", "F": "forward", "B": "backward", "I": "backward",
            "W": "weight grad", "R": "packing"}
RUNTIME = "runtime"  # a pipeline's own work before and between its stage computations
