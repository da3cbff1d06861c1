"""Independent NumPy fp64 reference for RMSNorm (the header's formulas), with the casting modes' roundings."""
import ml_dtypes
import numpy as np

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def rnd(a, dtype: str):
    """a rounded to dtype (nearest even), back in fp64."""
    return np.asarray(a, np.float64).astype(DTYPES[dtype]).astype(np.float64)


def rmsnorm_ref(x, w=None, residual=None, *, eps, offset=0.0, cast="llama", xdt="float32"):
    """Returns (y before its final rounding, s = x (+ residual), rstd), all fp64."""
    s = np.asarray(x, np.float64)
    if residual is not None:
        s = rnd(s + np.asarray(residual, np.float64), xdt)
    rstd = 1.0 / np.sqrt(np.mean(s * s, axis=-1) + eps)
    wf = np.ones(s.shape[-1]) if w is None else offset + np.asarray(w, np.float64)
    r = rstd
    if cast == "none":
        wf, r = rnd(wf, xdt), rnd(rstd, xdt)
    xn = s * r[..., None]
    if cast != "gemma":
        xn = rnd(xn, xdt)
    return xn * wf, s, rstd


def rmsnorm_bwd_ref(dy, s, w=None, *, eps, offset=0.0, cast="llama", xdt="float32", dres=None):
    """Returns (dx, dw) in fp64 for the forward above (s is the normalised input)."""
    s = np.asarray(s, np.float64)
    dy = np.asarray(dy, np.float64)
    rstd = 1.0 / np.sqrt(np.mean(s * s, axis=-1) + eps)
    wf = np.ones(s.shape[-1]) if w is None else offset + np.asarray(w, np.float64)
    if cast == "none":
        wf = rnd(wf, xdt)
    xhat = s * rstd[..., None]
    g = dy * wf
    mean = np.sum(g * xhat, axis=-1, keepdims=True) / s.shape[-1]
    dx = rstd[..., None] * (g - xhat * mean)
    if dres is not None:
        dx = dx + np.asarray(dres, np.float64)
    xw = xhat if cast == "gemma" else rnd(xhat, xdt)
    dw = np.sum((dy * xw).reshape(-1, s.shape[-1]), axis=0)
    return dx, dw


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(got)):
        return np.inf
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)


# Bounds on ||out - ref|| / ||ref|| for an output stored in each dtype.
TOL = {"float32": 2e-6, "float16": 2e-3, "bfloat16": 1e-2}
