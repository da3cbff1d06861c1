"""Benchmark of the per-token outputs with a backward (headloss.torch_tokens.linear_token_logprobs:
logp, entropy and lse from hidden states and the head's weight) against its floor, measured in the
same run: one cuBLAS product (logits = X W^T) for a forward alone (the "old / reference log-probs"
call, under no_grad), four for forward + backward (the logits formed again in backward, then
dX = G W and dW = G^T X). The issue's bars: forward <= 1.10x one product, forward + backward <=
1.08x four. Also the peak device memory above the inputs and the gradients, against the workspace
the call takes (the bar: no more than it).

Rows: N x H x V, bf16 hidden and weight, temperature 0.7; upstream gradients "logp" (logp and lse:
the shifted path on a 9.0 GPU) or "logp+entropy" (the entropy's too: the row pass).

Usage: python3 bench/bench_token_logprobs.py [--out table.md] [--shapes 8192x4096x128256,...] [--iters 10]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from headloss.loss import DEFAULT_MAX_WORKSPACE_BYTES  # noqa: E402
from headloss.torch_tokens import linear_token_logprobs  # noqa: E402
from bench_linear_loss import peak_extra_gib  # noqa: E402
from common import header, interleaved_runs, median, paired_ratio, table  # noqa: E402

SHAPES = "8192x4096x128256,32768x4096x128256,16384x8192x151936,4096x2048x262144"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        N, H, V = (int(s) for s in shape.split("x"))
        x = torch.randn(N, H, device="cuda").to(torch.bfloat16).requires_grad_()
        w = (torch.randn(V, H, device="cuda") / H ** 0.5).to(torch.bfloat16).requires_grad_()
        y = torch.randint(0, V, (N,), device="cuda")
        y[::17] = -100
        adv = torch.randn(N, device="cuda")
        z = torch.empty(N, V, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(N, V, device="cuda").to(torch.bfloat16)
        dx, dw = torch.empty_like(x), torch.empty_like(w)

        def one():
            torch.matmul(x.detach(), w.detach().T, out=z)

        def four():
            one()
            one()
            torch.matmul(g, w.detach(), out=dx)
            torch.matmul(g.T, x.detach(), out=dw)

        def forward():
            with torch.no_grad():
                linear_token_logprobs(x, w, y, temperature=0.7)

        def step(entropy):
            def run():
                x.grad = w.grad = None
                logp, ent, _ = linear_token_logprobs(x, w, y, temperature=0.7)
                loss = -(logp * adv).mean() - (1e-3 * ent.mean() if entropy else 0)
                loss.backward()
            return run

        fns = {"one": one, "four": four, "fwd": forward, "logp": step(False), "logp+entropy": step(True)}
        runs = interleaved_runs(fns, iters=args.iters)
        grads = (x.numel() + w.numel()) * 2 / 2**20  # bf16 grad_hidden and grad_weight
        for kind in ("logp", "logp+entropy"):
            extra = peak_extra_gib(fns[kind], x, w) * 1024 - grads
            rows.append([f"{N} x {H} x {V}", kind, f"{median(runs['one']):.2f}", f"{median(runs['fwd']):.2f}",
                         f"{paired_ratio(runs, 'fwd', 'one'):.3f}x", f"{median(runs['four']):.2f}",
                         f"{median(runs[kind]):.2f}", f"{paired_ratio(runs, kind, 'four'):.3f}x",
                         f"{extra:.0f}", f"{DEFAULT_MAX_WORKSPACE_BYTES / 2**20:.0f}"])
        x.grad = w.grad = None
    head = ["N x H x V", "upstream", "1 product (ms)", "forward (ms)", "vs 1", "4 products (ms)",
            "fwd + bwd (ms)", "vs 4", "peak above grads (MiB)", "workspace cap (MiB)"]
    text = header() + "\n\n" + table(rows, head)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
