"""gdn_bwd_dqkwg alone (no fla) at every bench_gdn.py shape, in about 20 s: the command for ab.sh A/Bs
of GDN kernel variants, `bench/experiments/ab.sh "python3 bench/experiments/gdn_time.py" x.patch`."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gdn as bg  # noqa: E402
from common import median_ms  # noqa: E402

torch.manual_seed(0)


def t(label, x, cu=None):
    print(f"| {label} | {median_ms(bg.ours_fn(x, cu), iters=30, warmup=5):.3f} |", flush=True)


for B, T, H, K in bg.SHAPES:
    t(f"{B},{T},{H},{K}", bg.inputs(B, T, H, K))
    torch.cuda.empty_cache()
T, H, K = bg.VARLEN
cu = bg.varlen_cu(T)
t("varlen", bg.inputs(1, T, H, K, cu), cu)
torch.cuda.empty_cache()
B, T, H, HV, K = bg.GVA
t("gva", bg.inputs(B, T, H, K, HV=HV))
