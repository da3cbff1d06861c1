"""PyTorch front end of the fused loss plan: an autograd Function and a module, so a training loop
uses it in one line:

    loss_fn = FusedLMHeadLoss(terms=("ce", "z"), z_weight=1e-4)
    loss, metrics = loss_fn(logits, labels)      # metrics: dict of 0-d tensors, no gradient
    loss.backward()

The gradient is formed in the forward pass (one pass over the logits) and handed back in
backward, scaled by the incoming gradient when that is not 1.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from .loss import SCALARS, LossPlan

_INPUTS = ("weights", "teacher_logits", "advantages", "old_logprobs", "ref_logprobs")


class FusedLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, plan: LossPlan, in_place: bool, divisor: float, *inputs):
        kw = {k: v for k, v in zip(_INPUTS, inputs) if v is not None}
        out = plan(logits, labels, divisor=divisor, in_place=in_place, **kw)
        ctx.save_for_backward(out.grad)
        ctx.mark_non_differentiable(out.scalars)
        return out.scalars[0].clone(), out.scalars

    @staticmethod
    def backward(ctx, dloss, _dscalars):
        (g,) = ctx.saved_tensors
        if dloss is not None and not torch.equal(dloss, torch.ones_like(dloss)):
            g = g * dloss.to(g.dtype)
        return (g, None, None, None, None) + (None,) * len(_INPUTS)


class FusedLMHeadLoss(torch.nn.Module):
    """The plan's options as keyword arguments (see LossPlan); plans are made per vocabulary size,
    dtype and device on first use. forward returns (loss, metrics dict)."""

    def __init__(self, terms=("ce",), in_place: bool = False, **options):
        super().__init__()
        self.terms, self.in_place, self.options = tuple(terms), in_place, options
        self._plans = {}

    def _plan(self, logits, labels) -> LossPlan:
        key = (logits.shape[-1], logits.dtype, logits.device,
               None if labels is None else labels.dtype)
        if key not in self._plans:
            self._plans[key] = LossPlan(
                logits.shape[-1], logits.dtype, terms=self.terms,
                device="cuda" if logits.is_cuda else "cpu",
                labels_dtype=None if labels is None else labels.dtype, **self.options)
        return self._plans[key]

    def forward(self, logits, labels=None, *, weights=None, teacher_logits=None, advantages=None,
                old_logprobs=None, ref_logprobs=None, divisor: float = 0.0):
        plan = self._plan(logits, labels)
        loss, scalars = FusedLossFunction.apply(logits, labels, plan, self.in_place, divisor, weights,
                                                teacher_logits, advantages, old_logprobs, ref_logprobs)
        return loss, dict(zip(SCALARS, scalars.unbind(0)))


def fused_lm_head_loss(logits, labels=None, *, terms=("ce",), in_place: bool = False, **kwargs):
    """Functional form; options and inputs as FusedLMHeadLoss. Returns (loss, metrics dict)."""
    inputs = {k: kwargs.pop(k) for k in list(kwargs) if k in _INPUTS or k == "divisor"}
    return _module(tuple(terms), in_place, tuple(sorted(kwargs.items())))(logits, labels, **inputs)


@lru_cache(maxsize=32)
def _module(terms, in_place, options) -> FusedLMHeadLoss:
    return FusedLMHeadLoss(terms, in_place, **dict(options))


__all__ = ["FusedLossFunction", "FusedLMHeadLoss", "fused_lm_head_loss"]
