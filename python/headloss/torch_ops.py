"""PyTorch custom ops over headloss: autograd-aware and opaque to torch.compile.

    from headloss.torch_ops import RMSNorm, rmsnorm, lm_head_loss
    norm = RMSNorm(4096, eps=1e-6).cuda()                  # a drop-in nn.Module
    y = norm(x)                                             # or y, s = norm(x, residual=r)
    loss, metrics = lm_head_loss(logits, labels, terms=("ce", "z"), z_weight=1e-4)
    loss.backward()
    torch.compile(model)                                    # the ops stay single kernels

Registered ops (torch.library.custom_op, with fake implementations for tracing and autograd
formulas): headloss::rmsnorm_fwd, headloss::rmsnorm_bwd, headloss::fused_loss. In eager mode
rmsnorm skips the dispatcher (an autograd.Function with the same formulas, cheaper per call);
torch.compile sees the custom ops. CUDA tensors run on
the CUDA backend on torch's current stream; CPU tensors on the CPU reference backend (fp64
accumulation), which makes CPU autograd checks possible.
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .loss import SCALARS, LossPlan
from .rmsnorm import rmsnorm_bwd as _hl_rmsnorm_bwd
from .rmsnorm import rmsnorm_fwd as _hl_rmsnorm_fwd

__all__ = ["RMSNorm", "rmsnorm", "lm_head_loss", "LMHeadLoss"]

_CAST = {"llama": 0, "gemma": 1, "none": 2}
_CAST_NAMES = {v: k for k, v in _CAST.items()}


def _cast_code(cast: str) -> int:
    if cast not in _CAST:
        raise ValueError(f"cast must be one of {sorted(_CAST)}, got {cast!r}")
    return _CAST[cast]


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


@torch.library.custom_op("headloss::fused_loss", mutates_args=())
def _fused_loss(logits: Tensor, labels: Optional[Tensor], weights: Optional[Tensor],
                teacher_logits: Optional[Tensor], advantages: Optional[Tensor],
                old_logprobs: Optional[Tensor], ref_logprobs: Optional[Tensor], options: str,
                divisor: float, need_grad: bool) -> Tuple[Tensor, Tensor]:
    """(scalars fp32 [len(SCALARS)], gradient or an empty tensor). options: the plan's options as
    JSON (static: one plan per distinct string, vocabulary, dtype and device)."""
    plan = _plan(options, logits.shape[-1], logits.dtype, logits.device.type,
                 None if labels is None else str(labels.dtype).replace("torch.", ""), need_grad)
    out = plan(logits, labels, weights=weights, teacher_logits=teacher_logits,
               advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
               divisor=divisor)
    return out.scalars, (out.grad if need_grad else logits.new_empty(0))


@_fused_loss.register_fake
def _(logits, labels, weights, teacher_logits, advantages, old_logprobs, ref_logprobs, options,
      divisor, need_grad):
    gdt = json.loads(options).get("grad_dtype")
    grad = (logits.new_empty(logits.shape, dtype=getattr(torch, gdt) if gdt else logits.dtype)
            if need_grad else logits.new_empty(0))
    return logits.new_empty((len(SCALARS),), dtype=torch.float32), grad


def _loss_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.logits_dtype = inputs[0].dtype


def _loss_backward(ctx, dscalars, _dgrad):
    (g,) = ctx.saved_tensors
    # The loss is scalars[0]: its incoming gradient scales the one formed in the forward pass
    # (no host synchronisation to test for 1). In place: the forward's buffer is used once, so
    # no second [rows, vocab] tensor is allocated. A second backward (retain_graph=True) is
    # refused by autograd's version check on the saved buffer rather than scaled twice.
    g.mul_(dscalars[0].to(g.dtype))
    return (g.to(ctx.logits_dtype),) + (None,) * 9


_fused_loss.register_autograd(_loss_backward, setup_context=_loss_setup)

@torch.compiler.assume_constant_result
def _options_json(key: tuple) -> str:
    """The plan options as the op's static JSON string (evaluated once while tracing)."""
    opts = dict(key)
    if opts.get("grad_dtype") is not None:
        opts["grad_dtype"] = str(opts["grad_dtype"]).replace("torch.", "")
    return json.dumps(opts, sort_keys=True)


def lm_head_loss(logits: Tensor, labels: Optional[Tensor] = None, *, terms: Sequence[str] = ("ce",),
                 weights: Optional[Tensor] = None, teacher_logits: Optional[Tensor] = None,
                 advantages: Optional[Tensor] = None, old_logprobs: Optional[Tensor] = None,
                 ref_logprobs: Optional[Tensor] = None, divisor: float = 0.0, **options):
    """The fused LM-head loss plan as a torch custom op: (loss, metrics dict of 0-d tensors).

    Options as headloss.LossPlan (ce_weight, z_weight, entropy_weight, distill_weight,
    grpo_weight, kl_ref_beta, label_smoothing, logit_scale, softcap, teacher/student_temperature,
    eps_low, eps_high, ignore_index, grad_dtype, check). The gradient w.r.t. the logits is
    formed in the same pass when autograd needs it, and scaled by the loss's incoming gradient in
    backward. Works under torch.compile (headloss::fused_loss is opaque to the compiler; the plan
    is made once per options / vocabulary / dtype / device).
    """
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    key = tuple(sorted(options.items())) + (("terms", terms if isinstance(terms, int) else tuple(terms)),)
    scalars, _ = torch.ops.headloss.fused_loss(
        logits, labels, weights, teacher_logits, advantages, old_logprobs, ref_logprobs,
        _options_json(key), float(divisor), bool(need_grad))
    metrics = dict(zip(SCALARS, scalars.detach().unbind(0)))
    return scalars[0], metrics


class LMHeadLoss(torch.nn.Module):
    """lm_head_loss as a module: the options at construction, the inputs at call time."""

    def __init__(self, terms: Sequence[str] = ("ce",), **options):
        super().__init__()
        self.terms, self.options = tuple(terms), options

    def forward(self, logits: Tensor, labels: Optional[Tensor] = None, **inputs):
        return lm_head_loss(logits, labels, terms=self.terms, **inputs, **self.options)
