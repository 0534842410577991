"""The hand-written Triton kernels against the ATen ops they replace, in Triton's interpreter.

fp32: rtol 1e-5, atol 1e-6 unless a comment says why not. bf16: the kernel on bf16 inputs
against the fp32 ATen op on the same values upcast, with the bound given in each test (a
bf16 result carries a rounding error of up to 2**-8 relative, before any accumulated error).
"""
import os

import pytest
import torch

from fxpar.kernels import attention, layernorm, rmsnorm, softmax
from fxpar.kernels import cross_entropy as ce
from fxpar.kernels.jit import interpreter, stored_as

aten = torch.ops.aten
FP32 = {"rtol": 1e-5, "atol": 1e-6}
BF16 = {"rtol": 2e-2, "atol": 2e-2}  # ~ 4 bf16 ulps relative


# FXPAR_TEST_GPU=1 where an NVIDIA GPU is lent: the same tests, on CUDA tensors, with the
# kernels compiled and launched on the GPU (tests/test_gpu.py says how)
ON_GPU = os.environ.get("FXPAR_TEST_GPU") == "1" and torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _interpret():
    torch.manual_seed(0)
    if ON_GPU:
        old = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        with torch.device("cuda"):
            yield
        torch.set_float32_matmul_precision(old)
        return
    with interpreter():
        yield


def close(got, want, **tol):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype,
                                                                  want.shape, want.dtype)
    torch.testing.assert_close(got, want, **(tol or FP32))


def close_bf16(got, want_fp32, **tol):
    assert got.dtype == torch.bfloat16 and got.shape == want_fp32.shape
    torch.testing.assert_close(got.float(), want_fp32, **(tol or BF16))


# --- softmax ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,dim", [((37, 129), 1), ((37, 129), -1), ((5, 37, 7), 1),
                                       ((4, 6, 33), 0), ((300, 3), 1)])
def test_softmax(shape, dim):
    x = torch.randn(shape) * 3
    y = softmax.softmax_forward(x, dim)
    close(y, aten._softmax(x, dim, False))
    g = torch.randn(shape)
    close(softmax.softmax_backward(g, y, dim, x.dtype),
          aten._softmax_backward_data(g, y, dim, x.dtype))


def test_softmax_noncontiguous_and_safe():
    x = torch.randn(129, 37).t()
    close(softmax.softmax_forward(x, 1), aten._softmax(x, 1, False))
    x = torch.randn(6, 9)
    x[2] = -float("inf")
    x[3, :4] = -float("inf")
    y = softmax.softmax_forward(x, 1, safe=True)
    close(y, aten._safe_softmax(x, 1))
    assert (y[2] == 0).all()
    assert softmax.softmax_forward(x, 1)[2].isnan().all()  # as aten._softmax


def test_softmax_bf16():
    x = torch.randn(5, 37, 7, dtype=torch.bfloat16)
    y = softmax.softmax_forward(x, 1)
    close_bf16(y, aten._softmax(x.float(), 1, False))
    g = torch.randn(5, 37, 7, dtype=torch.bfloat16)
    close_bf16(softmax.softmax_backward(g, y, 1, x.dtype),
               aten._softmax_backward_data(g.float(), y.float(), 1, torch.float32))
    # half_to_float: fp32 out; its backward returns the input dtype (as on CUDA / meta)
    assert softmax.softmax_forward(x, 1, half_to_float=True).dtype == torch.float32
    assert softmax.softmax_backward(g.float(), y.float(), 1, x.dtype).dtype == torch.bfloat16


# --- layer norm --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,k,affine", [((37, 129), 1, "wb"), ((37, 129), 1, ""),
                                            ((3, 5, 4, 7), 2, "b"), ((300, 20), 1, "w")])
def test_layer_norm(shape, k, affine):
    ns = list(shape[-k:])
    x = torch.randn(shape) * 2 + 0.5
    w = torch.randn(ns) if "w" in affine else None
    b = torch.randn(ns) if "b" in affine else None
    out = layernorm.layer_norm_forward(x, ns, w, b, 1e-5)
    ref = aten.native_layer_norm(x, ns, w, b, 1e-5)
    for got, want in zip(out, ref):
        close(got, want)
    g = torch.randn(shape)
    mask = [True, w is not None, b is not None]
    out = layernorm.layer_norm_backward(g, x, ns, ref[1], ref[2], w, b, mask)
    ref = aten.native_layer_norm_backward(g, x, ns, ref[1], ref[2], w, b, mask)
    for got, want in zip(out, ref):
        if want is None:
            assert got is None
        else:  # dweight/dbias sum 300 rows: summation order differs from ATen's
            close(got, want, rtol=1e-5, atol=1e-5)


def test_layer_norm_bf16():
    x = torch.randn(37, 129, dtype=torch.bfloat16)
    w, b = torch.randn(129, dtype=torch.bfloat16), torch.randn(129, dtype=torch.bfloat16)
    y, mean, rstd = layernorm.layer_norm_forward(x, [129], w, b, 1e-5)
    ry, rmean, rrstd = aten.native_layer_norm(x.float(), [129], w.float(), b.float(), 1e-5)
    close_bf16(y, ry)
    for got, want in ((mean, rmean), (rstd, rrstd)):  # ATen keeps mean/rstd in the input
        if got.device.type == "cpu":                  # dtype on CPU, in fp32 on CUDA
            close_bf16(got, want)
        else:
            close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn(37, 129, dtype=torch.bfloat16)
    dx, dw, db = layernorm.layer_norm_backward(g, x, [129], mean, rstd, w, b, [True] * 3)
    rdx, rdw, rdb = aten.native_layer_norm_backward(g.float(), x.float(), [129], rmean, rrstd,
                                                    w.float(), b.float(), [True] * 3)
    close_bf16(dx, rdx, rtol=2e-2, atol=5e-2)  # dx uses the bf16-rounded mean/rstd
    close_bf16(dw, rdw, rtol=2e-2, atol=1e-1)  # sums of 37 rows of O(1) terms
    close_bf16(db, rdb, rtol=2e-2, atol=1e-1)


# --- RMSNorm ---------------------------------------------------------------------------------

def _rms_reference(x, w, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (xf * rstd).to(x.dtype)
    return (y if w is None else w * y), rstd


@pytest.mark.parametrize("shape,has_w", [((37, 129), True), ((3, 5, 24), False), ((300, 20), True)])
def test_rms_norm(shape, has_w):
    x = torch.randn(shape, requires_grad=True)
    w = (torch.rand(shape[-1]) + 0.5).requires_grad_() if has_w else None
    y, rstd = rmsnorm.rms_norm_forward(x.detach(), w.detach() if has_w else None, 1e-6)
    ry, rrstd = _rms_reference(x, w, 1e-6)
    close(y, ry.detach())
    close(rstd, rrstd.detach())
    g = torch.randn(shape)
    ry.backward(g)
    dx, dw = rmsnorm.rms_norm_backward(g, x.detach(), rstd, w.detach() if has_w else None)
    close(dx, x.grad)
    if has_w:
        close(dw, w.grad, rtol=1e-5, atol=1e-5)  # a sum over 300 rows, in another order
    else:
        assert dw is None


def test_rms_norm_bf16():
    x = torch.randn(37, 129, dtype=torch.bfloat16)
    w = (torch.rand(129) + 0.5).to(torch.bfloat16)
    y, rstd = rmsnorm.rms_norm_forward(x, w, 1e-6)
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    ry, rrstd = _rms_reference(xf, wf, 1e-6)
    close_bf16(y, ry.detach())
    close(rstd, rrstd.detach())  # statistics are fp32 from the same bf16 values
    g = torch.randn(37, 129, dtype=torch.bfloat16)
    ry.backward(g.float())
    dx, dw = rmsnorm.rms_norm_backward(g, x, rstd, w)
    close_bf16(dx, xf.grad)
    close_bf16(dw, wf.grad, rtol=2e-2, atol=1e-1)  # sums of 37 O(1) terms, bf16 out


# --- cross-entropy ---------------------------------------------------------------------------

def _ce_reference(x, t, reduction, ignore):
    ls = aten._log_softmax(x, 1, False)
    loss, tw = aten.nll_loss_forward(ls, t, None, reduction, ignore)
    return ls, loss, tw


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_cross_entropy(reduction):
    x = torch.randn(37, 129) * 3
    t = torch.randint(0, 129, (37,))
    t[::5] = -100
    loss, tw, lse = ce.cross_entropy_forward(x, t, reduction, -100)
    ls, rloss, rtw = _ce_reference(x, t, reduction, -100)
    close(loss, rloss)
    close(tw, rtw)
    close(lse, torch.logsumexp(x, 1))
    g = torch.randn(rloss.shape)
    dx = ce.cross_entropy_backward(g, x, lse, t, reduction, -100, tw)
    want = aten._log_softmax_backward_data(
        aten.nll_loss_backward(g, ls, t, None, reduction, -100, rtw), ls, 1, x.dtype)
    close(dx, want)
    assert (dx[::5] == 0).all()


def test_cross_entropy_walks_a_long_vocabulary_in_blocks(monkeypatch):
    """A row longer than one block (GPT-2's 50257 on a GPU): the forward's online logsumexp
    over blocks and the backward's per-block programs equal ATen's, the last block partial,
    a target in every block, ignored rows zero."""
    monkeypatch.setattr(ce, "CHUNK", 64)
    x = torch.randn(9, 200) * 4
    x[1, 150:] += 30  # the row's largest values in its last block: the running max moves
    t = torch.tensor([0, 199, 64, 127, 128, -100, 191, 5, 63])
    loss, tw, lse = ce.cross_entropy_forward(x, t, 0, -100)
    ls, rloss, _ = _ce_reference(x, t, 0, -100)
    close(lse, torch.logsumexp(x, 1))
    close(loss, rloss)
    g = torch.randn(9)
    dx = ce.cross_entropy_backward(g, x, lse, t, 0, -100, tw)
    want = aten._log_softmax_backward_data(
        aten.nll_loss_backward(g, ls, t, None, 0, -100, tw), ls, 1, x.dtype)
    close(dx, want)
    assert (dx[5] == 0).all()


def test_cross_entropy_reads_padded_rows_in_place():
    """Logits whose rows are padded (a row stride above the vocabulary, as a matmul output
    laid out for aligned loads has) are read as they lie; the gradient is contiguous."""
    x = (torch.randn(37, 136) * 3)[:, :129]
    t = torch.randint(0, 129, (37,))
    loss, tw, lse = ce.cross_entropy_forward(x, t, 1, -100)
    ls, rloss, rtw = _ce_reference(x.contiguous(), t, 1, -100)
    close(loss, rloss)
    close(lse, torch.logsumexp(x, 1))
    assert ce._rows(x).data_ptr() == x.data_ptr()  # not copied
    dx = ce.cross_entropy_backward(torch.tensor(1.0), x, lse, t, 1, -100, tw)
    want = aten._log_softmax_backward_data(
        aten.nll_loss_backward(torch.tensor(1.0), ls, t, None, 1, -100, rtw), ls, 1, x.dtype)
    assert dx.is_contiguous()
    close(dx, want)


def test_cross_entropy_all_ignored_and_bf16():
    x = torch.randn(6, 10)
    t = torch.full((6,), 3)
    loss, tw, _ = ce.cross_entropy_forward(x, t, 1, 3)
    assert loss.isnan() and tw == 0  # 0 / 0, as ATen
    x = torch.randn(37, 129, dtype=torch.bfloat16) * 3
    t = torch.randint(0, 129, (37,))
    t[::5] = 7  # ignore_index may be a real class
    loss, tw, lse = ce.cross_entropy_forward(x, t, 1, 7)
    ls, rloss, rtw = _ce_reference(x.float(), t, 1, 7)
    close_bf16(loss, rloss)
    close_bf16(tw, rtw, rtol=0, atol=0)
    g = torch.tensor(1.5, dtype=torch.bfloat16)
    dx = ce.cross_entropy_backward(g, x, lse, t, 1, 7, tw)
    want = aten._log_softmax_backward_data(
        aten.nll_loss_backward(g.float(), ls, t, None, 1, 7, rtw), ls, 1, torch.float32)
    close_bf16(dx, want, rtol=2e-2, atol=1e-3)  # entries are O(1/29)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cross_entropy_of_the_fp32_copy_read_from_half_logits(dtype):
    """upcast: the kernels read half-precision logits and compute what they compute on the
    logits' fp32 copy, bit for bit (loss in fp32); grad_dtype: the fp32 gradient rounded
    once to half on the store, equal to the fp32 gradient cast down (as the store rounds
    where it runs: jit.stored_as)."""
    x = (torch.randn(37, 129) * 3).to(dtype)
    t = torch.randint(0, 129, (37,))
    t[::5] = -100
    for reduction in (0, 1, 2):
        want = ce.cross_entropy_forward(x.float(), t, reduction, -100)
        got = ce.cross_entropy_forward(x, t, reduction, -100, True)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)
        loss, tw, lse = want
        g = torch.randn(loss.shape)
        dx32 = ce.cross_entropy_backward(g, x.float(), lse, t, reduction, -100, tw)
        assert torch.equal(ce.cross_entropy_backward(g, x, lse, t, reduction, -100, tw, True),
                           dx32)
        dx = ce.cross_entropy_backward(g, x, lse, t, reduction, -100, tw, True, dtype)
        assert dx.dtype == dtype and torch.equal(dx, stored_as(dx32, dtype))


def test_cross_entropy_ops_lay_out_their_outputs_as_their_fakes_say():
    """The cross-entropy kernels as the custom ops Inductor calls (fxpar::cross_entropy and
    its backward): schema, fake kernels (shapes, strides, dtypes) and AOT dispatch checked
    by torch.library.opcheck; Inductor trusts the fakes' layouts around a fallback op."""
    from fxpar.kernels import library  # noqa: F401 (registers the ops)
    ops = torch.ops.fxpar
    for dtype, upcast, grad_dtype in [(torch.float32, False, None), (torch.bfloat16, True, None),
                                      (torch.bfloat16, True, torch.bfloat16)]:
        x = torch.randn(7, 33).to(dtype)
        t = torch.randint(0, 33, (7,))
        for reduction in (0, 1):
            args = (x, t, reduction, -100, upcast)
            assert torch.library.opcheck(ops.cross_entropy.default, args) == {
                k: "SUCCESS" for k in ("test_schema", "test_autograd_registration",
                                       "test_faketensor", "test_aot_dispatch_dynamic")}
            loss, tw, lse = ops.cross_entropy.default(*args)
            g = torch.ones_like(loss)
            result = torch.library.opcheck(ops.cross_entropy_backward.default,
                                           (g, x, lse, t, reduction, -100, tw, upcast,
                                            grad_dtype))
            assert set(result.values()) == {"SUCCESS"}, result


# --- attention -------------------------------------------------------------------------------

def _flash_ref(*args, backward=False, **kw):
    """ATen's flash attention (forward or backward) as the reference: its CPU kernel, on
    copies of the inputs where the test runs on the GPU, the results moved back."""
    op = (aten._scaled_dot_product_flash_attention_for_cpu_backward if backward else
          aten._scaled_dot_product_flash_attention_for_cpu)
    dev = next(a.device for a in args if isinstance(a, torch.Tensor))
    out = op(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], **kw)
    return [t.to(dev) for t in out]  # .to keeps the strides the test compares


def _attention_check(q, k, v, causal, scale=None, fwd=FP32, bwd=FP32):
    out, lse = attention.flash_attention_forward(q, k, v, causal, scale)
    ref = _flash_ref(q, k, v, 0.0, causal, scale=scale)
    for got, want in zip((out, lse), ref):
        close(got, want, **fwd)
        assert got.stride() == want.stride()
    g = torch.randn_like(out)
    grads = attention.flash_attention_backward(g, q, k, v, *ref, causal, scale)
    refs = _flash_ref(g, q, k, v, *ref, 0.0, causal, scale=scale, backward=True)
    for got, want in zip(grads, refs):
        close(got, want, **bwd)
        assert got.stride() == want.stride()


# grads sum Lk (dq) or Lq (dk, dv) products in another order than ATen, and dS = P * (dP -
# delta) cancels: where it is 0 in exact arithmetic (causal query 0 sees one key) both sides
# carry ~1e-6 of rounding noise, so atol 1e-5 (on entries up to ~5)
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("B,H,Lq,Lk,D,causal", [
    (2, 3, 33, 33, 8, False), (2, 3, 33, 33, 8, True), (2, 3, 33, 33, 24, True),
    (1, 2, 17, 33, 8, True),    # Lq < Lk: top-left causal mask, as torch
    (1, 2, 100, 70, 16, True),  # several blocks each way, Lq > Lk
    (1, 2, 70, 100, 16, False),
    (1, 1, 33, 40, 72, True)])  # fp32 head dim > 64: 32-wide blocks, D padded to 128
def test_attention(B, H, Lq, Lk, D, causal):
    q, k, v = torch.randn(B, H, Lq, D), torch.randn(B, H, Lk, D), torch.randn(B, H, Lk, D)
    _attention_check(q, k, v, causal, bwd=GRAD_TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_grouped_query(causal):
    # 6 query heads over 2 kv heads (HF Llama's num_key_value_heads): dk/dv sum 3 heads
    q, k, v = torch.randn(2, 6, 33, 8), torch.randn(2, 2, 33, 8), torch.randn(2, 2, 33, 8)
    _attention_check(q, k, v, causal, bwd=GRAD_TOL)


def test_attention_strided_and_scale():
    # q, k, v as views of [B, L, H, D] tensors (what a model's transpose(1, 2) gives)
    q, k, v = (torch.randn(2, 33, 3, 8).transpose(1, 2) for _ in range(3))
    _attention_check(q, k, v, True, scale=0.3, bwd=GRAD_TOL)


def test_attention_bf16():
    q, k, v = (torch.randn(2, 3, 33, 24, dtype=torch.bfloat16) for _ in range(3))
    out, lse = attention.flash_attention_forward(q, k, v, True)
    rout, rlse = _flash_ref(q.float(), k.float(), v.float(), 0.0, True)
    close_bf16(out, rout)
    close(lse, rlse, rtol=1e-5, atol=1e-5)  # fp32 scores from the same bf16 values
    g = torch.randn_like(out)
    grads = attention.flash_attention_backward(g, q, k, v, out, lse, True)
    refs = _flash_ref(g.float(), q.float(), k.float(), v.float(), rout, rlse, 0.0, True,
                      backward=True)
    for got, want in zip(grads, refs):  # P and dS are rounded to bf16 before their matmuls
        close_bf16(got, want, rtol=5e-2, atol=5e-2)


# --- supports() ------------------------------------------------------------------------------

def test_supports():
    x = torch.randn(4, 8)
    assert softmax.supports(x, 1) is None
    assert "dtype" in softmax.supports(x.double(), 1)
    assert "block" in softmax.supports(torch.empty(2, 65537, device="meta"), 1)
    assert layernorm.supports(x, [8]) is None
    assert layernorm.supports(x, [4]) is not None
    assert "block" in layernorm.supports(torch.empty(2, 65537, device="meta"), [65537])
    assert rmsnorm.supports(x, torch.randn(8)) is None and rmsnorm.supports(x) is None
    assert rmsnorm.supports(x, torch.randn(4)) is not None
    assert "dtype" in rmsnorm.supports(x.half().int())
    t = torch.zeros(4, dtype=torch.long)
    assert ce.supports(x, t) is None
    assert ce.supports(x, t.float()) is not None
    assert ce.supports(x.reshape(2, 2, 8), t) is not None
    assert ce.supports(torch.empty(4, 130000, device="meta"), t) is None  # Llama 3's 128k
    q = torch.randn(1, 2, 5, 8)
    assert attention.supports(q, q, q, True) is None
    assert attention.supports(q, q[:, :1], q[:, :1]) is None  # grouped-query
    assert attention.supports(q[:, :1], q, q) is not None
    assert attention.supports(q, q[:, :, :, :4], q[:, :, :, :4]) is not None
    assert attention.supports(q, q, q.double()) is not None
    assert attention.supports(q[0], q[0], q[0]) is not None
    big = torch.empty(1, 1, 4, 512, device="meta")
    assert "head dim" in attention.supports(big, big, big)


def _ptxas_missing():
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        get_ptxas(90)
    except Exception as e:  # noqa: BLE001
        return str(e)
    return None


@pytest.mark.slow
@pytest.mark.skipif(_ptxas_missing() is not None, reason="Triton's NVIDIA ptxas not usable")
def test_every_hand_written_kernel_compiles_for_h100(monkeypatch):
    """No GPU here: every kernel launch the wrappers make (fp32 and bf16, causal or not, GQA,
    head dims 8..128) compiles for sm_90 through ptxas, and fits the H100's 227 KiB of
    shared memory."""
    from fxpar.kernels.jit import compile_for_gpu, recording_launches
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU launch configurations
    with recording_launches() as launches:
        for dt in (torch.float32, torch.bfloat16):
            x, y, w = torch.randn(37, 129, dtype=dt), torch.randn(37, 129, dtype=dt), \
                torch.randn(129, dtype=dt)
            softmax.softmax_forward(x, 1)
            softmax.softmax_forward(x, 0, safe=True)
            softmax.softmax_backward(x, y, 1, dt)
            m = torch.zeros(37, 1, dtype=dt)
            layernorm.layer_norm_forward(x, [129], w, w, 1e-5)
            layernorm.layer_norm_backward(x, x, [129], m, m, w, w, [True] * 3)
            rmsnorm.rms_norm_forward(x, w, 1e-6)
            rmsnorm.rms_norm_backward(x, x, torch.ones(37, 1), w)
            t = torch.zeros(37, dtype=torch.long)
            ce.cross_entropy_forward(x, t, 1, -100)
            ce.cross_entropy_backward(torch.tensor(1.0), x, torch.zeros(37), t, 1, -100,
                                      torch.tensor(3.0))
            v = torch.empty(8, 50257, dtype=dt)  # GPT-2's vocabulary: blocks of CHUNK
            ce.cross_entropy_forward(v, t[:8], 1, -100, upcast=True)
            ce.cross_entropy_backward(torch.tensor(1.0), v, torch.zeros(8), t[:8], 1, -100,
                                      torch.tensor(3.0), upcast=True, grad_dtype=dt)
            for d in (8, 128):
                q = torch.randn(2, 4, 70, d, dtype=dt)
                kv = q[:, :2]
                for causal in (False, True):
                    attention.flash_attention_forward(q, kv, kv, causal)
                    attention.flash_attention_backward(q, q, kv, kv, q,
                                                       torch.zeros(2, 4, 70), causal)
    seen = set()
    for k, _, args, kwargs in launches:
        key = (k.fn.__name__, tuple(a.dtype if isinstance(a, torch.Tensor) else
                                    a if not isinstance(a, (int, float)) else type(a)
                                    for a in args), tuple(sorted(map(str, kwargs.items()))))
        if key in seen:
            continue
        seen.add(key)
        compiled = compile_for_gpu(k, args, kwargs)
        assert compiled.metadata.shared <= 227 * 1024, (k.fn.__name__, compiled.metadata.shared)
    assert len(seen) >= 20
