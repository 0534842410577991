"""Mixed precision (Plan.precision = "bf16" | "fp16"): the fp32 joint graph rewritten to compute
in half precision with fp32 master weights, the first pass (so remat, pipeline cuts, tensor
and data parallelism and fusion all see the half-precision sizes).

The op policy is torch.autocast's (aten/src/ATen/autocast_mode.cpp, the CUDA lists):
- HALF: matmuls, convolutions and attention run in half: their floating inputs are cast down
  (attention's fp32 logsumexp, an output of the forward kept for the backward, stays fp32);
- FP32: softmax / log-softmax, norms (their statistics), reductions (sum / mean accumulate in
  fp32), exp / log / pow / rsqrt and the losses cast their inputs up;
- everything else follows its inputs: type-promoting ops (add, mul, where, ...) promote as in
  eager; other ops with mixed float inputs (gelu_backward, cat, ...) get their inputs cast to
  the widest of them, as autograd under autocast would hand them.
Because the joint graph already holds the backward, the backward ops get the same policy: a
matmul's backward matmuls run in half, a norm's backward in fp32: the dtypes autograd
produces under autocast (the backward of a cast is the opposite cast), except that backward
reductions (a bias's gradient sum) accumulate in fp32 here, where eager runs them in half.

Parameters stay fp32 placeholders (the master weights). A parameter a half op reads is cast
once, right before its first use, and the cast is reused by every later use, forward and
backward (autocast's weight cache); views of it (its transpose) are re-made on the cast. With
ZeRO-3 the backward casts its own copy (the backward re-gathers the weight, so keeping the
forward's cast alive would hold a whole half weight between forward and backward). Any other
value is cast down once too, whole, under its views, and that cast serves the forward and the
backward: as under autocast, where a matmul saves its half input for its weight gradient and
an fp32 gradient is cast to half once for both backward matmuls (before, the backward kept
fp32 activations alive to re-cast them: docs/benchmarks.md "Mixed precision"). Up-casts are
made once per region (the backward re-makes them from the half value rather than keeping
fp32). Gradients
are cast to fp32 right where they are made: they leave the graph (and are all-reduced / reduce-
scattered by the data-parallel pass) in fp32, like DDP under autocast, whose .grad is the fp32
parameter's: one rounding per gradient, and the sum over ranks adds fp32 rounding only. Buffer updates
keep their buffer's dtype; the loss is fp32. On a GPU, attention (traced in fp32, where torch
picks its memory-efficient kernel) becomes the kernel torch picks for the half inputs (cuDNN or
flash), forward and backward together: the kernel eager autocast and torch.compile run.

fp16 (loss scaling): one more input, a 0-dim fp32 placeholder (role "batch", last, fqn
"loss_scale"), multiplies the backward's seed `ones_like(loss)`: every gradient comes out
scaled by it, and is divided by it right after the fp32 cast (unscaled in fp32, where the
small gradients fp16 would flush to zero survive). The runtime (runtime/amp.py) feeds the
scale and checks the gradients for inf/NaN. `gm.meta[ir.PRECISION_REPORT]` records what the pass did.
"""
from __future__ import annotations

import dataclasses
import functools
import operator

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from fxpar.core import ir
from fxpar.core.errors import PlanError

aten = torch.ops.aten

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# autocast's lower_precision_fp list, as the ATen overloads a joint graph holds (+ backwards)
_HALF_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.addbmm.default, aten.addmv.default, aten.addr.default, aten.mv.default,
    aten.convolution.default, aten._convolution.default, aten.convolution_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
}
# half ops' inputs that are fp32 by the op's own definition (attention's log-sum-exp)
_KEEP_FP32_ARGS = {"logsumexp"}

# autocast's fp32 and fp32_set_opt_dtype lists (+ the backwards of those ops)
_FP32_OPS = {
    aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default,
    aten._softmax_backward_data.default, aten._log_softmax_backward_data.default,
    aten.native_layer_norm.default, aten.native_layer_norm_backward.default,
    aten.native_group_norm.default, aten.native_group_norm_backward.default,
    aten.nll_loss_forward.default, aten.nll_loss_backward.default,
    aten.nll_loss2d_forward.default, aten.nll_loss2d_backward.default,
    aten.mse_loss.default, aten.mse_loss_backward.default,
    aten.binary_cross_entropy_with_logits.default, aten.smooth_l1_loss.default,
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
    aten.prod.default, aten.prod.dim_int, aten.cumsum.default, aten.logsumexp.default,
    aten.var.correction, aten.std.correction, aten.linalg_vector_norm.default,
    aten.norm.ScalarOpt_dim,
    aten.exp.default, aten.expm1.default, aten.log.default, aten.log1p.default,
    aten.log2.default, aten.log10.default, aten.reciprocal.default, aten.rsqrt.default,
    aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar,
    aten.acos.default, aten.asin.default, aten.cosh.default, aten.sinh.default,
    aten.tan.default, aten.erfinv.default, aten.softplus.default,
    # complex numbers have no bfloat16 (Llama 4's rotary embedding: `view_as_complex(x.float())`
    # whose `.float()` of an fp32 trace records nothing)
    aten.view_as_complex.default,
}
# ops that promote mixed dtypes themselves (TensorIterator): no explicit cast needed
_PROMOTING = {
    aten.add.Tensor, aten.sub.Tensor, aten.rsub.Tensor, aten.mul.Tensor, aten.div.Tensor,
    aten.div.Tensor_mode, aten.where.self, aten.maximum.default, aten.minimum.default,
    aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor,
    aten.ge.Tensor, aten.addcmul.default, aten.addcdiv.default,
}
# views re-made on a parameter's cast (so `t(w)` becomes `t(cast(w))`, one cast per weight)
_VIEWS = {aten.t.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten.transpose.int, aten.permute.default, aten.expand.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.alias.default, aten.slice.Tensor}


@dataclasses.dataclass
class PrecisionInfo:
    dtype: torch.dtype
    half_nodes: list[str]          # nodes that compute in half
    fp32_nodes: list[str]          # nodes forced to fp32 (softmax, norms, reductions, loss)
    param_casts: dict[str, str]    # parameter placeholder -> its cast node (forward)
    casts: int                     # cast nodes inserted in all
    loss_scale: str | None         # fp16: the loss-scale placeholder's name
    attention: dict[str, str] = dataclasses.field(default_factory=dict)  # node -> kernel


@dataclasses.dataclass(frozen=True)
class Options:
    """The Plan fields this pass reads (core/plan.pass_options fills them from a Plan)."""
    precision: str = "fp32"
    zero: int = 0


CONTRACT = ir.PassContract(
    "precision", Options,
    requires=frozenset({ir.VAL, ir.REGION, ir.MODULE, ir.ROLE, ir.FQN}),
    provides=frozenset({ir.LOSS_SCALE, ir.PRECISION_REPORT}),
    # every later pass sizes and prices tensors in the dtypes this one chooses
    before=frozenset({"remat", "pipeline_split", "tensor_parallel", "data_parallel", "overlap", "fusion"}),
    applies=lambda o: o.precision != "fp32")


def run(gm: torch.fx.GraphModule, options: Options, ctx) -> torch.fx.GraphModule:
    """Rewrite the fp32 joint graph to options.precision (see the module docstring)."""
    if options.precision == "fp32":
        return gm
    half = HALF_DTYPES[options.precision]
    graph = gm.graph
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    env: dict[torch.fx.Node, object] = {}
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    with mode:
        for ph in phs:
            v = ph.meta[ir.VAL]
            env[ph] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    params = {ph for ph in phs if ph.meta.get(ir.ROLE) == "param"}
    casts: dict[tuple, torch.fx.Node] = {}
    info = PrecisionInfo(half, [], [], {}, 0, None)

    def dtype_of(x):
        v = env.get(x) if isinstance(x, torch.fx.Node) else None
        return v.dtype if isinstance(v, torch.Tensor) else None

    def param_rooted(x):
        while x.op == "call_function" and x.target in _VIEWS:
            x = x.args[0]
        return x in params

    def cast(x, dtype, user):
        """x as `dtype`, cast once: a parameter's (and its views') cast is shared by all its
        users (per region only under ZeRO-3); a value's down-cast too, forward and backward,
        and made on the whole value under its views (autocast: a matmul saves its half
        input for the backward, and its gradient is cast to half once for both backward
        matmuls; a backward re-casting from fp32 kept the fp32 value alive and moved its
        bytes again); an up-cast once per region (re-made from the half value in the
        backward rather than kept alive in fp32 from the forward)."""
        if dtype_of(x) == dtype or not dtype_of(x).is_floating_point:
            return x
        on_param = param_rooted(x)
        down = torch.finfo(dtype).bits < torch.finfo(dtype_of(x)).bits
        scope = ("param" if options.zero != 3 else user.meta[ir.REGION]) if on_param else \
            "value" if down else user.meta[ir.REGION]
        key = (x, dtype, scope)
        if key in casts:
            return casts[key]
        if (on_param and x not in params) or (  # a view of a weight: re-made on its cast
                not on_param and down and x.op == "call_function" and x.target in _VIEWS
                and x.target is not aten.slice.Tensor):  # (a value's: not a part of it)
            base = cast(x.args[0], dtype, user)
            with graph.inserting_before(user):
                new = graph.call_function(x.target, (base, *x.args[1:]), dict(x.kwargs))
        else:
            with graph.inserting_before(user):
                new = graph.call_function(aten._to_copy.default, (x,), {"dtype": dtype})
            info.casts += 1
            if x in params:
                info.param_casts.setdefault(x.name, new.name)
        new.meta.update({ir.REGION: user.meta[ir.REGION], ir.MODULE: user.meta[ir.MODULE]})
        propagate(new)
        casts[key] = new
        return new

    def propagate(n):
        args = torch.fx.node.map_arg(n.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(n.kwargs, env.__getitem__)
        with mode:
            env[n] = n.target(*args, **kwargs)
        n.meta[ir.VAL] = env[n]

    def recast_inputs(n, want):
        """Replace n's floating tensor inputs by casts to want(arg name, dtype) (None: keep)."""
        schema = getattr(n.target, "_schema", None)
        names = [a.name for a in schema.arguments] if schema else []

        def fix(a, name):
            if isinstance(a, (list, tuple)):
                return type(a)(fix(x, name) for x in a)
            if isinstance(a, torch.fx.Node) and isinstance(env.get(a), torch.Tensor) \
                    and env[a].dtype.is_floating_point:
                d = want(name, env[a].dtype)
                return a if d is None else cast(a, d, n)
            return a
        n.args = tuple(fix(a, names[i] if i < len(names) else None)
                       for i, a in enumerate(n.args))
        n.kwargs = {k: fix(v, k) for k, v in n.kwargs.items()}

    def float_inputs(n):
        return [env[a] for a in n.all_input_nodes
                if isinstance(env.get(a), torch.Tensor) and env[a].dtype.is_floating_point]

    for n in list(graph.nodes):
        if n.op == "get_attr":  # a constant the trace kept (e.g. rotary inv_freq)
            env[n] = mode.from_tensor(operator.attrgetter(n.target)(gm))
            continue
        if n.op != "call_function" or n in env:
            continue
        if n.target is operator.getitem:
            env[n] = env[n.args[0]][n.args[1]]
            n.meta[ir.VAL] = env[n]
            continue
        if n.target in _HALF_OPS:
            recast_inputs(n, lambda name, d: None if name in _KEEP_FP32_ARGS else half)
            info.half_nodes.append(n.name)
        elif n.target in _FP32_OPS:
            recast_inputs(n, lambda name, d: torch.float32)
            info.fp32_nodes.append(n.name)
        elif n.target not in _PROMOTING:
            dts = {v.dtype for v in float_inputs(n)}
            if len(dts) > 1:  # mixed: as autograd under autocast would hand them, the widest
                widest = max(dts, key=lambda d: torch.finfo(d).bits)
                recast_inputs(n, lambda name, d: widest)
        propagate(n)

    info.attention = _attention_for_half(graph, env, mode, info.half_nodes)
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(out.args[0])
    sig = ctx.signature
    n_p = sig.num_params
    bufs = {ph.meta.get(ir.FQN): ph for ph in phs if ph.meta.get(ir.ROLE) == "buffer"}
    want = [torch.float32] + [env[ph].dtype for ph in phs[:n_p]] + [
        env[bufs[b]].dtype if b in bufs else torch.float32 for b in sig.mutated_buffers]
    scale = None
    if options.precision == "fp16" and any(n.op == "call_function" and n.meta.get(
            ir.REGION) == ir.BACKWARD for n in graph.nodes):  # (not for evaluate's graph)
        scale = _loss_scale_input(graph, phs, out, env, mode, info)
        gm.meta[ir.LOSS_SCALE] = True
    for i, (o, d) in enumerate(zip(outs, want)):
        if not isinstance(o, torch.fx.Node):
            continue
        if dtype_of(o) != d:
            with graph.inserting_after(o):
                c = graph.call_function(aten._to_copy.default, (o,), {"dtype": d})
            c.meta.update({ir.REGION: o.meta.get(ir.REGION, ir.BACKWARD),
                           ir.MODULE: o.meta.get(ir.MODULE, "")})
            propagate(c)
            info.casts += 1
            o = c
        if scale is not None and 1 <= i <= n_p:  # unscale the gradient, in fp32 (exact:
            with graph.inserting_after(o):      # the scale is a power of 2)
                u = graph.call_function(aten.div.Tensor, (o, scale))
            u.meta.update({ir.REGION: o.meta[ir.REGION], ir.MODULE: o.meta[ir.MODULE]})
            propagate(u)
            o = u
        outs[i] = o
    out.args = (tuple(outs),)
    for n in reversed(list(graph.nodes)):  # the fp32 views of weights the casts replaced
        if n.op == "call_function" and not n.users and n.target in _VIEWS:
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    gm.meta[ir.PRECISION_REPORT] = info
    return gm


_EFFICIENT = aten._scaled_dot_product_efficient_attention.default
_EFFICIENT_BACKWARD = aten._scaled_dot_product_efficient_attention_backward.default
# torch.nn.attention.SDPBackend's values, as torch._fused_sdp_choice returns them
_SDP_FLASH, _SDP_CUDNN = 1, 3
_OP_OWN_META = {ir.VAL, "tensor_meta"}  # the replaced op's outputs: not the new op's


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device)


@functools.lru_cache(maxsize=64)  # (one answer per layout: every layer asks the same)
def _sdp_choice(q, k, v, is_causal, scale, grad) -> int | None:
    """The attention kernel torch's scaled_dot_product_attention runs for inputs of these
    layouts (shape, stride, dtype, device) that need gradients or not (`grad`: some kernels
    are refused for training at some head sizes) - what eager autocast and torch.compile run;
    None where only a CUDA build with a GPU can tell."""
    if not torch.cuda.is_available():
        return None
    try:  # on real (empty) tensors: under fake tensors the choice runs torch's meta kernel,
        # which answers "math" for every input (seen on an H200)
        with unset_fake_temporarily():
            real = [torch.empty_strided(shape, stride, dtype=dtype, device=device,
                                        requires_grad=grad)
                    for shape, stride, dtype, device in (q, k, v)]
            return int(torch._fused_sdp_choice(*real, None, 0.0, is_causal, scale=scale))
    except Exception:  # noqa: BLE001 - no answer: the traced kernel stays, which is correct
        return None


def _attention_for_half(graph: torch.fx.Graph, env: dict, mode, half_nodes: list[str]
                        ) -> dict[str, str]:
    """A trace on a GPU is made in fp32, for which torch's attention picks its one fp32
    fused kernel, memory-efficient attention; with its inputs now half, torch would pick
    flash or cuDNN attention, faster on Hopper (docs/benchmarks.md, "GPU: one NVIDIA
    H100"). The forward and its backward are swapped together for the kernel torch picks
    for the half inputs; not with an attention bias or dropout (those kernels' bias gradient
    and random state differ) or grouped kv heads. Returns {forward node: kernel}."""
    swapped = {}
    for fwd in [n for n in graph.nodes if n.target is _EFFICIENT]:
        a = torch.fx.operator_schemas.normalize_function(
            fwd.target, fwd.args, fwd.kwargs, normalize_to_only_use_kwargs=True).kwargs
        q, k, v = (env[a[x]] for x in ("query", "key", "value"))
        if a["attn_bias"] is not None or a.get("dropout_p", 0.0) != 0.0 or \
                q.dtype not in (torch.float16, torch.bfloat16) or q.shape[1] != k.shape[1]:
            continue
        causal, scale = a.get("is_causal", False), a.get("scale")
        bwds = list(dict.fromkeys(u for g in fwd.users if g.target is operator.getitem
                                  for u in g.users if u.target is _EFFICIENT_BACKWARD))
        choice = _sdp_choice(*(_layout(t) for t in (q, k, v)), causal, scale, bool(bwds))
        if choice not in (_SDP_FLASH, _SDP_CUDNN):
            continue
        if any(g.target is not operator.getitem for g in fwd.users) or any(
                g.target is operator.getitem and g.args[0] is b and g.args[1] == 3 and g.users
                for b in bwds for g in b.users):  # (a bias gradient: none without a bias)
            continue
        qkv = (a["query"], a["key"], a["value"])
        if choice == _SDP_FLASH:
            target, args = aten._scaled_dot_product_flash_attention.default, (*qkv, 0.0, causal)
        else:
            target = aten._scaled_dot_product_cudnn_attention.default
            args = (*qkv, None, a["compute_log_sumexp"] or bool(bwds), 0.0, causal)
        bargs_of = {}
        for b in bwds:
            ba = torch.fx.operator_schemas.normalize_function(
                b.target, b.args, b.kwargs, normalize_to_only_use_kwargs=True).kwargs
            grad, out, lse, seed, offset, *bqkv = (ba[x] for x in (
                "grad_out_", "out", "logsumexp", "philox_seed", "philox_offset", "query", "key",
                "value"))
            lq, lk = q.shape[2], k.shape[2]
            if choice == _SDP_FLASH:
                bargs_of[b] = (aten._scaled_dot_product_flash_attention_backward.default, (
                    grad, *bqkv, out, lse, None, None, lq, lk, 0.0, causal, seed, offset))
            else:
                bargs_of[b] = (aten._scaled_dot_product_cudnn_attention_backward.default, (
                    grad, *bqkv, out, lse, seed, offset, None, None, None, lq, lk, 0.0, causal))
        # output, logsumexp, random seed and offset; the backward's bias gradient (unused) goes
        traced = {g: (env[g].shape, env[g].stride()) for n in (fwd, *bwds) for g in n.users
                  if isinstance(env.get(g), torch.Tensor)}
        if any(_dense_order(*layout) is None for layout in traced.values()):
            continue  # (a layout a copy cannot restore: not seen from these kernels)
        new = [_replace(graph, fwd, target, args, scale, env, mode, half_nodes,
                        {0: 0, 1: 1, 2: 6, 3: 7})]
        for b, (bt, bargs) in bargs_of.items():
            new.append(_replace(graph, b, bt, bargs, scale, env, mode, half_nodes,
                                {0: 0, 1: 1, 2: 2}))
        for g, (shape, stride) in traced.items():  # (the random state's shape may differ:
            # only the new backward reads it)
            if env[g].shape == shape and not _same_strides(env[g], stride):
                _restride(graph, g, stride, env, mode, keep=set(new))
        swapped[new[0].name] = "flash" if choice == _SDP_FLASH else "cudnn"
    return swapped


def _dense_order(shape, stride) -> list[int] | None:
    """The dims from outermost to innermost of a dense layout with these strides (None: not
    dense - overlapping or with gaps). Dims of size 1 place anywhere."""
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    want, step = {}, 1
    for d in reversed(order):
        want[d], step = step, step * shape[d]
    return order if all(want[d] == stride[d] for d in order if shape[d] > 1) else None


def _same_strides(val, stride) -> bool:
    """Strides equal where they matter (dims of size 1 place anywhere)."""
    return all(a == b for a, b, n in zip(val.stride(), stride, val.shape) if n > 1)


def _restride(graph, g, stride, env, mode, keep) -> None:
    """g's users (but those in `keep`) read a copy of g laid out as traced: the new kernels
    lay out their outputs as their inputs (cuDNN, flash) where memory-efficient attention's
    were [B, T, H, D], and the traced views after them (`.transpose(1, 2).view(B, T, C)`)
    need that layout. A copy of the output and of dq, dk, dv per layer, as eager's own
    `.contiguous()` makes with these kernels (HF GPT-2's q is [B, H, T, D]-contiguous once
    cast), as permute -> contiguous clone -> permute back: ops with no shape of their own,
    which the passes after this one shard (tensor parallelism splits the heads)."""
    order = _dense_order(env[g].shape, stride)
    back = [order.index(d) for d in range(len(order))]
    made = []
    for target, args, kwargs in ((aten.permute.default, (order,), {}),
                                 (aten.clone.default, (), {"memory_format":
                                                           torch.contiguous_format}),
                                 (aten.permute.default, (back,), {})):
        src = made[-1] if made else g
        with graph.inserting_after(src):
            n = graph.call_function(target, (src, *args), kwargs)
        with mode:
            env[n] = target(env[src], *args, **kwargs)
        n.meta.update({k: g.meta[k] for k in (ir.REGION, ir.MODULE) if k in g.meta})
        n.meta[ir.VAL] = env[n]
        made.append(n)
    g.replace_all_uses_with(made[-1], delete_user_cb=lambda u: u is not made[0]
                            and u not in keep)


def _replace(graph, old, target, args, scale, env, mode, half_nodes, outputs):
    """`old` replaced by target(*args, scale=scale): its getitems re-pointed by `outputs`
    (old index -> new; an index not there is an unused output, dropped); values and names
    kept current. Returns the new node."""
    with graph.inserting_before(old):
        new = graph.call_function(target, args, {"scale": scale})
    new.meta.update({k: v for k, v in old.meta.items() if k not in _OP_OWN_META})
    with mode:
        env[new] = target(*torch.fx.node.map_arg(args, env.__getitem__), scale=scale)
    new.meta[ir.VAL] = env[new]
    for g in list(old.users):
        if g.args[1] not in outputs:
            graph.erase_node(g)
            continue
        g.args = (new, outputs[g.args[1]])
        env[g] = env[new][g.args[1]]
        g.meta[ir.VAL] = env[g]
        g.meta.pop("tensor_meta", None)
    half_nodes[:] = [new.name if x == old.name else x for x in half_nodes]
    graph.erase_node(old)
    return new


def _loss_scale_input(graph, phs, out, env, mode, info):
    """fp16: a 0-dim fp32 'loss_scale' placeholder multiplies the backward's seed
    ones_like(loss) (so every gradient is scaled by it); returns the placeholder. Each gradient
    divides by the placeholder itself (no shared 1/scale node: under pipeline parallelism that
    would be a transfer from the last stage to every other)."""
    loss = out.args[0][0]
    seeds = [u for u in loss.users if u.target is aten.ones_like.default]
    if len(seeds) != 1:
        raise PlanError(
            "precision='fp16' scales the backward's seed ones_like(loss); this graph has "
            f"{len(seeds)} such seeds. Use precision='bf16' (no loss scaling needed).")
    with graph.inserting_after(phs[-1]):
        scale = graph.placeholder("loss_scale")
    scale.meta.update({ir.ROLE: "batch", ir.FQN: "loss_scale"})
    with mode:
        env[scale] = torch.empty((), dtype=torch.float32, device=env[phs[-1]].device)
    scale.meta[ir.VAL] = env[scale]
    seed = seeds[0]
    with graph.inserting_after(seed):
        new_seed = graph.call_function(aten.mul.Tensor, (seed, scale))
    new_seed.meta.update({ir.REGION: ir.BACKWARD, ir.MODULE: seed.meta.get(ir.MODULE, "")})
    seed.replace_all_uses_with(new_seed, delete_user_cb=lambda u: u is not new_seed)
    with mode:
        env[new_seed] = env[seed] * env[scale]
    new_seed.meta[ir.VAL] = env[new_seed]
    info.loss_scale = scale.name
    return scale
