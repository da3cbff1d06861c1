"""Shared fixtures: the package import path, seeded random generators, and GPU access.

GPU tests take the `gpu` fixture: it yields a small adapter over PyTorch (or CuPy) when the
library's CUDA backend and a GPU framework are both present, and skips with the reason otherwise.
"""
import os
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HEADLOSS_LIBRARY", str(ROOT / "lib" / "libheadloss.so"))

import headloss  # noqa: E402


@pytest.fixture
def rng(request):
    # A seed per test, derived from its name (crc32: stable across processes, unlike hash()), so
    # inputs differ between tests and a failure reproduces; HL_TEST_SEED draws a fresh set.
    seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("HL_TEST_SEED", "0"))
    return np.random.default_rng(seed)


class Gpu:
    """Moves NumPy arrays to the GPU and back through PyTorch (preferred) or CuPy."""

    def __init__(self):
        try:
            import torch
            if not torch.cuda.is_available():
                raise ImportError
            self.torch, self.cupy = torch, None
        except ImportError:
            import cupy
            self.torch, self.cupy = None, cupy

    def put(self, a: np.ndarray):
        a = np.ascontiguousarray(a)
        if self.torch is not None:
            if a.dtype.name == "bfloat16":  # torch cannot read ml_dtypes arrays: go through int16
                return self.torch.from_numpy(a.view(np.int16).copy()).view(self.torch.bfloat16).cuda()
            return self.torch.from_numpy(a).cuda()
        return self.cupy.asarray(a)

    def empty_like_poisoned(self, shape, dtype_name: str):
        """An uninitialised device array filled with NaN, so unwritten elements show."""
        if self.torch is not None:
            return self.torch.full(shape, float("nan"), dtype=getattr(self.torch, dtype_name), device="cuda")
        return self.cupy.full(shape, np.nan, dtype=dtype_name)

    def get(self, x) -> np.ndarray:
        if self.torch is not None:
            x = x.detach()
            if x.dtype == self.torch.bfloat16:
                x = x.float()
            return x.cpu().numpy().astype(np.float64)
        return self.cupy.asnumpy(x).astype(np.float64)


@pytest.fixture(scope="session")
def gpu():
    if not headloss.cuda_available():
        pytest.skip("no GPU: the library's CUDA backend is unavailable on this machine")
    try:
        return Gpu()
    except ImportError:
        pytest.skip("no GPU array library (PyTorch with CUDA, or CuPy) to move data")
