"""Capture time flat in depth: a model's repeated blocks traced twice, then stamped.

A transformer's layers are copies: the same module class, the same parameter shapes, the same
code. Tracing each one again costs ~0.6 ms a graph node (AOTAutograd's functionalization,
make_fx and fake tensors on every op), so a 48-layer model paid 4x a 12-layer one. Here the
model is traced with its block list cut to 2 and to 3 blocks; the third block's forward and
backward nodes, and how they connect to their neighbours, give a stamping rule; the rule is
checked by stamping the 2-block graph to 3 and comparing it with the 3-block trace node by
node; then the 3-block graph is stamped to the full depth.

What makes a copy a copy is checked, not assumed (`_same_structure`): same class, parameter
and buffer names, shapes, dtypes and requires_grad, no shared weights, no hooks; and every
block's forward, run on meta tensors with the inputs the traced block got, must issue the same
ATen ops on the same metadata with the same data flow as the traced block (a layer that
branches on its index - Gemma's sliding/global pattern, GPT-2's scale_attn_by_inverse_layer_idx
- differs there and is traced in full). Anything that does not fit (a block list the model
indexes by its config, blocks read across more than one step, code between the blocks) raises
`NotStampable` inside; capture then traces the whole model, as before.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import types
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar.core import ir

log = logging.getLogger(__name__)

MIN_BLOCKS = 8  # below this, tracing 2 + 3 blocks (and the checks) saves nothing


class NotStampable(Exception):
    """This model's blocks cannot be stamped (why in the message); capture traces it all."""


# ------------------------------------------------------------------ finding the block list

def _signature(block: torch.nn.Module) -> tuple:
    return (type(block),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in block.named_parameters(remove_duplicate=False)),
            tuple((n, tuple(b.shape), b.dtype)
                  for n, b in block.named_buffers(remove_duplicate=False)),
            tuple((n, type(m), m.training) for n, m in block.named_modules()))


def _hooked(module: torch.nn.Module) -> bool:
    return any(getattr(m, attr, None) for m in module.modules()
               for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                            "_backward_pre_hooks", "_state_dict_hooks"))


def find(model: torch.nn.Module) -> tuple[str, torch.nn.Module, int] | None:
    """The model's largest run of identical blocks that ends its block list: (the list's
    path, the ModuleList/Sequential, the run's first index - 0, or DeepSeek-V3's dense
    first layers, T5's first block with its relative bias), or None."""
    counts = collections.Counter(
        id(t) for _, t in (*model.named_parameters(remove_duplicate=False),
                           *model.named_buffers(remove_duplicate=False)))
    best, best_size = None, 0
    for path, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        blocks = list(mod._modules.values())
        if len(blocks) < MIN_BLOCKS or any(b is None for b in blocks):
            continue
        if list(mod._modules) != [str(i) for i in range(len(blocks))]:
            continue
        sig = _signature(blocks[-1])
        start = len(blocks)
        while start > 0 and _signature(blocks[start - 1]) == sig:
            start -= 1
        run = blocks[start:]
        if len(run) < MIN_BLOCKS or not sig[1]:
            continue
        tensors = [t for b in run for _, t in (*b.named_parameters(remove_duplicate=False),
                                               *b.named_buffers(remove_duplicate=False))]
        if len({id(t) for t in tensors}) != len(tensors) or \
                any(counts[id(t)] != 1 for t in tensors):
            continue  # a weight shared between blocks or with the rest of the model
        if len({id(m) for b in run for m in b.modules()}) != sum(
                len(list(b.modules())) for b in run):
            continue  # a submodule shared between blocks
        if _hooked(mod):
            continue
        size = sum(t.numel() for t in tensors)
        if size > best_size:
            best, best_size = (path, mod, start), size
    return best


@contextlib.contextmanager
def _cut(blocks: torch.nn.Module, k: int):
    """The block list holds its first k blocks (model code iterating it sees k layers)."""
    whole = blocks._modules
    blocks._modules = collections.OrderedDict(list(whole.items())[:k])
    try:
        yield
    finally:
        blocks._modules = whole


# ------------------------------------------------------------------ which node is whose

class _Blocks:
    """Per block index, its nodes in graph order (placeholders, forward, backward), and the
    block of every node (forward ops by the module that ran them; backward ops by the forward
    op they differentiate, autograd's sequence number, else by their module tag)."""

    def __init__(self, gm: torch.fx.GraphModule, path: str, start: int, k: int):
        self.path, self.start, self.k = path, start, k
        prefix = path + "." if path else ""
        self.of: dict[torch.fx.Node, int] = {}

        def index(name: str | None) -> int | None:  # (in the run: blocks before it are
            if not name or not name.startswith(prefix):  # the rest of the model)
                return None
            head = name[len(prefix):].split(".", 1)[0]
            return int(head) - start if head.isdigit() and int(head) >= start else None

        by_seq: dict[int, int | None] = {}
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                j = index(n.meta.get(ir.FQN)) if n.meta.get(ir.ROLE) in ("param", "buffer") \
                    else None
            elif n.op == "call_function" and n.meta.get(ir.REGION) == ir.FORWARD:
                j = index(n.meta.get(ir.MODULE))
                if ir.SEQ_NR in n.meta:
                    by_seq.setdefault(n.meta[ir.SEQ_NR], j)
            elif n.op == "call_function":
                seq = n.meta.get(ir.SEQ_NR)
                if n.meta.get("is_gradient_acc"):  # autograd's sum of two gradients (it
                    # carries another op's number): the block both come from, none if none
                    ins = {self.of.get(a) for a in n.all_input_nodes}
                    j = ins.pop() if len(ins) == 1 else index(n.meta.get(ir.MODULE))
                elif seq in by_seq:
                    j = by_seq[seq]
                else:
                    j = index(n.meta.get(ir.MODULE))
            else:
                j = None
            if j is not None:
                if j >= k:
                    raise NotStampable(f"node {n.name} is tagged block {j} of {k}")
                self.of[n] = j
        for n in gm.graph.nodes:  # a constant the trace lifted belongs to its readers' block
            if n.op == "get_attr" and n.users:
                users = {self.of.get(u) for u in n.users}
                if len(users) == 1 and None not in users:
                    self.of[n] = users.pop()
        self.nodes = [[] for _ in range(k)]
        self.stream: dict[torch.fx.Node, int] = {}  # 0: ran in the forward pass, 1: backward
        backward = 0
        for n in gm.graph.nodes:
            backward |= bool(n.meta.get("autograd_backward"))
            if n in self.of:
                self.nodes[self.of[n]].append(n)
                self.stream[n] = backward

    def pairing(self, a: int, b: int) -> dict[torch.fx.Node, torch.fx.Node]:
        """Block a's nodes -> block b's, by position; the ops must match one to one."""
        na, nb = self.nodes[a], self.nodes[b]
        if len(na) != len(nb):
            raise NotStampable(f"blocks {a} and {b} have {len(na)} and {len(nb)} nodes")
        for x, y in zip(na, nb):
            same = x.op == y.op and (x.op in ("placeholder", "get_attr") or x.target == y.target)
            if not same or x.meta.get(ir.REGION) != y.meta.get(ir.REGION):
                raise NotStampable(f"blocks {a} and {b} differ at {x.name} / {y.name}")
        return dict(zip(na, nb))


# ------------------------------------------------------------------ stamping

def _rename(s: str, prefix: str, j: int, new: int) -> str:
    old = f"{prefix}{j}"
    if s == old or s.startswith(old + "."):
        return f"{prefix}{new}" + s[len(old):]
    return s


def _stamp_one(gm: torch.fx.GraphModule, sig: ir.GraphSignature, blocks: _Blocks,
               psi: dict, seq_step: int) -> dict:
    """Appends block k (a copy of the last block, k-1) to gm and sig in place; returns the
    pairing last -> new (the next step's psi). psi pairs block k-2's nodes with k-1's."""
    graph = gm.graph
    last_j = blocks.k - 1
    new_j = blocks.k
    prefix = blocks.path + "." if blocks.path else ""
    last_abs, new_abs = blocks.start + last_j, blocks.start + new_j  # (in the block list)
    last = blocks.nodes[last_j]
    last_set = set(last)
    for n in last:
        for a in n.all_input_nodes:
            j = blocks.of.get(a)
            if j is not None and j < last_j - 1:
                raise NotStampable(f"{n.name} (block {last_j}) reads block {j}")
    kappa: dict[torch.fx.Node, torch.fx.Node] = {}

    def arg(a):
        if a in kappa:
            return kappa[a]
        if a in psi:  # the last block's input from the block before it: now the last block's
            return psi[a]
        if a in last_set:
            raise NotStampable(f"{a.name} is read before it is copied")
        return a  # shared by every block (the mask, rotary tables) or the rest of the model

    def copy_meta(src, dst):
        dst.meta = dict(src.meta)
        for key in (ir.MODULE, ir.FQN):
            if isinstance(src.meta.get(key), str):
                dst.meta[key] = _rename(src.meta[key], prefix, last_abs, new_abs)
        if ir.SEQ_NR in src.meta:
            dst.meta[ir.SEQ_NR] = src.meta[ir.SEQ_NR] + seq_step

    # placeholders: after the last block's, per role (params, then buffers)
    for role in ("param", "buffer"):
        phs = [n for n in last if n.op == "placeholder" and n.meta.get(ir.ROLE) == role]
        anchor = phs[-1] if phs else None
        for ph in phs:
            with graph.inserting_after(anchor):
                new = graph.placeholder(ph.name)
            new.target = new.name  # (a unique argument name)
            copy_meta(ph, new)
            kappa[ph] = anchor = new
    # the ops the forward pass ran after the last block's, those the backward pass ran before
    # its (by when autograd ran them: a value computed in the forward only for the backward,
    # BatchNorm's inverse deviation, is the backward's by region but ran in the forward)
    ops = [n for n in last if n.op in ("call_function", "get_attr")]
    fwd = [n for n in ops if blocks.stream[n] == 0]
    bwd = [n for n in ops if blocks.stream[n] == 1]
    if fwd + bwd != ops:
        raise NotStampable(f"block {last_j}'s forward ops are not all before its backward")

    def copy(n):
        new = graph.node_copy(n, arg)
        copy_meta(n, new)
        if n.op == "get_attr":  # a constant of its own, as the trace gives each block
            value = getattr(gm, n.target)
            new.target = f"{n.target}_{new_abs}"
            setattr(gm, new.target, value.clone() if isinstance(value, torch.Tensor) else value)
        kappa[n] = new
        return new

    anchor = fwd[-1] if fwd else None
    for n in fwd:
        with graph.inserting_after(anchor):
            anchor = copy(n)
    for n in bwd:
        with graph.inserting_before(bwd[0]):
            copy(n)
    # what the block before the last read from the last block, the last reads from the new
    inv = {b: a for a, b in psi.items()}
    for n in last:
        m = inv.get(n)
        if m is None or n.op == "placeholder":
            continue
        if not any(a in last_set for a in m.all_input_nodes):
            continue
        m_flat, m_spec = pytree.tree_flatten((m.args, m.kwargs))
        n_flat, n_spec = pytree.tree_flatten((n.args, n.kwargs))
        if m_spec != n_spec:
            raise NotStampable(f"{m.name} and {n.name} take different arguments")
        flat = [kappa[b] if isinstance(b, torch.fx.Node) and b in last_set else x
                for b, x in zip(m_flat, n_flat)]
        n.args, n.kwargs = pytree.tree_unflatten(flat, n_spec)
    # the rest of the model reads the new last block where it read the old one
    new_set = set(kappa.values())
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for n in last:
        for u in list(n.users):
            if u is out or u in new_set or u in blocks.of:
                continue
            u.replace_input_with(n, kappa[n])
    # outputs and signature: the new block's gradients and buffer updates after the last's
    outs = list(out.args[0])
    n_g = out.meta.get(ir.N_GRADS, 0)  # (0 in a forward-only graph)
    grads, updates = outs[1:1 + n_g], outs[1 + n_g:]
    old = f"{prefix}{last_abs}."
    p_last = [i for i, name in enumerate(sig.param_names) if name.startswith(old)]
    b_last = [i for i, name in enumerate(sig.buffer_names) if name.startswith(old)]
    u_last = [i for i, name in enumerate(sig.mutated_buffers) if name.startswith(old)]
    for idx, names, vals in ((p_last, sig.param_names, grads if n_g else None),
                             (b_last, sig.buffer_names, None),
                             (u_last, sig.mutated_buffers, updates)):
        if not idx:
            continue
        if idx != list(range(idx[0], idx[-1] + 1)):
            raise NotStampable(f"block {last_j}'s tensors are not contiguous in the signature")
        at = idx[-1] + 1
        names[at:at] = [_rename(names[i], prefix, last_abs, new_abs) for i in idx]
        if vals is not None:
            vals[at:at] = [None if vals[i] is None else kappa.get(vals[i]) for i in idx]
            if any(vals[i] is not None and vals[i] not in kappa for i in idx):
                raise NotStampable(f"an output of block {last_j} is computed outside it")
    out.args = ((outs[0], *grads, *updates),)
    out.meta[ir.N_GRADS] = len(grads)
    # block k's nodes: the copies, in graph order
    blocks.nodes.append([kappa[n] for n in last])
    for n in last:
        blocks.of[kappa[n]], blocks.stream[kappa[n]] = new_j, blocks.stream[n]
    blocks.k += 1
    return {n: kappa[n] for n in last}


def _canonical(gm: torch.fx.GraphModule) -> list:
    """The graph as positions: op, target, arguments as node indices, tags, value metadata."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def a(x):
        return ("node", index[x]) if isinstance(x, torch.fx.Node) else x

    rows = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":  # a constant: by its value, not its name
            t = getattr(gm, n.target)
            rows.append(("get_attr", tuple(t.flatten().tolist()) if isinstance(t, torch.Tensor)
                         and t.numel() <= 64 and t.device.type != "meta" else None,
                         n.meta.get(ir.MODULE), n.meta.get(ir.REGION)))
            continue
        val = n.meta.get("val")
        meta = tuple(
            (tuple(v.shape), v.dtype, tuple(v.stride())) if isinstance(v, torch.Tensor) else
            type(v).__name__ for v in pytree.tree_leaves(val))
        rows.append((n.op, None if n.op == "placeholder" else str(n.target),
                     pytree.tree_map(a, n.args), pytree.tree_map(a, n.kwargs),
                     n.meta.get(ir.MODULE), n.meta.get(ir.REGION), n.meta.get(ir.ROLE),
                     n.meta.get(ir.FQN), meta))
    return rows


# ------------------------------------------------------------------ every block alike

class _OpRecorder(TorchDispatchMode):
    """The ATen ops a forward issues: op, metadata and data flow (which earlier value each
    argument is), so two blocks that would trace alike record alike."""

    def __init__(self, inputs):
        super().__init__()
        self.ids: dict[int, int] = {}
        self.keep = []
        self.ops = []
        for t in inputs:
            self._name(t)

    def _name(self, t):
        if id(t) not in self.ids:
            self.ids[id(t)] = len(self.ids)
            self.keep.append(t)
        return self.ids[id(t)]

    def _arg(self, x):
        if isinstance(x, torch.Tensor):
            if x.device.type != "meta" and id(x) not in self.ids:
                # a tensor made from Python values (`torch.tensor(self.scale)`, Falcon's
                # `qkv[..., [-2], :]`): its values, read with the fake mode below off (or,
                # when large, its identity: then no two blocks compare equal)
                if x.numel() > 4096 or isinstance(x, FakeTensor) and x.constant is None:
                    self.keep.append(x)  # (its id stays its own while compared)
                    return ("data", id(x), x.dtype)
                with _python_dispatch._disable_current_modes():
                    x = x.constant if isinstance(x, FakeTensor) else x
                    return ("data", tuple(x.detach().flatten().tolist()), x.dtype)
            return ("t", self.ids.get(id(x), -1), tuple(x.shape), x.dtype, tuple(x.stride()))
        if isinstance(x, (list, tuple)):  # (an op's arguments: lists, never other containers;
            return (type(x), *map(self._arg, x))  # pytree's map costs ~3x this)
        if isinstance(x, (bool, float)):  # (True == 1 == 1.0, -0.0 == 0.0: not the same op)
            return (type(x), repr(x))
        return x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, self._arg(args),
                         tuple((k, self._arg(v)) for k, v in kwargs.items())))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._name(t)
        return out


class _TensorMeta:
    """What a block's input tensor was (a pytree leaf: none of the trace's tensors kept)."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.stride, self.dtype = tuple(t.shape), tuple(t.stride()), t.dtype
        self.requires_grad = t.requires_grad


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout,
          torch.memory_format)


def _replayable(x):
    """A block input as the replay takes it: a tensor's metadata, a plain value as itself, and
    any other object (a key/value cache holding the trace's tensors) as None: every block is
    replayed with the same stand-ins, so a block whose code differs still runs other ops."""
    if isinstance(x, torch.Tensor):
        return _TensorMeta(x)
    return x if isinstance(x, _PLAIN) else None


def _as_stand_in(x, device):
    """A tensor of x's metadata on `device`."""
    if isinstance(x, (torch.Tensor, _TensorMeta)):
        shape, stride = tuple(x.shape), (x.stride() if isinstance(x, torch.Tensor) else x.stride)
        t = torch.empty_strided(shape, stride, dtype=x.dtype, device=device)
        return t.requires_grad_(x.requires_grad) if t.is_floating_point() else t
    return x


def _record(block: torch.nn.Module, args, kwargs, backward: bool) -> list:
    """The ops `block(*args, **kwargs)` issues on meta tensors (its weights' too), and with
    `backward` those of its backward (a custom autograd.Function's per-layer scale shows only
    there): every branch on shapes, dtypes and attributes taken, no memory touched."""
    state = {n: _as_stand_in(t, "meta") for n, t in
             (*block.named_parameters(remove_duplicate=False),
              *block.named_buffers(remove_duplicate=False))}
    args, kwargs = pytree.tree_map(lambda x: _as_stand_in(x, "meta"), (args, kwargs))
    inputs = [t for t in pytree.tree_leaves((state, args, kwargs)) if isinstance(t, torch.Tensor)]
    rec = _OpRecorder(inputs)
    with rec:
        out = torch.func.functional_call(block, state, args, kwargs)
        outs = [t for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.requires_grad]
        wrt = [t for t in inputs if t.requires_grad]
        if backward and outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs],
                                allow_unused=True)
    return rec.ops


# nn.Module's own bookkeeping, read by every call (the hooks: `find` saw none on any block)
_INTERNAL = frozenset(("__dict__", "__class__", *(
    k for k in torch.nn.Module().__dict__ if "hook" in k)))


@contextlib.contextmanager
def _watching(block: torch.nn.Module, reads: set, when: Callable[[], bool] = lambda: True):
    """Records every attribute read of the block's modules, (module path, name), while
    `when()`: what a module's forward does depends only on its inputs and those (and
    globals); what the model around it does with it, on those it reads from outside."""
    swapped = []

    def watched(cls, path):
        def __getattribute__(obj, name):
            if name not in _INTERNAL and when():
                reads.add((path, name))
            return cls.__getattribute__(obj, name)
        return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                           "__module__": cls.__module__})

    for path, m in block.named_modules():
        swapped.append((m, m.__class__))
        m.__class__ = watched(m.__class__, path)
    try:
        yield
    finally:
        for m, cls in swapped:
            m.__class__ = cls


def _same_value(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, (torch.Tensor, torch.nn.Module)):
        return True  # (weights and submodules: compared by `_signature` and their own reads)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, types.MethodType):
        return a.__func__ is b.__func__ and _same_value(a.__self__, b.__self__)
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - not comparable: not the same
        return False


def _same_structure(blocks: list[torch.nn.Module], traced: int, call, outside: set,
                    backward: bool) -> None:
    """Every block is what the traced one was to the trace. The model reads of each block,
    from outside its forward, the same values (`outside`: a layer's attention type choosing
    its mask, say); and each block runs the ops the traced one ran: the same attributes read
    by its forward with equal values (then the same Python runs), else - a block that reads
    its own index, say - the same ops replayed on meta tensors."""
    missing = object()

    def value(block, path, name):
        try:
            return getattr(block.get_submodule(path), name)
        except AttributeError:
            return missing

    reads: set = set()
    with _watching(blocks[traced], reads):
        ref = _record(blocks[traced], *call, backward)
    outside = {r: value(blocks[traced], *r) for r in outside}
    inside = {r: value(blocks[traced], *r) for r in reads}
    for j, b in enumerate(blocks):
        differ = [r for r, v in outside.items() if not _same_value(v, value(b, *r))]
        if differ:
            raise NotStampable(f"the model reads {'.'.join(filter(None, differ[0]))} of each "
                               f"block, and block {j}'s differs from block {traced}'s")
        if j == traced or all(_same_value(v, value(b, *r)) for r, v in inside.items()):
            continue
        if _record(b, *call, backward) != ref:
            raise NotStampable(f"block {j} does not run the ops block {traced} runs "
                               "(its code branches on something of its own)")


# ------------------------------------------------------------------ the whole thing

@contextlib.contextmanager
def _unless_top(mode: TorchDispatchMode):
    """`mode` off the dispatch stack while inside, where it is the top mode (else as is)."""
    if _python_dispatch._get_current_dispatch_mode() is not mode:
        yield
        return
    with _python_dispatch._pop_mode_temporarily():
        yield


def _run_alike(blocks: list[torch.nn.Module], start: int,
               forward: Callable[[Any], None]) -> None:
    """The model at its full depth, its forward run once on fake tensors, runs every block of
    the run as it runs block 2: called in the same grad and autocast modes (not "the first k
    layers under no_grad"), fed the previous block's output and the same shared values (one
    mask object, one rotary table; not a mask picked by position from `config.layer_types`),
    the same ATen ops inside on the same scalars and Python-made constants with the same data
    flow (not a scale looked up by a counter the model keeps), and nothing of an inner
    block's output read outside the blocks but by the next block. `forward(ctx)` runs the
    model's forward with `ctx` entered inside its fake mode. Indices here are the run's."""
    blocks = blocks[start:]
    if any("forward" in vars(b) for b in blocks):  # (accelerate's hooks: not ours to touch)
        raise NotStampable("a block's forward is set on the instance")
    outs: dict[int, tuple[int, int]] = {}  # id(a block's output leaf) -> (block, leaf)
    keep, calls, ops, read = [], [], {}, collections.defaultdict(list)
    inside = [0]

    def describe(x, j):
        if isinstance(x, torch.Tensor):
            src = outs.get(id(x))
            return ("out", j - src[0], src[1]) if src else ("shared", id(x))
        return ("value", x)

    def wrapped(j, block, run):
        def forward(*args, **kwargs):
            flat, spec = pytree.tree_flatten((args, kwargs))
            modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                     *(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")),
                     torch._C._len_torch_dispatch_stack(),
                     torch._C._is_torch_function_mode_enabled())
            calls.append((j, spec, [("modes", modes), *(describe(x, j) for x in flat)]))
            state = [t for _, t in (*block.named_parameters(remove_duplicate=False),
                                    *block.named_buffers(remove_duplicate=False))]
            rec = _OpRecorder([*state, *(x for x in flat if isinstance(x, torch.Tensor))])
            inside[0] += 1
            try:  # (Readers has nothing to do inside a block: off the stack there, it costs
                with _unless_top(readers), rec:  # each op nothing; ~1/3 of this check)
                    out = run(*args, **kwargs)
            finally:
                inside[0] -= 1
            ops[j] = rec.ops
            for k, t in enumerate(pytree.tree_leaves(out)):
                if isinstance(t, torch.Tensor):
                    outs[id(t)] = (j, k)
                    keep.append(t)
            return out
        return forward

    class Readers(TorchDispatchMode):
        """Ops outside the blocks that read a block's output."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0]:
                for i, x in enumerate(pytree.tree_leaves((args, kwargs))):
                    if isinstance(x, torch.Tensor) and id(x) in outs:
                        j, k = outs[id(x)]
                        read[j].append((str(func), i, k))
            return func(*args, **(kwargs or {}))

    readers = Readers()
    for j, b in enumerate(blocks):
        b.forward = wrapped(j, b, b.forward)
    try:
        forward(readers)
    finally:
        for b in blocks:
            del b.forward
    if [c[0] for c in calls] != list(range(len(blocks))):
        raise NotStampable(f"the blocks ran in the order {[c[0] for c in calls][:8]}...")
    ref = calls[2]
    for j, spec, desc in calls[1:]:
        same = spec == ref[1] and len(desc) == len(ref[2]) and all(
            a[0] == b[0] and (_same_value(a[1], b[1]) if a[0] == "value" else a == b)
            for a, b in zip(desc, ref[2]))
        if not same:
            raise NotStampable(f"the model feeds block {j} otherwise than block 2 (an input, "
                               "or the grad or autocast mode, chosen by its position)")
        if ops[j] != ops[2]:
            raise NotStampable(f"block {j} does not run the ops block 2 runs (its code "
                               "branches on something of its own)")
    for j in range(len(blocks) - 1):
        if read[j] != read[1]:
            raise NotStampable(f"the model reads block {j}'s output otherwise than the next "
                               "block does")


def capture(model: torch.nn.Module, trace: Callable[[], tuple], found,
            tag_backward: Callable[[torch.fx.Graph], None],
            forward: Callable[[Any], None]) -> tuple:
    """`trace()` (capture's own, on the model as it stands) with the block list `found`
    (path, list, the run's first index) cut after the run's first 2 and 3 blocks, the rule
    checked, and the 3-block graph stamped to the full depth.
    `tag_backward(graph)` is capture's module tagging of backward nodes: it reads a node's
    neighbours, so it is run again on the stamped graph. `forward(ctx)` runs the model's
    forward once on fake tensors (for `_run_alike`)."""
    path, lst, start = found
    blocks = list(lst._modules.values())[start:]  # the run: indices below are the run's
    call: list[Any] = []
    inside = [False]
    outside: set = set()

    def enter(mod, args, kwargs):  # (metadata: nothing of the trace kept)
        call.append(pytree.tree_map(_replayable, (args, kwargs)))
        inside[0] = True

    def leave(mod, args, out):
        inside[0] = False

    with _cut(lst, start + 2):
        g2, s2 = trace()
    b2 = _Blocks(g2, path, start, 2)
    psi2 = b2.pairing(0, 1)  # (first: most models that are not stamped fail here, cheaply)
    hooks = (blocks[2].register_forward_pre_hook(enter, with_kwargs=True),
             blocks[2].register_forward_hook(leave))
    try:
        with _cut(lst, start + 3), _watching(blocks[2], outside, lambda: not inside[0]):
            g3, s3 = trace()
    finally:
        for h in hooks:
            h.remove()
    if not call:  # (AOTAutograd runs the model twice: once for its metadata, then to trace)
        raise NotStampable("block 2 did not run")
    joint = any(n.meta.get(ir.REGION) == ir.BACKWARD for n in g3.graph.nodes
                if n.op == "call_function")
    _same_structure(blocks, 2, call[-1], outside, joint)
    _run_alike(list(lst._modules.values()), start, forward)
    seq = 1 + max((n.meta.get(ir.SEQ_NR, 0) for n in g3.graph.nodes), default=0)

    _stamp_one(g2, s2, b2, psi2, seq)
    g2.graph.lint()
    tag_backward(g2.graph)
    c2, c3 = _canonical(g2), _canonical(g3)
    if c2 != c3 or s2 != s3:
        at = next((i for i, (x, y) in enumerate(zip(c2, c3)) if x != y), min(len(c2), len(c3)))
        raise NotStampable("the 2-block graph stamped to 3 blocks differs from the 3-block "
                           f"trace at node {at}: {c2[at:at + 1]} vs {c3[at:at + 1]}")
    b3 = _Blocks(g3, path, start, 3)
    psi = b3.pairing(1, 2)
    for _ in range(3, len(blocks)):
        psi = _stamp_one(g3, s3, b3, psi, seq)
    g3.graph.lint()
    tag_backward(g3.graph)
    # its Python code made when first called: the passes recompile the graph they change
    from torch.fx._lazy_graph_module import _LazyGraphModule
    lazy = _LazyGraphModule(g3, g3.graph)
    lazy.meta = g3.meta
    g3 = lazy
    log.debug("traced blocks %d-%d of %d of '%s', stamped the rest: %d nodes", start,
              start + 2, start + len(blocks), path, len(g3.graph.nodes))
    return g3, s3
