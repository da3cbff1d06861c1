"""Drop-in for flash-linear-attention (fla-core 0.6): fla's chunk_bwd_dqkwg, the step of the chunked
backward of chunk_gated_delta_rule, chunk_simple_gla, chunk_comba, chunk_delta_rule and the other fla
ops that call it, runs headloss's gdn_bwd_dqkwg wherever headloss takes the inputs, and fla's own
kernel otherwise::

    import headloss.fla_backend
    headloss.fla_backend.enable()    # fla's chunked GDN backward now runs ours where it can
    ...
    headloss.fla_backend.disable()   # fla's own kernel again

It registers a backend with fla's backend registry (fla.backends, for the "common" operations), so
fla's dispatch asks `takes` on every call and falls back to its own kernel when it says no; with
FLA_DISABLE_BACKEND_DISPATCH=1 fla bypasses every backend, this one included. fla 0.6 gives gates
in log2 units (exp2), as this assumes.
"""
from __future__ import annotations

from typing import Optional, Tuple

from . import _abi
from ._lib import HeadlossError, cuda_available
from .gdn import gdn_bwd_dqkwg

_HALF = ("torch.bfloat16", "torch.float16")
_enabled = False
_registered = False


def _dt(x) -> str:
    return str(x.dtype)


def takes(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None, state_v_first=False,
          cu_seqlens=None, chunk_size=64, chunk_indices=None, **unknown) -> Tuple[bool, Optional[str]]:
    """Whether headloss runs this chunk_bwd_dqkwg call (fla's arguments), and why not: CUDA tensors,
    contiguous, 16-bit q, k, v, do (w, dv alike), states in that dtype or fp32, HV a multiple of H,
    K and V up to 256, chunks of 64, fp32 gates, cu_seqlens with B = 1."""
    if unknown:
        return False, f"arguments headloss does not know: {sorted(unknown)}"
    if chunk_size != 64:
        return False, f"chunk_size is {chunk_size}; headloss runs 64"
    if g is not None and g_gamma is not None:
        return False, "both g and g_gamma given"
    tensors = dict(q=q, k=k, v=v, do=do, h=h, dh=dh, w=w, g=g, g_gamma=g_gamma, dv=dv, cu_seqlens=cu_seqlens)
    given = {n: x for n, x in tensors.items() if x is not None}
    for n, x in given.items():
        if not getattr(x, "is_cuda", False):
            return False, f"{n} is not a CUDA tensor"
        if not x.is_contiguous():
            return False, f"{n} is not contiguous"
    if len({x.device for x in given.values()}) != 1:
        return False, "tensors on more than one device"
    if _dt(q) not in _HALF:
        return False, f"q is {_dt(q)}; headloss takes bfloat16 and float16"
    for n in ("k", "v", "do", "w", "dv"):
        if n in given and _dt(given[n]) != _dt(q):
            return False, f"{n} is {_dt(given[n])}, q is {_dt(q)}"
    if _dt(h) not in (_dt(q), "torch.float32") or _dt(dh) != _dt(h):
        return False, f"h is {_dt(h)} and dh {_dt(dh)}; need both {_dt(q)} or both float32"
    for n in ("g", "g_gamma"):
        if n in given and _dt(given[n]) != "torch.float32":
            return False, f"{n} is {_dt(given[n])}; headloss takes float32 gates"
    if w is not None and dv is None:
        return False, "w without dv"
    if len(q.shape) != 4 or len(v.shape) != 4 or len(h.shape) != 5:
        return False, "q, v or h of an unexpected rank"
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if tuple(k.shape) != (B, T, H, K) or tuple(v.shape[:2]) != (B, T) or tuple(do.shape) != tuple(v.shape):
        return False, f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if H < 1 or HV % H:
        return False, f"HV = {HV} is not a multiple of H = {H}"
    if not (1 <= K <= 256 and 1 <= V <= 256):
        return False, f"K = {K}, V = {V}; headloss takes 1..256"
    state = (HV, V, K) if state_v_first else (HV, K, V)
    if tuple(h.shape[2:]) != state or h.shape[0] != B or tuple(dh.shape) != tuple(h.shape):
        return False, f"h {tuple(h.shape)}, dh {tuple(dh.shape)}; expected [B, NT, {', '.join(map(str, state))}]"
    if w is not None and tuple(w.shape) != (B, T, HV, K):
        return False, f"w is {tuple(w.shape)}; expected {(B, T, HV, K)}"
    if cu_seqlens is not None and (B != 1 or _dt(cu_seqlens) not in ("torch.int32", "torch.int64")):
        return False, "cu_seqlens needs B = 1 and int32 or int64"
    return True, None


def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                    state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """fla's chunk_bwd_dqkwg (same arguments and results: dq, dk, dw or None, dg or None) by
    headloss. cu_seqlens is not copied to the host (fla's chunk_indices are already prepared)."""
    r = gdn_bwd_dqkwg(q, k, v, do, h, dh, scale=scale, g=g, g_gamma=g_gamma, gate_log2=True,
                      dv=dv if w is not None else None, cu_seqlens=cu_seqlens, check=False,
                      state_v_first=state_v_first)
    return r.dq, r.dk, r.dw, r.dg


def _register():
    from fla.backends import BaseBackend, register

    class HeadlossBackend(BaseBackend):
        backend_type = "headloss"
        priority = 0  # ahead of fla's other CUDA backends (tilelang: 5)

        def is_enabled(self) -> bool:
            return _enabled

        def chunk_bwd_dqkwg_verifier(self, *args, **kwargs):
            return takes(*args, **kwargs)

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            return chunk_bwd_dqkwg(*args, **kwargs)

    register("common")(HeadlossBackend)


def enable() -> None:
    """Routes fla's chunk_bwd_dqkwg to headloss wherever `takes` says yes (idempotent)."""
    global _enabled, _registered
    if not cuda_available():
        raise HeadlossError("headloss.fla_backend: the headloss library has no CUDA backend or sees no GPU",
                            _abi.HL_STATUS_NOT_SUPPORTED)
    if not _registered:
        _register()
        _registered = True
    _enabled = True


def disable() -> None:
    """fla's own chunk_bwd_dqkwg again for every call."""
    global _enabled
    _enabled = False


def enabled() -> bool:
    return _enabled
