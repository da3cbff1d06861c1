"""A few RMSNorm forward calls, ours and Liger's Triton kernel, on the same x and y: the target for
ncu (`ncu --clock-control none --metrics ... -k regex:"rmsnorm_fwd|_rms_norm_forward" python3
bench/experiments/one_rmsnorm.py 8192 16384`)."""
import sys

import torch
from liger_kernel.ops.rms_norm import _rms_norm_forward_kernel, _str_to_casting_mode, calculate_settings

import headloss

EPS = 1e-6


def liger_fwd(x, w, y, rstd):
    """Liger's Triton forward kernel (llama casting) writing into the given y and rstd, which its
    public function allocates itself."""
    bs, nw = calculate_settings(x.shape[1])
    _rms_norm_forward_kernel[(x.shape[0],)](y, y.stride(0), x, x.stride(0), w, w.stride(0), rstd, rstd.stride(0),
                                            x.shape[1], EPS, 0.0, _str_to_casting_mode["llama"],
                                            elementwise_affine=True, BLOCK_SIZE=bs, num_warps=nw)


M, N = int(sys.argv[1]), int(sys.argv[2])
x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
y = torch.empty_like(x)
rstd = torch.empty(M, device="cuda", dtype=torch.float32)
for _ in range(2):
    headloss.rmsnorm_fwd(x, w, eps=EPS, out=y)
    liger_fwd(x, w, y, rstd)
torch.cuda.synchronize()
