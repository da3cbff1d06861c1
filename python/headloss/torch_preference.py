"""PyTorch front end of the plan's preference term (DPO and its loss types, IPO, SimPO, ORPO, CPO,
KTO; docs/loss.md "Preference losses"): one call on the policy's hidden states and head weight (or on
its logits) for a batch of completions grouped by cu_seqlens, the loss and TRL's metrics out, the
gradients formed in the same pass and handed to autograd in backward (torch_loss's Functions).

    loss, metrics = preference_loss(hidden, lm_head.weight, labels, cu_seqlens, ref_logps, loss="dpo", beta=0.1)
    loss.backward()

Layout: 2P sequences, the P chosen completions first, then their P rejected ones in the same order
(TRL's concatenation); prompt tokens carry label -100. ref_logps: the reference model's sequence
log-probabilities [2P] (DPO, KTO; SimPO, ORPO and CPO are reference-free). KTO's sequences are
unpaired: kto_labels [2P] says which are desirable (1), undesirable (0) or its KL completions (-1).
nll_weight > 0 adds the NLL of the chosen tokens (TRL's rpo_alpha, ORPO's and CPO's NLL) in the same
pass. Eager autograd (an autograd.Function); under torch.compile the call is a graph break.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional, Tuple

import torch

from ._loss_options import PREFERENCE_METRICS, preference_options
from .loss import DEFAULT_MAX_WORKSPACE_BYTES, SCALARS, LinearLossPlan, LossPlan
from .torch_loss import INPUTS, LINEAR_INPUTS, FusedLossFunction, LinearLossFunction

METRICS = PREFERENCE_METRICS  # TRL's metric names for the plan's scalars


@lru_cache(maxsize=64)
def _plan(key: tuple, vocab: int, hidden: int, dtype: torch.dtype, device: str, grads: tuple):
    opts = dict(key)
    if hidden:
        gh, gw, gw_dtype = grads
        return LinearLossPlan(vocab, hidden, dtype, device=device, grad_hidden="write" if gh else None,
                              grad_weight="write" if gw else None,
                              grad_weight_dtype=gw_dtype if gw else None, **opts)
    return LossPlan(vocab, dtype, device=device, grad_dtype=None, **opts)


def preference_loss(hidden: torch.Tensor, weight: Optional[torch.Tensor], labels: torch.Tensor,
                    cu_seqlens: torch.Tensor, ref_logps: Optional[torch.Tensor] = None, *, loss: str = "dpo",
                    loss_type: str = "sigmoid", beta: float = 0.1, gamma: Optional[float] = None,
                    label_smoothing: float = 0.0, nll_weight: float = 0.0, kto_labels: Optional[torch.Tensor] = None,
                    max_workspace_bytes: Optional[int] = DEFAULT_MAX_WORKSPACE_BYTES, grad_weight_dtype=None,
                    **options) -> Tuple[torch.Tensor, dict]:
    """(loss, metrics) of a preference loss. hidden [rows, H] with the head's weight [V, H] (the fused
    linear form: no [rows, V] logits), or logits [rows, V] with weight None. loss: "dpo", "simpo",
    "orpo", "cpo" or "kto"; loss_type: DPO's and CPO's (sigmoid, hinge, ipo, exo_pair, nca_pair,
    robust, bco_pair, sppo_hard, apo_zero, apo_down, discopop); beta, gamma (SimPO's margin, default
    0.5 as TRL), label_smoothing as TRL; other plan options (pref_logp, pref_tau, kto_*_weight, ...)
    by keyword. metrics: TRL's names (METRICS), 0-d tensors without gradient."""
    opts = dict(options, **preference_options(loss, loss_type, beta, gamma, label_smoothing, nll_weight))
    opts["cu_seqlens_dtype"] = str(cu_seqlens.dtype).replace("torch.", "")
    kw = dict(cu_seqlens=cu_seqlens)
    if ref_logps is not None:
        kw["ref_seq_logprobs"] = ref_logps.float().contiguous()
    if kto_labels is not None:
        kw["kto_labels"] = kto_labels.to(torch.int32).contiguous()
    if nll_weight:  # CE on the chosen completions' tokens alone (the first half of the sequences)
        rows = torch.arange(labels.shape[0], device=labels.device)
        kw["weights"] = (rows < cu_seqlens[(cu_seqlens.shape[0] - 1) // 2]).float()
    H = 0 if weight is None else hidden.shape[-1]
    grads = (hidden.requires_grad, weight is not None and weight.requires_grad, grad_weight_dtype)
    key = tuple(sorted(dict(opts, labels_dtype=str(labels.dtype).replace("torch.", "")).items()))
    V = hidden.shape[-1] if weight is None else weight.shape[0]
    plan = _plan(key, V, H, hidden.dtype, hidden.device.type, grads)
    if weight is None:
        value, scalars = FusedLossFunction.apply(hidden, labels, plan, False, None, *(kw.get(k) for k in INPUTS))
    else:
        value, scalars = LinearLossFunction.apply(hidden, weight, labels, plan, None, max_workspace_bytes,
                                                  *(kw.get(k) for k in LINEAR_INPUTS))
    index = {k: i for i, k in enumerate(SCALARS)}
    return value, {name: scalars[index[s]] for name, s in METRICS.items()}
