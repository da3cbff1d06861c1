"""RMSNorm forward and backward: y = (s * rstd) * (offset + w), s = x (+ residual)."""
from __future__ import annotations

import ctypes
from typing import Any, NamedTuple, Optional

from . import _abi
from ._arrays import FLOATS, dtype_code, empty, expect
from ._lib import DTYPE_F32, HeadlossValueError, check, code_of, declare, descriptor, named

CASTS = named("HL_RMSNORM_CAST_")  # "llama", "gemma", "none"
_fwd = declare("hl_rmsnorm_fwd", ctypes.POINTER(_abi.hl_rmsnorm_fwd_args_t), ctypes.c_void_p)
_bwd = declare("hl_rmsnorm_bwd", ctypes.POINTER(_abi.hl_rmsnorm_bwd_args_t), ctypes.c_void_p)
_bwd_ws = declare("hl_rmsnorm_bwd_workspace_size", ctypes.POINTER(_abi.hl_rmsnorm_bwd_args_t),
                  ctypes.POINTER(ctypes.c_size_t))


class RMSNormOutput(NamedTuple):
    y: Any
    residual_out: Optional[Any]  # x + residual, when a residual was fused
    rstd: Optional[Any]          # fp32 [rows], when asked for


class RMSNormGrads(NamedTuple):
    dx: Any                      # gradient of x (and of the fused residual)
    dw: Optional[Any]            # gradient of the weight, when there is one


def cast_code(cast: str) -> int:
    """HL_RMSNORM_CAST_* of a name in CASTS."""
    return code_of(CASTS, "cast", cast)


def _lone(given, needs, name: str, needed: str) -> None:
    if given is not None and needs is None:
        raise HeadlossValueError(f"{name} is given without {needed}")


def rmsnorm_fwd(x, weight=None, *, eps: float = 1e-6, offset: float = 0.0, cast: str = "llama",
                residual=None, out_dtype=None, return_rstd: bool = False, out=None,
                residual_out=None, rstd=None) -> RMSNormOutput:
    """RMSNorm over the last dimension of x.

    x: [..., N] float32/float16/bfloat16 array (NumPy runs on the CPU backend; PyTorch, CuPy and
    JAX device arrays on the CUDA backend, on the array's current stream). weight: optional [N]
    (float32/float16/bfloat16). residual: optional, x's shape and dtype; then s = x + residual is
    normalised and returned as residual_out. eps (default 1e-6; the library adds what it is
    given), offset (default 0; Gemma: 1), cast: "llama" (default), "gemma" or "none". rstd (fp32,
    one per row) is computed only when return_rstd is true or an rstd buffer is passed.
    out ([..., N], out_dtype or x's dtype) / residual_out / rstd: optional preallocated outputs.
    Every array is checked against x's rows and N (HeadlossError naming it) before the call.
    """
    xv = expect(x, "x", FLOATS, matrix=True)
    rows, cols = xv.rows, xv.shape[-1]
    wv = expect(weight, "weight", FLOATS, shape=(cols,), packed=True, like=xv)
    rv = expect(residual, "residual", xv.dtype, rows=rows, cols=cols, like=xv)
    _lone(residual_out, residual, "residual_out", "residual")
    ydt = None if out_dtype is None else dtype_code(out_dtype, "out_dtype")
    y = empty(xv, xv.shape, ydt or xv.dtype) if out is None else out
    yv = expect(y, "out", ydt or FLOATS, rows=rows, cols=cols, like=xv)
    res_out = None
    if rv is not None:
        res_out = empty(xv, xv.shape, xv.dtype) if residual_out is None else residual_out
    rov = expect(res_out, "residual_out", xv.dtype, rows=rows, cols=cols, like=xv)
    if rstd is None and return_rstd:
        rstd = empty(xv, (rows,), DTYPE_F32)
    sv = expect(rstd, "rstd", DTYPE_F32, size=rows, like=xv)
    a = descriptor(_abi.hl_rmsnorm_fwd_args_t, backend=xv.backend, rows=rows, cols=cols,
                   cast=cast_code(cast), eps=eps, offset=offset, x_dtype=xv.dtype, x=xv.ptr,
                   x_stride=xv.stride, y_dtype=yv.dtype, y=yv.ptr, y_stride=yv.stride)
    if rv is not None:
        a.residual, a.residual_stride = rv.ptr, rv.stride
        a.residual_out, a.residual_out_stride = rov.ptr, rov.stride
    if wv is not None:
        a.weight_dtype, a.weight = wv.dtype, wv.ptr
    if sv is not None:
        a.rstd = sv.ptr
    check(_fwd(ctypes.byref(a), xv.stream))
    return RMSNormOutput(y, res_out, rstd)


def rmsnorm(x, weight=None, *, eps: float = 1e-6, offset: float = 0.0, cast: str = "llama"):
    """y = RMSNorm(x) * (offset + weight); see rmsnorm_fwd for the options and their defaults."""
    return rmsnorm_fwd(x, weight, eps=eps, offset=offset, cast=cast).y


def rmsnorm_bwd(dy, x, weight=None, rstd=None, *, eps: float = 1e-6, offset: float = 0.0,
                cast: str = "llama", dresidual_out=None, dw_dtype=None, dx=None, dw=None) -> RMSNormGrads:
    """Gradients of rmsnorm_fwd. x is the normalised input s (x + residual when fused) [..., N];
    dy like it (any float dtype); rstd fp32 [rows] from the forward, or None to recompute it with
    eps (default 1e-6). dresidual_out: gradient flowing into the forward's residual_out (x's
    shape and dtype), added to dx. dw [N] (dw_dtype: float32 or the weight's, the default) is
    reduced over rows deterministically in fp32. dx / dw: optional preallocated outputs.
    Options as rmsnorm_fwd; every array is checked before the call."""
    xv = expect(x, "x", FLOATS, matrix=True)
    rows, cols = xv.rows, xv.shape[-1]
    dyv = expect(dy, "dy", FLOATS, rows=rows, cols=cols, like=xv)
    wv = expect(weight, "weight", FLOATS, shape=(cols,), packed=True, like=xv)
    sv = expect(rstd, "rstd", DTYPE_F32, size=rows, like=xv)
    drv = expect(dresidual_out, "dresidual_out", xv.dtype, rows=rows, cols=cols, like=xv)
    dx = empty(xv, xv.shape, xv.dtype) if dx is None else dx
    dxv = expect(dx, "dx", xv.dtype, rows=rows, cols=cols, like=xv)
    _lone(dw, weight, "dw", "weight")
    dwdt = None if dw_dtype is None else dtype_code(dw_dtype, "dw_dtype")
    if wv is not None and dw is None:
        dw = empty(xv, (cols,), dwdt or wv.dtype)
    dwv = expect(dw, "dw", dwdt or (DTYPE_F32, wv.dtype) if wv is not None else None, shape=(cols,),
                 packed=True, like=xv)
    a = descriptor(_abi.hl_rmsnorm_bwd_args_t, backend=xv.backend, rows=rows, cols=cols,
                   cast=cast_code(cast), eps=eps, offset=offset, x_dtype=xv.dtype, x=xv.ptr,
                   x_stride=xv.stride, dy_dtype=dyv.dtype, dy=dyv.ptr, dy_stride=dyv.stride,
                   dx=dxv.ptr, dx_stride=dxv.stride)
    if sv is not None:
        a.rstd = sv.ptr
    if wv is not None:
        a.weight_dtype, a.weight = wv.dtype, wv.ptr
        a.dw_dtype, a.dw = dwv.dtype, dwv.ptr
    if drv is not None:
        a.dresidual_out, a.dresidual_out_stride = drv.ptr, drv.stride
    nbytes = ctypes.c_size_t(0)
    check(_bwd_ws(ctypes.byref(a), ctypes.byref(nbytes)))
    ws = None
    if nbytes.value:
        ws = empty(xv, ((nbytes.value + 3) // 4,), DTYPE_F32)
        a.workspace, a.workspace_bytes = expect(ws, "workspace").ptr, nbytes.value
    check(_bwd(ctypes.byref(a), xv.stream))
    return RMSNormGrads(dx, dw)
