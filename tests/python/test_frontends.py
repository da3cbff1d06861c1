"""The Python front end's array handling: each array kind that is importable (NumPy always;
objects speaking only DLPack; PyTorch, CuPy and JAX where present), streams, device checks and the
error path (HeadlossError carrying the library's message)."""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import numpy as np
import pytest

import headloss
from headloss import _arrays
from headloss._lib import BACKEND_CPU, BACKEND_CUDA, DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_I64

EPS = 1e-5


def ref(x, w):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w.astype(np.float64)


def draw(rng, rows=6, cols=40):
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    return x, w


class DLPackOnly:
    """An array that offers nothing but the DLPack protocol."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def _torch():
    try:
        import torch
    except ImportError:
        pytest.skip("PyTorch is not installed")
    return torch


def _torch_cuda():
    torch = _torch()
    if not (torch.cuda.is_available() and headloss.cuda_available()):
        pytest.skip("no GPU (PyTorch CUDA and the library's CUDA backend are both needed)")
    return torch


# ---- NumPy and DLPack on the host ----------------------------------------------------------------

def test_numpy(rng):
    x, w = draw(rng)
    y = headloss.rmsnorm(x, w, eps=EPS)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32
    np.testing.assert_allclose(y, ref(x, w), rtol=1e-5, atol=1e-6)


def test_dlpack_only_host_object(rng):
    x, w = draw(rng)
    v = _arrays.view(DLPackOnly(x), "x")
    assert (v.kind, v.backend, v.shape, v.strides, v.dtype) == ("dlpack", BACKEND_CPU, x.shape, (40, 1), DTYPE_F32)
    assert v.ptr == x.__array_interface__["data"][0]
    y = np.full_like(x, np.nan)
    headloss.rmsnorm_fwd(DLPackOnly(x), DLPackOnly(w), eps=EPS, out=y)
    np.testing.assert_allclose(y, ref(x, w), rtol=1e-5, atol=1e-6)


def test_dlpack_strided_and_int(rng):
    a = np.zeros((4, 10), np.float16)[:, :7]
    v = _arrays.view(DLPackOnly(a), "a")
    assert v.shape == (4, 7) and v.strides == (10, 1) and v.dtype == DTYPE_F16
    assert _arrays.view(DLPackOnly(np.zeros(3, np.int64)), "i").dtype == DTYPE_I64
    with pytest.raises(headloss.HeadlossTypeError, match=r"d is DLPack dtype \(code 2, 64 bits, 1 lanes\); "
                       "expected float32, float16 or bfloat16"):
        _arrays.expect(DLPackOnly(np.zeros(3, np.float64)), "d", _arrays.FLOATS)


def test_dtype_codes():
    assert _arrays.dtype_code(np.dtype("float32")) == DTYPE_F32
    assert _arrays.dtype_code("bf16") == DTYPE_BF16
    assert _arrays.dtype_code(np.float16) == DTYPE_F16
    with pytest.raises(headloss.HeadlossTypeError, match="out_dtype is float64; expected one of float32"):
        _arrays.dtype_code(np.dtype("float64"), "out_dtype")


def test_unknown_kind_is_a_type_error():
    with pytest.raises(TypeError, match="unsupported array type"):
        headloss.rmsnorm([[1.0, 2.0]])


def test_lazy_stream_is_read_once():
    calls = []
    v = _arrays.ArrayView(None, "torch", 0, (1,), (1,), DTYPE_F32, BACKEND_CUDA,
                          lambda: calls.append(1) or 1234, 0)
    assert calls == []
    assert v.stream == 1234 and v.stream == 1234 and calls == [1]


def test_place_checks():
    host = _arrays.ArrayView(None, "numpy", 0, (1,), (1,), DTYPE_F32, BACKEND_CPU, 0, -1, "x")
    gpu0 = _arrays.ArrayView(None, "torch", 0, (1,), (1,), DTYPE_F32, BACKEND_CUDA, 0, 0, "y")
    gpu1 = _arrays.ArrayView(None, "torch", 0, (1,), (1,), DTYPE_F32, BACKEND_CUDA, 0, 1, "z")
    with pytest.raises(headloss.HeadlossTypeError, match="y is in cuda:0 but x is in host memory"):
        _arrays.expect(gpu0, "y", like=host)
    with pytest.raises(TypeError, match="z is in cuda:1 but y is in cuda:0"):
        _arrays.expect(gpu1, "z", like=gpu0)
    assert _arrays.expect(gpu0, "y", like=gpu0) is gpu0
    generic = _arrays.ArrayView(None, "cai", 0, (1,), (1,), DTYPE_F32, BACKEND_CUDA, 0, -1, "w")
    assert _arrays.expect(generic, "w", like=gpu1) is generic  # its device is not known: not refused


def test_library_error_carries_message(rng):
    x, _ = draw(rng)
    with pytest.raises(headloss.HeadlossError) as e:
        headloss.rmsnorm(x, None, eps=-1.0)
    assert e.value.status == 1  # HL_STATUS_INVALID_VALUE
    assert "eps is -1" in str(e.value)


def test_python_side_errors(rng):
    x, w = draw(rng)
    with pytest.raises(headloss.HeadlossValueError, match="cast is 'llama2'; expected one of 'llama'"):
        headloss.rmsnorm(x, w, cast="llama2")
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        headloss.rmsnorm(np.asfortranarray(x), w)
    with pytest.raises(headloss.HeadlossTypeError, match="x is float64; expected float32, float16 or bfloat16"):
        headloss.rmsnorm(x.astype(np.float64), w)


# ---- PyTorch -------------------------------------------------------------------------------------

def test_torch_cpu(rng):
    torch = _torch()
    x, w = draw(rng)
    y = headloss.rmsnorm(torch.from_numpy(x), torch.from_numpy(w), eps=EPS)
    assert isinstance(y, torch.Tensor) and y.device.type == "cpu"
    np.testing.assert_allclose(y.numpy(), ref(x, w), rtol=1e-5, atol=1e-6)


def test_torch_cuda_current_stream(rng):
    torch = _torch_cuda()
    x, w = draw(rng, 512, 1024)
    wt = torch.from_numpy(w).cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert _arrays.view(wt, "w").stream == s.cuda_stream
        # x is produced on s by a long chain of kernels; the call must queue behind them on s.
        xt = torch.from_numpy(x).cuda()
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            big = torch.tanh(big @ big)
        xt = xt + 0 * big[:512, :1024]
        y = headloss.rmsnorm(xt, wt, eps=EPS)
    s.synchronize()
    np.testing.assert_allclose(y.cpu().numpy(), ref(x, w), rtol=1e-5, atol=1e-5)
    assert _arrays.view(wt, "w").stream == torch.cuda.current_stream().cuda_stream


def test_torch_cuda_dlpack_only(rng):
    torch = _torch_cuda()
    x, w = draw(rng)
    xt, wt = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
    v = _arrays.view(DLPackOnly(xt), "x")
    assert (v.kind, v.backend, v.device, v.ptr) == ("dlpack", BACKEND_CUDA, xt.get_device(), xt.data_ptr())
    y = torch.full_like(xt, float("nan"))
    headloss.rmsnorm_fwd(DLPackOnly(xt), wt, eps=EPS, out=y)
    np.testing.assert_allclose(y.cpu().numpy(), ref(x, w), rtol=1e-5, atol=1e-6)


def test_torch_host_and_device_mixed(rng):
    torch = _torch_cuda()
    x, w = draw(rng)
    with pytest.raises(headloss.HeadlossTypeError, match="weight is in host memory but x is in cuda:0"):
        headloss.rmsnorm(torch.from_numpy(x).cuda(), torch.from_numpy(w), eps=EPS)


def test_torch_two_gpus(rng):
    torch = _torch_cuda()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    x, w = draw(rng)
    with pytest.raises(headloss.HeadlossTypeError, match="weight is in cuda:1 but x is in cuda:0"):
        headloss.rmsnorm(torch.from_numpy(x).to("cuda:0"), torch.from_numpy(w).to("cuda:1"))


# ---- CuPy ----------------------------------------------------------------------------------------

def test_cupy_stream(rng):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    if not headloss.cuda_available():
        pytest.skip("no GPU: the library's CUDA backend is unavailable")
    x, w = draw(rng)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        xc, wc = cupy.asarray(x), cupy.asarray(w)
        assert _arrays.view(xc, "x").stream == s.ptr
        y = headloss.rmsnorm(xc, wc, eps=EPS)
    s.synchronize()
    np.testing.assert_allclose(cupy.asnumpy(y), ref(x, w), rtol=1e-5, atol=1e-6)


# ---- JAX through ctypes (inputs only: JAX arrays are immutable) ----------------------------------

def test_jax_cpu_arrays(rng):
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    x, w = draw(rng)
    cpu = jax.devices("cpu")[0]
    y = headloss.rmsnorm(jax.device_put(x, cpu), jax.device_put(w, cpu), eps=EPS)
    np.testing.assert_allclose(np.asarray(y), ref(x, w), rtol=1e-5, atol=1e-6)


def test_jax_gpu_arrays_into_torch_output(rng):
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    torch = _torch_cuda()
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")
    x, w = draw(rng)
    xj, wj = jax.device_put(x, gpu), jax.device_put(w, gpu)
    v = _arrays.view(xj, "x")
    assert v.backend == BACKEND_CUDA and v.kind == "jax" and v.shape == x.shape
    y = torch.full(x.shape, float("nan"), device="cuda")
    torch.cuda.synchronize()
    headloss.rmsnorm_fwd(xj, wj, eps=EPS, out=y)
    torch.cuda.synchronize()
    np.testing.assert_allclose(y.cpu().numpy(), ref(x, w), rtol=1e-5, atol=1e-6)


# ---- the loss plans read bare pointers: arrays of another dtype or layout are refused --------------

@pytest.mark.parametrize("mutate, err, msg", [
    (lambda a: a.update(logits=a["logits"].astype(np.float16)), TypeError, "logits is float16; expected float32"),
    (lambda a: a.update(labels=a["labels"].astype(np.int32)), TypeError, "labels is int32; expected int64"),
    (lambda a: a.update(labels=np.repeat(a["labels"], 2)[::2]), ValueError, "labels .* must be contiguous"),
    (lambda a: a.update(weights=np.ones(6, np.float16)), TypeError, "weights is float16"),
    (lambda a: a.update(scalars=np.zeros(len(headloss.loss.SCALARS), np.float16)), TypeError, "scalars is float16"),
    (lambda a: a.update(grad=np.zeros((6, 10), np.float16)), TypeError, "grad is float16"),
])
def test_loss_plan_refuses_misread_arrays(rng, mutate, err, msg):
    a = dict(logits=rng.standard_normal((6, 10)).astype(np.float32), labels=np.arange(6, dtype=np.int64))
    mutate(a)
    with pytest.raises(err, match=msg):
        headloss.LossPlan(10, "float32")(a.pop("logits"), a.pop("labels"), **a)


@pytest.mark.parametrize("name, bad, msg", [
    ("hidden", np.zeros((6, 8), np.float16), "hidden is float16; expected float32"),
    ("weight", np.zeros((10, 8), np.float16), "weight is float16"),
    ("grad_weight", np.zeros((10, 8), np.float16), "grad_weight is float16; expected float32"),
    ("labels", np.arange(12, dtype=np.int64)[::2], "must be contiguous"),
])
def test_linear_loss_plan_refuses_misread_arrays(rng, name, bad, msg):
    a = dict(hidden=rng.standard_normal((6, 8)).astype(np.float32),
             weight=rng.standard_normal((10, 8)).astype(np.float32), labels=np.arange(6, dtype=np.int64))
    a[name] = bad
    with pytest.raises((TypeError, ValueError), match=msg):
        headloss.LinearLossPlan(10, 8, "float32")(a.pop("hidden"), a.pop("weight"), a.pop("labels"), **a)
