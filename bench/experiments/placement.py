"""Does the output's place in memory, relative to the input, move a bandwidth-bound kernel's time?
The RMSNorm forward (ours, Liger's Triton kernel called with the same output buffer) and a plain
copy, with y at several offsets inside one pool, x fixed. Usage: placement.py [MxN ...]
(default: 8192x16384 65536x2048 32768x4096, bf16)."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import median_ms  # noqa: E402

import headloss  # noqa: E402

try:
    from liger_kernel.ops.rms_norm import _rms_norm_forward_kernel, _str_to_casting_mode, calculate_settings
except Exception as e:  # noqa: BLE001
    print(f"liger unavailable: {e}")
    _rms_norm_forward_kernel = None

EPS = 1e-6


def liger_fwd(x, w, y, rstd):
    """Liger's Triton forward kernel (llama casting) writing into the given y and rstd, which its
    public function allocates itself."""
    bs, nw = calculate_settings(x.shape[1])
    _rms_norm_forward_kernel[(x.shape[0],)](y, y.stride(0), x, x.stride(0), w, w.stride(0), rstd, rstd.stride(0),
                                            x.shape[1], EPS, 0.0, _str_to_casting_mode["llama"],
                                            elementwise_affine=True, BLOCK_SIZE=bs, num_warps=nw)


OFFSETS = [0, 4 << 10, 64 << 10, 1 << 20, 2 << 20, 6 << 20, 34 << 20, 130 << 20, 258 << 20, 514 << 20]


def run(M, N):
    nbytes = M * N * 2
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
    rstd = torch.empty(M, device="cuda", dtype=torch.float32)
    pool = torch.empty(nbytes + OFFSETS[-1], device="cuda", dtype=torch.uint8)
    print(f"\n{M}x{N} bf16: x at {x.data_ptr():#x}, pool at {pool.data_ptr():#x}; us (GB/s)")
    print("| y offset | headloss | liger kernel | copy | liger / headloss |")
    print("|---|---|---|---|---|")
    for off in OFFSETS:
        y = pool[off:off + nbytes].view(torch.bfloat16).view(M, N)
        t = {"ours": median_ms(lambda: headloss.rmsnorm_fwd(x, w, eps=EPS, out=y), iters=30)}
        if _rms_norm_forward_kernel is not None:
            t["liger"] = median_ms(lambda: liger_fwd(x, w, y, rstd), iters=30)
        t["copy"] = median_ms(lambda: y.copy_(x), iters=30)
        g = {k: 2 * nbytes / v / 1e6 for k, v in t.items()}
        cell = lambda k: f"{t[k] * 1e3:.1f} ({g[k]:.0f})" if k in t else "-"  # noqa: E731
        ratio = f"{t['ours'] / t['liger']:.3f}" if "liger" in t else "-"
        print(f"| {off >> 10} KB | {cell('ours')} | {cell('liger')} | {cell('copy')} | {ratio} |", flush=True)
    del pool, x


if __name__ == "__main__":
    shapes = sys.argv[1:] or ["8192x16384", "65536x2048", "32768x4096"]
    for s in shapes:
        run(*map(int, s.split("x")))
