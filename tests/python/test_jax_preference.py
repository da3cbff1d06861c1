"""headloss.jax.preference_loss on the CPU platform: DPO (sigmoid, ipo), SimPO, ORPO with the chosen
tokens' NLL and KTO, the logits form and the fused linear form, under jax.jit and jax.grad, against
the NumPy CPU plans (LossPlan / LinearLossPlan) with the same options: the loss, TRL's metrics and
the gradients; and the adapter's checks of the per-sequence inputs."""
import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed")
import jax.numpy as jnp  # noqa: E402

import headloss  # noqa: E402
from headloss.loss import SCALARS  # noqa: E402
from test_preference import V, batch  # noqa: E402

try:
    import headloss.jax as hlj
except ImportError as e:  # the adapter is not built
    pytest.skip(f"headloss.jax unavailable: {e}", allow_module_level=True)

H = 6
# (loss, its keywords, the plan's options)
CASES = {
    "dpo_sigmoid": ("dpo", dict(beta=0.7, label_smoothing=0.1), dict(pref_loss_type="sigmoid", pref_beta=0.7,
                                                                     pref_label_smoothing=0.1)),
    "dpo_ipo": ("dpo", dict(loss_type="ipo", beta=0.3), dict(pref_loss_type="ipo", pref_beta=0.3)),
    "simpo": ("simpo", dict(beta=2.0, gamma=0.4), dict(pref_beta=2.0, pref_gamma=0.4)),
    "orpo_nll": ("orpo", dict(beta=0.2, nll_weight=1.5), dict(pref_beta=0.2, ce_weight=1.5)),
    "kto": ("kto", dict(beta=0.5, kto_desirable_weight=1.3), dict(pref_beta=0.5, kto_desirable_weight=1.3)),
}


def case(name, seed):
    """The inputs of one case and the NumPy plan's keywords (per-call inputs, plan options)."""
    rng = np.random.default_rng(seed)
    kind, kw, opts = CASES[name]
    logits, labels, cu = batch(rng, kind, 6 if kind == "kto" else 4)
    S = len(cu) - 1
    ref = (rng.normal(size=S) - 3).astype(np.float32) if kind in ("dpo", "kto") else None
    kto = np.array([1, 0, -1, 1, -1, 0], np.int32) if kind == "kto" else None
    call = {k: v for k, v in dict(cu_seqlens=cu, ref_seq_logprobs=ref, kto_labels=kto).items() if v is not None}
    if kw.get("nll_weight"):  # the chosen completions' tokens: the first half of the sequences
        call["weights"] = (np.arange(len(labels)) < cu[S // 2]).astype(np.float32)
    terms = ("ce", "preference") if kw.get("nll_weight") else ("preference",)
    return kind, kw, logits.astype(np.float32), labels.astype(np.int32), cu, ref, kto, call, \
        dict(opts, terms=terms, preference=kind, labels_dtype="int32")


def check_metrics(metrics, scalars):
    sc = np.asarray(scalars, np.float64)
    for trl, s in hlj.PREFERENCE_METRICS.items():
        np.testing.assert_allclose(float(metrics[trl]), sc[SCALARS.index(s)], rtol=1e-5, atol=1e-6, err_msg=trl)


@pytest.mark.parametrize("name", CASES)
def test_logits_form(name):
    kind, kw, x, labels, cu, ref, kto, call, opts = case(name, list(CASES).index(name))
    want = headloss.LossPlan(V, "float32", grad_dtype="float32", **opts)(x, labels, **call)

    @jax.jit
    def f(z):
        return hlj.preference_loss(z, None, labels, cu, ref, loss=kind, kto_labels=kto, **kw)

    (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(x))
    np.testing.assert_allclose(float(loss), want.scalars[0], rtol=1e-5, atol=1e-6)
    check_metrics(metrics, want.scalars)
    np.testing.assert_allclose(np.asarray(g), want.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CASES)
def test_linear_form(name):
    kind, kw, _, labels, cu, ref, kto, call, opts = case(name, 10 + list(CASES).index(name))
    rng = np.random.default_rng(20 + list(CASES).index(name))
    hidden = rng.normal(size=(len(labels), H)).astype(np.float32)
    weight = rng.normal(size=(V, H)).astype(np.float32)
    plan = headloss.LinearLossPlan(V, H, "float32", grad_hidden="write", grad_weight="write", **opts)
    want = plan(hidden, weight, labels, **call)

    @jax.jit
    def f(h, w):
        loss, metrics = hlj.preference_loss(h, w, labels, cu, ref, loss=kind, kto_labels=kto, **kw)
        return 2 * loss, metrics  # the incoming gradient scales the one formed in the pass

    (loss, metrics), (gh, gw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hidden, weight)
    np.testing.assert_allclose(float(loss), 2 * want.scalars[0], rtol=1e-5, atol=1e-6)
    check_metrics(metrics, want.scalars)
    np.testing.assert_allclose(np.asarray(gh), 2 * np.asarray(want.grad_hidden), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gw), 2 * np.asarray(want.grad_weight), rtol=1e-5, atol=1e-6)


def test_per_sequence_inputs_checked():
    _, _, x, labels, cu, _, _, _, _ = case("dpo_ipo", 0)
    S = len(cu) - 1
    with pytest.raises(headloss.HeadlossError, match="ref_seq_logprobs"):
        hlj.preference_loss(jnp.asarray(x), None, labels, cu, np.zeros(S + 1, np.float32))
    with pytest.raises(headloss.HeadlossError, match="ref_seq_logprobs"):
        hlj.fused_loss(jnp.asarray(x), labels, terms="preference", ref_seq_logprobs=np.zeros(S, np.float32))
    with pytest.raises(headloss.HeadlossError, match="kto_labels"):
        hlj.fused_loss(jnp.asarray(x), labels, terms="preference", preference="kto", cu_seqlens=cu,
                       ref_seq_logprobs=np.zeros(S, np.float32), kto_labels=np.zeros(S, np.float32))
