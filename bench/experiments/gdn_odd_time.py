"""gdn_bwd_dqkwg on the Hopper kernel (HEADLOSS_GDN_KERNEL=sm90: an error where it would not take
the call) at 8, 4096, 16 for K, V around 128: what the ODD kernels (K or V not a multiple of 8) cost
against the TMA kernels of the nearest sizes. Usage: python3 bench/experiments/gdn_odd_time.py [K,V ...]"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gdn as bg  # noqa: E402
from common import median_ms  # noqa: E402

os.environ["HEADLOSS_GDN_KERNEL"] = "sm90"
torch.manual_seed(0)
pairs = sys.argv[1:] or ["128,128", "104,128", "100,128", "128,104", "128,100", "104,104", "100,100", "96,96"]
for kv in pairs:
    K, V = map(int, kv.split(","))
    x = bg.inputs(8, 4096, 16, K, V=V)
    print(f"| K = {K}, V = {V} | {median_ms(bg.ours_fn(x), iters=30, warmup=5):.3f} ms |", flush=True)
    del x
    torch.cuda.empty_cache()
