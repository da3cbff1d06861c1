"""Each GPU kernel of one RMSNorm forward or backward call, ours beside torch.compile's and Liger's: the
call's median time (CUDA events) and every kernel's time under torch.profiler (CUPTI), inputs reused (so
held in L2 up to its size). Usage: kernel_times.py fwd|bwd MxN ... (before 39fd4e1: our 1024 x 4096 backward
kernel took 24 us against Liger's 8.5, which led to the partial dw rows' stores)."""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_rmsnorm import EPS, LigerRMSNormFunction, compiled  # noqa: E402
from common import median_ms  # noqa: E402

import headloss  # noqa: E402


def kernels(fn, n=20):
    """(us per call, launches per call, name) of each kernel fn runs, longest first."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = [(e.self_device_time_total / n, e.count // n, e.key[:90]) for e in prof.key_averages()
           if e.self_device_time_total > 0]
    return sorted(out, reverse=True)


def calls(which, M, N):
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    rstd, dw = torch.empty(M, device="cuda"), torch.empty(N, device="cuda")
    headloss.rmsnorm_fwd(x, w, eps=EPS, out=y, rstd=rstd)
    if which == "fwd":
        fns = {"headloss": lambda: headloss.rmsnorm_fwd(x, w, eps=EPS, out=y), "torch.compile": lambda: compiled(x, w)}
        if LigerRMSNormFunction is not None:
            fns["liger"] = lambda: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama")
        return fns
    wg, xg = w.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_c = compiled(xg, wg)
    fns = {"headloss": lambda: headloss.rmsnorm_bwd(dy, x, w, rstd, eps=EPS, dx=dx, dw=dw),
           "torch.compile": lambda: torch.autograd.grad(out_c, (xg, wg), dy, retain_graph=True)}
    if LigerRMSNormFunction is not None:
        out_l = LigerRMSNormFunction.apply(xg, wg, EPS, 0.0, "llama")
        fns["liger"] = lambda: torch.autograd.grad(out_l, (xg, wg), dy, retain_graph=True)
    return fns


def main():
    which = sys.argv[1]
    for shape in sys.argv[2:]:
        M, N = map(int, shape.split("x"))
        print(f"\n## {which} {M}x{N}")
        for name, fn in calls(which, M, N).items():
            print(f"{name}: {median_ms(fn, iters=30) * 1e3:.1f} us a call")
            for t, c, k in kernels(fn):
                print(f"    {t:8.2f} us x{c}  {k}")


if __name__ == "__main__":
    main()
