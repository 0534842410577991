"""The model's own state-dict machinery, run on whole tensors.

A rank holds the model's tensors as this plan's pieces: tensor-parallel slices, ZeRO-3
shards, stale copies of other pipeline stages' weights. A state dict built from those by
tensor identity is right only while every entry of `model.state_dict()` is one of the
model's own tensors. Modules may compute their entries in hooks instead (torchtitan's fused
QKV writes `wq/wk/wv` cut from `wqkv`; quantization wrappers pack weights; an overridden
`_save_to_state_dict`): those hooks read whatever the module holds, so on a sharded module
they write a slice, a stale copy or fail. Here the whole tensors are put into the module for
the length of one `state_dict()` (or `load_state_dict()`) call, so the model's own code runs
on exactly what single-process training holds, and the rank's pieces are put back after.

The swap replaces entries of the modules' `_parameters` / `_buffers` dicts (what
`torch.func.functional_call` does through a private helper), not `.data`: a meta-device
stand-in (a pipeline rank's other stages) cannot take a real tensor's data.
"""
from __future__ import annotations

import contextlib

import torch


def own_tensors(model: torch.nn.Module, persistent_only: bool = False
                ) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under each of its names (tied names included);
    `persistent_only`: without the buffers a state dict leaves out."""
    out = dict(model.named_parameters(remove_duplicate=False))
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, b in mod._buffers.items():
            if b is not None and not (persistent_only and attr in mod._non_persistent_buffers_set):
                out[f"{mod_name}.{attr}" if mod_name else attr] = b
    return out


def is_plain(model: torch.nn.Module, whole_meta: dict[str, torch.Tensor]) -> bool:
    """Whether every entry of `model.state_dict(keep_vars=True)` is one of the model's own
    tensors: then a state dict can be assembled tensor by tensor; otherwise a hook or an
    override makes new tensors from what the module holds. Asked of meta-device stand-ins
    of the whole tensors (`whole_meta`), so no hook runs on a rank's shards."""
    try:
        with holding(model, whole_meta) as held:
            state = model.state_dict(keep_vars=True)
    except Exception:  # a hook that needs real values: it computes, so not plain
        return False
    ids = {id(t) for t in held.values()}
    return all(id(v) in ids for v in state.values())


@contextlib.contextmanager
def holding(model: torch.nn.Module, whole: dict[str, torch.Tensor]):
    """Inside: the module holds `whole[name]` for each of its parameter and buffer names
    (as a Parameter where it held one; tied names get one shared tensor). Yields
    {name: the tensor the module holds now}."""
    swapped, made, held = [], {}, {}
    try:
        for kind in ("_parameters", "_buffers"):
            for mod_name, mod in model.named_modules(remove_duplicate=False):
                slots = getattr(mod, kind)
                for attr, old in list(slots.items()):
                    name = f"{mod_name}.{attr}" if mod_name else attr
                    if old is None or name not in whole:
                        continue
                    if id(old) not in made:
                        new = whole[name]
                        if isinstance(old, torch.nn.Parameter):
                            new = torch.nn.Parameter(new, requires_grad=old.requires_grad)
                        made[id(old)] = new
                    swapped.append((slots, attr, old))
                    slots[attr] = made[id(old)]
                    held[name] = made[id(old)]
        yield held
    finally:
        for slots, attr, old in reversed(swapped):
            slots[attr] = old


def state_dict_of(model: torch.nn.Module, whole: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """`model.state_dict()` as the model computes it from the `whole` tensors (its hooks
    included); entries that are whole tensors are returned as given, not copied."""
    with holding(model, whole), torch.no_grad():
        return dict(model.state_dict())


def whole_from_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor],
                          shapes: dict[str, torch.Size], dtypes: dict[str, torch.dtype],
                          device) -> dict[str, torch.Tensor]:
    """The inverse: the model's own tensors, whole, as `model.load_state_dict(state)` (its
    load hooks included) would set them, for the names in `shapes` (parameters and
    persistent buffers). Raises what load_state_dict raises (missing or unexpected keys, a
    shape that differs)."""
    own, by_id, whole = own_tensors(model, persistent_only=True), {}, {}
    for n in shapes:  # tied names share one tensor, as they share one in the model
        key = id(own[n]) if n in own else n
        if key not in by_id:
            by_id[key] = torch.empty(shapes[n], dtype=dtypes[n], device=device)
        whole[n] = by_id[key]
    with holding(model, whole), torch.no_grad():
        model.load_state_dict(state)
    return whole
