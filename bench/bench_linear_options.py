"""The fused linear CE's options against the same call without them (the bar: 1.02x):
forward + backward of CE at bf16, paired ratios (common.paired_ratio) of the call with one option
over CE alone, each at the plan's fast workspace. Options: class weights (per-token weights
ce_weight[y]), reduction "sum" (D = 1), token scaling, token_argmax, a head bias with grad_bias (the
row path; its ratio to the row path without a bias is the second column), and reduction "none"
(a forward without gradient, then the backward call with the upstream gradient as the weights).

Usage: python3 bench/bench_linear_options.py [--shapes 8192x4096x128256,...] [--iters 10]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear_loss import SHAPES, Direct  # noqa: E402
from common import header, interleaved_runs, paired_ratio, table  # noqa: E402
from headloss import loss as hloss  # noqa: E402


def inputs(N, H, V):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    b = torch.randn(V, device="cuda", generator=g).bfloat16()
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    cw = (torch.rand(V, device="cuda", generator=g) + 0.5)[y].contiguous()
    return x, w, b, y, cw


def biased(x, w, b, y):
    return Direct(x, w, y, ("ce",), extra={"bias": b, "grad_bias": torch.empty_like(b)}, grad_bias="write")


def calls(x, w, b, y, cw):
    N, H, V = x.shape[0], x.shape[1], w.shape[0]
    top = torch.empty(N, device="cuda", dtype=torch.int64)
    fwd = hloss.LinearLossPlan(V, H, "bfloat16", terms=("ce",), device="cuda", check=False, grad_hidden=None,
                               grad_weight=None)
    ws = fwd.workspace(x, N)
    bwd = Direct(x, w, y, ("ce",), extra={"weights": cw})
    bwd.args.divisor = 1.0
    fns = {"ce": Direct(x, w, y, ("ce",)),
           "class weights": Direct(x, w, y, ("ce",), extra={"weights": cw}),
           "sum": Direct(x, w, y, ("ce",)),
           "token scaling": Direct(x, w, y, ("ce",), token_scaling=True),
           "token_argmax": Direct(x, w, y, ("ce",), extra={"token_argmax": top}),
           "bias + grad_bias": biased(x, w, b, y),
           "none (fwd, then bwd)": lambda: (fwd(x, w, y, token_outputs=True, workspace=ws), bwd())}
    fns["sum"].args.divisor = 1.0
    return fns


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    print(header())
    rows = []
    for shape in args.shapes.split(","):
        N, H, V = (int(v) for v in shape.split("x"))
        x, w, b, y, cw = inputs(N, H, V)
        runs = interleaved_runs(calls(x, w, b, y, cw), iters=args.iters)
        os.environ["HEADLOSS_LINEAR_PATH"] = "rows"  # read at plan creation: CE alone on the row path
        on_rows = interleaved_runs({"ce": Direct(x, w, y, ("ce",)), "bias": biased(x, w, b, y)}, iters=args.iters)
        del os.environ["HEADLOSS_LINEAR_PATH"]
        for k in runs:
            if k != "ce":
                rows_ratio = f"{paired_ratio(on_rows, 'bias', 'ce'):.3f}" if k.startswith("bias") else ""
                rows.append([shape, k, f"{paired_ratio(runs, k, 'ce'):.3f}", rows_ratio])
    print(table(rows, ["N x H x V", "option", "x CE alone", "x CE alone on the row path"]))


if __name__ == "__main__":
    main()
