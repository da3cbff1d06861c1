"""PyTorch custom ops over headloss: autograd-aware and opaque to torch.compile.

    from headloss.torch_ops import RMSNorm, rmsnorm, lm_head_loss
    norm = RMSNorm(4096, eps=1e-6).cuda()                  # a drop-in nn.Module
    y = norm(x)                                             # or y, s = norm(x, residual=r)
    loss, metrics = lm_head_loss(logits, labels, terms=("ce", "z"), z_weight=1e-4)
    loss.backward()
    loss, metrics = linear_loss(hidden, lm_head.weight, labels)  # the logits never in memory
    torch.compile(model)                                    # the ops stay single kernels

Registered ops (torch.library.custom_op, with fake implementations for tracing and autograd
formulas): headloss::rmsnorm_fwd, headloss::rmsnorm_bwd, headloss::fused_loss,
headloss::linear_loss. In eager mode
rmsnorm skips the dispatcher (an autograd.Function with the same formulas, cheaper per call);
torch.compile sees the custom ops. CUDA tensors run on
the CUDA backend on torch's current stream; CPU tensors on the CPU reference backend (fp64
accumulation), which makes CPU autograd checks possible.
"""
from __future__ import annotations

import contextlib
import json
from functools import lru_cache
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ._lib import HeadlossTypeError, HeadlossValueError
from ._loss_options import call_value, terms_key
from .loss import SCALARS, LinearLossPlan, LossPlan
from .rmsnorm import CASTS, cast_code as _cast_code
from .rmsnorm import rmsnorm_bwd as _hl_rmsnorm_bwd
from .rmsnorm import rmsnorm_fwd as _hl_rmsnorm_fwd
from .torch_loss import DEFAULT_MAX_WORKSPACE_BYTES, LINEAR_INPUTS, keep_grads, run_linear, scale_grad, seq_options, take_grads

__all__ = ["RMSNorm", "rmsnorm", "lm_head_loss", "LMHeadLoss", "linear_loss", "LinearLoss",
           "LMHeadLinearLoss"]

_CAST_NAMES = {v: k for k, v in CASTS.items()}


def _dense(t: Optional[Tensor]) -> Optional[Tensor]:
    """Incoming gradients may be expanded (stride 0) or otherwise strided: the library wants rows
    with a contiguous last dimension."""
    if t is None or t.is_contiguous():
        return t
    return t.contiguous()


# ---- RMSNorm -------------------------------------------------------------------------------------

def _fwd_impl(x: Tensor, weight: Optional[Tensor], residual: Optional[Tensor], eps: float,
              offset: float, cast: int, out_dtype: Optional[torch.dtype],
              want_rstd: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(y, residual_out, rstd); residual_out and rstd are empty when not asked for."""
    out = _hl_rmsnorm_fwd(x, weight, eps=eps, offset=offset, cast=_CAST_NAMES[cast],
                          residual=residual, out_dtype=out_dtype, return_rstd=want_rstd)
    s = out.residual_out if residual is not None else x.new_empty(0)
    rstd = out.rstd if want_rstd else x.new_empty(0, dtype=torch.float32)
    return out.y, s, rstd


def _bwd_impl(dy: Tensor, s: Tensor, weight: Optional[Tensor], rstd: Optional[Tensor],
              dresidual_out: Optional[Tensor], eps: float, offset: float,
              cast: int) -> Tuple[Tensor, Tensor]:
    """(dx, dw); dw is empty without a weight."""
    dx, dw = _hl_rmsnorm_bwd(_dense(dy), s, weight, rstd, eps=eps, offset=offset,
                             cast=_CAST_NAMES[cast], dresidual_out=_dense(dresidual_out))
    return dx, (dw if dw is not None else s.new_empty(0))


_rmsnorm_fwd = torch.library.custom_op("headloss::rmsnorm_fwd", mutates_args=())(_fwd_impl)


@_rmsnorm_fwd.register_fake
def _(x, weight, residual, eps, offset, cast, out_dtype, want_rstd):
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    y = x.new_empty(x.shape, dtype=out_dtype or x.dtype)
    s = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    rstd = x.new_empty((rows,) if want_rstd else (0,), dtype=torch.float32)
    return y, s, rstd


_rmsnorm_bwd = torch.library.custom_op("headloss::rmsnorm_bwd", mutates_args=())(_bwd_impl)


@_rmsnorm_bwd.register_fake
def _(dy, s, weight, rstd, dresidual_out, eps, offset, cast):
    return s.new_empty(s.shape), (weight.new_empty(weight.shape) if weight is not None else s.new_empty(0))


def _rmsnorm_setup(ctx, inputs, output):
    x, weight, residual, eps, offset, cast, _, want_rstd = inputs
    _, s, rstd = output
    fused = residual is not None
    ctx.save_for_backward(s if fused else x, weight, rstd if want_rstd else None)
    ctx.cfg = (eps, offset, cast)
    ctx.fused = fused


def _rmsnorm_backward(ctx, dy, ds, _drstd):
    s, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.headloss.rmsnorm_bwd(dy, s, weight, rstd, ds if ctx.fused else None, *ctx.cfg)
    return (dx, dw if weight is not None else None, dx if ctx.fused else None,
            None, None, None, None, None)


_rmsnorm_fwd.register_autograd(_rmsnorm_backward, setup_context=_rmsnorm_setup)


class _RMSNormFunction(torch.autograd.Function):
    """The eager path: the same formulas as the custom op's, without the dispatcher round trip
    (about 30 us less per call); torch.compile traces the custom op instead."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps, offset, cast, out_dtype):
        y, s, rstd = _fwd_impl(x, weight, residual, eps, offset, cast, out_dtype, True)
        ctx.fused = residual is not None
        ctx.save_for_backward(s if ctx.fused else x, weight, rstd)
        ctx.cfg = (eps, offset, cast)
        if not ctx.fused:
            ctx.mark_non_differentiable(s)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        s, weight, rstd = ctx.saved_tensors
        dx, dw = _bwd_impl(dy, s, weight, rstd, ds if ctx.fused else None, *ctx.cfg)
        return (dx, dw if weight is not None else None, dx if ctx.fused else None,
                None, None, None, None)


def rmsnorm(x: Tensor, weight: Optional[Tensor] = None, *, eps: float = 1e-6, offset: float = 0.0,
            cast: str = "llama", residual: Optional[Tensor] = None,
            out_dtype: Optional[torch.dtype] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """y = RMSNorm(s) * (offset + weight) over the last dimension, s = x (+ residual).

    Differentiable w.r.t. x, weight and residual (one fused backward kernel), and traceable by
    torch.compile (headloss::rmsnorm_fwd is an opaque custom op). Returns y, or (y, residual_out)
    when a residual is fused. cast: "llama" (HF default), "gemma" (fp32 throughout; with
    offset=1) or "none". rstd is stored only when a gradient will be needed.
    """
    want_rstd = torch.is_grad_enabled() and (
        x.requires_grad or (weight is not None and weight.requires_grad)
        or (residual is not None and residual.requires_grad))
    if torch.compiler.is_compiling():
        y, s, _ = torch.ops.headloss.rmsnorm_fwd(x, weight, residual, float(eps), float(offset),
                                                 _cast_code(cast), out_dtype, bool(want_rstd))
    elif want_rstd:
        y, s = _RMSNormFunction.apply(x, weight, residual, float(eps), float(offset),
                                      _cast_code(cast), out_dtype)
    else:
        y, s, _ = _fwd_impl(x, weight, residual, float(eps), float(offset), _cast_code(cast),
                            out_dtype, False)
    return y if residual is None else (y, s)


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension with headloss kernels.

    hidden_size: N. eps: added to mean(x^2). offset: y = x_hat * (offset + weight); Gemma uses 1
    (then the weight starts at 0). cast: "llama", "gemma" or "none". elementwise_affine=False: no
    weight. forward(x) -> y; forward(x, residual) -> (y, x + residual) (the fused pre-norm add).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, offset: float = 0.0,
                 cast: str = "llama", elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        _cast_code(cast)
        self.hidden_size, self.eps, self.offset, self.cast = hidden_size, eps, offset, cast
        if elementwise_affine:
            init = torch.zeros if offset else torch.ones
            self.weight = torch.nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        return rmsnorm(x, self.weight, eps=self.eps, offset=self.offset, cast=self.cast,
                       residual=residual)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, cast={self.cast!r}, "
                f"elementwise_affine={self.weight is not None}")


# ---- the fused loss plan -------------------------------------------------------------------------

@lru_cache(maxsize=64)
def _plan(options: str, vocab: int, dtype: torch.dtype, device: str, labels_dtype, grad: bool) -> LossPlan:
    return LossPlan(vocab, dtype, device=device, labels_dtype=labels_dtype,
                    grad="write" if grad else None, **json.loads(options))


def _fused_loss_impl(logits: Tensor, labels: Optional[Tensor], weights: Optional[Tensor],
                teacher_logits: Optional[Tensor], advantages: Optional[Tensor],
                old_logprobs: Optional[Tensor], ref_logprobs: Optional[Tensor],
                rollout_logprobs: Optional[Tensor], cu_seqlens: Optional[Tensor],
                teacher_topk_ids: Optional[Tensor], teacher_topk_logprobs: Optional[Tensor], options: str,
                divisor: float, need_grad: bool) -> Tuple[Tensor, Tensor]:
    """(scalars fp32 [len(SCALARS)], gradient or an empty tensor). options: the plan's options as
    JSON (static: one plan per distinct string, vocabulary, dtype and device)."""
    plan = _plan(options, logits.shape[-1], logits.dtype, logits.device.type, _dtype_name(labels),
                 need_grad)
    out = plan(logits, labels, weights=weights, teacher_logits=teacher_logits,
               advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
               rollout_logprobs=rollout_logprobs, cu_seqlens=cu_seqlens, teacher_topk_ids=teacher_topk_ids,
               teacher_topk_logprobs=teacher_topk_logprobs, divisor=divisor or None)
    return out.scalars, (out.grad if need_grad else logits.new_empty(0))


_fused_loss = torch.library.custom_op("headloss::fused_loss", mutates_args=())(_fused_loss_impl)


@_fused_loss.register_fake
def _(logits, labels, weights, teacher_logits, advantages, old_logprobs, ref_logprobs,
      rollout_logprobs, cu_seqlens, teacher_topk_ids, teacher_topk_logprobs, options, divisor, need_grad):
    gdt = json.loads(options).get("grad_dtype")
    grad = (logits.new_empty(logits.shape, dtype=getattr(torch, gdt) if gdt else logits.dtype)
            if need_grad else logits.new_empty(0))
    return logits.new_empty((len(SCALARS),), dtype=torch.float32), grad


def _loss_setup(ctx, inputs, output):
    keep_grads(ctx, output[1])
    ctx.logits_dtype = inputs[0].dtype


def _loss_backward(ctx, dscalars, _dgrad):
    # The loss is scalars[0]: its incoming gradient scales the one formed in the forward pass, in
    # place, and the buffer is handed over (torch_loss.keep_grads: no second [rows, vocab] tensor).
    (g,) = take_grads(ctx)
    return (scale_grad(g, dscalars[0], ctx.logits_dtype),) + (None,) * 13


_fused_loss.register_autograd(_loss_backward, setup_context=_loss_setup)


class _EagerLoss(torch.autograd.Function):
    """A loss op's eager path: its implementation (scalars, then the gradients it formed, empty
    where not asked for) in an autograd.Function whose outputs are the loss and the scalars alone.
    The custom op (what torch.compile traces) must return its gradients as outputs, and autograd
    then copies them into .grad in eager mode (measured: twice the gradients' memory); here they
    are kept as plain references and handed over in backward, so autograd adopts them."""

    @staticmethod
    def forward(ctx, impl, diff: tuple, *args):
        scalars, *grads = impl(*args)
        keep_grads(ctx, *(g if g.numel() else None for g in grads))
        ctx.diff, ctx.dtypes, ctx.nargs = diff, tuple(args[i].dtype for i in diff), len(args)
        ctx.mark_non_differentiable(scalars)
        return scalars[0].clone(), scalars

    @staticmethod
    def backward(ctx, dloss, _dscalars):
        out = [None] * ctx.nargs
        for i, g, dt in zip(ctx.diff, take_grads(ctx), ctx.dtypes):
            out[i] = None if g is None else scale_grad(g, dloss, dt)
        return (None, None, *out)


def _run_loss(op, impl, diff: tuple, *args) -> Tuple[Tensor, Tensor]:
    """(loss, scalars) of a loss op: the custom op under torch.compile, _EagerLoss otherwise. diff:
    the positions of the arguments its gradients belong to, in the order it returns them."""
    if torch.compiler.is_compiling():
        scalars = op(*args)[0]
        return scalars[0], scalars
    return _EagerLoss.apply(impl, diff, *args)


def _dtype_name(t: Optional[Tensor]) -> Optional[str]:
    return None if t is None else str(t.dtype).replace("torch.", "")


@torch.compiler.assume_constant_result
def _options_json(key: tuple) -> str:
    """The plan options as the op's static JSON string (evaluated once while tracing); dtypes
    (grad_dtype, grad_weight_dtype) by name."""
    opts = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v) for k, v in key}
    return json.dumps(opts, sort_keys=True)


def _options_key(terms, options: dict) -> tuple:
    return tuple(sorted(options.items())) + (("terms", terms_key(terms)),)


def _metrics(scalars: Tensor) -> dict:
    return dict(zip(SCALARS, scalars.detach().unbind(0)))


def lm_head_loss(logits: Tensor, labels: Optional[Tensor] = None, *, terms: Sequence[str] = ("ce",),
                 weights: Optional[Tensor] = None, teacher_logits: Optional[Tensor] = None,
                 advantages: Optional[Tensor] = None, old_logprobs: Optional[Tensor] = None,
                 ref_logprobs: Optional[Tensor] = None, rollout_logprobs: Optional[Tensor] = None,
                 cu_seqlens: Optional[Tensor] = None, teacher_topk_ids: Optional[Tensor] = None,
                 teacher_topk_logprobs: Optional[Tensor] = None, divisor: Optional[float] = None,
                 **options):
    """The fused LM-head loss plan as a torch custom op: (loss, metrics dict of 0-d tensors).

    terms: a name or names of headloss.TERMS (default "ce"); divisor: D (default None: the sum of
    the valid rows' weights). Options, each defaulting to None (the library's default, as
    headloss.LossPlan's docstring lists: z_weight 1e-4, ...), as headloss.LossPlan (ce_weight, z_weight, entropy_weight, distill_weight,
    grpo_weight, kl_ref_beta, label_smoothing, logit_scale, softcap, teacher/student_temperature,
    eps_low, eps_high, dual_clip, cispo_weight, cispo_eps_high, kl_estimator, ratio_level,
    rollout_correction, rollout_level, rollout_cap, rollout_floor, jsd_beta, teacher_topk,
    topk_ids_dtype, ignore_index, grad_dtype, check); rollout_logprobs and cu_seqlens (over the
    flattened rows) as LossPlan's call; a sparse teacher (teacher_topk = k) passes teacher_topk_ids /
    teacher_topk_logprobs [..., k]. The gradient w.r.t. the logits is
    formed in the same pass when autograd needs it, and scaled by the loss's incoming gradient in
    backward. Works under torch.compile (headloss::fused_loss is opaque to the compiler; the plan
    is made once per options / vocabulary / dtype / device).
    """
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    loss, scalars = _run_loss(
        torch.ops.headloss.fused_loss, _fused_loss_impl, (0,),
        logits, labels, weights, teacher_logits, advantages, old_logprobs, ref_logprobs,
        rollout_logprobs, cu_seqlens, teacher_topk_ids, teacher_topk_logprobs,
        _options_json(_options_key(terms, seq_options(options, cu_seqlens))),
        call_value("divisor", divisor), bool(need_grad))
    return loss, _metrics(scalars)


class LMHeadLoss(torch.nn.Module):
    """lm_head_loss as a module: the options at construction, the inputs at call time."""

    def __init__(self, terms: Sequence[str] = ("ce",), **options):
        super().__init__()
        self.terms, self.options = terms_key(terms), options

    def forward(self, logits: Tensor, labels: Optional[Tensor] = None, **inputs):
        return lm_head_loss(logits, labels, terms=self.terms, **inputs, **self.options)


# ---- the fused linear form -----------------------------------------------------------------------

@lru_cache(maxsize=64)
def _linear_plan(options: str, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 labels_dtype, teacher_hidden: int, grad_hidden: bool, grad_weight: bool) -> LinearLossPlan:
    opts = json.loads(options)
    gw_dtype = opts.pop("grad_weight_dtype", None)
    return LinearLossPlan(vocab, hidden, dtype, device=device.type, labels_dtype=labels_dtype,
                          teacher_hidden=teacher_hidden, grad_hidden="write" if grad_hidden else None,
                          grad_weight="write" if grad_weight else None,
                          grad_weight_dtype=gw_dtype if grad_weight else None, **opts)


def _linear_loss_impl(hidden: Tensor, weight: Tensor, labels: Optional[Tensor], weights: Optional[Tensor],
                 teacher_logits: Optional[Tensor], advantages: Optional[Tensor],
                 old_logprobs: Optional[Tensor], ref_logprobs: Optional[Tensor],
                 rollout_logprobs: Optional[Tensor], cu_seqlens: Optional[Tensor],
                 teacher_topk_ids: Optional[Tensor], teacher_topk_logprobs: Optional[Tensor],
                 teacher_hidden: Optional[Tensor], teacher_weight: Optional[Tensor], options: str,
                 divisor: float, need_grad_hidden: bool, need_grad_weight: bool,
                 max_workspace_bytes: Optional[int]) -> Tuple[Tensor, Tensor, Tensor]:
    """(scalars fp32 [len(SCALARS)], grad_hidden, grad_weight; an empty tensor for a gradient not
    asked for) of the fused linear plan on hidden [rows, H] and weight [V, H]. options: the plan's
    options as JSON (static: one plan per distinct string, shape, dtype, device and gradients)."""
    dev = hidden.device
    # A CUDA plan belongs to the device current at its creation, and runs there only.
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        plan = _linear_plan(options, weight.shape[0], hidden.shape[-1], hidden.dtype, dev,
                            _dtype_name(labels), 0 if teacher_hidden is None else teacher_hidden.shape[-1],
                            need_grad_hidden, need_grad_weight)
        inputs = (weights, teacher_logits, advantages, old_logprobs, ref_logprobs, teacher_hidden,
                  teacher_weight, rollout_logprobs, cu_seqlens, teacher_topk_ids,
                  teacher_topk_logprobs)  # LINEAR_INPUTS' order
        scalars, gh, gw = run_linear(plan, hidden, weight, labels, divisor or None, max_workspace_bytes,
                                     {k: v for k, v in zip(LINEAR_INPUTS, inputs) if v is not None})
    return (scalars, gh if gh is not None else hidden.new_empty(0),
            gw if gw is not None else hidden.new_empty(0))


_linear_loss = torch.library.custom_op("headloss::linear_loss", mutates_args=())(_linear_loss_impl)


@_linear_loss.register_fake
def _(hidden, weight, labels, weights, teacher_logits, advantages, old_logprobs, ref_logprobs,
      rollout_logprobs, cu_seqlens, teacher_topk_ids, teacher_topk_logprobs, teacher_hidden, teacher_weight,
      options, divisor, need_grad_hidden, need_grad_weight, max_workspace_bytes):
    gdt = json.loads(options).get("grad_weight_dtype")
    gh = hidden.new_empty(hidden.shape) if need_grad_hidden else hidden.new_empty(0)
    gw = (weight.new_empty(weight.shape, dtype=getattr(torch, gdt) if gdt else weight.dtype)
          if need_grad_weight else hidden.new_empty(0))
    return hidden.new_empty((len(SCALARS),), dtype=torch.float32), gh, gw


def _linear_setup(ctx, inputs, output):
    keep_grads(ctx, output[1], output[2])
    ctx.dtypes = (inputs[0].dtype, inputs[1].dtype)
    ctx.need = (inputs[16], inputs[17])  # need_grad_hidden, need_grad_weight


def _linear_backward(ctx, dscalars, _dgh, _dgw):
    grads = tuple(scale_grad(g, dscalars[0], dt) if need else None
                  for g, dt, need in zip(take_grads(ctx), ctx.dtypes, ctx.need))
    return grads + (None,) * 17


_linear_loss.register_autograd(_linear_backward, setup_context=_linear_setup)


def _matrix(t: Optional[Tensor]) -> Optional[Tensor]:
    """[..., C] as [rows, C] with a contiguous last dimension (a copy only where needed)."""
    if t is None:
        return None
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _per_row(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.reshape(-1).contiguous()


def _compute_dtype(hidden: Tensor, others: dict) -> dict:
    """hidden, the weight and the teacher's matrices in one dtype (the plan's weight_dtype): under
    autocast its dtype, as F.linear would compute; otherwise they must already agree."""
    mats = dict(hidden=hidden, **others)
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return {k: (None if t is None else t.to(dt)) for k, t in mats.items()}
    for k, t in others.items():
        if t is not None and t.dtype != hidden.dtype:
            raise HeadlossTypeError(f"linear_loss: {k} is {t.dtype} but hidden is {hidden.dtype}; the plan takes "
                            "them in one dtype (cast one, or run under torch.autocast)")
    return mats


def _head_weight(weight) -> Tensor:
    if isinstance(weight, torch.nn.Linear):
        if weight.bias is not None:
            raise HeadlossValueError("linear_loss: the nn.Linear has a bias, which linear_loss does not take; "
                                     "headloss.integrations.liger (or LinearLossPlan's bias=) does")
        return weight.weight
    return weight


def linear_loss(hidden: Tensor, weight, labels: Optional[Tensor] = None, *,
                terms: Sequence[str] = ("ce",), weights: Optional[Tensor] = None,
                teacher_logits: Optional[Tensor] = None, advantages: Optional[Tensor] = None,
                old_logprobs: Optional[Tensor] = None, ref_logprobs: Optional[Tensor] = None,
                rollout_logprobs: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None,
                teacher_topk_ids: Optional[Tensor] = None, teacher_topk_logprobs: Optional[Tensor] = None,
                divisor: Optional[float] = None, **options):
    """The fused linear form of the loss plan as a torch custom op: the loss of the logits
    hidden @ weight.T without forming them (only a chunk of rows at a time exists, in the
    workspace). Returns (loss, metrics dict of 0-d tensors, no gradient).

    hidden [..., H] (leading dims flattened to rows); weight [V, H] (lm_head.weight, or the
    nn.Linear itself, without a bias); labels and the per-row inputs [...] (labels < 0 ignored);
    teacher_logits [..., V], or a sparse teacher's teacher_topk_ids / _logprobs [..., k]. Options as lm_head_loss (ce_weight, z_weight, entropy_weight,
    distill_weight, grpo_weight, kl_ref_beta, label_smoothing, logit_scale, softcap,
    teacher_temperature, student_temperature, eps_low, eps_high, dual_clip, cispo_weight,
    cispo_eps_high, kl_estimator, the sequence and rollout options, ignore_index, check; the inputs
    rollout_logprobs and cu_seqlens as lm_head_loss), and:
      teacher_hidden [..., Ht], teacher_weight [V, Ht]: a teacher fused the same way (no gradient);
      grad_weight_dtype: "float32" sums grad_weight over the chunks in fp32 (one rounding, at the
        cast to weight's dtype in backward); None: in weight's dtype, rounded once a chunk;
      max_workspace_bytes: caps the workspace (default 256 MiB: the peak is the gradients + 256 MiB;
        None: the plan's fast size, up to 1.2x faster at 1-2 GiB more; docs/python.md);
        never below the plan's minimum. Smaller means more chunks: less memory, more passes over
        grad_weight.
    hidden, weight and the teacher's matrices share one dtype (under torch.autocast: autocast's).

    One call computes the loss and the gradients w.r.t. hidden and weight (those that require
    grad; neither under no_grad), and backward hands them back scaled in place by the incoming
    gradient, without a copy: the peak is the gradients plus the workspace. In eager mode the op
    runs as an autograd.Function; torch.compile(fullgraph=True) keeps headloss::linear_loss as one
    call. A vocabulary
    sharded over tensor-parallel ranks is not differentiable here: use headloss.LinearLossPlan's
    stats / finish (or nccl), whose grad_hidden is each rank's part to all-reduce.
    """
    teacher_hidden, teacher_weight = options.pop("teacher_hidden", None), options.pop("teacher_weight", None)
    max_workspace_bytes = options.pop("max_workspace_bytes", DEFAULT_MAX_WORKSPACE_BYTES)
    mats = _compute_dtype(hidden, dict(weight=_head_weight(weight), teacher_hidden=teacher_hidden,
                                       teacher_weight=teacher_weight, teacher_logits=teacher_logits))
    grad = torch.is_grad_enabled()
    loss, scalars = _run_loss(
        torch.ops.headloss.linear_loss, _linear_loss_impl, (0, 1),
        _matrix(mats["hidden"]), _matrix(mats["weight"]), _per_row(labels), _per_row(weights),
        _matrix(mats["teacher_logits"]), _per_row(advantages), _per_row(old_logprobs),
        _per_row(ref_logprobs), _per_row(rollout_logprobs), _per_row(cu_seqlens),
        _matrix(teacher_topk_ids), _matrix(teacher_topk_logprobs),
        _matrix(mats["teacher_hidden"]), _matrix(mats["teacher_weight"]),
        _options_json(_options_key(terms, seq_options(options, cu_seqlens))), call_value("divisor", divisor),
        bool(grad and mats["hidden"].requires_grad), bool(grad and mats["weight"].requires_grad),
        None if max_workspace_bytes is None else int(max_workspace_bytes))
    return loss, _metrics(scalars)


class LinearLoss(torch.nn.Module):
    """linear_loss as a module: the options at construction (terms, plan options,
    grad_weight_dtype, max_workspace_bytes), the inputs at call time:
    forward(hidden, weight or an nn.Linear, labels, **inputs) -> (loss, metrics)."""

    def __init__(self, terms: Sequence[str] = ("ce",), **options):
        super().__init__()
        self.terms, self.options = terms_key(terms), options

    def forward(self, hidden: Tensor, weight, labels: Optional[Tensor] = None, **inputs):
        return linear_loss(hidden, weight, labels, terms=self.terms, **inputs, **self.options)

    def extra_repr(self) -> str:
        return f"terms={self.terms}" + "".join(f", {k}={v!r}" for k, v in self.options.items())


LMHeadLinearLoss = LinearLoss
