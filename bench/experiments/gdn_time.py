"""gdn_bwd_dqkwg alone (no fla) at every bench_gdn.py row, in about 30 s: the command for ab.sh A/Bs
of GDN kernel variants, `bench/experiments/ab.sh "python3 bench/experiments/gdn_time.py" x.patch`."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gdn as bg  # noqa: E402
from common import median_ms  # noqa: E402

torch.manual_seed(0)
for label, make, cu in bg.cases():
    print(f"| {label} | {median_ms(bg.ours_fn(make(), cu), iters=30, warmup=5):.3f} |", flush=True)
    torch.cuda.empty_cache()
