"""RMSNorm forward and backward: y = (s * rstd) * (offset + w), s = x (+ residual)."""
from __future__ import annotations

import ctypes
from typing import Any, NamedTuple, Optional

from . import _arrays
from ._arrays import ArrayView, dtype_code, empty, same_place, view
from ._lib import DTYPE_F32, check, declare

_CAST = {"llama": 0, "gemma": 1, "none": 2}
c_i64, c_ptr, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _FwdArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("backend", c_int), ("rows", c_i64),
                ("cols", c_i64), ("cast", c_int), ("eps", c_float), ("offset", c_float),
                ("x_dtype", c_int), ("x", c_ptr), ("x_stride", c_i64),
                ("residual", c_ptr), ("residual_stride", c_i64),
                ("residual_out", c_ptr), ("residual_out_stride", c_i64),
                ("weight_dtype", c_int), ("weight", c_ptr),
                ("y_dtype", c_int), ("y", c_ptr), ("y_stride", c_i64), ("rstd", c_ptr)]


class _BwdArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("backend", c_int), ("rows", c_i64),
                ("cols", c_i64), ("cast", c_int), ("eps", c_float), ("offset", c_float),
                ("x_dtype", c_int), ("x", c_ptr), ("x_stride", c_i64), ("rstd", c_ptr),
                ("weight_dtype", c_int), ("weight", c_ptr),
                ("dy_dtype", c_int), ("dy", c_ptr), ("dy_stride", c_i64),
                ("dresidual_out", c_ptr), ("dresidual_out_stride", c_i64),
                ("dx", c_ptr), ("dx_stride", c_i64), ("dresidual", c_ptr), ("dresidual_stride", c_i64),
                ("dw_dtype", c_int), ("dw", c_ptr),
                ("workspace", c_ptr), ("workspace_bytes", ctypes.c_size_t)]


_fwd = declare("rmsnorm_fwd", ctypes.POINTER(_FwdArgs), c_ptr)
_bwd = declare("rmsnorm_bwd", ctypes.POINTER(_BwdArgs), c_ptr)
_bwd_ws = declare("rmsnorm_bwd_workspace_size", ctypes.POINTER(_BwdArgs), ctypes.POINTER(ctypes.c_size_t))


class RMSNormOutput(NamedTuple):
    y: Any
    residual_out: Optional[Any]  # x + residual, when a residual was fused
    rstd: Optional[Any]          # fp32 [rows], when asked for


class RMSNormGrads(NamedTuple):
    dx: Any                      # gradient of x (and of the fused residual)
    dw: Optional[Any]            # gradient of the weight, when there is one


def _cast_code(cast: str) -> int:
    if cast not in _CAST:
        raise ValueError(f"cast must be one of {sorted(_CAST)}, got {cast!r}")
    return _CAST[cast]


def _opt(x, name) -> Optional[ArrayView]:
    return None if x is None else view(x, name)


def rmsnorm_fwd(x, weight=None, *, eps: float = 1e-6, offset: float = 0.0, cast: str = "llama",
                residual=None, out_dtype=None, return_rstd: bool = False, out=None,
                residual_out=None, rstd=None) -> RMSNormOutput:
    """RMSNorm over the last dimension of x.

    x: [..., N] float32/float16/bfloat16 array (NumPy runs on the CPU backend; PyTorch, CuPy and
    JAX device arrays on the CUDA backend, on the array's current stream). weight: optional [N].
    residual: optional, same shape as x; then s = x + residual is normalised and returned as
    residual_out. rstd (fp32, one per row) is computed only when return_rstd is true or an rstd
    buffer is passed. out / residual_out / rstd: optional preallocated outputs.
    """
    xv = view(x, "x")
    rows, cols, xs = xv.rows_view("x")
    wv, rv = _opt(weight, "weight"), _opt(residual, "residual")
    ydt = xv.dtype if out_dtype is None else dtype_code(out_dtype)
    y = empty(xv, xv.shape, ydt) if out is None else out
    yv = view(y, "out")
    res_out = None
    if rv is not None:
        res_out = empty(xv, xv.shape, xv.dtype) if residual_out is None else residual_out
    rov = _opt(res_out, "residual_out")
    if rstd is None and return_rstd:
        rstd = empty(xv, (rows,), DTYPE_F32)
    sv = _opt(rstd, "rstd")
    backend = same_place([xv, wv, rv, rov, yv, sv], "rmsnorm_fwd")
    a = _FwdArgs(ctypes.sizeof(_FwdArgs), backend, rows, cols, _cast_code(cast), eps, offset,
                 xv.dtype, xv.ptr, xs)
    if rv is not None:
        a.residual, a.residual_stride = rv.ptr, rv.rows_view("residual")[2]
        a.residual_out, a.residual_out_stride = rov.ptr, rov.rows_view("residual_out")[2]
    if wv is not None:
        a.weight_dtype, a.weight = wv.dtype, wv.ptr
    a.y_dtype, a.y, a.y_stride = yv.dtype, yv.ptr, yv.rows_view("out")[2]
    if sv is not None:
        a.rstd = sv.ptr
    check(_fwd(ctypes.byref(a), xv.stream))
    return RMSNormOutput(y, res_out, rstd)


def rmsnorm(x, weight=None, *, eps: float = 1e-6, offset: float = 0.0, cast: str = "llama"):
    """y = RMSNorm(x) * (offset + weight); see rmsnorm_fwd for the options."""
    return rmsnorm_fwd(x, weight, eps=eps, offset=offset, cast=cast).y


def rmsnorm_bwd(dy, x, weight=None, rstd=None, *, eps: float = 1e-6, offset: float = 0.0,
                cast: str = "llama", dresidual_out=None, dw_dtype=None, dx=None, dw=None) -> RMSNormGrads:
    """Gradients of rmsnorm_fwd. x is the normalised input s (x + residual when fused);
    rstd from the forward, or None to recompute it. dresidual_out: gradient flowing into the
    forward's residual_out, added to dx. dw is reduced over rows deterministically in fp32."""
    xv, dyv = view(x, "x"), view(dy, "dy")
    rows, cols, xs = xv.rows_view("x")
    wv, sv, drv = _opt(weight, "weight"), _opt(rstd, "rstd"), _opt(dresidual_out, "dresidual_out")
    dx = empty(xv, xv.shape, xv.dtype) if dx is None else dx
    dxv = view(dx, "dx")
    if wv is not None and dw is None:
        dw = empty(xv, (cols,), wv.dtype if dw_dtype is None else dtype_code(dw_dtype))
    dwv = _opt(dw, "dw")
    backend = same_place([xv, dyv, wv, sv, drv, dxv, dwv], "rmsnorm_bwd")
    a = _BwdArgs(ctypes.sizeof(_BwdArgs), backend, rows, cols, _cast_code(cast), eps, offset,
                 xv.dtype, xv.ptr, xs)
    if sv is not None:
        a.rstd = sv.ptr
    if wv is not None:
        a.weight_dtype, a.weight = wv.dtype, wv.ptr
        a.dw_dtype, a.dw = dwv.dtype, dwv.ptr
    a.dy_dtype, a.dy, a.dy_stride = dyv.dtype, dyv.ptr, dyv.rows_view("dy")[2]
    if drv is not None:
        a.dresidual_out, a.dresidual_out_stride = drv.ptr, drv.rows_view("dresidual_out")[2]
    a.dx, a.dx_stride = dxv.ptr, dxv.rows_view("dx")[2]
    nbytes = ctypes.c_size_t(0)
    check(_bwd_ws(ctypes.byref(a), ctypes.byref(nbytes)))
    ws = None
    if nbytes.value:
        ws = empty(xv, ((nbytes.value + 3) // 4,), DTYPE_F32)
        a.workspace, a.workspace_bytes = view(ws, "workspace").ptr, nbytes.value
    check(_bwd(ctypes.byref(a), xv.stream))
    return RMSNormGrads(dx, dw)
