"""Per-token losses with a per-token backward, whole or over a vocabulary-sharded head, from logits
or fused with the head's product from hidden states: what engines that apply their own loss mask and
reduction take (Megatron-core's vocab_parallel_cross_entropy and output layer, DTensor's loss_parallel).

    losses = token_loss(logits, labels, terms=("ce", "z"), z_weight=1e-4)   # labels' shape, fp32
    (losses * mask).sum().backward()
    losses = token_loss(shard, labels, group=tp_group)  # rank r holds columns [r n, (r + 1) n)
    losses = linear_token_loss(hidden, weight_shard, labels, group=tp_group)  # no logits

The forward runs a plan without gradient (whole: one pass over the logits, or one product a chunk;
sharded: statistics, one all-gather of per-row records on the group, and a finish that reads the
gathered records alone) and keeps its inputs (and the gathered records); the backward runs the
finish of a plan with gradient, each row weighted by its upstream gradient and divisor 1: the
vector-Jacobian product in one pass that reads the logits and writes their gradient (in fp32 inside,
rounded once), or forms the logits again chunk by chunk for grad_hidden and grad_weight (four
products in all; grad_hidden summed over the group by one all-reduce), with no second exchange of
records. A shard's fused linear form with max_workspace_bytes=None keeps the statistics step's
workspace, which then holds every row's logits of the shard, from the forward to the backward: three
products, the memory of the shard's logits in their dtype. A forward without backward (evaluation, reference log-probs) forms no gradient; backward
may run twice (retain_graph=True). Megatron-core keeps an fp32 softmax from the forward to the
backward, twice the logits' size for bf16 logits; this keeps the logits (or nothing of [rows, V]).
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
from .loss import DEFAULT_MAX_WORKSPACE_BYTES, LinearLossPlan, LossPlan
from .torch_loss import linear_workspace
from .torch_ops import _head_weight
from .torch_tokens import _on

__all__ = ["TokenLossFunction", "token_loss", "linear_token_loss"]


@lru_cache(maxsize=64)
def _plan(vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, labels_dtype: torch.dtype,
          shard: tuple, options: tuple, grads: tuple) -> LossPlan:
    """The logits form's plan (hidden 0) or the fused linear one; grads: the gradients it writes,
    () for the forward's, (logits,) or (hidden, weight) as booleans for a backward's."""
    options = dict(shard, **dict(options))
    if grads:  # the forward's plan checked these labels
        options["check"] = False
    else:
        options.pop("grad_dtype", None), options.pop("grad_weight_dtype", None)
    mode = [("write" if g else None) for g in grads] or [None, None]
    with _on(device):
        if not hidden:
            return LossPlan(vocab, dtype, device=device.type, labels_dtype=labels_dtype, grad=mode[0], **options)
        return LinearLossPlan(vocab, hidden, dtype, device=device.type, labels_dtype=labels_dtype,
                              grad_hidden=mode[0], grad_weight=mode[1], **options)


def _workspace(plan: LossPlan, mats: tuple, max_ws) -> dict:
    """{} for the logits form; the fused linear form's workspace= (max_ws as linear_workspace's)."""
    if not isinstance(plan, LinearLossPlan):
        return {}
    return {"workspace": linear_workspace(plan, mats[0], mats[0].shape[0], max_ws)}


def _every_row(plan: LossPlan, ws: dict, mats: tuple) -> bool:
    """Does the workspace hold every row's logits, which a shard's finish then takes from its
    statistics step instead of forming them?"""
    w = ws.get("workspace")
    return w is not None and w.numel() * 4 >= plan.workspace_sizes(mats[0].shape[0])[1]


class TokenLossFunction(torch.autograd.Function):
    """apply(labels [...], plans, group, max_workspace_bytes, *inputs) -> per-token losses [...]
    (fp32). inputs: (logits [..., n],) or (hidden [..., H], weight [n, H]); plans: the forward's
    (no gradient) and the backward's (the gradients of the inputs) of the same options, a shard's
    with group's size as ranks or whole ones with group None. A shard's statistics come from the
    backward's plan: where its workspace holds every row's logits (max_workspace_bytes None in the
    fused linear form), the backward finds them there and forms them no more (three products in
    all), the workspace kept from the forward to the backward."""

    @staticmethod
    def forward(ctx, labels: Tensor, plans: tuple, group, max_ws, *inputs):
        mats, y = _mats(inputs), labels.reshape(-1).contiguous()
        fwd, bwd = plans
        gathered, ctx.kept = None, None
        with _on(inputs[0].device):
            if group is None:
                out = fwd(*mats, y, divisor=1.0, token_outputs=True, **_workspace(fwd, mats, max_ws))
            else:
                # No backward to come (evaluation, reference log-probs): nothing to keep, so no more
                # than the default workspace.
                grads = any(ctx.needs_input_grad)
                stats = bwd if grads else fwd
                ws = _workspace(stats, mats, DEFAULT_MAX_WORKSPACE_BYTES if max_ws is None and not grads else max_ws)
                block = stats.stats(*mats, y, **ws)
                gathered = block.new_empty(dist.get_world_size(group) * block.numel())
                dist.all_gather_into_tensor(gathered, block, group=group)
                out = fwd.finish(gathered, *mats, y, divisor=1.0, token_outputs=True, **_workspace(fwd, mats, 0))
                if grads and _every_row(bwd, ws, mats):
                    ctx.kept = ws["workspace"]
        ctx.save_for_backward(y, gathered, *inputs)
        ctx.plan, ctx.group, ctx.max_ws = bwd, group, max_ws
        return out.token_loss.view(labels.shape)

    @staticmethod
    def backward(ctx, g: Tensor):
        y, gathered, *inputs = ctx.saved_tensors
        mats, w = _mats(inputs), g.reshape(-1).float().contiguous()
        # The kept logits serve once: the finish writes their gradient over them. A second backward
        # (retain_graph) whose workspace holds every row forms them there again with a statistics step.
        ws = {"workspace": ctx.kept} if ctx.kept is not None else _workspace(ctx.plan, mats, ctx.max_ws)
        with _on(inputs[0].device):
            if gathered is None:
                out = ctx.plan(*mats, y, weights=w, divisor=1.0, **ws)
            else:
                if ctx.kept is None and _every_row(ctx.plan, ws, mats):
                    ctx.plan.stats(*mats, y, **ws)
                out = ctx.plan.finish(gathered, *mats, y, weights=w, divisor=1.0, **ws)
        ctx.kept = None
        if len(inputs) == 1:
            return None, None, None, None, out.grad.view(inputs[0].shape)
        gh, gw = out.grad_hidden, out.grad_weight
        if gh is not None and ctx.group is not None:
            dist.all_reduce(gh, group=ctx.group)  # each shard's part of d loss / d hidden
        return (None, None, None, None, None if gh is None else gh.view(inputs[0].shape),
                None if gw is None else gw.to(inputs[1].dtype))


def _mats(inputs: tuple) -> tuple:
    return (inputs[0].reshape(-1, inputs[0].shape[-1]),) + tuple(inputs[1:])


def _shard(group, n: int, vocab_start: Optional[int], vocab_global: Optional[int]) -> tuple:
    """The plan's shard options on group (by default equal shards of n in rank order), and the group
    itself (None for one rank)."""
    ranks = 1 if group is None else dist.get_world_size(group)
    if ranks == 1:
        return (), None
    rank = dist.get_rank(group)
    return ((("vocab_start", rank * n if vocab_start is None else vocab_start),
             ("vocab_global", ranks * n if vocab_global is None else vocab_global), ("ranks", ranks)), group)


def _key(terms, options: dict) -> tuple:
    if "grad" in options:
        raise HeadlossTypeError("token_loss: the backward writes the gradient (no grad option)")
    return tuple(sorted(dict(options, terms=terms_key(terms)).items()))


def token_loss(logits: Tensor, labels: Tensor, *, group=None, vocab_start: Optional[int] = None,
               vocab_global: Optional[int] = None, terms=("ce",), **options) -> Tensor:
    """Per-token losses [labels' shape] (fp32) of logits [..., n] with a per-token backward (see the
    module docstring). group: a torch.distributed group over which the vocabulary is sharded (None
    or one rank: the whole vocabulary); by default equal shards in rank order (vocab_start = rank
    n, vocab_global = ranks n, Megatron's layout), else pass both. options: LossPlan's (terms'
    weights, label_smoothing, softcap, logit_scale, ignore_index, grad_dtype, check=False to skip
    the label-range check and its synchronisation, ...); no grad option: the backward writes the gradient."""
    key, (shard, group) = _key(terms, options), _shard(group, logits.shape[-1], vocab_start, vocab_global)
    plans = tuple(_plan(logits.shape[-1], 0, logits.dtype, logits.device, labels.dtype, shard, key, grads)
                  for grads in ((), (True,)))
    return TokenLossFunction.apply(labels, plans, group, None, logits)


def linear_token_loss(hidden: Tensor, weight, labels: Tensor, *, group=None, vocab_start: Optional[int] = None,
                      vocab_global: Optional[int] = None, terms=("ce",),
                      max_workspace_bytes: Optional[int] = DEFAULT_MAX_WORKSPACE_BYTES, **options) -> Tensor:
    """token_loss of the logits hidden @ weight.T without forming them: hidden [..., H] (the same on
    every rank of group), weight [n, H] (this rank's rows of the head; an nn.Linear without bias)
    in one dtype, labels [hidden's leading shape]. The backward gives grad_hidden (summed over
    group) and grad_weight (this shard's), those that require grad. options: LinearLossPlan's
    (grad_weight_dtype="float32" sums grad_weight over the chunks in fp32, ...) and token_loss's;
    max_workspace_bytes as headloss.torch_ops.linear_loss; None over a group of two or more ranks
    keeps the shard's logits from the forward to the backward (see the module docstring)."""
    weight = _head_weight(weight)
    key, (shard, group) = _key(terms, options), _shard(group, weight.shape[0], vocab_start, vocab_global)
    grads = (hidden.requires_grad, weight.requires_grad)
    plans = tuple(_plan(weight.shape[0], hidden.shape[-1], hidden.dtype, hidden.device, labels.dtype, shard, key, gr)
                  for gr in ((), grads if any(grads) else (True, True)))
    return TokenLossFunction.apply(labels, plans, group, max_workspace_bytes, hidden, weight)
