"""Hugging Face causal LMs the zoo does not have yet, built generically at the zoo's tiny
size, under context parallelism (cp=2) and a plain dp=2 control, against eager.

    PYTHONSAFEPATH=1 .venv/bin/python -m fxpar.examples.hf_causal_lms [--list] [NAME ...]
        [--plans KEY[,KEY]]

Every architecture of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES whose model class no
zoo model (zoo.models(), zoo.more_moes()) builds is taken from its config class's defaults
with the common size fields that exist on it overridden (`tiny_overrides`: vocabulary
zoo.VOCAB, width 32, 2 layers, 4 heads, 2 KV heads, head_dim 8, 64 positions, pad/bos/eos
0/1/2, dropouts 0, small MoE / MLA / linear-attention fields, per-layer lists cut to 2
layers keeping two different layer types where the default has them, sliding windows 8).
`more_causal_lms()` builds each and runs one eager forward + backward on zoo.lm_batch(0)
(twice, to catch a forward that is not deterministic), and keeps those that work; the
others are listed with the reason (`skipped()`).

--list prints the built models and the skipped ones with their reasons (of the NAMEs given,
else of every candidate) and runs nothing; otherwise the
models named (default: every built one) run under PLANS (zoo_cp's "cp=2 (dp=2)" column and
a plain dp=2 control) as zoo_sweep.plan_table runs them, one row per model (a row whose
launch itself failed says so instead of ending the table).

zoo_sweep finds a model by name in zoo.models() (in the launched ranks too, which unpickle
zoo_sweep's rank functions by reference). Importing this module registers its models:
zoo.models is wrapped to return them as well, in this process, and zoo_sweep's rank
functions are swapped (`install`) for wrappers defined here, so each rank imports this
module (and so registers the models) before it looks the name up. zoo.py and zoo_sweep.py
are not edited.
"""
from __future__ import annotations

import functools
import math
import sys
import time
import traceback

import torch

from fxpar.examples import zoo, zoo_cp, zoo_sweep

PLANS = {"cp=2 (dp=2)": zoo_cp.PLANS["cp=2 (dp=2)"], "dp=2": (2, {"dp": 2})}

# the size fields: every name of a group that the config stores (or maps to a stored name
# through its attribute_map) gets the group's value
_SIZES: list[tuple[tuple[str, ...], object]] = [
    (("vocab_size",), zoo.VOCAB),
    (("hidden_size", "n_embd", "d_model", "n_embed", "model_dim"), zoo.HIDDEN),
    (("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim",
      "intermediate_size_mlp", "d_inner"), 2 * zoo.HIDDEN),
    (("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"), 2),
    (("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads"), 4),
    (("num_key_value_heads", "n_kv_heads", "num_kv_heads", "kv_n_heads",
      "num_key_value_heads_per_layer"), 2),
    (("head_dim", "kv_channels", "d_head", "d_kv"), 8),
    (("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx",
      "max_sequence_length"), 64),
    (("pad_token_id",), 0), (("bos_token_id",), 1), (("eos_token_id",), 2),
    (("embedding_size", "word_embed_proj_dim"), zoo.HIDDEN),
    # MoE
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    (("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "num_selected_experts"), 2),
    (("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
      "shared_intermediate_size"), zoo.HIDDEN),
    (("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    (("n_group", "topk_group"), 1),
    (("router_aux_loss_coef", "aux_loss_coef", "router_jitter_noise", "input_jitter_noise",
      "router_z_loss_coef"), 0.0),
    # multi-head latent attention
    (("kv_lora_rank",), 16), (("qk_rope_head_dim",), 4), (("qk_nope_head_dim",), 8),
    (("v_head_dim",), 8),
    # linear attention / state space
    (("linear_key_head_dim", "linear_value_head_dim"), 8), (("linear_num_key_heads",), 2),
    (("linear_num_value_heads",), 4), (("linear_conv_kernel_dim", "conv_kernel"), 4),
    (("state_size", "mamba_d_state", "ssm_state_size"), 8),
]
# only where the default is set (None switches the feature off)
_IF_SET: list[tuple[tuple[str, ...], object]] = [
    (("q_lora_rank",), 16),
    (("sliding_window", "local_attention", "attention_chunk_size", "window_size"), 8),
]
_LAYER_LISTS_KEEP = ("rope_parameters", "rope_scaling")


def _is_dropout(key: str) -> bool:
    return zoo._is_dropout(key) or "layerdrop" in key or key.endswith("drop_path_rate")


def _two_layers(values: list) -> list:
    """A per-layer list cut to 2 layers: its first entry and the first different one (a
    hybrid keeps one layer of each of its first two kinds), else its first two."""
    first = values[0]
    other = next((v for v in values[1:] if v != first), None)
    return [first, other] if other is not None else list(values[:2])


def tiny_overrides(model_type: str) -> dict:
    """The config kwargs that make `model_type` tiny (see the module's docstring)."""
    from transformers import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    stored = default.to_dict()
    amap = getattr(cls, "attribute_map", {}) or {}
    out = {}

    def real(name):
        if name in stored:
            return name
        if name in amap and amap[name] in stored:
            return amap[name]
        return None
    for names, value in _SIZES:
        for n in names:
            r = real(n)
            if r is not None and not isinstance(stored[r], (list, dict)):
                out[r] = value
    for names, value in _IF_SET:
        for n in names:
            r = real(n)
            if r is not None and isinstance(stored[r], int) and not isinstance(stored[r], bool):
                out[r] = value
    for k, v in stored.items():
        if _is_dropout(k) and isinstance(v, float):
            out[k] = 0.0
    if "is_decoder" in stored:
        out["is_decoder"] = True  # encoders built as causal LMs (BertLMHeadModel, ...)
    n_layers = next((stored[r] for n in _SIZES[3][0] if (r := real(n)) is not None
                     and isinstance(stored[r], int)), None)
    for k, v in stored.items():
        if (isinstance(v, list) and n_layers and len(v) == n_layers and n_layers > 2
                and k not in _LAYER_LISTS_KEEP):
            out[k] = _two_layers(v)
    return out


def _make(model_type: str, model_cls: str, extra: dict | None = None, attn: str | None = None):
    """A zoo factory: the tiny config of `model_type` (plus `extra`), attention `attn`
    ("sdpa" where the class has it, else "eager"; None: the library's choice)."""
    def make():
        import transformers
        from transformers import CONFIG_MAPPING
        kw = {**tiny_overrides(model_type), **(extra or {})}
        cfg = CONFIG_MAPPING[model_type](**kw)
        if attn is not None:
            cfg._attn_implementation = attn
        return getattr(transformers, model_cls)(cfg)
    make.model_type, make.model_cls, make.extra, make.attn = model_type, model_cls, extra, attn
    return make


# a few fields the generic sizes get wrong for one architecture (tried when the generic
# build fails)
_EXTRA: dict[str, list[dict]] = {
    "minicpm3": [dict(num_key_value_heads=4)],  # MLA: as many KV heads as heads
    "youtu": [dict(num_key_value_heads=4, qk_rope_head_dim=8)],
    "gemma3n_text": [dict(num_kv_shared_layers=0, vocab_size_per_layer_input=zoo.VOCAB,
                          hidden_size_per_layer_input=8)],
    "mamba2": [dict(num_heads=8, head_dim=8, expand=2, n_groups=1, chunk_size=8)],
    "falcon_mamba": [dict(time_step_rank=4, expand=2)],
    "bamba": [dict(mamba_n_heads=8, mamba_d_head=8, mamba_expand=2, mamba_n_groups=1,
                   mamba_chunk_size=8, attn_layer_indices=[1])],
    "falcon_h1": [dict(mamba_n_heads=8, mamba_d_head=8, mamba_expand=2, mamba_n_groups=1,
                       mamba_chunk_size=8, mamba_d_ssm=64)],
    "nemotron_h": [dict(mamba_num_heads=8, mamba_head_dim=8, n_groups=1, chunk_size=8,
                        hybrid_override_pattern="M*", layers_block_type=None)],
    "zamba": [dict(mamba_expand=2, mamba_dt_rank=4, attn_layer_period=2, attn_layer_offset=1,
                   n_mamba_heads=2)],
    "zamba2": [dict(mamba_expand=2, n_mamba_heads=8, mamba_headdim=8, mamba_ngroups=1,
                    chunk_size=8, hybrid_layer_ids=[1], num_mem_blocks=1)],
    "recurrent_gemma": [dict(lru_width=32, attention_window_size=8,
                             block_types=["recurrent", "attention"])],
    "rwkv": [dict(attention_hidden_size=32, context_length=64)],
    "reformer": [dict(axial_pos_shape=[4, 4], axial_pos_embds_dim=[16, 16],
                      attn_layers=["local", "lsh"], local_attn_chunk_length=8,
                      lsh_attn_chunk_length=8, is_decoder=True, num_buckets=4)],
    "xlstm": [dict(embedding_dim=32, num_blocks=2, num_heads=4, qk_dim_factor=0.5,
                   v_dim_factor=1.0, mode="train", chunkwise_kernel="chunkwise--native_autograd",
                   sequence_kernel="native_sequence__native", step_kernel="native",
                   chunk_size=8)],
}


def zoo_classes() -> dict[str, str]:
    """{HF model class: zoo model} of every zoo model built by zoo._hf / zoo._hf_eager."""
    out = {}
    for name, spec in zoo._models_unpatched().items() if hasattr(zoo, "_models_unpatched") \
            else zoo.models().items():
        for cell in getattr(spec.factory, "__closure__", None) or ():
            c = cell.cell_contents
            if isinstance(c, str) and c[:1].isupper() and not c.endswith("Config"):
                out.setdefault(c, name)
    return out


def _name(model_type: str, taken) -> str:
    n = model_type.replace("-", "_")
    return n + "_clm" if n in taken else n


@functools.lru_cache(maxsize=None)
def candidates() -> tuple[tuple[str, str, str, str], ...]:
    """(zoo name, model_type, model class, why not) for every mapping entry: why not is ''
    for an architecture to build, else why it is not (covered by the zoo, a duplicate class,
    needs other inputs)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    covered = zoo_classes()
    taken = set(_orig_models())
    out = []
    for mt, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if cls in covered:
            why = f"covered: the zoo's {covered[cls]} builds {cls}"
        elif "ForConditionalGeneration" in cls:
            why = f"multimodal / encoder-decoder ({cls}: needs other inputs)"
        else:
            why = ""
        out.append((_name(mt, taken) if not why else mt, mt, cls, why))
    return tuple(out)


def _zoo_model(name, mt, cls, extra=None, attn="sdpa") -> zoo.ZooModel:
    note = f"generic tiny {mt} ({cls})" + (f", {extra}" if extra else "")
    return zoo.ZooModel(name, "causal-lm", _make(mt, cls, extra, attn), zoo.lm_batch, note=note)


# the variant each built model uses (name -> (extra, attn)), found by `more_causal_lms` and
# fixed here so that the launched ranks build the same model without trying again
_CHOSEN: dict[str, tuple] = {}
_SKIPPED: dict[str, str] = {}


MAX_PARAMS = 4_000_000


def _try(spec: zoo.ZooModel) -> str:
    """'' where the model builds and runs one eager forward + backward on lm_batch(0) with a
    finite loss, the same loss twice, else why not."""
    try:
        with torch.device("meta"):  # a size field the overrides missed: no 20 GB model
            n = sum(p.numel() for p in spec.factory().parameters())
        if n > MAX_PARAMS:
            return f"not tiny: {n / 1e6:.1f}M parameters at the generic sizes"
        torch.manual_seed(1234)
        model = spec.factory()
        losses = []
        for _ in range(2):
            model.zero_grad()
            loss = zoo.loss_of(model, spec, spec.batch(0))
            if loss is None or not torch.is_tensor(loss):
                return "no loss from labels"
            loss.backward()
            losses.append(loss.item())
        if not all(math.isfinite(x) for x in losses):
            return f"loss not finite: {losses}"
        if losses[0] != losses[1]:
            return f"forward not deterministic: {losses}"
        if not any(p.grad is not None for p in model.parameters()):
            return "no gradients"
        return ""
    except Exception as e:  # noqa: BLE001 - the reason is the skip's
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _variants(name, mt, cls):
    for extra in [None, *_EXTRA.get(mt, [])]:
        for attn in ("sdpa", "eager"):
            yield extra, attn


@functools.lru_cache(maxsize=None)
def _choose(name: str) -> str:
    """Tries `name`'s variants (the generic sizes, then _EXTRA's, each with sdpa then eager
    attention): '' and the variant recorded in _CHOSEN, or why none builds and runs."""
    import logging
    import warnings
    logging.getLogger("transformers").setLevel(logging.ERROR)
    _, mt, cls, _ = {c[0]: c for c in candidates()}[name]
    print(f"hf_causal_lms: trying {name}", file=sys.stderr, flush=True)
    reasons = []
    for extra, attn in _variants(name, mt, cls):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = _try(_zoo_model(name, mt, cls, extra, attn))
        if not r:
            _CHOSEN[name] = (extra, attn)
            return ""
        reasons.append(r)
    # the generic build's reason, unless a variant of _EXTRA's was tried
    return reasons[-1] if _EXTRA.get(mt) else reasons[0]


@functools.lru_cache(maxsize=None)
def _built(only: tuple[str, ...] | None = None):
    """(names built, ((name, why not), ...)) over every candidate (`only`: those)."""
    good, bad = [], []
    seen: dict[str, str] = {}  # model class -> the model_type built for it
    for name, mt, cls, why in candidates():
        if only is not None and name not in only:
            continue
        if not why and cls in seen:  # (several model_types of one class: the first that
            why = f"duplicate: {cls} is built for {seen[cls]}"  # builds)
        if not why:
            why = _choose(name)
        if why:
            bad.append((name, why))
        else:
            good.append(name)
            seen[cls] = mt
    return tuple(good), tuple(bad)


def more_causal_lms(only=None) -> list[zoo.ZooModel]:
    """The causal LMs built and run eagerly at the tiny size (`skipped()`: the others;
    `only`: of these names)."""
    good, _ = _built(None if only is None else tuple(only))
    by = {c[0]: c for c in candidates()}
    return [_zoo_model(n, by[n][1], by[n][2], *_CHOSEN[n]) for n in good]


def skipped() -> list[tuple[str, str]]:
    return list(_built()[1])


# --- registration: zoo.models() and zoo_sweep's ranks see these models ---------------------

def _orig_models():
    return zoo._models_unpatched() if hasattr(zoo, "_models_unpatched") else zoo.models()


def _registered() -> dict[str, zoo.ZooModel]:
    """Every candidate by name, its factory the variant chosen (the parent passes it to the
    ranks, `_rank`); a rank does not try the builds again."""
    out = {}
    for name, mt, cls, why in candidates():
        if not why:
            out[name] = _zoo_model(name, mt, cls, *_CHOSEN.get(name, (None, "sdpa")))
    return out


def install() -> None:
    if hasattr(zoo, "_models_unpatched"):
        return
    orig = zoo.models
    zoo._models_unpatched = orig

    def models():
        return {**orig(), **_registered()}
    zoo.models = models
    zoo_sweep._plans_rank = _plans_rank
    zoo_sweep._plans_verify_rank = _plans_verify_rank


def _plans_rank(name, plans, keys, chosen=None):
    _CHOSEN.update(chosen or {})
    return _ORIG_PLANS_RANK(name, plans, keys)


def _plans_verify_rank(name, plans, keys, chosen=None):
    _CHOSEN.update(chosen or {})
    return _ORIG_VERIFY_RANK(name, plans, keys)


_ORIG_PLANS_RANK = zoo_sweep._plans_rank
_ORIG_VERIFY_RANK = zoo_sweep._plans_verify_rank
if __name__ != "__main__":  # (run as -m: the module imported by its name installs)
    install()


def _launch_with_choice(fxpar_launch):
    """fxpar.launch passing this process's chosen variants (_CHOSEN) to the ranks."""
    def launch(fn, nprocs, *args):
        if fn in (_plans_rank, _plans_verify_rank):
            args = (*args, dict(_CHOSEN))
        return fxpar_launch(fn, nprocs, *args)
    return launch


def table(names, plans=PLANS, log=functools.partial(print, flush=True)) -> None:
    """zoo_sweep.plan_table, a row per model, a failed launch a row of its own."""
    import fxpar
    zoo_sweep.fxpar = type(sys)("fxpar_shim")  # plan_cells calls fxpar.launch by attribute
    zoo_sweep.fxpar.__dict__.update(fxpar.__dict__)
    zoo_sweep.fxpar.launch = _launch_with_choice(fxpar.launch)
    log("| model | " + " | ".join(plans) + " |\n|---|" + "---|" * len(plans))
    for name in names:
        t0 = time.perf_counter()
        try:
            row = zoo_sweep.plan_cells(name, plans)
            cells = [row[k] for k in plans]
        except Exception as e:  # noqa: BLE001 - a rank died or hung: the row says so
            cells = [f"launch failed: {type(e).__name__}: {str(e)[:300]}"] * len(plans)
            traceback.print_exc()
        log(f"| {name} | " + " | ".join(c.replace("|", "/").replace("\n", " ")
                                       for c in cells)
            + f" |  <!-- {time.perf_counter() - t0:.0f} s -->")


def main(argv) -> None:
    keys = tuple(PLANS)
    if "--plans" in argv:
        i = argv.index("--plans")
        keys = tuple(argv[i + 1].split(","))
        argv = argv[:i] + argv[i + 2:]
        unknown = [k for k in keys if k not in PLANS]
        if unknown:
            sys.exit(f"hf_causal_lms: unknown plan column(s) {unknown}; choose from "
                     f"{list(PLANS)}")
    listing = "--list" in argv
    names = [a for a in argv if a != "--list"]
    only = tuple(names) if names else None
    good = [m.name for m in more_causal_lms(only)]
    if listing:  # (of the names given, else of every candidate; runs nothing)
        print(f"{len(good)} built:")
        for m in more_causal_lms(only):
            extra, attn = _CHOSEN[m.name]
            print(f"  {m.name:28s} {m.note} [{attn}]")
        bad = _built(only)[1]
        print(f"{len(bad)} skipped:")
        for n, why in bad:
            print(f"  {n:28s} {why}")
        return
    unknown = [n for n in names if n not in good]
    if unknown:
        sys.exit(f"hf_causal_lms: not built: {unknown} (see --list)")
    table(names or good, {k: PLANS[k] for k in keys})


if __name__ == "__main__":
    from fxpar.examples import hf_causal_lms  # the module by its name: ranks import it
    hf_causal_lms.main(sys.argv[1:])
