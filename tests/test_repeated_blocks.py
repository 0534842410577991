"""Capture flat in depth (compiler/repeated_blocks.py): a list of identical blocks is traced at
2 and 3 blocks and stamped to its depth. The stamped graph must be the whole trace, node for
node; a block that is not a copy (it branches on its index, or the model feeds it differently)
is traced whole."""
import logging

import pytest
import torch
import torch.nn as nn

from fxpar.compiler import capture as cap
from fxpar.compiler import repeated_blocks as rb
from fxpar.examples import models as M

LOGGER = "fxpar.compiler"


def _hf(config_cls, model_cls, **kw):
    import transformers
    cfg = getattr(transformers, config_cls)(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(cfg)


def _lm_batch(vocab=128, seq=16):
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


class Block(nn.Module):
    """A residual MLP block with BatchNorm (running statistics: buffers the step updates)."""

    def __init__(self, dim, index=0, special=None):
        super().__init__()
        self.index, self.special = index, special
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.kind = "plain"

    def forward(self, x, scale):
        y = x + torch.relu(self.bn(self.fc(x))) * scale
        if self.index == self.special:  # a layer unlike the others, by its index
            y = y * 2
        return y


class Stack(nn.Module):
    def __init__(self, depth=8, dim=8, special=None, fed_by_kind=False, kinds=None):
        super().__init__()
        self.kinds = kinds  # each layer's input kind, by position (as `config.layer_types`)
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(
            Block(dim, i, None if fed_by_kind else special) for i in range(depth))
        if fed_by_kind:
            for i, b in enumerate(self.blocks):
                b.kind = "double" if i == special else "plain"
        self.head = nn.Linear(dim, 1)

    def forward(self, batch):
        x, y = batch
        h = self.inp(x)
        scales = {"plain": torch.ones(()), "double": torch.full((), 2.0)}
        for i, b in enumerate(self.blocks):
            # the model chooses each block's input by the block's kind, or by its position
            h = b(h, scales[self.kinds[i] if self.kinds else b.kind])
        return nn.functional.mse_loss(self.head(h).squeeze(-1), y)


def _xy():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 4, generator=g), torch.randn(16, generator=g)


def _both(model, batch, caplog, joint=True):
    """(stamped graph, its signature, whole graph, its signature, the log's why)."""
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        caplog.clear()
        gs, ss = cap.capture(model, batch, joint=joint)
        why = " ".join(r.getMessage() for r in caplog.records
                       if "stamped" in r.getMessage())
    gw, sw = cap.capture(model, batch, joint=joint, stamp=False)
    return gs, ss, gw, sw, why


MODELS = {
    "gpt2": (lambda: _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=128, n_embd=32, n_layer=8,
                         n_head=4, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0), _lm_batch, "transformer.h"),
    "llama": (lambda: _hf("LlamaConfig", "LlamaForCausalLM", vocab_size=128, hidden_size=32,
                          intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=16),
              _lm_batch, "model.layers"),
    # multi-query heads split by indexing with Python lists (`qkv[..., [-2], :]`): an index
    # tensor made in each block, whose values the copy check reads with the fake mode off
    "falcon": (lambda: _hf("FalconConfig", "FalconForCausalLM", vocab_size=128, hidden_size=32,
                           num_hidden_layers=8, num_attention_heads=4, multi_query=True,
                           new_decoder_architecture=False, parallel_attn=True, bias=False,
                           alibi=False, hidden_dropout=0.0, attention_dropout=0.0),
               _lm_batch, "transformer.h"),
    "batchnorm stack": (Stack, _xy, "blocks"),
}


@pytest.mark.parametrize("name", [pytest.param(m, marks=pytest.mark.slow) if m in (
    "llama", "falcon") else m for m in MODELS])
def test_the_stamped_graph_is_the_whole_trace_node_for_node(name, caplog):
    factory, batch, path = MODELS[name]
    model = factory()
    assert rb.find(model)[::2] == (path, 0)
    gs, ss, gw, sw, why = _both(model, batch(), caplog)
    assert "stamped the rest" in why, why
    assert rb._canonical(gs) == rb._canonical(gw)  # ops, data flow, tags, shapes, in order
    assert ss == sw
    if name == "batchnorm stack":  # each block's running statistics are outputs
        assert len(sw.mutated_buffers) == 3 * 8


def test_the_stamped_graph_computes_what_the_model_does(caplog):
    model = Stack()
    x, y = _xy()
    gs, ss, *_ = _both(model, (x, y), caplog)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    out = gs(*[params[n] for n in ss.param_names], *[buffers[n] for n in ss.buffer_names], x, y)
    eager = Stack()
    eager.load_state_dict(model.state_dict())
    loss = eager((x, y))
    loss.backward()
    torch.testing.assert_close(out[0], loss)
    grads = dict(eager.named_parameters())
    for name, g in zip(ss.param_names, out[1:1 + len(ss.param_names)]):
        torch.testing.assert_close(g, grads[name].grad, msg=name)


@pytest.mark.slow
def test_forward_only_graphs_are_stamped_too(caplog):
    model = MODELS["gpt2"][0]()
    gs, ss, gw, sw, why = _both(model, _lm_batch(), caplog, joint=False)
    assert "stamped the rest" in why, why
    assert rb._canonical(gs) == rb._canonical(gw) and ss == sw


@pytest.mark.slow  # (make test's 6 minutes)
def test_a_block_that_branches_on_its_index_is_traced_whole(caplog):
    model = Stack(special=5)
    gs, ss, gw, sw, why = _both(model, _xy(), caplog)
    assert "does not run the ops block 2 runs" in why, why
    assert rb._canonical(gs) == rb._canonical(gw)


@pytest.mark.slow
def test_a_block_the_model_feeds_by_its_own_attribute_is_traced_whole(caplog):
    """The model reads each block's `kind` to choose its input (as HF models choose a
    layer's mask by its attention type): a block whose kind differs is not a copy, though
    its own code runs the same ops."""
    model = Stack(special=5, fed_by_kind=True)
    gs, ss, gw, sw, why = _both(model, _xy(), caplog)
    assert "the model reads kind of each block" in why, why
    assert rb._canonical(gs) == rb._canonical(gw)


@pytest.mark.slow  # (make test's 6 minutes)
def test_a_block_the_model_feeds_by_its_position_is_traced_whole(caplog):
    """Qwen2's and Gemma 3's masks: the model picks each layer's input by its index in a
    config list (`config.layer_types[i]`), and the first three layers are alike."""
    model = Stack(kinds=["plain"] * 5 + ["double"] * 3)
    gs, ss, gw, sw, why = _both(model, _xy(), caplog)
    assert "the model feeds block 5 otherwise than block 2" in why, why
    assert rb._canonical(gs) == rb._canonical(gw)


def test_a_run_of_copies_after_unlike_first_blocks_is_stamped(caplog):
    """DeepSeek-V3's dense first layers before its MoE layers, T5's first block with its
    relative bias: the run of copies that ends the list is stamped, the first blocks traced."""
    model = Stack(depth=10)
    model.blocks[0] = Block(8)
    model.blocks[0].fc = nn.Linear(8, 8, bias=False)
    assert rb.find(model)[::2] == ("blocks", 1)
    gs, ss, gw, sw, why = _both(model, _xy(), caplog)
    assert "traced blocks 1-3 of 10" in why, why
    assert rb._canonical(gs) == rb._canonical(gw) and ss == sw


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


class OddBlock(nn.Module):
    """A block unlike the others from layer 4 on in a way its forward's ops do not show: a
    tensor made from its own Python value, or a scale only its backward applies."""

    def __init__(self, index, how):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.how, self.s = how, 1.0 if index < 4 else 2.0

    def forward(self, x):
        y = x + torch.tanh(self.fc(x))
        if self.how == "counter":  # a scale by a count the model keeps, not the block
            COUNTER["i"] += 1
            return y * SCALES[COUNTER["i"] - 1]
        if self.how == "constant":
            return y * torch.tensor(self.s)
        return _Scale.apply(y, self.s) if self.how == "backward" else y


SCALES = [1.0] * 4 + [2.0] * 4
COUNTER = {"i": 0}


class OddStack(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.inp, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        self.blocks = nn.ModuleList(OddBlock(i, how) for i in range(8))
        self.how = how

    def forward(self, x):
        x = self.inp(x)
        COUNTER["i"] = 0
        for i, b in enumerate(self.blocks):  # "no_grad": the first 4 layers frozen by mode
            with torch.set_grad_enabled(torch.is_grad_enabled()
                                        and (self.how != "no_grad" or i >= 4)):
                x = b(x)
        return self.head(x).sum()


@pytest.mark.parametrize("how,why", [
    ("constant", "block 4 does not run the ops block 2 runs"),
    ("backward", "block 4 does not run the ops block 2 runs"),
    ("counter", "block 4 does not run the ops block 2 runs"),
    ("no_grad", "the model feeds block 4 otherwise than block 2")])
@pytest.mark.slow  # (make test's 6 minutes)
def test_a_difference_only_values_or_modes_show_is_traced_whole(how, why, caplog):
    gs, ss, gw, sw, log_why = _both(OddStack(how), torch.randn(4, 8), caplog)
    assert why in log_why, log_why
    assert rb._canonical(gs) == rb._canonical(gw)


def test_only_lists_of_true_copies_are_found():
    assert rb.find(Stack(depth=rb.MIN_BLOCKS - 1)) is None  # too shallow to gain
    shared = Stack()
    shared.blocks[3].fc = shared.blocks[2].fc  # a weight shared between blocks
    assert rb.find(shared) is None
    wider = Stack()
    wider.blocks[4].fc = nn.Linear(8, 8, bias=False)  # not the same parameters
    assert rb.find(wider) is None  # (the run after it is too short)
    hooked = Stack()
    hooked.blocks[1].register_forward_hook(lambda m, a, o: None)
    assert rb.find(hooked) is None
    assert rb.find(M.MLP()) is None


class CountedBlock(Block):
    traced: list = []

    def forward(self, x, scale):
        from torch._subclasses.functional_tensor import FunctionalTensor
        if isinstance(x, FunctionalTensor):  # (AOTAutograd's trace, not the checks' runs)
            CountedBlock.traced.append(id(self))
        return super().forward(x, scale)


def test_stamping_traces_three_blocks_not_all(caplog):
    """What makes capture flat in depth: at 24 blocks, block 3 onward is never traced (the
    traces hold 2 and 3 blocks; the check that every block is a copy runs the model's
    forward once on fake tensors, several times cheaper than a trace)."""
    model = Stack(depth=24)
    for i in range(24):
        model.blocks[i] = CountedBlock(8, i)
    CountedBlock.traced.clear()
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        gm, sig = cap.capture(model, _xy())
    which = {i for i, b in enumerate(model.blocks) if id(b) in CountedBlock.traced}
    assert which == {0, 1, 2}
    assert len(sig.param_names) == 2 + 4 * 24 + 2


def test_the_graph_check_still_sees_a_wrong_value_in_any_copy(caplog):
    """graphs.verify runs an op once for all its copies (the same values in and out); a copy
    whose recorded value is not what it computes is still caught."""
    from fxpar.core import graphs
    from fxpar.core.errors import PassError
    model = Stack(depth=12)
    gm, _, _, _, why = _both(model, _xy(), caplog)
    assert "stamped the rest" in why
    graphs.verify(gm)
    relu = [n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default][9]
    relu.meta["val"] = relu.meta["val"][:1]  # a copy's value, wrong
    with pytest.raises(PassError, match=relu.name):
        graphs.verify(gm)


def _gpt2_8(seed=0):
    torch.manual_seed(seed)
    return MODELS["gpt2"][0]()


def _train(world, plan, batches):
    import fxpar
    pm = fxpar.parallelize(_gpt2_8(), world, example_batch=batches[0],
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), plan=plan)
    return [pm.step(b).item() for b in batches], pm.full_state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("plan", [{"tp": 2}, {"pp": 2, "microbatches": 2}])
def test_a_stamped_model_trains_as_eager_under_a_split_plan(plan):
    import fxpar
    batches = [_lm_batch() for _ in range(2)]
    batches[1] = {k: v.flip(0) for k, v in batches[1].items()}
    model = _gpt2_8()
    assert rb.find(model) is not None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = []
    for b in batches:
        opt.zero_grad()
        loss = model(**b).loss
        loss.backward()
        opt.step()
        ref.append(loss.item())
    losses, state = fxpar.launch(_train, 2, 2, plan, batches)[0]
    assert losses == pytest.approx(ref, abs=1e-5)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v, atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.slow
def test_gemma3s_local_and_global_layers_are_not_stamped_as_copies(caplog):
    """Gemma 3's five sliding-window layers to one global one: the first three layers are
    alike, the sixth gets another mask from the model (by its position in
    `config.layer_types`). Stamping it from the third would train a wrong model."""
    model = _hf("Gemma3TextConfig", "Gemma3ForCausalLM", vocab_size=128, hidden_size=32,
                intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, sliding_window=8, query_pre_attn_scalar=8,
                layer_types=["sliding_attention"] * 5 + ["full_attention"]
                + ["sliding_attention"] * 2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    gs, ss, gw, sw, why = _both(model, _lm_batch(), caplog)
    assert "the model feeds block 5 otherwise than block 2" in why, why
    assert rb._canonical(gs) == rb._canonical(gw)
