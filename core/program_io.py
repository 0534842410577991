"""A Program saved to a file and loaded back, so it can run without the compiler (a job that
must not trace, a machine of the same kind), be compared with another compile, or be drawn.

Graphs are saved node by node: op, name, target (an ATen/c10d/fxpar op by its qualified
name, torch's higher-order ops by theirs), arguments, and node.meta; a fake value
(meta["val"]) as its shape, strides, dtype and device, rebuilt in a FakeTensorMode on load.
A meta or gm.meta entry that cannot be pickled, or whose classes live in the compiler or the
passes (the passes' reports, torch's `original_aten`), is left out: the Program's own fields
carry every decision the runtime reads. Left out too: the planner's report (`plan_report`,
the compiler's objects) and `build_eval`, a closure - evaluate()'s program is compiled when
the Program is saved and saved beside it, so a loaded Program never compiles. A loaded
Program's snapshots (`stage_graphs`, for pictures) are decoded when first read.

`dumps`/`loads` carry a Program between the ranks of one job (`fxpar.parallelize` compiles
on rank 0): the passes' reports kept, as the receiving rank has the compiler, and each graph
put on the receiving rank's own device.

Why not torch.save / pickle of the GraphModules: a GraphModule pickles as its generated
Python code and drops node.meta, which the runtime reads (regions, buckets, stages). Why not
torch.export's serializer: it takes an ExportedProgram, not a graph with functional
collectives and fxpar's metadata. The file is a pickle: load only files you trust."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import pickle
import warnings
from collections.abc import Mapping

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from fxpar.core import ir
from fxpar.core.errors import FxparError

FORMAT = 4
_LAYERS_ABOVE = (b"fxpar.compiler", b"fxpar.passes", b"fxpar.api")


@dataclasses.dataclass(frozen=True)
class _Spec:
    """A fake value on disk."""
    shape: tuple
    stride: tuple
    storage_offset: int
    dtype: torch.dtype
    device: str


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A node argument on disk: the node of that name."""
    name: str


def _target(t, reports: bool = False):
    if isinstance(t, str):
        return ("str", t)
    if isinstance(t, torch._ops.OpOverload):
        return ("op", t.namespace, t._schema.name.split("::", 1)[1], t._overloadname)
    if isinstance(t, torch._ops.HigherOrderOperator):
        return ("hop", t.name())
    return ("pickled", _pickled(t, f"the graph calls {t!r}", reports))


def _resolve(spec):
    kind, *rest = spec
    if kind == "str":
        return rest[0]
    if kind == "op":
        ns, name, overload = rest
        if ns == "fxpar":  # fxpar's ops register when their modules are imported: the
            # kernels' and the sharding rules' (localize, local_chunk, expert_window...)
            importlib.import_module("fxpar.kernels.library")
            importlib.import_module("fxpar.core.sharding")
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    if kind == "hop":
        return torch._ops._higher_order_ops[rest[0]]
    return pickle.loads(rest[0])


def _pickled(value, what: str, reports: bool = False) -> bytes:
    try:
        data = pickle.dumps(value)
    except Exception as e:  # noqa: BLE001 - the reason goes into the message
        raise FxparError(f"cannot save this Program: {what}, which cannot be pickled "
                         f"({type(e).__name__}: {e})") from None
    if not reports and any(layer in data for layer in _LAYERS_ABOVE):
        raise FxparError(f"cannot save this Program: {what}, an object of the compiler's "
                         "(a loaded Program runs without it)")
    return data


_ATOMS = (str, int, float, bool, type(None))


class _Writer:
    """Encodes a Program's graphs. `reports`: the passes' reports in the metadata kept, for a
    process that has the compiler (another rank of the job), not for a file. What pickles is
    remembered per object: the passes' snapshots share their metadata values with the graph."""

    def __init__(self, reports: bool):
        self.reports, self.seen = reports, {}

    def plain(self, value) -> bool:
        """Whether a metadata value can go where it is sent (module docstring)."""
        if type(value) in _ATOMS:
            return True
        seen = self.seen.get(id(value))
        if seen is not None:
            return seen[0]
        try:
            data = pickle.dumps(value)
            ok = self.reports or not any(layer in data for layer in _LAYERS_ABOVE)
        except Exception:  # noqa: BLE001 - not picklable: left out (module docstring)
            ok = False
        self.seen[id(value)] = (ok, value)  # (the value kept alive: its id stays its own)
        return ok

    def val(self, v):
        if isinstance(v, torch.Tensor):
            return _Spec(tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype,
                         str(v.device))
        if isinstance(v, (list, tuple)):
            return type(v)(self.val(x) for x in v)
        return v if self.plain(v) else None

    def graph(self, gm: torch.fx.GraphModule) -> dict:
        nodes = []
        for n in gm.graph.nodes:
            meta = {k: (self.val(v) if k == ir.VAL else v) for k, v in n.meta.items()
                    if k == ir.VAL or self.plain(v)}
            args = _encode_args((n.args, n.kwargs))
            if not self.reports:  # (a file: each node's arguments checked, to name it)
                _pickled(args, f"node {n.name}'s arguments")
            nodes.append((n.op, n.name, _target(n.target, self.reports), args, meta))
        attrs = {n.target: _host(getattr(gm, n.target)) for n in gm.graph.nodes
                 if n.op == "get_attr"}
        meta = {k: v for k, v in gm.meta.items() if self.plain(v)}
        return {"nodes": nodes, "attrs": attrs, "meta": meta}


def _on(device: torch.device, here: torch.device | None) -> torch.device:
    """A saved device as the loading process has it: with `here` (cuda:3), a device of its
    type (the compiling rank's cuda:0) becomes `here`."""
    return here if here is not None and device.type == here.type else device


def _decode_val(v, mode: FakeTensorMode, here: torch.device | None = None):
    if isinstance(v, _Spec):  # (made on meta and wrapped: 5x faster than ops under the mode)
        t = torch.empty_strided(v.shape, v.stride, dtype=v.dtype, device="meta")
        if v.storage_offset:
            t = t.as_strided(v.shape, v.stride, v.storage_offset)
        # (a fresh meta tensor: the converter's memo, which from_meta_and_device fills,
        # is never asked of it)
        return FakeTensor(mode, t, _on(torch.device(v.device), here))
    if isinstance(v, (list, tuple)):
        return type(v)(_decode_val(x, mode, here) for x in v)
    return v


@dataclasses.dataclass(frozen=True)
class _Op:
    """An op as a node argument on disk (RNG replay's wrapped op), by its qualified name: an
    OpOverload does not pickle (its kernels are Python functions torch re-wraps)."""
    spec: tuple


def _encode_arg(x):
    if isinstance(x, torch.fx.Node):
        return _Ref(x.name)
    if isinstance(x, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return _Op(_target(x))
    return x


@dataclasses.dataclass(frozen=True)
class _OnHost:
    """A graph constant on disk: its values on the host and the device it was on (a
    CUDA tensor pickled as itself would load onto that same GPU in every process)."""
    tensor: torch.Tensor
    device: str


def _host(v):
    return _OnHost(v.detach().cpu(), str(v.device)) if isinstance(v, torch.Tensor) else v


def _encode_args(a):
    return torch.fx.node.map_aggregate(a, _encode_arg)


def encode_graph(gm: torch.fx.GraphModule, reports: bool = False) -> dict:
    return _Writer(reports).graph(gm)


def decode_graph(d: dict, mode: FakeTensorMode,
                 here: torch.device | None = None) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    made: dict[str, torch.fx.Node] = {}

    def arg(x):
        if isinstance(x, _Ref):
            return made[x.name]
        if isinstance(x, _Op):
            return _resolve(x.spec)
        return _on(x, here) if isinstance(x, torch.device) else x
    for op, name, target, args, meta in d["nodes"]:
        args, kwargs = torch.fx.node.map_aggregate(args, arg)
        node = g.create_node(op, _resolve(target), tuple(args), dict(kwargs), name=name)
        node.meta = {k: (_decode_val(v, mode, here) if k == ir.VAL else v)
                     for k, v in meta.items()}
        made[name] = node
    root = torch.nn.Module()
    for name, value in d["attrs"].items():
        if isinstance(value, _OnHost):  # (a constant: where this process runs)
            value = value.tensor.to(_on(torch.device(value.device), here))
        setattr(root, name, value)
    gm = torch.fx.GraphModule(root, g)
    gm.meta.update(d["meta"])
    return gm


def _encode(value, w: _Writer):
    """A Program field's value on disk: graphs node by node, pipeline parts likewise."""
    if isinstance(value, torch.fx.GraphModule):
        return ("graph", w.graph(value))
    if isinstance(value, ir.PipelineProgram):
        parts = {k: dataclasses.replace(p, graph=None) for k, p in value.parts.items()}
        return ("pipeline", dataclasses.replace(value, parts=parts),
                {k: w.graph(p.graph) for k, p in value.parts.items()})
    if isinstance(value, Mapping) and value and all(
            isinstance(v, Mapping) and all(isinstance(g, torch.fx.GraphModule)
                                           for g in v.values())
            for v in value.values()):  # stage_graphs: {pass: {role: snapshot}}
        return ("snapshots", {k: {r: w.graph(g) for r, g in v.items()}
                              for k, v in value.items()})
    return ("value", value)


def _decode(enc, mode: FakeTensorMode, here: torch.device | None):
    kind = enc[0]
    if kind == "graph":
        return decode_graph(enc[1], mode, here)
    if kind == "pipeline":
        pipeline, graphs = enc[1], enc[2]
        parts = {k: dataclasses.replace(p, graph=decode_graph(graphs[k], mode, here))
                 for k, p in pipeline.parts.items()}
        return dataclasses.replace(pipeline, parts=parts)
    if kind == "snapshots":
        return _Snapshots(enc[1], mode, here)
    return enc[1]


class _Snapshots(Mapping):
    """stage_graphs as loaded: a pass's snapshots are decoded when first read (for pictures
    and tests; a job's other ranks mostly never read them, and they are most of the graphs)."""

    def __init__(self, encoded: dict, mode: FakeTensorMode, here: torch.device | None):
        self._encoded, self._mode, self._here, self._read = encoded, mode, here, {}

    def __getitem__(self, name: str) -> dict:
        if name not in self._read:
            self._read[name] = {r: decode_graph(g, self._mode, self._here)
                                for r, g in self._encoded[name].items()}
        return self._read[name]

    def __iter__(self):
        return iter(self._encoded)

    def __len__(self) -> int:
        return len(self._encoded)


_NOT_SAVED = ("plan_report", "build_eval", "bound_groups")


def _encode_program(program: ir.Program, reports: bool) -> dict:
    out, w = {}, _Writer(reports)
    for f in dataclasses.fields(program):
        if f.name in _NOT_SAVED:
            continue
        value = getattr(program, f.name)
        enc = _encode(value, w)
        if enc[0] == "value":
            _pickled(value, f"its field {f.name}", reports)
        out[f.name] = enc
    return out


@contextlib.contextmanager
def _no_collection():
    """The cyclic garbage collector off: making a graph's many small objects triggers full
    collections over the whole heap (2-3x the time of a dump or a load, measured)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def dumps(program: ir.Program, *, evaluate: bool = True, reports: bool = False) -> bytes:
    """`program` (as fxpar.compile returned it) as bytes. With `evaluate`, evaluate()'s
    forward-only program is compiled now and saved beside it. With `reports`, the passes'
    reports in the graphs' metadata are kept: for a process that has the compiler (another
    rank of the same job), not for a file."""
    if program.bound_groups is not None:
        raise FxparError("cannot save a Program a runtime has bound to its process groups: "
                         "save the one fxpar.compile returns, before running it")
    eval_program = program.build_eval() if evaluate and program.build_eval is not None else None
    with _no_collection():
        payload = {"format": FORMAT, "torch": torch.__version__,
                   "program": _encode_program(program, reports),
                   "evaluate": None if eval_program is None else
                   _encode_program(eval_program, reports)}
        return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes, *, device: torch.device | None = None, source: str = "a Program"
          ) -> ir.Program:
    """The Program `dumps` made, its fake values rebuilt; evaluate()'s program (if saved) is
    its build_eval. `device`: this process's device; the saved graphs' devices of its type
    (the compiling rank's cuda:0) become it. `source` names the bytes in errors."""
    with warnings.catch_warnings(), _no_collection():
        # (torch's own TreeSpec pickles warn about themselves: the batch's pytree spec)
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        payload = pickle.loads(data)
    if payload.get("format") != FORMAT:
        raise FxparError(f"{source}: a Program of format {payload.get('format')}, this fxpar "
                         f"reads format {FORMAT}: compile the model again")
    if payload["torch"] != torch.__version__:
        raise FxparError(f"{source}: saved by torch {payload['torch']}, this is torch "
                         f"{torch.__version__}: the graphs' ops may differ; compile again")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    here = None if device is None else torch.device(device)

    def program_of(fields, **more):
        return ir.Program(**{k: _decode(v, mode, here) for k, v in fields.items()}, **more)
    with _no_collection():
        if payload["evaluate"] is None:
            return program_of(payload["program"])
        eval_program = program_of(payload["evaluate"])
        return program_of(payload["program"], build_eval=lambda: eval_program)


def save_program(program: ir.Program, path, *, evaluate: bool = True) -> None:
    """Write `program` (as fxpar.compile returned it) to `path`. With `evaluate`, evaluate()'s
    forward-only program is compiled now and saved beside it."""
    data = dumps(program, evaluate=evaluate)  # (all of it, then the file)
    with open(path, "wb") as f:
        f.write(data)


def load_program(path, *, device: torch.device | None = None) -> ir.Program:
    """The Program `save_program` wrote (`loads`). Imports nothing of the compiler."""
    with open(path, "rb") as f:
        return loads(f.read(), device=device, source=str(path))
