"""Per-token log-probabilities, entropies and log-sum-exps with a backward, as PyTorch custom ops:
what RL and preference trainers compute their own loss from (verl's linear_cross_entropy,
Transformer Engine's linear_cross_entropy_with_token_entropy), without the [rows, vocab] logits.

    logp, entropy, lse = linear_token_logprobs(hidden, lm_head.weight, labels, temperature=T)
    loss = my_loss(logp, entropy)
    loss.backward()               # grad_hidden and grad_weight from the outputs' gradients

The forward runs the loss plan with no term (headloss.h, "Per-token gradients"): in the fused linear
form one product a chunk, nothing of [rows, vocab] kept and no gradient buffer made (the inputs are
saved, not the logits: the "old / reference log-probs" case under no_grad costs the same).
Backward runs the plan again with the outputs' incoming gradients, which forms the logits again
chunk by chunk (four products in all). Registered ops: headloss::token_logprobs and
headloss::token_logprobs_bwd (logits form), headloss::linear_token_logprobs and
headloss::linear_token_logprobs_bwd; torch.compile(fullgraph=True) keeps each as one call.
"""
from __future__ import annotations

import contextlib
import json
from functools import lru_cache
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ._loss_options import temperature_scale
from .loss import DEFAULT_MAX_WORKSPACE_BYTES, LinearLossPlan, LossPlan
from .torch_loss import linear_workspace
from .torch_ops import _dense, _dtype_name, _head_weight, _matrix, _options_json, _per_row

__all__ = ["TokenLogprobs", "token_logprobs", "linear_token_logprobs"]

# The per-token outputs, in the ops' order, as the plan's token_grads name them.
_OUTPUTS = ("logp", "entropy", "lse")


class TokenLogprobs(NamedTuple):
    logp: Tensor     # log p of the label (0 where the row is ignored or there are no labels)
    entropy: Tensor  # of the row's softmax
    lse: Tensor      # log-sum-exp of the row's logits (after temperature and soft cap)


@lru_cache(maxsize=64)
def _plan(options: str, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, labels_dtype,
          grads: Tuple[str, ...], grad_a: bool, grad_b: bool) -> LossPlan:
    """The plan of a forward (grads = (): no gradient) or of a backward taking the upstream
    gradients `grads` names; grad_a / grad_b: the logits' (or hidden's) and weight's gradients."""
    opts = json.loads(options)
    gw_dtype = opts.pop("grad_weight_dtype", None)
    common = dict(terms=(), device=device.type, labels_dtype=labels_dtype, token_grads=grads, **opts)
    if not hidden:
        return LossPlan(vocab, dtype, grad="write" if grad_a else None, **common)
    return LinearLossPlan(vocab, hidden, dtype, grad_hidden="write" if grad_a else None,
                          grad_weight="write" if grad_b else None,
                          grad_weight_dtype=gw_dtype if grad_b else None, **common)


def _on(dev: torch.device):
    """A CUDA plan belongs to the device current at its creation, and runs there only."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def _outputs(like: Tensor) -> list:
    """The plan's tokens= outputs: no token_loss, then logp, entropy, lse."""
    rows = like.shape[0]
    return [None] + [like.new_empty(rows, dtype=torch.float32) for _ in _OUTPUTS]


def _upstream(labels: Optional[Tensor], grads) -> dict:
    """The backward's grad_token_* arguments: the gradients given (logp's only with labels: without,
    logp is a constant 0), packed."""
    names = ("logp",) * (labels is not None) + _OUTPUTS[1:]
    return {f"grad_token_{n}": _dense(g.float()) for n, g in zip(_OUTPUTS, grads)
            if g is not None and n in names}


def _token_logprobs_impl(logits: Tensor, labels: Optional[Tensor], options: str) -> Tuple[Tensor, Tensor, Tensor]:
    with _on(logits.device):
        plan = _plan(options, logits.shape[-1], 0, logits.dtype, logits.device, _dtype_name(labels), (),
                     False, False)
        toks = _outputs(logits)
        plan(logits, labels, tokens=toks)
    return tuple(toks[1:])


def _token_logprobs_bwd_impl(logits: Tensor, labels: Optional[Tensor], g_logp: Optional[Tensor],
                             g_entropy: Optional[Tensor], g_lse: Optional[Tensor], options: str) -> Tensor:
    up = _upstream(labels, (g_logp, g_entropy, g_lse))
    if not up:
        return torch.zeros_like(logits)
    names = tuple(k[len("grad_token_"):] for k in up)
    with _on(logits.device):
        plan = _plan(options, logits.shape[-1], 0, logits.dtype, logits.device, _dtype_name(labels), names,
                     True, False)
        return plan(logits, labels, **up).grad


_fwd = torch.library.custom_op("headloss::token_logprobs", mutates_args=())(_token_logprobs_impl)
_bwd = torch.library.custom_op("headloss::token_logprobs_bwd", mutates_args=())(_token_logprobs_bwd_impl)


@_fwd.register_fake
def _(logits, labels, options):
    return tuple(logits.new_empty(logits.shape[0], dtype=torch.float32) for _ in _OUTPUTS)


@_bwd.register_fake
def _(logits, labels, g_logp, g_entropy, g_lse, options):
    return torch.empty_like(logits)


def _fwd_setup(ctx, inputs, output):
    logits, labels, ctx.options = inputs
    ctx.save_for_backward(logits, labels)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no flag, no work


def _fwd_backward(ctx, g_logp, g_entropy, g_lse):
    logits, labels = ctx.saved_tensors
    return torch.ops.headloss.token_logprobs_bwd(logits, labels, g_logp, g_entropy, g_lse, ctx.options), None, None


_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def _linear_impl(hidden: Tensor, weight: Tensor, labels: Optional[Tensor], options: str,
                 max_workspace_bytes: Optional[int]) -> Tuple[Tensor, Tensor, Tensor]:
    with _on(hidden.device):
        plan = _plan(options, weight.shape[0], hidden.shape[-1], hidden.dtype, hidden.device, _dtype_name(labels),
                     (), False, False)
        toks = _outputs(hidden)
        ws = linear_workspace(plan, hidden, hidden.shape[0], max_workspace_bytes)
        plan(hidden, weight, labels, workspace=ws, tokens=toks)
    return tuple(toks[1:])


def _linear_bwd_impl(hidden: Tensor, weight: Tensor, labels: Optional[Tensor], g_logp: Optional[Tensor],
                     g_entropy: Optional[Tensor], g_lse: Optional[Tensor], options: str, need_grad_hidden: bool,
                     need_grad_weight: bool, max_workspace_bytes: Optional[int]) -> Tuple[Tensor, Tensor]:
    """(grad_hidden, grad_weight) in their inputs' dtypes; an empty tensor for one not asked for."""
    up = _upstream(labels, (g_logp, g_entropy, g_lse))
    if not up or not (need_grad_hidden or need_grad_weight):
        return (torch.zeros_like(hidden) if need_grad_hidden else hidden.new_empty(0),
                torch.zeros_like(weight) if need_grad_weight else hidden.new_empty(0))
    names = tuple(k[len("grad_token_"):] for k in up)
    with _on(hidden.device):
        plan = _plan(options, weight.shape[0], hidden.shape[-1], hidden.dtype, hidden.device, _dtype_name(labels),
                     names, need_grad_hidden, need_grad_weight)
        ws = linear_workspace(plan, hidden, hidden.shape[0], max_workspace_bytes)
        out = plan(hidden, weight, labels, workspace=ws, **up)
    gh = out.grad_hidden if need_grad_hidden else hidden.new_empty(0)
    gw = out.grad_weight.to(weight.dtype) if need_grad_weight else hidden.new_empty(0)
    return gh, gw


_lfwd = torch.library.custom_op("headloss::linear_token_logprobs", mutates_args=())(_linear_impl)
_lbwd = torch.library.custom_op("headloss::linear_token_logprobs_bwd", mutates_args=())(_linear_bwd_impl)


@_lfwd.register_fake
def _(hidden, weight, labels, options, max_workspace_bytes):
    return tuple(hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in _OUTPUTS)


@_lbwd.register_fake
def _(hidden, weight, labels, g_logp, g_entropy, g_lse, options, need_grad_hidden, need_grad_weight,
      max_workspace_bytes):
    return (torch.empty_like(hidden) if need_grad_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_grad_weight else hidden.new_empty(0))


def _linear_setup(ctx, inputs, output):
    hidden, weight, labels, ctx.options, ctx.max_workspace_bytes = inputs
    ctx.save_for_backward(hidden, weight, labels)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None (e.g. the entropy's:
    # the shifted path stays eligible)


def _linear_backward(ctx, g_logp, g_entropy, g_lse):
    hidden, weight, labels = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    gh, gw = torch.ops.headloss.linear_token_logprobs_bwd(hidden, weight, labels, g_logp, g_entropy, g_lse,
                                                          ctx.options, need_h, need_w, ctx.max_workspace_bytes)
    return gh if need_h else None, gw if need_w else None, None, None, None


_lfwd.register_autograd(_linear_backward, setup_context=_linear_setup)


def _options(temperature: float, softcap, ignore_index, check: bool, **more) -> str:
    opts = dict(logit_scale=temperature_scale(temperature), softcap=softcap,
                ignore_index=ignore_index, check=check, **more)
    return _options_json(tuple(sorted((k, v) for k, v in opts.items() if v is not None)))


def _shaped(outs, shape) -> TokenLogprobs:
    return TokenLogprobs(*(t.reshape(shape) for t in outs))


def token_logprobs(logits: Tensor, labels: Optional[Tensor] = None, *, temperature: float = 1.0,
                   softcap: Optional[float] = None, ignore_index: Optional[int] = None,
                   check: bool = True) -> TokenLogprobs:
    """(logp, entropy, lse) of logits [..., V] / temperature (optionally soft-capped), each [...]
    fp32, with a backward w.r.t. the logits. labels [...]: the ids whose log-prob logp is (< 0 or
    ignore_index: ignored, logp 0; None: logp is 0). check=False skips the label range check that
    synchronises with the GPU."""
    shape = logits.shape[:-1]
    outs = torch.ops.headloss.token_logprobs(_matrix(logits), _per_row(labels),
                                             _options(temperature, softcap, ignore_index, check))
    return _shaped(outs, shape)


def linear_token_logprobs(hidden: Tensor, weight, labels: Optional[Tensor] = None, *, temperature: float = 1.0,
                          softcap: Optional[float] = None, ignore_index: Optional[int] = None, check: bool = True,
                          grad_weight_dtype: Optional[str] = None,
                          max_workspace_bytes: Optional[int] = DEFAULT_MAX_WORKSPACE_BYTES) -> TokenLogprobs:
    """token_logprobs of the logits hidden @ weight.T without forming them: hidden [..., H], weight
    [V, H] (lm_head.weight or the nn.Linear, without a bias) in one dtype. Backward gives
    grad_hidden and grad_weight (those that require grad). grad_weight_dtype "float32" sums
    grad_weight over the chunks in fp32; max_workspace_bytes as headloss.torch_ops.linear_loss."""
    shape = hidden.shape[:-1]
    options = _options(temperature, softcap, ignore_index, check, grad_weight_dtype=grad_weight_dtype)
    outs = torch.ops.headloss.linear_token_logprobs(
        _matrix(hidden), _matrix(_head_weight(weight)), _per_row(labels), options,
        None if max_workspace_bytes is None else int(max_workspace_bytes))
    return _shaped(outs, shape)
