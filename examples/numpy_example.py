"""headloss on NumPy arrays (the CPU backend: fp64 reference arithmetic, no GPU needed): RMSNorm
forward and backward, the loss plan on logits, and the fused linear form on hidden states and the
head's weight, each checked against NumPy. Run it from a checkout after `make` (it finds
python/ itself) or with the package installed: python examples/numpy_example.py"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))  # a checkout's package
import headloss  # noqa: E402

rng = np.random.default_rng(0)
N, C, V, H = 48, 96, 500, 64


def log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def close(name, got, want, tol=1e-5):
    err = np.max(np.abs(np.asarray(got, np.float64) - want)) / max(1.0, np.max(np.abs(want)))
    print(f"  {name:<22} max rel. error {err:.1e}")
    assert err < tol, name


# ---- RMSNorm, with a fused residual add ----------------------------------------------------------
print(f"RMSNorm on [{N}, {C}] float32, residual fused")
x, r = rng.standard_normal((N, C), dtype=np.float32), rng.standard_normal((N, C), dtype=np.float32)
w = rng.uniform(0.5, 1.5, C).astype(np.float32)
out = headloss.rmsnorm_fwd(x, w, residual=r, eps=1e-6, return_rstd=True)
s = x.astype(np.float64) + r
rstd = 1 / np.sqrt((s ** 2).mean(axis=1, keepdims=True) + 1e-6)
close("y", out.y, s * rstd * w)
close("residual_out", out.residual_out, s)
dy = rng.standard_normal((N, C), dtype=np.float32)
grads = headloss.rmsnorm_bwd(dy, out.residual_out, w, out.rstd)
xhat, gw = s * rstd, dy * w.astype(np.float64)
close("dx", grads.dx, rstd * (gw - xhat * (gw * xhat).mean(axis=1, keepdims=True)))
close("dw", grads.dw, (dy * xhat).sum(axis=0))

# ---- the loss plan on logits: CE + z-loss, its metrics and the gradient in one pass ----------------
print(f"loss plan on logits [{N}, {V}]: terms ce + z (z_weight: the library's default, 1e-4)")
logits = 3 * rng.standard_normal((N, V), dtype=np.float32)
labels = rng.integers(0, V, N)
labels[:5] = -100  # ignored rows
plan = headloss.LossPlan(V, "float32", terms=("ce", "z"))
res = plan(logits, labels)
m = res.as_dict()
lp = log_softmax(logits.astype(np.float64))
lse = np.log(np.exp(logits.astype(np.float64)).sum(axis=1))
ok = labels >= 0
ce, z = -lp[ok, labels[ok]].mean(), (lse[ok] ** 2).mean()
close("ce", m["ce"], ce)
close("z", m["z"], z)
close("loss", m["loss"], ce + 1e-4 * z)
p = np.exp(lp)
onehot = np.zeros_like(p)
onehot[np.flatnonzero(ok), labels[ok]] = 1
grad = ((p - onehot) + 2e-4 * lse[:, None] * p) * ok[:, None] / ok.sum()
close("grad", res.grad, grad)
print(f"  valid_rows {m['valid_rows']:.0f}, accuracy {m['accuracy']:.3f}, entropy_mean {m['entropy_mean']:.3f}")

# ---- the fused linear form: the same loss from hidden states and the head's weight ----------------
print(f"fused linear form: hidden [{N}, {H}] x weight [{V}, {H}], the logits never whole in memory")
hidden = rng.standard_normal((N, H), dtype=np.float32)
weight = 0.2 * rng.standard_normal((V, H), dtype=np.float32)
lin = headloss.LinearLossPlan(V, H, "float32", terms=("ce", "z"))
lres = lin(hidden, weight, labels)
ref = headloss.LossPlan(V, "float32", terms=("ce", "z"))(hidden @ weight.T, labels)
close("loss (vs the logits)", lres.as_dict()["loss"], ref.as_dict()["loss"])
g = ref.grad.astype(np.float64)
close("grad_hidden", lres.grad_hidden, g @ weight)
close("grad_weight", lres.grad_weight, g.T @ hidden)

# ---- errors name the argument at fault -------------------------------------------------------------
try:
    plan(logits, labels[:-1])
except headloss.HeadlossValueError as e:  # also a ValueError
    print(f"a short labels array is refused before the call: {e}")
print("OK")
