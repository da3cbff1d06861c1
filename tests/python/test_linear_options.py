"""The loss plan's options of ABI 0.7 against the fp64 reference: the fused linear form's head bias
and grad_bias, token_argmax (both forms), token scaling (both forms); every dtype, ragged rows,
ignored rows, gradient modes, NaN-poisoned outputs, a vocabulary sharded over CPU ranks equal to
the unsharded plan, and the refusals. CPU backend always; CUDA with a GPU and PyTorch."""
import numpy as np
import pytest

from headloss import HeadlossError
from headloss.loss import SCALARS, LinearLossPlan, LossPlan
from test_linear_loss import SCALAR_RTOL, f64, shard_plans
from test_loss import GRAD_TOL, NP_DTYPES, be, rel, run_ref  # noqa: F401  (be: fixture)

N, H, V = 23, 40, 131


def make(rng, dtype, scale=2.0):
    dt = NP_DTYPES[dtype]
    y = rng.integers(0, V, N)
    y[::5] = -100
    return {"hidden": rng.standard_normal((N, H)).astype(dt),
            "weight": (rng.standard_normal((V, H)) * scale / np.sqrt(H)).astype(dt),
            "bias": rng.standard_normal(V).astype(dt), "labels": y}


def reference(inp, terms, opts, bias=True):
    """(scalars, tokens, argmax, grad_hidden, grad_weight, grad_bias) in fp64."""
    X, W = f64(inp["hidden"]), f64(inp["weight"])
    z = X @ W.T + (f64(inp["bias"]) if bias else 0.0)
    sc, toks, G = run_ref({"logits": z, "labels": inp["labels"]}, terms, opts)
    return sc, toks, z.argmax(1), G @ W, G.T @ X, G.sum(0)


def run(be, inp, terms, opts, *, bias=True, grad_bias="write", init=None):
    dtype = str(inp["hidden"].dtype)
    plan = LinearLossPlan(V, H, dtype, terms=terms, device=be.name, grad_bias=grad_bias,
                          grad_weight_dtype="float32", **opts)
    gb = be.full((V,), dtype) if init is None else be.to_dev(init.astype(NP_DTYPES[dtype]))
    top = be.to_dev(np.full(N, -7, np.int64))
    out = plan(be.to_dev(inp["hidden"]), be.to_dev(inp["weight"]), be.to_dev(inp["labels"]),
               bias=be.to_dev(inp["bias"]) if bias else None, grad_bias=gb if grad_bias else None,
               grad_hidden=be.full((N, H), dtype), grad_weight=be.full((V, H), "float32"),
               tokens=[be.full((N,), "float32") for _ in range(4)], argmax=top)
    toks = dict(zip(("loss", "logp", "entropy", "lse"), (be.to_np(t) for t in out[3:7])))
    return (dict(zip(SCALARS, be.to_np(out.scalars))), toks, be.to_np(out.token_argmax).astype(np.int64),
            be.to_np(out.grad_hidden), be.to_np(out.grad_weight),
            None if out.grad_bias is None else be.to_np(out.grad_bias))


def check(be, got, want, dtype, init=None):
    sc, toks, top, gh, gw, gb = got
    rsc, rtoks, rtop, rgh, rgw, rgb = want
    rtol = SCALAR_RTOL["cpu" if be.name == "cpu" else dtype]
    for k in SCALARS:
        assert abs(sc[k] - rsc.get(k, 0.0)) <= rtol * (1 + abs(rsc.get(k, 0.0))), f"scalar {k}"
    for k in rtoks:
        assert rel(toks[k], rtoks[k]) < (1e-6 if be.name == "cpu" else 10 * rtol), f"token {k}"
    # A tie after rounding may pick another column on the GPU: the maxima must agree.
    assert np.array_equal(top, rtop) or be.name == "cuda" and np.mean(top == rtop) > 0.9, "token_argmax"
    tol = GRAD_TOL[dtype] if be.name == "cpu" else 1e-4 if dtype == "float32" else 3 * GRAD_TOL[dtype]
    assert rel(gh, rgh) < tol, "grad_hidden"
    assert rel(gw, rgw) < tol, "grad_weight"
    if rgb is not None:
        assert rel(gb, rgb + (0 if init is None else f64(init))) < tol, "grad_bias"


CASES = {"ce": (("ce",), {}), "ce_z_scaled": (("ce", "z"), dict(z_weight=1e-2, token_scaling=True)),
         "smooth_cap": (("ce",), dict(label_smoothing=0.1, softcap=4.0)), "ce_scaled": (("ce",), dict(token_scaling=True))}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("bias", [True, False])
def test_bias_argmax_scaling(be, case, dtype, bias):
    terms, opts = CASES[case]
    inp = make(np.random.default_rng(3), dtype)
    check(be, run(be, inp, terms, opts, bias=bias), reference(inp, terms, opts, bias), dtype)


def test_grad_bias_accumulates(be):
    rng = np.random.default_rng(4)
    inp = make(rng, "float32")
    start = rng.standard_normal(V)
    got = run(be, inp, ("ce",), {}, grad_bias="accumulate", init=start)
    check(be, got, reference(inp, ("ce",), {}), "float32", init=start)


def test_logits_form_argmax_and_scaling(be):
    rng = np.random.default_rng(5)
    z = (rng.standard_normal((N, V)) * 2).astype(np.float32)
    y = rng.integers(0, V, N)
    y[::4] = -100
    plan = LossPlan(V, "float32", terms=("ce", "z"), z_weight=1e-2, token_scaling=True, device=be.name)
    out = plan(be.to_dev(z), be.to_dev(y), argmax=True, grad=be.full((N, V), "float32"))
    sc, _, g = run_ref({"logits": f64(z), "labels": y}, ("ce", "z"), dict(z_weight=1e-2, token_scaling=True))
    assert abs(float(be.to_np(out.scalars)[0]) - sc["loss"]) < 1e-5 * (1 + abs(sc["loss"]))
    assert rel(be.to_np(out.grad), g) < 1e-5
    assert np.array_equal(be.to_np(out.token_argmax).astype(np.int64), f64(z).argmax(1))


@pytest.mark.parametrize("R", [2, 3])
def test_sharded_bias_equals_unsharded(R):
    """CPU ranks, each with its shard of weight and bias: the scalars, argmax (global ids),
    grad_hidden summed over the ranks, grad_weight and grad_bias shards stacked."""
    rng = np.random.default_rng(6)
    inp = make(rng, "float32")
    terms, opts = ("ce", "z"), dict(z_weight=1e-3, token_scaling=True)
    want = reference(inp, terms, opts)
    bounds, plans = shard_plans(type("B", (), {"name": "cpu"}), R, V, H, "float32", terms, opts, "int64",
                                grad_bias="write")
    X, W, b, y = inp["hidden"], inp["weight"], inp["bias"], inp["labels"]
    shard = [(np.ascontiguousarray(W[lo:hi]), np.ascontiguousarray(b[lo:hi])) for lo, hi in zip(bounds, bounds[1:])]
    gathered = np.concatenate([p.stats(X, w, y, bias=bs) for p, (w, bs) in zip(plans, shard)])
    outs = [p.finish(gathered, X, w, y, bias=bs, argmax=True) for p, (w, bs) in zip(plans, shard)]
    assert all(np.array_equal(o.token_argmax, want[2]) for o in outs)
    assert abs(outs[0].scalars[0] - want[0]["loss"]) < 1e-6 * (1 + abs(want[0]["loss"]))
    assert rel(sum(f64(o.grad_hidden) for o in outs), want[3]) < 1e-6
    assert rel(np.concatenate([f64(o.grad_weight) for o in outs]), want[4]) < 1e-6
    assert rel(np.concatenate([f64(o.grad_bias) for o in outs]), want[5]) < 1e-6


@pytest.mark.parametrize("kw, msg", [
    (dict(token_scaling=True, terms=("ce", "entropy"), entropy_weight=-1e-3), "HL_LOSS_TOKEN_SCALING"),
    (dict(token_scaling=True, labels_dtype=None, terms=("z",)), "HL_LOSS_TOKEN_SCALING"),
    (dict(grad_bias_dtype="float32"), "grad_bias_dtype is F32 but grad_bias_mode is NONE"),
    (dict(grad_bias="write", grad_bias_dtype="float16"), "grad_bias_dtype is F16"),
])
def test_bad_options(kw, msg):
    with pytest.raises(HeadlossError, match=msg):
        LinearLossPlan(V, H, "float32", **kw)


def test_bad_calls():
    inp = make(np.random.default_rng(7), "float32")
    plan = LinearLossPlan(V, H, "float32")
    with pytest.raises(HeadlossError, match="bias"):
        plan(inp["hidden"], inp["weight"], inp["labels"], bias=inp["bias"][:-1])
    with pytest.raises(HeadlossError, match="grad_bias is given"):
        plan(inp["hidden"], inp["weight"], inp["labels"], grad_bias=np.zeros(V, np.float32))
    with pytest.raises(HeadlossError, match="token_argmax"):
        plan(inp["hidden"], inp["weight"], inp["labels"], argmax=np.zeros(N, np.int32))
