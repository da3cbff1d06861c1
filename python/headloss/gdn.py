"""Gated DeltaNet backward, the chunk_bwd_dqkwg step: dq, dk, dw, dg (see headloss.h)."""
from __future__ import annotations

import ctypes
import math
from typing import Any, NamedTuple, Optional

from ._arrays import ArrayView, empty, same_place, view
from ._lib import DTYPE_F32, DTYPE_I64, check as _check_status, declare

c_i64, c_ptr, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
GATE_NONE, GATE_LOG, GATE_LOG2, GATE_CONST_DECAY, GATE_CONST_DECAY_LOG2 = 0, 1, 2, 3, 4
UNCHECKED, STATE_V_FIRST = 1, 2  # HL_GDN_UNCHECKED, HL_GDN_STATE_V_FIRST


class _Args(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("backend", c_int),
                ("B", c_i64), ("T", c_i64), ("H", c_i64), ("HV", c_i64), ("K", c_i64), ("V", c_i64),
                ("num_chunks", c_i64), ("dtype", c_int), ("h_dtype", c_int),
                ("q", c_ptr), ("k", c_ptr), ("v", c_ptr), ("do_", c_ptr), ("h", c_ptr), ("dh", c_ptr),
                ("dv", c_ptr), ("dq", c_ptr), ("dk", c_ptr), ("dw", c_ptr),
                ("gate", c_int), ("g", c_ptr), ("g_gamma", c_ptr), ("dg", c_ptr),
                ("reverse_cumsum", c_int), ("scale", c_float),
                ("cu_seqlens_dtype", c_int), ("cu_seqlens", c_ptr), ("num_seqs", c_i64),
                ("workspace", c_ptr), ("workspace_bytes", ctypes.c_size_t), ("flags", ctypes.c_uint)]


_run = declare("gdn_bwd_dqkwg", ctypes.POINTER(_Args), c_ptr)
_ws = declare("gdn_bwd_dqkwg_workspace_size", ctypes.POINTER(_Args), ctypes.POINTER(ctypes.c_size_t))


class GDNGrads(NamedTuple):
    dq: Any            # [B,T,H,K], summed over the value heads of each q/k head
    dk: Any            # [B,T,H,K]
    dw: Optional[Any]  # [B,T,HV,K] when dv was given
    dg: Optional[Any]  # [B,T,HV] fp32 with a per-token gate g


def _contig(x: Optional[ArrayView], name: str) -> int:
    if x is None:
        return 0
    acc = 1
    for n, s in reversed(list(zip(x.shape, x.strides))):
        if n != 1 and s != acc:
            raise ValueError(f"{name} must be contiguous (shape {x.shape}, strides {x.strides})")
        acc *= n
    return x.ptr


def gdn_bwd_dqkwg(q, k, v, do, h, dh, *, scale: Optional[float] = None, g=None, g_gamma=None,
                  gate_log2: bool = False, dv=None, cu_seqlens=None, reverse_cumsum: bool = False,
                  check: bool = True, state_v_first: bool = False,
                  out: Optional[GDNGrads] = None) -> GDNGrads:
    """q, k [B,T,H,K]; v (v_new), do [B,T,HV,V]; h, dh [B,NT,HV,K,V] ([B,NT,HV,V,K] with
    state_v_first, as fla's option of that name); g [B,T,HV] fp32 chunk-local cumulative gate or
    g_gamma [HV] fp32 constant decay (gate_log2: exp2 units, as fla 0.6); dv [B,T,HV,V] turns on
    dw; cu_seqlens [S+1] int32/int64 with B = 1 (NT is h.shape[1]). scale defaults to K ** -0.5.
    NumPy arrays run on the CPU backend, device arrays on CUDA.
    check=False (CUDA varlen): cu_seqlens is not copied to the host and checked, so the call does
    not synchronise the stream (HL_GDN_UNCHECKED; a CUDA graph can capture it)."""
    if g is not None and g_gamma is not None:
        raise ValueError("pass g or g_gamma, not both")
    qv, kv, vv, dov, hv, dhv = (view(x, n) for x, n in
                                ((q, "q"), (k, "k"), (v, "v"), (do, "do"), (h, "h"), (dh, "dh")))
    gv = None if g is None else view(g, "g")
    gg = None if g_gamma is None else view(g_gamma, "g_gamma")
    dvv = None if dv is None else view(dv, "dv")
    cv = None if cu_seqlens is None else view(cu_seqlens, "cu_seqlens")
    if len(qv.shape) != 4 or len(vv.shape) != 4 or len(hv.shape) != 5:
        raise ValueError("expected q [B,T,H,K], v [B,T,HV,V], h [B,NT,HV,K,V]")
    B, T, H, K = qv.shape
    HV, V = vv.shape[2], vv.shape[3]
    for name, x, shape in (("k", kv, qv.shape), ("do", dov, vv.shape), ("dh", dhv, hv.shape),
                           ("dv", dvv, vv.shape), ("g", gv, (B, T, HV)), ("g_gamma", gg, (HV,))):
        if x is not None and tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {x.shape}; expected {shape}")
    if vv.shape[:2] != (B, T) or tuple(hv.shape[2:]) != ((HV, V, K) if state_v_first else (HV, K, V)) \
            or hv.shape[0] != B:
        raise ValueError(f"shapes disagree: q {qv.shape}, v {vv.shape}, h {hv.shape}")
    if out is None:
        out = GDNGrads(empty(qv, qv.shape, qv.dtype), empty(qv, qv.shape, qv.dtype),
                       None if dvv is None else empty(qv, (B, T, HV, K), qv.dtype),
                       None if gv is None else empty(qv, (B, T, HV), DTYPE_F32))
    ov = [None if x is None else view(x, n) for x, n in zip(out, ("dq", "dk", "dw", "dg"))]
    backend = same_place([qv, kv, vv, dov, hv, dhv, gv, gg, dvv, cv] + ov, "gdn_bwd_dqkwg")
    gate = GATE_NONE
    if gv is not None:
        gate = GATE_LOG2 if gate_log2 else GATE_LOG
    elif gg is not None:
        gate = GATE_CONST_DECAY_LOG2 if gate_log2 else GATE_CONST_DECAY
    a = _Args(ctypes.sizeof(_Args), backend, B, T, H, HV, K, V, hv.shape[1], qv.dtype, hv.dtype,
              _contig(qv, "q"), _contig(kv, "k"), _contig(vv, "v"), _contig(dov, "do"),
              _contig(hv, "h"), _contig(dhv, "dh"), _contig(dvv, "dv"),
              _contig(ov[0], "dq"), _contig(ov[1], "dk"), _contig(ov[2], "dw"),
              gate, _contig(gv, "g"), _contig(gg, "g_gamma"), _contig(ov[3], "dg"),
              int(reverse_cumsum), K ** -0.5 if scale is None else scale)
    if cv is not None:
        a.cu_seqlens_dtype, a.cu_seqlens, a.num_seqs = cv.dtype, _contig(cv, "cu_seqlens"), cv.shape[0] - 1
    a.flags = (0 if check else UNCHECKED) | (STATE_V_FIRST if state_v_first else 0)
    n = ctypes.c_size_t(0)
    _check_status(_ws(ctypes.byref(a), ctypes.byref(n)))
    ws = None
    if n.value:
        ws = empty(qv, (math.ceil(n.value / 8),), DTYPE_I64)
        a.workspace, a.workspace_bytes = view(ws, "workspace").ptr, n.value
    _check_status(_run(ctypes.byref(a), qv.stream))
    return out
