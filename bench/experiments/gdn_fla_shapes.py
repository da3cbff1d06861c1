"""fla beside ours at shapes outside bench_gdn.py's rows (bf16, log2 gate, dw on; fla's first call autotunes, ~40 s a
shape on the H100): python3 bench/experiments/gdn_fla_shapes.py BxTxHxKxV ... (at 6a6b466: bench/NOTES.md "GDN v20")."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gdn as bg  # noqa: E402
from common import median_ms  # noqa: E402

print("| B, T, H, K, V | fla ms | ours ms | ours vs fla |\n|---|---|---|---|")
for shape in sys.argv[1:]:
    B, T, H, K, V = (int(v) for v in shape.split("x"))
    x = bg.inputs(B, T, H, K, V=V)
    ours, fla = bg.ours_fn(x), bg.fla_fn(x, K ** -0.5)
    if fla is None:
        sys.exit("fla is not installed")
    fla()  # autotuning, outside the timing
    t_fla, t_ours = median_ms(fla, iters=30, warmup=5), median_ms(ours, iters=30, warmup=5)
    print(f"| {B}, {T}, {H}, {K}, {V} | {t_fla:.3f} | {t_ours:.3f} | {t_fla / t_ours:.2f}x |", flush=True)
    del x
    torch.cuda.empty_cache()
