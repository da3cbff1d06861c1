"""Liger-Kernel's fused linear cross-entropy in one line:

    from headloss.integrations.liger import LigerFusedLinearCrossEntropyLoss   # was liger_kernel.transformers
    from headloss.integrations.liger import liger_fused_linear_cross_entropy   # was ...transformers.functional
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)(lm_head.weight, hidden, labels, lm_head.bias)

or, for code that imports Liger itself, `apply_liger()` puts both in Liger's modules (where Liger
installs) and `remove_liger()` takes them out. The signatures and defaults are Liger 0.8.5's
(liger_kernel.ops.fused_linear_cross_entropy), each option mapped onto the fused linear loss plan:

- bias [V] (the head's): the plan's bias, with its gradient;
- ce_weight [V] (class weights, as torch's cross_entropy(weight=)): per-token weights
  ce_weight[target], the mean divided by the sum of the counted targets' weights;
- lse_square_scale: the z-loss term and its weight; return_z_loss: that term alone;
- label_smoothing, softcap, ignore_index: the plan's (every negative target is ignored too);
- reduction "mean" / "sum" (divisor 1) / "none" (per-token losses; backward re-runs the plan with
  the upstream gradient as the tokens' weights, as Liger does);
- use_token_scaling: each token's loss times its detached predicted probability (the plan's
  token_scaling);
- return_token_accuracy (a scalar, or per token with "none"), return_predicted_tokens (the argmax,
  -1 where ignored);
- accum_dtype=torch.float32: grad_weight (and grad_bias) summed over the chunks in fp32.

Refused with HeadlossValueError: ce_weight with label smoothing or a z-loss (Liger weights their
parts differently from the tokens' weights the plan takes), label_smoothing = 1, another
accum_dtype. chunk_mem_const is accepted and unused: the workspace is headloss's (256 MiB by
default, headloss.torch_loss.DEFAULT_MAX_WORKSPACE_BYTES). The functions run eagerly (an
autograd.Function), not as a torch custom op.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
from torch import Tensor

from .._lib import HeadlossValueError
from ..loss import DEFAULT_MAX_WORKSPACE_BYTES, SCALARS, LinearLossPlan
from ..torch_loss import keep_grads, linear_workspace, scale_grad, take_grads

__all__ = ["LigerFusedLinearCrossEntropyLoss", "liger_fused_linear_cross_entropy", "CrossEntropyOutput",
           "apply_liger", "remove_liger"]

_Z = SCALARS.index("z")


@dataclass
class CrossEntropyOutput:
    """Liger's return type where a return_* flag is set."""
    loss: Optional[Tensor] = None
    z_loss: Optional[Tensor] = None
    token_accuracy: Optional[Tensor] = None
    predicted_tokens: Optional[Tensor] = None


@lru_cache(maxsize=32)
def _plan(vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, labels_dtype: str, ignore_index: int,
          z: float, smoothing: float, softcap: Optional[float], scaling: bool, grads: tuple) -> LinearLossPlan:
    """The plan of one option set on one device (a CUDA plan runs on the device current at its
    creation); grads: (grad_hidden, grad_weight, grad_bias, fp32 sums)."""
    gh, gw, gb, f32 = grads
    acc = "float32" if f32 else None
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return LinearLossPlan(vocab, hidden, str(dtype).replace("torch.", ""), device=device.type,
                              labels_dtype=labels_dtype, ignore_index=ignore_index,
                              terms=("ce", "z") if z else ("ce",), z_weight=z or None,
                              label_smoothing=smoothing or None, softcap=softcap, token_scaling=scaling,
                              grad_hidden="write" if gh else None, grad_weight="write" if gw else None,
                              grad_weight_dtype=acc if gw else None, grad_bias="write" if gb else None,
                              grad_bias_dtype=acc if gb else None)


class _Call:
    """One call's plan options and per-token weights, shared by forward and the deferred backward."""

    def __init__(self, x, w, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
                 reduction, softcap, accum_dtype, use_token_scaling):
        if reduction not in ("mean", "sum", "none"):
            raise HeadlossValueError(f"reduction is {reduction!r}; expected 'mean', 'sum' or 'none'")
        if accum_dtype not in (None, torch.float32):
            raise HeadlossValueError(f"accum_dtype is {accum_dtype}; headloss sums grad_weight in fp32 "
                                     "(torch.float32) or in the weight's dtype (None)")
        if ce_weight is not None and (label_smoothing or lse_square_scale):
            raise HeadlossValueError("ce_weight with label_smoothing or lse_square_scale: Liger weights the "
                                     "smoothing by every class's weight and leaves the z-loss unweighted, "
                                     "which per-token weights cannot express; drop one of them")
        self.x, self.w, self.target, self.bias = x, w, target, bias
        self.valid = (target != ignore_index) & (target >= 0)
        self.key = dict(ignore_index=int(ignore_index), z=float(lse_square_scale),
                        smoothing=float(label_smoothing), softcap=None if softcap is None else float(softcap),
                        scaling=bool(use_token_scaling))
        self.reduction, self.f32 = reduction, accum_dtype is not None
        self.grad_enabled = torch.is_grad_enabled()  # autograd.Function.forward runs without it
        # ce_weight[target], 0 where ignored: torch's weighted mean divides by their sum.
        self.weights = None
        if ce_weight is not None:
            safe = torch.where(self.valid, target, torch.zeros_like(target))
            self.weights = torch.where(self.valid, ce_weight.float()[safe], 0.0).contiguous()
        self.count = self.valid.sum()

    def run(self, grads: tuple, weights=None, divisor=None, **outputs):
        plan = _plan(self.w.shape[0], self.x.shape[1], self.x.dtype, self.x.device, str(self.target.dtype)[6:],
                     grads=grads + (self.f32,), **self.key)
        ws = linear_workspace(plan, self.x, self.x.shape[0], DEFAULT_MAX_WORKSPACE_BYTES)
        return plan(self.x, self.w, self.target, bias=self.bias, weights=weights, divisor=divisor,
                    workspace=ws, **outputs)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, call: _Call):
        need = (x.requires_grad, w.requires_grad, bias is not None and bias.requires_grad)
        none = call.reduction == "none"
        grads = (False, False, False) if none or not call.grad_enabled else need
        divisor = 1.0 if call.reduction == "sum" else None
        out = call.run(grads, weights=call.weights, divisor=divisor, token_outputs=True, argmax=True)
        ctx.call, ctx.need, ctx.dtypes = call, need, (x.dtype, w.dtype, None if bias is None else bias.dtype)
        if none:
            loss = out.token_loss if call.weights is None else out.token_loss * call.weights
        else:
            loss = out.scalars[0].clone()  # D: the count, the targets' weights, or 1 for "sum"
            keep_grads(ctx, out.grad_hidden, out.grad_weight, out.grad_bias)
        ctx.mark_non_differentiable(out.scalars, out.token_argmax, out.token_lse, out.token_logp)
        return loss, out.scalars, out.token_argmax, out.token_lse, out.token_logp

    @staticmethod
    def backward(ctx, dloss, *_unused):
        call = ctx.call
        if call.reduction != "none":
            grads = tuple(None if g is None else scale_grad(g, dloss, dt)
                          for g, dt in zip(take_grads(ctx), ctx.dtypes))
            return grads + (None,)
        # Per-token upstream gradients: the plan's gradient with them as the tokens' weights, D = 1.
        g = dloss.float() if call.weights is None else dloss.float() * call.weights
        out = call.run(ctx.need, weights=g.contiguous(), divisor=1.0)
        return tuple(None if t is None else t.to(dt) for t, dt in
                     zip((out.grad_hidden, out.grad_weight, out.grad_bias), ctx.dtypes)) + (None,)


def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index: int = -100,
                                     lse_square_scale: float = 0.0, label_smoothing: float = 0.0,
                                     reduction: str = "mean", softcap: Optional[float] = None,
                                     return_z_loss: bool = False, accum_dtype=None, use_token_scaling: bool = False,
                                     return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
                                     chunk_mem_const: int = 1):
    """liger_kernel.transformers.functional.liger_fused_linear_cross_entropy on headloss (see the
    module docstring): input [BT, H], weight [V, H], target [BT], bias [V]."""
    x = input if input.stride(-1) == 1 else input.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    b = None if bias is None else bias.to(w.dtype)
    call = _Call(x, w, target.contiguous(), b, ce_weight, ignore_index, lse_square_scale, label_smoothing,
                 reduction, softcap, accum_dtype, use_token_scaling)
    loss, scalars, top, lse, logp = _FusedLinearCE.apply(x, w, b, call)
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return loss
    none, valid = reduction == "none", call.valid
    out = CrossEntropyOutput(loss=loss)
    if return_z_loss:  # the z term alone (times p_y with token scaling), in the input's dtype as Liger's
        if none:
            z = lse_square_scale * lse * lse * (logp.exp() if use_token_scaling else 1.0)
            out.z_loss = torch.where(valid, z, 0.0).to(x.dtype)
        else:
            out.z_loss = (lse_square_scale * scalars[_Z]).to(x.dtype)
    hit = (top == target) & valid
    if return_token_accuracy:
        out.token_accuracy = hit.float() if none else hit.sum().float() / call.count
    if return_predicted_tokens:
        out.predicted_tokens = torch.where(valid, top, -1)
    return out


class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):
    """liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss on headloss:
    forward(lin_weight, _input, target, bias=None)."""

    def __init__(self, ce_weight: Optional[torch.FloatTensor] = None, ignore_index: int = -100,
                 lse_square_scale: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean",
                 softcap: Optional[float] = None, return_z_loss: bool = False, accum_dtype=None,
                 use_token_scaling: bool = False, return_token_accuracy: bool = False,
                 return_predicted_tokens: bool = False):
        super().__init__()
        self.ce_weight, self.ignore_index, self.lse_square_scale = ce_weight, ignore_index, lse_square_scale
        self.label_smoothing, self.reduction, self.softcap = label_smoothing, reduction, softcap
        self.return_z_loss, self.accum_dtype, self.use_token_scaling = return_z_loss, accum_dtype, use_token_scaling
        self.return_token_accuracy, self.return_predicted_tokens = return_token_accuracy, return_predicted_tokens

    def forward(self, lin_weight, _input, target, bias=None):
        return liger_fused_linear_cross_entropy(
            _input, lin_weight, target, bias, self.ce_weight, self.ignore_index, self.lse_square_scale,
            self.label_smoothing, self.reduction, self.softcap, self.return_z_loss, self.accum_dtype,
            self.use_token_scaling, self.return_token_accuracy, self.return_predicted_tokens)


_PATCHES = (("liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss", LigerFusedLinearCrossEntropyLoss),
            ("liger_kernel.transformers.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyLoss",
             LigerFusedLinearCrossEntropyLoss),
            ("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy",
             liger_fused_linear_cross_entropy))
_saved: dict = {}


def apply_liger() -> None:
    """Puts headloss's module and function in Liger's modules (code that imports them from Liger
    afterwards gets headloss's); ImportError where Liger is not installed."""
    import importlib
    for mod, name, ours in _PATCHES:
        m = importlib.import_module(mod)
        _saved.setdefault((mod, name), getattr(m, name))
        setattr(m, name, ours)


def remove_liger() -> None:
    """Liger's own module and function again."""
    import importlib
    for (mod, name), theirs in list(_saved.items()):
        setattr(importlib.import_module(mod), name, theirs)
        del _saved[(mod, name)]
