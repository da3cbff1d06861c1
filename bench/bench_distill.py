"""Benchmark of distillation on logits against its peers on one GPU, side by side in one run.

Rows: N x V, bf16 student and teacher logits, bf16 gradient. Columns: the floor (torch.add of the
student and teacher logits into the gradient's buffer: the bytes any such loss moves, two reads and
one write); headloss CE + each dense divergence (forward KL, reverse KL, JSD at beta 0.5) and its
ratio to the floor; CE + a sparse teacher (its top 64 ids and log-probs, reverse KL); Liger's JSD
(liger-kernel: it takes log-probabilities, so log_softmax of both first; forward + backward) and
torch.compile of CE + JSD from the logits. Times are medians of CUDA-event timings (ms).

Usage: python3 bench/bench_distill.py [--out table.md] [--shapes 8192x128256,...] [--no-compile]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from bench_loss import Direct  # noqa: E402
from common import compile_per_shape, header, median_ms, table  # noqa: E402

SHAPES = "8192x32000,8192x128256,4096x262144"
BETA = 0.5


def torch_ce_jsd(x, u, y):
    """CE + JSD(beta) from logits, as our plan defines it (log m = log((1 - b) p + b q), b on the
    teacher's q), the mean over rows with a label."""
    ls, lt = torch.log_softmax(x.float(), -1), torch.log_softmax(u.float(), -1)
    lm = torch.logaddexp(ls + math.log(1 - BETA), lt + math.log(BETA))
    jsd = (BETA * lt.exp() * (lt - lm) + (1 - BETA) * ls.exp() * (ls - lm)).sum(-1)
    valid = (y >= 0).float()
    ce = -ls.gather(-1, y.clamp(min=0)[:, None])[:, 0]
    return ((ce + jsd) * valid).sum() / valid.sum()


def liger_jsd():
    try:
        from liger_kernel.transformers.jsd import LigerJSD
    except Exception as e:  # noqa: BLE001
        print(f"# Liger JSD unavailable: {type(e).__name__}: {e}", flush=True)
        return None
    jsd = LigerJSD(beta=BETA)
    return lambda x, u: jsd(torch.log_softmax(x.float(), -1), torch.log_softmax(u.float(), -1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    liger = liger_jsd()
    compiled = None if args.no_compile else compile_per_shape(torch_ce_jsd)
    head = ["N x V", "floor (2 reads + 1 write)", "CE + fwd KL", "vs floor", "CE + rev KL", "vs floor",
            "CE + JSD", "vs floor", "CE + top-64 rev KL", "Liger JSD", "vs our CE + JSD",
            "torch.compile CE + JSD", "vs ours"]
    rows = []
    f = lambda t: "n/a" if t is None else f"{t:.3f}"  # noqa: E731
    r = lambda a, b: "n/a" if a is None or b is None else f"{a / b:.2f}x"  # noqa: E731
    for shape in args.shapes.split(","):
        N, V = map(int, shape.split("x"))
        x = (torch.randn(N, V, device="cuda") * 2).to(torch.bfloat16)
        u = (torch.randn(N, V, device="cuda") * 2).to(torch.bfloat16)
        y = torch.randint(0, V, (N,), device="cuda")
        y[::17] = -100
        g = torch.empty_like(x)
        t_floor = median_ms(lambda: torch.add(x, u, out=g))
        del g
        t = {}
        for name in ("fwd", "rev", "jsd"):
            run = Direct(x, y, ("ce", f"distill_{name}"), {"teacher_logits": u}, **({"jsd_beta": BETA} if name == "jsd" else {}))
            t[name] = median_ms(run, iters=20)
            del run
        lp, ids = torch.log_softmax(u.float(), -1).topk(64, -1)
        run = Direct(x, y, ("ce", "distill_rev"), {"teacher_topk_ids": ids, "teacher_topk_logprobs": lp},
                     teacher_topk=64)
        t["sparse"] = median_ms(run, iters=20)
        del run, lp, ids
        torch.cuda.empty_cache()
        t_liger = t_comp = None
        xg = x.detach().requires_grad_(True)

        def fb(fn):
            def go():
                xg.grad = None
                fn().backward()
            return go
        if liger is not None:
            t_liger = median_ms(fb(lambda: liger(xg, u)), iters=10, warmup=3)
        if compiled is not None:
            fb(lambda: compiled(xg, u, y))()
            t_comp = median_ms(fb(lambda: compiled(xg, u, y)), iters=10, warmup=3)
        del xg
        rows.append([f"{N} x {V}", f"{t_floor:.3f}", f(t["fwd"]), r(t["fwd"], t_floor), f(t["rev"]),
                     r(t["rev"], t_floor), f(t["jsd"]), r(t["jsd"], t_floor), f(t["sparse"]), f(t_liger),
                     r(t_liger, t["jsd"]), f(t_comp), r(t_comp, t["jsd"])])
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
        del x, u
        torch.cuda.empty_cache()
    text = "\n".join([f"{header()}; bf16 logits and teacher logits, bf16 gradient; median ms", "",
                      table(rows, head), "",
                      "vs floor: our time over the floor's. Liger JSD / torch.compile: their time over our CE + JSD "
                      "(>1: we are faster; they compute JSD alone / CE + JSD). Labels unchecked."])
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
