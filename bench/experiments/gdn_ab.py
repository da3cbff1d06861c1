"""GDN kernel variants (gdn_variant.sh's libraries) timed against each other in one process, in turns:
  python3 bench/experiments/gdn_ab.py ROUNDS 'label,label...' .variants/a.so .variants/b.so ... [--shapes BxTxHxKxV ...]
Rows: bench_gdn.py's whose label contains one of the comma-separated strings, then the shapes. Each variant's
gdn_bwd_dqkwg stands in for the package's in turn (HEADLOSS_LIBRARY: any of them); each cell is the median of
ROUNDS x 20 calls timed interleaved (common.interleaved_ms)."""
import argparse
import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gdn as bg  # noqa: E402
from common import interleaved_ms  # noqa: E402

import headloss.gdn as hg  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("rounds", type=int)
ap.add_argument("labels", help="comma-separated parts of bench_gdn.py row labels ('' for none)")
ap.add_argument("libs", nargs="+")
ap.add_argument("--shapes", nargs="*", default=[])
args = ap.parse_args()
variants = {}
for p in args.libs:
    f = ctypes.CDLL(p).gdn_bwd_dqkwg
    f.restype, f.argtypes = hg._run.restype, hg._run.argtypes
    variants[Path(p).stem] = f
cases = [c for c in bg.cases() if any(w and w in c[0] for w in args.labels.split(","))]
cases += list(bg.shape_cases(args.shapes))
torch.manual_seed(0)
print("| row | " + " | ".join(variants) + " |\n|---|" + "---|" * len(variants))
for label, make, cu in cases:
    x = make()
    fn = bg.ours_fn(x, cu)

    def with_variant(f):
        def run():
            hg._run = f
            fn()
        return run

    t = interleaved_ms({n: with_variant(f) for n, f in variants.items()}, warmup=3, iters=20 * args.rounds)
    print(f"| {label} | " + " | ".join(f"{v:.3f}" for v in t.values()) + " |", flush=True)
    del x
    torch.cuda.empty_cache()
