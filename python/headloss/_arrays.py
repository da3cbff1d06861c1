"""One view of the array kinds the package accepts: NumPy (CPU backend), and PyTorch, CuPy and
JAX arrays or anything with __cuda_array_interface__ (CUDA backend); other objects through
__dlpack__ (host memory: CPU backend; CUDA memory: CUDA backend). PyTorch CPU tensors run on the
CPU backend.

`view(x, name)` reads an array's pointer, shape, element strides, dtype, device and current stream
without copying; `expect(x, name, ...)` is the one check every entry point makes of every array
against what it tells the library (the C ABI takes bare pointers, so a short, mistyped, misplaced
or strided array would be read or written past its end); `empty(like, shape, dtype)` allocates an
output of the same kind and device.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np

from ._lib import (BACKEND_CPU, BACKEND_CUDA, DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_I32,
                   DTYPE_I64, HeadlossTypeError, HeadlossValueError)

_NAME_TO_DTYPE = {"float32": DTYPE_F32, "float16": DTYPE_F16, "bfloat16": DTYPE_BF16,
                  "int32": DTYPE_I32, "int64": DTYPE_I64}
DTYPE_NAMES = {v: k for k, v in _NAME_TO_DTYPE.items()}
ITEMSIZE = {DTYPE_F32: 4, DTYPE_F16: 2, DTYPE_BF16: 2, DTYPE_I32: 4, DTYPE_I64: 8}
FLOATS = (DTYPE_F32, DTYPE_F16, DTYPE_BF16)  # the dtypes of logits, activations and weights
INTS = (DTYPE_I32, DTYPE_I64)                # of labels, ids and cu_seqlens


_DTYPE_CACHE: dict = {}  # dtype object (hashable) -> hl_dtype_t: skips the str() on the hot path


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).replace("torch.", "")
    name = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
            "fp16": "float16", "f32": "float32", "f16": "float16"}.get(name, name)
    if name not in _NAME_TO_DTYPE:
        try:  # a scalar type such as np.float16 or ml_dtypes.bfloat16
            name = np.dtype(dtype).name
        except TypeError:
            pass
    return name


def dtype_code(dtype: Any, name: str = "dtype") -> int:
    """hl_dtype_t for a NumPy, ml_dtypes, PyTorch or JAX dtype, or a name such as 'bfloat16';
    HeadlossTypeError naming the argument `name` for any other."""
    code = _array_dtype(dtype)
    if isinstance(code, str):
        raise HeadlossTypeError(f"{name} is {code}; expected one of {', '.join(_NAME_TO_DTYPE)}")
    return code


def _array_dtype(dtype: Any) -> Union[int, str]:
    """hl_dtype_t of a dtype, or its name where the library has none (expect() reports it)."""
    try:
        return _DTYPE_CACHE[dtype]
    except (KeyError, TypeError):
        pass
    name = _dtype_name(dtype)
    code = _NAME_TO_DTYPE.get(name, name)
    try:
        _DTYPE_CACHE[dtype] = code
    except TypeError:  # unhashable
        pass
    return code


def dtype_label(code: Union[int, str]) -> str:
    return DTYPE_NAMES.get(code, str(code))


class ArrayView:
    """One array as the library sees it. `stream` is the array's current CUDA stream (0: the legacy
    default stream; 0 on the CPU); for PyTorch it is read on first use only, since only the first
    array's stream is used by a call. `device` is the CUDA device ordinal (-1 on the host).
    `dtype` is the hl_dtype_t, or the dtype's name where the library has none (expect() refuses
    it); `name` the argument's, for messages; `rows`, `stride` the rows and row stride expect()
    found for a matrix."""

    __slots__ = ("obj", "kind", "ptr", "shape", "strides", "dtype", "backend", "_stream", "device",
                 "name", "rows", "stride")

    def __init__(self, obj: Any, kind: str, ptr: int, shape: tuple, strides: tuple, dtype,
                 backend: int, stream: Any = 0, device: int = -1, name: str = "array"):
        self.obj = obj          # the caller's array, kept alive while the view is used
        self.kind = kind        # "numpy", "torch", "cupy", "jax", "dlpack" or "cai"
        self.ptr = ptr
        self.shape = shape
        self.strides = strides  # in elements
        self.dtype = dtype      # hl_dtype_t
        self.backend = backend  # BACKEND_CPU or BACKEND_CUDA
        self._stream = stream   # an int, or a callable returning it (read lazily)
        self.device = device
        self.name = name
        self.rows = self.stride = 0

    @property
    def stream(self) -> int:
        s = self._stream
        if callable(s):
            s = self._stream = s()
        return s

    @stream.setter
    def stream(self, value: int) -> None:
        self._stream = value

    def __repr__(self) -> str:
        return (f"ArrayView(kind={self.kind!r}, ptr={self.ptr:#x}, shape={self.shape}, "
                f"strides={self.strides}, dtype={dtype_label(self.dtype)}, backend={self.backend}, "
                f"device={self.device})")

    def rows_view(self, name: str):
        """(rows, cols, row_stride) of the array seen as [prod(leading dims), last dim]."""
        if len(self.shape) == 0:
            raise HeadlossValueError(f"{name} is a 0-d array; expected at least one dimension")
        cols = self.shape[-1]
        rows = math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1
        if rows == 0 or cols == 0:  # no elements: strides mean nothing (NumPy reports 0)
            return rows, cols, cols
        if cols > 1 and self.strides[-1] != 1:
            raise HeadlossValueError(f"{name}: the last dimension must be contiguous (stride "
                                     f"{self.strides[-1]}, shape {self.shape})")
        lead = [(n, s) for n, s in zip(self.shape[:-1], self.strides[:-1]) if n != 1]
        row_stride = lead[-1][1] if lead else cols
        expected = row_stride
        for n, s in reversed(lead):  # leading dims must collapse into one row stride
            if s != expected:
                raise HeadlossValueError(f"{name}: leading dimensions {self.shape[:-1]} with strides "
                                 f"{self.strides[:-1]} do not collapse into rows; make it contiguous")
            expected = s * n
        return rows, cols, row_stride


_torch_raw_stream = None


def _torch_stream_fn(device: int):
    """A callable returning torch's current stream on `device` as an int (cudaStream_t)."""
    global _torch_raw_stream
    if _torch_raw_stream is None:
        import torch
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what inductor uses: no object
        _torch_raw_stream = raw if raw is not None else (
            lambda d: torch.cuda.current_stream(d).cuda_stream)
    return lambda: _torch_raw_stream(device)


def _torch_view(x, name: str) -> ArrayView:
    if x.is_cuda:
        dev = x.get_device()
        return ArrayView(x, "torch", x.data_ptr(), tuple(x.shape), x.stride(), _array_dtype(x.dtype),
                         BACKEND_CUDA, _torch_stream_fn(dev), dev, name)
    if x.device.type != "cpu":
        raise HeadlossTypeError(f"{name} is on the torch device {x.device}; expected cpu or cuda")
    return ArrayView(x, "torch", x.data_ptr(), tuple(x.shape), x.stride(), _array_dtype(x.dtype),
                     BACKEND_CPU, 0, -1, name)


# DLPack (DLManagedTensor, read through ctypes from the capsule; the capsule keeps the data alive
# and its destructor releases it, so it is kept with the view).
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DL_DTYPES = {(2, 32): DTYPE_F32, (2, 16): DTYPE_F16, (4, 16): DTYPE_BF16, (0, 32): DTYPE_I32,
              (0, 64): DTYPE_I64}


def _dlpack_structs():
    import ctypes

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                    ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                    ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                    ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                    ("byte_offset", ctypes.c_uint64)]

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return DLTensor, get


_DLPACK = None


def _dlpack_view(x, name: str, stream_fn=None) -> ArrayView:
    """Any object with __dlpack__ / __dlpack_device__: host memory runs on the CPU backend, CUDA
    memory on the CUDA backend. The producer is asked to make the data ready on the stream we run
    on (stream_fn() if given, else the legacy default stream)."""
    global _DLPACK
    if _DLPACK is None:
        _DLPACK = _dlpack_structs()
    DLTensor, get = _DLPACK
    dev_type, dev_id = x.__dlpack_device__()
    dev_type = int(dev_type)
    if dev_type in (_DL_CPU, _DL_CUDA_HOST):
        capsule, backend, stream, device = x.__dlpack__(), BACKEND_CPU, 0, -1
    elif dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        stream = stream_fn() if stream_fn is not None else 0
        # DLPack names the legacy default stream 1 (0 is ambiguous); cudaStreamLegacy is 0x1 too.
        capsule = x.__dlpack__(stream=stream if stream else 1)
        backend, device = BACKEND_CUDA, int(dev_id)
    else:
        raise HeadlossTypeError(f"{name}: DLPack device type {dev_type} is neither host nor CUDA memory")
    t = DLTensor.from_address(get(capsule, b"dltensor"))
    code = _DL_DTYPES.get((t.code, t.bits)) if t.lanes == 1 else None
    if code is None:
        code = f"DLPack dtype (code {t.code}, {t.bits} bits, {t.lanes} lanes)"
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides:
        strides = tuple(t.strides[i] for i in range(t.ndim))
    else:
        strides = _packed_strides(shape)
    return ArrayView((x, capsule), "dlpack", (t.data or 0) + t.byte_offset, shape, strides, code,
                     backend, stream, device, name)


def _packed_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _cai_view(x, kind: str, stream: Optional[int], name: str, device: int = -1) -> ArrayView:
    cai = x.__cuda_array_interface__
    if stream is None:  # a generic producer: run on the stream it names (v3), else the default
        stream = cai.get("stream") or 0
    dt = np.dtype(cai["typestr"])
    code = _array_dtype(getattr(x, "dtype", dt))
    shape = tuple(cai["shape"])
    if cai.get("strides") is None:
        strides = _packed_strides(shape)
    else:
        strides = tuple(s // dt.itemsize for s in cai["strides"])
    return ArrayView(x, kind, cai["data"][0], shape, strides, code, BACKEND_CUDA, stream, device, name)


def view(x: Any, name: str = "array") -> ArrayView:
    """Reads an array without copying. HeadlossTypeError for kinds the package does not know."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return _torch_view(x, name)
    if isinstance(x, np.ndarray):
        if any(s % x.itemsize for s in x.strides):
            raise HeadlossValueError(f"{name}: strides {x.strides} are not multiples of the item size")
        return ArrayView(x, "numpy", x.__array_interface__["data"][0], x.shape,
                         tuple(s // x.itemsize for s in x.strides), _array_dtype(x.dtype),
                         BACKEND_CPU, 0, -1, name)
    if mod == "cupy":
        import cupy
        dev = x.device.id
        with cupy.cuda.Device(dev):  # the current stream of the array's own device
            stream = cupy.cuda.get_current_stream().ptr
        return _cai_view(x, "cupy", stream, name, dev)
    if mod in ("jax", "jaxlib"):
        devs = list(x.devices())
        if len(devs) != 1:
            raise HeadlossValueError(f"{name}: a JAX array sharded over {len(devs)} devices; pass one shard "
                             "(x.addressable_shards) or use headloss.jax inside shard_map")
        if devs[0].platform == "cpu":
            return view(np.asarray(x), name)
        # JAX exposes no stream: DLPack asks it to make the data ready on the legacy default
        # stream, which the call then runs on; the caller keeps x alive. JAX arrays are immutable:
        # outputs must come from another framework (or use headloss.jax, the XLA FFI path).
        try:
            v = _dlpack_view(x, name)
        except Exception:  # an older jax without DLPack streams: wait for the data instead
            x.block_until_ready()
            return ArrayView(x, "jax", x.unsafe_buffer_pointer(), tuple(x.shape),
                             _packed_strides(tuple(x.shape)), _array_dtype(x.dtype), BACKEND_CUDA, 0,
                             getattr(devs[0], "local_hardware_id", devs[0].id), name)
        v.kind = "jax"
        return v
    if hasattr(x, "__cuda_array_interface__"):
        return _cai_view(x, "cai", None, name)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return _dlpack_view(x, name)
    raise HeadlossTypeError(f"{name}: unsupported array type {type(x).__name__}; pass a NumPy, PyTorch, "
                    "CuPy or JAX array, or an object with __cuda_array_interface__ or __dlpack__")


def empty(like: ArrayView, shape: Sequence[int], dtype: int) -> Any:
    """A new array of the same kind and device as `like`."""
    if like.kind == "torch":
        import torch
        return torch.empty(tuple(shape), dtype=_torch_dtype(dtype), device=like.obj.device)
    name = DTYPE_NAMES[dtype]
    if like.kind == "numpy":
        return np.empty(tuple(shape), dtype=_numpy_dtype(name))
    if like.kind == "cupy":
        import cupy
        return cupy.empty(tuple(shape), dtype=_numpy_dtype(name))
    if like.kind == "jax":
        raise HeadlossTypeError(f"{like.name}: JAX arrays are immutable, so the outputs cannot be "
                                "allocated like it: use the headloss.jax functions (XLA FFI)")
    raise HeadlossTypeError(f"cannot allocate an output like {like.name}, a {like.kind} array; "
                            "pass the outputs preallocated")


def _numpy_dtype(name: str):
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:
            raise HeadlossTypeError("bfloat16 NumPy arrays need the ml_dtypes package") from e
        return ml_dtypes.bfloat16
    return np.dtype(name)


_TORCH_DTYPES: dict = {}


def _torch_dtype(code: int):
    t = _TORCH_DTYPES.get(code)
    if t is None:
        import torch
        t = _TORCH_DTYPES[code] = getattr(torch, DTYPE_NAMES[code])
    return t


def spec(x, name: str) -> ArrayView:
    """A view of an array's shape and dtype alone (a JAX tracer or ShapeDtypeStruct: no memory yet),
    for expect() without like= or strides."""
    shape = tuple(x.shape)
    return ArrayView(x, "spec", 0, shape, _packed_strides(shape), _array_dtype(x.dtype), 0, 0, -1, name)


def _place(v: ArrayView) -> str:
    return "host memory" if v.backend == BACKEND_CPU else f"cuda:{v.device}" if v.device >= 0 else "GPU memory"


def _dims(shape) -> str:
    return "[" + ", ".join("any" if n is None else str(n) for n in shape) + "]"


def _is_packed(v: ArrayView) -> bool:
    acc = 1
    for n, s in zip(reversed(v.shape), reversed(v.strides)):
        if n == 0:
            return True
        if n != 1 and s != acc:
            return False
        acc *= n
    return True


def expect(x, name: str, dtype: Union[int, Tuple[int, ...], None] = None, *,
           shape: Optional[Sequence[Optional[int]]] = None, rows: Optional[int] = None,
           cols: Optional[int] = None, matrix: bool = False, size: Optional[int] = None,
           packed: bool = False, like: Optional[ArrayView] = None) -> Optional[ArrayView]:
    """The view of `x` (an array or its view; None passes through) after checking it against what
    the call tells the library about it, else a HeadlossError naming `name`, its value and what
    was expected (nothing is written before the checks pass):

      like:   the same memory (the host, or the same GPU) as that view    (HeadlossTypeError)
      dtype:  an hl_dtype_t, or a tuple of those                          (HeadlossTypeError)
      shape:  exactly this shape (None: any extent in that place)         (HeadlossValueError ...)
      rows, cols, matrix: the array as a matrix [rows, cols], leading dimensions flattened, the
              last contiguous (None: any); sets .rows and .stride (its row stride)
      size:   this many elements, packed (a per-row array: the library takes no stride for it)
      packed: contiguous, row-major.
    A few integer comparisons: no copy, no device synchronisation.
    """
    if x is None:
        return None
    v = x if isinstance(x, ArrayView) else view(x, name)
    if like is not None and (v.backend != like.backend or  # a device of -1: not known (a generic producer)
                             (v.device != like.device and min(v.device, like.device) >= 0)):
        raise HeadlossTypeError(f"{name} is in {_place(v)} but {like.name} is in {_place(like)}; "
                                "pass them on one device")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if v.dtype not in allowed:
            names = [DTYPE_NAMES[d] for d in allowed]
            want = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
            raise HeadlossTypeError(f"{name} is {dtype_label(v.dtype)}; expected {want}")
    if shape is not None and (len(v.shape) != len(shape) or
                              any(n is not None and n != m for n, m in zip(shape, v.shape))):
        raise HeadlossValueError(f"{name} has shape {_dims(v.shape)}; expected {_dims(shape)}")
    if size is not None:
        n = math.prod(v.shape)
        if n != size:
            raise HeadlossValueError(f"{name} has {n} elements (shape {_dims(v.shape)}); expected {size}")
        packed = True
    if packed and not _is_packed(v):
        raise HeadlossValueError(f"{name} (shape {_dims(v.shape)}, strides {list(v.strides)}) must be "
                                 "contiguous")
    if matrix or rows is not None or cols is not None:
        r, c, v.stride = v.rows_view(name)
        v.rows = r
        if (rows is not None and r != rows) or (cols is not None and c != cols):
            raise HeadlossValueError(f"{name} is {_dims((r, c))} as rows x columns (shape {_dims(v.shape)}); "
                                     f"expected {_dims((rows, cols))}")
    return v
