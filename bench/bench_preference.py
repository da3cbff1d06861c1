"""Benchmark of the plan's preference losses (fused linear form) against Liger's chunked preference
losses on one GPU, with the floor measured in the same run: the three products of the same shapes
(logits = X W^T, dX = G W, dW = G^T X through cuBLAS).

Batch: P pairs of chosen and rejected completions of T tokens each (the first T / 8 of every
sequence a prompt, label -100), hidden H, vocabulary V, bf16 hidden and weight; forward + backward
of DPO (sigmoid; no reference model: reference log-probs 0 for us, use_ref_model=False for Liger),
ORPO (with its NLL) and SimPO. headloss runs at the PyTorch front end's default workspace (256 MiB:
the logits formed again in the finish, four products) and at fast_bytes (every row's logits kept:
three). Peak memory: above the inputs during one forward + backward, gradients included.

Usage: python3 bench/bench_preference.py [--out table.md] [--pairs 8] [--tokens 2048] [--hidden 4096]
       [--vocab 128256,151936] [--iters 5]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import headloss  # noqa: E402
from headloss.torch_preference import preference_loss  # noqa: E402
from bench_linear_loss import floor_products, fwd_bwd, peak_extra_gib  # noqa: E402
from common import header, interleaved_ms  # noqa: E402

LOSSES = {"DPO": dict(loss="dpo", beta=0.1), "ORPO": dict(loss="orpo", beta=0.1, nll_weight=1.0),
          "SimPO": dict(loss="simpo", beta=2.0, gamma=0.5)}


def liger_losses() -> dict:
    try:
        from liger_kernel.chunked_loss import (LigerFusedLinearDPOLoss, LigerFusedLinearORPOLoss,
                                               LigerFusedLinearSimPOLoss)
    except Exception as e:  # noqa: BLE001
        print(f"# Liger unavailable: {type(e).__name__}: {e}", flush=True)
        return {}
    return {"DPO": LigerFusedLinearDPOLoss(beta=0.1, use_ref_model=False),
            "ORPO": LigerFusedLinearORPOLoss(beta=0.1), "SimPO": LigerFusedLinearSimPOLoss(beta=2.0, gamma=0.5)}


def first(out):
    """The loss of a call that returns it alone or first in a tuple (Liger's chunked losses)."""
    return out[0] if isinstance(out, tuple) else out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", default="128256,151936")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    P, T, H = args.pairs, args.tokens, args.hidden
    N = 2 * P * T
    liger = liger_losses()
    head = ["V", "loss", "3 products (floor)", "headloss, 256 MiB", "vs floor", "headloss, fast_bytes", "vs floor",
            "Liger chunked", "vs floor", "peak GiB: headloss 256 MiB / fast / Liger"]
    lines = [header() + f"; headloss {headloss.version()}; {P} pairs x 2 x {T} tokens, hidden {H}, bf16; "
             "forward + backward, median ms", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    print("\n".join(lines), flush=True)
    torch.manual_seed(0)
    for V in map(int, args.vocab.split(",")):
        x = torch.randn(N, H, device="cuda").to(torch.bfloat16).requires_grad_()
        w = (torch.randn(V, H, device="cuda") / H ** 0.5).to(torch.bfloat16).requires_grad_()
        labels = torch.randint(0, V, (2 * P, T), device="cuda")
        labels[:, : T // 8] = -100
        flat = labels.reshape(-1)
        cu = torch.arange(0, N + 1, T, device="cuda", dtype=torch.int32)
        ref = torch.zeros(2 * P, device="cuda")
        for name, opts in LOSSES.items():
            r = ref if name == "DPO" else None
            ours = lambda x, w, y, **ws: first(preference_loss(x, w, y, cu, r, **ws, **opts))  # noqa: E731
            fns = {"floor": floor_products(x.detach(), w.detach())[0],
                   "capped": fwd_bwd(ours, x, w, flat),
                   "fast": fwd_bwd(lambda x, w, y: ours(x, w, y, max_workspace_bytes=None), x, w, flat)}
            if name in liger:
                xs = x.detach().reshape(2 * P, T, H).requires_grad_()
                fns["liger"] = fwd_bwd(lambda xs, w, y: first(liger[name](w, xs, y)), xs, w, labels)
            t = interleaved_ms(fns, warmup=1, iters=args.iters)
            del fns["floor"]
            torch.cuda.empty_cache()
            mem = [peak_extra_gib(fns[k], x, w) for k in ("capped", "fast")]
            if "liger" in fns:
                mem.append(peak_extra_gib(fns["liger"], xs, w))
            f = lambda k: (f"{t[k]:.2f}", f"{t[k] / t['floor']:.3f}x") if k in t else ("n/a", "")  # noqa: E731
            row = [str(V), name, f"{t['floor']:.2f}", *f("capped"), *f("fast"), *f("liger"),
                   " / ".join(f"{m:.2f}" for m in mem)]
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
        del x, w
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
