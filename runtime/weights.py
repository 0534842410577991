"""Each rank's weights without a whole model: sliced reads, shard-wise init, HF-layout saves.

A model built on the meta device has shapes and no data. The runtime gives each rank only
what its Program owns (runtime/trainer.py): for a parameter, its tensor-parallel slice
(runtime/tp_slices.py's layout, fused QKV interleaving included), or with ZeRO-3 the 1/dp
flat shard of that slice; nothing for a pipeline stage the rank does not run. This module
says which elements of the user's full tensor those are (`local_runs`, `flat_shard_rows`)
and reads just those from a *source*:

- `FileSource`: a `.safetensors` file, a Hugging Face `save_pretrained` directory
  (`model.safetensors`, or `model.safetensors.index.json` + shards), a torch state-dict
  file, or an fxpar checkpoint (DCP). safetensors' `get_slice` reads only the requested
  rows/columns from the file; a torch file is opened with `mmap=True`, so slicing touches
  only those pages; a DCP checkpoint is read one tensor at a time (DCP reads whole tensors
  here: at most one full tensor is in memory at once).
- `ConvertedSource`: a Hugging Face checkpoint in the Hub's layout (an MoE's experts one
  by one, older key names), converted with transformers' own mapping as `from_pretrained`
  converts it; used for the keys the file does not hold as the model names them, and
  for those transformers' mapping converts even under the model's own name.
- `InitSource`: the modules' own initialisation (HF `_init_weights`, else
  `reset_parameters`) run on one module's tensors at a time, with a generator seeded per
  module, so every rank computes the same values for the elements it keeps. Same
  distributions as a single-process init, not the same numbers: `weights=` gives those.
- real (non-meta) tensors of the model are their own source (`tensor[index]`).

`save_pretrained` writes the full state as Hugging Face safetensors shards (+ index), one
tensor gathered at a time to the rank that writes its file, in the Hub's layout where
transformers' own save writes that (`hub_layout`): memory per rank is bounded by the shard
size, and `from_pretrained` reads the result (`load_state_dict` too where that layout is
the modules' own).
"""
from __future__ import annotations

import json
import logging
import math
import os
import zlib
from typing import Iterable

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import metadata as dcp_md

from fxpar.core.errors import CheckpointError
from fxpar.core.ir import fused_pieces
from fxpar.runtime import checkpoint as ck
from fxpar.runtime import model_state
from fxpar.runtime import tp_slices as rtp

log = logging.getLogger(__name__)

Runs = list[tuple[int, int]]  # contiguous [start, stop) ranges of one dim, in local order


# --- which elements of the full tensor a rank holds ---------------------------------------

def local_runs(shape, layout, tp: int, rank: int, runs: list[Runs] | None = None
               ) -> list[Runs]:
    """Per dim of the full tensor, the ranges whose concatenation is this tp rank's tensor
    (rtp.local_param's result, without making the full tensor). layout: (shard_dim,
    interleave_dim, k) or None. `runs`: an earlier split's (on other dims), to split
    further."""
    runs = [list(r) for r in runs] if runs is not None else [[(0, n)] for n in shape]
    if layout is None:
        return runs
    shard_dim, il_dim, pieces = layout
    if fused_pieces(pieces):  # fused pieces: rank r's chunk is [piece_0 share r; piece_1 ...]
        n = shape[il_dim]
        if runs[il_dim] != [(0, n)]:
            raise ValueError(f"fxpar bug: dim {il_dim} interleaved after another split of it")
        sizes = rtp.piece_sizes(n, pieces)
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        runs[il_dim] = [(a + r * (s // tp), a + (r + 1) * (s // tp))
                        for r in range(tp) for a, s in zip(starts, sizes)]
    if shard_dim is not None:
        n = run_length(runs[shard_dim])
        size = -(-n // tp)  # torch.chunk's sizes
        runs[shard_dim] = narrow(runs[shard_dim], min(n, rank * size), min(n, (rank + 1) * size))
    return runs


def split_runs(shape, splits) -> list[Runs]:
    """local_runs after each split in turn (runtime/tp_slices.local_of's chain)."""
    runs = None
    for layout, ranks, rank, _ in splits:
        runs = local_runs(shape, layout, ranks, rank, runs)
    return runs if runs is not None else [[(0, n)] for n in shape]


def narrow(runs: Runs, start: int, stop: int) -> Runs:
    """The runs covering local positions [start, stop) of the concatenation of `runs`."""
    out, pos = [], 0
    for a, b in runs:
        lo, hi = max(start, pos), min(stop, pos + b - a)
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += b - a
    return out


def run_length(runs: Runs) -> int:
    return sum(b - a for a, b in runs)


def flat_shard_rows(runs: list[Runs], dp: int, rank: int):
    """ZeRO-3: this dp rank's slice of the local tensor flattened and padded to a multiple
    of dp (runtime/zero.ShardedOptimizer's layout). Returns (runs narrowed to the dim-0 rows
    covering it, offset of the slice in those rows' flat elements, real elements, slice
    size): only those rows are read, never the whole tensor."""
    shape = [run_length(r) for r in runs]
    numel = math.prod(shape)
    size = -(-numel // dp)
    a, b = rank * size, min((rank + 1) * size, numel)
    if not shape:  # 0-dim: one element, on rank 0's slice
        return runs, 0, max(0, b - a), size
    row = numel // shape[0] if shape[0] else 1
    if b <= a:
        return [[]] + runs[1:], 0, 0, size
    r0, r1 = a // row, -(-b // row)
    return [narrow(runs[0], r0, r1)] + runs[1:], a - r0 * row, b - a, size


# --- sources ------------------------------------------------------------------------------

class Source:
    """Reads a block of one tensor of the user's state dict (keys as model.state_dict())."""

    def shape(self, key: str) -> tuple | None:
        """The full shape of `key`, None where the source has no such tensor."""
        raise NotImplementedError

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        raise NotImplementedError

    def read_runs(self, key: str, runs: list[Runs]) -> torch.Tensor:
        """The tensor made of `runs` (per dim): one read per block of contiguous ranges."""
        for d, r in enumerate(runs):
            if len(r) > 1:
                return torch.cat([self.read_runs(key, runs[:d] + [[x]] + runs[d + 1:])
                                  for x in r], d)
        if any(not r for r in runs):
            return torch.empty([run_length(r) for r in runs], dtype=self.dtype(key))
        return self.read(key, tuple(slice(a, b) for (a, b), in runs))

    def dtype(self, key: str) -> torch.dtype:
        return torch.float32


class TensorSource(Source):
    """The model's own (real) tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def shape(self, key):
        t = self.tensors.get(key)
        return None if t is None else tuple(t.shape)

    def dtype(self, key):
        return self.tensors[key].dtype

    def read(self, key, index):
        return self.tensors[key].detach()[index]


class FileSource(Source):
    """A weights file or directory (see the module docstring); keys as model.state_dict()."""

    def __init__(self, path):
        self.path = str(path)
        self._shapes: dict[str, tuple] = {}
        self._torch: dict | None = None
        self._dcp = None
        self.key_file: dict[str, str] = {}
        p = self.path
        if os.path.isdir(p):
            index = os.path.join(p, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    wm = json.load(f).get("weight_map")
                if not isinstance(wm, dict):
                    raise CheckpointError(f"{index} has no 'weight_map': not a Hugging Face "
                                          "safetensors index.")
                self.key_file = {k: os.path.join(p, v) for k, v in wm.items()}
            elif os.path.exists(os.path.join(p, "model.safetensors")):
                self._index_safetensors(os.path.join(p, "model.safetensors"))
            elif os.path.exists(os.path.join(p, "fxpar.json")):
                self._open_dcp(p)
            elif os.path.exists(os.path.join(p, "pytorch_model.bin")):
                self._open_torch(os.path.join(p, "pytorch_model.bin"))
            else:
                raise CheckpointError(
                    f"weights={p!r} is a directory with none of model.safetensors.index.json, "
                    "model.safetensors, pytorch_model.bin (Hugging Face save_pretrained "
                    "layouts) or fxpar.json (an fxpar checkpoint): point weights= at one of "
                    "those, or at a .safetensors / torch state-dict file.")
        elif os.path.isfile(p):
            if p.endswith(".safetensors"):
                self._index_safetensors(p)
            else:
                self._open_torch(p)
        else:
            raise CheckpointError(f"weights={p!r}: no such file or directory.")

    def keys(self) -> list[str]:
        """Every tensor key a safetensors or torch file holds (as stored; an fxpar
        checkpoint holds the model's own keys and is never converted)."""
        return list(self._torch) if self._torch is not None else list(self.key_file)

    def _index_safetensors(self, file):
        with safe_open(file, framework="pt") as f:
            self.key_file.update({k: file for k in f.keys()})

    def _open_torch(self, file):
        try:
            sd = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # not a zip-format torch file, or pickled objects
            raise CheckpointError(f"weights={file!r} is neither a .safetensors file nor a "
                                  f"torch state-dict file torch.load(weights_only=True, "
                                  f"mmap=True) reads: {type(e).__name__}: {e}") from None
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise CheckpointError(f"weights={file!r} holds a {type(sd).__name__}, not a state "
                                  "dict of tensors (keys as model.state_dict()).")
        self._torch = sd

    def _open_dcp(self, path):
        _, reader, md = ck.read_meta(path)
        self._dcp = (reader, md)

    def _open(self, key):
        """The safetensors file holding `key`, opened for this read only: a mapping kept
        open would count every page read so far in the rank's resident memory."""
        file = self.key_file[key]
        try:
            return safe_open(file, framework="pt")
        except FileNotFoundError:
            raise CheckpointError(f"weights {self.path!r}: the index names {file!r} for "
                                  f"{key!r}, which does not exist.") from None

    def shape(self, key):
        if self._torch is not None:
            t = self._torch.get(key)
            return None if t is None else tuple(t.shape)
        if self._dcp is not None:
            m = self._dcp[1].get(f"model.{key}")
            return tuple(m.size) if isinstance(m, dcp_md.TensorStorageMetadata) else None
        if key not in self.key_file:
            return None
        if key not in self._shapes:
            with self._open(key) as f:
                self._shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        return self._shapes[key]

    def read(self, key, index):
        if self._torch is not None:
            return self._torch[key][index]
        if self._dcp is not None:
            reader, md = self._dcp
            full = ck.read_tensors(self.path, reader, md, [f"model.{key}"], False)[f"model.{key}"]
            return full[index]  # DCP reads whole tensors here: one at a time
        with self._open(key) as f:
            return f.get_slice(key)[index]


class ConvertedSource(Source):
    """A Hugging Face checkpoint whose tensors are stored in another layout than the model's
    modules hold them: transformers 5 keeps the Hub's layout on disk (an MoE's experts one
    by one, `block_sparse_moe.experts.3.w1.weight`; a base model's keys without the head's
    prefix) and converts on load (`from_pretrained`: Mixtral's experts stacked and gate/up
    concatenated into `mlp.experts.gate_up_proj`). This applies transformers' own mapping
    for the model (`get_model_conversion_mapping`: its renamings, and its converters'
    operations), so a checkpoint from the Hub or from the model's own `save_pretrained`
    loads as `from_pretrained` loads it. A renamed key is read sliced as any other; a
    converted one is built whole from its sources (one target group at a time: the memory
    of one layer's experts, as from_pretrained), then sliced. Keys as model.state_dict()."""

    def __init__(self, model: torch.nn.Module, file: FileSource, mapping: list):
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     dot_natural_key, rename_source_key)
        self.model, self.file = model, file
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        state = model.state_dict()
        prefix = getattr(model, "base_model_prefix", None)
        self.renamed: dict[str, str] = {}  # model key -> file key
        self.groups: dict[str, tuple] = {}  # first target -> (converter, [(pattern, file key)])
        for key in sorted(file.keys(), key=dot_natural_key):  # experts in their order
            new, pattern = rename_source_key(key, renamings, converters, prefix, state)
            if new not in state and key in state:
                new, pattern = key, None
            if new not in state:
                continue  # a key the model does not have (from_pretrained ignores it too)
            if pattern is None:
                self.renamed[new] = key
            else:
                self.groups.setdefault(new, (by_pattern[pattern], []))[1].append((pattern, key))
        self.made_by: dict[str, str] = {}  # model key -> the group (first target) making it
        self.shapes: dict[str, tuple] = {}
        for first in self.groups:  # which keys a group makes, and their shapes: on meta
            for k, v in self._convert(first, meta=True).items():
                self.made_by[k], self.shapes[k] = first, tuple(v.shape)
        self._made: tuple[str, dict] | None = None  # the last group converted

    def _convert(self, first: str, meta: bool) -> dict[str, torch.Tensor]:
        import copy
        conv, sources = self.groups[first]
        conv = copy.deepcopy(conv)  # (convert consumes what add_tensor collected)
        for pattern, key in sources:
            t = torch.empty(self.file.shape(key), device="meta") if meta else \
                self.file.read(key, (...,))
            conv.add_tensor(first, key, pattern, t)
        try:
            out = conv.convert(first, model=self.model, config=getattr(self.model, "config",
                                                                      None))
        except Exception as e:  # noqa: BLE001 - named with the keys it was given
            found = {}
            for pattern, key in sources:
                found.setdefault(pattern, []).append(key)
            what = "; ".join(f"{len(ks)} x {p!r} ({ks[0]}{' ...' if len(ks) > 1 else ''})"
                             for p, ks in found.items())
            raise CheckpointError(
                f"weights {self.file.path!r}: transformers builds {first!r} from the file's "
                f"{what}, and that failed ({type(e).__name__}: {e}). A tensor is missing "
                "from the file (e.g. one expert's), or it was saved in a layout this "
                "transformers version does not convert: check the file against the model's "
                "config.") from None
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}

    def shape(self, key):
        if key in self.renamed:
            return self.file.shape(self.renamed[key])
        return self.shapes.get(key)

    def sources_of(self, key: str) -> str:
        """The file's keys a converted `key` is built from (for messages)."""
        keys = [k for _, k in self.groups[self.made_by[key]][1]]
        return ", ".join(keys[:3]) + (f" ... ({len(keys)} tensors)" if len(keys) > 3 else "")

    def read(self, key, index):
        if key in self.renamed:
            return self.file.read(self.renamed[key], index)
        first = self.made_by[key]
        if self._made is None or self._made[0] != first:
            self._made = None  # (the last group freed before the next is built)
            self._made = (first, self._convert(first, meta=False))
        return self._made[1][key][index]

    def release(self) -> None:
        self._made = None


def hf_conversion(model: torch.nn.Module, file: FileSource) -> ConvertedSource | None:
    """transformers' conversion of `file` into `model`'s keys (ConvertedSource), or None:
    not a Hugging Face model, an fxpar checkpoint (the model's own keys), or a transformers
    without these mappings (or whose mapping does not apply: a warning)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel) or file._dcp is not None:
        return None
    try:
        return ConvertedSource(model, file, get_model_conversion_mapping(model))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - another transformers: the file's keys as they are
        log.warning("weights: transformers' conversion mapping for %s did not apply (%s: "
                    "%s): reading %s with the model's own keys", type(model).__name__,
                    type(e).__name__, e, file.path)
        return None


class HookedSource(Source):
    """A file saved from a model whose state dict its own hooks compute (torchtitan's fused
    QKV saves `wq/wk/wv` and joins them into `wqkv` on load): the model's load hooks turn the
    file's entries into the model's own tensors (runtime/model_state.py). The hooks need
    whole tensors, so the first read reads every entry of the file the model's state dict
    names, whole, and makes all of the model's tensors (one full copy of the model on each
    rank while the weights are placed; released after); later reads slice them.
    `stand_in`: the model's state dict on meta stand-ins, with keep_vars (tied names hold one
    tensor: a file that keeps one of them, as transformers' and safetensors' saves do, is
    read for all)."""

    def __init__(self, model: torch.nn.Module, file: FileSource, stand_in: dict, path):
        self.model, self.file, self.path = model, file, path
        self.own = model_state.own_tensors(model, persistent_only=True)
        self.saved = {k: tuple(v.shape) for k, v in stand_in.items()}  # what the file holds
        tied: dict[int, list[str]] = {}
        for k, v in stand_in.items():
            tied.setdefault(id(v), []).append(k)
        self.tied = {k: names for names in tied.values() for k in names}
        self._whole: dict[str, torch.Tensor] | None = None

    def key_in_file(self, key: str) -> str | None:
        """The file's entry for state-dict entry `key`: its own, or a tied name's."""
        return next((k for k in (key, *self.tied.get(key, ())) if self.file.shape(k)
                     is not None), None)

    def check(self) -> None:
        for k, want in self.saved.items():
            src = self.key_in_file(k)
            got = None if src is None else self.file.shape(src)
            if got is None:
                raise CheckpointError(
                    f"weights {self.path!r} has no {k!r} (keys as model.state_dict(), which "
                    "this model's own hooks compute): it was saved from a different model. "
                    "Load the file saved from this architecture.")
            if tuple(got) != want:
                raise CheckpointError(
                    f"weights {self.path!r}: {k!r} has shape {tuple(got)}, the model's is "
                    f"{want}: the file was saved from a differently configured model.")

    def shape(self, key):
        t = self.own.get(key)
        return None if t is None else tuple(t.shape)

    def dtype(self, key):
        return self.own[key].dtype

    def read(self, key, index):
        if self._whole is None:
            self.check()
            saved = {k: self.file.read(self.key_in_file(k), tuple(slice(0, n) for n in shape))
                     for k, shape in self.saved.items()}
            try:
                self._whole = model_state.whole_from_state_dict(
                    self.model, saved, {n: t.shape for n, t in self.own.items()},
                    {n: t.dtype for n, t in self.own.items()}, "cpu")
            except RuntimeError as e:
                raise CheckpointError(f"weights {self.path!r} do not load into this model "
                                      f"through its state-dict hooks: {e}") from e
        return self._whole[key][index]

    def release(self) -> None:
        self._whole = None


class InitSource(Source):
    """The modules' own initialisation, one module's tensors at a time (whole, transiently:
    the memory of the largest module, not of the model), on CPU. Reads the model as built
    (its tensors still meta): the runtime swaps in the rank's tensors after every read."""

    def __init__(self, model: torch.nn.Module, seed: int | None = None):
        self.model = model
        self.seed = torch.initial_seed() if seed is None else seed
        self.owner: dict[str, tuple[str, str]] = {}  # key -> (module path, attribute)
        for mname, mod in model.named_modules(remove_duplicate=False):
            for attr, t in (*mod._parameters.items(), *mod._buffers.items()):
                if t is not None:
                    key = f"{mname}.{attr}" if mname else attr
                    self.owner.setdefault(key, (mname, attr))
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None
        # ancestors' init (HF inits some weights from a parent) would also overwrite the
        # model's real tensors: run it only where there are none
        self.all_meta = all(t.is_meta for t in (*model.parameters(), *model.buffers()))

    def shape(self, key):
        if key not in self.owner:
            return None
        mname, attr = self.owner[key]
        return tuple(getattr(self.model.get_submodule(mname), attr).shape)

    def dtype(self, key):
        mname, attr = self.owner[key]
        return getattr(self.model.get_submodule(mname), attr).dtype

    def read(self, key, index):
        mname, attr = self.owner[key]
        if self._cached is None or self._cached[0] != mname:
            self._cached = (mname, self._init_module(mname))
        return self._cached[1][attr][index]

    def release(self) -> None:
        """Drop the last module's initialised tensors."""
        self._cached = None

    def _init_module(self, mname: str) -> dict[str, torch.Tensor]:
        """The module's direct meta tensors made real (on CPU), initialised by its own init
        (and its ancestors': HF inits some weights from a parent, GPT-2's scaled c_proj),
        then the module put back as it was. Seeded by the module's path: every rank gets the
        same. An element the init did not write is an error: floats are prefilled with NaN;
        integer / bool tensors are initialised twice from two different prefills."""
        mod = self.model.get_submodule(mname)
        meta = {a: t for store in (mod._parameters, mod._buffers) for a, t in store.items()
                if t is not None and t.is_meta}
        out = self._run_init(mod, mname, meta, fill=None)
        exact = [a for a, t in out.items() if not t.is_floating_point()]
        if exact:  # nothing to NaN-mark: what differs between two prefills was not written
            again = self._run_init(mod, mname, meta, fill=1)
            unset = [a for a in exact if not torch.equal(out[a], again[a])]
        else:
            unset = []
        unset += [a for a, t in out.items() if t.is_floating_point() and bool(t.isnan().any())]
        if unset:
            a = unset[0]
            name = f"{mname}.{a}" if mname else a
            how = ("it is a non-persistent buffer, so no weights file has it either: build "
                   "the model with its buffers real (e.g. accelerate's init_empty_weights("
                   "include_buffers=False)) or give the module an init that sets it"
                   if a in mod._buffers and a in mod._non_persistent_buffers_set else
                   "pass weights=PATH (a safetensors file or a save_pretrained directory), or "
                   "give the module a reset_parameters() that sets it")
            raise CheckpointError(
                f"weights=None on a meta-device model: nothing initialises {name!r} (module "
                f"{type(mod).__name__}: its reset_parameters / Hugging Face _init_weights "
                f"leave it unset): {how}.")
        return out

    def _run_init(self, mod, mname, meta, fill) -> dict[str, torch.Tensor]:
        fresh = {}
        for a, t in meta.items():
            f = torch.empty(t.shape, dtype=t.dtype)
            f.fill_(float("nan") if f.is_floating_point() and fill is None else (fill or 0))
            fresh[a] = f
        # the module's own real tensors (a partly-meta module) must survive its init
        kept = {a: t.detach().clone() for store in (mod._parameters, mod._buffers)
                for a, t in store.items() if t is not None and not t.is_meta}
        for a, f in fresh.items():
            if a in mod._parameters:
                mod._parameters[a] = torch.nn.Parameter(f, requires_grad=meta[a].requires_grad)
            else:
                mod._buffers[a] = f
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed((self.seed + zlib.crc32(mname.encode())) % 2**63)
                for path in _self_and_ancestors(mname)[:None if self.all_meta else 1]:
                    _init_one(self.model, path)
            return {a: getattr(mod, a).detach() for a in fresh}
        finally:
            for a, t in meta.items():
                (mod._parameters if a in mod._parameters else mod._buffers)[a] = t
            with torch.no_grad():
                for a, t in kept.items():
                    getattr(mod, a).copy_(t)


def _self_and_ancestors(mname: str) -> list[str]:
    parts = mname.split(".") if mname else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _init_one(model: torch.nn.Module, path: str) -> None:
    """Run the module's own init: the nearest Hugging Face PreTrainedModel's _init_weights,
    or its reset_parameters (the module at `path`'s own tensors; the others stay meta)."""
    mod = model.get_submodule(path)
    hf = _nearest_pretrained(model, path)
    if hf is not None:
        hf._init_weights(mod)
    elif hasattr(mod, "reset_parameters") and _has_direct_real(mod):
        mod.reset_parameters()
    elif isinstance(mod, torch.nn.MultiheadAttention) and _has_direct_real(mod):
        mod._reset_parameters()


def _has_direct_real(mod) -> bool:
    return any(t is not None and not t.is_meta
               for t in (*mod._parameters.values(), *mod._buffers.values()))


def _nearest_pretrained(model, path):
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        m = model.get_submodule(".".join(parts[:i]))
        if isinstance(m, PreTrainedModel):
            return m
    return None


# --- saving in Hugging Face's layout ------------------------------------------------------

SHARD_BYTES = 5 * 10**9  # Hugging Face's default max_shard_size ("5GB")


def hf_keys(model: torch.nn.Module, state_keys: Iterable[str]) -> list[str]:
    """The state-dict keys a save writes: every key, except for a Hugging Face model the
    aliases of a tied tensor after its first name (from_pretrained ties them again, as
    save_pretrained leaves them out)."""
    keys = list(state_keys)
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return keys
    if not isinstance(model, PreTrainedModel):
        return keys
    state = model.state_dict(keep_vars=True)
    seen, out = set(), []
    for k in keys:
        if id(state[k]) in seen:
            continue
        seen.add(id(state[k]))
        out.append(k)
    return out


def plan_shards(entries: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Keys (in order) packed into files of at most max_bytes (a larger tensor alone)."""
    files, cur, size = [], [], 0
    for k, n in entries:
        if cur and size + n > max_bytes:
            files.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += n
    if cur:
        files.append(cur)
    return files


# transformers' conversion ops that act on the tensors alone (stack/split experts, join/split
# gate and up): their reverse is the same whatever the model holds
PER_TENSOR_OPS = {"MergeModulelist", "SplitModulelist", "Concatenate", "Chunk"}


def hub_layout(model: torch.nn.Module, keys: list[str], shapes: dict[str, tuple],
               dtypes: dict[str, torch.dtype]):
    """How transformers' own save_pretrained writes `keys` of a Hugging Face model: the Hub's
    layout (ConvertedSource's, reversed with transformers' `revert_weight_conversion`:
    Mixtral's stacked experts written one by one, older key names). Returns ({key: [(written
    key, shape)]}, convert(key, full tensor) -> {written key: tensor}), or None where that
    layout is the modules' own, or where a written tensor would need several of the model's
    at once (fxpar gathers one full tensor at a time): the modules' keys are written then,
    which from_pretrained reads as well."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    try:  # ops that read the model (a Transpose checking the parameter's shape: fxpar's
        # model holds this rank's shards by now) could write another layout than HF's
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
        mapping = getattr(model, "_weight_conversions", None) or \
            get_model_conversion_mapping(model, add_legacy=False)
        odd = {type(op).__name__ for c in mapping if isinstance(c, WeightConverter)
               for op in c.operations} - PER_TENSOR_OPS
    except Exception as e:  # noqa: BLE001 - another transformers: the modules' own keys
        odd = {f"{type(e).__name__}: {e}"}
    if odd:
        log.info("save_pretrained: %s's Hub layout needs %s; writing the modules' own keys "
                 "(from_pretrained reads them too)", type(model).__name__, sorted(odd))
        return None

    def convert(key, t):
        return revert_weight_conversion(model, {key: t})
    try:  # planned on meta tensors: names and shapes without data
        metas = {k: torch.empty(shapes[k], dtype=dtypes[k], device="meta") for k in keys}
        whole = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, metas).items()}
        per = {k: [(o, tuple(v.shape)) for o, v in convert(k, m).items()]
               for k, m in metas.items()}
    except Exception as e:  # noqa: BLE001 - another transformers: the modules' own keys
        log.warning("save_pretrained: transformers' reverse conversion for %s did not apply "
                    "(%s: %s): writing the modules' own keys", type(model).__name__,
                    type(e).__name__, e)
        return None
    if all(outs == [(k, shapes[k])] for k, outs in per.items()):
        return None
    if dict(o for outs in per.values() for o in outs) != whole:
        log.info("save_pretrained: %s's Hub layout combines several of its tensors into one; "
                 "writing the modules' own keys (from_pretrained reads them too)",
                 type(model).__name__)
        return None
    return per, convert


def save_pretrained(model, directory, keys: list[str], shapes: dict[str, tuple],
                    dtypes: dict[str, torch.dtype], full_tensor, rank: int, world: int,
                    max_shard_bytes: int = SHARD_BYTES) -> str:
    """Write `keys` as safetensors files (+ index when several) in `directory`.
    `full_tensor(key, dst)` is a collective every rank calls in the same key order; it
    returns the full CPU tensor on rank `dst` (None elsewhere). File i is written by rank
    i % world, so a rank holds at most one file's tensors at a time."""
    os.makedirs(directory, exist_ok=True)
    if rank == 0:  # an earlier save's files would shadow these (from_pretrained prefers a
        for f in os.listdir(directory):  # model.safetensors, FileSource the index)
            if f.startswith("model") and (f.endswith(".safetensors") or
                                          f == "model.safetensors.index.json"):
                os.remove(os.path.join(directory, f))
    if world > 1:
        dist.barrier()
    hub = hub_layout(model, keys, shapes, dtypes)  # what transformers' own save writes
    written = hub[0] if hub else {k: [(k, shapes[k])] for k in keys}
    sizes = [(k, sum(math.prod(s) for _, s in written[k]) * dtypes[k].itemsize) for k in keys]
    files = plan_shards(sizes, max_shard_bytes)
    n = len(files)
    names = ["model.safetensors"] if n == 1 else [
        f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for i, (fname, fkeys) in enumerate(zip(names, files)):
        dst = i % world
        tensors, ptrs = {}, set()
        for k in fkeys:
            t = full_tensor(k, dst)
            if rank != dst:
                continue
            # tied names written apart, and the experts split out of one stacked tensor,
            # must not share memory in the file
            # (the same conversion ran on every rank on meta tensors in hub_layout: it is
            # not expected to fail here; if it did, this rank's exception ends the job
            # through its launcher, as any rank's uncaught error does)
            parts = hub[1](k, t.contiguous()) if hub else {k: t}
            for out, v in parts.items():
                v = v.contiguous()
                store = v.untyped_storage().data_ptr()
                tensors[out] = v.clone() if len(parts) > 1 or store in ptrs else v
                ptrs.add(store)
        if rank == dst:
            save_file(tensors, os.path.join(directory, fname), metadata={"format": "pt"})
        del tensors
    if rank == 0:
        if n > 1:
            index = {"metadata": {"total_size": sum(s for _, s in sizes)},
                     "weight_map": {out: names[i] for i, fk in enumerate(files) for k in fk
                                    for out, _ in written[k]}}
            with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)
    if world > 1:
        dist.barrier()
    return str(directory)


# --- where each tensor of a model comes from ----------------------------------------------

class ModelWeights:
    """For each parameter/buffer name of `model`: the source and key to read it from.
    weights=PATH: every parameter and persistent buffer from the file (through any of its
    tied names), non-persistent buffers from the model (or its init where they are meta);
    weights=None: real tensors from the model, meta ones from the modules' init."""

    def __init__(self, model: torch.nn.Module, path=None):
        self.model, self.path = model, path
        self.file = FileSource(path) if path is not None else None
        self._converted: ConvertedSource | None | bool = False  # built on the first locate
        state = model.state_dict(keep_vars=True)  # parameters and persistent buffers
        self.hooked: HookedSource | None = None  # a model whose hooks compute its entries
        meta = {n: torch.empty(t.shape, dtype=t.dtype, device="meta")
                for n, t in model_state.own_tensors(model).items()}
        if self.file is not None and not model_state.is_plain(model, meta):
            with model_state.holding(model, meta), torch.no_grad():
                stand_in = dict(model.state_dict(keep_vars=True))
            self.hooked = HookedSource(model, self.file, stand_in, path)
            state = model_state.own_tensors(model, persistent_only=True)
        self.persistent = {id(t) for t in state.values()}
        self.tensors = {**state, **dict(model.named_buffers(remove_duplicate=False))}
        self.real = TensorSource({k: t for k, t in self.tensors.items() if not t.is_meta})
        self.init = InitSource(model)
        self.aliases: dict[int, list[str]] = {}
        for k, t in self.tensors.items():
            self.aliases.setdefault(id(t), []).append(k)

    def locate(self, name: str) -> tuple[Source, str]:
        """(source, key) for the model's tensor named `name`; CheckpointError naming the
        key when the weights file lacks it or holds another shape."""
        t = self.tensors[name]
        names = self.aliases[id(t)]
        if self.hooked is not None and id(t) in self.persistent:
            return self.hooked, names[0]
        if self.file is not None and id(t) in self.persistent:
            conv = self.converted()
            # transformers converts a key its mapping matches even where the file holds it
            # under the model's own name (Qwen3-VL-MoE's experts, stored transposed): as
            # from_pretrained, those come from the conversion; the rest as the file has them
            made = [k for k in names if conv is not None and k in conv.made_by]
            for k in made or [k for k in names if self.file.shape(k) is not None]:
                src = conv if made else self.file
                got = src.shape(k)
                if tuple(got) != tuple(t.shape):
                    raise CheckpointError(
                        f"weights {self.path!r}: {k!r} has shape {tuple(got)}"
                        + (" once transformers' conversion has built it from the file's "
                           f"{conv.sources_of(k)}" if made else "")
                        + f", the model's is {tuple(t.shape)}: the file was saved from a "
                        "differently configured model (check the config you built the "
                        "model from).")
                return src, k
            for k in names if conv is not None else ():  # renamed (e.g. a base model's keys)
                got = conv.shape(k)
                if got is not None and tuple(got) != tuple(t.shape):
                    raise CheckpointError(
                        f"weights {self.path!r}: {k!r} is stored as {conv.renamed[k]!r} with "
                        f"shape {tuple(got)}, the model's is {tuple(t.shape)}: the file was "
                        "saved from a differently configured model (check the config you "
                        "built the model from).")
                if got is not None:
                    return conv, k
            raise CheckpointError(
                f"weights {self.path!r} has no {' / '.join(repr(k) for k in names)} (keys as "
                "model.state_dict()): it was saved from a different model, or with other "
                "module names. Load the file saved from this architecture.")
        if not t.is_meta:
            return self.real, name
        return self.init, self.init_key(names)

    def check(self) -> None:
        """Locate every parameter and persistent buffer in the weights file now (shapes from
        its headers, a conversion planned on meta tensors): a missing key or another shape
        is a CheckpointError before the model is traced and compiled, not after."""
        if self.hooked is not None:
            self.hooked.check()
        elif self.file is not None:
            for name in self.model.state_dict(keep_vars=True):
                self.locate(name)

    def converted(self) -> ConvertedSource | None:
        """The file's keys converted as from_pretrained converts them (see ConvertedSource),
        planned once, at the first locate (on meta tensors: nothing read)."""
        if self._converted is False:
            self._converted = hf_conversion(self.model, self.file)
        return self._converted

    def release(self) -> None:
        """Drop what was made whole for reading: the last module initialised, the last
        tensors converted."""
        self.init.release()
        if self.hooked is not None:
            self.hooked.release()
        if self._converted:
            self._converted.release()

    def init_key(self, names: list[str]) -> str:
        return next((k for k in names if k in self.init.owner), names[0])


def unmeta(model: torch.nn.Module, device) -> dict[str, tuple]:
    """Swap every meta parameter/buffer for an empty (0-element) tensor on `device`, each
    tied alias for the same new tensor (a meta tensor's .data cannot be re-pointed at real
    memory). Returns the full shapes by name; the runtime then fills in each rank's part."""
    shapes, new = {}, {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for store, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for attr, t in list(store.items()):
                if t is None or not t.is_meta:
                    continue
                key = f"{mname}.{attr}" if mname else attr
                shapes[key] = tuple(t.shape)
                if id(t) not in new:
                    empty = torch.empty(0, dtype=t.dtype, device=device)
                    new[id(t)] = (torch.nn.Parameter(empty, requires_grad=t.requires_grad)
                                  if is_param else empty, t)
                store[attr] = new[id(t)][0]
    return shapes
