"""Finds and loads libheadloss, and turns its status codes into exceptions.

The library is looked up, in order: $HEADLOSS_LIBRARY (a path), the package folder (a bundled
copy), then the repository's lib/ folder when the package runs from a checkout.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent


class HeadlossError(RuntimeError):
    """A headloss call failed. `status` is the hl_status_t value, `args[0]` the library's message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _candidates():
    env = os.environ.get("HEADLOSS_LIBRARY")
    if env:
        yield Path(env)
    yield from sorted(_HERE.glob("libheadloss.so*"))
    yield _HERE.parent.parent / "lib" / "libheadloss.so"


def _load() -> ctypes.CDLL:
    tried = []
    for path in _candidates():
        if path.exists():
            try:
                dll = ctypes.CDLL(str(path))
            except OSError as e:  # e.g. a copy built for another platform: try the next one
                tried.append(f"{path} ({e})")
                continue
            dll._headloss_path = path
            return dll
        tried.append(str(path))
    raise ImportError("libheadloss.so not found (build it with `make`, or set HEADLOSS_LIBRARY); "
                      "looked in: " + ", ".join(tried))


lib = _load()
lib_path: Path = lib._headloss_path  # the file loaded (the JAX adapter is looked for beside it)
lib.hl_get_version.restype = ctypes.c_int
lib.hl_get_error_string.restype = ctypes.c_char_p
lib.hl_get_error_string.argtypes = [ctypes.c_int]
lib.hl_get_last_error.restype = ctypes.c_char_p
lib.hl_backend_is_available.restype = ctypes.c_int
lib.hl_backend_is_available.argtypes = [ctypes.c_int]

# hl_backend_t and hl_dtype_t
BACKEND_CPU, BACKEND_CUDA = 1, 2
DTYPE_NONE, DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_I32, DTYPE_I64 = 0, 1, 2, 3, 4, 5


def check(status: int) -> None:
    """Raises HeadlossError carrying the library's last-error message if status is not success."""
    if status != 0:
        msg = lib.hl_get_last_error().decode() or lib.hl_get_error_string(status).decode()
        raise HeadlossError(status, msg)


def version() -> str:
    v = lib.hl_get_version()
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def cuda_available() -> bool:
    """True when the library was built with CUDA and a GPU is visible."""
    return bool(lib.hl_backend_is_available(BACKEND_CUDA))


def declare(name: str, *argtypes) -> ctypes._CFuncPtr:
    """Declares a library function returning hl_status_t."""
    f = getattr(lib, name)
    f.restype = ctypes.c_int
    f.argtypes = list(argtypes)
    return f
