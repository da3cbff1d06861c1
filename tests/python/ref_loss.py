"""An independent fp64 NumPy reference of the fused loss plan (the header's formulas): whole-matrix
softmaxes and the gradient formulas of the spec's table, term by term."""
from __future__ import annotations

import numpy as np

TERM_NAMES = ("ce", "z", "entropy", "distill_fwd", "distill_rev", "grpo", "kl_ref", "cispo", "distill_jsd")
DISTILL = ("distill_fwd", "distill_rev", "distill_jsd")
REST_FLOOR = 2.0 ** -24  # a sparse teacher's rest masses are at least this (headloss.h)


def _log_softmax(x):
    m = x.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=1, keepdims=True))
    return x - lse, lse[:, 0]


def _xlogy(x, y):
    """x log y with 0 log 0 = 0."""
    return np.where(x > 0, x * np.log(np.where(x > 0, y, 1.0)), 0.0)


def _divergence(kind, p, q, beta, mask):
    """Per-row divergence between distributions p and q over the outcomes where mask is set (the
    columns of [N, M] arrays), and a = dL/dp there: forward KL(q || p), reverse KL(p || q), or the
    generalised JSD beta KL(q || m) + (1 - beta) KL(p || m), m = (1 - beta) p + beta q."""
    p, q = np.where(mask, p, 1.0), np.where(mask, q, 1.0)
    if kind == "distill_fwd":
        L, a = _xlogy(q, q) - _xlogy(q, p), -q / p
    elif kind == "distill_rev":
        L, a = _xlogy(p, p) - _xlogy(p, q), np.log(p / q) + 1
    else:
        m = (1 - beta) * p + beta * q
        L = beta * (_xlogy(q, q) - _xlogy(q, m)) + (1 - beta) * (_xlogy(p, p) - _xlogy(p, m))
        a = beta * -q * (1 - beta) / m + (1 - beta) * (np.log(p / m) + 1 - p * (1 - beta) / m)
    return np.where(mask, L, 0.0).sum(1), np.where(mask, a, 0.0)


def _sparse_teacher(kind, ps, ids, lq, beta):
    """A top-k teacher's divergence with a tail bucket: p_s and q coarsened onto each row's ids
    (< 0: padding) plus one rest outcome (masses floored at REST_FLOOR), the divergence between
    those, and dL/dp_s over the vocabulary (the rest outcome's a off the ids). Returns (L, a, the
    teacher mass of the ids)."""
    N = ps.shape[0]
    ids = np.asarray(ids, np.int64)
    valid = ids >= 0
    rows = np.arange(N)[:, None]
    pk = np.where(valid, ps[rows, np.maximum(ids, 0)], 0.0)
    qk = np.where(valid, np.exp(np.asarray(lq, np.float64)), 0.0)
    pr = np.maximum(1 - pk.sum(1), REST_FLOOR)
    qr = np.maximum(1 - qk.sum(1), REST_FLOOR)
    mask = np.concatenate([valid, np.ones((N, 1), bool)], 1)
    L, a = _divergence(kind, np.concatenate([pk, pr[:, None]], 1), np.concatenate([qk, qr[:, None]], 1),
                       beta, mask)
    full = np.repeat(a[:, -1:], ps.shape[1], 1)
    for i, j in zip(*np.nonzero(valid)):
        full[i, ids[i, j]] = a[i, j]
    return L, full, qk.sum(1)


def reference(z, labels=None, *, terms=("ce",), weights=None, teacher=None, adv=None, old=None,
              ref=None, divisor=0.0, grad_scale=1.0, ce_weight=1.0, z_weight=1.0,
              entropy_weight=1.0, distill_weight=1.0, grpo_weight=1.0, kl_ref_beta=1.0,
              label_smoothing=0.0, logit_scale=1.0, softcap=0.0, teacher_temperature=1.0,
              student_temperature=1.0, eps_low=0.2, eps_high=0.2, ignore_index=None, dual_clip=0.0,
              cispo_weight=1.0, cispo_eps_high=0.0, kl_estimator="k3", rollout=None, cu_seqlens=None,
              ratio_level="token", rollout_correction=None, rollout_level="token", rollout_cap=0.0,
              rollout_floor=0.0, cu_seqlens_dtype=None, jsd_beta=0.0, topk_ids=None, topk_logprobs=None,
              token_scaling=False):
    """Returns (scalars dict, per-token dict, gradient w.r.t. z) for raw logits z [N, V] (fp64).
    GSPO (ratio_level "seq_mean") as verl's GSPO-token: each token's ratio has the value of its
    sequence's and the gradient of its own log-prob. A sparse teacher: topk_ids / topk_logprobs
    [N, k] instead of teacher. token_scaling: each valid token's terms and their gradient times
    its p_y (a constant)."""
    z = np.asarray(z, np.float64)
    N, V = z.shape
    s = logit_scale
    if softcap > 0:
        t = np.tanh(s * z / softcap)
        zh, chain = softcap * t, s * (1 - t * t)
    else:
        zh, chain = s * z, np.full_like(z, s)
    logp_all, lse = _log_softmax(zh)
    p = np.exp(logp_all)
    H = lse - (p * zh).sum(1)
    if labels is None:
        valid = np.ones(N, bool)
        y = np.zeros(N, np.int64)
    else:
        y = np.asarray(labels, np.int64)
        valid = y >= 0
        if ignore_index is not None:
            valid &= y != ignore_index
        y = np.where(valid, y, 0)
    rows = np.arange(N)
    onehot = np.zeros_like(z)
    onehot[rows, y] = 1.0
    w = (np.ones(N) if weights is None else np.asarray(weights, np.float64)) * valid
    W = w.sum()
    D = divisor if divisor > 0 else W
    zy = zh[rows, y]
    logp = zy - lse
    eps = label_smoothing
    per, grads = {}, {}
    per["ce"] = (1 - eps) * (lse - zy) + eps * (lse - zh.mean(1))
    grads["ce"] = p - (1 - eps) * onehot - eps / V
    per["z"] = lse ** 2
    grads["z"] = 2 * lse[:, None] * p
    per["entropy"] = H
    grads["entropy"] = -p * (logp_all + H[:, None])
    if teacher is not None:
        logq, _ = _log_softmax(np.asarray(teacher, np.float64) / teacher_temperature)
        q = np.exp(logq)
        logps, _ = _log_softmax(zh / student_temperature)
        ps = np.exp(logps)
        per["distill_fwd"] = (q * (logq - logps)).sum(1)
        grads["distill_fwd"] = (ps - q) / student_temperature
        kl = (ps * (logps - logq)).sum(1)
        per["distill_rev"] = kl
        grads["distill_rev"] = ps * (logps - logq - kl[:, None]) / student_temperature
        per["distill_jsd"], a = _divergence("distill_jsd", ps, q, jsd_beta, np.ones_like(ps, bool))
        grads["distill_jsd"] = ps * (a - (ps * a).sum(1, keepdims=True)) / student_temperature
    cover = None
    if topk_ids is not None:
        ps = np.exp(_log_softmax(zh / student_temperature)[0])
        for kind in DISTILL:
            per[kind], a, cover = _sparse_teacher(kind, ps, topk_ids, topk_logprobs, jsd_beta)
            grads[kind] = ps * (a - (ps * a).sum(1, keepdims=True)) / student_temperature
    def seq_reduce(x, mean):
        """Per row: the sum (or mean) of x over the valid rows of its sequence."""
        out = np.zeros(N)
        for b, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            v = valid[b:e]
            s = x[b:e][v].sum()
            out[b:e] = s / max(v.sum(), 1) if mean else s
        return out

    if old is not None:
        old = np.asarray(old, np.float64)
        lr = logp - old
        if ratio_level == "seq_mean":
            lr = np.minimum(seq_reduce(lr, True), 10.0)
    r = np.exp(lr) if old is not None else None
    w_is = np.ones(N)
    if rollout is not None and old is not None:
        dr = old - np.asarray(rollout, np.float64)
        if rollout_correction:
            x = dr if rollout_level == "token" else seq_reduce(dr, rollout_level == "seq_mean")
            rho = np.exp(np.clip(x, -20, 20))
            cap = rollout_cap or 2.0
            floor = rollout_floor or 1 / cap
            inside = (rho >= floor) & (rho <= cap)
            w_is, corrected = {"tis": (np.minimum(rho, cap), rho > cap),
                               "mis": (np.where(inside, rho, 0.0), ~inside),
                               "reject": (inside.astype(float), ~inside)}[rollout_correction]
    lo, hi = 1 - eps_low, 1 + eps_high
    if r is not None and adv is not None:
        A = np.asarray(adv, np.float64)
        clipped = -np.minimum(r * A, np.clip(r, lo, hi) * A)
        active = ((A >= 0) & (r <= hi)) | ((A < 0) & (r >= lo))
        # dual clip (verl's clip_ratio_c): negative advantages' loss capped at -c A, constant in r
        dual = (A < 0) & (clipped > -dual_clip * A) if dual_clip > 0 else np.zeros(N, bool)
        per["grpo"] = np.where(dual, -dual_clip * A, clipped)
        grads["grpo"] = (A * r * (active & ~dual))[:, None] * (p - onehot)
        wc = np.minimum(r, 1 + (cispo_eps_high or eps_high))  # stop-gradient weight
        per["cispo"] = -wc * A * logp
        grads["cispo"] = (wc * A)[:, None] * (p - onehot)
        for t in ("grpo", "cispo"):  # the rollout correction's constant weight
            per[t] = per[t] * w_is
            grads[t] = grads[t] * w_is[:, None]
    if ref is not None:
        d = np.asarray(ref, np.float64) - logp
        per["kl_ref"], dk = {"k3": (np.exp(d) - d - 1, 1 - np.exp(d)), "k1": (-d, np.ones(N)),
                             "k2": (d * d / 2, -d)}[kl_estimator]  # (KL, dKL/dlogp)
        grads["kl_ref"] = dk[:, None] * (onehot - p)
    weight_of = {"ce": ce_weight, "z": z_weight, "entropy": entropy_weight,
                 "distill_fwd": distill_weight, "distill_rev": distill_weight,
                 "distill_jsd": distill_weight,
                 "grpo": grpo_weight, "kl_ref": kl_ref_beta, "cispo": cispo_weight}
    tok = np.zeros(N)
    g = np.zeros_like(z)
    if token_scaling:
        for t in terms:
            per[t] = per[t] * np.exp(logp)
            grads[t] = grads[t] * np.exp(logp)[:, None]
    for t in terms:
        tok += weight_of[t] * per[t]
        g += weight_of[t] * grads[t]
    tok = np.where(valid, tok, 0.0)
    kd = grad_scale / D if D > 0 else 0.0
    grad = g * (kd * w)[:, None] * chain
    inv_d = 1 / D if D > 0 else 0.0
    inv_w = 1 / W if W > 0 else 0.0
    wsum = lambda x: float((w * x).sum())  # noqa: E731
    sc = {"loss": wsum(tok) * inv_d, "divisor": D, "weight_sum": W, "valid_rows": float(valid.sum()),
          "lse_mean": wsum(lse) * inv_w, "entropy_mean": wsum(H) * inv_w}
    for name in ("ce", "z", "entropy", "grpo", "kl_ref", "cispo"):
        sc[name] = wsum(per[name]) * inv_d if name in terms else 0.0
    dist = [t for t in DISTILL if t in terms]
    sc["distill"] = wsum(per[dist[0]]) * inv_d if dist else 0.0
    sc["distill_kl_mean"] = wsum(per[dist[0]]) * inv_w if dist else 0.0
    if cover is not None and dist:
        sc["topk_mass"] = wsum(cover) * inv_w
    if labels is not None:
        sc["logp_mean"] = wsum(logp) * inv_w
        sc["accuracy"] = wsum(zh.argmax(1) == y) * inv_w
    pos = w > 0
    if r is not None:
        sc["ratio_mean"] = wsum(r) * inv_w
        sc["ratio_min"], sc["ratio_max"] = float(r[pos].min()), float(r[pos].max())
        sc["clip_any"] = wsum((r < lo) | (r > hi)) * inv_w
        sc["k3_old"] = wsum(r - np.log(r) - 1) * inv_w
        if adv is not None:
            sc["clip_low"] = wsum((A < 0) & (r < lo)) * inv_w
            sc["clip_high"] = wsum((A > 0) & (r > hi)) * inv_w
            sc["dual_clip"] = wsum(dual) * inv_w
    if adv is not None:
        A = np.asarray(adv, np.float64)
        sc["adv_mean"] = wsum(A) * inv_w
        sc["adv_min"], sc["adv_max"] = float(A[pos].min()), float(A[pos].max())
    if ref is not None:
        sc["kl_ref_mean"] = wsum(per["kl_ref"]) * inv_w
    if rollout is not None and old is not None:
        sc["rollout_kl_k1"] = wsum(-dr) * inv_w
        sc["rollout_kl_k3"] = wsum(np.exp(dr) - dr - 1) * inv_w
        if rollout_correction:
            sc["rollout_weight_mean"] = wsum(w_is) * inv_w
            sc["rollout_corrected"] = wsum(corrected) * inv_w
    tokens = {"loss": tok, "logp": np.where(valid & (labels is not None), logp, 0.0), "entropy": H, "lse": lse}
    return sc, tokens, grad


def total_loss(z, labels=None, **kw):
    """The combined loss times grad_scale, as a function of z (for finite differences)."""
    sc, _, _ = reference(z, labels, **kw)
    return sc["loss"] * kw.get("grad_scale", 1.0)


def token_reference(z, labels=None, *, logit_scale=1.0, softcap=0.0, ignore_index=None, g_logp=None,
                    g_entropy=None, g_lse=None):
    """Per-token (logp, entropy, lse) of raw logits z [N, V] (fp64; logp 0 where the row is ignored
    or there are no labels), and the vector-Jacobian product of the upstream gradients given
    w.r.t. z: d/dz_hat_j = g_logp ([j = y] - p_j) - g_entropy p_j (log p_j + H) + g_lse p_j (the
    issue's formula), times the soft cap's and logit scale's chain factor."""
    z = np.asarray(z, np.float64)
    N, V = z.shape
    t = np.tanh(logit_scale * z / softcap) if softcap > 0 else None
    zh = softcap * t if softcap > 0 else logit_scale * z
    chain = logit_scale * (1 - t * t) if softcap > 0 else logit_scale
    logp_all, lse = _log_softmax(zh)
    p = np.exp(logp_all)
    H = -(p * logp_all).sum(1)
    y = np.full(N, -1) if labels is None else np.asarray(labels, np.int64)
    valid = (y >= 0) & (y != (-1 if ignore_index is None else ignore_index))
    onehot = np.zeros_like(z)
    onehot[np.nonzero(valid)[0], y[valid]] = 1.0
    logp = np.where(valid, logp_all[np.arange(N), np.maximum(y, 0)], 0.0)
    g = np.zeros_like(z)
    if g_logp is not None:
        g += np.where(valid, np.asarray(g_logp, np.float64), 0.0)[:, None] * (onehot - p)
    if g_entropy is not None:
        g -= np.asarray(g_entropy, np.float64)[:, None] * p * (logp_all + H[:, None])
    if g_lse is not None:
        g += np.asarray(g_lse, np.float64)[:, None] * p
    return {"logp": logp, "entropy": H, "lse": lse}, g * chain
