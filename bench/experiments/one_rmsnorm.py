"""A few RMSNorm forward calls, ours and Liger's Triton kernel, on the same x and y: the target for
ncu (`ncu --clock-control none --metrics ... -k regex:"rmsnorm_fwd|_rms_norm_forward" python3
bench/experiments/one_rmsnorm.py 8192 16384`)."""
import sys

import torch

import headloss
from placement import EPS, liger_fwd

M, N = int(sys.argv[1]), int(sys.argv[2])
x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
y = torch.empty_like(x)
rstd = torch.empty(M, device="cuda", dtype=torch.float32)
for _ in range(2):
    headloss.rmsnorm_fwd(x, w, eps=EPS, out=y)
    liger_fwd(x, w, y, rstd)
torch.cuda.synchronize()
