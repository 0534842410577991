"""Context parallelism (Plan.cp, passes/context_parallel.py): the sequence leaves it splits,
the rewrite (attention on gathered keys/values, the causal chunk kernel, which collectives
appear on which group), the chunk kernel against whole-sequence attention, the plans and
batches it refuses, and training on gloo ranks against eager."""
import dataclasses
import operator

import pytest
import torch

import fxpar
from fxpar.api.parallelize import mesh_dims
from fxpar.core import context_attention, ir
from fxpar.core.errors import BatchError, PlanError
from fxpar.core.plan import resolve
from fxpar.examples import zoo

import workers
from test_parity import _check_plans

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
fxpar_ops = torch.ops.fxpar


def _llama():
    model, spec = zoo.build("llama")
    return model, spec.batch(0)


def _group_of(n):
    return n.args[{c10d.all_gather_into_tensor.default: 2, c10d.reduce_scatter_tensor.default: 3,
                   c10d.all_reduce.default: 2}[n.target]]


def test_rewrite_splits_the_sequence_and_gathers_keys_and_values():
    """dp=2 as cp=2 on HF Llama (2 layers, SDPA causal, 16 tokens: cp_attention "auto"
    gathers, test_ring_attention_keeps_keys_and_values_split): both token leaves cut to the
    rank's half of the sequence in the graph (a front and a back quarter); per layer one
    causal chunk attention forward and backward (none left whole), k and v all-gathered over
    the cp group forward and their gradients reduce-scattered backward; the gradients summed
    over the whole dp group; every activation of a linear holds half the tokens."""
    model, batch = _llama()
    prog = fxpar.compile(model, 2, example_batch=batch, plan={"dp": 2, "cp": 2, "fuse": False})
    g = prog.graph.graph
    assert prog.cp == 2 and prog.rows == 1 and prog.plan.cp_attention == "auto"
    assert prog.graph.meta[ir.SEQUENCE_SPLIT] == [1, 1]
    assert mesh_dims(prog.plan) == [("cdp", 1), ("cp", 2)]
    chunks = [n for n in g.nodes if n.target is fxpar_ops.zigzag_chunk.default
              and n.args[0].op == "placeholder"]
    assert len(chunks) == 2 and all(n.args[1:] == (1, 2, ir.GROUPS["cp"]) for n in chunks)
    fwd = [n for n in g.nodes if n.target is fxpar_ops.causal_chunk_attention.default]
    bwd = [n for n in g.nodes if n.target is fxpar_ops.causal_chunk_attention_backward.default]
    assert len(fwd) == len(bwd) == 2
    assert not [n for n in g.nodes
                if n.target is aten._scaled_dot_product_flash_attention_for_cpu.default]
    B, S = batch["input_ids"].shape
    for n in fwd:
        q, k, v = (a.meta[ir.VAL] for a in n.args[:3])
        assert q.shape[2] == S // 2 and k.shape[2] == v.shape[2] == S
        assert n.args[-1] == ir.GROUPS["cp"]
    report = prog.graph.meta[ir.CP_REPORT]
    assert report["causal"] == 2 and not report["whole_attention"]
    assert report["split"] == ["batch[0]", "batch[1]"]
    gathers = [n for n in g.nodes if n.target is c10d.all_gather_into_tensor.default
               and _group_of(n) == ir.GROUPS["cp"] and n.meta[ir.REGION] != ir.BACKWARD]
    scatters = [n for n in g.nodes if n.target is c10d.reduce_scatter_tensor.default
                and _group_of(n) == ir.GROUPS["cp"]]
    # k and v per layer (and the shifted labels, gathered once for the loss)
    per_layer = [n for n in gathers if ".self_attn" in n.meta[ir.MODULE]]
    assert len(per_layer) == 4 and len(scatters) == 4
    dp_sums = [n for n in g.nodes if n.target is c10d.all_reduce.default
               and _group_of(n) == ir.GROUPS["dp"]]
    assert dp_sums  # the gradient buckets
    for n in g.nodes:  # every linear runs on the rank's tokens
        if n.target is aten.mm.default and n.meta[ir.REGION] == ir.FORWARD:
            assert n.meta[ir.VAL].shape[0] == B * S // 2, n.meta[ir.MODULE]
    # with remat on (memory short), the backward gathers k and v again rather than holding
    # the forward's whole copies: 2 gathers more per layer (a budget that recomputes no
    # attention)
    lean = fxpar.compile(model, 2, example_batch=batch,
                         plan={"dp": 2, "cp": 2, "fuse": False, "remat": 10 ** 12,
                               "cp_attention": "gather"})
    again = [n for n in lean.graph.graph.nodes if n.target is c10d.all_gather_into_tensor.default
             and _group_of(n) == ir.GROUPS["cp"] and ".self_attn" in n.meta[ir.MODULE]]
    assert len([n for n in lean.graph.graph.nodes
                if n.target is fxpar_ops.causal_chunk_attention.default]) == 2
    assert len(again) == 8
    four = fxpar.compile(model, 4, example_batch=batch, plan={"dp": 4, "cp": 2, "fuse": False})
    assert four.rows == 2 and four.batch_shard_dims == [0, 0]
    assert mesh_dims(four.plan) == [("cdp", 2), ("cp", 2)]


def test_mean_loss_counts_every_ranks_targets_when_rows_split_too():
    """cp=2 inside dp=4 (two row groups) on a masked LM (1 in 4 positions labelled, so the
    ranks count different targets): the loss is the whole batch's sum over its whole count -
    one all-reduce of (sum, count) over the dp group, read by the loss and by the backward
    as its target count - not each row group's mean averaged (what the row split made of the
    sequence's exact mean)."""
    model, spec = zoo.build("bert_mlm")
    prog = fxpar.compile(model, 4, example_batch=spec.batch(0),
                         plan={"dp": 4, "cp": 2, "fuse": False, "overlap": False})
    g = prog.graph.graph
    assert prog.cp == 2 and prog.rows == 2
    nll = next(n for n in g.nodes if n.target is aten.nll_loss_forward.default)
    reductions = [n for n in g.nodes if n.target is c10d.all_reduce.default
                  and n.meta.get(ir.LOSS_REDUCTION)]
    assert len(reductions) == 1 and _group_of(reductions[0]) == ir.GROUPS["dp"]
    pair = reductions[0].args[0]
    assert pair.target is aten.stack.default
    assert {a.target for a in pair.all_input_nodes} == {aten.where.ScalarOther,
                                                        operator.getitem}
    assert all(a.args[0] is nll for n in pair.all_input_nodes
               for a in [n, *n.all_input_nodes] if a.target is operator.getitem)
    done = next(iter(reductions[0].users))
    loss = next(iter(g.output_node().args[0]))
    assert loss.target is aten.div.Tensor and all(a.args[0] is done for a in loss.args)
    backward = next(n for n in g.nodes if n.target is aten.nll_loss_backward.default)
    assert backward.args[6] is loss.args[1]  # (its target count: the whole batch's)
    # no row group averages a mean: the loss reads no other reduction
    assert [n for n in ir.ancestors([loss]) if n.target is c10d.all_reduce.default] == \
        reductions


def test_ring_attention_keeps_keys_and_values_split():
    """cp_attention="ring": every attention of HF Llama, forward and backward, is
    fxpar::ring_attention(_backward) on the cp group with q, k, v of the rank's tokens; no
    key or value is all-gathered and no gradient of theirs reduce-scattered (the only cp
    gather left: the shifted labels). ("auto" asks the cost model per attention: at these
    16 tokens the ring's steps are latency alone and it gathers, as the rewrite test
    shows; test_cost has the other side.) Refused by name under "ring": a mask, attention
    written out as matmuls (it never reaches the ring rule), and ring without cp."""
    model, batch = _llama()
    B, S = batch["input_ids"].shape
    prog = fxpar.compile(model, 2, example_batch=batch,
                         plan={"dp": 2, "cp": 2, "fuse": False, "cp_attention": "ring"})
    g = prog.graph.graph
    fwd = [n for n in g.nodes if n.target is fxpar_ops.ring_attention.default]
    bwd = [n for n in g.nodes if n.target is fxpar_ops.ring_attention_backward.default]
    assert len(fwd) == len(bwd) == 2
    for n in fwd:
        q, k, v = (a.meta[ir.VAL] for a in n.args[:3])
        assert q.shape[2] == k.shape[2] == v.shape[2] == S // 2
        assert n.args[3:5] == (0.0, True) and n.args[-1] == ir.GROUPS["cp"]
    for n in bwd:
        assert all(a.meta[ir.VAL].shape[2] == S // 2 for a in n.args[:6])
    cp_comms = [n for n in g.nodes if n.target in (c10d.all_gather_into_tensor.default,
                                                     c10d.reduce_scatter_tensor.default)
                and _group_of(n) == ir.GROUPS["cp"]]
    assert not [n for n in cp_comms if ".self_attn" in n.meta[ir.MODULE]]
    assert len(cp_comms) == 1  # (the labels, shifted on the whole sequence)
    report = prog.graph.meta[ir.CP_REPORT]
    assert (report["ring"], report["ring_backward"], report["causal"]) == (2, 2, 0)
    ids = torch.randint(0, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0  # (right padding: the causal mask and the padding as one mask)
    padded = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    with pytest.raises(PlanError, match="cp_attention='ring'.*takes a mask"):
        fxpar.compile(model, 2, example_batch=padded,
                      plan={"dp": 2, "cp": 2, "cp_attention": "ring"})
    eager = _llama()[0]  # attention written out: never reaches the ring, said so
    eager.config._attn_implementation = "eager"
    with pytest.raises(PlanError, match="cp_attention='ring'.*written out as matmuls"):
        fxpar.compile(eager, 2, example_batch=batch,
                      plan={"dp": 2, "cp": 2, "cp_attention": "ring"})
    with pytest.raises(PlanError, match="cp=1 splits no sequence"):
        resolve({"dp": 2, "cp_attention": "ring"}, 2)
    with pytest.raises(PlanError, match="must be one of"):
        resolve({"dp": 2, "cp": 2, "cp_attention": "rings"}, 2)


@pytest.mark.slow  # (make test's 6 minutes)
def test_hsdp_shards_within_groups_holding_whole_cp_groups():
    """cp with HSDP (dp=8 in shard groups of 4, cp=2 inside each): the mesh is (replicas,
    the shard group's row groups, cp); ZeRO-3 gathers and reduce-scatters over the shard
    group, each summed shard then all-reduced across the replicas; the keys and values
    over cp, the loss's sum and count over the whole dp group (every row group's targets)."""
    model, batch = _llama()
    plan = {"dp": 8, "cp": 2, "zero": 3, "dp_shard": 4, "fuse": False, "cp_attention": "gather"}
    assert mesh_dims(resolve(plan, 8)) == [("dp_rep", 2), ("cdp_shard", 2), ("cp", 2)]
    g = fxpar.compile(model, 8, example_batch={k: v.repeat(4, 1) for k, v in batch.items()},
                      plan=plan).graph.graph
    groups = {}
    for n in g.nodes:
        if n.target in (c10d.all_gather_into_tensor.default,
                        c10d.reduce_scatter_tensor.default, c10d.all_reduce.default):
            groups.setdefault(n.target, set()).add(_group_of(n))
        if n.target is c10d.reduce_scatter_tensor.default and \
                _group_of(n) == ir.GROUPS["dp_shard"]:
            wait = next(iter(n.users))
            assert [(u.target, _group_of(u)) for u in wait.users] == [
                (c10d.all_reduce.default, ir.GROUPS["dp_rep"])], n.name
    G = ir.GROUPS
    assert groups[c10d.all_gather_into_tensor.default] == {G["dp_shard"], G["cp"]}
    assert groups[c10d.reduce_scatter_tensor.default] == {G["dp_shard"], G["cp"]}
    assert groups[c10d.all_reduce.default] == {G["dp_rep"], G["dp"]}


@pytest.mark.slow  # (make test's 6 minutes)
def test_cuda_flash_attention_splits_as_the_cpus():
    """A plan for CUDA traces SDPA as CUDA's kernels (compiler/target_attention.py; run on
    this CPU). In bf16, causal, without dropout that is flash attention, which the pass makes
    the same causal chunk attention as the CPU's flash kernel (portable_flash): the program is
    the CPU capture's node for node (but a view's kind), so what trains like eager on CPU
    (test_llama_cp2_trains_like_eager) is what a GPU runs, each rank 1/cp of the attention.
    Where CUDA runs the memory-efficient kernel (DeepSeek's value head dim) it stays whole
    (said in the report; its random-state scalars replicated)."""
    from fxpar.compiler.target_attention import CudaAttention
    model, batch = _llama()
    plan = {"dp": 2, "cp": 2, "fuse": False, "cp_attention": "gather"}

    def targets(prog):
        return [str(n.target).replace("_unsafe_view", "view") for n in prog.graph.graph.nodes]
    half = model.to(torch.bfloat16)
    with CudaAttention():
        gpu = fxpar.compile(half, 2, example_batch=batch, plan=plan)
    cpu = fxpar.compile(half, 2, example_batch=batch, plan=plan)
    assert targets(gpu) == targets(cpu)
    report = gpu.graph.meta[ir.CP_REPORT]
    assert report["causal"] == 2 and not report["whole_attention"]
    assert not [n for n in gpu.graph.graph.nodes if "flash_attention" in str(n.target)]
    from test_target_attention import MLAttention  # (query/key head dims not the value's)
    ids = torch.randint(0, 64, (1, 32))
    with CudaAttention():
        fp32 = fxpar.compile(MLAttention(), 2, example_batch={"ids": ids, "labels": ids},
                             plan=plan)
    report = fp32.graph.meta[ir.CP_REPORT]
    assert report["causal"] == 0 and len(report["whole_attention"]) == 1
    assert [n for n in fp32.graph.graph.nodes
            if n.target is aten._scaled_dot_product_efficient_attention.default]


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_chunk_attention_is_whole_sequence_attention(monkeypatch, cp):
    """Each rank's pair of chunks of queries (r and 2cp-1-r of 2cp: fxpar::zigzag_chunk)
    against the whole keys: its rows of causal SDPA over the whole sequence; the keys' and
    values' gradients, summed over the ranks, SDPA's; zigzag_order between the natural and
    the ranks' order is a permutation and its inverse."""
    torch.manual_seed(0)
    B, H, S, D = 2, 3, 8 * cp, 4
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    go = torch.randn_like(ref)
    ref.backward(go)
    gk, gv = torch.zeros_like(k), torch.zeros_like(v)
    pieces = []
    for r in range(cp):
        monkeypatch.setattr(context_attention, "_rank", lambda name, r=r: r)
        qc = fxpar_ops.zigzag_chunk(q.detach(), 2, cp, "g")
        C = S // (2 * cp)
        want = torch.cat([q.detach()[:, :, r * C:(r + 1) * C],
                          q.detach()[:, :, (2 * cp - 1 - r) * C:(2 * cp - r) * C]], 2)
        assert torch.equal(qc, want)
        out, lse = fxpar_ops.causal_chunk_attention(qc, k.detach(), v.detach(), 0.0, None, "g")
        torch.testing.assert_close(out, fxpar_ops.zigzag_chunk(ref.detach(), 2, cp, "g"))
        dq, dk, dv = fxpar_ops.causal_chunk_attention_backward(
            fxpar_ops.zigzag_chunk(go, 2, cp, "g"), qc, k.detach(), v.detach(), out, lse,
            0.0, None, "g")
        torch.testing.assert_close(dq, fxpar_ops.zigzag_chunk(q.grad, 2, cp, "g"))
        if r == 0:  # its chunks see keys up to the end of the last chunk
            assert dk[:, :, :C].any() and dk[:, :, -C:].any()
        gk, gv = gk + dk, gv + dv
        pieces.append(qc)
    torch.testing.assert_close(gk, k.grad)
    torch.testing.assert_close(gv, v.grad)
    gathered = torch.cat(pieces, 2)  # what an all-gather in rank order holds
    natural = fxpar_ops.zigzag_order(gathered, 2, cp, "g", False)
    assert torch.equal(natural, q.detach())
    assert torch.equal(fxpar_ops.zigzag_order(natural, 2, cp, "g", True), gathered)


@pytest.mark.parametrize("cp", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ring_attention_is_whole_sequence_attention(cp):
    """fxpar::ring_attention on cp gloo ranks, each holding its zigzag chunks of q, k and v
    (the others' keys/values passed around the ring, never gathered): its output and
    gradients, causal and not, are whole-sequence SDPA's rows for the rank's chunks (its
    keys' and values' gradients complete: every rank's queries' share summed on the way
    round; in float64, and causal in float32 too). cp=3: an odd ring, where the blocks'
    owners and the pairs' order differ."""
    for r, cases in fxpar.launch(workers.ring_attention_rank, cp).items():
        for (causal, dtype), (got, want) in cases.items():
            for g, w, name in zip(got, want, ("out", "grad_q", "grad_k", "grad_v")):
                torch.testing.assert_close(
                    g, w, msg=lambda m: f"rank {r} causal={causal} {dtype} {name}: {m}")


def test_plans_and_batches_context_parallelism_refuses_by_name():
    """cp must divide dp (and HSDP's shard groups) and the sequence (into 2 x cp chunks);
    with ep, the smaller of the two groups inside the larger; not with hpZ, nor with ep and
    HSDP at once yet; a model fed no sequence (an MLP's [batch, features]) has
    nothing to split; under "ring", an attention whose queries reach it whole (a decoder
    over a target sequence of another length) has nothing to pass around."""
    with pytest.raises(PlanError, match="must divide dp=3"):
        resolve({"dp": 3, "cp": 2}, 3)
    with pytest.raises(PlanError, match="cp must divide dp_shard"):
        resolve({"dp": 8, "cp": 4, "zero": 3, "dp_shard": 2}, 8)
    with pytest.raises(PlanError, match="hpz=2"):
        resolve({"dp": 4, "cp": 2, "zero": 3, "hpz": 2}, 4)
    with pytest.raises(PlanError, match="one must divide the other"):
        resolve({"dp": 12, "cp": 4, "ep": 6}, 12)
    with pytest.raises(PlanError, match="ep=2 and dp_shard=4"):
        resolve({"dp": 8, "cp": 2, "ep": 2, "zero": 3, "dp_shard": 4}, 8)
    with pytest.raises(PlanError, match="positive integer"):
        resolve({"dp": 2, "cp": 0}, 2)
    model, batch = _llama()
    odd = {k: v[:, :14] for k, v in batch.items()}
    with pytest.raises(BatchError, match="14 tokens .* multiple of 4"):
        fxpar.compile(model, 2, example_batch=odd, plan={"dp": 2, "cp": 2})
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 4))
    with pytest.raises(PlanError, match="no batch leaf is one"):
        fxpar.compile(mlp, 2, example_batch=(torch.randn(8, 16), torch.randn(8, 4)),
                      loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                      plan={"dp": 2, "cp": 2})
    seq2seq, spec = zoo.build("nn_transformer")
    with pytest.raises(PlanError, match="self_attn.* queries reach it whole"):
        fxpar.compile(seq2seq, 2, example_batch=spec.batch(0),
                      plan={"dp": 2, "cp": 2, "cp_attention": "ring"})


def test_a_view_into_chunks_too_few_to_split_runs_on_the_whole_sequence():
    """A scan within chunks of 8 of a 16-token sequence (the sequence viewed as [2, 8]):
    DTensor's view rule keeps the split on the chunks dim, where cp=2's layout (a front and
    a back quarter a rank) does not fit, and each rank would have scanned its quarters as if
    they were the chunks (3 steps 1e-1 off eager). The view runs on the gathered sequence."""
    model, batch_fn, loss_fn = workers.build("chunked_scan")
    prog = fxpar.compile(model, 2, example_batch=batch_fn(0), loss_fn=loss_fn,
                         plan={"dp": 2, "cp": 2, "fuse": False})
    g = prog.graph.graph
    scan = next(n for n in g.nodes if n.target is aten.cumsum.default)
    assert tuple(scan.meta[ir.VAL].shape) == (workers.GLOBAL_BATCH, 2, 8, 16)
    # the sequence was gathered over cp on the way to it
    assert [n for n in ir.ancestors([scan]) if n.target is c10d.all_gather_into_tensor.default
            and _group_of(n) == ir.GROUPS["cp"]]
    # the embedding still runs on the rank's half of the tokens
    emb = next(n for n in g.nodes if n.target is aten.embedding.default)
    assert tuple(emb.meta[ir.VAL].shape) == (workers.GLOBAL_BATCH, 8, 16)


@pytest.mark.parametrize("dropout", [False, True])
def test_a_norm_and_mlp_on_flattened_tokens_run_on_each_ranks_own(dropout):
    """OPT's decoder layer flattens its tokens ([B, S, H] -> [B*S, H]) before its final layer
    norm and MLP: under cp the rank's chunks flattened are a strided shard of the rows,
    which the layer norm, fc1, ReLU and fc2 (and their backward) carry row by row - each
    rank runs the MLP on its own tokens, and nothing but attention's keys and values and
    the shifted labels is gathered over cp. With OPT's default dropouts, the MLP's dropout
    draws its mask for the rank's own tokens too (as on the sequence split not flattened)."""
    model, spec = zoo.build("opt", dropout=dropout)
    batch = spec.batch(0)
    B, S = batch["input_ids"].shape
    prog = fxpar.compile(model, 2, example_batch=batch, plan={"dp": 2, "cp": 2, "fuse": False})
    g = prog.graph.graph
    mlp = [n for n in g.nodes if n.target is aten.addmm.default
           and n.meta.get(ir.MODULE, "").endswith(("fc1", "fc2"))]
    assert len(mlp) == 2 * model.config.num_hidden_layers and all(
        n.meta[ir.VAL].shape[0] == B * S // 2 for n in mlp)
    assert prog.graph.meta["context_parallel"]["gathered"] == {
        "(outside the model's modules)": 1}  # (the labels shifted for the loss)
    # forward and backward: each layer's keys and values, the labels; nothing else
    gathers = [n for n in g.nodes if n.target is c10d.all_gather_into_tensor.default
               and _group_of(n) == ir.GROUPS["cp"]]
    assert len(gathers) == 2 * model.config.num_hidden_layers + 1
    drops = [n for n in g.nodes if n.target is aten.native_dropout.default
             and n.meta[ir.VAL][0].dim() == 2]
    assert len(drops) == (model.config.num_hidden_layers if dropout else 0) and all(
        n.meta[ir.VAL][0].shape[0] == B * S // 2 for n in drops)


@pytest.mark.slow  # (two ranks launched: make test's 6 minutes)
def test_llama_cp2_trains_like_eager():
    """cp=2 on 2 ranks (HF Llama: RoPE, causal SDPA, the shifted-label loss; a scan within
    chunks of the sequence, run whole; HF Mixtral (also with one sequence a step), its MoE
    dispatch on each rank's own tokens; HF DeepSeek-V3 with ep=2 as well, each rank's
    tokens sent to their experts - V3's group-limited routing gathers its top-k ids, which
    the dispatch cuts back to the tokens' layout; HF OPT, its final norm and MLP on tokens
    flattened behind the batch): losses, evaluate() and every final weight equal eager
    AdamW. (Ring attention: the op against SDPA above; trained with tp,
    cp=4 and a pipeline in the slow composition test. torchtitan's MoE: within rounding,
    as under every plan, in docs/zoo.md.)"""
    _check_plans(2, [(name, "adamw", {"dp": 2, "cp": 2, "codegen": "eager", **more})
                     for name, more in (("hf_llama", {}), ("chunked_scan", {}), ("mixtral", {}),
                                        ("mixtral_one_row", {}), ("deepseek_v3", {"ep": 2}),
                                        ("opt", {}))])


@pytest.mark.slow
def test_context_parallelism_composes_on_four_ranks():
    """cp=2 inside dp=4 (two row groups), with tp=2, with a pipeline of 2 stages (1F1B and
    zero-bubble, microbatched), and cp=4 with ZeRO-2 (attention gathered, as ring
    attention - with tp, cp=4 and the pipeline - and as the cost model picks per attention);
    cp=2 inside HSDP's shard groups of 2 with ZeRO-3; GPT-2 (learned positions) with ZeRO-3
    and remat; fxpar's own GPT; right-padded rows (an attention mask, ignored labels,
    microbatches weighted by their target counts; inside dp=4, row groups counting different
    targets); Mixtral with ep=4 (an expert group spanning two cp groups) and listed
    experts (where_moe) inside dp=4; Inductor's code for the chunk kernels:
    every one equal to eager. A pipeline's backward parts run ring attention as
    their forward parts do."""
    _check_plans(4, [("hf_llama", "adamw", {**p, "codegen": "eager"}) for p in (
        {"dp": 4, "cp": 2, "cp_attention": "gather"},
        {"dp": 2, "cp": 2, "tp": 2, "cp_attention": "ring"},
        {"dp": 4, "cp": 4, "zero": 2, "cp_attention": "ring"},
        {"dp": 2, "cp": 2, "pp": 2, "microbatches": 2, "cp_attention": "ring"},
        {"dp": 2, "cp": 2, "pp": 2, "microbatches": 4, "schedule": "zero-bubble"},
        {"dp": 4, "cp": 2, "zero": 3, "dp_shard": 2})]
        # (row groups counting different targets: the mean over all of them)
        + [("hf_llama_padded", "adamw", {"dp": 4, "cp": 2, "codegen": "eager"})]
        # MoE dispatches inside row groups: Mixtral's on each rank's own tokens, sent to
        # their experts' ranks, listed experts' (routed by torch.where) on the cp group's,
        # then split by dp's rows
        + [(name, "adamw", {"dp": 4, "cp": 2, "codegen": "eager", **more})
           for name, more in (("mixtral", {"ep": 4}), ("where_moe", {}))])
    _check_plans(2, [("hf_gpt2", "adamw", {"dp": 2, "cp": 2, "zero": 3, "remat": "sqrt",
                                           "codegen": "eager"}),
                     ("gpt", "adamw", {"dp": 2, "cp": 2, "codegen": "eager"}),
                     ("hf_llama_padded", "adamw", {"dp": 2, "cp": 2, "microbatches": 2,
                                                   "codegen": "eager"}),
                     ("hf_llama", "adamw", {"dp": 2, "cp": 2})])
    # a pipeline's backward parts read their forward's results as inputs: ring there too
    model, batch = _llama()
    prog = fxpar.compile(model, 4, example_batch=batch,
                         plan={"dp": 2, "cp": 2, "pp": 2, "microbatches": 2,
                               "cp_attention": "ring", "fuse": False})
    parts = prog.stage_graphs["stages"]
    for name, want in (("F", fxpar_ops.ring_attention.default),
                       ("B", fxpar_ops.ring_attention_backward.default)):
        for r in (0, 1):
            assert [n.target for n in parts[f"{name}{r}"].graph.nodes
                    if n.target in (want, fxpar_ops.causal_chunk_attention.default,
                                    fxpar_ops.causal_chunk_attention_backward.default)] == [want]


@pytest.mark.slow
def test_checkpoint_resumes_and_reshards(tmp_path):
    """A cp=2 run saves at step 5: it resumes bit for bit, and plain dp=2 loads the same
    checkpoint and takes its next step (the weights are whole on every rank)."""
    workers.check_resumed_and_resharded(2, "hf_llama", {"dp": 2, "cp": 2, "codegen": "eager"},
                                        {"dp": 2, "codegen": "eager"}, str(tmp_path))


def test_planner_prices_context_parallelism():
    """The planner's statistics hold the sequence and each layer's attention (its keys' and
    values' bytes); where the batch has fewer rows than ranks it prices cp (the smallest
    that lets dp use every rank) with the gathers, and a fixed cp is the only one priced; a
    model without a sequence gets no cp plan and a fixed one names why."""
    from fxpar.compiler import planner
    from fxpar.compiler.compile import planner_stats
    from fxpar.core import cost
    model, batch = _llama()
    stats = planner_stats(model, batch)
    B, S = batch["input_ids"].shape
    assert stats.seq == S and stats.cp_refusal is None
    attn = [s for s in stats.segments if s.n_attn]
    assert [s.name for s in attn] == ["model.layers.0", "model.layers.1"]
    kv = 2 * B * model.config.num_key_value_heads * S * model.config.head_dim * 4
    assert all(s.kv_bytes == kv and s.attn_flops_f > 0 and s.attn_flops_b > 0 for s in attn)
    hw = cost.HARDWARE["h100"]
    r = planner.search(stats, 2 * B, hw, batch_rows=B, executable=False)
    wide = [c for c in r.table if c.plan.dp == 2 * B]
    assert wide and all(c.plan.cp == 2 for c in wide)
    assert all(c.plan.cp == 1 for c in r.table if c.plan.dp <= B)
    # on a device where what full recompute keeps of one sequence (each layer's input) takes
    # over a quarter of its memory (a microbatch of one row may not fit) cp is priced at its
    # smallest degrees, rows dividing dp or not
    one_row = sum(s.boundary for s in stats.layers) / stats.rows
    small = dataclasses.replace(hw, memory=one_row * 3)
    assert planner._context_degrees(stats, B, 1, 1, B, {}, hw) == [1]
    assert planner._context_degrees(stats, B, 1, 1, B, {}, small)[:3] == [1, 2, 4]
    # a field cp does not run with yet, fixed by the user: no cp plan priced
    r = planner.search(stats, 2 * B, hw, batch_rows=B, executable=False,
                       constraints={"grad_compression": "1bit-adam"})
    assert r.table and all(c.plan.cp == 1 for c in r.table)
    r = planner.search(stats, 4, hw, batch_rows=B, executable=False,
                       constraints={"cp": 2, "tp": 1, "pp": 1})
    assert {(c.plan.dp, c.plan.cp) for c in r.table} == {(4, 2)}
    # HSDP: cp inside shard groups of 2 (the same cp plan, ZeRO-3 within each group)
    r = planner.search(stats, 4, hw, batch_rows=B, executable=False,
                       constraints={"cp": 2, "tp": 1, "pp": 1, "zero": 3, "dp_shard": 2})
    assert r.table and all(c.plan.hsdp and c.plan.cp == 2 for c in r.table)
    fixed = {"cp": 2, "tp": 1, "pp": 1, "zero": 0}
    one = planner.search(stats, 4, hw, batch_rows=B, executable=False, constraints=fixed)
    plain = planner.search(stats, 4, hw, batch_rows=B, executable=False,
                           constraints={"tp": 1, "pp": 1, "zero": 0, "dp": 4})
    assert one.best.step_s > plain.best.step_s  # the gathers, at as many tokens per rank
    # attention written out (the built-in GPTs': q @ k^T, softmax, dropout, @ v) is found by
    # its softmax over the sequence: k^T and v gathered, priced split on every device
    from fxpar.examples import gpt_stats
    gpt2 = gpt_stats.gpt_stats("gpt2")
    written = [s for s in gpt2.segments if s.n_attn]
    assert gpt2.seq == 1024 and len(written) == len(gpt2.layers)
    assert all(s.kv_bytes == 2 * 1024 * 768 * 2 and s.sdpa_flops_f == 0 < s.attn_flops_f
               for s in written)
    # a rank's segments are summed into a few stand-ins to price it: they carry every
    # layer's attention (the stand-in for all layers but the largest once dropped them:
    # a cp plan paid one layer's gathers)
    for st, pp in ((stats, 1), (gpt2, 1), (gpt2, 2)):
        ranks = planner._rank_aggregates(planner.stages_of(st, pp), pp, 1)
        for f in ("kv_bytes", "attn_flops_f", "attn_flops_b", "n_attn", "qo_bytes"):
            assert sum(getattr(s, f) for r in ranks for s in r) == pytest.approx(
                sum(getattr(s, f) for s in st.segments)), f
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 4))
    flat = planner_stats(mlp, (torch.randn(8, 16), torch.randn(8, 4)),
                         loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    assert flat.seq is None and "no batch leaf is one" in flat.cp_refusal
    with pytest.raises(PlanError, match="Plan.cp=2: PlanError: .*no batch leaf"):
        planner.search(flat, 4, hw, batch_rows=8, executable=False, constraints=fixed)


def test_an_moe_dispatch_runs_on_each_ranks_own_tokens():
    """An MoE's dispatch (its sort, histogram and grouped matmuls; core/local_dispatch) under
    cp runs on the rank's own tokens, as under dp on its own rows: Mixtral's router scores,
    their top-k and the token gathers keep the sequence split flattened behind the batch (a
    strided shard), so the grouped matmuls take half of the pairs at cp=2, and no token is
    gathered over the cp group forward (only attention's keys and values are); with one
    sequence in the batch too."""
    model, spec = zoo.build("mixtral")
    batch = spec.batch(0)
    B, S = batch["input_ids"].shape
    prog = fxpar.compile(model, 2, example_batch=batch, plan={"dp": 2, "cp": 2, "fuse": False})
    g = prog.graph.graph
    k = model.config.num_experts_per_tok
    rows = [n.meta[ir.VAL].shape[0] for n in g.nodes
            if n.target is aten._grouped_mm.default and n.meta[ir.REGION] == ir.FORWARD]
    assert len(rows) == 4 and all(r == B * S * k // 2 for r in rows)
    forward_gathers = {n.meta[ir.MODULE] for n in g.nodes
                       if n.target is c10d.all_gather_into_tensor.default
                       and _group_of(n) == ir.GROUPS["cp"] and n.meta[ir.REGION] == ir.COMM
                       and any(u.meta.get(ir.REGION) == ir.FORWARD
                               for w in n.users for u in w.users)}
    assert forward_gathers and all(m.endswith("self_attn") or m == "" for m in forward_gathers)
    # one sequence in the batch (cp's long-context case): its tokens flattened are a plain
    # shard, one block, and the dispatch still runs on the rank's own
    one = {name: v[:1] for name, v in batch.items()}
    prog = fxpar.compile(model, 2, example_batch=one, plan={"dp": 2, "cp": 2, "fuse": False})
    assert [n.meta[ir.VAL].shape[0] for n in prog.graph.graph.nodes
            if n.target is aten._grouped_mm.default
            and n.meta[ir.REGION] == ir.FORWARD] == [S * k // 2] * 4


@pytest.mark.slow  # (two more models compiled: make test's 6 minutes)
def test_torchtitans_and_listed_experts_run_on_each_ranks_own_tokens():
    """As Mixtral's (above): torchtitan's MoE, whose counts are made outside its dispatch,
    and experts listed in an nn.ModuleList, routed by torch.where and grouped."""
    # torchtitan's MoE counts each expert's tokens outside its dispatch (a histogram over the
    # routing): placed by cp's rules, they are the rank's own, and its grouped matmuls too
    pytest.importorskip("torchtitan")
    from fxpar.examples import external_zoo
    titan, spec = external_zoo.build("titan_qwen3_moe")
    batch = spec.batch(0)
    prog = fxpar.compile(titan, 2, example_batch=batch, plan={"dp": 2, "cp": 2, "fuse": False},
                         loss_fn=spec.loss_fn)
    mms = [n for n in prog.graph.graph.nodes if n.target is aten._grouped_mm.default
           and n.meta[ir.REGION] == ir.FORWARD]
    B, S = batch["input_ids"].shape
    k = titan.layers["0"].moe.router.top_k
    assert mms and all(n.meta[ir.VAL].shape[0] == B * S * k // 2 for n in mms)
    # experts listed in an nn.ModuleList, routed by torch.where and grouped: their routing's
    # masks and expert ids keep the tokens' split (where(mask, e, ids), unsqueeze, select),
    # so the grouped matmuls take the rank's own rows, as many as under dp=2
    listed, spec = zoo.build("where_moe")

    def rows(plan):
        prog = fxpar.compile(listed, 2, example_batch=spec.batch(0), loss_fn=spec.loss_fn,
                             plan={**plan, "fuse": False})
        return [n.meta[ir.VAL].shape[0] for n in prog.graph.graph.nodes
                if n.target is aten._grouped_mm.default and n.meta[ir.VAL].dim() == 2]
    assert rows({"dp": 2, "cp": 2}) == rows({"dp": 2}) != []


def test_planner_searches_ring_attention():
    """Each cp plan is priced both ways, its attention's keys/values gathered and as ring
    attention: at remat "none" the ring plan holds fewer activations (no whole keys/values
    held for the backward); the plan it returns names the way. Attention written out as matmuls
    (GPT-2's) cannot go around the ring: only gathered plans, and a fixed "ring" says why."""
    from fxpar.compiler import planner
    from fxpar.compiler.compile import planner_stats
    from fxpar.core import cost
    from fxpar.examples import gpt_stats
    model, batch = _llama()
    stats = planner_stats(model, batch)
    B = batch["input_ids"].shape[0]
    assert stats.ring_refusal is None
    hw = cost.HARDWARE["h100"]
    fixed = {"cp": 2, "tp": 1, "pp": 1, "zero": 0, "remat": "none", "microbatches": 1}
    r = planner.search(stats, 4, hw, batch_rows=B, executable=False, constraints=fixed)
    by = {c.plan.cp_attention: c for c in r.table}
    assert set(by) == {"gather", "ring"}
    assert by["ring"].memory.activations < by["gather"].memory.activations
    # the gathered step replays as a CUDA graph (no host dispatch); the ring's send/recv
    # inside its op is not captured (runtime/cudagraph), so its nodes pay their launches
    slow_host = dataclasses.replace(hw, node_overhead=1e-3)
    nodes = sum(s.nodes_f + s.nodes_b for s in stats.segments)
    r = planner.search(stats, 4, slow_host, batch_rows=B, executable=False, constraints=fixed)
    by = {c.plan.cp_attention: c.step_s for c in r.table}
    assert by["gather"] < 0.2 * nodes * 1e-3 < 0.5 * nodes * 1e-3 < by["ring"]
    ring = planner.search(stats, 4, hw, batch_rows=B, executable=False,
                          constraints={**fixed, "cp_attention": "ring"})
    assert {c.plan.cp_attention for c in ring.table} == {"ring"}
    # a fixed way without a fixed cp asks for cp (where dp alone could take the rows)
    ring = planner.search(stats, 4, hw, batch_rows=4, executable=False,
                          constraints={"cp_attention": "ring"})
    assert ring.table and all(c.plan.cp > 1 and c.plan.cp_attention == "ring"
                              for c in ring.table)
    gpt2 = gpt_stats.gpt_stats("gpt2")
    assert "written out as matmuls" in gpt2.ring_refusal
    r = planner.search(gpt2, 8, hw, batch_rows=4, executable=False,
                       constraints={"cp": 2, "tp": 1, "pp": 1})
    assert r.table and {c.plan.cp_attention for c in r.table} == {"gather"}
    with pytest.raises(PlanError, match="cp_attention='ring': the attention .*written out"):
        planner.search(gpt2, 8, hw, batch_rows=4, executable=False,
                       constraints={"cp": 2, "tp": 1, "pp": 1, "cp_attention": "ring"})


def test_planner_probes_the_experts_under_cp_where_it_prices_cp(monkeypatch):
    """Where cp runs the experts (and what it keeps for the backward) is found by cp passes
    on copies of the graph, run once and only where the search prices a cp plan:
    statistics of an MoE planned without cp (or planned again) pay nothing for it."""
    from fxpar.compiler import planner
    from fxpar.compiler.compile import planner_stats
    from fxpar.core import cost
    runs = []
    probe = planner.cp_probe
    monkeypatch.setattr(planner, "cp_probe", lambda *a: runs.append(1) or probe(*a))
    model, spec = zoo.build("mixtral")
    batch = spec.batch(0)
    stats = planner_stats(model, batch, loss_fn=spec.loss_fn)
    hw, rows = cost.HARDWARE["h100"], torch.utils._pytree.tree_leaves(batch)[0].shape[0]
    fixed = {"tp": 1, "pp": 1, "zero": 0, "remat": "none", "microbatches": 1}
    planner.search(stats, 2, hw, batch_rows=rows, executable=False,
                   constraints={**fixed, "cp": 1})
    assert not runs
    for _ in range(2):
        r = planner.search(stats, 4, hw, batch_rows=rows, executable=False,
                           constraints={**fixed, "cp": 2, "dp": 4})
        assert {c.plan.ep for c in r.table} == {1, 2, 4}  # (the experts split under cp)
    assert runs == [1]
    assert stats.with_depth(4).moe_cp_whole is False and runs == [1]


@pytest.mark.slow  # (three models' planner statistics: make test's 6 minutes)
def test_planner_prices_experts_cp_runs_whole(monkeypatch):
    """The planner runs the cp pass on a copy to see where the experts run: Mixtral's and
    listed experts' (where_moe, grouped first as the job groups them) on each rank's
    tokens, so cp x ep plans are searched. Where the pass would run them on the cp group's
    whole tokens (here: where_moe with its routing's where(mask, e, ids) left to DTensor's
    rules, which gather the tokens), cp=2 prices their work at twice a rank's share and no
    ep plan is searched with cp (the pass refuses it)."""
    from fxpar.compiler import planner
    from fxpar.compiler.compile import planner_stats
    from fxpar.core import cost, sharding
    hw = cost.HARDWARE["h100"]
    fixed = {"cp": 2, "tp": 1, "pp": 1, "zero": 0, "remat": "none", "microbatches": 1,
             "cp_attention": "gather", "precision": "bf16"}
    for name, whole in (("mixtral", False), ("where_moe", False), ("where_moe", True)):
        if whole:
            monkeypatch.setattr(sharding, "_SEQUENCE_STRIDED",
                                sharding._SEQUENCE_STRIDED - {aten.where.ScalarSelf})
        model, spec = zoo.build(name)
        batch = spec.batch(0)
        stats = planner_stats(model, batch, loss_fn=spec.loss_fn)
        assert stats.moe_local and stats.moe_cp_whole == whole, name
        B = torch.utils._pytree.tree_leaves(batch)[0].shape[0]
        at_dp4 = {**fixed, "dp": 4, "ep": 1}
        r = planner.search(stats, 4, hw, batch_rows=B, executable=False, constraints=at_dp4,
                           precision="bf16")
        split = planner.search(dataclasses.replace(stats, cp_probe=lambda: dataclasses.replace(
            stats.cp_probe(), moe_cp_whole=False)), 4, hw, batch_rows=B, executable=False,
            constraints=at_dp4, precision="bf16")
        assert (r.best.step_s > split.best.step_s) == whole, name
        eps = {c.plan.ep for c in planner.search(stats, 4, hw, batch_rows=B, executable=False,
                                                 constraints=fixed, precision="bf16").table}
        assert eps == ({1} if whole else {1, 2, 4}), (name, eps)
