"""JAX front end: headloss ops as XLA FFI custom calls, differentiable and usable under jax.jit.

    import headloss.jax as hlj
    y = hlj.rmsnorm(x, w, eps=1e-6)                         # custom_vjp: jax.grad works
    loss, metrics = hlj.fused_loss(logits, labels, terms=("ce", "z"), z_weight=1e-4)
    jax.grad(lambda z: hlj.fused_loss(z, labels)[0])(logits)
    # inside shard_map, logits sharded over the vocabulary along axis "tp":
    loss, metrics = hlj.sharded_fused_loss(logits_shard, labels, axis_name="tp", vocab_global=V)
    # the fused linear form: hidden states and the head's weight, the logits never in memory
    loss, metrics = hlj.linear_loss(hidden, weight, labels, terms=("ce", "z"), z_weight=1e-4)
    # per-token (logp, entropy, lse) with a backward, for a loss of your own (RL trainers)
    logp, entropy, lse = hlj.linear_token_logprobs(hidden, weight, labels, temperature=0.7)

The calls go through a small adapter library, libheadloss_jax.so (src/jax/headloss_jax.cc, built
by CMake when jax's FFI headers are found), registered with jax.ffi.register_ffi_target for the
"CUDA" platform (the CUDA backend on XLA's stream) and for "cpu" (the CPU reference backend). The
adapter is looked for in $HEADLOSS_JAX_LIBRARY, beside the loaded libheadloss, in this package's
folder, then in the checkout's lib/.

Loss plans are created inside the adapter once per static configuration (options, vocabulary and
shard, dtypes, backend, device) and cached for the life of the process; jit-compiled steps reuse
them.
The loss's forward pass computes the gradient at the same time (one pass over the logits) and saves
it; the backward pass scales it by the cotangent. Differentiation is with respect to the logits
(the linear form: the hidden states and the weight, only those being differentiated; for RMSNorm,
x, the weight and the residual).

The vocabulary-sharded loss runs in three steps, one collective: loss_stats (each shard's block of
statistics), an all-gather of the blocks, loss_finish; dense distill_jsd adds loss_middle and a
second all-gather of its blocks before loss_finish (loss_exchanges says which). sharded_fused_loss
does the steps inside shard_map (jax.lax.all_gather) and is differentiable; sharded_linear_loss the
same for the weight sharded by vocabulary rows. See examples/jax_shard_map.py.
"""
from __future__ import annotations

import ctypes
import math
import os
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from . import _abi
from ._arrays import DTYPE_NAMES, FLOATS, INTS, dtype_code, expect, spec
from ._lib import _HERE, DTYPE_F32, DTYPE_I32, HeadlossValueError, lib_path
from ._loss_options import (PREFERENCE_METRICS, SCALARS, call_value, plan_fields, preference_options,
                            temperature_scale, terms_bits)
from .loss import DEFAULT_MAX_WORKSPACE_BYTES, LossPlan
from .rmsnorm import cast_code

__all__ = ["rmsnorm", "rmsnorm_fwd", "rmsnorm_bwd", "fused_loss", "sharded_fused_loss", "loss_stats",
           "loss_middle", "loss_finish", "loss_exchanges", "linear_loss", "sharded_linear_loss", "TokenLogprobs",
           "token_logprobs", "linear_token_logprobs", "preference_loss", "PREFERENCE_METRICS", "loss_plan_count",
           "adapter_path"]

_OPTIONAL_INPUTS = ("labels", "weights", "teacher_logits", "advantages", "old_logprobs", "ref_logprobs")
_TEACHER_INPUTS = ("teacher_hidden", "teacher_weight")  # the fused linear form's teacher
_SEQ_INPUTS = ("rollout_logprobs", "cu_seqlens")
_TOPK_INPUTS = ("teacher_topk_ids", "teacher_topk_logprobs")  # a sparse teacher
_GRAD_INPUTS = ("grad_token_logp", "grad_token_entropy", "grad_token_lse")  # token_logprobs' backward
_PREF_INPUTS = ("ref_seq_logprobs", "kto_labels")  # the preference term's, one value a sequence
# Every optional input in the adapter's order (both forms): input k is bit 1 << k of `inputs`.
_ALL_INPUTS = _OPTIONAL_INPUTS + _TEACHER_INPUTS + _SEQ_INPUTS + _TOPK_INPUTS + _GRAD_INPUTS + _PREF_INPUTS


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

for _name in ("rmsnorm_fwd", "rmsnorm_bwd", "loss", "loss_stats", "loss_middle", "loss_finish"):
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


def _spec(x, name: str, dtype=None, **checks):
    """expect() of a JAX array's shape and dtype (a tracer under jit: no memory to check)."""
    return None if x is None else expect(spec(x, name), name, dtype, **checks)


# ---- RMSNorm -------------------------------------------------------------------------------------

def rmsnorm_fwd(x, weight=None, *, eps: float = 1e-6, offset: float = 0.0, cast: str = "llama",
                residual=None, out_dtype=None, return_rstd: bool = False):
    """RMSNorm over the last dimension (no autodiff rule: see `rmsnorm`). Returns
    (y, residual_out or None, rstd or None), as headloss.rmsnorm_fwd (the same options and
    defaults; every array checked against x's shape, HeadlossError naming it)."""
    xv = _spec(x, "x", FLOATS, matrix=True)
    rows, cols = xv.rows, x.shape[-1]
    _spec(weight, "weight", FLOATS, shape=(cols,))
    _spec(residual, "residual", xv.dtype, shape=x.shape)
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
        *args, eps=_f32(eps), offset=_f32(offset), cast=_i32(cast_code(cast)),
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
    fused) [..., N]; dy like it; rstd fp32 [rows] from the forward or None (recomputed);
    dresidual_out x's shape and dtype; weight [N]; dw_dtype float32 or the weight's (default)."""
    xv = _spec(x, "x", FLOATS, matrix=True)
    _spec(dy, "dy", FLOATS, shape=x.shape)
    _spec(rstd, "rstd", DTYPE_F32, size=xv.rows)
    wv = _spec(weight, "weight", FLOATS, shape=(x.shape[-1],))
    _spec(dresidual_out, "dresidual_out", xv.dtype, shape=x.shape)
    if dw_dtype is not None and wv is not None and dtype_code(dw_dtype, "dw_dtype") not in (DTYPE_F32, wv.dtype):
        raise HeadlossValueError(f"dw_dtype is {dw_dtype}; expected float32 or the weight's {weight.dtype}")
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
        *args, eps=_f32(eps), offset=_f32(offset), cast=_i32(cast_code(cast)),
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
    cast_code(cast)
    cfg = (float(eps), float(offset), cast, None if out_dtype is None else jnp.dtype(out_dtype).name)
    y, s = _rmsnorm(x, weight, residual, cfg)
    return y if residual is None else (y, s)


# ---- the fused loss plan -------------------------------------------------------------------------

class _Cfg(NamedTuple):
    """A loss call's static configuration (hashable: custom_vjp's nondiff argument)."""
    opts: Tuple[Tuple[str, Any], ...]  # the plan's attributes by name
    token_outputs: bool
    grad_dtype: Optional[str]          # the logits' (linear form: grad_weight's); None: the operand's
    axis_name: Any = None              # sharded losses: the shard_map axis of the vocabulary
    linear: bool = False               # the fused linear form: operands (hidden, weight)
    dtypes: Tuple[str, ...] = ()       # the operands' dtypes (of their cotangents)


def _config(fn: str, logits, extras, terms, divisor, ignore_index, check, grad_dtype, token_outputs,
            options, axis_name=None, **shard) -> _Cfg:
    """Checks `fn`'s inputs and options; shard: vocab_global and ranks of a vocabulary shard.
    logits: the operand, or for the linear form a stand-in of the logits' shape and dtype. The
    options are validated by the library itself, on a CPU plan made once per configuration at
    trace time (HeadlossError with its message, as LossPlan raises)."""
    lv = _spec(logits, "logits", FLOATS, matrix=True)
    options = dict(options)
    _check_inputs(extras, lv.rows, logits.shape[-1], lv.dtype, options.pop("teacher_topk", None))
    options.pop("cu_seqlens_dtype", None)  # cu_seqlens' own dtype is used (without jax_enable_x64
    #                                        an int64 array arrives as int32)
    opts = dict(plan_fields(options), terms=terms_bits(terms), flags=0 if check else _abi.HL_LOSS_UNCHECKED,
                divisor=call_value("divisor", divisor), **shard)
    cu = extras[_ALL_INPUTS.index("cu_seqlens")]
    if cu is not None:
        opts["cu_seqlens_dtype"] = dtype_code(cu.dtype)
    elif opts.get("ratio_level") or opts.get("rollout_level"):
        raise HeadlossValueError(f"{fn}: a sequence-level ratio_level or rollout_level needs cu_seqlens")
    if ignore_index is not None:
        opts.update(use_ignore_index=1, ignore_index=int(ignore_index))
    cfg = _Cfg(tuple(sorted(opts.items())), bool(token_outputs),
               None if grad_dtype is None else jnp.dtype(grad_dtype).name, axis_name,
               dtypes=(logits.dtype.name,))
    _plan("cpu", logits.shape[-1], logits.dtype.name, extras[0], extras, cfg.opts)
    return cfg


_PER_ROW_F32 = ("weights", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")


def _check_inputs(extras, rows: int, vocab: int, dtype: int, k=None) -> None:
    """The per-row inputs, teacher logits and a sparse teacher's arrays against the logits' rows,
    vocabulary and dtype (the fused linear form's teacher is _linear_config's). A sparse teacher's
    ids and log-probs go together, [rows, k], with k the option teacher_topk where given."""
    x = dict(zip(_ALL_INPUTS, extras))
    _spec(x["labels"], "labels", INTS, size=rows)
    for name in _PER_ROW_F32:
        _spec(x[name], name, DTYPE_F32, size=rows)
    _spec(x["teacher_logits"], "teacher_logits", dtype, rows=rows, cols=vocab)
    cu = _spec(x["cu_seqlens"], "cu_seqlens", INTS, shape=(None,))
    for name, dt in zip(_PREF_INPUTS, (DTYPE_F32, DTYPE_I32)):
        if x[name] is not None and cu is None:
            raise HeadlossValueError(f"{name} needs cu_seqlens (one value a sequence)")
        _spec(x[name], name, dt, shape=(None if cu is None else x["cu_seqlens"].shape[0] - 1,))
    ids, lp = x["teacher_topk_ids"], x["teacher_topk_logprobs"]
    if (ids is None) != (lp is None):
        raise HeadlossValueError("teacher_topk_ids and teacher_topk_logprobs go together")
    if k is not None and k != (0 if ids is None else ids.shape[-1]):
        raise HeadlossValueError(f"teacher_topk is {k} but teacher_topk_ids has shape "
                                 f"{None if ids is None else ids.shape}")
    if ids is not None:
        _spec(ids, "teacher_topk_ids", INTS, rows=rows)
        _spec(lp, "teacher_topk_logprobs", DTYPE_F32, rows=rows, cols=ids.shape[-1])


def _extras(kw: dict, labels, names) -> tuple:
    """The optional inputs by their bits (_ALL_INPUTS; None where not passed or not the form's)."""
    return (labels, *(kw.pop(k, None) if k in names else None for k in _ALL_INPUTS[1:]))


def _by_bit(**inputs) -> tuple:
    """The optional inputs given by name, in _ALL_INPUTS' order (None where not given)."""
    return tuple(inputs.get(k) for k in _ALL_INPUTS)


def _kwargs_config(fn: str, logits, labels, kwargs: dict, **shard):
    """(cfg, extras) from fused_loss's keyword arguments as a dict."""
    kw = dict(kwargs)
    extras = _extras(kw, labels, _OPTIONAL_INPUTS + _SEQ_INPUTS + _TOPK_INPUTS + _PREF_INPUTS)
    cfg = _config(fn, logits, extras, kw.pop("terms", ("ce",)), kw.pop("divisor", None),
                  kw.pop("ignore_index", None), kw.pop("check", True), kw.pop("grad_dtype", None),
                  kw.pop("token_outputs", False), kw, **shard)
    return cfg, extras


def _linear_config(fn: str, hidden, weight, labels, kwargs: dict, **shard):
    """(cfg, extras) of the fused linear form from linear_loss's keyword arguments as a dict;
    extras: _ALL_INPUTS."""
    kw = dict(kwargs)
    extras = _extras(kw, labels, tuple(k for k in _ALL_INPUTS if k not in _GRAD_INPUTS))
    hv = _spec(hidden, "hidden", FLOATS, matrix=True)
    H = hidden.shape[-1]
    _spec(weight, "weight", hv.dtype, shape=(None, H))
    th, tw = extras[6], extras[7]
    if (th is None) != (tw is None):
        raise HeadlossValueError("teacher_hidden and teacher_weight go together")
    if th is not None:
        Ht = _spec(th, "teacher_hidden", hv.dtype, rows=hv.rows).shape[-1]
        _spec(tw, "teacher_weight", hv.dtype, shape=(weight.shape[0], Ht))
    cap = kw.pop("max_workspace_bytes", DEFAULT_MAX_WORKSPACE_BYTES)
    logits = jax.ShapeDtypeStruct(hidden.shape[:-1] + (weight.shape[0],), hidden.dtype)
    cfg = _config(fn, logits, extras, kw.pop("terms", ("ce",)), kw.pop("divisor", None),
                  kw.pop("ignore_index", None), kw.pop("check", True), kw.pop("grad_weight_dtype", None),
                  kw.pop("token_outputs", False), kw, **shard)
    if cap is not None:
        cfg = cfg._replace(opts=tuple(sorted(cfg.opts + (("max_workspace_bytes", int(cap)),))))
    return cfg._replace(linear=True, dtypes=(hidden.dtype.name, weight.dtype.name)), extras


# The attributes' types: the descriptor's fields' (int and unsigned fields as int32), and the
# call's divisor and workspace cap.
_NP_TYPES = {ctypes.c_float: np.float32, ctypes.c_int: np.int32, ctypes.c_uint: np.int32,
             ctypes.c_int64: np.int64}
_ATTR_TYPES = {f: _NP_TYPES[t] for f, t in _abi.hl_loss_plan_desc_t._fields_ if t in _NP_TYPES}
_ATTR_TYPES.update(divisor=np.float64, max_workspace_bytes=np.int64)


def _attrs(cfg: _Cfg) -> dict:
    """The plan's attributes with the types the adapter reads them as."""
    return {k: _ATTR_TYPES[k](v) for k, v in cfg.opts}


def _vocab_start(v):
    v = jnp.asarray(v)
    if v.shape != () or v.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(f"vocab_start must be a scalar int32 or int64, got {v.dtype}{list(v.shape)}")
    return v


def _grads(cfg: _Cfg, operands, need) -> list:
    """(mode attribute, dtype attribute, result shape) of each operand's gradient: the logits'
    (grad_mode), or hidden's and the weight's (grad_hidden_mode, grad_weight_mode); the last
    operand's in cfg.grad_dtype when set."""
    names = ("grad_hidden", "grad_weight") if cfg.linear else ("grad",)
    dts = [x.dtype for x in operands]
    if cfg.grad_dtype:
        dts[-1] = jnp.dtype(cfg.grad_dtype)
    return [(f"{n}_mode", f"{n}_dtype", jax.ShapeDtypeStruct(x.shape, dt) if g else None)
            for n, x, dt, g in zip(names, operands, dts, need)]


def _loss_call(cfg: _Cfg, operands, extras, need, target: str = "headloss_loss", tail=()):
    """Runs the plan on its operands (logits, or hidden and weight) or, with target
    "headloss_loss_finish" and tail (gathered, [gathered_middle,] vocab_start), the finish of a
    shard; need: which operands' gradients to form. Returns (scalars, gradients (None where not
    formed), token outputs or None)."""
    inputs = 0
    args = list(operands)
    for bit, x in enumerate(extras):
        if x is not None:
            inputs |= 1 << bit
            args.append(x)
    grads = _grads(cfg, operands, need)
    outs = [jax.ShapeDtypeStruct((len(SCALARS),), jnp.float32)] + [g[2] for g in grads if g[2] is not None]
    if cfg.token_outputs:
        outs += [jax.ShapeDtypeStruct(operands[0].shape[:-1], jnp.float32)] * 4
    middle = {"middle": _i32(1)} if len(tail) == 3 else {}
    res = list(jax.ffi.ffi_call(target, outs, vmap_method="sequential")(
        *args, *tail, inputs=_i32(inputs), token_outputs=_i32(cfg.token_outputs), linear=_i32(cfg.linear), **middle,
        **{mode: _i32(n) for (mode, _, _), n in zip(grads, need)}, **_attrs(cfg)))
    scalars = res.pop(0)
    gs = tuple(res.pop(0) if n else None for n in need)
    return scalars, gs, (tuple(res) if cfg.token_outputs else None)


def _platform(x) -> str:
    """The backend that will run a call on x: the mesh's under shard_map, else x's device, else the
    default device's or backend's (under jit, x is a tracer and carries no device)."""
    mesh = jax.sharding.get_abstract_mesh().abstract_device
    concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    where = next(w for w in (mesh, next(iter(x.devices())) if concrete else None,
                             jax.config.jax_default_device, jax.default_backend()) if w is not None)
    return "cpu" if getattr(where, "platform", where) == "cpu" else "cuda"


def _plan(device: str, vocab: int, dtype: str, labels, extras, opts) -> LossPlan:
    """The LossPlan of a call's configuration (made once per configuration): what the library
    says of its options, and the sizes of its blocks."""
    ids = extras[_ALL_INPUTS.index("teacher_topk_ids")]
    topk = () if ids is None else (("teacher_topk", int(ids.shape[-1])), ("topk_ids_dtype", ids.dtype.name))
    return _cached_plan(device, vocab, dtype, None if labels is None else labels.dtype.name, opts + topk)


@lru_cache(maxsize=64)
def _cached_plan(device: str, vocab: int, dtype: str, labels_dtype: Optional[str], opts) -> LossPlan:
    kw = {k: v for k, v in opts if k not in ("flags", "divisor", "use_ignore_index", "max_workspace_bytes")}
    if "cu_seqlens_dtype" in kw:  # an hl_dtype_t attribute; LossPlan takes a name
        kw["cu_seqlens_dtype"] = DTYPE_NAMES[kw["cu_seqlens_dtype"]]
    return LossPlan(vocab, dtype, device=device, labels_dtype=labels_dtype, grad=None, **kw)


_STATS_INPUTS = (0, 2, 6, 7, 10, 11)  # the inputs statistics read: labels and the teacher's


def _vocab(cfg: _Cfg, operands) -> int:
    """This shard's columns of the logits: the logits' last dimension, or the weight's rows."""
    return operands[1].shape[0] if cfg.linear else operands[0].shape[-1]


def _split_call(target: str, cfg: _Cfg, operands, extras, tail, need):
    """The statistics step (target "headloss_loss_stats", tail (vocab_start,)) or the middle step
    ("headloss_loss_middle", tail (gathered, vocab_start)) of a shard: its block, uint8[bytes]."""
    kept = [(bit, extras[bit]) for bit in _STATS_INPUTS if bit < len(extras) and extras[bit] is not None]
    sizes = _split_sizes(cfg, operands, extras, math.prod(operands[0].shape[:-1]))
    # The block's plan must be the finish's, gradient modes and dtypes included.
    grad_attrs = {}
    for (mode, dt, spec), n in zip(_grads(cfg, operands, need), need):
        grad_attrs.update({mode: _i32(n), dt: _i32(dtype_code(spec.dtype) if n else 0)})
    size = sizes[1] if target == "headloss_loss_middle" else sizes[0]
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((size,), jnp.uint8), vmap_method="sequential")(
        *operands, *(x for _, x in kept), *tail[:-1], _vocab_start(tail[-1]),
        inputs=_i32(sum(1 << bit for bit, _ in kept)), linear=_i32(cfg.linear), **grad_attrs,
        **_attrs(cfg))


def _split_sizes(cfg: _Cfg, operands, extras, rows: int) -> Tuple[int, int]:
    """The library's sizes of one block of statistics and of one middle block (0: the plan has no
    middle step): XLA needs the results' shapes when tracing (records are fp64 on the CPU backend,
    fp32 on CUDA; the same for both forms)."""
    plan = _plan(_platform(operands[0]), _vocab(cfg, operands), operands[0].dtype.name, extras[0], extras,
                 cfg.opts)
    return plan.stats_bytes(rows), plan.middle_bytes(rows) if plan.exchanges == 2 else 0


def _exchanges(cfg: _Cfg, operands, extras) -> int:
    """All-gathers the plan's split takes: 1, or 2 (dense distill_jsd: a middle step)."""
    return 2 if _split_sizes(cfg, operands, extras, 1)[1] else 1


def _run(cfg: _Cfg, operands, extras, need):
    """The whole loss, or with cfg.axis_name (inside shard_map) this shard's: stats, one
    all-gather of the blocks over the axis (dense JSD: its middle step and a second one), finish
    (the linear form: and one psum of grad_hidden, each shard's part)."""
    axis = cfg.axis_name
    if axis is None:
        return _loss_call(cfg, operands, extras, need)
    start = jax.lax.axis_index(axis) * _vocab(cfg, operands)
    # ffi_call types its results as the same on every device along the axis: true of the scalars
    # and token outputs (the same bits everywhere), not of the blocks and the gradients. Say so for
    # shard_map's check_vma (the gradient of the sharded operand must vary as it does).
    varying = partial(jax.lax.pcast, axis_name=axis, to="varying")
    gather = lambda b: jax.lax.all_gather(varying(b), axis, tiled=True)  # noqa: E731
    gathered = [gather(_split_call("headloss_loss_stats", cfg, operands, extras, (start,), need))]
    if _exchanges(cfg, operands, extras) == 2:
        gathered.append(gather(_split_call("headloss_loss_middle", cfg, operands, extras,
                                           (gathered[0], start), need)))
    scalars, gs, toks = _loss_call(cfg, operands, extras, need, "headloss_loss_finish", (*gathered, start))
    gs = [None if g is None else varying(g) for g in gs]
    if cfg.linear and gs[0] is not None:  # hidden is replicated: its gradient, the parts' sum
        gs[0] = jax.lax.psum(gs[0], axis)
    return scalars, tuple(gs), toks


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss(cfg, operands, extras):
    scalars, _, toks = _run(cfg, operands, extras, (False,) * len(operands))
    return scalars[0], scalars, toks


def _loss_fwd(cfg, operands, extras):
    # symbolic_zeros: each primal says whether it is differentiated (`perturbed`); the plan forms
    # only those operands' gradients (no gradient at all for the teacher or the per-row inputs).
    need = tuple(bool(x.perturbed) for x in operands)
    values = jax.tree_util.tree_map(lambda x: x.value, (operands, extras))
    scalars, gs, toks = _run(cfg, *values, need)
    return (scalars[0], scalars, toks), gs


def _loss_bwd(cfg, gs, cts):
    dloss = cts[0]
    zero = isinstance(dloss, SymbolicZero)
    # The incoming gradient scales the one formed in the forward pass, in fp32, rounded once to
    # the operand's dtype (a gradient formed in fp32 on request is cast here).
    d = tuple(None if g is None or zero else (g.astype(jnp.float32) * dloss).astype(dt)
              for g, dt in zip(gs, cfg.dtypes))
    return d, (None,) * len(_ALL_INPUTS)


_loss.defvjp(_loss_fwd, _loss_bwd, symbolic_zeros=True)


def _results(cfg: _Cfg, operands, extras):
    """(loss, metrics[, token outputs]) of the differentiable loss."""
    loss, scalars, toks = _loss(cfg, tuple(operands), extras)
    metrics = _metrics(jax.lax.stop_gradient(scalars))
    return (loss, metrics, toks) if cfg.token_outputs else (loss, metrics)


def _metrics(scalars) -> Dict[str, Any]:
    return {k: scalars[i] for i, k in enumerate(SCALARS)}


def fused_loss(logits, labels=None, *, terms: Sequence[str] = ("ce",), weights=None,
               teacher_logits=None, advantages=None, old_logprobs=None, ref_logprobs=None,
               rollout_logprobs=None, cu_seqlens=None, teacher_topk_ids=None, teacher_topk_logprobs=None,
               ref_seq_logprobs=None, kto_labels=None, divisor: Optional[float] = None, token_outputs: bool = False, ignore_index: Optional[int] = None,
               check: bool = True, grad_dtype=None, **options
               ) -> Tuple[Any, Dict[str, Any]] | Tuple[Any, Dict[str, Any], Tuple[Any, ...]]:
    """The fused LM-head loss plan (see headloss.h and headloss.LossPlan for the options).

    logits [..., V] float32 / float16 / bfloat16; labels [...] int32 / int64 (negative = ignored);
    weights, advantages, old_logprobs, ref_logprobs [...] float32; teacher_logits like logits, or a
    sparse teacher: teacher_topk_ids [..., k] int32 / int64 (< 0: padding) and
    teacher_topk_logprobs [..., k] float32 (the plan's teacher_topk is k).
    terms: a name or names of headloss.TERMS ("ce", the default, "z", "entropy", "distill_fwd",
    "distill_rev", "distill_jsd", "grpo", "kl_ref", "cispo"). Every option defaults to None, the
    library's default (headloss.LossPlan's docstring lists them: z_weight 1e-4, ...; an explicit 0
    that the library would read as a nonzero default is refused, as LossPlan refuses it); options: ce_weight, z_weight, entropy_weight,
    distill_weight, grpo_weight, kl_ref_beta, label_smoothing, logit_scale, softcap,
    teacher_temperature, student_temperature, eps_low, eps_high, dual_clip, cispo_weight,
    cispo_eps_high, kl_estimator, ratio_level, rollout_correction, rollout_level, rollout_cap,
    rollout_floor, jsd_beta (names as headloss.LossPlan's); rollout_logprobs [...] float32 and
    cu_seqlens int32 / int64 [sequences + 1] over the flattened rows as LossPlan's call;
    ref_seq_logprobs float32 and kto_labels int32 [sequences]: the preference term's (see
    preference_loss). divisor (static): D, None (default) = the sum of the valid rows' weights.

    Returns (loss, metrics) where metrics maps every name of headloss.loss.SCALARS to a 0-d fp32
    array (no gradient flows through metrics), plus (token_loss, token_logp, token_entropy,
    token_lse) when token_outputs. jax.grad of the loss w.r.t. the logits uses the gradient formed
    in the same pass (the forward of a jax.grad / jax.vjp computes and keeps it).
    """
    extras = _by_bit(labels=labels, weights=weights, teacher_logits=teacher_logits, advantages=advantages,
                     old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                     cu_seqlens=cu_seqlens, teacher_topk_ids=teacher_topk_ids,
                     teacher_topk_logprobs=teacher_topk_logprobs, ref_seq_logprobs=ref_seq_logprobs,
                     kto_labels=kto_labels)
    cfg = _config("fused_loss", logits, extras, terms, divisor, ignore_index, check, grad_dtype,
                  token_outputs, options)
    return _results(cfg, (logits,), extras)


def sharded_fused_loss(logits_shard, labels=None, *, axis_name, vocab_global: int, **kwargs):
    """fused_loss over a vocabulary sharded along the shard_map axis `axis_name`: call it INSIDE
    shard_map, with logits_shard this device's columns [i * V_local, (i + 1) * V_local) of the
    [..., vocab_global] logits, i = jax.lax.axis_index(axis_name). Shards must be equal
    (V_local * axis size == vocab_global); labels are global column ids, and every per-row input
    (labels, weights, ...) is the whole batch's on every device.

    One collective: each device's block of statistics (hl_loss_plan_execute_stats), a
    jax.lax.all_gather of the blocks over the axis, then hl_loss_plan_execute_finish (dense
    distill_jsd: two, its middle step's blocks gathered the same way before the finish). Every other
    keyword argument and the return value are fused_loss's: the loss and metrics, the same on every
    device; jax.grad gives the gradient w.r.t. logits_shard (this device's slice of the full one).
    Take the gradient inside the shard_map body, or outside it with check_vma on (the default):
    with check_vma=False shard_map cannot tell that the loss is replicated, and its transpose
    divides the gradient by the axis size. On CUDA, each of the two calls reads this device's first
    column from device memory: one 8-byte copy and a synchronisation of XLA's stream each.
    """
    ranks = jax.lax.axis_size(axis_name)
    if logits_shard.shape[-1] * ranks != vocab_global:
        raise ValueError(f"sharded_fused_loss needs equal shards: {logits_shard.shape[-1]} columns "
                         f"x {ranks} devices along {axis_name!r} != vocab_global = {vocab_global}")
    cfg, extras = _kwargs_config("sharded_fused_loss", logits_shard, labels, kwargs, axis_name=axis_name,
                                 vocab_global=int(vocab_global), ranks=ranks)
    return _results(cfg, (logits_shard,), extras)


# ---- the fused linear form ------------------------------------------------------------------------

def linear_loss(hidden, weight, labels=None, *, terms: Sequence[str] = ("ce",), weights=None,
                teacher_logits=None, teacher_hidden=None, teacher_weight=None, advantages=None,
                old_logprobs=None, ref_logprobs=None, rollout_logprobs=None, cu_seqlens=None,
                teacher_topk_ids=None, teacher_topk_logprobs=None,
                divisor: Optional[float] = None, token_outputs: bool = False,
                ignore_index: Optional[int] = None, check: bool = True, grad_weight_dtype=None,
                max_workspace_bytes: Optional[int] = DEFAULT_MAX_WORKSPACE_BYTES, **options):
    """The fused linear form of the loss plan: the loss of the logits hidden @ weight.T without
    forming them (headloss.h, "The fused linear form"; a chunk of rows at a time exists, in a
    workspace from XLA's scratch allocator of at most max_workspace_bytes, 256 MiB by default as
    in PyTorch (None: the plan's fast size, faster for more memory), never below the plan's
    minimum).

    hidden [..., H] and weight [V, H] (a Dense kernel [H, V] is weight.T) in one dtype (float32,
    float16 or bfloat16); labels and the per-row inputs [...] as fused_loss; teacher_logits
    [..., V], or a teacher of its own: teacher_hidden [..., Ht] and teacher_weight [V, Ht] in
    hidden's dtype, or a sparse teacher as fused_loss's. Options and the return value as fused_loss. jax.grad w.r.t. hidden and weight
    uses the gradients formed in the same call as the loss (only those of the arguments being
    differentiated); grad_weight_dtype="float32" sums grad_weight over the chunks in fp32 (one
    rounding, to weight's dtype, in the backward pass). No gradient flows to the teacher.
    """
    kw = dict(options, terms=terms, weights=weights, teacher_logits=teacher_logits,
              teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, advantages=advantages,
              old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
              cu_seqlens=cu_seqlens, teacher_topk_ids=teacher_topk_ids,
              teacher_topk_logprobs=teacher_topk_logprobs, divisor=divisor, token_outputs=token_outputs,
              ignore_index=ignore_index, check=check,
              grad_weight_dtype=grad_weight_dtype, max_workspace_bytes=max_workspace_bytes)
    cfg, extras = _linear_config("linear_loss", hidden, weight, labels, kw)
    return _results(cfg, (hidden, weight), extras)


def sharded_linear_loss(hidden, weight_shard, labels=None, *, axis_name, vocab_global: int, **kwargs):
    """linear_loss with the weight sharded by vocabulary rows along the shard_map axis
    `axis_name`: call it INSIDE shard_map, with weight_shard this device's rows [i * V_local,
    (i + 1) * V_local) of the [vocab_global, H] weight (teacher_weight and teacher_logits sharded
    the same way), and hidden, labels and the per-row inputs the whole batch's on every device.

    As sharded_fused_loss: each device's block of statistics, one jax.lax.all_gather, the finish;
    the loss and metrics are the same bits on every device, jax.grad gives the gradient w.r.t.
    weight_shard (this device's rows) and w.r.t. hidden (each device's part, summed by one
    jax.lax.psum: the collective every tensor-parallel linear layer has). The statistics and the
    finish are two XLA calls with a workspace each, so the finish forms the logits again (four
    products in all, against the three of LinearLossPlan.stats / finish sharing one workspace;
    dense distill_jsd's middle step forms them once more).
    """
    ranks = jax.lax.axis_size(axis_name)
    if weight_shard.shape[0] * ranks != vocab_global:
        raise ValueError(f"sharded_linear_loss needs equal shards: {weight_shard.shape[0]} rows x {ranks} "
                         f"devices along {axis_name!r} != vocab_global = {vocab_global}")
    cfg, extras = _linear_config("sharded_linear_loss", hidden, weight_shard, labels, kwargs,
                                 vocab_global=int(vocab_global), ranks=ranks)
    return _results(cfg._replace(axis_name=axis_name), (hidden, weight_shard), extras)


# ---- preference losses -----------------------------------------------------------------------------

# TRL's metric names for the plan's scalars (as headloss.torch_preference.METRICS).
def preference_loss(hidden, weight, labels, cu_seqlens, ref_logps=None, *, loss: str = "dpo",
                    loss_type: str = "sigmoid", beta: float = 0.1, gamma: Optional[float] = None,
                    label_smoothing: float = 0.0, nll_weight: float = 0.0, kto_labels=None,
                    max_workspace_bytes: Optional[int] = DEFAULT_MAX_WORKSPACE_BYTES, **options):
    """(loss, metrics) of a preference loss (docs/loss.md "Preference losses"), as
    headloss.torch_preference.preference_loss: hidden [rows, H] with the head's weight [V, H]
    (linear_loss: no [rows, V] logits), or logits [rows, V] with weight None (fused_loss).
    2P sequences by cu_seqlens [2P + 1], the P chosen completions first, then their rejected ones
    in the same order; prompt tokens carry label -100. ref_logps [2P]: the reference's sequence
    log-probs (DPO, KTO); kto_labels [2P]: KTO's 1 desirable, 0 undesirable, -1 KL completion.
    loss: "dpo", "simpo", "orpo", "cpo" or "kto"; loss_type DPO's and CPO's (TRL's names); gamma
    SimPO's margin (None: 0.5 as TRL); nll_weight > 0 adds the chosen tokens' NLL (TRL's
    rpo_alpha, ORPO's and CPO's NLL) in the same pass. Other plan options (pref_logp, pref_tau,
    kto_*_weight, ...) by keyword. metrics: TRL's names (PREFERENCE_METRICS), without gradient.
    Differentiable w.r.t. hidden and weight (or the logits) under jax.grad and jax.jit."""
    opts = dict(options, **preference_options(loss, loss_type, beta, gamma, label_smoothing, nll_weight),
                ref_seq_logprobs=None if ref_logps is None else jnp.asarray(ref_logps, jnp.float32),
                kto_labels=None if kto_labels is None else jnp.asarray(kto_labels, jnp.int32))
    if nll_weight:  # CE on the chosen completions' tokens alone (the first half of the sequences)
        chosen_end = cu_seqlens[(cu_seqlens.shape[0] - 1) // 2]
        opts["weights"] = (jnp.arange(labels.shape[0]) < chosen_end).astype(jnp.float32)
    if weight is None:
        loss_value, metrics = fused_loss(hidden, labels, cu_seqlens=cu_seqlens, **opts)
    else:
        loss_value, metrics = linear_loss(hidden, weight, labels, cu_seqlens=cu_seqlens,
                                          max_workspace_bytes=max_workspace_bytes, **opts)
    return loss_value, {name: metrics[s] for name, s in PREFERENCE_METRICS.items()}


# ---- per-token outputs with a backward ---------------------------------------------------------------

class TokenLogprobs(NamedTuple):
    logp: Any     # log p of the label (0 where the row is ignored or there are no labels)
    entropy: Any  # of the row's softmax
    lse: Any      # log-sum-exp of the row's logits (after temperature and soft cap)


# The upstream gradients' names (_GRAD_INPUTS' order).
_TOKEN_GRADS = ("logp", "entropy", "lse")


@jax.tree_util.register_static
class _Need(NamedTuple):
    """Which operands the backward differentiates: static, so it travels in the residuals."""
    grads: Tuple[bool, ...]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tokens(cfg: _Cfg, operands, labels):
    _, _, toks = _loss_call(cfg, operands, (labels,), (False,) * len(operands))
    return TokenLogprobs(*toks[1:])


def _tokens_fwd(cfg, operands, labels):
    # The forward forms no gradient (one product a chunk in the linear form): the backward runs
    # the plan again with the cotangents, for the operands being differentiated only.
    need = _Need(tuple(bool(x.perturbed) for x in operands))
    operands, labels = jax.tree_util.tree_map(lambda x: x.value, (operands, labels))
    return _tokens(cfg, operands, labels), (operands, labels, need)


def _tokens_bwd(cfg, saved, cts):
    operands, labels, need = saved
    # An unused output's cotangent is a symbolic zero: no flag, no work (logp without labels is a
    # constant 0).
    ups = tuple(None if isinstance(g, SymbolicZero) or (n == "logp" and labels is None) else g.astype(jnp.float32)
                for n, g in zip(_TOKEN_GRADS, cts))
    if all(u is None for u in ups):
        return tuple(jnp.zeros_like(x) if n else None for x, n in zip(operands, need.grads)), None
    extras = _by_bit(labels=labels, **dict(zip(_GRAD_INPUTS, ups)))
    _, gs, _ = _loss_call(cfg._replace(token_outputs=False), operands, extras, need.grads)
    return tuple(None if g is None else g.astype(dt) for g, dt in zip(gs, cfg.dtypes)), None


_tokens.defvjp(_tokens_fwd, _tokens_bwd, symbolic_zeros=True)


def _token_kwargs(temperature, softcap, ignore_index, check) -> dict:
    return dict(terms=(), token_outputs=True, logit_scale=temperature_scale(temperature), softcap=softcap,
                ignore_index=ignore_index, check=check)


def _token_results(cfg: _Cfg, operands, labels) -> TokenLogprobs:
    shape = operands[0].shape[:-1]
    return TokenLogprobs(*(t.reshape(shape) for t in _tokens(cfg, tuple(operands), labels)))


def token_logprobs(logits, labels=None, *, temperature: float = 1.0, softcap: Optional[float] = None,
                   ignore_index: Optional[int] = None, check: bool = True) -> TokenLogprobs:
    """(logp, entropy, lse) of logits [..., V] / temperature (optionally soft-capped), each [...]
    fp32, differentiable w.r.t. the logits (jax.custom_vjp) and jit-compatible; as
    headloss.torch_tokens.token_logprobs. labels [...] int32 / int64: the ids whose log-prob logp
    is (< 0 or ignore_index: ignored, logp 0; None: logp is 0). The forward runs the plan with no
    term; the backward runs it again with the outputs' cotangents (those not symbolically zero).
    check=False skips the label range check (on CUDA a synchronisation of XLA's stream)."""
    kw = _token_kwargs(temperature, softcap, ignore_index, check)
    cfg, extras = _kwargs_config("token_logprobs", logits, labels, kw)
    return _token_results(cfg, (logits,), extras[0])


def linear_token_logprobs(hidden, weight, labels=None, *, temperature: float = 1.0,
                          softcap: Optional[float] = None, ignore_index: Optional[int] = None,
                          check: bool = True, grad_weight_dtype=None,
                          max_workspace_bytes: Optional[int] = DEFAULT_MAX_WORKSPACE_BYTES) -> TokenLogprobs:
    """token_logprobs of the logits hidden @ weight.T without forming them: hidden [..., H], weight
    [V, H] in one dtype. The forward is one product a chunk; jax.grad w.r.t. hidden and weight
    (only those being differentiated) forms the logits again, chunk by chunk, in a workspace from
    XLA's scratch allocator (max_workspace_bytes as linear_loss's). grad_weight_dtype="float32"
    sums grad_weight over the chunks in fp32 (one rounding to weight's dtype)."""
    kw = dict(_token_kwargs(temperature, softcap, ignore_index, check), grad_weight_dtype=grad_weight_dtype,
              max_workspace_bytes=max_workspace_bytes)
    cfg, extras = _linear_config("linear_token_logprobs", hidden, weight, labels, kw)
    return _token_results(cfg, (hidden, weight), extras[0])


# ---- the split steps, for a gather of your own ------------------------------------------------------

def loss_stats(logits_shard, labels=None, *, vocab_start, vocab_global: int, ranks: int,
               grad: bool = True, **kwargs):
    """Step 1 of the vocabulary-sharded loss (hl_loss_plan_execute_stats): this shard's block of
    per-row statistics, a uint8 array of hl_loss_plan_get_stats_size bytes, to all-gather (tiled,
    in any order) across the `ranks` shards, e.g. jax.lax.all_gather(block, axis, tiled=True).

    logits_shard holds columns [vocab_start, vocab_start + V_local) of a vocabulary of vocab_global
    columns (shards may be uneven); labels are global ids. vocab_start is a Python int or a scalar
    int32 / int64 array, e.g. computed from jax.lax.axis_index under shard_map (on CUDA it is read
    from device memory: an 8-byte copy and a synchronisation of XLA's stream). grad and the keyword
    arguments (fused_loss's) must be loss_finish's: the block carries a fingerprint of the plan and
    the finish refuses another plan's; those that do not bear on the statistics (weights, ...) are
    accepted and unused. No autodiff rule: see sharded_fused_loss for a differentiable loss.
    The block's size depends on the backend (fp64 records on the CPU, fp32 on CUDA): it is the
    platform of the shard_map mesh, else of logits_shard, else (under jit) of the default device.
    """
    cfg, extras = _kwargs_config("loss_stats", logits_shard, labels, kwargs,
                                 vocab_global=int(vocab_global), ranks=int(ranks))
    return _split_call("headloss_loss_stats", cfg, (logits_shard,), extras, (vocab_start,), (bool(grad),))


def loss_exchanges(logits_shard, labels=None, *, vocab_global: int, ranks: int, **kwargs) -> int:
    """All-gathers the split takes for these arguments (as loss_stats'): 1, or 2 for dense
    distill_jsd, whose loss_middle and a second all-gather come before loss_finish."""
    cfg, extras = _kwargs_config("loss_exchanges", logits_shard, labels, kwargs,
                                 vocab_global=int(vocab_global), ranks=int(ranks))
    return _exchanges(cfg, (logits_shard,), extras)


def loss_middle(gathered, logits_shard, labels=None, *, vocab_start, vocab_global: int, ranks: int,
                grad: bool = True, **kwargs):
    """Step 2a of a split of two exchanges (hl_loss_plan_execute_middle): from the gathered blocks
    (every shard's loss_stats, concatenated), this shard's middle block, a uint8 array to
    all-gather like the first and pass to loss_finish as gathered_middle. Arguments as loss_stats.
    """
    cfg, extras = _kwargs_config("loss_middle", logits_shard, labels, kwargs,
                                 vocab_global=int(vocab_global), ranks=int(ranks))
    return _split_call("headloss_loss_middle", cfg, (logits_shard,), extras, (gathered, vocab_start),
                       (bool(grad),))


def loss_finish(gathered, logits_shard, labels=None, *, vocab_start, vocab_global: int, ranks: int,
                grad: bool = True, gathered_middle=None, **kwargs):
    """Step 3 (hl_loss_plan_execute_finish, with gathered_middle _finish_with_middle): merges the gathered
    blocks (every shard's loss_stats, concatenated; with two exchanges also every shard's
    loss_middle) and returns (loss, metrics, grad or None), plus the token outputs with
    token_outputs=True: the loss and metrics are the same bits on every shard, grad is this shard's
    columns of the gradient. Arguments as loss_stats; a buffer that does not hold the `ranks`
    blocks of one plan tiling the vocabulary raises with the library's message.
    """
    cfg, extras = _kwargs_config("loss_finish", logits_shard, labels, kwargs,
                                 vocab_global=int(vocab_global), ranks=int(ranks))
    tail = (gathered,) + (() if gathered_middle is None else (gathered_middle,)) + (_vocab_start(vocab_start),)
    scalars, (g,), toks = _loss_call(cfg, (logits_shard,), extras, (bool(grad),), "headloss_loss_finish", tail)
    out = (scalars[0], _metrics(scalars), g)
    return out + (toks,) if cfg.token_outputs else out
