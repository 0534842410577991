"""ZeRO++'s quantized collectives (Plan.comm_quantization; Wang et al. 2023), as ATen ops.

qwZ: a ZeRO-3 parameter all-gather sends each rank's shards as int8 values in blocks of
BLOCK elements, each block with its scale (absmax / 127, to 5 significant bits: `_scales`)
as two more bytes, so one int8 all-gather carries both; every rank dequantizes the gathered
rows. ~0.254x fp32's bytes.
qgZ: a gradient reduce-scatter becomes an all-to-all: each rank quantizes the dp parts of its
gradients to int4 (two values a byte, blocks of GRAD_BLOCK with a scale, absmax / 7), sends
part r to rank r, and sums the dp parts it receives in fp32 after dequantizing them. ~0.141x
fp32's bytes.
A block never spans two tensors (each is padded to whole blocks; ZeRO-2's flat buckets are
cut into rows at every tensor boundary any row has). A block holding inf or NaN arrives as
NaNs. Rounding is to nearest; lossy by design (no error feedback, as in ZeRO++).

Each function takes `op(target, *args)`, which emits a graph node (passes/data_parallel.py)
or calls the op on tensors (the tests run the same code eagerly), and returns what it made.
"""
from __future__ import annotations

import operator

import torch

aten = torch.ops.aten

BLOCK = 256       # qwZ: int8 values per scale
GRAD_BLOCK = 64   # qgZ: int4 values per scale (smaller: 4 bits resolve less of a block)
ONEBIT_BLOCK = 256  # 1-bit Adam (runtime/onebit_adam.py): sign bits per fp32 scale
TINY = 1e-30  # a block of zeros gets a scale that divides without inf (exponent -107)
NONFINITE = -128.0  # the exponent of a block holding inf or NaN (finite ones are >= -107)


def _padded_length(sizes, block: int) -> int:
    return sum(-(-n // block) * block for n in sizes)


def _padded(op, x, sizes, block: int):
    """x [..., sum(sizes)] -> each segment padded with zeros to a multiple of `block`, so no
    block holds two tensors (a LayerNorm's weights near 1 beside its bias near 0 would
    share a scale: the bias rounded away)."""
    pads = [-n % block for n in sizes]
    if not any(pads):
        return x
    if len(sizes) == 1:
        return op(aten.constant_pad_nd.default, x, [0, pads[0]])
    pieces = op(aten.split_with_sizes.default, x, list(sizes), -1)
    parts = []
    for k, pad in enumerate(pads):
        piece = op(operator.getitem, pieces, k)
        parts.append(op(aten.constant_pad_nd.default, piece, [0, pad]) if pad else piece)
    return op(aten.cat.default, parts, -1)


def _unpadded(op, x, sizes, block: int):
    """The inverse of `_padded`, contiguous."""
    padded = [n + (-n % block) for n in sizes]
    if padded == list(sizes):
        return x
    if len(sizes) == 1:
        return op(aten.clone.default, op(aten.slice.Tensor, x, -1, 0, sizes[0]),
                  memory_format=torch.contiguous_format)
    pieces = op(aten.split_with_sizes.default, x, padded, -1)
    return op(aten.cat.default, [op(aten.slice.Tensor, op(operator.getitem, pieces, k), -1, 0, n)
                                 for k, n in enumerate(sizes)], -1)


def _scales(op, amax, qmax: float, dtype):
    """Each block's scale as it travels: two bytes of `dtype` per block, an exponent e and
    k in 0..16, meaning 2**e * (1 + k / 16) >= amax / qmax (5 significant bits: the block's
    largest value still lands within 1/16 of qmax). Returns (scale, its bytes [.., nb, 2]).
    Sent as numbers, not as an fp32's bytes: Inductor's CPU code (torch 2.13) read a bitcast
    (view.dtype) of the received bytes at the wrong offsets once its product was sliced -
    inf / NaN weights in a compiled run (tests/test_quantized_comm.py)."""
    finite = op(aten.isfinite.default, amax)
    v = op(aten.div.Tensor, op(aten.clamp_min.default, amax, TINY), qmax)
    e = op(aten.floor.default, op(aten.log2.default, v))
    frac = op(aten.div.Tensor, v, op(aten.exp2.default, e))
    k = op(aten.clamp.default, op(aten.ceil.default, op(aten.mul.Tensor,
                                                        op(aten.sub.Tensor, frac, 1.0), 16.0)),
           0.0, 16.0)
    # a block holding inf or NaN travels as the exponent NONFINITE: every value of it
    # arrives as NaN (an fp16 overflow stays visible to the loss scaler and the NaN checks)
    e = op(aten.where.self, finite, e, op(aten.full_like.default, e, NONFINITE))
    k = op(aten.where.self, finite, k, op(aten.zeros_like.default, k))
    offset = 128.0 if dtype == torch.uint8 else 0.0  # (uint8 holds e + 128)
    code = op(aten._to_copy.default, op(aten.cat.default, [op(aten.add.Tensor, e, offset), k], -1),
              dtype=dtype)
    scale = _decoded(op, e, k)  # (the sender divides a non-finite block by 1: its codes stay
    # in range; the receiver decodes NaN)
    return op(aten.where.self, finite, scale, op(aten.ones_like.default, scale)), code


def _decoded(op, e, k):
    scale = op(aten.mul.Tensor, op(aten.exp2.default, e),
               op(aten.add.Tensor, op(aten.div.Tensor, k, 16.0), 1.0))
    return op(aten.where.self, op(aten.eq.Scalar, e, NONFINITE),
              op(aten.full_like.default, scale, float("nan")), scale)


def _quantized(op, xb, qmax: float, dtype):
    """Blocks (the last dim of `xb`) -> (their values rounded to -qmax..qmax, as fp32;
    their scales' codes [.., nb, 2] in `dtype`)."""
    amax = op(aten.amax.default, op(aten.abs.default, xb), [-1], True)
    scale, code = _scales(op, amax, qmax, dtype)
    q = op(aten.clamp.default, op(aten.round.default, op(aten.div.Tensor, xb, scale)),
           -qmax, qmax)
    return q, code


def _scales_from(op, code, dtype_offset: float):
    """The scales of `code` ([.., nb, 2] bytes, as `_scales` made them), as fp32."""
    c = op(aten._to_copy.default, code, dtype=torch.float32)
    e = op(aten.sub.Tensor, op(aten.select.int, c, -1, 0), dtype_offset)
    return _decoded(op, e, op(aten.select.int, c, -1, 1))


def int8_payload(op, flat, sizes):
    """[sum(sizes)] (any float dtype; segments: the tensors side by side) ->
    [int8_bytes(sizes)] int8: the blocks' values, then their scales' codes."""
    n_pad = _padded_length(sizes, BLOCK)
    nb = n_pad // BLOCK
    x = _padded(op, op(aten._to_copy.default, flat, dtype=torch.float32), sizes, BLOCK)
    q, code = _quantized(op, op(aten.view.default, x, [nb, BLOCK]), 127.0, torch.int8)
    q = op(aten.view.default, op(aten._to_copy.default, q, dtype=torch.int8), [n_pad])
    return op(aten.cat.default, [q, op(aten.view.default, code, [2 * nb])])


def int8_bytes(sizes) -> int:
    n_pad = _padded_length(sizes, BLOCK)
    return n_pad + 2 * (n_pad // BLOCK)


def from_int8_payloads(op, gathered, sizes, dp: int, dtype):
    """The all-gather of dp payloads ([dp * int8_bytes(sizes)]) -> [dp * sum(sizes)] in
    `dtype` (rank r's tensors in row r)."""
    n_pad = _padded_length(sizes, BLOCK)
    nb = n_pad // BLOCK
    rows = op(aten.view.default, gathered, [dp, n_pad + 2 * nb])
    parts = op(aten.split_with_sizes.default, rows, [n_pad, 2 * nb], 1)
    q, code = op(operator.getitem, parts, 0), op(operator.getitem, parts, 1)
    scale = _scales_from(op, op(aten.view.default, code, [dp, nb, 2]), 0.0)  # [dp, nb]
    q = op(aten._to_copy.default, op(aten.view.default, q, [dp, nb, BLOCK]),
           dtype=torch.float32)
    x = op(aten.mul.Tensor, q, op(aten.unsqueeze.default, scale, -1))
    x = _unpadded(op, op(aten.view.default, x, [dp, n_pad]), sizes, BLOCK)
    x = op(aten.view.default, x, [dp * sum(sizes)])
    return op(aten._to_copy.default, x, dtype=dtype) if dtype != torch.float32 else x


def int4_payload(op, flat, sizes, dp: int):
    """[dp * sum(sizes)] (row r: what rank r keeps, its segments side by side) ->
    [dp * int4_bytes(sizes)] uint8: per row, the blocks' values two to a byte (offset by 8:
    1..15), then their scales' codes."""
    n_pad = _padded_length(sizes, GRAD_BLOCK)
    nb = n_pad // GRAD_BLOCK
    x = op(aten.view.default, op(aten._to_copy.default, flat, dtype=torch.float32),
           [dp, sum(sizes)])
    xb = op(aten.view.default, _padded(op, x, sizes, GRAD_BLOCK), [dp, nb, GRAD_BLOCK])
    q, code = _quantized(op, xb, 7.0, torch.uint8)
    q = op(aten._to_copy.default, op(aten.add.Tensor, q, 8.0), dtype=torch.uint8)
    pairs = op(aten.view.default, q, [dp, n_pad // 2, 2])
    lo = op(aten.select.int, pairs, 2, 0)
    hi = op(aten.select.int, pairs, 2, 1)
    packed = op(aten.bitwise_or.Tensor, lo, op(aten.bitwise_left_shift.Tensor_Scalar, hi, 4))
    return op(aten.view.default,
              op(aten.cat.default, [packed, op(aten.view.default, code, [dp, 2 * nb])], 1),
              [dp * int4_bytes(sizes)])


def int4_bytes(sizes) -> int:
    n_pad = _padded_length(sizes, GRAD_BLOCK)
    return n_pad // 2 + 2 * (n_pad // GRAD_BLOCK)


def sum_of_int4_payloads(op, received, sizes, dp: int, dtype):
    """The all-to-all's result ([dp * int4_bytes(sizes)]: row k = rank k's part for this
    rank) -> this rank's [sum(sizes)] shard, the dequantized parts summed in fp32."""
    n_pad = _padded_length(sizes, GRAD_BLOCK)
    nb = n_pad // GRAD_BLOCK
    rows = op(aten.view.default, received, [dp, int4_bytes(sizes)])
    parts = op(aten.split_with_sizes.default, rows, [n_pad // 2, 2 * nb], 1)
    packed, code = op(operator.getitem, parts, 0), op(operator.getitem, parts, 1)
    scale = _scales_from(op, op(aten.view.default, code, [dp, nb, 2]), 128.0)  # [dp, nb]
    lo = op(aten.bitwise_and.Scalar, packed, 15)
    hi = op(aten.bitwise_right_shift.Tensor_Scalar, packed, 4)
    q = op(aten.stack.default, [lo, hi], 2)  # [dp, n_pad // 2, 2]
    q = op(aten._to_copy.default, op(aten.view.default, q, [dp, nb, GRAD_BLOCK]),
           dtype=torch.float32)
    x = op(aten.mul.Tensor, op(aten.sub.Tensor, q, 8.0), op(aten.unsqueeze.default, scale, -1))
    x = op(aten.sum.dim_IntList, op(aten.view.default, x, [dp, n_pad]), [0])
    x = _unpadded(op, x, sizes, GRAD_BLOCK)
    return op(aten._to_copy.default, x, dtype=dtype) if dtype != torch.float32 else x


def eager(target, *args, **kwargs):
    """`op` for tensors: the ATen op itself."""
    return target(*args, **kwargs)
