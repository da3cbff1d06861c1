"""One gdn_bwd_dqkwg shape with K and V apart (bf16, log2 gate, dw on), run a few times: a target for
ncu. Usage: python3 bench/experiments/one_gdn_kv.py B T H K V [iters]"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gdn import inputs, ours_fn  # noqa: E402

B, T, H, K, V = (int(a) for a in sys.argv[1:6])
run = ours_fn(inputs(B, T, H, K, V=V))
for _ in range(int(sys.argv[6]) if len(sys.argv) > 6 else 3):
    run()
torch.cuda.synchronize()
