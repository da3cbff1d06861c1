"""Finds and loads libheadloss, and turns its status codes into exceptions.

The library is looked up, in order: $HEADLOSS_LIBRARY (a path), the package folder (a bundled
copy), then the repository's lib/ folder when the package runs from a checkout. Its structures,
enums and constants come from _abi, generated from include/headloss.h by the build
(tools/gen_abi.py); the library loaded must be of the same version.
"""
from __future__ import annotations

import ctypes
import numbers
import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent


try:
    from . import _abi
except ModuleNotFoundError as e:  # a checkout never built: the build generates _abi.py
    raise ImportError("headloss/_abi.py is missing: build the library (`make`, or cmake --build), "
                      "which generates it from include/headloss.h, or `pip install .`") from e
from ._errors import HeadlossError, HeadlossTypeError, HeadlossValueError  # noqa: E402


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
if lib.hl_get_version() != _abi.HL_VERSION:
    raise ImportError(f"{lib_path} is version {lib.hl_get_version()}, but this package was built for "
                      f"{_abi.HL_VERSION} (include/headloss.h): rebuild, or point HEADLOSS_LIBRARY at "
                      "the library built with it")

BACKEND_CPU, BACKEND_CUDA = _abi.HL_BACKEND_CPU, _abi.HL_BACKEND_CUDA
DTYPE_NONE, DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_I32, DTYPE_I64 = (
    _abi.HL_DTYPE_NONE, _abi.HL_DTYPE_F32, _abi.HL_DTYPE_F16, _abi.HL_DTYPE_BF16, _abi.HL_DTYPE_I32,
    _abi.HL_DTYPE_I64)
# Statuses that mean a bad argument: raised as HeadlossValueError (also a ValueError).
_VALUE_STATUSES = (_abi.HL_STATUS_INVALID_VALUE, _abi.HL_STATUS_MISALIGNED,
                   _abi.HL_STATUS_INSUFFICIENT_WORKSPACE)


def check(status: int) -> None:
    """Raises HeadlossError carrying the library's last-error message if status is not success
    (HeadlossValueError for the statuses of a bad argument)."""
    if status != 0:
        msg = lib.hl_get_last_error().decode() or lib.hl_get_error_string(status).decode()
        raise (HeadlossValueError if status in _VALUE_STATUSES else HeadlossError)(msg, status)


def descriptor(struct, **fields):
    """A zeroed descriptor with struct_size set (every field its default: the header's "zero it
    and set struct_size"), then `fields` set."""
    return struct(struct_size=ctypes.sizeof(struct), **fields)


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


def named(prefix: str) -> dict:
    """The header's constants of one family by their lower-case suffix: named("HL_LOSS_KL_") is
    {"k3": 0, "k1": 1, "k2": 2}."""
    return {k[len(prefix):].lower(): v for k, v in vars(_abi).items() if k.startswith(prefix)}


def code_of(table: dict, what: str, value) -> int:
    """The code of a name in `table` (from named()); an int passes through (the library checks it)."""
    if isinstance(value, str):
        if value not in table:
            raise HeadlossValueError(f"{what} is {value!r}; expected one of {', '.join(map(repr, table))}")
        return table[value]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise HeadlossTypeError(f"{what} is {value!r}; expected one of {', '.join(map(repr, table))}")
    return int(value)
