"""The package's one error type. Every error a caller can cause is a HeadlossError:

- HeadlossValueError (also a ValueError): a bad value, shape, length, layout or option, found by
  the package before the call or by the library (statuses INVALID_VALUE, MISALIGNED,
  INSUFFICIENT_WORKSPACE);
- HeadlossTypeError (also a TypeError): an argument of the wrong kind: an array type, dtype or
  device the call does not take, an unknown keyword;
- HeadlossError itself (a RuntimeError) for the rest: NOT_SUPPORTED, CUDA, NCCL, allocation
  and internal failures.

`status` is the hl_status_t (INVALID_VALUE for the package's own checks); the message names the
argument, its value and what was expected.
"""
from __future__ import annotations

from ._abi import HL_STATUS_INVALID_VALUE


class HeadlossError(RuntimeError):
    """A headloss call failed. `status` is the hl_status_t value, `args[0]` the message."""

    def __init__(self, message: str, status: int = HL_STATUS_INVALID_VALUE):
        super().__init__(message)
        self.status = status


class HeadlossValueError(HeadlossError, ValueError):
    """A bad value: shape, length, layout, option (or the library's INVALID_VALUE, MISALIGNED,
    INSUFFICIENT_WORKSPACE)."""


class HeadlossTypeError(HeadlossError, TypeError):
    """An argument of the wrong kind: array type, dtype, device, keyword."""
