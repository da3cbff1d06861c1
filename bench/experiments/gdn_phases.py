"""Cycles per phase of an item in CTA 0's three consumer warpgroups (items 4..51, medians), from a variant built with
gdn-phase-probes.patch (clock64 at each phase's end; the probes cost a little and can move the compiler's schedule):
  cp kernels/gdn/dqkwg_sm90.cu /tmp/p.cu && patch /tmp/p.cu bench/experiments/gdn-phase-probes.patch
  bench/experiments/gdn_variant.sh phases /tmp/p.cu
  HEADLOSS_LIBRARY=.variants/phases.so python3 bench/experiments/gdn_phases.py BxTxHxKxV ...
One value head a q/k head (G = 1): a pass is an item."""
import ctypes
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gdn as bg  # noqa: E402

from headloss import _lib  # noqa: E402

names = ["stages", "wait q/k", "ds + barrier", "scale, dglk, mma", "dg row sums", "store", "epilogue barrier"]
get = _lib.lib.hl_exp_prof
for shape, make, _ in bg.shape_cases(sys.argv[1:]):
    x = make()
    fn = bg.ours_fn(x)
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    buf = np.zeros((3, 64, 8), dtype=np.int64)
    assert get(buf.ctypes.data_as(ctypes.c_void_p)) == 0
    print(f"{shape}: " + ", ".join(names) + ", period")
    for wg in range(3):
        p = buf[wg, 4:52].astype(np.float64)
        steps = [p[:, k + 1] - p[:, k] for k in range(7)]
        if wg == 2:  # WG2 has no ds, q/k or dg row sums: probes 2-4 stay unset
            steps[1:5] = [np.zeros(len(p))] * 4
            steps[5] = p[:, 6] - p[:, 5]
        period = buf[wg, 5:53, 0] - buf[wg, 4:52, 0]
        print(f"  WG{wg}: " + " ".join(f"{np.median(s):.0f}" for s in steps) + f" | {np.median(period):.0f}")
    del x
    torch.cuda.empty_cache()
