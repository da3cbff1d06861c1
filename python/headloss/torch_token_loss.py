"""Per-token losses with a per-token backward, in the logits form, whole or over a vocabulary-sharded
head: what engines that apply their own loss mask and reduction take (Megatron-core's
vocab_parallel_cross_entropy, DTensor's loss_parallel).

    losses = token_loss(logits, labels, terms=("ce", "z"), z_weight=1e-4)   # labels' shape, fp32
    (losses * mask).sum().backward()
    losses = token_loss(shard, labels, group=tp_group)  # rank r holds columns [r n, (r + 1) n)

The forward runs the plan with divisor 1 and no weights, so its token_loss output is each token's
loss and the gradient row t is d loss_t / dz. The gradient is formed there, in one pass over the
logits (sharded: statistics, one all-gather of per-row records on the group, finish), and kept;
backward scales its rows by the upstream per-token gradient in place (in fp32, one rounding) and
hands it over (torch_loss.keep_grads): one gradient the size of the logits lives from the forward
to the backward (Megatron-core keeps an fp32 softmax, twice that for bf16 logits).
Labels are global ids; a negative one (or ignore_index) has loss 0 and gradient 0.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ._lib import HeadlossTypeError
from ._loss_options import terms_key
from .loss import LossPlan
from .torch_loss import keep_grads, take_grads
from .torch_tokens import _on

__all__ = ["TokenLossFunction", "token_loss"]


@lru_cache(maxsize=64)
def _plan(vocab: int, dtype: torch.dtype, device: torch.device, labels_dtype: torch.dtype, shard: tuple,
          options: tuple) -> LossPlan:
    with _on(device):
        return LossPlan(vocab, dtype, device=device.type, labels_dtype=labels_dtype, **dict(shard),
                        **dict(options))


class TokenLossFunction(torch.autograd.Function):
    """apply(logits [..., n], labels [...], plan, group) -> per-token losses [...] (fp32): the
    plan (grad "write", a shard's with group's size as ranks, or a whole one with group None)
    runs with divisor 1; its gradient waits for the upstream per-token gradient."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, plan: LossPlan, group):
        x, y = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).contiguous()
        with _on(logits.device):
            if group is None:
                out = plan(x, y, divisor=1.0, token_outputs=True)
            else:
                block = plan.stats(x, y)
                gathered = block.new_empty(dist.get_world_size(group) * block.numel())
                dist.all_gather_into_tensor(gathered, block, group=group)
                out = plan.finish(gathered, x, y, divisor=1.0, token_outputs=True)
        keep_grads(ctx, out.grad.view(logits.shape))
        ctx.logits_dtype = logits.dtype
        return out.token_loss.view(labels.shape)

    @staticmethod
    def backward(ctx, g: Tensor):
        (grad,) = take_grads(ctx)
        grad.mul_(g.float().unsqueeze(-1))  # fp32 product, rounded once into the gradient's dtype
        return grad.to(ctx.logits_dtype), None, None, None


def token_loss(logits: Tensor, labels: Tensor, *, group=None, vocab_start: Optional[int] = None,
               vocab_global: Optional[int] = None, terms=("ce",), **options) -> Tensor:
    """Per-token losses [labels' shape] (fp32) of logits [..., n] with a per-token backward (see the
    module docstring). group: a torch.distributed group over which the vocabulary is sharded (None
    or one rank: the whole vocabulary); by default equal shards in rank order (vocab_start = rank
    n, vocab_global = ranks n, Megatron's layout), else pass both. options: LossPlan's (terms'
    weights, label_smoothing, softcap, logit_scale, ignore_index, grad_dtype, check=False to skip
    the label-range check and its synchronisation, ...); the plan always forms its gradient."""
    if "grad" in options:
        raise HeadlossTypeError("token_loss: the plan always writes its gradient (no grad option)")
    ranks = 1 if group is None else dist.get_world_size(group)
    n, shard = logits.shape[-1], ()
    if ranks > 1:
        rank = dist.get_rank(group)
        shard = (("vocab_start", rank * n if vocab_start is None else vocab_start),
                 ("vocab_global", ranks * n if vocab_global is None else vocab_global), ("ranks", ranks))
    key = tuple(sorted(dict(options, terms=terms_key(terms)).items()))
    plan = _plan(n, logits.dtype, logits.device, labels.dtype, shard, key)
    return TokenLossFunction.apply(logits, labels, plan, group if ranks > 1 else None)
