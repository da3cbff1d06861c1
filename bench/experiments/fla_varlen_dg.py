"""Where fla's dg and ours differ on bench_gdn.py's varlen batch: the tokens with the largest differences
and where they sit in their sequences, then the worst sequence alone (dense) through both kernels
(bench/notes/gdn.md, "GDN v6": fla is off at the last token of a partial chunk)."""
import bisect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gdn as bg  # noqa: E402

torch.manual_seed(0)
T, H, K = bg.VARLEN
cu = bg.varlen_cu(T)
x = bg.inputs(1, T, H, K, cu)
fla = lambda x, cu: bg.fla_fn(x, K ** -0.5, cu)()  # noqa: E731
ours = lambda x, cu: bg.ours_fn(x, cu)()  # noqa: E731
a, b = ours(x, cu), fla(x, cu)
dga, dgb = a[3][0].double(), b[3][0].double()  # [T, H]
d = (dga - dgb).abs().sum(1)
ref = dgb.abs().sum(1)
cul = cu.tolist()
print("rel", float((dga - dgb).norm() / dgb.norm()))
top = torch.topk(d, 15).indices.tolist()
for t in top:
    s = bisect.bisect_right(cul, t) - 1
    print(f"tok {t}: diff {float(d[t]):.3e} |dg| {float(ref[t]):.3e} seq {s} [{cul[s]},{cul[s + 1]}) "
          f"len {cul[s + 1] - cul[s]} off {t - cul[s]} off%64 {(t - cul[s]) % 64}")
# the worst sequence alone (dense, B = 1): its tokens, and its chunks' states
s = bisect.bisect_right(cul, top[0]) - 1
lo, hi = cul[s], cul[s + 1]
c0 = sum((cul[j + 1] - cul[j] + 63) // 64 for j in range(s))
nc = (hi - lo + 63) // 64
y = {k: (v[:, c0:c0 + nc] if k in ("h", "dh") else v[:, lo:hi]).contiguous() for k, v in x.items()}
a1, b1 = ours(y, None), fla(y, None)
for n, p, r, pv, rv in zip(("dq", "dk", "dw", "dg"), a1, b1, a, b):
    e = lambda u, w: float((u.double() - w.double()).norm() / w.double().norm())  # noqa: E731
    print(n, "dense ours vs fla", e(p, r), "| ours dense vs varlen", e(pv[:, lo:hi], p),
          "| fla dense vs varlen", e(rv[:, lo:hi], r))
