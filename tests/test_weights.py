"""Models bigger than one device (runtime/weights.py): which elements a rank reads, the weight
readers, shard-wise init, save_pretrained; meta-device models trained against eager.

Fast tests check the index arithmetic against the runtime's own slicing (tp_slices, ZeRO's flat
shards), every file format, the errors, and one-process training. Slow tests run 4 gloo ranks:
a model saved with save_pretrained, rebuilt on meta and loaded with weights= trains exactly
like single-process eager under ZeRO-3 x tp, tp x pp x microbatches, ZeRO-3 x 4, ZeRO-3 x pp,
with local batches; pm.save_pretrained reloads into plain from_pretrained bit for bit."""
import json
import os

import pytest
import torch

import fxpar
from fxpar.core.errors import CheckpointError
from fxpar.examples import models as M
from fxpar.runtime import tp_slices as rtp
from fxpar.runtime import weights as W
from fxpar.runtime.zero import ShardedOptimizer

import workers
from workers import OPTIMIZERS, build, eager_reference

transformers = pytest.importorskip("transformers")

LAYOUTS = [None, (0, None, 1), (1, None, 1), (0, 0, 3), (1, 0, 3), (None, 0, 2),
           (0, 0, (12, 8, 4)), (1, 1, (8, 4))]  # (a grouped-query QKV's unequal pieces)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_local_runs_pick_the_elements_local_param_keeps(layout, tp):
    full = torch.randn(24, 12)
    src = W.TensorSource({"w": full})
    for rank in range(tp):
        want = rtp.local_param(full, layout, tp, rank) if layout else full
        runs = W.local_runs(tuple(full.shape), layout, tp, rank)
        assert torch.equal(src.read_runs("w", runs), want)


@pytest.mark.parametrize("shape", [(10, 3), (7,), (), (5, 2, 3), (1, 4)], ids=str)
@pytest.mark.parametrize("dp", [2, 3, 4])
def test_flat_shard_rows_read_only_the_rows_of_zero3s_shard(shape, dp):
    """ZeRO-3's shard (runtime/zero.py: flat, padded to a multiple of dp, 1/dp each) made
    from the dim-0 rows that cover it, never from the whole tensor."""
    full = torch.randn(shape)
    src = W.TensorSource({"w": full})
    z = ShardedOptimizer(lambda ps: None, [full], [], dp, 0, None)
    for rank in range(dp):
        z.rank = rank
        want = z.cut([full], 0)
        rows, off, n, size = W.flat_shard_rows([[(0, k)] for k in shape], dp, rank)
        got = torch.zeros(size)
        if n:
            block = src.read_runs("w", rows)
            if shape:
                assert block.shape[0] <= -(-full.numel() // dp) // max(1, full[0].numel()) + 2
            got[:n] = block.reshape(-1)[off:off + n]
        assert torch.equal(got, want)


def _saved(tmp_path, fmt):
    torch.manual_seed(0)
    model = M.hf_llama()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    d = tmp_path / fmt
    if fmt == "safetensors":
        from safetensors.torch import save_file
        d.mkdir()
        save_file({k: v for k, v in state.items() if k != "lm_head.weight"} | {
            "lm_head.weight": state["lm_head.weight"].clone()}, d / "w.safetensors")
        return model, state, str(d / "w.safetensors")
    if fmt == "hf_dir":
        model.save_pretrained(d)
    elif fmt == "hf_sharded":
        model.save_pretrained(d, max_shard_size="20KB")
        assert (d / "model.safetensors.index.json").exists()
    elif fmt == "torch":
        d.mkdir()
        torch.save(state, d / "sd.pt")
        return model, state, str(d / "sd.pt")
    elif fmt == "fxpar":
        pm = fxpar.parallelize(model, 1, example_batch=M.hf_lm_batch(128, 8, 16),
                               plan={"fuse": False})
        pm.save(str(d))
    return model, state, str(d)


@pytest.mark.parametrize("fmt", ["safetensors", "hf_dir", "hf_sharded", "torch", "fxpar"])
def test_every_weights_format_reads_slices(tmp_path, fmt):
    model, state, path = _saved(tmp_path, fmt)
    src = W.FileSource(path)
    k = "model.layers.0.self_attn.q_proj.weight"
    assert src.shape(k) == tuple(state[k].shape)
    runs = W.local_runs(tuple(state[k].shape), (0, None, 1), 2, 1)
    assert torch.equal(src.read_runs(k, runs), state[k].chunk(2, 0)[1])
    assert src.shape("no.such.key") is None


def test_missing_key_and_wrong_shape_are_checkpoint_errors_naming_the_key(tmp_path):
    from safetensors.torch import save_file
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in M.hf_llama().state_dict().items()}
    del state["model.norm.weight"]
    save_file(state, tmp_path / "a.safetensors")
    with torch.device("meta"):
        model = M.hf_llama()
    w = W.ModelWeights(model, str(tmp_path / "a.safetensors"))
    with pytest.raises(CheckpointError, match="has no 'model.norm.weight'"):
        w.locate("model.norm.weight")
    state["model.norm.weight"] = torch.ones(7)
    save_file(state, tmp_path / "b.safetensors")
    w = W.ModelWeights(model, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \(7,\)"):
        w.locate("model.norm.weight")
    with pytest.raises(CheckpointError, match="no such file"):
        W.ModelWeights(model, str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        W.ModelWeights(model, str(tmp_path / "empty"))


def _hub_layout(name, tmp_path):
    """A zoo model saved by transformers' own save_pretrained (the Hub's layout), and the
    same model loaded back by from_pretrained."""
    from safetensors import safe_open
    from fxpar.examples import zoo
    spec = zoo.models()[name]
    torch.manual_seed(0)
    model = spec.factory()
    model.save_pretrained(tmp_path / name)
    with safe_open(str(tmp_path / name / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert stored - set(model.state_dict()), (  # else this test no longer tests conversion
        f"transformers now saves {name} with the modules' own keys")
    return spec, type(model).from_pretrained(tmp_path / name).state_dict()


@pytest.mark.parametrize("name", ["mixtral", "gpt_neox", "vit"])
@pytest.mark.slow  # (make test's 6 minutes)
def test_a_checkpoint_in_the_hubs_layout_loads_as_from_pretrained_loads_it(tmp_path, name):
    """transformers 5 writes (and the Hub holds) Mixtral's experts one by one
    (`block_sparse_moe.experts.N.w1.weight`), GPT-NeoX's and ViT's keys under other names,
    and converts them on load: weights= applies the same conversion (runtime/weights.
    ConvertedSource), so the model holds exactly what from_pretrained gives; and
    pm.save_pretrained writes that layout back (runtime/weights.hub_layout)."""
    spec, want = _hub_layout(name, tmp_path)
    with torch.device("meta"):
        model = spec.factory()
    pm = fxpar.parallelize(model, 1, example_batch=spec.batch(0), loss_fn=spec.loss_fn,
                           plan={"codegen": "eager"}, weights=str(tmp_path / name))
    got = pm.full_state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # and pm.save_pretrained writes what transformers' own save_pretrained writes (sharded)
    from safetensors.torch import load_file
    hub = load_file(str(tmp_path / name / "model.safetensors"))
    pm.save_pretrained(str(tmp_path / "out"), max_shard_size=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    saved = {k: v for f in set(index["weight_map"].values())
             for k, v in load_file(str(tmp_path / "out" / f)).items()}
    assert set(saved) == set(index["weight_map"]) == set(hub)
    for k, v in hub.items():
        assert torch.equal(saved[k], v), k


@pytest.mark.slow
def test_a_hub_layout_moe_loads_slice_wise_under_tp_and_zero3_and_trains_like_eager(tmp_path):
    """Mixtral from the Hub's layout on 2 ranks: each rank's tensor-parallel slice / ZeRO-3
    shard of the stacked experts cut from the converted tensors; 2 AdamW steps equal eager
    training of the model from_pretrained loads; pm.save_pretrained (files written by both
    ranks) is in the Hub's layout again and from_pretrained reads the trained state."""
    from fxpar.examples import zoo
    spec, _ = _hub_layout("mixtral", tmp_path)
    ref = type(spec.factory()).from_pretrained(tmp_path / "mixtral")
    opt = OPTIMIZERS["adamw"](ref.parameters())
    losses = []
    for s in range(2):
        opt.zero_grad()
        loss = zoo.loss_of(ref, spec, spec.batch(s))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    plans = [{"tp": 2, "codegen": "eager"}, {"dp": 2, "zero": 3, "codegen": "eager"}]
    res = fxpar.launch(workers.hub_layout_rank, 2, "mixtral", str(tmp_path / "mixtral"),
                       plans, 2, str(tmp_path / "out"))[0]
    from safetensors import safe_open
    with safe_open(str(tmp_path / "mixtral" / "model.safetensors"), "pt") as f:
        hub_keys = set(f.keys())
    for i, plan in enumerate(plans):
        saved = tmp_path / "out" / str(i)
        index = json.loads((saved / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == hub_keys and len(set(index["weight_map"].values())) > 1
        back = type(ref).from_pretrained(saved).state_dict()
        for k, v in back.items():
            assert torch.equal(v, res[repr(plan)][1][k]), (plan, k)
    for plan in plans:
        got_losses, state = res[repr(plan)]
        torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{plan}: {m}")
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{plan} {k}: {m}")


def test_a_key_transformers_converts_under_its_own_name_is_converted(tmp_path):
    """Qwen3-VL-MoE's Hub checkpoints hold the experts transposed under the module's own
    names (`mlp.experts.gate_up_proj`, its mapping a Transpose): read as they are, the
    square one would load silently transposed and the other be refused for its shape.
    Both come through transformers' conversion, equal to from_pretrained; and the save
    writes the modules' own keys (a Transpose reads the model, which holds shards by then)."""
    from safetensors.torch import load_file, save_file
    T = transformers
    if not hasattr(T, "Qwen3VLMoeConfig"):
        pytest.skip("this transformers has no Qwen3-VL-MoE")
    text = dict(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 0]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                  patch_size=4, spatial_merge_size=1, temporal_patch_size=1,
                  num_position_embeddings=16, deepstack_visual_indexes=[])
    cfg = T.Qwen3VLMoeConfig(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    T.Qwen3VLMoeForConditionalGeneration(cfg).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    save_file({k: v.transpose(1, 2).contiguous() if ".experts." in k else v
               for k, v in state.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    want = T.Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path).state_dict()
    with torch.device("meta"):
        model = T.Qwen3VLMoeForConditionalGeneration(cfg)
    w = W.ModelWeights(model, str(tmp_path))
    w.check()
    experts = [k for k in want if ".experts." in k]
    assert any(want[k].shape[-1] == want[k].shape[-2] for k in experts)  # the silent case
    for k in experts:
        src, key = w.locate(k)
        assert torch.equal(src.read(key, (...,)), want[k]), k
    keys = list(want)
    assert W.hub_layout(model, keys, {k: tuple(v.shape) for k, v in want.items()},
                        {k: v.dtype for k, v in want.items()}) is None


def test_a_hub_checkpoint_that_does_not_convert_names_its_keys(tmp_path):
    """An expert missing from a Mixtral checkpoint: a CheckpointError naming the tensors
    transformers' conversion was given, not a stack/cat error from inside it."""
    from safetensors.torch import load_file, save_file
    _hub_layout("mixtral", tmp_path)
    path = tmp_path / "mixtral" / "model.safetensors"
    state = load_file(str(path))
    gone = next(k for k in state if k.endswith("experts.3.w1.weight"))
    del state[gone]
    save_file(state, str(path), metadata={"format": "pt"})
    from fxpar.examples import zoo
    with torch.device("meta"):
        model = zoo.models()["mixtral"].factory()
    w = W.ModelWeights(model, str(tmp_path / "mixtral"))
    target = gone.split("block_sparse_moe")[0] + "mlp.experts.gate_up_proj"
    with pytest.raises(CheckpointError, match=r"builds 'model.layers.0.mlp.experts.gate_up_proj"
                       r"' from the file's 3 x '.*w1.weight' .*4 x '.*w3.weight'.*missing"):
        w.locate(target)


def test_a_missing_key_is_found_before_the_model_is_compiled(tmp_path, monkeypatch):
    """parallelize checks every key of weights= when it opens the file: the error comes
    before tracing and compiling (seconds to minutes at real size), not after."""
    from safetensors.torch import save_file
    from fxpar.api import parallelize as api
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in M.hf_llama().state_dict().items()}
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "a.safetensors")
    with torch.device("meta"):
        model = M.hf_llama()
    monkeypatch.setattr(api, "build", lambda *a, **k: pytest.fail("compiled before the check"))
    with pytest.raises(CheckpointError, match="has no 'model.layers.1.mlp.up_proj.weight'"):
        fxpar.parallelize(model, 1, example_batch=M.hf_lm_batch(128, 8, 16),
                          weights=str(tmp_path / "a.safetensors"))


def test_init_on_meta_matches_the_modules_own_distributions():
    """weights=None: HF's _init_weights per module (normal(0, initializer_range) linears and
    embeddings, ones for RMSNorm, the rotary inv_freq recomputed), the same values on every
    rank (seeded per module), and plain modules' reset_parameters."""
    torch.manual_seed(3)
    with torch.device("meta"):
        model = M.hf_llama(hidden=64, vocab=512)
    src = W.InitSource(model)
    q = src.read("model.layers.0.self_attn.q_proj.weight", (...,))
    assert abs(q.std().item() - model.config.initializer_range) < 0.003
    assert torch.equal(src.read("model.norm.weight", (...,)), torch.ones(64))
    real = M.hf_llama(hidden=64, vocab=512)
    inv = src.read("model.rotary_emb.inv_freq", (...,))
    assert torch.equal(inv, real.model.rotary_emb.inv_freq)
    again = W.InitSource(model).read("model.layers.0.self_attn.q_proj.weight", (slice(0, 4),))
    assert torch.equal(again, q[:4])  # what another rank computes for its slice
    with torch.device("meta"):
        lin = torch.nn.Linear(100, 10)
    w = W.InitSource(lin).read("weight", (...,))
    bound = 1 / 100 ** 0.5  # kaiming_uniform(a=sqrt(5)) of nn.Linear.reset_parameters
    assert w.abs().max() <= bound and w.abs().max() > 0.8 * bound


def test_init_refuses_a_parameter_nothing_initialises():
    class Custom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.empty(4))

        def forward(self, x):
            return (x * self.scale).sum()
    with torch.device("meta"):
        m = Custom()
    with pytest.raises(CheckpointError, match="nothing initialises 'scale'.*weights=PATH"):
        W.InitSource(m).read("scale", (...,))


def test_init_catches_unset_integer_buffers_and_keeps_real_tensors():
    """An integer / bool tensor has no NaN to mark it unset: one no init writes is found by
    initialising twice from two prefills. A partly-meta module's real tensors survive its
    reset_parameters; the seed is what every rank was given, not each rank's own."""
    class Index(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("pos", torch.arange(4), persistent=False)

        def forward(self, x):
            return self.lin(x)[:, self.pos].sum()
    with torch.device("meta"):
        m = Index()
    with pytest.raises(CheckpointError, match="'pos'.*non-persistent buffer"):
        W.InitSource(m).read("pos", (...,))
    lin = torch.nn.Linear(8, 8)
    lin.bias = torch.nn.Parameter(torch.full((8,), 7.0))
    lin.weight = torch.nn.Parameter(torch.empty(8, 8, device="meta"))
    w = W.InitSource(lin, seed=3).read("weight", (...,))
    assert torch.equal(lin.bias, torch.full((8,), 7.0)) and w.abs().max() > 0
    torch.manual_seed(11)  # another rank's own seed: the broadcast one decides
    assert torch.equal(W.InitSource(lin, seed=3).read("weight", (...,)), w)


def test_meta_model_with_an_optimizer_instance_is_refused():
    with torch.device("meta"):
        model = M.hf_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(fxpar.PlanError, match="Pass a factory"):
        fxpar.parallelize(model, 1, example_batch=M.hf_lm_batch(128, 8, 16), optimizer=opt)


@pytest.mark.slow  # (make test's 6 minutes)
def test_meta_model_one_device_trains_exactly_and_save_pretrained_reloads(tmp_path):
    """devices=1: a model saved with save_pretrained, rebuilt on meta and loaded with weights=
    trains like eager; pm.save_pretrained reloads into plain from_pretrained bit for bit
    (sharded, with its index); weights=None trains from the modules' init."""
    torch.manual_seed(0)
    ref = M.hf_llama()
    ref.save_pretrained(tmp_path / "start")
    with torch.device("meta"):
        model = M.hf_llama()
    pm = fxpar.parallelize(model, 1, example_batch=M.hf_lm_batch(128, 8, 16),
                           optimizer=OPTIMIZERS["adamw"], plan={"fuse": False},
                           weights=str(tmp_path / "start"))
    assert not any(p.is_meta for p in model.parameters())
    opt = OPTIMIZERS["adamw"](ref.parameters())
    for s in range(3):
        b = M.hf_lm_batch(128, 8, 16, seed=s)
        got = pm.step(b)
        opt.zero_grad()
        loss = ref(**b).loss
        loss.backward()
        opt.step()
        torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=1e-6)
    b0 = M.hf_lm_batch(128, 8, 16, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(pm.evaluate(b0), ref(**b0).loss, rtol=1e-5, atol=1e-6)
    pm.save_pretrained(str(tmp_path / "out"), max_shard_size=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" in index["weight_map"]  # (untied llama: its own key)
    pm.save_pretrained(str(tmp_path / "out"), max_shard_size=10**9)  # again, one file:
    assert sorted(os.listdir(tmp_path / "out")) == [  # the shards and index are gone
        "config.json", "model.safetensors"]
    pm.save_pretrained(str(tmp_path / "out"), max_shard_size=20_000)
    assert not (tmp_path / "out" / "model.safetensors").exists()
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"))
    full = pm.full_state_dict()
    for k, v in back.state_dict().items():
        assert torch.equal(v, full[k]), k
        torch.testing.assert_close(v, ref.state_dict()[k], rtol=1e-5, atol=1e-5)
    with torch.device("meta"):
        fresh = M.hf_llama()
    pm2 = fxpar.parallelize(fresh, 1, example_batch=M.hf_lm_batch(128, 8, 16),
                            plan={"fuse": False})
    assert 4.0 < pm2.step(M.hf_lm_batch(128, 8, 16)).item() < 6.0  # ~ln(128): a sane init


@pytest.mark.slow  # (make test's 6 minutes)
def test_meta_model_checkpoint_round_trip(tmp_path):
    """pm.save / pm.load on a model built on meta (weights=None): the new job, also built on
    meta, resumes with the same weights and optimizer state (bit for bit)."""
    b = M.hf_lm_batch(128, 8, 16)

    def job():
        with torch.device("meta"):
            model = M.hf_llama()
        return fxpar.parallelize(model, 1, example_batch=b, optimizer=OPTIMIZERS["adamw"],
                                 plan={"fuse": False})
    pm = job()
    pm.step(b)
    pm.save(str(tmp_path / "c"))
    want = pm.step(M.hf_lm_batch(128, 8, 16, seed=1))
    pm2 = job()
    pm2.load(str(tmp_path / "c"))
    assert torch.equal(pm2.step(M.hf_lm_batch(128, 8, 16, seed=1)), want)


def test_tied_hf_weights_saved_once_and_found_through_any_name(tmp_path):
    torch.manual_seed(0)
    ref = M.hf_gpt2()
    assert ref.lm_head.weight is ref.transformer.wte.weight
    with torch.device("meta"):
        model = M.hf_gpt2()
    ref.save_pretrained(tmp_path / "a")
    pm = fxpar.parallelize(model, 1, example_batch=M.hf_lm_batch(128, 8, 16),
                           plan={"fuse": False}, weights=str(tmp_path / "a"))
    assert model.lm_head.weight is model.transformer.wte.weight
    pm.save_pretrained(str(tmp_path / "b"))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "b" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "b"))
    assert torch.equal(back.lm_head.weight, ref.lm_head.weight)


def test_local_batch_of_the_wrong_size_says_what_to_give():
    model, batch_fn, loss_fn = build("mlp")
    pm = fxpar.parallelize(model, 1, example_batch=batch_fn(0), plan={"fuse": False},
                           batch="local")
    assert (pm.dp_rank, pm.dp_size) == (0, 1)
    x, y = batch_fn(0)
    with pytest.raises(fxpar.core.errors.BatchError, match="batch='local'.*DistributedSampler"):
        pm.step((x[:3], y[:3]))
    with pytest.raises(fxpar.PlanError, match="batch='shard'"):
        fxpar.parallelize(model, 1, example_batch=batch_fn(0), batch="shard")


# --- 4 gloo ranks ---------------------------------------------------------------------------

# each plan on one of the two models (HF Llama: a Hub checkpoint with its own names; the GPT:
# fxpar's save_pretrained), every plan once: the two models double the time, not the cover
PLANS = {"hf_llama": [({"dp": 2, "zero": 3, "tp": 2}, "global"),
                      ({"dp": 4, "zero": 3}, "global"),
                      ({"dp": 2, "tp": 2, "zero": 1, "microbatches": 2}, "local")],
         "gpt": [({"tp": 2, "pp": 2, "microbatches": 2}, "global"),
                 ({"dp": 2, "pp": 2, "microbatches": 2, "zero": 3}, "local"),
                 ({"dp": 4, "zero": 3, "dp_shard": 2}, "local"),  # (HSDP: half-shards)
                 # context parallelism: a cp group's ranks give the same rows
                 ({"dp": 4, "cp": 2, "microbatches": 2}, "local")],
         # expert parallelism: each rank reads its half of the experts' rows
         "mixtral": [({"dp": 4, "ep": 2}, "global"), ({"dp": 2, "ep": 2, "tp": 2}, "local")]}


@pytest.mark.slow
def test_meta_model_under_parameter_servers_trains_like_eager(tmp_path):
    """Plan.ps with weights=PATH: the workers read the whole model, each server its share
    only; 2 workers + 1 server train as eager."""
    model, batch_fn, _ = build("gpt")
    fxpar.parallelize(model, 1, example_batch=batch_fn(0),
                      plan={"fuse": False}).save_pretrained(str(tmp_path / "w" / "gpt"))
    res = fxpar.launch(workers.meta_weights_rank, 3, [("gpt", {"ps": 1}, "global")],
                       str(tmp_path / "w"))[0]
    ((losses, state),) = res.values()
    ref_losses, ref_state = eager_reference("gpt", "adamw", steps=3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                               atol=1e-6)
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("hf_llama", marks=pytest.mark.full), "gpt",
                                  "mixtral"])
def test_meta_model_loaded_shard_wise_trains_like_eager(tmp_path, name):
    model, _, _ = build(name)
    d = tmp_path / "w" / name
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(d)
    else:
        fxpar.parallelize(model, 1, example_batch=build(name)[1](0),
                          plan={"fuse": False}).save_pretrained(str(d))
    cases = [(name, {**plan, "fuse": False}, mode) for plan, mode in PLANS[name]]
    res = fxpar.launch(workers.meta_weights_rank, 4, cases, str(tmp_path / "w"),
                       str(tmp_path / "out"))[0]
    ref_losses, ref_state = eager_reference(name, "adamw", steps=3)
    for (_, plan, mode), (losses, state) in res.items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{plan} {mode}: {m}")
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{plan} {mode} {k}: {m}")
        saved = tmp_path / "out" / name / repr(sorted(eval(plan).items()))
        from safetensors.torch import load_file
        files = [f for f in os.listdir(saved) if f.endswith(".safetensors")]
        back = {k: v for f in files for k, v in load_file(str(saved / f)).items()}
        for k, v in back.items():  # what pm.save_pretrained wrote is the trained state
            if k not in state:  # (Mixtral's experts saved per expert, as the Hub holds
                assert hasattr(model, "save_pretrained"), k  # them: from_pretrained's below)
                continue
            assert torch.equal(v, state[k]), (plan, k)
        if hasattr(model, "save_pretrained"):
            hf = type(model).from_pretrained(str(saved))
            for k, v in hf.state_dict().items():
                assert torch.equal(v, state[k]), (plan, k)
