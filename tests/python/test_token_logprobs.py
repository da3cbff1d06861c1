"""Per-token outputs with a backward (headloss.h, "Per-token gradients"): plans whose calls pass the
upstream gradients of token_logp / token_entropy / token_lse (token_grads=, grad_token_*=), in both
forms, against the fp64 reference (ref_loss.token_reference): every output and gradient, every
dtype, ragged sizes, ignored rows (negative labels and ignore_index), a temperature and a soft cap,
with and without other terms; vocabulary shards against the unsharded plan; finite differences of
the linear form's backward; bad input. CPU backend always, CUDA with a GPU; outputs NaN-poisoned."""
import numpy as np
import pytest

from headloss import HeadlossValueError
from headloss.loss import SCALARS, LinearLossPlan, LossPlan
from ref_loss import token_reference
from test_linear_loss import f64
from test_loss import GRAD_TOL, NP_DTYPES, be, rel  # noqa: F401  (be: the backend fixture)

N, V, H = 37, 301, 24
ALL = ("logp", "entropy", "lse")


def inputs(rng, dtype, *, scale=2.0):
    y = rng.integers(0, V, N)
    y[::5] = -100
    y[1] = 7  # ignored with ignore_index=7
    up = {n: rng.standard_normal(N).astype(np.float32) for n in ALL}
    return y, up


def tol(be, dtype):
    return 2e-6 if be.name == "cpu" and dtype == "float32" else GRAD_TOL[dtype]


def check_tokens(be, toks, want, dtype):
    for k, t in zip(ALL, toks):
        assert rel(be.to_np(t), want[k]) < (1e-6 if be.name == "cpu" else 5e-5), k


def tokens(be):
    return [None] + [be.full((N,), "float32") for _ in ALL]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("grads", [ALL, ("logp",), ("entropy", "lse")])
@pytest.mark.parametrize("opts", [{}, {"logit_scale": 1 / 0.7, "ignore_index": 7}, {"softcap": 4.0}])
def test_logits_form(be, rng, dtype, grads, opts):
    y, up = inputs(rng, dtype)
    z = (rng.standard_normal((N, V)) * 2).astype(NP_DTYPES[dtype])
    plan = LossPlan(V, dtype, terms=(), device=be.name, token_grads=grads, grad_dtype="float32", **opts)
    toks = tokens(be)
    out = plan(be.to_dev(z), be.to_dev(y), tokens=toks, grad=be.full((N, V), "float32"),
               **{f"grad_token_{n}": be.to_dev(up[n]) for n in grads})
    want, g = token_reference(f64(z), y, **opts, **{f"g_{n}": up[n] for n in grads})
    check_tokens(be, toks[1:], want, dtype)
    assert rel(be.to_np(out.grad), g) < tol(be, "float32") * (1 if dtype == "float32" else 10)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("grads", [ALL, ("logp", "lse")])
def test_linear_form(be, rng, dtype, grads):
    """grad_hidden and grad_weight are G W and G^T X of the reference's G; on CUDA the 16-bit logits
    are stored between the products (its reference rounds them too), except on the shifted path
    (bf16 on a 9.0 GPU without the entropy's gradient), whose logits stay fp32."""
    y, up = inputs(rng, dtype)
    np_dt = NP_DTYPES[dtype]
    X = rng.standard_normal((N, H)).astype(np_dt)
    W = (rng.standard_normal((V, H)) * 2.5 / np.sqrt(H)).astype(np_dt)
    plan = LinearLossPlan(V, H, dtype, terms=(), device=be.name, token_grads=grads, grad_hidden_dtype="float32",
                          grad_weight_dtype="float32", logit_scale=1.25)
    toks = tokens(be)
    out = plan(be.to_dev(X), be.to_dev(W), be.to_dev(y), tokens=toks,
               **{f"grad_token_{n}": be.to_dev(up[n]) for n in grads})
    z = f64(X) @ f64(W).T
    shifted = (be.name == "cuda" and dtype == "bfloat16" and "entropy" not in grads
               and be.torch.cuda.get_device_capability() == (9, 0))
    if be.name == "cuda" and dtype != "float32" and not shifted:
        z = z.astype(np_dt).astype(np.float64)
    want, g = token_reference(z, y, logit_scale=1.25, **{f"g_{n}": up[n] for n in grads})
    check_tokens(be, toks[1:], want, dtype)
    t = tol(be, dtype) * (1 if be.name == "cpu" else 2)
    assert rel(be.to_np(out.grad_hidden), g @ f64(W)) < t
    assert rel(be.to_np(out.grad_weight), g.T @ f64(X)) < t


def test_forward_only(be, rng):
    """No term and no gradient: the per-token outputs alone (the "old log-probs" call)."""
    y, _ = inputs(rng, "float32")
    X = rng.standard_normal((N, H)).astype(np.float32)
    W = rng.standard_normal((V, H)).astype(np.float32) / 4
    plan = LinearLossPlan(V, H, "float32", terms=(), device=be.name, grad_hidden=None, grad_weight=None)
    toks = tokens(be)
    out = plan(be.to_dev(X), be.to_dev(W), be.to_dev(y), tokens=toks)
    assert out.grad_hidden is None and out.grad_weight is None
    check_tokens(be, toks[1:], token_reference(f64(X) @ f64(W).T, y)[0], "float32")


def test_added_to_terms(rng):
    """With terms, the gradient is the terms' (weighted, over D) plus the product (unweighted)."""
    y, up = inputs(rng, "float32")
    z = (rng.standard_normal((N, V)) * 2).astype(np.float32)
    w = rng.uniform(0.5, 2, N).astype(np.float32)
    both = LossPlan(V, "float32", terms=("ce",), token_grads=ALL)
    alone = LossPlan(V, "float32", terms=("ce",))
    g = both(z, y, weights=w, grad_scale=0.5, **{f"grad_token_{n}": up[n] for n in ALL}).grad
    g_ce = alone(z, y, weights=w, grad_scale=0.5).grad
    assert rel(f64(g) - f64(g_ce), token_reference(f64(z), y, **{f"g_{n}": up[n] for n in ALL})[1]) < 2e-6


@pytest.mark.parametrize("form", ["logits", "linear"])
def test_sharded_equals_unsharded(be, rng, form):
    """Three uneven shards, the simulated all-gather: each rank's gradient is its columns of the
    unsharded one (logits form), or the ranks' grad_hidden sum to it and their grad_weight rows
    are its rows (linear form); the per-token outputs are every rank's."""
    y, up = inputs(rng, "float32")
    shards = [(0, 100), (100, 1), (101, V - 101)]
    X = rng.standard_normal((N, H)).astype(np.float32)
    W = rng.standard_normal((V, H)).astype(np.float32) / 4
    z = f64(X) @ f64(W).T
    kw = dict(terms=(), device=be.name, token_grads=ALL, softcap=5.0)
    up_dev = {f"grad_token_{n}": be.to_dev(up[n]) for n in ALL}
    if form == "logits":
        plans = [LossPlan(s[1], "float32", vocab_start=s[0], vocab_global=V, ranks=3, **kw) for s in shards]
        args = [(be.to_dev(np.ascontiguousarray(z[:, a:a + n].astype(np.float32))),) for a, n in shards]
    else:
        plans = [LinearLossPlan(s[1], H, "float32", vocab_start=s[0], vocab_global=V, ranks=3, **kw) for s in shards]
        args = [(be.to_dev(X), be.to_dev(np.ascontiguousarray(W[a:a + n]))) for a, n in shards]
    if form == "logits":
        z = z.astype(np.float32).astype(np.float64)
    labels = be.to_dev(y)
    ws = [p.workspace(args[i][0], N) if be.name == "cuda" else None for i, p in enumerate(plans)]
    stats = [p.stats(*a, labels, **({"workspace": w} if form == "linear" else {}))
             for p, a, w in zip(plans, args, ws)]
    gathered = np.concatenate(stats) if be.name == "cpu" else be.torch.cat(stats)
    want, g = token_reference(z, y, softcap=5.0, **{f"g_{n}": up[n] for n in ALL})
    gh = 0
    for p, a, s, w in zip(plans, args, shards, ws):
        toks = tokens(be)
        extra = {"workspace": w} if form == "linear" else {}
        out = p.finish(gathered, *a, labels, tokens=toks, scalars=be.full((len(SCALARS),), "float32"),
                       **extra, **up_dev)
        check_tokens(be, toks[1:], want, "float32")
        if form == "logits":
            assert rel(be.to_np(out.grad), g[:, s[0]:s[0] + s[1]]) < tol(be, "float32")
        else:
            gh = gh + be.to_np(out.grad_hidden)
            assert rel(be.to_np(out.grad_weight), g[:, s[0]:s[0] + s[1]].T @ f64(X)) < 5 * tol(be, "float32")
    if form == "linear":
        assert rel(gh, g @ f64(W)) < 5 * tol(be, "float32")


def test_finite_differences(rng):
    """The linear form's grad_hidden and grad_weight against central differences of
    sum_t (g_logp logp + g_entropy H + g_lse lse) on the CPU backend (fp64 inside)."""
    n, v, h = 5, 13, 6
    y = rng.integers(0, v, n)
    y[2] = -100
    up = {k: rng.standard_normal(n).astype(np.float32) for k in ALL}
    X = rng.standard_normal((n, h)).astype(np.float32)
    W = rng.standard_normal((v, h)).astype(np.float32) / 2
    grad = LinearLossPlan(v, h, "float32", terms=(), token_grads=ALL, grad_hidden_dtype="float32",
                          grad_weight_dtype="float32", logit_scale=0.8)
    fwd = LinearLossPlan(v, h, "float32", terms=(), grad_hidden=None, grad_weight=None, logit_scale=0.8)
    out = grad(X, W, y, **{f"grad_token_{k}": up[k] for k in ALL})

    def f(X, W):
        t = fwd(X, W, y, token_outputs=True)
        return sum(f64(up[k]) @ f64(getattr(t, "token_" + k)) for k in ALL)

    eps = 1e-2
    for M, G in ((X, out.grad_hidden), (W, out.grad_weight)):
        for idx in [(0, 0), (2, 3), (M.shape[0] - 1, h - 1)]:
            plus, minus = M.copy(), M.copy()
            plus[idx] += eps
            minus[idx] -= eps
            args = lambda m: (m, W) if M is X else (X, m)  # noqa: E731
            fd = (f(*args(plus)) - f(*args(minus))) / (2 * eps)
            assert abs(fd - G[idx]) < 2e-3 * max(1.0, abs(fd)), (idx, fd, G[idx])


def test_bad_input(rng):
    y, up = inputs(rng, "float32")
    z = rng.standard_normal((N, V)).astype(np.float32)
    with pytest.raises(HeadlossValueError, match="token_grads: unknown output 'logq'"):
        LossPlan(V, "float32", terms=(), token_grads=("logq",))
    with pytest.raises(HeadlossValueError, match="HL_LOSS_GRAD_TOKEN_\\* bits but no gradient"):
        LossPlan(V, "float32", terms=(), grad=None, token_grads="lse")
    with pytest.raises(HeadlossValueError, match="grad_token_lse is set but the plan's flags lack"):
        LossPlan(V, "float32")(z, y, grad_token_lse=up["lse"])
    with pytest.raises(HeadlossValueError, match="grad_token_entropy is NULL; HL_LOSS_GRAD_TOKEN_ENTROPY"):
        LossPlan(V, "float32", terms=(), token_grads=ALL)(z, y, grad_token_logp=up["logp"], grad_token_lse=up["lse"])
    with pytest.raises(HeadlossValueError, match="grad_token_logp"):
        LossPlan(V, "float32", terms=(), token_grads="logp")(z, y, grad_token_logp=up["logp"][:-1])
