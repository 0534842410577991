"""Context parallelism as a graph transformation, exact (Plan.cp).

Groups of cp neighbouring dp ranks (the "cp" group) share the same rows of the batch and
split its sequence: cut into 2 cp chunks, rank r keeps chunks r and 2cp-1-r of every
sequence leaf (a front and a back one, so that causal attention costs every rank alike:
core/context_attention.py; the runtime hands each rank of the group the same rows, and
fxpar::zigzag_chunk cuts them in the graph, cheap for token ids). The sharding engine
propagates that split through the joint graph with DTensor's rules: every op that treats
positions alike (embeddings, norms, linears, the MLP, the loss's log-softmax) runs on the
rank's chunks, an MoE's router and its dispatch (sort, histogram, grouped matmuls:
core/local_dispatch) on the rank's tokens as under dp on its rows, and a value computed
whole (RoPE's cos/sin, learned positions, a causal mask) is cut to them where it meets the
split one. Attention reads every key: q keeps its chunk, k
and v are all-gathered over the cp group, a causal kernel is rewritten to
fxpar::causal_chunk_attention (each chunk against the keys before it, unmasked, and its own,
causal; keys after it never read), and in the backward the keys' and values' gradients are
reduce-scattered back to their chunks. The backward reads the whole keys and values again:
with remat on (memory is short) it gathers them again, else it holds the forward's copies.
Ops that need the whole sequence (shifting the labels, a slice) get it gathered, by
DTensor's rules.

Outputs: the mean loss is reduced exactly over the group (core/mean_loss.py); every
gradient is left a partial sum over the group (a weight's gradient sums over every
position), for the data-parallel pass to sum over the whole dp group (its batch rows over
"cdp" x the sequence over "cp") in the same buckets; buffers are made whole.

CUDA's flash attention without dropout splits as the CPU's does (`portable_flash`); its
memory-efficient and cuDNN kernels (masks, fp32, a value head dim of its own) and flash with
dropout keep the sequence whole by DTensor's rules (exact; every rank of the group runs its
rows' whole attention; the report names them).

Ring attention (Plan.cp_attention): an attention whose q, k and v all hold the rank's
chunks (no mask, no dropout) can instead keep k and v split and run as
fxpar::ring_attention(_backward), the blocks passed around the group inside the op
(core/context_attention.py); no key/value collective appears and no rank holds them whole.
"auto" asks the cost model per attention (`_ring_choice`).
"""
from __future__ import annotations

import dataclasses
import logging
import operator

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from fxpar.core import context_attention, cost, ir
from fxpar.core.errors import BatchError, PlanError
from fxpar.core.graphs import fake_propagate
from fxpar.core.mean_loss import exact_mean_loss, mean_nll_loss, target_count_program
from fxpar.core.sharding import (Partial, Replicate, Shard, make_mesh, redistribute,
                                 shard_graph)

log = logging.getLogger(__name__)
aten = torch.ops.aten
c10d = torch.ops._c10d_functional
fxpar_ops = torch.ops.fxpar


@dataclasses.dataclass(frozen=True)
class Options:
    """The Plan fields this pass reads (core/plan.pass_options fills them from a Plan)."""
    cp: int = 1
    cp_attention: str = "auto"
    remat: object = "none"
    microbatches: int = 1


CONTRACT = ir.PassContract(
    "context_parallel", Options,
    requires=frozenset({ir.VAL, ir.REGION, ir.MODULE, ir.ROLE, ir.FQN, ir.N_GRADS}),
    # tensor parallelism's placements are another mesh axis's, carried through
    reads=frozenset({ir.SHARD}),
    provides=frozenset({ir.SEQUENCE_SPLIT, ir.CP_REPORT, ir.LOSS_COUNT}),
    # the data-parallel pass shards the result over the batch's rows and sums the
    # gradients this pass leaves partial
    before=frozenset({"data_parallel", "overlap", "fusion"}),
    after=frozenset({"precision", "remat", "tensor_parallel", "expert_parallel"}),
    applies=lambda o: (o.cp or 1) > 1,
    values_fresh=True)


def run(gm: torch.fx.GraphModule, options: Options, ctx) -> torch.fx.GraphModule:
    cp, group = options.cp, ctx.group_names["cp"]
    joint = any(n.meta.get(ir.REGION) == ir.BACKWARD for n in gm.graph.nodes)
    if options.microbatches > 1 and joint:  # (the data-parallel pass weights microbatches by
        # their target counts: counted on the graph before the sequence is split)
        nll = mean_nll_loss(gm.graph)
        gm.meta[ir.LOSS_COUNT] = target_count_program(gm, nll) if nll is not None else None
    leaves = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[ir.ROLE] == "batch"]
    dims = sequence_dims(leaves, cp)
    placements = {n.name: (Shard(d),) for n, d in zip(leaves, dims) if d is not None}
    # where memory is short (remat on), the backward gathers each attention's keys and
    # values again rather than holding the forward's whole copies
    regather = options.remat not in ("none", None)
    portable_flash(gm.graph)
    ring = _ring_choice(options.cp_attention, cp, ctx.profile or cost.DeviceProfile.for_device(
        ctx.device or "cpu"), regather)
    shard_graph(gm, make_mesh(cp), placements, [group], split_sequence=True, regather=regather,
                ring=ring, local_dispatch=True)
    if options.cp_attention == "ring":
        _check_ring(gm, next(n.meta[ir.VAL].shape[d] for n, d in zip(leaves, dims)
                             if d is not None))
    _reduce_outputs(gm, group, cp)
    exact_mean_loss(gm.graph, group, cp)
    _chunk_leaves(gm.graph, leaves, dims, cp, group)
    gm.meta[ir.SEQUENCE_SPLIT] = dims
    gm.meta[ir.CP_REPORT] = report(gm, leaves, dims, cp, group)
    gm.graph.lint()
    if ctx.fresh_values:
        fake_propagate(gm, check=False)
    return gm


_CUDA_FLASH = getattr(aten, "_scaled_dot_product_flash_attention", None)
_CUDA_FLASH_BACKWARD = getattr(aten, "_scaled_dot_product_flash_attention_backward", None)


def portable_flash(graph: torch.fx.Graph) -> int:
    """CUDA's flash attention (forward and backward, without dropout) as fxpar::flash_attention
    (core/context_attention.py): the CPU kernel's arguments and results on either device, so
    the sequence rule splits it as it splits the CPU's (causal: fxpar::causal_chunk_attention,
    each rank 1/cp of the attention) instead of DTensor's rule keeping the sequence whole.
    The forward's other results (no dense sequence offsets, the random state dropout would
    read) go with the kernel. Returns how many nodes it rewrote."""
    done = 0
    for n in list(graph.nodes):
        # (flash with dropout is left to DTensor, whole: its random state goes to the backward)
        a = _flash_without_dropout(n)
        if a is None:
            continue
        if n.target is _CUDA_FLASH.default:
            n.target = fxpar_ops.flash_attention.default
            n.args = (a["query"], a["key"], a["value"], 0.0, a.get("is_causal", False),
                      a.get("scale"))
            n.meta[ir.VAL] = tuple(n.meta[ir.VAL][:2])
        else:
            n.target = fxpar_ops.flash_attention_backward.default
            n.args = tuple(a[k] for k in ("grad_out", "query", "key", "value", "out",
                                           "logsumexp")) + (0.0, a["is_causal"], a.get("scale"))
        n.kwargs = {}
        done += 1
    for n in list(graph.nodes):  # the forward's results nothing reads now
        if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) and \
                n.args[0].target is fxpar_ops.flash_attention.default and n.args[1] >= 2:
            if n.users:
                raise PlanError(
                    f"Plan.cp: {list(n.users)} read result {n.args[1]} of CUDA's flash "
                    f"attention {n.args[0].name} (its sequence offsets or random state), "
                    "which context parallelism does not carry: it splits flash attention "
                    "whose results go only to its own backward. Use cp=1, or report the "
                    "model to fxpar.")
            graph.erase_node(n)
    return done


def _ring_choice(mode: str, cp: int, profile, regather: bool):
    """The sharding engine's question for each attention with its queries split (`mode`:
    Plan.cp_attention): ring attention, or gather the keys and values? "ring" everywhere
    (else a PlanError naming the attention; `_check_ring` for those the question never
    reaches), "gather" nowhere, "auto" where it can run and the cost model prices its
    forward and backward together no slower (`cost.ring_attention_time`). A backward goes
    as its forward went."""
    def ring(node, a, kv_split: bool) -> bool:
        bwd = node.target in ATTENTION_BACKWARD
        if bwd and a["out"].target is operator.getitem:  # as its forward went (rewritten
            # already; a pipeline's backward part reads the forward's results as inputs and
            # decides alike below)
            return a["out"].args[0].target is fxpar_ops.ring_attention.default
        why = ring_refusal(node, a, kv_split)
        if mode == "ring" and why:
            raise _not_ring(node, why)
        if mode != "auto" or why:
            return mode == "ring"
        k, v = a["key"].meta[ir.VAL], a["value"].meta[ir.VAL]  # (whole: before fake_propagate)
        kv = cost.tensor_bytes(k) + cost.tensor_bytes(v)
        acc = kv * max(4, k.element_size()) / k.element_size()  # (the backward's, float32)
        # the forward and its backward (twice the kernel time) together
        kernel = cost.node_time(node, profile) / (2 if bwd else 1)
        fwd = cost.ring_attention_time(kv, kernel, cp, profile)
        bwd = cost.ring_attention_time(kv, 2 * kernel, cp, profile, acc, regather)
        return fwd[0] + bwd[0] <= fwd[1] + bwd[1]
    return ring


def _not_ring(node, why: str) -> PlanError:
    return PlanError(f"Plan.cp_attention='ring': the attention {node.name} (module "
                     f"{node.meta.get(ir.MODULE, '')!r}) cannot go around the ring: {why}. "
                     "Use cp_attention='gather' or 'auto' (it gathers that attention's keys "
                     "and values).")


def _check_ring(gm, seq: int) -> None:
    """Plan.cp_attention='ring': every attention became ring attention, or a PlanError names
    the first that did not (a kernel the ring runs whose queries reach it whole, a kernel no
    rule splits, attention written out as matmuls and a softmax over the whole sequence)."""
    for n in gm.graph.nodes:
        if n.meta.get(ir.REGION) != ir.FORWARD or n.op != "call_function":
            continue
        if n.target in context_attention.RING_KERNELS:  # (its queries never split)
            raise _not_ring(n, "its queries reach it whole: its sequence is not the one cp "
                               "splits (an encoder over another input), or is rebuilt whole "
                               "before it (a decoder fed the labels shifted right)")
        if n.target in ATTENTION and n.target is not fxpar_ops.ring_attention.default:
            raise _not_ring(n, f"{n.target} is not one of the flash kernels ring attention "
                               "runs (CUDA's memory-efficient or cuDNN kernel, or flash with "
                               "dropout)")
        if n.target is aten._softmax.default and seq > 1 and \
                n.meta[ir.VAL].shape[-1] == seq:
            raise _not_ring(n, "it is written out as matmuls and a softmax (ring attention "
                               "runs SDPA's flash kernels)")


def ring_refusal(node, a: dict, kv_split: bool) -> str | None:
    """Why an attention (its arguments by name; `kv_split`: its keys and values split over
    the sequence like its queries) cannot run as ring attention, or None."""
    q, k, v = (a[x].meta[ir.VAL] for x in ("query", "key", "value"))
    if not kv_split or not q.shape[2] == k.shape[2] == v.shape[2]:
        return ("its keys and values are not the queries' sequence split alike (e.g. "
                "cross-attention to another sequence)")
    if isinstance(a.get("attn_mask"), torch.fx.Node):
        return "it takes a mask (ring attention passes the keys' blocks, not the mask's)"
    if a.get("dropout_p", 0.0):
        return f"it applies dropout (p={a['dropout_p']}), whose mask the blocks would not share"
    return None


def sequence_dims(leaves: list[torch.fx.Node], cp: int) -> list[int | None]:
    """Per batch leaf, the dim cp splits (1: the sequence) or None (whole on every rank of
    the group). The sequence is dim 1 of the token ids (integer [B, S, ...]), or of
    embeddings fed instead ([B, S, H] floats); every leaf [B, S, ...] with that S splits."""
    vals = [n.meta[ir.VAL] for n in leaves]
    ids = [v for v in vals if v.dim() >= 2 and not v.is_floating_point()] or \
          [v for v in vals if v.dim() == 3]
    if not ids:
        raise PlanError(
            f"Plan.cp={cp} splits the sequence of the batch's token inputs, but no batch leaf "
            f"is one ([batch, sequence] token ids or [batch, sequence, hidden] embeddings; "
            f"leaf shapes: {[tuple(v.shape) for v in vals]}). Context parallelism is for "
            "sequence models; use cp=1.")
    seq = ids[0].shape[1]
    if seq % (2 * cp):
        raise BatchError(
            f"the sequence does not split over cp={cp} ranks: the batch's sequences have "
            f"{seq} tokens (dim 1), and each rank takes 2 of 2 x cp equal chunks (a front and "
            f"a back one, balancing causal attention). Pad the sequences to a multiple of "
            f"{2 * cp}, or use a cp with 2 x cp dividing {seq}.")
    return [1 if v.dim() >= 2 and v.shape[1] == seq else None for v in vals]


def _reduce_outputs(gm: torch.fx.GraphModule, group: str, cp: int) -> None:
    """The loss and buffers made whole over the group; every gradient made a partial sum
    (a whole one: this rank keeps it, the others contribute zeros), so that one sum over the
    dp group completes them all."""
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    outs = list(out.args[0])
    n_p = out.meta.get(ir.N_GRADS, 0)

    def placed(v, want):
        have = v.meta.get(ir.SHARD) if isinstance(v, torch.fx.Node) else None
        if have is None or have == want:
            return v
        with graph.inserting_before(out):  # (a whole gradient: this rank's, zeros elsewhere)
            r = redistribute(graph, v, have, want, [group], [cp],
                             {ir.MODULE: v.meta.get(ir.MODULE, ""),
                              ir.REGION: v.meta.get(ir.REGION, ir.BACKWARD)})
        r.meta[ir.SHARD] = want
        return r

    whole, partial = (Replicate(),), (Partial("sum"),)
    outs = [placed(v, partial if 1 <= i <= n_p else whole) if v is not None else None
            for i, v in enumerate(outs)]
    out.args = (tuple(outs),)


def _chunk_leaves(graph, leaves, dims, cp, group) -> None:
    """Each split leaf cut to this rank's chunk right after the placeholders (the runtime
    gives every rank of the group the whole sequences)."""
    last = max(leaves, key=lambda n: list(graph.nodes).index(n)) if leaves else None
    for leaf, d in zip(leaves, dims):
        if d is None:
            continue
        users = list(leaf.users)
        with graph.inserting_after(last):
            chunk = graph.call_function(fxpar_ops.zigzag_chunk.default, (leaf, d, cp, group))
        chunk.meta.update({ir.REGION: ir.FORWARD, ir.MODULE: "", ir.SHARD: (Shard(d),),
                           ir.VAL: leaf.meta[ir.VAL]})
        for u in users:
            u.replace_input_with(leaf, chunk)


# attention kernels as traced, forward and backward (the planner prices them: q, k, v are
# their first three tensor arguments, after the output's gradient in the backward); a causal
# one on CPU becomes the fxpar op
_KERNELS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
ATTENTION = {getattr(aten, k).default for k in _KERNELS if hasattr(aten, k)} | {
    fxpar_ops.causal_chunk_attention.default, fxpar_ops.flash_attention.default,
    fxpar_ops.ring_attention.default}
ATTENTION_BACKWARD = {getattr(aten, k + "_backward").default for k in _KERNELS
                      if hasattr(aten, k + "_backward")} | {
    fxpar_ops.causal_chunk_attention_backward.default,
    fxpar_ops.flash_attention_backward.default, fxpar_ops.ring_attention_backward.default}


def splits_attention(node) -> bool:
    """Whether this pass splits an attention kernel node's sequence (its queries' share of
    the work on each rank) rather than running it whole on every rank of the group: the
    flash kernels, the CPU's and CUDA's without dropout (`portable_flash`)."""
    if node.target is aten._scaled_dot_product_flash_attention_for_cpu.default or \
            node.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        return True
    return _flash_without_dropout(node) is not None


def _flash_without_dropout(node) -> dict | None:
    """A CUDA flash attention node's (forward or backward) arguments by name where it runs
    without dropout (what `portable_flash` rewrites), else None."""
    if _CUDA_FLASH is None or _CUDA_FLASH_BACKWARD is None or node.target not in (
            _CUDA_FLASH.default, _CUDA_FLASH_BACKWARD.default):
        return None
    norm = normalize_function(node.target, tuple(node.args), dict(node.kwargs),
                              normalize_to_only_use_kwargs=True)
    return norm.kwargs if norm is not None and not norm.kwargs.get("dropout_p", 0.0) \
        else None


_COLLECTIVES = {c10d.all_gather_into_tensor.default: 2, c10d.reduce_scatter_tensor.default: 3,
                c10d.all_reduce.default: 2}  # (-> the group's argument)


def _reaches_attention(gathered, hops: int = 6) -> bool:
    """Whether a gathered value feeds an attention within a few ops (views, a GQA repeat):
    its keys or values."""
    front, seen = {gathered}, {gathered}
    for _ in range(hops + 1):
        if any(n.target in ATTENTION or n.target in ATTENTION_BACKWARD for n in front):
            return True
        front = {u for n in front for u in n.users} - seen
        seen |= front
    return False


def report(gm, leaves, dims, cp, group: str) -> dict:
    """What the pass did: the split leaves, each attention (split, or left whole: its
    sequence gathered), the other forward ops that read a value gathered over the group
    (`gathered`: by module, or op where the module has no name: what runs on whole
    sequences), the collectives it added."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    attn = [n for n in nodes if n.target in ATTENTION and n.meta.get(ir.REGION) == ir.FORWARD]
    comms: dict[str, int] = {}
    gathered: dict[str, int] = {}
    for n in nodes:
        if n.target not in _COLLECTIVES or n.args[_COLLECTIVES[n.target]] != group:
            continue  # (tp's and ep's collectives are their passes')
        comms[n.target._opname] = comms.get(n.target._opname, 0) + 1
        if n.target is c10d.all_gather_into_tensor.default and \
                not _reaches_attention(n):  # (attention's keys and values: counted apart)
            readers, todo = set(), list(n.users)
            while todo:  # (through the wait, the chunks' reorder and the views it adds)
                u = todo.pop()
                if u.meta.get(ir.REGION) == ir.COMM or u.target in context_attention.REORDERS:
                    todo += list(u.users)
                elif u.meta.get(ir.REGION) == ir.FORWARD:
                    readers.add(u.meta.get(ir.MODULE) or "(outside the model's modules)")
            for r in readers:
                gathered[r] = gathered.get(r, 0) + 1
    split = [n for n in attn if n.meta[ir.SHARD][0] == (Shard(2),)]
    whole = [n for n in attn if n not in split]
    if whole:
        log.warning("context parallelism: %d of %d attention ops run on the whole sequence "
                    "(their queries reach them whole - a sequence cp does not split, e.g. a "
                    "decoder's target - or no rule splits their kernel on this device): %s",
                    len(whole), len(attn), ", ".join(sorted({
                        f"{n.meta.get(ir.MODULE, '')} ({n.target})" for n in whole})))
    return {"cp": cp,
            "split": [n.meta[ir.FQN] for n, d in zip(leaves, dims) if d is not None],
            "attention": [n.meta.get(ir.MODULE, "") for n in split],
            "whole_attention": [n.meta.get(ir.MODULE, "") for n in attn if n not in split],
            "gathered": dict(sorted(gathered.items())),
            "causal": sum(n.target is fxpar_ops.causal_chunk_attention.default for n in split),
            # (their keys and values passed around the group, not gathered)
            "ring": sum(n.target is fxpar_ops.ring_attention.default for n in split),
            "ring_backward": sum(n.target is fxpar_ops.ring_attention_backward.default
                                 for n in nodes),
            "collectives": comms}
