"""The fused linear form's sharded CE on one GPU, the shifted path against the row path
(HEADLOSS_LINEAR_PATH=rows, read when a plan is created): R ranks one after another, stats of every rank,
the blocks concatenated (the all-gather), finish of every rank; both paths in turns, 8 rounds; the
paired ratio and how far apart the summed grad_hidden are. Plans are checked (a synchronisation in each
finish), so times are for comparing the two paths, not the unsharded bench.

Usage: python3 bench/experiments/tp_linear_time.py [NxHxVxR ...]   (default 8192x4096x128256x2)"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import interleaved_runs, median, paired_ratio  # noqa: E402
from headloss.loss import LinearLossPlan  # noqa: E402


def build(path, x, w, y, R):
    N, H = x.shape
    V = w.shape[0]
    b = [V * r // R for r in range(R + 1)]
    os.environ["HEADLOSS_LINEAR_PATH"] = path
    plans = [LinearLossPlan(b[r + 1] - b[r], H, "bfloat16", terms=("ce",), device="cuda", vocab_start=b[r],
                            vocab_global=V, ranks=R) for r in range(R)]
    ws = [p.workspace(x, N, p.workspace_sizes(N)[1]) for p in plans]  # every row kept
    wr = [w[b[r]:b[r + 1]] for r in range(R)]
    gh = [torch.empty_like(x) for _ in range(R)]
    gw = [torch.empty_like(t) for t in wr]

    def run():
        g = torch.cat([p.stats(x, wr[r], y, workspace=ws[r]).view(-1) for r, p in enumerate(plans)])
        for r, p in enumerate(plans):
            p.finish(g, x, wr[r], y, workspace=ws[r], grad_hidden=gh[r], grad_weight=gw[r])
    return run, gh


def main():
    for shape in sys.argv[1:] or ["8192x4096x128256x2"]:
        N, H, V, R = map(int, shape.split("x"))
        torch.manual_seed(0)
        x = torch.randn(N, H, device="cuda").to(torch.bfloat16)
        w = (torch.randn(V, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
        y = torch.randint(0, V, (N,), device="cuda")
        runs, gh = {}, {}
        for path in ("shifted", "rows"):
            runs[path], gh[path] = build(path, x, w, y, R)
        t = interleaved_runs(runs, iters=8)
        a, b = (sum(g.float() for g in gh[k]) for k in ("shifted", "rows"))
        print(f"{N} x {H} x {V}, R = {R}: shifted {median(t['shifted']):.2f} ms, rows {median(t['rows']):.2f} ms, "
              f"{paired_ratio(t, 'shifted', 'rows'):.3f}x; grad_hidden rel. diff {((a - b).norm() / b.norm()).item():.1e}",
              flush=True)
        del runs, gh, x, w, y
        torch.cuda.empty_cache()
    os.environ.pop("HEADLOSS_LINEAR_PATH", None)


if __name__ == "__main__":
    main()
