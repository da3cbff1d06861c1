"""An independent fp64 NumPy reference of the plan's preference losses, written from the papers'
formulas as TRL's dpo_loss / cpo / orpo / kto trainers state them (headloss.h, "Preference
losses"): sequence log-probs from per-token log-softmax, the pair (or KTO sequence) losses, TRL's
metrics, and the gradient w.r.t. the logits by the chain rule through each sequence's log-prob."""
from __future__ import annotations

import numpy as np

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
              "apo_zero", "apo_down", "discopop")


def _logsig(x):
    return -np.logaddexp(0.0, -x)


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def pair_losses(kind, loss_type, c, r, rc, rr, beta=0.1, gamma=0.0, smoothing=0.0, tau=0.05):
    """Per-pair losses of log-probs c, r (references rc, rr; zeros reference-free), [P] each."""
    if kind == "orpo":
        lo = (c - r) - (np.log1p(-np.exp(c)) - np.log1p(-np.exp(r)))
        return -beta * _logsig(lo)
    if kind == "simpo":
        x = beta * (c - r) - gamma
        return -(1 - smoothing) * _logsig(x) - smoothing * _logsig(-x)
    u, l = c - rc, r - rr
    x, e = beta * (u - l), smoothing
    if loss_type == "sigmoid":
        return -(1 - e) * _logsig(x) - e * _logsig(-x)
    if loss_type == "hinge":
        return np.maximum(0.0, 1 - x)
    if loss_type == "ipo":
        return (u - l - 1 / (2 * beta)) ** 2
    if loss_type == "exo_pair":
        e = e or 1e-3
        return _sig(x) * (_logsig(x) - np.log1p(-e)) + _sig(-x) * (_logsig(-x) - np.log(e))
    if loss_type == "nca_pair":
        return -_logsig(beta * u) - 0.5 * _logsig(-beta * u) - 0.5 * _logsig(-beta * l)
    if loss_type == "robust":
        return (-(1 - e) * _logsig(x) + e * _logsig(-x)) / (1 - 2 * e)
    if loss_type == "bco_pair":
        return -_logsig(beta * u) - _logsig(-beta * l)
    if loss_type == "sppo_hard":
        return (u - 0.5 / beta) ** 2 + (l + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - _sig(beta * u) + _sig(beta * l)
    if loss_type == "apo_down":
        return _sig(beta * u) + 1 - _sig(x)
    m = _sig(x / tau)  # discopop
    return -_logsig(x) * (1 - m) + np.exp(-x) * m


def seq_logps(logits, labels, cu, mean):
    """Each sequence's sum (or mean) of its tokens' logp_y, and the tokens' logp."""
    z = np.asarray(logits, np.float64)
    lse = np.logaddexp.reduce(z, axis=1)
    valid = labels >= 0
    logp = np.where(valid, z[np.arange(len(z)), np.maximum(labels, 0)] - lse, 0.0)
    out = []
    for b, e in zip(cu[:-1], cu[1:]):
        n = valid[b:e].sum()
        s = logp[b:e].sum()
        out.append(s / n if mean and n else (0.0 if mean else s))
    return np.array(out), logp


def preference(kind, loss_type, logits, labels, cu, ref=None, kto_labels=None, mean=False, beta=0.1,
               gamma=0.0, smoothing=0.0, tau=0.05, w_d=1.0, w_u=1.0):
    """(term, metrics dict) of the plan's preference term on logits [rows, vocab]."""
    v, _ = seq_logps(logits, labels, cu, mean)
    S = len(v)
    ref = np.zeros(S) if ref is None else np.asarray(ref, np.float64)
    if kind == "kto":
        k = np.asarray(kto_labels)
        kl = k < 0
        z0 = max((v[kl] - ref[kl]).mean(), 0.0) if kl.any() else 0.0
        good, bad = k > 0, k == 0
        lr = v - ref
        losses = np.concatenate([w_d * (1 - _sig(beta * (lr[good] - z0))), w_u * (1 - _sig(beta * (z0 - lr[bad])))])
        rc, rr = beta * lr[good], beta * lr[bad]
        mean_ = lambda a: a.mean() if len(a) else 0.0  # noqa: E731
        m = dict(rewards_chosen=mean_(rc), rewards_rejected=mean_(rr), rewards_margin=mean_(rc) - mean_(rr),
                 logps_chosen=mean_(v[good]), logps_rejected=mean_(v[bad]), kto_kl=z0)
        return mean_(losses), m
    P = S // 2
    c, r, rc, rr = v[:P], v[P:], ref[:P], ref[P:]
    losses = pair_losses(kind, loss_type, c, r, rc, rr, beta, gamma, smoothing, tau)
    wc, wr = beta * (c - rc), beta * (r - rr)
    m = dict(rewards_chosen=wc.mean(), rewards_rejected=wr.mean(), rewards_accuracy=(wc > wr).mean(),
             rewards_margin=(wc - wr).mean(), logps_chosen=c.mean(), logps_rejected=r.mean())
    if kind == "orpo":
        lo = (c - r) - (np.log1p(-np.exp(c)) - np.log1p(-np.exp(r)))
        m.update(log_odds_ratio=_logsig(lo).mean(), log_odds_chosen=lo.mean())
    return losses.mean(), m
