"""headloss: fused kernels for the language-model head, over the libheadloss C library.

Arrays from NumPy run on the CPU backend (fp64 reference arithmetic); arrays from PyTorch, CuPy
and JAX on the GPU run on the CUDA backend, on the array's current stream. Every error a caller
can cause raises HeadlossError naming the argument, its value and what was expected:
HeadlossValueError (also a ValueError) for a bad value, shape or option, HeadlossTypeError (also
a TypeError) for a wrong array type, dtype or device; every array is checked against the sizes
passed to the library before the call. TERMS and SCALARS name the loss plan's terms and outputs;
LossPlan's docstring lists its options and their defaults.

Framework front ends (imported on demand, so the package needs neither): headloss.torch_ops
(PyTorch custom ops and the RMSNorm module, torch.compile-ready; linear_loss for the fused linear
form), headloss.torch_tokens (per-token log-probs, entropies and lse with a backward, both
forms), headloss.torch_loss (the loss plan as autograd functions and a module), headloss.jax (XLA
FFI custom calls for jax.jit) and headloss.fla_backend (gdn_bwd_dqkwg as a drop-in for
flash-linear-attention's chunked backward).
"""
from ._lib import HeadlossError, HeadlossTypeError, HeadlossValueError, cuda_available, version
from .rmsnorm import RMSNormGrads, RMSNormOutput, rmsnorm, rmsnorm_bwd, rmsnorm_fwd
from .gdn import GDNGrads, gdn_bwd_dqkwg
from .loss import (SCALARS, TERMS, LinearLossOutput, LinearLossPlan, LossOutput, LossPlan, aggregation,
                   fused_loss)

__version__ = version()
__all__ = ["HeadlossError", "HeadlossValueError", "HeadlossTypeError", "cuda_available", "version", "rmsnorm", "rmsnorm_fwd", "rmsnorm_bwd",
           "RMSNormOutput", "RMSNormGrads"]
__all__ += ["gdn_bwd_dqkwg", "GDNGrads"]
__all__ += ["LossPlan", "LossOutput", "fused_loss", "LinearLossPlan", "LinearLossOutput", "aggregation",
            "TERMS", "SCALARS"]
