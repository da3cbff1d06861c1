"""PyTorch front end of the fused loss plan: autograd Functions and a module, so a training loop
uses it in one line:

    loss_fn = FusedLMHeadLoss(terms=("ce", "z"), z_weight=1e-4)
    loss, metrics = loss_fn(logits, labels)      # metrics: dict of 0-d tensors, no gradient
    loss.backward()

    plan = LinearLossPlan(V, H, torch.bfloat16, device="cuda", terms=("ce",), grad_weight_dtype="float32")
    loss, scalars = LinearLossFunction.apply(hidden, lm_head.weight, labels, plan, None, None)

The gradient is formed in the forward pass (one pass over the logits; for the fused linear form,
grad_hidden and grad_weight in the same call) and handed back in backward, scaled in place by the
incoming gradient (no host synchronisation to test for 1). Backward keeps no reference to it, so
autograd adopts it as the parameter's .grad: peak memory is the gradients plus the workspace, no
second copy; a second backward through the same graph is refused rather than scaled twice. headloss.torch_ops has the same as custom ops (torch.compile).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from ._loss_options import terms_key
from .loss import DEFAULT_MAX_WORKSPACE_BYTES, SCALARS, LinearLossPlan, LossPlan

_BASE = ("weights", "teacher_logits", "advantages", "old_logprobs", "ref_logprobs")
# 0.4's inputs, after those of earlier versions' order (LinearLossFunction takes them positionally)
_NEW = ("rollout_logprobs", "cu_seqlens", "teacher_topk_ids", "teacher_topk_logprobs",
        "ref_seq_logprobs", "kto_labels")  # the last two: 0.7's preference term, one value a sequence
INPUTS = _BASE + _NEW
LINEAR_INPUTS = _BASE + ("teacher_hidden", "teacher_weight") + _NEW


def seq_options(options: dict, cu_seqlens) -> dict:
    """The plan options with cu_seqlens_dtype taken from the cu_seqlens passed, unless set."""
    if cu_seqlens is None or "cu_seqlens_dtype" in options:
        return options
    return dict(options, cu_seqlens_dtype=str(cu_seqlens.dtype).replace("torch.", ""))


def keep_grads(ctx, *grads) -> None:
    """Keeps the gradients formed in the forward pass for backward as plain references (detached:
    no cycle through an output's grad_fn), not as saved tensors: backward hands them over and keeps
    nothing, so autograd adopts each as the parameter's .grad instead of copying it (a saved tensor
    stays referenced by the graph until the backward pass ends, which makes autograd clone)."""
    ctx.headloss_grads = tuple(None if g is None else g.detach() for g in grads)


def take_grads(ctx) -> tuple:
    """The gradients keep_grads kept, handed over once."""
    grads = getattr(ctx, "headloss_grads", None)
    if grads is None:
        raise RuntimeError("headloss: backward ran twice through the same loss (retain_graph=True): "
                           "its gradients were formed in the forward pass and handed over already")
    ctx.headloss_grads = None
    return grads


def scale_grad(g: torch.Tensor, dloss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A gradient formed in the forward pass, times the loss's incoming gradient (in place), in the
    dtype of the input it belongs to (a gradient computed in fp32 on request is cast here)."""
    g.mul_(dloss.to(g.dtype))
    return g if g.dtype == dtype else g.to(dtype)


def linear_workspace(plan: LinearLossPlan, like: torch.Tensor, rows: int,
                     max_workspace_bytes: Optional[int] = None) -> Optional[torch.Tensor]:
    """The workspace of a call on `rows` rows: the plan's fast size (the whole chunking it runs
    fastest with), capped at max_workspace_bytes (None: no cap), never below its minimum. None
    where the plan needs none (the CPU backend)."""
    lo, hi = plan.workspace_sizes(rows)
    nbytes = hi if max_workspace_bytes is None else max(lo, min(hi, int(max_workspace_bytes)))
    return plan.workspace(like, rows, nbytes) if nbytes else None


def run_linear(plan: LinearLossPlan, hidden, weight, labels, divisor: Optional[float],
               max_workspace_bytes: Optional[int], inputs: dict):
    """One call of a fused linear plan on [rows, H] hidden states: (scalars, grad_hidden or None,
    grad_weight or None), as the plan's gradient modes say."""
    ws = linear_workspace(plan, hidden, hidden.shape[0], max_workspace_bytes)
    out = plan(hidden, weight, labels, divisor=divisor, workspace=ws, **inputs)
    return out.scalars, out.grad_hidden, out.grad_weight


class FusedLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, plan: LossPlan, in_place: bool, divisor: Optional[float], *inputs):
        kw = {k: v for k, v in zip(INPUTS, inputs) if v is not None}
        out = plan(logits, labels, divisor=divisor, in_place=in_place, **kw)
        keep_grads(ctx, out.grad)
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(out.scalars)
        return out.scalars[0].clone(), out.scalars

    @staticmethod
    def backward(ctx, dloss, _dscalars):
        (g,) = take_grads(ctx)
        g = None if g is None else scale_grad(g, dloss, ctx.logits_dtype)
        return (g, None, None, None, None) + (None,) * len(INPUTS)


class LinearLossFunction(torch.autograd.Function):
    """The fused linear form with a plan of your own: apply(hidden [rows, H], weight [V, H], labels,
    plan, divisor, max_workspace_bytes, *inputs in LINEAR_INPUTS order) -> (loss, scalars).
    The plan (a LinearLossPlan of the whole vocabulary) fixes which gradients are formed and in
    which dtype; hidden and weight get those (None for one the plan does not form). For the
    sharded vocabulary use LinearLossPlan.stats / finish / nccl (grad_hidden is then a rank's
    part, to all-reduce)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, plan: LinearLossPlan, divisor: Optional[float],
                max_workspace_bytes: Optional[int], *inputs):
        kw = {k: v for k, v in zip(LINEAR_INPUTS, inputs) if v is not None}
        scalars, gh, gw = run_linear(plan, hidden, weight, labels, divisor, max_workspace_bytes, kw)
        keep_grads(ctx, gh, gw)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(scalars)
        return scalars[0].clone(), scalars

    @staticmethod
    def backward(ctx, dloss, _dscalars):
        grads = tuple(None if g is None else scale_grad(g, dloss, dt)
                      for g, dt in zip(take_grads(ctx), ctx.dtypes))
        return grads + (None,) * (4 + len(LINEAR_INPUTS))


class FusedLMHeadLoss(torch.nn.Module):
    """The plan's options as keyword arguments (see LossPlan); plans are made per vocabulary size,
    dtype and device on first use (a sparse teacher's topk_ids_dtype: int64 unless given).
    forward returns (loss, metrics dict)."""

    def __init__(self, terms=("ce",), in_place: bool = False, **options):
        super().__init__()
        self.terms, self.in_place, self.options = terms_key(terms), in_place, options
        self._plans = {}

    def _plan(self, logits, labels, cu_seqlens) -> LossPlan:
        key = (logits.shape[-1], logits.dtype, logits.device,
               None if labels is None else labels.dtype, None if cu_seqlens is None else cu_seqlens.dtype)
        if key not in self._plans:
            self._plans[key] = LossPlan(
                logits.shape[-1], logits.dtype, terms=self.terms,
                device="cuda" if logits.is_cuda else "cpu",
                labels_dtype=None if labels is None else labels.dtype,
                **seq_options(self.options, cu_seqlens))
        return self._plans[key]

    def forward(self, logits, labels=None, *, weights=None, teacher_logits=None, advantages=None,
                old_logprobs=None, ref_logprobs=None, rollout_logprobs=None, cu_seqlens=None,
                teacher_topk_ids=None, teacher_topk_logprobs=None, ref_seq_logprobs=None, kto_labels=None,
                divisor: Optional[float] = None):
        plan = self._plan(logits, labels, cu_seqlens)
        loss, scalars = FusedLossFunction.apply(logits, labels, plan, self.in_place, divisor, weights,
                                                teacher_logits, advantages, old_logprobs, ref_logprobs,
                                                rollout_logprobs, cu_seqlens, teacher_topk_ids,
                                                teacher_topk_logprobs, ref_seq_logprobs, kto_labels)
        return loss, dict(zip(SCALARS, scalars.unbind(0)))


def fused_lm_head_loss(logits, labels=None, *, terms=("ce",), in_place: bool = False, **kwargs):
    """Functional form; options and inputs as FusedLMHeadLoss. Returns (loss, metrics dict)."""
    inputs = {k: kwargs.pop(k) for k in list(kwargs) if k in INPUTS or k == "divisor"}
    return _module(terms_key(terms), in_place, tuple(sorted(kwargs.items())))(logits, labels, **inputs)


@lru_cache(maxsize=32)
def _module(terms, in_place, options) -> FusedLMHeadLoss:
    return FusedLMHeadLoss(terms, in_place, **dict(options))


__all__ = ["FusedLossFunction", "FusedLMHeadLoss", "fused_lm_head_loss", "LinearLossFunction"]
