"""Hugging Face transformers in one line:

    from headloss.integrations.transformers import apply_headloss, remove_headloss
    model = apply_headloss(AutoModelForCausalLM.from_pretrained(name))   # returns the model
    ...                                                                  # train as before
    remove_headloss(model)                                               # the stock model again

apply_headloss swaps two things on the model's own modules (instance attributes only: the classes,
the parameters and the state dict stay as they are, so optimizers, checkpoints and other models
are untouched):
- every RMSNorm of a kind in NORMS runs headloss's kernels with that model's rounding: Llama, Qwen2/3,
  Mistral, Mixtral, Phi-3, Granite cast like Llama (x_hat rounded to x's dtype, then times w; the
  output in the promoted dtype); Gemma 1/2/3, Qwen3-Next and Qwen3.5 in fp32 with (1 + w); Olmo2
  and Gemma3n in fp32 with w (Gemma3n's norms without a scale normalise only);
- for a causal LM of a type in LOSS_MODELS, training steps (model.training and labels given)
  compute the loss with headloss's loss plan from the last hidden states: HF's label shift (the
  last position of each sequence ignored, or `shift_labels` when passed), -100 (any negative
  label) ignored, `num_items_in_batch` as the divisor (else the mean over the counted tokens),
  Gemma 2/3's final_logit_softcapping and Granite's logits_scaling applied inside the plan. The
  loss goes through `lm_loss`: headloss's fused linear + loss where the installed version has it
  (torch_ops.linear_loss: the logits are never materialised), else the logits through lm_head and
  torch_ops.lm_head_loss (no fp32 copy of the logits, the gradient formed in the same pass). Such a
  step returns logits=None; evaluation (model.eval()) and calls without labels run the stock forward.

Extra keyword arguments of apply_headloss are loss-plan options (torch_ops.lm_head_loss's: e.g.
z_weight=1e-4 with terms=("ce", "z"), label_smoothing, check=False to skip the label-range check and
its stream synchronisation). Written against transformers 5.17 (the modules' code was checked
there); other versions work where those classes and the causal-LM forward are unchanged.
"""
from __future__ import annotations

import types
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import torch_ops
from .._lib import HeadlossValueError

__all__ = ["apply_headloss", "remove_headloss", "lm_loss", "NORMS", "LOSS_MODELS"]

# Norm class -> (cast, offset): how its forward rounds (see the module docstring).
_LLAMA, _GEMMA, _FP32 = ("llama", 0.0), ("gemma", 1.0), ("gemma", 0.0)
NORMS: Dict[str, tuple] = {
    **dict.fromkeys(["LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm",
                     "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Phi3RMSNorm", "GraniteRMSNorm"], _LLAMA),
    **dict.fromkeys(["GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "Qwen3NextRMSNorm", "Qwen3_5RMSNorm"], _GEMMA),
    **dict.fromkeys(["Olmo2RMSNorm", "Gemma3nRMSNorm"], _FP32),
}

# Causal-LM model types whose forward is model.model -> last_hidden_state -> lm_head -> the loss,
# with the config attributes they apply to the logits first: Gemma 2/3's final soft-cap, Granite's
# division by logits_scaling.
LOSS_MODELS: Dict[str, Dict[str, str]] = {
    **dict.fromkeys(["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo2"], {}),
    **dict.fromkeys(["gemma2", "gemma3_text"], {"softcap": "final_logit_softcapping"}),
    "granite": {"logits_scaling": "logits_scaling"},
}


def _is_hf_norm(m: nn.Module) -> bool:
    return type(m).__name__ in NORMS and type(m).__module__.startswith("transformers.")


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    cast, offset = NORMS[type(self).__name__]
    w = getattr(self, "weight", None)  # Gemma3n's norms without a scale have none
    x = hidden_states if hidden_states.is_contiguous() else hidden_states.contiguous()
    # Llama's forward returns weight * x_hat.to(x.dtype): the promoted dtype (fp32 with an fp32
    # weight); the others return x's dtype.
    out = torch.promote_types(w.dtype, x.dtype) if cast == "llama" and w is not None else x.dtype
    eps = getattr(self, "variance_epsilon", None)
    return torch_ops.rmsnorm(x, w, eps=self.eps if eps is None else eps, offset=offset, cast=cast,
                             out_dtype=out)


def lm_loss(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, *, divisor: Optional[float] = None,
            **options) -> torch.Tensor:
    """The loss of the next-token labels [...] (already shifted; negative ones ignored) from the
    last hidden states [..., H]: the one place that picks the fused linear + loss (the logits never
    exist) where headloss has it, else the logits form. options: the loss plan's."""
    linear_loss = getattr(torch_ops, "linear_loss", None)
    if linear_loss is not None and type(lm_head) is nn.Linear and lm_head.bias is None:
        return linear_loss(hidden, lm_head.weight, labels, divisor=divisor, **options)[0]
    logits = lm_head(hidden)
    return torch_ops.lm_head_loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                  divisor=divisor, **options)[0]


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None,
                       past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                       logits_to_keep=0, **kwargs):
    if labels is None or not self.training:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, past_key_values=past_key_values,
                                  inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                  logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # The arguments HF's ForCausalLMLoss takes; the rest go to the decoder as in the stock forward.
    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, **kwargs)
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    hidden = outputs.last_hidden_state[:, keep, :]
    if shift_labels is None:  # position t predicts token t + 1; the last one predicts nothing
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    options = dict(self._headloss_loss_options)
    if ignore_index >= 0:  # negative labels are ignored anyway
        options["ignore_index"] = ignore_index
    loss = lm_loss(hidden, self.lm_head, shift_labels.to(hidden.device).contiguous(),
                   divisor=None if num_items is None else float(num_items) or None, **options)
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def _logit_options(model) -> Dict[str, Any]:
    attrs, cfg, out = LOSS_MODELS[model.config.model_type], model.config, {}
    cap = getattr(cfg, attrs["softcap"], None) if "softcap" in attrs else None
    if cap:
        out["softcap"] = float(cap)
    scaling = getattr(cfg, attrs["logits_scaling"], None) if "logits_scaling" in attrs else None
    if scaling:
        out["logit_scale"] = 1.0 / float(scaling)
    return out


def apply_headloss(model: nn.Module, *, rms_norm: bool = True, loss: bool = True, **loss_options) -> nn.Module:
    """Swaps in headloss's RMSNorm and causal-LM loss (see the module docstring); returns the model.
    loss=True needs a causal LM of a type in LOSS_MODELS (loss=False: the norms alone). Calling it
    again is harmless; remove_headloss undoes it."""
    from transformers.utils import can_return_tuple

    patched = getattr(model, "_headloss_patched", [])
    if loss:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in LOSS_MODELS or not isinstance(getattr(model, "lm_head", None), nn.Module):
            raise HeadlossValueError(f"headloss: no causal-LM loss for {type(model).__name__} (model type "
                             f"{model_type!r}); supported: {sorted(LOSS_MODELS)}. loss=False swaps the "
                             "norms alone")
        model._headloss_loss_options = {**_logit_options(model), **loss_options}
        if model not in patched:
            model.forward = types.MethodType(can_return_tuple(_causal_lm_forward), model)
            patched.append(model)
    if rms_norm:
        for m in model.modules():
            if _is_hf_norm(m) and m not in patched:
                m.forward = types.MethodType(_norm_forward, m)
                patched.append(m)
    if not patched:
        raise HeadlossValueError(f"headloss: nothing to swap in {type(model).__name__} (no RMSNorm of a kind "
                         f"in headloss.integrations.transformers.NORMS)")
    model._headloss_patched = patched
    return model


def remove_headloss(model: nn.Module) -> nn.Module:
    """Undoes apply_headloss: every patched module runs its class's forward again."""
    for m in getattr(model, "_headloss_patched", []):
        del m.forward
    for attr in ("_headloss_patched", "_headloss_loss_options"):
        if attr in model.__dict__:
            delattr(model, attr)
    return model
