"""Cut a pipeline-split joint graph into one GraphModule per (stage, phase): what a rank runs.

After the passes, every node carries meta["stage"] and meta["pipe_phase"] (F, B, or I/W) from
passes/pipeline_split.py; nodes later passes added (collectives) join the part of the value
they read — except the data-parallel gradient reduction (bucket packing, all-reduce /
reduce-scatter and what follows it): that goes into a per-stage "R" part which the runtime
runs once per step on the gradients summed over the microbatches, so a step communicates the
gradient bytes once, not once per microbatch (Megatron and DeepSpeed reduce once too). Each part becomes a graph whose inputs are parameters, buffers,
batch leaves, or values made by other parts, and whose outputs are the values other parts (or
the step's outputs) read. Values move between parts on one rank through the executor's store
(a forward's saved activations wait there for the backward: the per-microbatch stash), and
between ranks by send/recv.

Why not torch.fx.passes.split_module: it returns a top-level graph of calls that the runtime
would have to interpret anyway to learn which value goes where; building the parts directly
gives that table (`inputs`/`outputs` per part) in one step.
"""
from __future__ import annotations

import torch
import torch.fx

from fxpar.core import ir
from fxpar.core.ir import Part, PipelineProgram  # noqa: F401 (what split makes)

PHASE = ir.PHASE


def run_order(key: str) -> tuple:
    """Order in which a rank's parts of one microbatch run: forwards by stage, then
    backwards from the last stage, input gradients (I) before weight gradients (W); the
    once-per-step gradient reduction (R) of a stage after all of them."""
    phase, stage = key[0], int(key[1:])
    if phase == "R":
        return (2, -stage, 0)
    return (0, stage, 0) if phase == "F" else (1, -stage, 1 if phase == "W" else 0)


def part_key(node: torch.fx.Node) -> str:
    return f"{node.meta[PHASE]}{node.meta[ir.STAGE]}"


def _fill_keys(graph: torch.fx.Graph, n_stages: int) -> dict[torch.fx.Node, str]:
    """Part of every call node: its own, else that of the first input that has one (a
    collective goes with the value it reduces), else that of its first user. With one stage
    (gradient accumulation only) the region decides: F0 or B0. A gradient bucket node
    (meta[ir.BUCKET], from the data-parallel pass) and everything computed from one go to the
    R part of their stage."""
    key: dict[torch.fx.Node, str] = {}
    calls = [n for n in graph.nodes if n.op == "call_function"]
    for n in calls:
        if ir.STAGE in n.meta and PHASE in n.meta:
            key[n] = part_key(n)
        elif n_stages == 1 and n.meta.get(ir.REGION) in (ir.FORWARD, ir.BACKWARD):
            key[n] = "B0" if n.meta[ir.REGION] == ir.BACKWARD else "F0"
        else:  # the part, among its inputs', that runs last
            ks = [key[a] for a in n.all_input_nodes if a in key]
            if ks:
                k = max(ks, key=run_order)
                key[n] = f"R{k[1:]}" if n.meta.get(ir.BUCKET) or k[0] == "R" else k
    for n in reversed(calls):
        if n not in key:
            k = next((key[u] for u in n.users if u in key), None)
            if k is None:
                raise ValueError(f"node {n.name} belongs to no pipeline stage")
            key[n] = k
    return key


def split(gm: torch.fx.GraphModule, signature: ir.GraphSignature, n_stages: int) -> PipelineProgram:
    graph = gm.graph
    key = _fill_keys(graph, n_stages)
    n_p, n_b = signature.num_params, len(signature.buffer_names)
    source = {}
    for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder"):
        source[n] = ("param", i) if i < n_p else ("buffer", i - n_p) if i < n_p + n_b else \
            ("batch", i - n_p - n_b)
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")

    keys = list(dict.fromkeys(key[n] for n in graph.nodes if n in key))
    ext: dict[str, list[torch.fx.Node]] = {k: [] for k in keys}   # external inputs per part
    for n in graph.nodes:
        if n in key:
            for a in n.all_input_nodes:
                if a.op == "get_attr":  # a constant: each part reads it from the module
                    continue
                if (a.op == "placeholder" or key[a] != key[n]) and a not in ext[key[n]]:
                    ext[key[n]].append(a)
    consumers: dict[str, list[str]] = {}
    for k, ins in ext.items():
        for a in ins:
            if a.op != "placeholder":
                consumers.setdefault(a.name, []).append(k)

    graphs = {k: torch.fx.Graph() for k in keys}
    env: dict[str, dict] = {k: {} for k in keys}
    inputs: dict[str, list] = {k: [] for k in keys}
    for k in keys:
        for a in ext[k]:
            ph = graphs[k].placeholder(a.name)
            ph.meta = dict(a.meta)
            env[k][a] = ph
            inputs[k].append(source[a] if a.op == "placeholder" else ("value", a.name))
    def lookup(a, k):
        if a not in env[k] and a.op == "get_attr":
            env[k][a] = graphs[k].get_attr(a.target)
            env[k][a].meta = dict(a.meta)
        return env[k][a]

    for n in graph.nodes:
        if n in key:
            k = key[n]
            env[k][n] = graphs[k].node_copy(n, lambda a, k=k: lookup(a, k))
    step_outputs = {a for a in out_node.all_input_nodes}
    parts, producer = {}, {}
    for k in keys:
        outs = [n for n in graph.nodes if key.get(n) == k and (n.name in consumers
                                                                  or n in step_outputs)]
        graphs[k].output(tuple(env[k][n] for n in outs))
        graphs[k].lint()
        for n in outs:
            producer[n.name] = k
        phase, stage = k[0], int(k[1:])
        parts[k] = Part(k, stage, phase, torch.fx.GraphModule(gm, graphs[k]), inputs[k],
                        [n.name for n in outs])

    outs = list(out_node.args[0])
    n_g = out_node.meta.get(ir.N_GRADS, n_p)

    def name(v):
        return v.name if isinstance(v, torch.fx.Node) else None

    param_stages: dict[int, set[int]] = {}
    buffer_stages: dict[int, set[int]] = {}
    for k, ins in inputs.items():
        for kind, i in ins:
            if kind == "param":
                param_stages.setdefault(i, set()).add(parts[k].stage)
            elif kind == "buffer":
                buffer_stages.setdefault(i, set()).add(parts[k].stage)
    return PipelineProgram(n_stages, parts, producer, consumers, name(outs[0]),
                           [name(v) for v in outs[1:1 + n_g]],
                           [name(v) for v in outs[1 + n_g:]], param_stages, buffer_stages)
