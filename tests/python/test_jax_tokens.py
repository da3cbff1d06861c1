"""headloss.jax.token_logprobs / linear_token_logprobs: per-token log-probs, entropies and
log-sum-exps with a jax.custom_vjp, under jax.jit and jax.grad, against the fp64 reference
(ref_loss.token_reference: the outputs and the vector-Jacobian product), both forms, f32 and bf16,
ignored rows, outputs left unused (no cotangent sent, no gradient formed for an operand not
differentiated) and finite differences. On each JAX platform present (gpu skips without one)."""
import numpy as np
import pytest

from test_jax import _ffi_params, device, hlj, jax, jnp, rel  # noqa: F401  (device: the platform fixture)
from ref_loss import token_reference
from headloss import HeadlossValueError

N, H, V = 23, 32, 211
TOL = {"float32": 1e-5, "bfloat16": 1.6e-2}


def inputs(dtype, seed=0):
    """hidden, weight, labels (every fourth row ignored: -100, and one ignore_index = 7 row) and
    the three outputs' upstream gradients, as numpy arrays (hidden and weight in dtype)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((N, H)), dtype)
    w = jnp.asarray(rng.standard_normal((V, H)) / H ** 0.5 * 2, dtype)
    y = rng.integers(0, V, N).astype(np.int32)
    y[::4], y[1] = -100, 7
    return x, w, y, rng.standard_normal((3, N)).astype(np.float32)


def f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def logits_ref(x, w, device, dtype):
    """The fp64 logits of the fused linear form: on CUDA a 16-bit product is stored rounded."""
    z = f64(x) @ f64(w).T
    return f64(jnp.asarray(z, dtype)) if device.platform == "gpu" and dtype != "float32" else z


def loss_of(outs, up, used):
    return sum((outs[i].reshape(-1) * up[i]).sum() for i in used)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_against_reference(device, dtype):
    """A temperature, a soft cap and ignore_index; logits [2, N, V] give outputs [2, N]."""
    x, w, y, up = inputs(dtype, 1)
    z = jax.device_put(jnp.asarray(f64(x) @ f64(w).T, dtype).reshape(1, N, V), device)
    labels = jax.device_put(jnp.asarray(y).reshape(1, N), device)
    opts = dict(temperature=1.3, softcap=6.0, ignore_index=7)
    outs = jax.jit(lambda z: hlj.token_logprobs(z, labels, **opts))(z)
    assert outs.logp.shape == (1, N) and outs.lse.dtype == jnp.float32
    g = jax.jit(jax.grad(lambda z: loss_of(hlj.token_logprobs(z, labels, **opts), up, (0, 1, 2))))(z)
    assert g.dtype == z.dtype and g.shape == z.shape
    want, gz = token_reference(f64(z).reshape(N, V), y, logit_scale=1 / 1.3, softcap=6.0, ignore_index=7,
                               g_logp=up[0], g_entropy=up[1], g_lse=up[2])
    for name, t in zip(("logp", "entropy", "lse"), outs):
        assert rel(t.reshape(N), want[name]) < 1e-5, name
    assert float(jnp.abs(outs.logp[0, ::4]).max()) == 0.0 and float(outs.logp[0, 1]) == 0.0
    assert rel(f64(g).reshape(N, V), gz) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("used", [(0, 1, 2), (0,), (1,)])
def test_linear_against_reference(device, dtype, used):
    """grad_hidden and grad_weight from the outputs used (the others' cotangents are symbolic
    zeros: not sent), against the reference's gradient of the logits through X W^T."""
    x, w, y, up = inputs(dtype)
    x, w, labels = (jax.device_put(a, device) for a in (x, w, jnp.asarray(y)))
    outs = hlj.linear_token_logprobs(x, w, labels, temperature=0.8)
    gx, gw = jax.jit(jax.grad(lambda x, w: loss_of(hlj.linear_token_logprobs(x, w, labels, temperature=0.8),
                                                   up, used), argnums=(0, 1)))(x, w)
    assert gx.dtype == gw.dtype == jnp.dtype(dtype)
    ups = {k: up[i] for i, k in enumerate(("g_logp", "g_entropy", "g_lse")) if i in used}
    want, gz = token_reference(logits_ref(x, w, device, dtype), y, logit_scale=1 / 0.8, **ups)
    for name, t in zip(("logp", "entropy", "lse"), outs):
        assert rel(t, want[name]) < TOL[dtype], name
    assert rel(gx, gz @ f64(w)) < 2 * TOL[dtype]
    assert rel(gw, gz.T @ f64(x)) < 2 * TOL[dtype]


def test_linear_grad_weight_f32_and_workspace_cap(device):
    """grad_weight summed in fp32 then rounded once; a workspace of the plan's minimum (chunks of
    few rows) gives the same results. One plan per configuration under jit."""
    x, w, y, up = inputs("bfloat16", 2)
    x, w, labels = (jax.device_put(a, device) for a in (x, w, jnp.asarray(y)))
    f = jax.jit(jax.grad(lambda w: loss_of(hlj.linear_token_logprobs(
        x, w, labels, grad_weight_dtype="float32", max_workspace_bytes=0), up, (0, 1, 2))))
    gw = f(w)
    assert gw.dtype == jnp.bfloat16
    _, gz = token_reference(logits_ref(x, w, device, "bfloat16"), y, g_logp=up[0], g_entropy=up[1], g_lse=up[2])
    assert rel(gw, gz.T @ f64(x)) < 2 * TOL["bfloat16"]
    n = hlj.loss_plan_count()
    f(w * 2).block_until_ready()
    assert hlj.loss_plan_count() == n


@pytest.mark.parametrize("argnums, modes", [((0,), (1, 0)), ((1,), (0, 1)), ((0, 1), (1, 1))])
def test_forms_only_what_is_asked(argnums, modes):
    """The forward forms no gradient; the backward only the differentiated operands' gradients,
    from the cotangents of the outputs used (here the entropy's alone: input bit 8192), and
    without labels logp's cotangent is never sent (logp is the constant 0)."""
    x, w, y, up = inputs("float32")

    def f(x, w):
        out = hlj.linear_token_logprobs(x, w)
        return out.entropy.sum() + out.logp.sum()

    fwd, bwd = _ffi_params(jax.make_jaxpr(jax.grad(f, argnums=argnums))(x, w).jaxpr)
    assert (fwd["grad_hidden_mode"], fwd["grad_weight_mode"], fwd["token_outputs"]) == (0, 0, 1)
    assert (bwd["grad_hidden_mode"], bwd["grad_weight_mode"], bwd["token_outputs"]) == (*modes, 0)
    assert bwd["inputs"] == 8192
    g = jax.jit(jax.grad(f, argnums=argnums))(x, w)
    _, gz = token_reference(f64(x) @ f64(w).T, None, g_entropy=np.ones(N))
    for i, gi in zip(argnums, g):
        assert rel(gi, (gz @ f64(w), gz.T @ f64(x))[i]) < 1e-5
    assert float(jnp.abs(hlj.linear_token_logprobs(x, w).logp).max()) == 0.0


def test_no_cotangent_gives_zeros():
    """A loss that uses none of the outputs (only stop_gradient'ed ones) gives a zero gradient
    without running the plan's backward."""
    x, w, y, _ = inputs("float32")
    f = lambda z: jax.lax.stop_gradient(hlj.token_logprobs(z, jnp.asarray(y)).lse).sum()  # noqa: E731
    z = x @ w.T
    assert len(_ffi_params(jax.make_jaxpr(jax.grad(f))(z).jaxpr)) == 1
    assert float(jnp.abs(jax.grad(f)(z)).max()) == 0.0


def test_finite_differences():
    """jax.grad of a loss of all three outputs against central differences (fp32, a few
    directions)."""
    x, w, y, up = inputs("float32", 3)
    z = (x @ w.T)[:5]
    labels = jnp.asarray(y[:5])
    f = jax.jit(lambda z: loss_of(hlj.token_logprobs(z, labels, temperature=0.7, softcap=5.0), up[:, :5], (0, 1, 2)))
    g = np.asarray(jax.grad(f)(z), np.float64)
    rng = np.random.default_rng(4)
    for _ in range(4):
        d = rng.standard_normal(z.shape).astype(np.float32)
        eps = 1e-2
        fd = (float(f(z + eps * d)) - float(f(z - eps * d))) / (2 * eps)
        assert abs(fd - (g * d).sum()) < 2e-3 * max(1.0, abs(fd))


def test_bad_input():
    x, w, y, _ = inputs("float32")
    with pytest.raises(HeadlossValueError, match="temperature is 0"):
        hlj.token_logprobs(x @ w.T, jnp.asarray(y), temperature=0)
    with pytest.raises(HeadlossValueError, match="labels"):
        hlj.linear_token_logprobs(x, w, jnp.asarray(y[:-1]))
