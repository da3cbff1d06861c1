"""Gated DeltaNet backward, the chunk_bwd_dqkwg step: dq, dk, dw, dg (see headloss.h)."""
from __future__ import annotations

import ctypes
import math
from typing import Any, NamedTuple, Optional

from . import _abi
from ._arrays import INTS, empty, expect
from ._lib import (DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_I64, HeadlossValueError, check as _check_status,
                   declare, descriptor)

_run = declare("hl_gdn_bwd_dqkwg", ctypes.POINTER(_abi.hl_gdn_bwd_dqkwg_args_t), ctypes.c_void_p)
_ws = declare("hl_gdn_bwd_dqkwg_workspace_size", ctypes.POINTER(_abi.hl_gdn_bwd_dqkwg_args_t),
              ctypes.POINTER(ctypes.c_size_t))


class GDNGrads(NamedTuple):
    dq: Any            # [B,T,H,K], summed over the value heads of each q/k head
    dk: Any            # [B,T,H,K]
    dw: Optional[Any]  # [B,T,HV,K] when dv was given
    dg: Optional[Any]  # [B,T,HV] fp32 with a per-token gate g


def _gate(g, g_gamma, gate_log2: bool) -> int:
    if g is not None:
        return _abi.HL_GDN_GATE_LOG2 if gate_log2 else _abi.HL_GDN_GATE_LOG
    if g_gamma is not None:
        return _abi.HL_GDN_GATE_CONST_DECAY_LOG2 if gate_log2 else _abi.HL_GDN_GATE_CONST_DECAY
    return _abi.HL_GDN_GATE_NONE


def gdn_bwd_dqkwg(q, k, v, do, h, dh, *, scale: Optional[float] = None, g=None, g_gamma=None,
                  gate_log2: bool = False, dv=None, cu_seqlens=None, reverse_cumsum: bool = False,
                  check: bool = True, state_v_first: bool = False,
                  out: Optional[GDNGrads] = None) -> GDNGrads:
    """q, k [B,T,H,K]; v (v_new), do [B,T,HV,V]; h, dh [B,NT,HV,K,V] ([B,NT,HV,V,K] with
    state_v_first, as fla's option of that name); g [B,T,HV] fp32 chunk-local cumulative gate or
    g_gamma [HV] fp32 constant decay (gate_log2: exp2 units, as fla 0.6); dv [B,T,HV,V] turns on
    dw; cu_seqlens [S+1] int32/int64 with B = 1 (NT is h.shape[1]). q, k, v, do, dv share one
    16-bit dtype (float16 / bfloat16); h, dh that one or float32. Every array is contiguous.
    scale: None (default) is the library's K ** -0.5 (0 is refused: it would mean the same).
    NumPy arrays run on the CPU backend, device arrays on CUDA.
    check=False (CUDA varlen): cu_seqlens is not copied to the host and checked, so the call does
    not synchronise the stream (HL_GDN_UNCHECKED; a CUDA graph can capture it).
    out: GDNGrads of preallocated dq, dk [B,T,H,K], dw [B,T,HV,K] (with dv), dg [B,T,HV] fp32
    (with g). Every array is checked against q's and v's shapes before the call."""
    if g is not None and g_gamma is not None:
        raise HeadlossValueError("g and g_gamma are both given; pass one gate")
    if scale is not None and scale == 0:
        raise HeadlossValueError("scale is 0; pass None for the default K ** -0.5")
    qv = expect(q, "q", (DTYPE_F16, DTYPE_BF16), shape=(None,) * 4, packed=True)
    B, T, H, K = qv.shape
    vv = expect(v, "v", qv.dtype, shape=(B, T, None, None), packed=True, like=qv)
    HV, V = vv.shape[2:]
    hv = expect(h, "h", (qv.dtype, DTYPE_F32), shape=(B, None, HV) + ((V, K) if state_v_first else (K, V)),
                packed=True, like=qv)
    both = dict(packed=True, like=qv)
    kv = expect(k, "k", qv.dtype, shape=qv.shape, **both)
    dov = expect(do, "do", qv.dtype, shape=vv.shape, **both)
    dhv = expect(dh, "dh", hv.dtype, shape=hv.shape, **both)
    dvv = expect(dv, "dv", qv.dtype, shape=vv.shape, **both)
    gv = expect(g, "g", DTYPE_F32, shape=(B, T, HV), **both)
    gg = expect(g_gamma, "g_gamma", DTYPE_F32, shape=(HV,), **both)
    cv = expect(cu_seqlens, "cu_seqlens", INTS, shape=(None,), **both)
    if out is None:
        out = GDNGrads(empty(qv, qv.shape, qv.dtype), empty(qv, qv.shape, qv.dtype),
                       None if dvv is None else empty(qv, (B, T, HV, K), qv.dtype),
                       None if gv is None else empty(qv, (B, T, HV), DTYPE_F32))
    for name, x, given in (("dw", out.dw, dv), ("dg", out.dg, g)):
        if x is not None and given is None:
            raise HeadlossValueError(f"out.{name} is given without {'dv' if name == 'dw' else 'g'}")
    dq = expect(out.dq, "out.dq", qv.dtype, shape=qv.shape, **both)
    dk = expect(out.dk, "out.dk", qv.dtype, shape=qv.shape, **both)
    dw = expect(out.dw, "out.dw", qv.dtype, shape=(B, T, HV, K), **both)
    dg = expect(out.dg, "out.dg", DTYPE_F32, shape=(B, T, HV), **both)
    ptr = lambda x: 0 if x is None else x.ptr  # noqa: E731
    a = descriptor(_abi.hl_gdn_bwd_dqkwg_args_t, backend=qv.backend, B=B, T=T, H=H, HV=HV, K=K, V=V,
                   num_chunks=hv.shape[1], dtype=qv.dtype, h_dtype=hv.dtype, q=qv.ptr, k=kv.ptr,
                   v=vv.ptr, do_=dov.ptr, h=hv.ptr, dh=dhv.ptr, dv=ptr(dvv), dq=dq.ptr, dk=dk.ptr,
                   dw=ptr(dw), gate=_gate(gv, gg, gate_log2), g=ptr(gv), g_gamma=ptr(gg), dg=ptr(dg),
                   reverse_cumsum=int(reverse_cumsum), scale=scale or 0.0,
                   flags=(0 if check else _abi.HL_GDN_UNCHECKED) |
                   (_abi.HL_GDN_STATE_V_FIRST if state_v_first else 0))
    if cv is not None:
        a.cu_seqlens_dtype, a.cu_seqlens, a.num_seqs = cv.dtype, cv.ptr, cv.shape[0] - 1
    n = ctypes.c_size_t(0)
    _check_status(_ws(ctypes.byref(a), ctypes.byref(n)))
    ws = None
    if n.value:
        ws = empty(qv, (math.ceil(n.value / 8),), DTYPE_I64)
        a.workspace, a.workspace_bytes = expect(ws, "workspace").ptr, n.value
    _check_status(_run(ctypes.byref(a), qv.stream))
    return out
