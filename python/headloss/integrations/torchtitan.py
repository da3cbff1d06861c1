"""torchtitan / DTensor loss parallelism in one call:

    from headloss.integrations.torchtitan import cross_entropy, cross_entropy_loss
    loss = cross_entropy(logits, labels)    # logits: a DTensor [..., V] placed Shard(-1) on a 1-D mesh
    loss.backward()                         # no loss_parallel() context needed, forward or backward
    torchtitan.components.loss.cross_entropy_loss = cross_entropy_loss   # before the trainer builds its loss

cross_entropy returns what torch.nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten(),
ignore_index=..., reduction=...) returns under torch.distributed.tensor.parallel.loss_parallel() (for
"none": labels' shape): a DTensor replicated on the mesh, in the logits' dtype, whose backward gives
the logits a gradient placed as they are (Shard(-1)); a plain tensor logits is the whole vocabulary
and gets a plain tensor back. It runs the sharded loss plan (torch_token_loss.token_loss) on the
mesh's process group, this rank's columns where DTensor's layout puts them (uneven shards too): one
all-gather of per-row records (loss_parallel: three all-reduces), the logits kept for the backward,
which writes their gradient in one pass (loss_parallel: an fp32 log-softmax kept).

linear_cross_entropy(hidden, weight, labels) is cross_entropy of the logits hidden @ weight.T without
forming them, for an lm_head weight placed Shard(0) on the mesh (its vocabulary rows, as a
ColwiseParallel lm_head holds them) and hidden states that every rank holds (a plain tensor or a
replicated DTensor): the fused linear form on the mesh's group (torch_token_loss.linear_token_loss),
its backward giving the weight a gradient placed as it is and hidden the gradient summed over the
mesh (one all-reduce).

cross_entropy_loss(pred, labels) is torchtitan's function of that name (components/loss.py, read at
commit 00a388d): the sum over tokens in fp32, -100 ignored, pred [T, V] a DTensor placed Shard(1) on the
tensor-parallel mesh or a plain tensor; torchtitan's CrossEntropyLoss takes the module's function
when it is built, so assigning it there beforehand is the switch, and its pred.float() copy of the
logits is not made. A plain pred narrower than global_vocab_size (torchtitan's spmd_types backend:
a local shard without its mesh) is refused.

Where it differs from loss_parallel: a negative label is ignored as well as ignore_index (torch refuses
it) and one >= V is refused by the plan's label check (check=False skips it and its synchronisation);
extra keyword arguments are loss-plan options (terms, z_weight, label_smoothing as the plan's eps,
softcap, logit_scale, ...; loss_parallel supports no label smoothing and no class weights).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .._lib import HeadlossValueError
from ..torch_token_loss import linear_token_loss, token_loss

__all__ = ["cross_entropy", "cross_entropy_loss", "linear_cross_entropy"]


class _LocalShard(torch.autograd.Function):
    """DTensor.to_local whose backward gives the gradient the DTensor's own shape and stride: to_local's
    derives a stride from the local shard, which for uneven shards differs from the logits' and makes
    the leaf's gradient accumulation replicate it (torch 2.11)."""

    @staticmethod
    def forward(ctx, x: DTensor):
        ctx.layout = (x.device_mesh, x.placements, x.shape, x.stride())
        local = x.to_local()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        mesh, placements, shape, stride = ctx.layout
        return DTensor.from_local(g, mesh, placements, run_check=False, shape=shape, stride=stride)


def _local_labels(labels):
    if not isinstance(labels, DTensor):
        return labels
    return labels.to_local() if all(p.is_replicate() for p in labels.placements) else labels.full_tensor()


def _reduce(losses: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / ((labels >= 0) & (labels != ignore_index)).sum()  # 0 / 0 = nan, as torch


def _cross_entropy(logits, labels, ignore_index: int, reduction: str, dtype, options: dict):
    if reduction not in ("mean", "sum", "none"):
        raise HeadlossValueError(f"headloss: reduction must be 'mean', 'sum' or 'none', not {reduction!r}")
    if not isinstance(logits, DTensor):
        losses = token_loss(logits, labels, ignore_index=ignore_index, **options)
        return _reduce(losses, labels, ignore_index, reduction).to(dtype)
    mesh, vocab_dim = logits.device_mesh, logits.ndim - 1
    if mesh.ndim != 1 or tuple(logits.placements) != (Shard(vocab_dim),):
        raise HeadlossValueError(f"headloss: logits must be placed (Shard(-1),) on a 1-D mesh, not "
                                 f"{tuple(logits.placements)} on a {mesh.ndim}-D one")
    _, offset = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)
    y = _local_labels(labels)
    losses = token_loss(_LocalShard.apply(logits), y, group=mesh.get_group(), vocab_start=offset[-1],
                        vocab_global=logits.shape[-1], ignore_index=ignore_index, **options)
    # Every rank holds the same losses: a replicated DTensor, whose gradient reaches each shard.
    out = _reduce(losses, y, ignore_index, reduction).to(dtype)
    return DTensor.from_local(out, mesh, [Replicate()], run_check=False)


def linear_cross_entropy(hidden, weight, labels, *, ignore_index: int = -100, reduction: str = "mean",
                         **plan_options):
    """cross_entropy of hidden @ weight.T (see the module docstring): hidden [..., H] (a plain tensor,
    the same on every rank, or a replicated DTensor), weight [V, H] (a DTensor placed Shard(0) on a
    1-D mesh, or a plain tensor: the whole head), labels [...] -> as cross_entropy, in hidden's
    dtype. plan_options: linear_token_loss's (max_workspace_bytes, ...) and the plan's."""
    if reduction not in ("mean", "sum", "none"):
        raise HeadlossValueError(f"headloss: reduction must be 'mean', 'sum' or 'none', not {reduction!r}")
    y = _local_labels(labels)
    if not isinstance(weight, DTensor):
        losses = linear_token_loss(hidden, weight, y, ignore_index=ignore_index, **plan_options)
        return _reduce(losses, y, ignore_index, reduction).to(hidden.dtype)
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise HeadlossValueError(f"headloss: the weight must be placed (Shard(0),) on a 1-D mesh, not "
                                 f"{tuple(weight.placements)} on a {mesh.ndim}-D one")
    if isinstance(hidden, DTensor):
        if not all(p.is_replicate() for p in hidden.placements):
            raise HeadlossValueError(f"headloss: hidden must be replicated on the mesh, not {tuple(hidden.placements)}")
        hidden = _LocalShard.apply(hidden)
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    losses = linear_token_loss(hidden, _LocalShard.apply(weight), y, group=mesh.get_group(), vocab_start=offset[0],
                               vocab_global=weight.shape[0], ignore_index=ignore_index, **plan_options)
    out = _reduce(losses, y, ignore_index, reduction).to(hidden.dtype)
    return DTensor.from_local(out, mesh, [Replicate()], run_check=False)


def cross_entropy(logits, labels, *, ignore_index: int = -100, reduction: str = "mean", **plan_options):
    """F.cross_entropy under loss_parallel() on the sharded plan (see the module docstring): logits
    [..., V] (a DTensor placed Shard(-1) on a 1-D mesh, or a plain tensor), labels [...] (global ids,
    a tensor or a replicated DTensor) -> a scalar ("mean", "sum") or [...] ("none") in the logits'
    dtype."""
    return _cross_entropy(logits, labels, ignore_index, reduction, logits.dtype, plan_options)


def cross_entropy_loss(pred, labels, *, global_vocab_size: Optional[int] = None) -> torch.Tensor:
    """torchtitan's cross_entropy_loss (see the module docstring): the fp32 sum of pred [T, V]'s
    per-token losses, -100 ignored."""
    if not isinstance(pred, DTensor) and global_vocab_size not in (None, pred.shape[-1]):
        raise HeadlossValueError(f"headloss: a plain pred of {pred.shape[-1]} columns is a shard of "
                                 f"{global_vocab_size} without its mesh; pass the DTensor")
    return _cross_entropy(pred, labels, -100, "sum", torch.float32, {})
