"""Megatron-core in one call:

    from headloss.integrations.megatron import apply_headloss, remove_headloss
    apply_headloss(model)                  # a module (GPTModel, wrapped in DDP etc. or not) or a list
    apply_headloss(model, terms=("ce", "z"), z_weight=1e-4)   # the plan's other terms, as options
    ...                                    # train as before
    remove_headloss(model)                 # Megatron's loss again

Every LanguageModule in the model (GPTModel, HybridModel, BERT, T5; the MTP heads take the method
at call time) then computes compute_language_model_loss with headloss's sharded loss plan on its
tensor-parallel group, whichever path its config picks (cross_entropy_loss_fusion with the "native"
or "te" implementation, or vocab_parallel_cross_entropy), on Megatron's contract: logits
[s, b, V / tp] (rank r holds columns [r V / tp, (r + 1) V / tp)), labels [b, s], per-token losses
[b, s] (fp32) out, their gradient from the upstream per-token gradient; Megatron applies the loss
mask afterwards. A step takes one all-gather of per-row records (Megatron: three all-reduces, one
fused) and keeps the logits from the forward to the backward, which forms the gradient in one pass
weighted by the upstream gradient (Megatron keeps an fp32 softmax). vocab_parallel_cross_entropy here is the same for callers of Megatron's function.

Where it differs from Megatron's own loss (none of it shows through a loss mask):
- labels are in [0, V) in Megatron; a negative one (-100, ...) gets loss 0 and gradient 0 here, as in
  Transformer Engine's parallel_cross_entropy (Megatron's own paths give it the log-sum-exp less the
  row's max and a softmax gradient, which its mask then drops); one >= V is refused by the plan's
  label check (a synchronisation; check=False skips it, and that row's loss is then infinite);
- the gradient is in the logits' dtype (Megatron's fused path rounds it to bf16 whatever the logits);
- label_smoothing alpha (vocab_parallel_cross_entropy's): Megatron spreads alpha K / (K - 1) over
  the K columns of each rank's shard, each rank with its own mean; here it is spread over the whole
  vocabulary, the plan's eps = alpha V / (V - 1): Megatron's loss at tp = 1.

The output layer fused too: apply_headloss(model, fused_output_layer=True) makes every GPTModel's
training forward (labels given, no output_processor of the caller's, no MuP logit scaling) compute
the per-token losses from the decoder's hidden states and the output layer's weight shard (or the
shared embedding's) with the fused linear form (torch_token_loss.linear_token_loss): the [s, b,
V / tp] logits are formed once, into a workspace kept from the forward to the backward, and
Megatron's fp32 copies of them never exist. The forward is the shard's product (statistics) and one
all-gather; the backward writes the logits' gradient over them for grad_hidden and grad_weight (three
products in all) and sums grad_hidden over the tensor-parallel group with one all-reduce (under
sequence parallelism the hidden states are gathered first, as the output layer does). With
max_workspace_bytes=N (bytes) the workspace is at most N, nothing of [s, b, V / tp] is kept, and
the backward forms the logits again chunk by chunk (four products: the upstream per-token gradient
is not known in the forward); so does tensor parallelism 1. Forwards without labels keep Megatron's
output layer (and the switched loss).

Extra keyword arguments of apply_headloss are loss-plan options (LossPlan's: terms, z_weight,
entropy_weight, label_smoothing as the plan's eps, softcap, logit_scale, grad_dtype="float32",
check=False, ...); a token's loss is then sum_k weight_k l_k. Written against megatron-core 0.19.2
(compute_language_model_loss and the three losses it picks from were read there).
"""
from __future__ import annotations

import inspect
import types
from typing import Optional

import torch
import torch.distributed as dist

from .._lib import HeadlossValueError
from ..loss import LossPlan
from ..torch_token_loss import linear_token_loss, token_loss

__all__ = ["apply_headloss", "remove_headloss", "vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, tp_group: Optional[dist.ProcessGroup] = None,
                                 **options) -> torch.Tensor:
    """megatron.core.tensor_parallel.vocab_parallel_cross_entropy on the sharded plan: logits
    [s, b, V / tp], target [s, b] -> per-token losses [s, b] (fp32). tp_group None: Megatron's
    tensor-parallel group. label_smoothing: Megatron's alpha (see the module docstring); options:
    the plan's."""
    if tp_group is None:
        from megatron.core.parallel_state import get_tensor_model_parallel_group
        tp_group = get_tensor_model_parallel_group()
    if label_smoothing:
        V = vocab_parallel_logits.shape[-1] * dist.get_world_size(tp_group)
        options["label_smoothing"] = label_smoothing * V / (V - 1)
    return token_loss(vocab_parallel_logits, target, group=tp_group, **options)


def _compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    # Labels [b, s] as the logits' [s, b] rows; the losses back to [b, s], as Megatron's.
    loss = token_loss(logits, labels.transpose(0, 1), group=self.tp_group, **self._headloss_loss_options)
    return loss.transpose(0, 1).contiguous()


def _fused_output(self, *, hidden_states, output_layer, output_weight, labels, **_):
    """GPTModel's output_processor: per-token losses [b, s] from hidden [s, b, H] (sequence parallel:
    this rank's s / tp) and the weight shard [V / tp, H], without the logits."""
    if getattr(output_layer, "bias", None) is not None:
        raise HeadlossValueError("headloss: fused_output_layer takes an output layer without a bias")
    if getattr(output_layer, "sequence_parallel", False):
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
        # linear_token_loss sums grad_hidden over the group: the gather's backward splits it.
        hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                             group=self.tp_group)
    weight = output_layer.weight if output_weight is None else output_weight
    loss = linear_token_loss(hidden_states, weight, labels.transpose(0, 1), group=self.tp_group,
                             max_workspace_bytes=self._headloss_workspace, **self._headloss_loss_options)
    return loss.transpose(0, 1).contiguous()


def _forward_fused(self, *args, **kwargs):
    """GPTModel.forward with _fused_output as its output_processor where it applies."""
    from megatron.core.inference.utils import InferenceMode
    bound = inspect.signature(type(self).forward).bind(self, *args, **kwargs)
    if (bound.arguments.get("labels") is not None and bound.arguments.get("output_processor") is None
            and not InferenceMode.is_active() and not getattr(self.config, "use_mup", False)):
        kwargs["output_processor"] = types.MethodType(_fused_output, self)
    return type(self).forward(self, *args, **kwargs)


def _language_modules(model) -> list:
    from megatron.core.models.common.language_module.language_module import LanguageModule
    chunks = model if isinstance(model, (list, tuple)) else [model]  # virtual pipeline: a list
    return [m for c in chunks for m in c.modules() if isinstance(m, LanguageModule)]


def apply_headloss(model, *, fused_output_layer: bool = False, max_workspace_bytes: Optional[int] = None,
                   **loss_options):
    """Makes every LanguageModule in model (a module or a list of modules) compute its language-model
    loss with headloss's sharded plan (see the module docstring), and with fused_output_layer every
    GPTModel its output layer and loss in one (the fused linear form, its workspace capped at
    max_workspace_bytes); returns model. Calling it again replaces the options; remove_headloss
    undoes it."""
    LossPlan(2, "float32", **loss_options)  # refuses a bad option now rather than at the first step
    found = _language_modules(model)
    if not found:
        raise HeadlossValueError(f"headloss: no Megatron-core LanguageModule in {type(model).__name__}")
    for m in found:
        m._headloss_loss_options, m._headloss_workspace = dict(loss_options), max_workspace_bytes
        m.compute_language_model_loss = types.MethodType(_compute_language_model_loss, m)
        m.__dict__.pop("forward", None)
        if fused_output_layer and "output_processor" in inspect.signature(type(m).forward).parameters:
            m.forward = types.MethodType(_forward_fused, m)
    return model


def remove_headloss(model):
    """Undoes apply_headloss: Megatron's own compute_language_model_loss again."""
    for m in _language_modules(model):
        for attr in ("compute_language_model_loss", "_headloss_loss_options", "_headloss_workspace", "forward"):
            m.__dict__.pop(attr, None)
    return model
