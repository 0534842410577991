"""Where Triton kernels can run, and a lazily compiled `@kernel` decorator.

Triton compiles for NVIDIA/AMD GPUs; on a CPU it can only run its interpreter
(TRITON_INTERPRET=1, numpy under the hood: exact but slow). `triton.jit` decides between
compiled and interpreted when it decorates, so a kernel decorated at import time would be
stuck with whatever the environment said then. `kernel` defers that choice to the first
launch and keeps one variant per mode.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # pragma: no cover - triton is a dependency
        return f"triton cannot be imported ({e})"
    return None


def unavailable_reason(device: torch.device | str) -> str | None:
    """None if Triton kernels can run on `device`, else why not (for logs and errors)."""
    err = _triton_import_error()
    if err:
        return err
    device = torch.device(device)
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if interpreting():
            return None
        return ("Triton compiles for GPUs only; on CPU set TRITON_INTERPRET=1 to run the "
                "kernels in Triton's interpreter (slow, for testing)")
    return f"Triton kernels do not run on {device.type} devices"


class kernel:
    """`@kernel` instead of `@triton.jit`: compiled (or interpreted) at first launch.

    Usage is the same: `my_kernel[grid](*args, BLOCK=...)`."""

    def __init__(self, fn):
        self.fn = fn
        self._variants: dict[bool, object] = {}
        functools.update_wrapper(self, fn)

    def _get(self):
        mode = interpreting()
        k = self._variants.get(mode)
        if k is None:
            import triton
            k = self._variants[mode] = triton.jit(self.fn)
        return k

    def __getitem__(self, grid):
        launch = self._get()[grid]
        if not interpreting():
            return launch

        def run(*args, **kwargs):
            # the interpreter evaluates masked-off lanes too (e.g. -inf - -inf): harmless
            import numpy as np
            with np.errstate(all="ignore"), _interpretable_stdlib():
                return launch(*args, **kwargs)
        return run


_INTERPRETED: dict = {}


def _twin(fn):
    """An interpreted copy of a triton.language helper. Triton's own InterpretedFunction
    patches triton.language.core for a nested call and never restores it, which breaks later
    GPU compilation in the same process; this one restores what it patched."""
    from triton.runtime.interpreter import InterpretedFunction, _patch_lang

    class Twin(InterpretedFunction):
        def __call__(self, *args, **kwargs):
            scope = _patch_lang(self.fn)
            try:
                return self.rewrite()(*args, **kwargs)
            finally:
                scope.restore()
    return Twin(fn)


@contextlib.contextmanager
def _interpretable_stdlib():
    """triton.language's own helpers (tl.sum, tl.max, ...) are `@triton.jit` functions bound
    when triton was imported; if that happened before TRITON_INTERPRET=1 was set (torch
    imports triton early), the interpreter refuses to call them. Swap in interpreted twins
    for the duration of a launch."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction
    saved = []
    for mod in (tl, tl.standard, tl.math, tl.core):
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction):
                twin = _INTERPRETED.get(obj)
                if twin is None:
                    twin = _INTERPRETED[obj] = _twin(obj.fn)
                saved.append((mod, name, obj))
                setattr(mod, name, twin)
    try:
        yield
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)


@contextlib.contextmanager
def interpreter():
    """Run Triton kernels in the interpreter inside this block (tests on CPU)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def stored_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `x` as a kernel's `.to(dtype)` store gives it where the kernel runs: on a GPU
    rounded to nearest even (torch's cast); in Triton's interpreter (3.x) an fp32 -> bf16
    store truncates the mantissa instead (one bf16 ulp toward zero at most)."""
    if dtype == torch.bfloat16 and x.device.type == "cpu" and \
            os.environ.get("TRITON_INTERPRET") == "1":
        return (x.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return x.to(dtype)


def is_fake(t) -> bool:
    """A fake or meta tensor (tracing, planning): run the reference ops, never a kernel."""
    global _FakeTensor
    if _FakeTensor is None:  # imported on first use (an import per call cost ~1 us)
        from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
    return isinstance(t, _FakeTensor) or (isinstance(t, torch.Tensor) and t.is_meta)


_FakeTensor = None


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def row_blocks(rows: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_N >= n columns, num_warps) for a kernel holding whole rows of n:
    about 4096 elements per program."""
    block_n = next_pow2(n)
    block_m = max(1, min(next_pow2(rows), 4096 // block_n))
    return block_m, block_n, min(16, max(4, block_m * block_n // 1024))


_TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
       torch.int32: "i32", torch.bool: "i1", torch.uint8: "u8"}


@contextlib.contextmanager
def recording_launches():
    """Launches inside the block are recorded, not run: yields a list of
    (kernel, grid, args, kwargs). With `compile_for_gpu` this checks on a machine without a
    GPU that what the wrappers would launch compiles for one."""
    launches = []
    old = kernel.__getitem__

    def record(self, grid):
        return lambda *args, **kwargs: launches.append((self, grid, args, kwargs))
    kernel.__getitem__ = record
    try:
        yield launches
    finally:
        kernel.__getitem__ = old


def compile_for_gpu(k: "kernel", args, kwargs, arch: int = 90):
    """Compile one recorded launch for an NVIDIA target (sm_90 = H100/H200) through ptxas,
    without a GPU. Returns Triton's compiled kernel (its metadata has registers/shared memory)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = triton.jit(k.fn)
    kw = dict(kwargs)
    opts = {o: kw.pop(o) for o in ("num_warps", "num_stages") if o in kw}
    vals = dict(zip(fn.arg_names, args))
    vals.update(kw)
    sig, consts = {}, {}
    for i, name in enumerate(fn.arg_names):
        v = vals[name]
        if fn.params[i].is_constexpr:
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TY[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if abs(v) < 2 ** 31 else "i64"
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v is None:
            sig[name], consts[name] = "constexpr", None
        else:
            raise TypeError(f"cannot type argument {name}={v!r}")
    return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32),
                          options=opts)
