"""One loss plan (CE + gradient, bf16) executed a few times at N x V: a target for ncu.
Usage: python3 bench/experiments/one_loss.py N V [iters]"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_loss import Direct  # noqa: E402

N, V = int(sys.argv[1]), int(sys.argv[2])
logits = (torch.randn(N, V, device="cuda") * 2).to(torch.bfloat16)
labels = torch.randint(0, V, (N,), device="cuda")
run = Direct(logits, labels, ("ce",))
for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
    run()
torch.cuda.synchronize()
