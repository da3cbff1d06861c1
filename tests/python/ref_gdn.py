"""Independent fp64 NumPy reference of gdn_bwd_dqkwg (the header's formulas), written from the math, not the code.

Two forms of dg: "new" (from the final dq, dk: the request's optimisation) and "old" (inter-chunk
terms plus row and column sums of ds∘qkᵀ), and the per-chunk loss whose gradient these are, for
finite differences. Arrays are float64; q, k [B,T,H,K], v, do, dv [B,T,HV,V], w [B,T,HV,K],
h, dh [B,NT,HV,K,V], g [B,T,HV], g_gamma [HV].
"""
from __future__ import annotations

import numpy as np

BT = 64


def chunks(B, T, cu_seqlens=None):
    """(b, first token, rows n, index on h's NT axis) of every chunk, in h's order."""
    out = []
    if cu_seqlens is None:
        nt = -(-T // BT)
        for b in range(B):
            for i in range(nt):
                out.append((b, i * BT, min(BT, T - i * BT), i))
    else:
        c = 0
        for s in range(len(cu_seqlens) - 1):
            bos, eos = int(cu_seqlens[s]), int(cu_seqlens[s + 1])
            for t0 in range(bos, eos, BT):
                out.append((0, t0, min(BT, eos - t0), c))
                c += 1
    return out


def _gamma(g, g_gamma, b, t0, n, hv):
    """Chunk-local cumulative gate of one value head, or None without a gate."""
    if g is not None:
        return g[b, t0:t0 + n, hv]
    if g_gamma is not None:
        return g_gamma[hv] * np.arange(1, n + 1, dtype=np.float64)
    return None


def chunk_terms(q, k, v, do, h, dh, gam, scale, log2, dv=None):
    """One (chunk, value head): q, k [n,K], v, do [n,V], h, dh [K,V], gam [n] or None.
    Returns per-value-head dq, dk, dw, dg (new form), dg (old form)."""
    n = q.shape[0]
    E = np.exp2 if log2 else np.exp
    tri = np.tril(np.ones((n, n), dtype=bool))
    ds = do @ v.T
    dq_i = do @ h.T
    dk_i = v @ dh.T
    dw = None if dv is None else -(dv @ h.T)
    if gam is None:
        dq_i = dq_i * scale
        ds = np.where(tri, ds * scale, 0.0)
        dgl = 0.0
    else:
        dgl = np.sum(h * dh) * E(gam[-1])
        dq_i = dq_i * (E(gam) * scale)[:, None]
        dk_i = dk_i * E(gam[-1] - gam)[:, None]
        dgl += np.sum(dk_i * k)
        diff = np.where(tri, gam[:, None] - gam[None, :], 0.0)
        ds = np.where(tri, ds * E(diff) * scale, 0.0)
    dq = dq_i + ds @ k
    dk = dk_i + ds.T @ q
    if gam is None:
        return dq, dk, dw, None, None
    dg_new = np.sum(dq * q, 1) - np.sum(dk * k, 1)
    qk = q @ k.T
    dg_old = np.sum(dq_i * q, 1) - np.sum(k * dk_i, 1) + np.sum(ds * qk, 1) - np.sum(ds * qk, 0)
    dg_new[-1] += dgl
    dg_old[-1] += dgl
    return dq, dk, dw, dg_new, dg_old


def gdn_bwd_dqkwg(q, k, v, do, h, dh, *, scale, g=None, g_gamma=None, log2=False, dv=None,
                  cu_seqlens=None, dg_form="new", reverse_cumsum=False):
    """dq, dk [B,T,H,K] (summed over the value heads of each q/k head), dw [B,T,HV,K] or None,
    dg [B,T,HV] or None (only with a per-token gate g)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    dq = np.zeros((B, T, H, K))
    dk = np.zeros((B, T, H, K))
    dw = None if dv is None else np.zeros((B, T, HV, K))
    dg = None if g is None else np.zeros((B, T, HV))
    for b, t0, n, c in chunks(B, T, cu_seqlens):
        sl = slice(t0, t0 + n)
        for hv in range(HV):
            hq = hv // G
            gam = _gamma(g, g_gamma, b, t0, n, hv)
            r = chunk_terms(q[b, sl, hq], k[b, sl, hq], v[b, sl, hv], do[b, sl, hv],
                            h[b, c, hv], dh[b, c, hv], gam, scale, log2,
                            None if dv is None else dv[b, sl, hv])
            dq[b, sl, hq] += r[0]
            dk[b, sl, hq] += r[1]
            if dw is not None:
                dw[b, sl, hv] = r[2]
            if dg is not None:
                d = r[3] if dg_form == "new" else r[4]
                dg[b, sl, hv] = d[::-1].cumsum()[::-1] if reverse_cumsum else d
    return dq, dk, dw, dg


def chunk_loss(q, k, v, do, h, dh, gam, scale, log2):
    """The per-chunk loss whose gradients (w.r.t. q, k, and gam in natural-log units) the op
    computes: Σ do∘o + Σ dh∘h_end with o = scale·(E(γ)q·h + (E(γt−γs)·[s≤t]·qkᵀ)v) and
    h_end = E(γl)h + kᵀ·diag(E(γl−γ))·v. In log2 units the gate derivative carries a factor ln 2,
    which the op leaves out (as fla does): dg is the gradient w.r.t. the natural-log gate."""
    n = q.shape[0]
    E = np.exp2 if log2 else np.exp
    if gam is None:
        gam = np.zeros(n)
        E = np.exp
    A = np.where(np.tril(np.ones((n, n), dtype=bool)), E(gam[:, None] - gam[None, :]), 0.0)
    o = scale * ((E(gam)[:, None] * q) @ h + (A * (q @ k.T)) @ v)
    h_end = E(gam[-1]) * h + (k * E(gam[-1] - gam)[:, None]).T @ v
    return np.sum(do * o) + np.sum(dh * h_end)
