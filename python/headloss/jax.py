"""JAX front end: headloss ops as XLA FFI custom calls, differentiable and usable under jax.jit.

    import headloss.jax as hlj
    y = hlj.rmsnorm(x, w, eps=1e-6)                         # custom_vjp: jax.grad works
    loss, metrics = hlj.fused_loss(logits, labels, terms=("ce", "z"), z_weight=1e-4)
    jax.grad(lambda z: hlj.fused_loss(z, labels)[0])(logits)

The calls go through a small adapter library, libheadloss_jax.so (src/jax/headloss_jax.cc, built
by CMake when jax's FFI headers are found), registered with jax.ffi.register_ffi_target for the
"CUDA" platform (the CUDA backend on XLA's stream) and for "cpu" (the CPU reference backend). The
adapter is looked for in $HEADLOSS_JAX_LIBRARY, beside the loaded libheadloss, in this package's
folder, then in the checkout's lib/.

Loss plans are created inside the adapter once per static configuration (options, vocabulary,
dtypes, backend) and cached for the life of the process; jit-compiled steps reuse them.
The loss's forward pass computes the gradient at the same time (one pass over the logits) and saves
it; the backward pass scales it by the cotangent. Differentiation is with respect to the logits
(and, for RMSNorm, x, the weight and the residual).
"""
from __future__ import annotations

import ctypes
import math
import os
from functools import partial
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ._lib import _HERE, lib_path
from .loss import SCALARS, TERMS

__all__ = ["rmsnorm", "rmsnorm_fwd", "rmsnorm_bwd", "fused_loss", "loss_plan_count", "adapter_path"]

_CAST = {"llama": 0, "gemma": 1, "none": 2}
_GRAD_MODES = {None: 0, "none": 0, "write": 1}
_OPTIONAL_INPUTS = ("labels", "weights", "teacher_logits", "advantages", "old_logprobs", "ref_logprobs")


def _find_adapter() -> Path:
    env = os.environ.get("HEADLOSS_JAX_LIBRARY")
    cands = ([Path(env)] if env else []) + [lib_path.parent / "libheadloss_jax.so",
                                           _HERE / "libheadloss_jax.so",
                                           _HERE.parent.parent / "lib" / "libheadloss_jax.so"]
    for c in cands:
        if c.exists():
            return c
    raise ImportError("libheadloss_jax.so not found: build the library with jax installed (CMake "
                      "builds the JAX adapter when `jax.ffi.include_dir()` is importable, or pass "
                      "-DHL_JAX_FFI_INCLUDE=...), or set HEADLOSS_JAX_LIBRARY; looked in: "
                      + ", ".join(map(str, cands)))


adapter_path = _find_adapter()
_adapter = ctypes.CDLL(str(adapter_path))
_adapter.hl_jax_loss_plan_count.restype = ctypes.c_int64

for _name in ("rmsnorm_fwd", "rmsnorm_bwd", "loss"):
    jax.ffi.register_ffi_target(f"headloss_{_name}", jax.ffi.pycapsule(getattr(_adapter, f"hl_jax_{_name}")),
                                platform="CUDA")
    jax.ffi.register_ffi_target(f"headloss_{_name}",
                                jax.ffi.pycapsule(getattr(_adapter, f"hl_jax_{_name}_cpu")), platform="cpu")


def loss_plan_count() -> int:
    """How many loss plans the adapter has created in this process (one per configuration)."""
    return int(_adapter.hl_jax_loss_plan_count())


def _i32(v) -> np.int32:
    return np.int32(int(v))


def _f32(v) -> np.float32:
    return np.float32(float(v))


def _cast_code(cast: str) -> int:
    if cast not in _CAST:
        raise ValueError(f"cast must be one of {sorted(_CAST)}, got {cast!r}")
    return _CAST[cast]


def _check_float(x, name: str) -> None:
    if x.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
        raise TypeError(f"{name}: unsupported dtype {x.dtype}; expected float32, float16 or bfloat16")


# ---- RMSNorm -------------------------------------------------------------------------------------

def rmsnorm_fwd(x, weight=None, *, eps: float = 1e-6, offset: float = 0.0, cast: str = "llama",
                residual=None, out_dtype=None, return_rstd: bool = False):
    """RMSNorm over the last dimension (no autodiff rule: see `rmsnorm`). Returns
    (y, residual_out or None, rstd or None), as headloss.rmsnorm_fwd."""
    _check_float(x, "x")
    if weight is not None and (weight.ndim != 1 or weight.shape[0] != x.shape[-1]):
        raise ValueError(f"weight has shape {weight.shape}; expected ({x.shape[-1]},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must have x's shape and dtype")
    rows = math.prod(x.shape[:-1])
    ydt = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    outs = [jax.ShapeDtypeStruct(x.shape, ydt)]
    args = [x]
    if residual is not None:
        args.append(residual)
        outs.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
    if weight is not None:
        args.append(weight)
    if return_rstd:
        outs.append(jax.ShapeDtypeStruct((rows,), jnp.float32))
    res = jax.ffi.ffi_call("headloss_rmsnorm_fwd", outs, vmap_method="sequential")(
        *args, eps=_f32(eps), offset=_f32(offset), cast=_i32(_cast_code(cast)),
        has_weight=_i32(weight is not None), has_residual=_i32(residual is not None),
        want_rstd=_i32(return_rstd))
    res = list(res)
    y = res.pop(0)
    s = res.pop(0) if residual is not None else None
    rstd = res.pop(0) if return_rstd else None
    return y, s, rstd


def rmsnorm_bwd(dy, x, weight=None, rstd=None, *, eps: float = 1e-6, offset: float = 0.0,
                cast: str = "llama", dresidual_out=None, dw_dtype=None):
    """Gradients of rmsnorm_fwd: (dx, dw or None). x is the normalised input s (x + residual when
    fused); rstd from the forward or None (recomputed)."""
    args = [dy, x]
    if rstd is not None:
        args.append(rstd)
    if weight is not None:
        args.append(weight)
    if dresidual_out is not None:
        args.append(dresidual_out)
    outs = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    if weight is not None:
        outs.append(jax.ShapeDtypeStruct(weight.shape, weight.dtype if dw_dtype is None else jnp.dtype(dw_dtype)))
    res = jax.ffi.ffi_call("headloss_rmsnorm_bwd", outs, vmap_method="sequential")(
        *args, eps=_f32(eps), offset=_f32(offset), cast=_i32(_cast_code(cast)),
        has_rstd=_i32(rstd is not None), has_weight=_i32(weight is not None),
        has_dres=_i32(dresidual_out is not None))
    return res[0], (res[1] if weight is not None else None)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rmsnorm(x, weight, residual, cfg):
    eps, offset, cast, out_dtype = cfg
    y, s, _ = rmsnorm_fwd(x, weight, eps=eps, offset=offset, cast=cast, residual=residual,
                          out_dtype=out_dtype)
    return y, s


def _rmsnorm_vjp_fwd(x, weight, residual, cfg):
    eps, offset, cast, out_dtype = cfg
    y, s, rstd = rmsnorm_fwd(x, weight, eps=eps, offset=offset, cast=cast, residual=residual,
                             out_dtype=out_dtype, return_rstd=True)
    return (y, s), (x if s is None else s, weight, rstd, residual is not None)


def _rmsnorm_vjp_bwd(cfg, saved, cts):
    eps, offset, cast, _ = cfg
    s, weight, rstd, fused = saved
    dy, ds = cts
    dx, dw = rmsnorm_bwd(dy, s, weight, rstd, eps=eps, offset=offset, cast=cast,
                         dresidual_out=ds if fused else None)
    return dx, dw, (dx if fused else None)


_rmsnorm.defvjp(_rmsnorm_vjp_fwd, _rmsnorm_vjp_bwd)


def rmsnorm(x, weight=None, *, eps: float = 1e-6, offset: float = 0.0, cast: str = "llama",
            residual=None, out_dtype=None):
    """y = RMSNorm(s) * (offset + weight) over the last dimension, s = x (+ residual).

    Differentiable (jax.custom_vjp over headloss's fused backward) and jit-compatible. Returns y,
    or (y, residual_out) when a residual is fused (residual_out = x + residual, for the next layer).
    x: [..., N] float32 / float16 / bfloat16; weight: optional [N]; cast: "llama", "gemma" or
    "none" (see headloss.h). Runs on the CUDA backend on GPU and the CPU backend on the host.
    """
    _cast_code(cast)
    cfg = (float(eps), float(offset), cast, None if out_dtype is None else jnp.dtype(out_dtype).name)
    y, s = _rmsnorm(x, weight, residual, cfg)
    return y if residual is None else (y, s)


# ---- the fused loss plan -------------------------------------------------------------------------

def _loss_call(cfg, logits, extras, grad: bool):
    """Runs the plan; returns (scalars, grad or None, token outputs or None)."""
    opts, token_outputs, grad_dtype = cfg
    opts = dict(opts)
    inputs = 0
    args = [logits]
    for bit, x in enumerate(extras):
        if x is not None:
            inputs |= 1 << bit
            args.append(x)
    rows = math.prod(logits.shape[:-1])
    outs = [jax.ShapeDtypeStruct((len(SCALARS),), jnp.float32)]
    if grad:
        outs.append(jax.ShapeDtypeStruct(logits.shape, logits.dtype if grad_dtype is None else jnp.dtype(grad_dtype)))
    if token_outputs:
        outs += [jax.ShapeDtypeStruct(logits.shape[:-1], jnp.float32)] * 4
    attrs = {k: (np.int64(v) if k == "ignore_index" else np.float64(v) if k == "divisor"
                 else _i32(v) if isinstance(v, (bool, int)) else _f32(v)) for k, v in opts.items()}
    res = list(jax.ffi.ffi_call("headloss_loss", outs, vmap_method="sequential")(
        *args, inputs=_i32(inputs), grad_mode=_i32(1 if grad else 0),
        token_outputs=_i32(token_outputs), **attrs))
    scalars = res.pop(0)
    g = res.pop(0) if grad else None
    return scalars, g, (tuple(res) if token_outputs else None)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_loss(cfg, logits, extras):
    scalars, _, toks = _loss_call(cfg, logits, extras, grad=False)
    return scalars[0], scalars, toks


def _fused_loss_fwd(cfg, logits, extras):
    scalars, g, toks = _loss_call(cfg, logits, extras, grad=True)
    return (scalars[0], scalars, toks), g


def _fused_loss_bwd(cfg, g, cts):
    dloss = cts[0]
    dlogits = (g.astype(jnp.float32) * dloss).astype(g.dtype)
    return dlogits, tuple(None for _ in _OPTIONAL_INPUTS)


_fused_loss.defvjp(_fused_loss_fwd, _fused_loss_bwd)


def fused_loss(logits, labels=None, *, terms: Sequence[str] = ("ce",), weights=None,
               teacher_logits=None, advantages=None, old_logprobs=None, ref_logprobs=None,
               divisor: float = 0.0, token_outputs: bool = False, ignore_index: Optional[int] = None,
               check: bool = True, grad_dtype=None, **options
               ) -> Tuple[Any, Dict[str, Any]] | Tuple[Any, Dict[str, Any], Tuple[Any, ...]]:
    """The fused LM-head loss plan (see headloss.h and headloss.LossPlan for the options).

    logits [..., V] float32 / float16 / bfloat16; labels [...] int32 / int64 (negative = ignored);
    weights, advantages, old_logprobs, ref_logprobs [...] float32; teacher_logits like logits.
    terms: names from headloss.loss.TERMS ("ce", "z", "entropy", "distill_fwd", "distill_rev",
    "grpo", "kl_ref"); options: ce_weight, z_weight, entropy_weight, distill_weight, grpo_weight,
    kl_ref_beta, label_smoothing, logit_scale, softcap, teacher_temperature, student_temperature,
    eps_low, eps_high. divisor (static): D, 0 = sum of valid weights.

    Returns (loss, metrics) where metrics maps every name of headloss.loss.SCALARS to a 0-d fp32
    array (no gradient flows through metrics), plus (token_loss, token_logp, token_entropy,
    token_lse) when token_outputs. jax.grad of the loss w.r.t. the logits uses the gradient formed
    in the same pass (the forward of a jax.grad / jax.vjp computes and keeps it).
    """
    _check_float(logits, "logits")
    unknown = set(options) - {"ce_weight", "z_weight", "entropy_weight", "distill_weight", "grpo_weight",
                              "kl_ref_beta", "label_smoothing", "logit_scale", "softcap",
                              "teacher_temperature", "student_temperature", "eps_low", "eps_high"}
    if unknown:
        raise TypeError(f"fused_loss: unknown options {sorted(unknown)}")
    bits = terms if isinstance(terms, int) else sum(TERMS[t] for t in terms)
    opts = dict(options, terms=bits, flags=0 if check else 1, divisor=float(divisor))
    if ignore_index is not None:
        opts.update(use_ignore_index=1, ignore_index=int(ignore_index))
    if labels is not None and labels.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(f"labels: dtype {labels.dtype}; expected int32 or int64")
    extras = (labels, weights, teacher_logits, advantages, old_logprobs, ref_logprobs)
    for name, x in zip(_OPTIONAL_INPUTS, extras):
        if x is None:
            continue
        want = logits.shape if name == "teacher_logits" else logits.shape[:-1]
        if tuple(x.shape) != tuple(want):
            raise ValueError(f"{name} has shape {x.shape}; expected {tuple(want)}")
        if name == "teacher_logits" and x.dtype != logits.dtype:
            raise TypeError("teacher_logits must have the logits' dtype")
        if name not in ("labels", "teacher_logits") and x.dtype != jnp.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
    cfg = (tuple(sorted(opts.items())), bool(token_outputs),
           None if grad_dtype is None else jnp.dtype(grad_dtype).name)
    loss, scalars, toks = _fused_loss(cfg, logits, extras)
    scalars = jax.lax.stop_gradient(scalars)
    metrics = {k: scalars[i] for i, k in enumerate(SCALARS)}
    return (loss, metrics, toks) if token_outputs else (loss, metrics)
