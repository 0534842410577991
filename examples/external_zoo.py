"""The external zoo: model code fxpar's authors did not write, as its users train it.

torchtitan's, timm's, litgpt's and nanoGPT's own modules, built from the libraries' own
configs at a debug size, each a `zoo.ZooModel` (plus the library it needs) with a global
batch of 8 rows and a loss_fn, so examples/zoo_sweep.py trains them under every plan
against plain single-process PyTorch exactly as it does the zoo (`python -m fxpar zoo
--external`, tests/test_external_zoo.py, docs/external_zoo.md).

The libraries are pyproject's `zoo` extra, installed by scripts/setup.sh with --no-deps (see
there). A model whose library is missing is not an error: `missing(spec)` names it, the sweep
marks its cells "skipped" and the tests skip. What each builder changes from the library's
config, and why:
- torchtitan: the flavor's `debugmodel` config cut to 2 layers. Its attention is
  FlexAttention, which has no backward on CPU ("FlexAttention does not support backward on
  CPU"), so every FlexAttention/VarlenAttention config is swapped for torchtitan's own
  ScaledDotProductAttention (causal, no packed-document mask: the batches pack none). Qwen3's
  MoE debug config (64 experts, top-8, 80M parameters at 2 layers) is cut to 8 experts,
  top-2. Loss: next-token cross entropy on the logits, as torchtitan's trainer computes it.
- timm: `timm.create_model` with `pretrained=False`, 5 classes, dropout and drop-path 0
  (the library's test_* configs where timm has one), on 32x32 images. timm imports
  torchvision at module level (FrozenBatchNorm2d, its data transforms); PyPI's torchvision
  is not installed beside this torch, so `import timm` runs with a stand-in `torchvision`
  module (a FrozenBatchNorm2d and placeholder names that raise when used), removed from
  sys.modules again once timm is imported.
- litgpt: `litgpt.Config.from_name(<a real checkpoint's config>)` at 2 layers, width 32,
  vocabulary 128; `litgpt.GPT`. Loss: next-token cross entropy on the logits.
- nanoGPT: its model.py, vendored unmodified in examples/third_party/nanogpt (nanoGPT is
  not a package); `GPT(GPTConfig(...))`, loss the one its forward returns with targets.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import io
import sys
import types

import torch
from torch import nn
import torch.nn.functional as F

from fxpar.examples import zoo
from fxpar.examples.zoo import BATCH, SEQ, ZooModel


@dataclasses.dataclass(frozen=True)
class ExternalModel(ZooModel):
    library: str = ""            # the distribution the model code comes from
    requires: tuple = ()         # modules that must import (the library and what it needs)


# --- batches and losses -------------------------------------------------------------------------

def next_token_batch(vocab: int, seed: int):
    """Token ids and their next-token targets (the last position predicts the first)."""
    def batch(step: int) -> dict:
        g = torch.Generator().manual_seed(seed + step)
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
        return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}
    return batch


def logits_loss(model, batch):
    """Mean next-token cross entropy of a model that returns logits (torchtitan, litgpt)."""
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())


def classifier_loss(model, batch):
    """timm: the model returns class logits."""
    return F.cross_entropy(model(batch["pixel_values"]), batch["labels"])


def nanogpt_loss(model, batch):
    """nanoGPT's forward computes the loss itself when given targets."""
    return model(batch["input_ids"], batch["labels"])[1]


# --- torchtitan -----------------------------------------------------------------------------------

TITAN_VOCAB = 2048  # the debug configs' vocabulary


def _titan_sdpa(cfg) -> int:
    """Swap every FlexAttention / VarlenAttention config under `cfg` for SDPA's."""
    from torchtitan.models.common.attention import (FlexAttention, ScaledDotProductAttention,
                                                    VarlenAttention)
    n = 0
    items = cfg if isinstance(cfg, list) else (
        [getattr(cfg, f.name) for f in dataclasses.fields(cfg)]
        if dataclasses.is_dataclass(cfg) else [])
    if dataclasses.is_dataclass(cfg):
        for f in dataclasses.fields(cfg):
            if isinstance(getattr(cfg, f.name), (FlexAttention.Config, VarlenAttention.Config)):
                setattr(cfg, f.name, ScaledDotProductAttention.Config())
                n += 1
    for v in items:
        if isinstance(v, list) or dataclasses.is_dataclass(v):
            n += _titan_sdpa(v)
    return n


def _titan_experts(cfg, experts: int, top_k: int) -> None:
    """Set every MoE config under `cfg` to `experts` experts, `top_k` per token."""
    from torchtitan.models.common.moe import TokenChoiceTopKRouter
    if isinstance(cfg, list):
        for c in cfg:
            _titan_experts(c, experts, top_k)
        return
    if not dataclasses.is_dataclass(cfg):
        return
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name == "num_experts" and isinstance(v, int):
            setattr(cfg, f.name, experts)
        elif f.name == "top_k" and isinstance(v, int):
            setattr(cfg, f.name, top_k)
        elif isinstance(v, list) or dataclasses.is_dataclass(v):
            _titan_experts(v, experts, top_k)
    if isinstance(cfg, TokenChoiceTopKRouter.Config):
        cfg.gate.out_features = experts


def _titan(family: str, registry: str, flavor: str = "debugmodel", layers: int = 2,
           experts: tuple[int, int] | None = None):
    def make():
        fn = getattr(importlib.import_module(f"torchtitan.models.{family}"), registry)[flavor]
        params = inspect.signature(fn).parameters
        kw = {k: v for k, v in (("attn_backend", "flex"), ("moe_comm_backend", "standard"))
              if k in params}
        cfg = fn(**kw)
        cfg.layers = cfg.layers[:layers]
        _titan_sdpa(cfg)
        if experts is not None:
            _titan_experts(cfg, *experts)
        model = cfg.build()
        model.init_states()
        return model
    return make


def _titans() -> list[ExternalModel]:
    t = dict(library="torchtitan", requires=("torchtitan.models",), loss_fn=logits_loss)
    lm = next_token_batch(TITAN_VOCAB, 8000)
    return [
        ExternalModel("titan_llama3", "causal-lm", _titan("llama3", "llama3_configs"), lm, **t,
                      note="torchtitan Llama 3 debugmodel: fused wqkv (split into wq/wk/wv by a "
                           "state-dict hook), complex RoPE cache"),
        ExternalModel("titan_qwen3", "causal-lm", _titan("qwen3", "qwen3_configs"), lm, **t,
                      note="torchtitan Qwen 3 debugmodel: q/k RMSNorm, head_dim 128 > dim / heads"),
        ExternalModel("titan_qwen3_unfused", "causal-lm", _titan(
            "qwen3", "qwen3_configs", "debugmodel_non_fused_qkv"), lm, **t,
            note="torchtitan Qwen 3 with separate wq / wk / wv"),
        ExternalModel("titan_qwen3_moe", "moe", _titan(
            "qwen3", "qwen3_configs", "debugmodel_moe", experts=(8, 2)), lm, **t,
            note="torchtitan Qwen 3 MoE (8 experts, top-2): grouped experts, a custom "
                 "scatter-add op, expert-load buffers updated in the forward"),
        ExternalModel("titan_deepseek_v3", "moe", _titan(
            "deepseek_v3", "deepseekv3_configs"), lm, **t,
            note="torchtitan DeepSeek-V3 debugmodel: MLA, a dense then an MoE layer (8 "
                 "experts, top-3, 2 shared), tokens_per_expert buffer"),
        ExternalModel("titan_kimi_k2", "moe", _titan("kimi_k2_7", "kimi_k2_5_configs"), lm, **t,
                      note="torchtitan Kimi-K2 debugmodel, text only: DeepSeek-V3-style MoE; "
                           "its vision encoder gets no gradient"),
    ]


# --- timm -------------------------------------------------------------------------------------------

class _FrozenBatchNorm2d(nn.Module):
    """torchvision.ops.misc.FrozenBatchNorm2d: BatchNorm2d with fixed statistics and affine."""

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x):
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)


class _Absent(type):
    """A name torchvision would have: any attribute is another such name; calling one
    (instantiating it) raises."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{cls.__qualname__}.{name}", (), {"__qualname__": f"{cls.__qualname__}.{name}"})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"torchvision is not installed: {cls.__qualname__} is a stand-in "
                           "(fxpar's external zoo imports timm without it)")


class _AbsentModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Absent(f"{self.__name__}.{name}", (), {"__qualname__": f"{self.__name__}.{name}"})
        setattr(self, name, value)
        return value


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision" and not name.startswith("torchvision."):
            return None
        if name.startswith("torchvision.models"):  # timm's optional fx feature extraction: off
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _AbsentModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        if module.__name__ == "torchvision.ops.misc":
            module.FrozenBatchNorm2d = _FrozenBatchNorm2d


@contextlib.contextmanager
def _torchvision_stand_in():
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        yield
        return
    finder = _TorchvisionStandIn()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]


def import_timm():
    """`import timm`, without torchvision where it is not installed (see the module doc)."""
    if "timm" in sys.modules:
        return sys.modules["timm"]
    with _torchvision_stand_in():
        import timm
    return timm


def _timm(arch: str, **kw):
    def make():
        timm = import_timm()
        return timm.create_model(arch, pretrained=False, num_classes=5, drop_rate=0.0,
                                 drop_path_rate=0.0, **kw)
    return make


def _timms() -> list[ExternalModel]:
    t = dict(library="timm", requires=("timm", "huggingface_hub", "safetensors", "yaml"),
             loss_fn=classifier_loss)
    img = zoo.image_batch
    return [
        ExternalModel("timm_vit", "vision", _timm("test_vit", img_size=32, depth=2), img, **t,
                      note="timm test_vit (ViT): class token, fused qkv, LayerScale off"),
        ExternalModel("timm_resnet", "vision", _timm("test_resnet"), img, **t,
                      note="timm test_resnet: BatchNorm (running stats updated)"),
        ExternalModel("timm_efficientnet", "vision", _timm("test_efficientnet"), img, **t,
                      note="timm test_efficientnet: depthwise convs, squeeze-excite, SiLU, "
                           "BatchNormAct2d"),
        ExternalModel("timm_convnext", "vision", _timm("test_convnext"), img, **t,
                      note="timm test_convnext: depthwise 7x7 convs, LayerNorm2d, layer scale"),
        ExternalModel("timm_swin", "vision", _timm(
            "swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4,
            embed_dim=16, depths=(1, 1), num_heads=(2, 4)), img, **t,
            note="timm Swin: shifted windows, relative-position bias, patch merging"),
        ExternalModel("timm_mobilenetv3", "vision", _timm("mobilenetv3_small_050"), img, **t,
                      note="timm MobileNetV3-small 0.5: hard-swish, squeeze-excite, "
                           "BatchNormAct2d"),
        ExternalModel("timm_nfnet", "vision", _timm("test_nfnet"), img, **t,
                      note="timm test_nfnet: normalizer-free, weight-standardized convs"),
    ]


# --- litgpt -------------------------------------------------------------------------------------------

LIT_VOCAB = 128
_LIT_SMALL = dict(n_layer=2, n_embd=32, n_head=4, block_size=64, vocab_size=LIT_VOCAB,
                  padded_vocab_size=LIT_VOCAB, intermediate_size=64)


def _litgpt(checkpoint: str, **over):
    def make():
        from litgpt.config import Config
        from litgpt.model import GPT
        return GPT(Config.from_name(checkpoint, **{**_LIT_SMALL, **over}))
    return make


def _litgpts() -> list[ExternalModel]:
    t = dict(library="litgpt", requires=("litgpt", "lightning", "torchmetrics", "psutil"),
             loss_fn=logits_loss)
    lm = next_token_batch(LIT_VOCAB, 8100)
    return [
        ExternalModel("litgpt_pythia", "causal-lm", _litgpt("pythia-14m"), lm, **t,
                      note="litgpt pythia-14m config: parallel residual, rotary on a quarter "
                           "of the head, LayerNorm, fused QKV"),
        ExternalModel("litgpt_llama3", "causal-lm", _litgpt("Llama-3.2-1B", n_query_groups=2),
                      lm, **t, note="litgpt Llama-3.2-1B config: GQA, SwiGLU, RMSNorm, "
                                    "Llama-3 RoPE scaling"),
        ExternalModel("litgpt_gemma2", "causal-lm", _litgpt(
            "Gemma-2-2b", n_query_groups=2, head_size=8, sliding_window_size=8), lm, **t,
            note="litgpt Gemma-2-2b config: soft-capping, local (window 8) / global layers, "
                 "post-norms, scaled embeddings"),
        ExternalModel("litgpt_gemma3", "causal-lm", _litgpt(
            "Gemma-3-1b-it", n_query_groups=1, head_size=8, sliding_window_size=8,
            sliding_window_indices=[1, 0], rope_indices=[1, 0]), lm, **t,
            note="litgpt Gemma-3-1b config: q/k norm, local / global layers with two RoPE "
                 "bases, MQA"),
        ExternalModel("litgpt_mixtral", "moe", _litgpt(
            "Mixtral-8x7B-v0.1", n_query_groups=2, n_expert=4, n_expert_per_token=2), lm, **t,
            note="litgpt Mixtral config (4 experts, top-2): experts picked by torch.where"),
    ]


# --- nanoGPT -------------------------------------------------------------------------------------------

NANOGPT_VOCAB = 128


def _nanogpt():
    from fxpar.examples.third_party.nanogpt import model as nanogpt
    cfg = nanogpt.GPTConfig(block_size=64, vocab_size=NANOGPT_VOCAB, n_layer=2, n_head=4,
                            n_embd=32, dropout=0.0, bias=True)
    with contextlib.redirect_stdout(io.StringIO()):  # its "number of parameters" line
        return nanogpt.GPT(cfg)


def _nanogpts() -> list[ExternalModel]:
    return [ExternalModel(
        "nanogpt", "causal-lm", _nanogpt, next_token_batch(NANOGPT_VOCAB, 8200),
        loss_fn=nanogpt_loss, library="nanoGPT (vendored)",
        requires=("fxpar.examples.third_party.nanogpt.model",),
        note="nanoGPT's model.py: GPT-2 with tied head, SDPA causal attention, loss in forward")]


# --- the registry ---------------------------------------------------------------------------------------

def models() -> dict[str, ExternalModel]:
    """Every external model by name, installed or not (see `missing`)."""
    return {m.name: m for m in (*_titans(), *_timms(), *_litgpts(), *_nanogpts())}


def missing(spec: ExternalModel) -> str:
    """'' when the model's library imports, else why it cannot be built here."""
    for mod in spec.requires:
        try:
            if importlib.util.find_spec(mod) is None:
                raise ImportError(f"No module named {mod!r}")
        except ImportError as e:  # also a missing parent package
            return (f"{spec.library} is not installed ({e}); scripts/setup.sh installs "
                    "pyproject's `zoo` extra")
    return ""


def build(name: str, seed: int = 1234) -> tuple[nn.Module, ExternalModel]:
    """The model, initialised from `seed` (the same weights every time)."""
    spec = models()[name]
    why = missing(spec)
    if why:
        raise ImportError(why)
    torch.manual_seed(seed)
    return spec.factory(), spec


loss_of = zoo.loss_of
