"""TRL's DPO, KTO, CPO and ORPO trainers on headloss's preference loss in one line:

    from headloss.integrations.trl import apply_headloss, remove_headloss
    trainer = apply_headloss(DPOTrainer(model, ref_model=ref, args=DPOConfig(...), ...))  # or KTOTrainer,
    trainer.train()                     # trl.experimental.cpo.CPOTrainer, trl.experimental.orpo.ORPOTrainer
    remove_headloss(trainer)            # TRL's own loss again

Apply it before train(): when training starts, accelerate wraps the policy's forward (with its
autocast) around the one apply_headloss installs.

The trainer's loss step (DPO's and KTO's _compute_loss, CPO's and ORPO's get_batch_loss_metrics)
then calls the policy with a flag: its forward (so DDP, PEFT and accelerate's autocast wrappers see
the call) runs the backbone, as TRL's fused head does, and computes the loss from the completion
tokens' last hidden states and lm_head.weight with headloss.torch_preference.preference_loss, in
autocast's dtype under mixed precision (as F.linear would take them): no [tokens, V] logits. The
reference log-probs stay TRL's (its reference forward, or the precomputed ones). Written against
TRL 1.16 and transformers 5.x.

TRL's options it takes: beta; DPO's loss_type among sigmoid, hinge, ipo, exo_pair, nca_pair, robust,
bco_pair, sppo_hard, apo_zero, apo_down, discopop (discopop_tau) and sigmoid_norm, one of them with
its loss_weights entry, plus "sft" (the NLL of the chosen completions, with its weight);
label_smoothing where TRL reads it (DPO's robust and exo_pair, CPO's sigmoid and simpo);
precompute_ref_log_probs; KTO's loss_type "kto" with desirable_weight and undesirable_weight and its
KL completions; CPO's loss_type sigmoid, hinge, ipo and simpo (simpo_gamma) with cpo_alpha; ORPO's
NLL over the chosen prompt and completion (the prompt's rows in a CE call of their own). The
metrics TRL logs for the loss come from headloss's: rewards/chosen, rewards/rejected,
rewards/accuracies, rewards/margins, logps/chosen, logps/rejected, nll_loss (CPO, ORPO),
log_odds_ratio and log_odds_chosen (ORPO), kl (KTO); logits/chosen and logits/rejected are TRL's
means of the logits over the vocabulary, hidden @ mean(lm_head.weight) (no logits either). DPO's
ipo and sigmoid_norm compare mean log-probs: their rewards and logps are then logged per token (TRL
logs sums). DPO's and KTO's entropy, mean_token_accuracy and num_tokens are not logged.

Refused with HeadlossValueError naming the option (no headloss equivalent): DPO's aot, aot_unpaired,
more than one preference loss_type, f_divergence_type other than reverse_kl, ld_alpha,
use_weighting; KTO's apo_zero_unpaired; CPO's alpha (AlphaPO); an MoE router loss
(router_aux_loss_coef / output_router_logits), encoder-decoder models, vision datasets, an lm_head
with a bias, models whose config transforms the logits (final_logit_softcapping, logit scales).
KTO's KL baseline is this rank's (TRL averages it over the ranks before the loss).
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from .._lib import HeadlossValueError
from ..torch_ops import linear_loss
from ..torch_preference import preference_loss

__all__ = ["apply_headloss", "remove_headloss"]

# The config attributes by which a model scales or caps its logits before the loss (TRL's fused head).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling")


def _refuse(option: str, why: str):
    raise HeadlossValueError(f"headloss.integrations.trl: {option} {why}")


# ---- TRL's options -> preference_loss's, checked once in apply_headloss ----

def _dpo_options(t) -> dict:
    if t.f_divergence_type != "reverse_kl":
        _refuse(f"f_divergence_type={t.f_divergence_type!r}", "has no headloss equivalent (reverse_kl: standard DPO)")
    if t.ld_alpha is not None:
        _refuse(f"ld_alpha={t.ld_alpha}", "(LD-DPO's length weighting) has no headloss equivalent")
    if t.use_weighting:
        _refuse("use_weighting=True", "(WPO's weights) has no headloss equivalent")
    weights = dict(zip(t.loss_types, t.loss_weights))
    nll = weights.pop("sft", 0.0)
    if len(weights) != 1:
        _refuse(f"loss_type={t.loss_types}", "needs one preference loss type (with 'sft' beside it or not): "
                "headloss computes one a call")
    (loss_type, weight), = weights.items()
    if loss_type in ("aot", "aot_unpaired"):
        _refuse(f"loss_type={loss_type!r}", "(sorted log-ratios across the batch) has no headloss equivalent")
    mean = loss_type in ("ipo", "sigmoid_norm")  # both compare mean log-probs (TRL: sums / completion lengths)
    opts = dict(loss="dpo", loss_type="sigmoid" if loss_type == "sigmoid_norm" else loss_type, beta=t.beta,
                nll_weight=nll, pref_logp="mean" if mean else None, pref_weight=None if weight == 1 else weight)
    if loss_type in ("robust", "exo_pair"):
        opts["label_smoothing"] = t.label_smoothing
    if loss_type == "discopop":
        opts["pref_tau"] = t.args.discopop_tau
    return opts


def _kto_options(t) -> dict:
    if t.loss_type != "kto":
        _refuse(f"loss_type={t.loss_type!r}", "has no headloss equivalent (headloss's KTO is loss_type 'kto')")
    return dict(loss="kto", beta=t.beta, kto_desirable_weight=t.desirable_weight,
                kto_undesirable_weight=t.undesirable_weight)


def _cpo_options(t) -> dict:
    if t.alpha != 0:
        _refuse(f"alpha={t.alpha}", "(AlphaPO's reward transform) has no headloss equivalent")
    simpo = t.loss_type == "simpo"
    opts = dict(loss="simpo" if simpo else "cpo", loss_type=t.loss_type, beta=t.beta, nll_weight=t.cpo_alpha)
    if simpo:
        opts["gamma"] = t.simpo_gamma
    if t.loss_type in ("sigmoid", "simpo"):  # TRL ignores it for hinge and ipo
        opts["label_smoothing"] = t.label_smoothing
    return opts


def _orpo_options(t) -> dict:
    return dict(loss="orpo", beta=t.beta)


# ---- the loss on the policy's completion rows, inside its forward ----

def _head(model, input_ids, attention_mask, fn):
    """fn(hidden [B, L, H], lm_head.weight) run inside `model`'s forward (_add_forward's flag), so
    it sees the wrappers' autocast as TRL's fused head does; both in autocast's dtype there."""
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, headloss=fn)


def _rows(hidden, labels):
    """The rows that predict a label: hidden [B, L, H] (L > T where prompt-learning PEFT prepends
    tokens) and labels [B, T] (-100 outside the completions) -> hidden rows [N, H], their next-token
    labels [N], cu_seqlens [B + 1], the sequences' lengths [B]."""
    x, y = hidden[:, -labels.shape[1]:-1], labels[:, 1:]
    keep = y != -100
    n = keep.sum(1)
    return x[keep], y[keep], F.pad(n.cumsum(0), (1, 0)).to(torch.int32), n


def _mean_logits(x, w) -> torch.Tensor:
    """Each row's logits averaged over the vocabulary (TRL's logits/* metrics), without forming them."""
    return x.detach().float() @ w.detach().float().mean(0)


def _mean(trainer, value, count=1):
    """The mean over all ranks of this rank's mean `value` of `count` items (TRL's gathered means);
    None where no rank has any."""
    acc = trainer.accelerator  # gather, not gather_for_metrics: these are sums, not samples to trim
    sums = torch.tensor([[float(value) * count if count else 0.0, float(count)]], device=acc.device)
    total, n = acc.gather(sums).sum(0).tolist()
    return total / n if n else None


def _log(trainer, mode: str, name: str, value, count=1):
    """Appends a metric to DPO's and KTO's store, as TRL does where some rank has items for it;
    returns it (None where not)."""
    mean = _mean(trainer, value, count)
    if mean is not None:
        trainer._metrics[mode][name].append(mean)
    return mean


def _ref(trainer, inputs, keys):
    """The reference's sequence log-probs: the precomputed ones, else TRL's reference forward."""
    if trainer.precompute_ref_logps:
        return [inputs.get(k) for k in keys]
    ref = trainer.ref_model if trainer.ref_model is not None else trainer.model  # PEFT: the adapter disabled
    return trainer.compute_ref_log_probs(ref, inputs)


def _outputs(model, inputs):
    """What TRL returns with return_outputs=True: the stock forward's outputs (TRL recomputes them too)."""
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])


def _completion_labels(inputs, prefix=""):
    return inputs[prefix + "input_ids"].masked_fill(inputs[prefix + "completion_mask"] == 0, -100)


def _dpo_loss(self, model, inputs, return_outputs):
    mode = "train" if self.model.training else "eval"
    opts, labels = self._headloss_options, _completion_labels(inputs)
    ref = torch.cat(list(_ref(self, inputs, ("ref_chosen_logps", "ref_rejected_logps"))))

    def head(hidden, w):
        x, y, cu, n = _rows(hidden, labels)
        loss, metrics = preference_loss(x, w, y, cu, ref / n.clamp(min=1) if opts["pref_logp"] else ref, **opts)
        z, half = _mean_logits(x, w), cu[len(n) // 2]
        return loss, metrics, (z[:half].sum(), z[half:].sum())

    loss, metrics, logits = _head(model, inputs["input_ids"], inputs["attention_mask"], head)
    pairs, tokens = len(labels) // 2, (labels[:, 1:] != -100).sum(1)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected"):
        _log(self, mode, name, metrics[name], pairs)
    for kind, total, count in zip(("chosen", "rejected"), logits, (tokens[:pairs].sum(), tokens[pairs:].sum())):
        _log(self, mode, f"logits/{kind}", total / count.clamp(min=1), int(count))
    return (loss, _outputs(model, inputs)) if return_outputs else loss


def _kto_loss(self, model, inputs, return_outputs):
    mode = "train" if self.model.training else "eval"
    labels = _completion_labels(inputs)
    desirable = torch.as_tensor(inputs["label"], device=labels.device).to(torch.int32)
    ref, ref_kl = _ref(self, inputs, ("ref_logps", "ref_KL_logps"))
    kl = None
    if self.calculate_KL:  # TRL's KL completions, kto_labels -1: their z0 is a constant (no gradient)
        with torch.no_grad():
            kl = _head(model, inputs["KL_input_ids"], inputs["KL_attention_mask"],
                       lambda hidden, w: _rows(hidden, _completion_labels(inputs, "KL_")))

    def head(hidden, w):
        x, y, cu, n = _rows(hidden, labels)
        z, chosen = _mean_logits(x, w), torch.repeat_interleave(desirable, n).bool()
        kto_labels, r = desirable, ref
        if kl is not None:
            xk, yk, cuk, _ = kl
            x, y, cu = torch.cat([x, xk.to(x.dtype)]), torch.cat([y, yk]), torch.cat([cu, cuk[1:] + cu[-1]])
            kto_labels, r = F.pad(desirable, (0, len(cuk) - 1), value=-1), torch.cat([ref, ref_kl])
        loss, metrics = preference_loss(x, w, y, cu, r, kto_labels=kto_labels, **self._headloss_options)
        return loss, metrics, (z[chosen].sum(), chosen.sum()), (z[~chosen].sum(), (~chosen).sum())

    loss, metrics, *logits = _head(model, inputs["input_ids"], inputs["attention_mask"], head)
    _log(self, mode, "kl", metrics["kl"])
    seqs = {"chosen": int(desirable.sum()), "rejected": len(desirable) - int(desirable.sum())}
    rewards = {}
    for (kind, count), (total, tokens) in zip(seqs.items(), logits):
        _log(self, mode, f"logits/{kind}", total / tokens.clamp(min=1), int(tokens))
        _log(self, mode, f"logps/{kind}", metrics[f"logps/{kind}"], count)
        rewards[kind] = _log(self, mode, f"rewards/{kind}", metrics[f"rewards/{kind}"], count)
    if None not in rewards.values():  # TRL's margin: where both kinds occur
        self._metrics[mode]["rewards/margins"].append(rewards["chosen"] - rewards["rejected"])
    return (loss, _outputs(model, inputs)) if return_outputs else loss


def _paired_loss(self, model, batch, train_eval="train"):
    """CPO's and ORPO's get_batch_loss_metrics: (loss, metrics)."""
    opts, orpo = dict(self._headloss_options), self._headloss_options["loss"] == "orpo"
    cat = self.concatenated_inputs(batch, padding_value=self.padding_value if orpo else self.pad_token_id,
                                   device=self.accelerator.device)
    ids, mask, labels = cat["concatenated_input_ids"], cat["concatenated_attention_mask"], cat["concatenated_labels"]
    pairs = len(ids) // 2

    def head(hidden, w):
        x, y, cu, _ = _rows(hidden, labels)
        if orpo:  # TRL's ORPO NLL is the mean over the chosen prompts' tokens too: theirs in a CE call of their own
            xp, yp, _, _ = _rows(hidden[:pairs], ids.masked_fill((mask == 0) | (labels != -100), -100)[:pairs])
            opts["nll_weight"] = int(cu[pairs]) / (len(yp) + int(cu[pairs]))
        loss, metrics = preference_loss(x, w, y, cu, **opts)
        if orpo and len(yp):
            prompt_nll = linear_loss(xp, w, yp, divisor=len(yp) + int(cu[pairs]))[0]
            loss = loss + prompt_nll
            metrics["nll_loss"] = metrics["nll_loss"] * opts["nll_weight"] + prompt_nll.detach()
        z = _mean_logits(hidden[:, :-1] if orpo else hidden, w)  # TRL's means over every position's logits
        metrics["logits/chosen"], metrics["logits/rejected"] = z[:pairs].mean(), z[pairs:].mean()
        return loss, metrics

    loss, metrics = _head(model, ids, mask, head)
    names = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss"]
    names += ["log_odds_ratio", "log_odds_chosen"] if orpo else []
    prefix = "eval_" if train_eval == "eval" else ""
    # TRL gathers the per-pair rewards and logps, the other metrics as one value a rank
    return loss, {prefix + k: _mean(self, metrics[k], pairs if k.startswith(("rewards", "logps")) else 1)
                  for k in names}


# ---- the switch ----

_TRAINERS = {"DPOTrainer": (_dpo_options, "_compute_loss", _dpo_loss),
             "KTOTrainer": (_kto_options, "_compute_loss", _kto_loss),
             "CPOTrainer": (_cpo_options, "get_batch_loss_metrics", _paired_loss),
             "ORPOTrainer": (_orpo_options, "get_batch_loss_metrics", _paired_loss)}


def _kind(trainer):
    for cls in type(trainer).__mro__:
        if cls.__name__ in _TRAINERS and cls.__module__.startswith("trl."):
            return _TRAINERS[cls.__name__]
    raise HeadlossValueError(f"headloss.integrations.trl: {type(trainer).__name__} is none of TRL's "
                             f"{', '.join(_TRAINERS)} (nor a subclass)")


def _policy(trainer):
    """The policy model whose forward takes the flag (under PEFT, the model inside the adapter)."""
    model = trainer.model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _check(trainer, model) -> None:
    if getattr(trainer, "is_encoder_decoder", False):
        _refuse("an encoder-decoder model", "is not covered: the preference loss takes a causal LM's rows")
    if getattr(trainer, "_is_vision_dataset", False):
        _refuse("a vision dataset", "is not covered: the backbone is called with input_ids and attention_mask")
    if getattr(trainer, "aux_loss_enabled", False):
        _refuse("an MoE router loss (router_aux_loss_coef / output_router_logits)",
                "is not computed here; set router_aux_loss_coef to 0")
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        _refuse("an lm_head with a bias", "is not covered: the preference loss takes the head's weight alone")
    cfg = model.config.get_text_config()
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(cfg, attr, None)
        if value is not None and (attr == "final_logit_softcapping" or value != 1):
            _refuse(f"the model's {attr}={value}", "(a transform of the logits) is not covered")


def _add_forward(model) -> None:
    """model(..., headloss=fn) runs the backbone, as TRL's fused head does, and returns fn(last hidden
    states, lm_head.weight), both in autocast's dtype under autocast (as F.linear would take them);
    without it, the forward the model had."""
    stock = model.forward

    @functools.wraps(type(model).forward)  # keeps the signature generate() checks its kwargs against
    def forward(self, *args, headloss=None, **kwargs):
        if headloss is None:
            return stock(*args, **kwargs)
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        return headloss(hidden.to(dtype), self.get_output_embeddings().weight.to(dtype))

    model._headloss_stock_forward = stock
    model.forward = types.MethodType(forward, model)


def apply_headloss(trainer):
    """Makes a TRL DPOTrainer, KTOTrainer, CPOTrainer or ORPOTrainer compute its loss with headloss
    (see the module docstring); returns the trainer. HeadlossValueError names a TRL option that
    has no headloss equivalent. Calling it again takes the trainer's current options."""
    options, method, loss = _kind(trainer)
    model = _policy(trainer)
    _check(trainer, model)
    trainer._headloss_options = options(trainer)
    setattr(trainer, method, types.MethodType(loss, trainer))
    if "_headloss_stock_forward" not in vars(model):
        _add_forward(model)
    return trainer


def remove_headloss(trainer):
    """TRL's own loss again."""
    _, method, _ = _kind(trainer)
    for attr in (method, "_headloss_options"):
        vars(trainer).pop(attr, None)
    model = _policy(trainer)
    stock = vars(model).pop("_headloss_stock_forward", None)
    if stock is not None and stock.__func__ is type(model).forward:
        del model.forward
    elif stock is not None:
        model.forward = stock
    return trainer
