"""Plan-independent training checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is a directory: DCP's files (`.metadata` + one `.distcp` file per writing rank)
and `fxpar.json`. What is in it does not depend on the plan that wrote it:
- `model.<key>`: every entry of `model.state_dict()` (parameters and buffers) in its FULL,
  unsharded shape;
- `optim.state.<param name>.<state key>` (e.g. `optim.state.fc1.weight.exp_avg`): the
  optimizer state per parameter, in the parameter's full shape (0-dim values such as Adam's
  `step` as they are). This is torch's own "FQN-keyed" optimizer convention
  (`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`, flattened as DCP
  flattens nested dicts), so a checkpoint written at dp=2 x pp=2 loads at tp=2 x dp=2, at
  ZeRO-2, or into one plain process (`load_plain`);
- `rng.cpu.<rank>` / `rng.cuda.<rank>`: each rank's generator states (dropout continues with
  the same masks);
- `fxpar.json`: the step counter (`pm.step_count`: global batches consumed = the data
  position), the optimizer's hyperparameters per parameter name (lr, betas, ... as param
  groups), the fp16 loss scaler's state, the user's `extra` dict, the writing plan, and the
  plan's `settings` that change a step's numbers (`training_settings`: max_grad_norm,
  precision, batch_stats), which `load` checks so that a resume continues the same run.
  An LR scheduler is the user's object (as in torch): its `state_dict()` goes in `extra`.
  Written last, by rank 0, after every rank's data is on disk: a save that crashed midway
  leaves no `fxpar.json` and is refused on load as incomplete.

How sharded state becomes full tensors (save) and back (load). fxpar holds parameters in its
own layouts: tensor-parallel slices, some interleaved (a fused QKV weight: each rank's slice
holds its share of q, k and v; runtime/tp_slices.py), ZeRO flat bucket shards (the optimizer's
parameters are 1/dp slices of padded flat buckets; runtime/zero.py), pipeline stages (a rank
holds only its stages' weights). DCP could write a rank's piece as a chunk of the full
tensor (a DTensor/ShardedTensor with offsets) only where that piece is a plain contiguous
block of it; a flat bucket slice spans several parameters and an interleaved QKV slice is
three blocks. So each rank gathers its pieces to full tensors (tp: all-gather over the tp
group and un-interleave; ZeRO: all-gather of the flat shards over the dp group, then cut per
parameter) and DCP's save planner deduplicates the replicated copies (one rank writes each
key). That costs one full copy of the rank's stage's state in host/device memory during a
save, which is fine at the sizes fxpar targets on gloo/a few GPUs; a chunked DTensor path for
plain row/column shards would avoid it at scale. A pipeline rank writes only the weights its
stages hold (its copies of other stages' weights are stale). Loading is the inverse: every
rank reads the full tensors it needs and keeps its slice.

Safety: loading never unpickles the checkpoint's objects. Only tensors go through DCP (never
its pickled "bytes" items); DCP reads tensor data with `torch.load(weights_only=True)`, and
its `.metadata` file, which DCP itself reads with plain `pickle.load`, is read here by an
unpickler that resolves only DCP's metadata classes (`_SafeReader`). Everything else is JSON.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pickle
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from fxpar.core.errors import CheckpointError
from fxpar.runtime import model_state
from fxpar.runtime import tp_slices as rtp

FORMAT = 1
META_FILE = "fxpar.json"

log = logging.getLogger(__name__)

# --- never unpickle untrusted data ------------------------------------------------------

_SAFE_GLOBALS = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "BytesStorageMetadata")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Python's documented "restricting globals" unpickler: DCP's metadata dataclasses,
    torch.Size and dtypes resolve, any other global (a function a crafted file would call)
    is refused."""

    def find_class(self, module, name):
        if (module, name) in _SAFE_GLOBALS or (module == "torch" and isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        raise CheckpointError(f"the checkpoint's DCP .metadata refers to {module}.{name}, which "
                              "is not part of DCP's metadata: refusing to load it (it could run "
                              "code). Only load checkpoints written by fxpar/DCP.")


class _SafeReader(FileSystemReader):
    """DCP's FileSystemReader with the `.metadata` read by _MetadataUnpickler (DCP itself uses
    pickle.load; tensor data it already reads with torch.load(weights_only=True))."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp_md.Metadata):
            raise CheckpointError(f"{path} is not DCP metadata ({type(metadata).__name__}).")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# --- JSON for everything that is not a tensor -------------------------------------------

def _encode(obj, prefix: str, tensors: dict, where: str):
    """obj as JSON; tensors inside go to `tensors` (saved by DCP) as {"__tensor__": key}."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise CheckpointError(f"{where}: key {bad[0]!r} is not a string; checkpoints store "
                                  "dicts as JSON objects.")
        return {k: _encode(v, f"{prefix}.{k}", tensors, f"{where}[{k!r}]")
                for k, v in obj.items()}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{prefix}.{i}", tensors, f"{where}[{i}]")
                              for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{prefix}.{i}", tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(
        f"{where} is a {type(obj).__name__}: a checkpoint holds tensors and JSON values (dict, "
        "list, tuple, str, int, float, bool, None) only, never pickled objects, so that loading "
        "it cannot run code. Convert it (e.g. a sampler's state to a dict of ints).")


def _json_only(obj, where: str):
    """obj as JSON where no tensor may hide (hyperparameters, non-tensor optimizer state)."""
    found: dict = {}
    enc = _encode(obj, "", found, where)
    if found:
        raise CheckpointError(f"{where} holds a tensor of shape {tuple(next(iter(found.values())).shape)}"
                              "; only one-element tensors are supported there.")
    return enc


def _tensor_keys(enc) -> list[str]:
    if isinstance(enc, dict):
        if set(enc) == {"__tensor__"}:
            return [enc["__tensor__"]]
        return [k for v in enc.values() for k in _tensor_keys(v)]
    if isinstance(enc, list):
        return [k for v in enc for k in _tensor_keys(v)]
    return []


def _decode(enc, tensors: dict):
    if isinstance(enc, dict):
        if set(enc) == {"__tensor__"}:
            return tensors[enc["__tensor__"]]
        if set(enc) == {"__tuple__"}:
            return tuple(_decode(v, tensors) for v in enc["__tuple__"])
        return {k: _decode(v, tensors) for k, v in enc.items()}
    if isinstance(enc, list):
        return [_decode(v, tensors) for v in enc]
    return enc


# --- where each parameter lives on this rank --------------------------------------------

def _full_shape(pm, i) -> torch.Size:
    return torch.Size(pm.param_shapes[i])


def _to_full(pm, i, local):
    splits = pm.splits_of(i)  # (a tp layout, an expert weight's ep split)
    return rtp.full_of(local, splits) if splits else local.detach().clone()


def _to_local(pm, i, full):
    splits = pm.splits_of(i)
    return rtp.local_of(full, splits) if splits else full


def _slots(pm):
    """The optimizer's tensors: [(tensor, [(param index, offset, numel)], dp-sharded)].
    Without ZeRO each is one (tp-local) parameter; with ZeRO a flat bucket shard."""
    opt = pm.optimizer
    if opt is None:
        return []
    host = pm.host_optimizer  # Plan.offload_optimizer: the optimizer steps host copies
    master = host.master_of if host is not None else (lambda t: t)
    if pm.sharded_optimizer is not None:
        z = pm.sharded_optimizer
        return [(master(shard), z.bucket_layout(k), True) for k, shard in enumerate(z.shards)]
    index = {id(master(p)): i for i, p in enumerate(pm.params)}
    elsewhere = _held_elsewhere(pm)
    out = []
    for g in opt.param_groups:
        for t in g["params"]:
            if id(t) in elsewhere:  # (another ep rank's expert: its state is that rank's)
                continue
            if id(t) not in index:
                raise CheckpointError(
                    f"the optimizer holds a tensor of shape {tuple(t.shape)} that is not a "
                    "parameter of the compiled model, so it cannot be saved by name. Build the "
                    "optimizer over the model's parameters (pass a factory).")
            out.append((t, [(index[id(t)], 0, t.numel())], False))
    return out


def _held(pm):
    """Which model.state_dict() entries this rank holds up to date: all of them, except under
    pipeline parallelism (only its stages' weights and buffers)."""
    r = pm.pipeline_runner
    state = pm.model.state_dict(keep_vars=True)
    if r is None or pm.plan.pp == 1:
        return state
    return {k: state[k] for k, stages in pm.state_stages(state).items()
            if any(r.rank_of(s) == r.rank for s in stages)}


def _names(pm):
    """Per parameter index, the name of the parameter this rank holds there (under ep,
    a listed experts' slot holds this rank's expert: trainer.held_names)."""
    return pm.held_names


def _held_elsewhere(pm) -> set[int]:
    """ids of the model's parameters this rank does not hold (under ep, the other ranks'
    experts of an nn.ModuleList): saved and loaded by the ranks holding them."""
    held = {id(p) for p in pm.params}
    return {i for i in pm.param_index_of if i not in held}


# --- save -------------------------------------------------------------------------------

def _model_state(pm) -> dict[str, torch.Tensor]:
    """{"model.<key>": full tensor} for the entries this rank holds (collective over tp / dp
    for tp slices and ZeRO-3 shards; under ep a listed expert is its rank's alone)."""
    if not pm.state_is_plain():  # the model's hooks make its entries: from whole tensors
        return {f"model.{k}": v for k, v in pm.full_state_dict().items()}  # (DCP dedups)
    # id(param) -> full weight (collective over the tp / dp / ep groups); under ep each rank
    # writes its own listed experts (DCP writes a key several ranks give once)
    full, elsewhere = pm.full_params(every_expert=False), _held_elsewhere(pm)
    return {f"model.{k}": (full[id(v)] if id(v) in full else v.detach())
            for k, v in _held(pm).items() if id(v) not in elsewhere}


def _optim_state(pm) -> tuple[dict[str, torch.Tensor], dict]:
    """{"optim.state.<param>.<key>": full tensor}, and the non-tensor state as JSON."""
    opt = pm.optimizer
    names = _names(pm)
    out, other = {}, {}
    for t, members, sharded in _slots(pm):
        for key, v in opt.state.get(t, {}).items():
            if not isinstance(v, torch.Tensor):
                for i, _, _ in members:
                    other.setdefault(names[i], {})[key] = _json_only(v, f"optimizer state {key}")
                continue
            if v.dim() == 0 and t.dim() != 0:  # a scalar per parameter (Adam's step)
                for i, _, _ in members:
                    out[f"optim.state.{names[i]}.{key}"] = v.detach()
                continue
            if v.shape != t.shape:
                raise CheckpointError(
                    f"optimizer state {key!r} of {names[members[0][0]]} has shape "
                    f"{tuple(v.shape)}, not its parameter's {tuple(t.shape)}: only elementwise "
                    "optimizer state (SGD, Adam, AdamW, ...) can be saved plan-independently.")
            # (offloaded state is on the host: to the device before the tp / dp gathers)
            flat = v.detach().reshape(-1).to(pm.world.device)
            if sharded:  # (the bucket's group: dp, HSDP's shard group, ep's "edp")
                flat = pm.sharded_optimizer.gather(flat, members[0][0])
            for i, off, n in members:
                local = flat[off:off + n].view(pm.local_shapes[i])
                out[f"optim.state.{names[i]}.{key}"] = _to_full(pm, i, local)
    return out, other


def _param_groups(pm) -> list[dict]:
    """The optimizer's hyperparameters as param groups naming their parameters."""
    opt = pm.optimizer
    if opt is None:
        return []
    names = _names(pm)
    slots = {id(t): members for t, members, _ in _slots(pm)}
    groups = []
    for gi, g in enumerate(opt.param_groups):
        hyper = {k: _json_only(v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v,
                               f"optimizer param_groups[{gi}][{k!r}]")
                 for k, v in g.items() if k != "params"}
        groups.append({"hyper": hyper, "params": [names[i] for t in g["params"]
                                                  for i, _, _ in slots.get(id(t), ())]})
    return groups


def _rng_state(pm) -> dict[str, torch.Tensor]:
    r = pm.world.rank
    out = {f"rng.cpu.{r}": torch.get_rng_state()}
    if pm.world.device.type == "cuda":
        out[f"rng.cuda.{r}"] = torch.cuda.get_rng_state(pm.world.device)
    return out


def save(pm, path: str, extra: dict | None = None) -> str:
    """Write pm's model, optimizer, loss-scaler, step counter, RNG and `extra` to the directory
    `path` (collective: every rank calls it with the same path). Returns path."""
    path = begin_save(path)
    tensors = _model_state(pm)
    optim_tensors, optim_other = _optim_state(pm)
    tensors.update(optim_tensors)
    tensors.update(_rng_state(pm))
    scaler = getattr(pm, "scaler", None)
    scaler_enc = _encode(scaler.state_dict(), "scaler", tensors, "pm.scaler.state_dict()") \
        if scaler is not None else None
    extra_enc = _encode(dict(extra or {}), "extra", tensors, "extra")
    return write(path, tensors, {"param_groups": _param_groups(pm), "other": optim_other,
                                 "optimizer": type(pm.optimizer).__name__
                                 if pm.optimizer is not None else None},
                 pm.plan, int(getattr(pm, "step_count", 0)), scaler_enc, extra_enc)


def begin_save(path) -> str:
    """Rank 0 makes the directory and removes an older save's fxpar.json (the checkpoint is
    incomplete until this one's is written); every rank waits for it."""
    path = os.fspath(path)
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        if os.path.exists(os.path.join(path, META_FILE)):  # overwriting: incomplete until done
            os.remove(os.path.join(path, META_FILE))
    if _distributed():
        dist.barrier()
    return path


def write(path: str, tensors: dict, info: dict, plan, step_count: int, scaler_enc,
          extra_enc) -> str:
    """This rank's `tensors` through DCP (a key several ranks give is written once), then
    rank 0's fxpar.json from every rank's `info` (its optimizer's param groups by parameter
    name, its non-tensor state, its optimizer's type). Collective over the whole job."""
    distributed = _distributed()
    world = dist.get_world_size() if distributed else 1
    per_rank = [info]
    if distributed:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, info)  # between this job's own ranks (trusted)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    with _quiet(distributed):
        dcp.save(tensors, storage_writer=FileSystemWriter(path, overwrite=True),
                 no_dist=not distributed)
    if not distributed or dist.get_rank() == 0:
        groups, seen, other = [], set(), {}
        for d in per_rank:  # pipeline ranks each know their stages' groups; dp copies repeat
            for g in d["param_groups"]:
                key = json.dumps(g, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    groups.append(g)
            other.update(d["other"])
        meta = {"format": FORMAT, "step_count": step_count, "world_size": world,
                "plan": dataclasses.asdict(plan),
                "optimizer": next((d["optimizer"] for d in per_rank if d["optimizer"]), None),
                "param_groups": groups, "optim_other": other, "scaler": scaler_enc,
                "settings": training_settings(plan), "extra": extra_enc,
                "torch": torch.__version__}
        tmp = os.path.join(path, META_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, os.path.join(path, META_FILE))
    if distributed:
        dist.barrier()
    return path


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


# --- load -------------------------------------------------------------------------------

def read_meta(path: str):
    path = os.fspath(path)
    mpath = os.path.join(path, META_FILE)
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r}: not a directory. Pass the directory "
                              "pm.save(path) wrote.")
    if not os.path.exists(mpath):
        what = "an incomplete save (it crashed before finishing)" if os.path.exists(
            os.path.join(path, ".metadata")) or any(f.endswith(".distcp")
                                                   for f in os.listdir(path)) else "not one"
        raise CheckpointError(f"{path!r} is not a complete fxpar checkpoint ({META_FILE} is "
                              f"missing): {what}. Load an earlier checkpoint.")
    with open(mpath) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{mpath} has format {meta.get('format')!r}; this fxpar reads "
                              f"format {FORMAT}.")
    reader = _SafeReader(path)
    return meta, reader, reader.read_metadata().state_dict_metadata


@contextlib.contextmanager
def _quiet(distributed):
    """DCP warns that it 'assumes' one process when there is no process group (we asked for
    that), and about overwriting (pm.save replaces a checkpoint on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # we clear
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_tensors(path, reader, md, keys, distributed) -> dict[str, torch.Tensor]:
    """The tensors `keys` from the checkpoint (collective when distributed)."""
    out = {}
    for k in keys:
        m = md.get(k)
        if not isinstance(m, dcp_md.TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path!r}: entry {k!r} is "
                                  f"{'missing' if m is None else 'not a tensor'}.")
        out[k] = torch.empty(m.size, dtype=m.properties.dtype)
    with _quiet(distributed):
        dcp.load(out, storage_reader=reader, no_dist=not distributed)
    return out


def _state_keys(md, name) -> list[str]:
    prefix = f"optim.state.{name}."
    return sorted(k[len(prefix):] for k in md
                  if k.startswith(prefix) and "." not in k[len(prefix):])


def training_settings(plan) -> dict:
    """The plan's settings that change what a step computes, not only how: a run resumed
    under others is not the run that was saved. Parallel degrees, ZeRO, schedules, remat and
    code generation are not among them (resuming under another plan is supported), nor the
    microbatch count where batch_stats="whole" (a step is then one step on the whole batch)."""
    m = plan.microbatches
    stats = "whole" if plan.batch_stats == "whole" or m == 1 else \
        f"microbatch (microbatches={m})"
    return {"max_grad_norm": plan.max_grad_norm, "precision": plan.precision,
            "batch_stats": stats,
            "comm_quantization": plan.comm_quantization,
            "grad_compression": plan.grad_compression if plan.grad_compression == "none"
            else f"{plan.grad_compression} (compression_warmup={plan.compression_warmup})"}


def check_settings(pm, meta: dict, path, allow_changed: bool) -> None:
    """Refuse to resume under compiled settings other than the checkpoint's (they cannot be
    restored without recompiling); with `allow_changed`, warn instead."""
    saved = meta.get("settings")
    if saved is None:
        log.warning("checkpoint %r records no training settings (written by an older fxpar): "
                    "cannot check that this plan's max_grad_norm, precision and batch_stats "
                    "are the ones it was trained with.", os.fspath(path))
        return
    now = training_settings(pm.plan)
    diffs = [f"{k}: checkpoint {saved[k]!r}, this plan {v!r}"
             for k, v in now.items() if k in saved and saved[k] != v]
    if not diffs:
        return
    if not allow_changed:
        raise CheckpointError(
            f"checkpoint {os.fspath(path)!r} was trained with other settings than this plan's, "
            f"so resuming would not continue the same run: {'; '.join(diffs)}. Pass the "
            "checkpoint's settings to parallelize(plan=...), or load anyway with "
            "pm.load(path, allow_changed_settings=True).")
    log.warning("checkpoint %r: loading under changed settings (allow_changed_settings=True); "
                "the run continues differently than the saved one would: %s",
                os.fspath(path), "; ".join(diffs))


def load(pm, path: str, allow_changed_settings: bool = False) -> dict:
    """Restore what `save` wrote into pm, whatever plan wrote it (collective). Returns the
    `extra` dict given to save. Restored from the checkpoint: weights, optimizer state and
    hyperparameters (every param group key, as torch's load_state_dict does), the fp16 loss
    scaler's state, step_count, RNG states. The compiled settings (`training_settings`) must
    match the plan's: otherwise CheckpointError, or a warning with allow_changed_settings."""
    meta, reader, md = read_meta(path)
    check_settings(pm, meta, path, allow_changed_settings)
    distributed = pm.world.size > 1
    names = _names(pm)
    plain = pm.state_is_plain()  # else: keys and whole shapes as the model's hooks make them
    state = pm.model.state_dict(keep_vars=True) if plain else pm.stand_in_state()
    pidx, uidx = {id(p): i for i, p in enumerate(pm.params)}, pm.param_index_of
    # what to read: every model entry; optimizer state of this rank's parameters; RNG
    check_entries(path, md, meta, {k: _full_shape(pm, uidx[id(v)]) if id(v) in uidx
                                   else v.shape for k, v in state.items()}, pm.optimizer)
    elsewhere = _held_elsewhere(pm)  # (another ep rank's experts: that rank loads them)
    state = {k: v for k, v in state.items() if id(v) not in elsewhere}
    slots = _slots(pm)
    okeys = {i: _state_keys(md, names[i]) for _, members, _ in slots for i, _, _ in members}
    need = pm.needed_params()  # (other pipeline stages' weights: not read here)
    state = {k: v for k, v in state.items() if id(v) not in pidx or pidx[id(v)] in need}
    keys = [f"model.{k}" for k in state] + [f"optim.state.{names[i]}.{s}"
                                             for i, ss in okeys.items() for s in ss]
    saved_world = meta["world_size"]
    src = pm.world.rank if pm.world.rank < saved_world else pm.world.rank % saved_world
    rng_keys = [k for k in (f"rng.cpu.{src}", f"rng.cuda.{src}") if k in md and (
        k.startswith("rng.cpu") or pm.world.device.type == "cuda")]
    scaler = getattr(pm, "scaler", None)
    enc_keys = _tensor_keys(meta.get("extra")) + (
        _tensor_keys(meta.get("scaler")) if scaler is not None else [])
    got = read_tensors(path, reader, md, keys + rng_keys + enc_keys, distributed)
    with torch.no_grad():
        if plain:
            _load_model(pm, state, got)
        else:
            _load_model_whole(pm, {k: got[f"model.{k}"] for k in state}, path)
    if pm.host_optimizer is not None:  # the masters are what the optimizer steps
        pm.host_optimizer.pull()
    if pm.optimizer is not None:
        _load_optimizer(pm, slots, okeys, got, meta, path)
    if pm.onebit is not None:  # its carried errors are not saved: they restart at zero
        pm.onebit.reset()
    if scaler is not None and meta.get("scaler") is not None:
        scaler.load_state_dict(_decode(meta["scaler"], got))
    pm.step_count = int(meta["step_count"])
    for k in rng_keys:
        if k.startswith("rng.cpu"):
            torch.set_rng_state(got[k])
        else:
            torch.cuda.set_rng_state(got[k], pm.world.device)
    return _decode(meta.get("extra") or {}, got)


def check_entries(path, md, meta: dict, shapes: dict, optimizer) -> None:
    """Refuse a checkpoint without `model.<key>` in each of `shapes` (key -> the model's
    full shape) or holding another optimizer type's state than `optimizer`'s."""
    missing = [k for k in shapes if f"model.{k}" not in md]
    if missing:
        raise CheckpointError(
            f"checkpoint {path!r} has no {missing[:3]} (of {len(missing)} missing entries): it "
            "was saved from a different model. Load it into the model it was saved from.")
    for k, want in shapes.items():
        got = md[f"model.{k}"].size
        if tuple(got) != tuple(want):
            raise CheckpointError(f"checkpoint {path!r}: {k} has shape {tuple(got)}, the model's "
                                  f"is {tuple(want)}: saved from a differently configured model.")
    saved_opt = meta.get("optimizer")
    if optimizer is not None and saved_opt not in (None, type(optimizer).__name__):
        raise CheckpointError(f"checkpoint {path!r} holds {saved_opt} state, but this model's "
                              f"optimizer is {type(optimizer).__name__}: build the same "
                              "optimizer type to resume (or use load_plain for the weights).")


def restored_group(group: dict, hyper: dict | None, params: list[int]) -> dict:
    """A param group of torch's optimizer state dict: `group`'s entries with the saved
    hyperparameters `hyper` (JSON, as save wrote them) in their current types, over the
    state-dict indices `params`."""
    new = dict(group)
    for k, v in (hyper or {}).items():
        v, cur = _decode(v, {}), new.get(k)
        new[k] = torch.tensor(v, dtype=cur.dtype, device=cur.device) if isinstance(
            cur, torch.Tensor) else (tuple(v) if isinstance(cur, tuple) else v)
    new["params"] = params
    return new


def _load_model(pm, state, got):
    pidx = {id(p): i for i, p in enumerate(pm.params)}
    z, elsewhere = pm.sharded_optimizer, _held_elsewhere(pm)
    for k, v in state.items():  # (this rank's stages' weights, every buffer)
        if id(v) in elsewhere:
            continue
        full = got[f"model.{k}"].to(v.device)
        if id(v) not in pidx:  # a buffer
            v.copy_(full)
            continue
        i = pidx[id(v)]
        local = _to_local(pm, i, full)
        if z is not None and z.shard_params:  # ZeRO-3: the graph reads this rank's flat shard
            z.param_shards[i].copy_(z.cut([local], i))
        else:
            v.data.copy_(local)
    if z is not None and not z.shard_params:  # ZeRO 1/2: the optimizer steps flat shards
        for shard, members, idx in zip(z.shards, z.buckets, z.bucket_indices):
            shard.copy_(z.cut(members, idx[0]))


def _load_model_whole(pm, saved: dict[str, torch.Tensor], path: str):
    """A model whose state dict its own hooks compute: its load hooks turn the saved entries
    back into its whole tensors, which are then cut to this rank's pieces."""
    meta = pm.whole_meta()
    names = model_state.own_tensors(pm.model, persistent_only=True)
    try:
        whole = model_state.whole_from_state_dict(
            pm.model, saved, {n: meta[n].shape for n in names},
            {n: meta[n].dtype for n in names}, "cpu")
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path!r} does not load into this model: {e}") from e
    pidx = {id(p): i for i, p in enumerate(pm.params)}
    need, first = pm.needed_params(), {}
    for n, t in names.items():  # each tensor once (tied names share it)
        if id(t) not in pidx or pidx[id(t)] in need:
            first.setdefault(id(t), n)
    _load_model(pm, {n: names[n] for n in first.values()},
                {f"model.{n}": whole[n] for n in first.values()})


def _load_optimizer(pm, slots, okeys, got, meta, path):
    names = _names(pm)
    opt = pm.optimizer
    index = {id(t): n for n, t in enumerate(t for g in opt.param_groups for t in g["params"])}
    state = {}
    for t, members, sharded in slots:
        keys = okeys[members[0][0]]
        if any(okeys[i] != keys for i, _, _ in members):
            raise CheckpointError(f"checkpoint {path!r}: parameters "
                                  f"{[names[i] for i, _, _ in members]} have different optimizer "
                                  "state entries; it was saved by a different optimizer.")
        entry = {}
        for key in keys:
            vals = [got[f"optim.state.{names[i]}.{key}"] for i, _, _ in members]
            if all(v.dim() == 0 for v in vals) and not all(
                    _full_shape(pm, i) == torch.Size([]) for i, _, _ in members):
                entry[key] = vals[0]  # a scalar per parameter (Adam's step)
                continue
            pieces = []
            for (i, _, _), v in zip(members, vals):
                if v.shape != _full_shape(pm, i):
                    raise CheckpointError(f"checkpoint {path!r}: optimizer state {key!r} of "
                                          f"{names[i]} has shape {tuple(v.shape)}, the parameter "
                                          f"{tuple(_full_shape(pm, i))}.")
                pieces.append(_to_local(pm, i, v).reshape(-1))
            flat = torch.cat(pieces)
            if sharded:
                flat = pm.sharded_optimizer.cut([flat], members[0][0])
            entry[key] = flat.view(t.shape)
        entry.update({k: _decode(v, {}) for i, _, _ in members
                      for k, v in meta.get("optim_other", {}).get(names[i], {}).items()})
        if entry:
            state[index[id(t)]] = entry
    saved_hyper = {n: g["hyper"] for g in meta.get("param_groups", []) for n in g["params"]}
    groups = []
    for gi, g in enumerate(opt.param_groups):
        fqns = [names[i] for t in g["params"] for i, _, _ in
                next((m for tt, m, _ in slots if tt is t), ())]
        hypers = [saved_hyper[n] for n in fqns if n in saved_hyper]
        if any(h != hypers[0] for h in hypers):
            raise CheckpointError(
                f"checkpoint {path!r}: the parameters of param group {gi} had different "
                "hyperparameters when saved (several param groups), which this optimizer's one "
                "group cannot hold. Under ZeRO every bucket is one group: save and load with "
                "one set of hyperparameters, or load without ZeRO.")
        groups.append(restored_group(g, hypers[0] if hypers else None,
                                     [index[id(t)] for t in g["params"]]))
    _log_restored_hyper(opt.param_groups, groups, path)
    opt.load_state_dict({"state": state, "param_groups": groups})


def _log_restored_hyper(current: list[dict], restored: list[dict], path) -> None:
    """Say which hyperparameters the checkpoint replaced (as torch's load_state_dict does,
    silently there): one set after pm.load wins, e.g. to change the lr on resuming."""
    changed = sorted({f"{k} {g[k]!r} -> {n[k]!r}" for g, n in zip(current, restored)
                      for k in g if k != "params" and k in n and _differs(g[k], n[k])})
    if changed:
        log.info("checkpoint %r: optimizer hyperparameters restored from it: %s (set them "
                 "after pm.load to change them)", os.fspath(path), ", ".join(changed))


def _differs(a, b) -> bool:
    a, b = (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in (a, b))
    return a != b


# --- into plain PyTorch -----------------------------------------------------------------

def load_plain(path: str, model: torch.nn.Module | None = None,
               optimizer: torch.optim.Optimizer | None = None):
    """Read an fxpar checkpoint in ONE plain process (no process group, no fxpar model):
    returns (model_state, optim_state). model_state is `model.state_dict()`-shaped;
    optim_state is torch's FQN-keyed optimizer state dict ({"state": {param name: {...}},
    "param_groups": [{..., "params": [param names]}]}, as
    torch.distributed.checkpoint.state_dict.get_optimizer_state_dict returns). With `model`
    (and `optimizer`, built over model.parameters() as usual) given, loads them in place:
    `model.load_state_dict(model_state)` and `optimizer.load_state_dict(...)` with the names
    mapped to the optimizer's parameter order. Never unpickles anything."""
    meta, reader, md = read_meta(path)
    mkeys = [k for k in md if k.startswith("model.")]
    okeys = [k for k in md if k.startswith("optim.state.")]
    got = read_tensors(path, reader, md, mkeys + okeys, distributed=False)
    model_state = {k[len("model."):]: got[k] for k in mkeys}
    ostate: dict[str, dict] = {}
    for k in okeys:
        name, _, key = k[len("optim.state."):].rpartition(".")
        ostate.setdefault(name, {})[key] = got[k]
    for name, d in meta.get("optim_other", {}).items():
        ostate.setdefault(name, {}).update({k: _decode(v, {}) for k, v in d.items()})
    groups = []
    for g in meta.get("param_groups", []):
        hyper = _decode(g["hyper"], {})
        same = next((h for h in groups if h["_hyper"] == hyper), None)
        if same is None:
            groups.append({"_hyper": hyper, "params": list(g["params"])})
        else:
            same["params"] += [n for n in g["params"] if n not in same["params"]]
    optim_state = {"state": ostate,
                   "param_groups": [{**h["_hyper"], "params": h["params"]} for h in groups]}
    if model is not None:
        model.load_state_dict(model_state)
    if optimizer is not None:
        if model is None:
            raise CheckpointError("load_plain(optimizer=...) needs the model too: the optimizer "
                                  "state is keyed by parameter names.")
        optimizer.load_state_dict(to_optimizer_state_dict(optim_state, model, optimizer))
    return model_state, optim_state


def to_optimizer_state_dict(optim_state: dict, model: torch.nn.Module,
                            optimizer: torch.optim.Optimizer) -> dict:
    """An FQN-keyed optimizer state (load_plain's) as `optimizer.state_dict()` numbers it:
    parameters by position in the optimizer's param groups."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    hyper_of = {n: {k: v for k, v in g.items() if k != "params"}
                for g in optim_state["param_groups"] for n in g["params"]}
    state, groups, pos = {}, [], 0
    for g in optimizer.param_groups:
        ids = []
        for p in g["params"]:
            n = name_of.get(id(p))
            if n is None:
                raise CheckpointError("the optimizer holds a tensor that is not a parameter of "
                                      "`model`; build it over model.parameters().")
            if n in optim_state["state"]:
                state[pos] = optim_state["state"][n]
            ids.append(pos)
            pos += 1
        first = name_of[id(g["params"][0])] if g["params"] else None
        hyper = {k: (tuple(v) if isinstance(g.get(k), tuple) else v)
                 for k, v in hyper_of.get(first, {}).items()}
        groups.append({**{k: v for k, v in g.items() if k != "params"}, **hyper, "params": ids})
    return {"state": state, "param_groups": groups}
