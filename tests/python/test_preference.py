"""The plan's preference term (DPO with every loss type, IPO, SimPO, ORPO, CPO, KTO) on the CPU
backend against the fp64 reference of ref_preference.py: the term, TRL's metrics, and the gradient
against central differences of the reference; both forms, ragged sequences with ignored prompt
tokens, CE on the chosen tokens in the same pass, a vocabulary split against the whole."""
import ml_dtypes
import numpy as np
import pytest

import headloss
from headloss.loss import SCALARS
from ref_preference import LOSS_TYPES, preference, seq_logps

V = 7
S_IDX = {k: i for i, k in enumerate(SCALARS)}


def batch(rng, kind="dpo", seqs=4):
    """Ragged sequences of 1-2 prompt rows (label -100) and 1-4 completion tokens each."""
    lens = [(int(rng.integers(1, 3)), int(rng.integers(1, 5))) for _ in range(seqs)]
    labels = np.concatenate([np.r_[np.full(p, -100), rng.integers(0, V, c)] for p, c in lens]).astype(np.int64)
    cu = np.r_[0, np.cumsum([p + c for p, c in lens])].astype(np.int32)
    logits = rng.normal(size=(len(labels), V)) * 1.5
    return logits, labels, cu


def settings(kind, loss_type):
    """(plan options, reference keywords) of one case."""
    smoothing = {"sigmoid": 0.1, "robust": 0.2, "exo_pair": 0.0}.get(loss_type, 0.0) if kind in ("dpo", "cpo") else 0.0
    opts = dict(preference=kind, pref_beta=0.7)
    ref = dict(beta=0.7, mean=kind in ("simpo", "orpo") or loss_type == "ipo")
    if kind in ("dpo", "cpo"):
        opts["pref_loss_type"] = loss_type
        if smoothing:
            opts["pref_label_smoothing"] = ref["smoothing"] = smoothing
        if loss_type == "discopop":
            opts["pref_tau"] = ref["tau"] = 0.3
    if kind == "simpo":
        opts["pref_gamma"] = ref["gamma"] = 0.4
        opts["pref_label_smoothing"] = ref["smoothing"] = 0.05
    if kind == "kto":
        opts.update(kto_desirable_weight=1.3, kto_undesirable_weight=0.6)
        ref.update(w_d=1.3, w_u=0.6)
    return opts, ref


CASES = ([("dpo", t) for t in LOSS_TYPES] + [("cpo", "sigmoid"), ("cpo", "ipo"), ("simpo", "sigmoid"),
                                              ("orpo", "sigmoid"), ("kto", "sigmoid")])


def inputs(rng, kind, logits, labels, cu):
    S = len(cu) - 1
    kw = {}
    if kind in ("dpo", "kto"):
        kw["ref_seq_logprobs"] = (rng.normal(size=S) - 3).astype(np.float32)
    if kind == "kto":
        kw["kto_labels"] = np.array([1, 0, -1, 1, -1, 0][:S], np.int32)
    return kw


@pytest.mark.parametrize("kind,loss_type", CASES)
def test_term_metrics_and_gradient(kind, loss_type):
    rng = np.random.default_rng(CASES.index((kind, loss_type)))
    logits, labels, cu = batch(rng, kind, 6 if kind == "kto" else 4)
    kw = inputs(rng, kind, logits, labels, cu)
    opts, rkw = settings(kind, loss_type)
    plan = headloss.LossPlan(V, "float32", terms="preference", grad_dtype="float32", **opts)
    x = logits.astype(np.float32)
    out = plan(x, labels, cu_seqlens=cu, grad_scale=1.5, **kw)
    ref_args = dict(ref=kw.get("ref_seq_logprobs"), kto_labels=kw.get("kto_labels"), **rkw)
    if kind not in ("dpo", "kto"):
        ref_args["ref"] = None
    xt = x.astype(np.float64)
    want, metrics = preference(kind, loss_type, xt, labels, cu, **ref_args)
    sc = np.asarray(out.scalars, np.float64)
    np.testing.assert_allclose(sc[S_IDX["preference"]], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sc[S_IDX["loss"]], want, rtol=1e-5, atol=1e-6)
    for k, v in metrics.items():
        np.testing.assert_allclose(sc[S_IDX[k]], v, rtol=1e-5, atol=1e-6, err_msg=k)
    # central differences of the fp64 reference
    h, num = 1e-6, np.zeros_like(xt)
    for i in range(xt.shape[0]):
        for j in range(V):
            p, m = xt.copy(), xt.copy()
            p[i, j] += h
            m[i, j] -= h
            num[i, j] = (preference(kind, loss_type, p, labels, cu, **ref_args)[0] -
                         preference(kind, loss_type, m, labels, cu, **ref_args)[0]) / (2 * h)
    np.testing.assert_allclose(np.asarray(out.grad, np.float64), 1.5 * num, rtol=2e-4, atol=2e-6)


def test_nll_on_chosen_tokens_in_the_same_pass():
    rng = np.random.default_rng(3)
    logits, labels, cu = batch(rng)
    x = logits.astype(np.float32)
    P = (len(cu) - 1) // 2
    w = (np.arange(len(labels)) < cu[P]).astype(np.float32)  # CE on the chosen sequences alone
    plan = headloss.LossPlan(V, "float32", terms=("ce", "preference"), preference="orpo", ce_weight=1.0)
    out = plan(x, labels, cu_seqlens=cu, weights=w)
    want, _ = preference("orpo", "sigmoid", x.astype(np.float64), labels, cu, mean=True)
    _, logp = seq_logps(x.astype(np.float64), labels, cu, False)
    chosen = (labels >= 0) & (w > 0)
    nll = -logp[chosen].mean()
    sc = np.asarray(out.scalars, np.float64)
    np.testing.assert_allclose(sc[S_IDX["ce"]], nll, rtol=1e-5)
    np.testing.assert_allclose(sc[S_IDX["loss"]], nll + want, rtol=1e-5)


def test_linear_form_matches_logits_form():
    rng = np.random.default_rng(5)
    _, labels, cu = batch(rng)
    H = 5
    hidden = rng.normal(size=(len(labels), H)).astype(np.float32)
    weight = rng.normal(size=(V, H)).astype(np.float32)
    ref = (rng.normal(size=len(cu) - 1) - 3).astype(np.float32)
    logits = (hidden.astype(np.float64) @ weight.astype(np.float64).T).astype(np.float32)
    opts = dict(terms="preference", preference="dpo", pref_loss_type="ipo")
    out = headloss.LossPlan(V, "float32", **opts)(logits, labels, cu_seqlens=cu, ref_seq_logprobs=ref)
    lin = headloss.LinearLossPlan(V, H, "float32", grad_weight="write", **opts)
    lo = lin(hidden, weight, labels, cu_seqlens=cu, ref_seq_logprobs=ref)
    np.testing.assert_allclose(lo.scalars, out.scalars, rtol=1e-5, atol=1e-6)
    g = np.asarray(out.grad, np.float64)
    np.testing.assert_allclose(lo.grad_hidden, g @ weight, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(lo.grad_weight, g.T @ hidden, rtol=1e-4, atol=1e-6)


def test_sharded_equals_unsharded():
    rng = np.random.default_rng(7)
    logits, labels, cu = batch(rng)
    x = logits.astype(np.float32)
    ref = (rng.normal(size=len(cu) - 1) - 3).astype(np.float32)
    opts = dict(terms="preference", preference="dpo", pref_loss_type="sigmoid")
    whole = headloss.LossPlan(V, "float32", **opts)(x, labels, cu_seqlens=cu, ref_seq_logprobs=ref)
    cuts = [(0, 3), (3, V)]
    plans = [headloss.LossPlan(b - a, "float32", vocab_start=a, vocab_global=V, ranks=2, **opts) for a, b in cuts]
    blocks = [p.stats(np.ascontiguousarray(x[:, a:b]), labels) for p, (a, b) in zip(plans, cuts)]
    gathered = np.concatenate([np.asarray(b).ravel() for b in blocks])
    outs = [p.finish(gathered, np.ascontiguousarray(x[:, a:b]), labels, cu_seqlens=cu, ref_seq_logprobs=ref)
            for p, (a, b) in zip(plans, cuts)]
    np.testing.assert_allclose(outs[0].scalars, whole.scalars, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.concatenate([o.grad for o in outs], 1), whole.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("opts,inputs_,message", [
    (dict(preference="simpo"), dict(ref_seq_logprobs=np.zeros(4, np.float32)), "reference-free"),
    (dict(preference="dpo"), {}, "ref_seq_logprobs is NULL"),
    (dict(preference="kto"), dict(ref_seq_logprobs=np.zeros(4, np.float32)), "kto_labels is NULL"),
])
def test_argument_errors(opts, inputs_, message):
    rng = np.random.default_rng(1)
    logits, labels, cu = batch(rng)
    plan = headloss.LossPlan(V, "float32", terms="preference", **opts)
    with pytest.raises(headloss.HeadlossError, match=message):
        plan(logits.astype(np.float32), labels, cu_seqlens=cu, **inputs_)


@pytest.mark.parametrize("opts,message", [
    (dict(terms="ce", pref_beta=0.2), "pref_beta is 0.2 but the plan has no HL_LOSS_PREFERENCE"),
    (dict(terms="preference", preference="orpo", pref_loss_type="hinge"), "only DPO and CPO"),
    (dict(terms="preference", pref_gamma=0.5), "not SimPO"),
    (dict(terms="preference", pref_label_smoothing=0.5), r"in \[0, 0.5\)"),
    (dict(terms="preference", pref_loss_type="hinge", pref_label_smoothing=0.1), "has none"),
])
def test_plan_errors(opts, message):
    with pytest.raises(headloss.HeadlossError, match=message):
        headloss.LossPlan(V, "float32", **opts)


@pytest.mark.parametrize("kind,loss_type", CASES)
def test_cuda_matches_cpu(gpu, kind, loss_type):
    """The CUDA backend (its preference kernel between the statistics and the finish) against the
    CPU backend, in both forms: every scalar, and the gradients (poisoned before the call) by
    relative norm error; bf16 logits in the logits form, fp32 in the linear one."""
    rng = np.random.default_rng(100 + CASES.index((kind, loss_type)))
    _, labels, cu = batch(rng, kind, 6 if kind == "kto" else 4)
    H = 16
    hidden = rng.normal(size=(len(labels), H)).astype(np.float32)
    weight = (rng.normal(size=(V, H)) / 2).astype(np.float32)
    kw = inputs(rng, kind, None, labels, cu)
    opts, _ = settings(kind, loss_type)
    dev = {k: gpu.put(v) for k, v in kw.items()}
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    # logits form, bf16 logits (their rounded values on both backends)
    logits = (hidden @ weight.T).astype(ml_dtypes.bfloat16)
    cpu = headloss.LossPlan(V, "bfloat16", terms="preference", grad_dtype="float32", **opts)(
        logits, labels, cu_seqlens=cu, grad_scale=1.5, **kw)
    grad = gpu.empty_like_poisoned((len(labels), V), "float32")
    out = headloss.LossPlan(V, "bfloat16", terms="preference", grad_dtype="float32", device="cuda", **opts)(
        gpu.put(logits), gpu.put(labels), cu_seqlens=gpu.put(cu), grad_scale=1.5, grad=grad, **dev)
    np.testing.assert_allclose(gpu.get(out.scalars), np.asarray(cpu.scalars, np.float64), rtol=2e-4, atol=1e-6)
    assert rel(gpu.get(grad), np.asarray(cpu.grad, np.float64)) < 1e-5
    # fused linear form, fp32
    lin = dict(terms="preference", grad_weight="write", **opts)
    cpu = headloss.LinearLossPlan(V, H, "float32", **lin)(hidden, weight, labels, cu_seqlens=cu, **kw)
    gh, gw = gpu.empty_like_poisoned((len(labels), H), "float32"), gpu.empty_like_poisoned((V, H), "float32")
    out = headloss.LinearLossPlan(V, H, "float32", device="cuda", **lin)(
        gpu.put(hidden), gpu.put(weight), gpu.put(labels), cu_seqlens=gpu.put(cu), grad_hidden=gh,
        grad_weight=gw, **dev)
    np.testing.assert_allclose(gpu.get(out.scalars), np.asarray(cpu.scalars, np.float64), rtol=2e-4, atol=1e-6)
    assert rel(gpu.get(gh), np.asarray(cpu.grad_hidden, np.float64)) < 1e-4
    assert rel(gpu.get(gw), np.asarray(cpu.grad_weight, np.float64)) < 1e-4
