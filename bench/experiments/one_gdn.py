"""One gdn_bwd_dqkwg shape (bf16, log2 gate, dw on), ours or fla's, run a few times: a target for ncu.
Usage: python3 bench/experiments/one_gdn.py B T H K [ours|fla] [iters] [HV (value heads, GVA)]"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gdn import fla_fn, inputs, ours_fn  # noqa: E402

B, T, H, K = (int(a) for a in sys.argv[1:5])
who = sys.argv[5] if len(sys.argv) > 5 else "ours"
x = inputs(B, T, H, K, HV=int(sys.argv[7]) if len(sys.argv) > 7 else None)
run = fla_fn(x, K ** -0.5) if who == "fla" else ours_fn(x)
for _ in range(int(sys.argv[6]) if len(sys.argv) > 6 else 3):
    run()
torch.cuda.synchronize()
