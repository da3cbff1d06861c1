"""RMSNorm forward and backward, headloss against PyTorch (eager, F.rms_norm, torch.compile) and
Liger, side by side in one run (bf16, llama casting, weight). Bandwidth counts x read + y
written (forward) and x, dy read + dx written (backward); % is of the measured copy bandwidth (2 GB
buffers), and "same-bytes copy" is a copy moving the call's own bytes, timed the same way: what a
plain copy reaches at that size (the backward's copy reads half its bytes, the kernel two thirds).
--residual: the fused residual add instead (s = x + r normalised; forward x, r read + y, s written;
backward dy, s and the gradient of s read + dx written), against Liger's fused add."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch._functorch.config
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import headloss  # noqa: E402
from common import compile_per_shape, copy_bandwidth_gbs, copy_ms, header, median_ms, table  # noqa: E402

SHAPES = [(262144, 128), (131072, 256), (32768, 4096), (8192, 16384), (4096, 4096),
          (65536, 2048), (1024, 4096)]
EPS = 1e-6
QUICK = FWD_ONLY = FLUSH_L2 = RESIDUAL = False


def eager(x, w):
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (xf * r).to(x.dtype) * w


def eager_add(x, r, w):
    s = x + r
    return eager(s, w), s


torch._functorch.config.donated_buffer = False  # the backward is timed repeatedly
compiled = compile_per_shape(eager)
compiled_add = compile_per_shape(eager_add)

try:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
except Exception as e:  # noqa: BLE001
    print(f"liger unavailable: {e}")
    LigerRMSNormFunction = None
try:
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
except Exception:  # noqa: BLE001
    LigerFusedAddRMSNormFunction = None


def sets_for(nbytes_one: int) -> int:
    """How many input sets to rotate through so that they do not all sit in L2 (50 MB)."""
    return max(1, min(8, -(-200_000_000 // max(nbytes_one, 1))))


def timed(fns, what, rotate):
    """Median times of those of fns that run (a peer may refuse a shape), one after another. With
    --flush-l2, a read of 256 MB before each call leaves L2 holding nothing of the inputs and no
    dirty lines of the previous call's outputs."""
    if FLUSH_L2:
        scratch = torch.ones(64 << 20, device="cuda")
        inner = rotate
        rotate = lambda: (inner(), scratch.sum())  # noqa: E731
    res = {}
    for name, fn in fns.items():
        try:
            res[name] = median_ms(fn, rotate=rotate)
        except Exception as e:  # noqa: BLE001
            print(f"{name} {what} failed: {e}")
    return res


class Inputs:
    """n random bf16 [M, N] tensors a set, in as many sets as keep the timed calls from finding them in
    L2, and the weight. rot() moves to the next set; at(j) is a function giving tensor j of the
    current set."""

    def __init__(self, M, N, n):
        self.sets = [[torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
                     for _ in range(sets_for(n * M * N * 2))]
        self.w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
        self.i = 0

    def rot(self):
        self.i = (self.i + 1) % len(self.sets)

    def at(self, j):
        return lambda: self.sets[self.i][j]

    def peer_backward(self, f, leaves, grads):
        """A call of a peer's own backward: f(*tensors `leaves` of a set, weight) recorded once a set,
        then the current set's tensors `grads` backpropagated through it."""
        wg = self.w.clone().requires_grad_(True)
        ins = [[s[j].clone().requires_grad_(True) for j in leaves] for s in self.sets]
        outs = [f(*a, wg) for a in ins]
        return lambda: torch.autograd.grad(outs[self.i], (*ins[self.i], wg),
                                           tuple(self.sets[self.i][j] for j in grads), retain_graph=True)


def bench_shape(M, N):
    """Forward and backward times at one shape (x and dy a set), and the bytes each moves."""
    if RESIDUAL:
        return bench_shape_residual(M, N)
    inp = Inputs(M, N, 2)
    x, dy, w = inp.at(0), inp.at(1), inp.w
    y = torch.empty_like(x())
    rstd = torch.empty(M, device="cuda", dtype=torch.float32)
    fwd = {
        "headloss": lambda: headloss.rmsnorm_fwd(x(), w, eps=EPS, out=y),
        "headloss+rstd": lambda: headloss.rmsnorm_fwd(x(), w, eps=EPS, out=y, rstd=rstd),
    }
    if not QUICK:
        fwd.update({"torch eager": lambda: eager(x(), w), "F.rms_norm": lambda: F.rms_norm(x(), (N,), w, EPS),
                    "torch.compile": lambda: compiled(x(), w)})
    if LigerRMSNormFunction is not None:
        fwd["liger"] = lambda: LigerRMSNormFunction.apply(x(), w, EPS, 0.0, "llama")
    fwd_bytes = 2 * M * N * 2
    res = timed(fwd, f"fwd {M}x{N}", inp.rot)
    if FWD_ONLY:
        return res, fwd_bytes, {}, 0
    # Backward: ours from a saved rstd; peers through autograd (their own backward kernels).
    dx = torch.empty_like(y)
    dw = torch.empty(N, device="cuda", dtype=torch.float32)
    bwd = {"headloss": lambda: headloss.rmsnorm_bwd(dy(), x(), w, rstd, eps=EPS, dx=dx, dw=dw)}
    if not QUICK:
        bwd["torch.compile"] = inp.peer_backward(compiled, [0], [1])
    if "liger" in res:  # Liger refuses rows past 64K columns
        bwd["liger"] = inp.peer_backward(lambda a, wg: LigerRMSNormFunction.apply(a, wg, EPS, 0.0, "llama"), [0], [1])
    bres = timed(bwd, f"bwd {M}x{N}", inp.rot)
    bwd_bytes = 3 * M * N * 2
    return res, fwd_bytes, bres, bwd_bytes


def bench_shape_residual(M, N):
    """bench_shape for the fused residual add: each call normalises s = x + r and returns y and s;
    its backward takes dy and ds (the gradient flowing into s) and gives dx (= dr) and dw."""
    inp = Inputs(M, N, 4)
    x, r, dy, ds, w = inp.at(0), inp.at(1), inp.at(2), inp.at(3), inp.w
    y, s = torch.empty_like(x()), torch.empty_like(x())
    rstd = torch.empty(M, device="cuda", dtype=torch.float32)
    fwd = {
        "headloss": lambda: headloss.rmsnorm_fwd(x(), w, eps=EPS, residual=r(), out=y, residual_out=s),
        "headloss+rstd": lambda: headloss.rmsnorm_fwd(x(), w, eps=EPS, residual=r(), out=y, residual_out=s,
                                                      rstd=rstd),
    }
    if not QUICK:
        fwd.update({"torch eager": lambda: eager_add(x(), r(), w), "torch.compile": lambda: compiled_add(x(), r(), w)})
    if LigerFusedAddRMSNormFunction is not None:
        fwd["liger"] = lambda: LigerFusedAddRMSNormFunction.apply(x(), r(), w, EPS, 0.0, "llama")
    res = timed(fwd, f"fwd {M}x{N} residual", inp.rot)
    if FWD_ONLY:
        return res, 4 * M * N * 2, {}, 0
    dx = torch.empty_like(y)
    dw = torch.empty(N, device="cuda", dtype=torch.float32)
    bwd = {"headloss": lambda: headloss.rmsnorm_bwd(dy(), s, w, rstd, eps=EPS, dresidual_out=ds(), dx=dx, dw=dw)}
    if not QUICK:
        bwd["torch.compile"] = inp.peer_backward(compiled_add, [0, 1], [2, 3])
    if "liger" in res:
        bwd["liger"] = inp.peer_backward(
            lambda a, b, wg: LigerFusedAddRMSNormFunction.apply(a, b, wg, EPS, 0.0, "llama"), [0, 1], [2, 3])
    bres = timed(bwd, f"bwd {M}x{N} residual", inp.rot)
    return res, 4 * M * N * 2, bres, 4 * M * N * 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    ap.add_argument("--quick", action="store_true", help="Liger as the only peer (no torch.compile)")
    ap.add_argument("--flush-l2", action="store_true", help="read 256 MB before each timed call")
    ap.add_argument("--fwd-only", action="store_true", help="the forward alone (kernel A/B runs)")
    ap.add_argument("--shapes", default=None, help="MxN,... (default: the issue's shapes)")
    ap.add_argument("--residual", action="store_true", help="the fused residual add (see the docstring)")
    args = ap.parse_args()
    global QUICK, FWD_ONLY, FLUSH_L2, RESIDUAL
    QUICK, FWD_ONLY, FLUSH_L2, RESIDUAL = args.quick, args.fwd_only, args.flush_l2, args.residual
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
    headloss.rmsnorm(torch.randn(8, 64, device="cuda"))  # load the module before timing
    bw = copy_bandwidth_gbs()
    lines = [f"# RMSNorm benchmark\n\n{header()}, copy bandwidth {bw:.0f} GB/s (read + write)\n"]
    fwd_rows, bwd_rows = [], []

    def same(ms, nbytes):
        """A copy moving the call's bytes: its time, and the call's speed as % of the copy's (not
        timed with --flush-l2, whose calls start from a clean L2)."""
        if FLUSH_L2:
            return "-"
        c = copy_ms(nbytes, sets_for(nbytes))
        return f"{c * 1e3:.1f} ({100 * c / ms:.0f}%)"

    for M, N in shapes:
        res, fb, bres, bb = bench_shape(M, N)
        ours = res["headloss"]
        peers = {k: v for k, v in res.items() if not k.startswith("headloss")}
        best = min(peers, key=peers.get) if peers else None
        gbs = lambda ms: fb / ms / 1e6  # noqa: E731
        fwd_rows.append([f"{M}x{N}", f"{ours * 1e3:.1f}", f"{gbs(ours):.0f} ({100 * gbs(ours) / bw:.0f}%)",
                         same(ours, fb), f"{res['headloss+rstd'] * 1e3:.1f}"] +
                        [f"{gbs(res[k]):.0f}" if k in res else "-" for k in
                         ["torch eager", "F.rms_norm", "torch.compile", "liger"]] +
                        [f"{peers[best] / ours:.2f}x ({best})" if best else "-"])
        if FWD_ONLY:
            continue
        bours = bres["headloss"]
        bgbs = lambda ms: bb / ms / 1e6  # noqa: E731
        bpeers = {k: v for k, v in bres.items() if k != "headloss"}
        bbest = min(bpeers, key=bpeers.get) if bpeers else None
        bwd_rows.append([f"{M}x{N}", f"{bours * 1e3:.1f}", f"{bgbs(bours):.0f} ({100 * bgbs(bours) / bw:.0f}%)",
                         same(bours, bb)] +
                        [f"{bgbs(bres[k]):.0f}" if k in bres else "-" for k in ["torch.compile", "liger"]] +
                        [f"{bpeers[bbest] / bours:.2f}x ({bbest})" if bbest else "-"])
    what = ", fused residual add" if RESIDUAL else ""
    lines.append(f"## Forward (bf16, weight, llama casting{what}, no rstd store unless noted)\n")
    lines.append(table(fwd_rows, ["M x N", "headloss us", "headloss GB/s (% copy)",
                                  "same-bytes copy us (headloss %)", "headloss+rstd us",
                                  "eager GB/s", "F.rms_norm GB/s", "compile GB/s", "liger GB/s",
                                  "best peer / headloss"]))
    if bwd_rows:
        lines.append("\n## Backward (dx and dw; bytes: " +
                     ("s, dy, ds read + dx written)\n" if RESIDUAL else "x, dy read + dx written)\n"))
        lines.append(table(bwd_rows, ["M x N", "headloss us", "headloss GB/s (% copy)",
                                      "same-bytes copy us (headloss %)", "compile GB/s",
                                      "liger GB/s", "best peer / headloss"]))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
