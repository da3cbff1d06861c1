"""GDN kernel variants (gdn_variant.sh's libraries) timed against each other in one process, rounds alternating:
  python3 bench/experiments/gdn_ab.py ROUNDS 'label,label...' .variants/a.so .variants/b.so ...
Rows: bench_gdn.py's whose label contains one of the comma-separated strings, then EXTRA="BxTxHxKxV ..." shapes.
Each variant's gdn_bwd_dqkwg stands in for the package's in turn (HEADLOSS_LIBRARY: any of them); each cell is the
median over the rounds of a 20-run median (ms)."""
import ctypes
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gdn as bg  # noqa: E402
from common import median_ms  # noqa: E402

import headloss.gdn as hg  # noqa: E402

rounds, wanted, paths = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3:]
runs = {}
for p in paths:
    f = ctypes.CDLL(p).gdn_bwd_dqkwg
    f.restype, f.argtypes = hg._run.restype, hg._run.argtypes
    runs[Path(p).stem] = f
cases = [c for c in bg.cases() if any(w and w in c[0] for w in wanted)]
for e in os.environ.get("EXTRA", "").split():
    B, T, H, K, V = (int(v) for v in e.split("x"))
    cases.append((e, lambda B=B, T=T, H=H, K=K, V=V: bg.inputs(B, T, H, K, V=V), None))
torch.manual_seed(0)
print("| row | " + " | ".join(runs) + " |\n|---|" + "---|" * len(runs))
for label, make, cu in cases:
    x = make()
    fn = bg.ours_fn(x, cu)
    t = {n: [] for n in runs}
    for _ in range(rounds):
        for n, f in runs.items():
            hg._run = f
            t[n].append(median_ms(fn, iters=20, warmup=3))
    print(f"| {label} | " + " | ".join(f"{statistics.median(v):.3f}" for v in t.values()) + " |", flush=True)
    del x
    torch.cuda.empty_cache()
