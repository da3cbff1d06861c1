"""verl's fused linear cross-entropy in one line:

    from headloss.integrations import verl as hl_verl
    hl_verl.patch()      # verl's linear_cross_entropy runs headloss's from here on
    ...                  # train as before (use_fused_kernels: the "triton" backend's forward)
    hl_verl.unpatch()    # verl's own again

linear_cross_entropy takes the arguments of verl's (verl.utils.kernel.linear_cross_entropy, checked
against verl 0.9.1) and returns what it returns: (logprobs, entropy), fp32, of the logits
hidden @ weight.T / temperature without forming them; hidden [..., H] and labels [...] flattened to
the tokens, entropy [tokens], logprobs [tokens] (reduction "none") or their sum or mean over the
tokens (0-d, "sum" / "mean"); the backward gives hidden's gradient (in its shape) and weight's, in
their dtypes. It runs headloss.torch_tokens.linear_token_logprobs: a forward of one product a chunk,
a backward that forms the logits again chunk by chunk, on CUDA or (CPU tensors) the CPU backend.
Where they differ: a negative label gives logp 0 (verl's kernel leaves its row undefined), labels
are range-checked (one synchronisation of the stream), and a vocabulary-parallel weight
(dist_process_group of several ranks, Megatron's tensor parallelism) is not done here: those calls
go to verl's kernel while patched, and raise otherwise.
"""
from __future__ import annotations

import importlib
import sys
from typing import Optional

import torch.distributed as dist
from torch import Tensor

from .._lib import HeadlossValueError
from ..torch_tokens import linear_token_logprobs

__all__ = ["linear_cross_entropy", "patch", "unpatch"]

_KERNEL = "verl.utils.kernel.linear_cross_entropy"
_stock = None     # verl's function while patched
_patched: list = []  # the modules whose linear_cross_entropy patch() replaced


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0,
                         reduction: str = "none", dist_process_group: Optional[dist.ProcessGroup] = None):
    """verl's linear_cross_entropy on headloss (see the module docstring)."""
    if dist_process_group is not None and dist.get_world_size(dist_process_group) > 1:
        if _stock is None:
            raise NotImplementedError("headloss.integrations.verl: a vocabulary-parallel weight "
                                      "(dist_process_group of several ranks) runs verl's own kernel; "
                                      "call patch() to keep it for such calls")
        return _stock(hidden, weight, labels, temperature, reduction, dist_process_group)
    reduction = reduction.lower()
    if reduction not in ("none", "sum", "mean"):
        raise HeadlossValueError(f"reduction is {reduction!r}; expected 'none', 'sum' or 'mean'")
    out = linear_token_logprobs(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                               temperature=float(temperature))
    logp = out.logp if reduction == "none" else out.logp.sum() if reduction == "sum" else out.logp.mean()
    return logp, out.entropy


def patch() -> None:
    """Replaces verl's linear_cross_entropy with this module's: in its own module (which verl's
    Hugging Face forwards import from at each call) and in every module already imported that
    holds it under that name (Megatron's fused forwards import it once; those imported later take
    the patched one from the kernel's module). Imports verl. Calling it again is harmless;
    unpatch() undoes it."""
    global _stock
    stock = _stock or importlib.import_module(_KERNEL).linear_cross_entropy
    for mod in list(sys.modules.values()):
        if getattr(mod, "__dict__", {}).get("linear_cross_entropy") is stock:
            mod.linear_cross_entropy = linear_cross_entropy
            _patched.append(mod)
    _stock = stock


def unpatch() -> None:
    """verl's own linear_cross_entropy again where patch() replaced it."""
    global _stock
    for mod in _patched:
        if vars(mod).get("linear_cross_entropy") is linear_cross_entropy:
            mod.linear_cross_entropy = _stock
    _patched.clear()
    _stock = None
