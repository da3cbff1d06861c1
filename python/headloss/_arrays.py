"""One view of the array kinds the package accepts: NumPy (CPU backend), and PyTorch, CuPy and
JAX arrays or anything with __cuda_array_interface__ (CUDA backend).

`view(x)` reads an array's pointer, shape, element strides, dtype, device and current stream
without copying; `empty(like, shape, dtype)` allocates an output of the same kind and device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from ._lib import (BACKEND_CPU, BACKEND_CUDA, DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_I32,
                   DTYPE_I64, DTYPE_NONE)

_NAME_TO_DTYPE = {"float32": DTYPE_F32, "float16": DTYPE_F16, "bfloat16": DTYPE_BF16,
                  "int32": DTYPE_I32, "int64": DTYPE_I64}
DTYPE_NAMES = {v: k for k, v in _NAME_TO_DTYPE.items()}
ITEMSIZE = {DTYPE_F32: 4, DTYPE_F16: 2, DTYPE_BF16: 2, DTYPE_I32: 4, DTYPE_I64: 8}


def dtype_code(dtype: Any) -> int:
    """hl_dtype_t for a NumPy, ml_dtypes, PyTorch or JAX dtype, or a name such as 'bfloat16'."""
    name = str(dtype).replace("torch.", "")
    name = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
            "fp16": "float16", "f32": "float32", "f16": "float16"}.get(name, name)
    if name not in _NAME_TO_DTYPE:
        raise TypeError(f"unsupported dtype {dtype!r}; expected float32, float16, bfloat16, int32 or int64")
    return _NAME_TO_DTYPE[name]


@dataclass
class ArrayView:
    obj: Any                 # the caller's array, kept alive while the view is used
    kind: str                # "numpy", "torch", "cupy", "jax" or "cai"
    ptr: int
    shape: tuple
    strides: tuple           # in elements
    dtype: int               # hl_dtype_t
    backend: int             # BACKEND_CPU or BACKEND_CUDA
    stream: int              # the array's current CUDA stream (0: default), 0 on the CPU

    def rows_view(self, name: str):
        """(rows, cols, row_stride) of the array seen as [prod(leading dims), last dim]."""
        if len(self.shape) == 0:
            raise ValueError(f"{name} must have at least one dimension")
        cols = self.shape[-1]
        if cols > 1 and self.strides[-1] != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous (stride {self.strides[-1]})")
        rows = math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1
        lead = [(n, s) for n, s in zip(self.shape[:-1], self.strides[:-1]) if n != 1]
        row_stride = lead[-1][1] if lead else cols
        expected = row_stride
        for n, s in reversed(lead):  # leading dims must collapse into one row stride
            if s != expected:
                raise ValueError(f"{name}: leading dimensions {self.shape[:-1]} with strides "
                                 f"{self.strides[:-1]} do not collapse into rows; make it contiguous")
            expected = s * n
        return rows, cols, row_stride


def _torch_view(x) -> ArrayView:
    import torch
    cuda = x.is_cuda
    stream = torch.cuda.current_stream(x.device).cuda_stream if cuda else 0
    if not (cuda or x.device.type == "cpu"):
        raise ValueError(f"unsupported torch device {x.device}")
    return ArrayView(x, "torch", x.data_ptr(), tuple(x.shape), tuple(x.stride()),
                     dtype_code(x.dtype), BACKEND_CUDA if cuda else BACKEND_CPU, stream)


def _cai_view(x, kind: str, stream: int) -> ArrayView:
    cai = x.__cuda_array_interface__
    dt = np.dtype(cai["typestr"])
    code = dtype_code(getattr(x, "dtype", dt))
    shape = tuple(cai["shape"])
    itemsize = ITEMSIZE[code]
    if cai.get("strides") is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    else:
        strides = tuple(s // itemsize for s in cai["strides"])
    return ArrayView(x, kind, cai["data"][0], shape, strides, code, BACKEND_CUDA, stream)


def view(x: Any, name: str = "array") -> ArrayView:
    """Reads an array without copying. Raises TypeError for kinds the package does not know."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return _torch_view(x)
    if isinstance(x, np.ndarray):
        if any(s % x.itemsize for s in x.strides):
            raise ValueError(f"{name}: strides {x.strides} are not multiples of the item size")
        return ArrayView(x, "numpy", x.ctypes.data, x.shape,
                         tuple(s // x.itemsize for s in x.strides), dtype_code(x.dtype),
                         BACKEND_CPU, 0)
    if mod == "cupy":
        import cupy
        return _cai_view(x, "cupy", cupy.cuda.get_current_stream().ptr)
    if mod in ("jax", "jaxlib"):
        dev = list(x.devices())[0]
        if dev.platform == "cpu":
            return view(np.asarray(x), name)
        x.block_until_ready()  # JAX exposes no stream: order by completion, run on the default one
        shape = tuple(x.shape)
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        return ArrayView(x, "jax", x.unsafe_buffer_pointer(), shape, tuple(reversed(strides)),
                         dtype_code(x.dtype), BACKEND_CUDA, 0)
    if hasattr(x, "__cuda_array_interface__"):
        return _cai_view(x, "cai", 0)
    raise TypeError(f"{name}: unsupported array type {type(x).__name__}; pass a NumPy, PyTorch, "
                    "CuPy or JAX array")


def empty(like: ArrayView, shape: Sequence[int], dtype: int) -> Any:
    """A new array of the same kind and device as `like`."""
    name = DTYPE_NAMES[dtype]
    if like.kind == "torch":
        import torch
        return torch.empty(tuple(shape), dtype=getattr(torch, name), device=like.obj.device)
    if like.kind == "numpy":
        return np.empty(tuple(shape), dtype=_numpy_dtype(name))
    if like.kind == "cupy":
        import cupy
        return cupy.empty(tuple(shape), dtype=_numpy_dtype(name))
    if like.kind == "jax":
        raise TypeError("JAX arrays are immutable: use the headloss.jax functions (XLA FFI)")
    raise TypeError(f"cannot allocate an output like a {like.kind} array; pass out=")


def _numpy_dtype(name: str):
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:
            raise TypeError("bfloat16 NumPy arrays need the ml_dtypes package") from e
        return ml_dtypes.bfloat16
    return np.dtype(name)


def same_place(views: Sequence[Optional[ArrayView]], what: str) -> int:
    """The common backend of the given arrays; raises if they live on different kinds of memory."""
    present = [v for v in views if v is not None]
    backends = {v.backend for v in present}
    if len(backends) != 1:
        raise ValueError(f"{what}: arrays mix host and device memory")
    return backends.pop()
