// Sequence-level preference losses (headloss.h, "Preference losses"), one implementation for both
// backends: from each sequence's log-prob (SeqSums), a pair's (or a KTO sequence's) loss, its
// metrics and dL/dv of each sequence, which the finish step adds to every token of the sequence as
// an upstream gradient of its logp (RowInputs::seq_g). The CPU backend runs it in double, the CUDA
// kernel (kernels/loss/preference.cu) in float.
#pragma once

#include "hl/loss/row_math.h"

namespace hl::loss {

// The plan's preference options, defaults resolved (kind -1: no preference term).
struct PrefOptions {
  int kind;          // HL_LOSS_PREF_*
  int type;          // HL_LOSS_DPO_* (DPO, CPO; SimPO runs as SIGMOID)
  bool mean;         // v_s is the mean of its tokens' logp (else the sum)
  bool reference;    // ref_seq_logprobs is read (DPO, KTO)
  float weight, beta, gamma, smoothing, tau, w_desirable, w_undesirable;
};

// log sigma(x) and sigma(x), stable for either sign.
template <class F>
HL_HD F log_sigmoid(F x) { return m_min(x, F(0)) - m_log(F(1) + m_exp(-m_abs(x))); }
template <class F>
HL_HD F sigmoid(F x) { return F(1) / (F(1) + m_exp(-x)); }

// Sums over pairs (KTO: sequences) that the metrics are means of. n_c, n_r: chosen (desirable) and
// rejected (undesirable) sequences; units: pairs (KTO: non-KL sequences), the term's divisor.
template <class F>
struct PrefSums {
  F loss, reward_c, reward_r, logp_c, logp_r, n_c, n_r, acc, lor, lo, units;
};
template <class F>
HL_HD PrefSums<F> pref_zero() { return {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}; }
template <class F>
HL_HD PrefSums<F> add(const PrefSums<F> &a, const PrefSums<F> &b) {
  return {a.loss + b.loss, a.reward_c + b.reward_c, a.reward_r + b.reward_r, a.logp_c + b.logp_c,
          a.logp_r + b.logp_r, a.n_c + b.n_c, a.n_r + b.n_r, a.acc + b.acc, a.lor + b.lor,
          a.lo + b.lo, a.units + b.units};
}

// A sequence's log-prob v_s from its sums (SeqSums::lr holds the sum of its tokens' logp).
template <class F>
HL_HD F seq_logp(const SeqSums<F> &s, const PrefOptions &o) {
  return o.mean ? (s.n > F(0) ? s.lr / s.n : F(0)) : s.lr;
}

// DPO-family loss of one pair at x = b (u - l) (u, l: the log-ratios, or the log-probs without a
// reference); *du, *dl: dL/du and dL/dl.
template <class F>
HL_HD F dpo_pair(const PrefOptions &o, F u, F l, F *du, F *dl) {
  const F b = F(o.beta), e = F(o.smoothing), x = b * (u - l);
  F dx = 0, loss = 0;
  *du = *dl = F(0);
  switch (o.type) {
    case HL_LOSS_DPO_HINGE:
      loss = m_max(F(1) - x, F(0));
      dx = x < F(1) ? F(-1) : F(0);
      break;
    case HL_LOSS_DPO_IPO: {
      const F h = u - l - F(0.5) / b;
      *du = F(2) * h, *dl = F(-2) * h;
      return h * h;
    }
    case HL_LOSS_DPO_EXO_PAIR: {
      const F ee = e > F(0) ? e : F(1e-3), s = sigmoid(x), t = sigmoid(-x);
      loss = s * (log_sigmoid(x) - m_log(F(1) - ee)) + t * (log_sigmoid(-x) - m_log(ee));
      dx = s * t * (x - m_log((F(1) - ee) / ee));
      break;
    }
    case HL_LOSS_DPO_NCA_PAIR: {
      const F bu = b * u, bl = b * l;
      loss = -log_sigmoid(bu) - F(0.5) * log_sigmoid(-bu) - F(0.5) * log_sigmoid(-bl);
      *du = b * (-sigmoid(-bu) + F(0.5) * sigmoid(bu)), *dl = b * F(0.5) * sigmoid(bl);
      return loss;
    }
    case HL_LOSS_DPO_ROBUST:
      loss = (-(F(1) - e) * log_sigmoid(x) + e * log_sigmoid(-x)) / (F(1) - F(2) * e);
      dx = (-(F(1) - e) * sigmoid(-x) - e * sigmoid(x)) / (F(1) - F(2) * e);
      break;
    case HL_LOSS_DPO_BCO_PAIR: {
      const F bu = b * u, bl = b * l;
      *du = -b * sigmoid(-bu), *dl = b * sigmoid(bl);
      return -log_sigmoid(bu) - log_sigmoid(-bl);
    }
    case HL_LOSS_DPO_SPPO_HARD: {
      const F hu = u - F(0.5) / b, hl = l + F(0.5) / b;
      *du = F(2) * hu, *dl = F(2) * hl;
      return hu * hu + hl * hl;
    }
    case HL_LOSS_DPO_APO_ZERO: {
      const F su = sigmoid(b * u), sl = sigmoid(b * l);
      *du = -b * su * (F(1) - su), *dl = b * sl * (F(1) - sl);
      return F(1) - su + sl;
    }
    case HL_LOSS_DPO_APO_DOWN: {
      const F su = sigmoid(b * u), sx = sigmoid(x), gx = sx * (F(1) - sx);
      *du = b * (su * (F(1) - su) - gx), *dl = b * gx;
      return su + F(1) - sx;
    }
    case HL_LOSS_DPO_DISCOPOP: {
      const F m = sigmoid(x / F(o.tau)), dm = m * (F(1) - m) / F(o.tau), ex = m_exp(-x);
      const F ls = log_sigmoid(x);
      loss = -ls * (F(1) - m) + ex * m;
      dx = -sigmoid(-x) * (F(1) - m) + ls * dm - ex * m + ex * dm;
      break;
    }
    default:  // SIGMOID (cDPO with e > 0)
      loss = -(F(1) - e) * log_sigmoid(x) - e * log_sigmoid(-x);
      dx = -(F(1) - e) * sigmoid(-x) + e * sigmoid(x);
  }
  *du = b * dx, *dl = -b * dx;
  return loss;
}

// Pair (c, r) of log-probs with references (rc, rr; 0 reference-free): its sums added to *sum,
// dL/dc and dL/dr of its loss into *dc, *dr.
template <class F>
HL_HD void pref_pair(const PrefOptions &o, F c, F r, F rc, F rr, PrefSums<F> *sum, F *dc, F *dr) {
  const F b = F(o.beta);
  F loss = 0, lor = 0, lo = 0;
  if (o.kind == HL_LOSS_PREF_ORPO) {
    // log(1 - e^v) = log(-expm1(v)); d o / d c = 1 / (1 - e^c) = -1 / expm1(c).
    lo = c - r - m_log(-m_expm1(c)) + m_log(-m_expm1(r));
    lor = log_sigmoid(lo);
    loss = -b * lor;
    const F g = -b * sigmoid(-lo);
    *dc = -g / m_expm1(c), *dr = g / m_expm1(r);
  } else if (o.kind == HL_LOSS_PREF_SIMPO) {
    PrefOptions s = o;  // sigmoid at b (c - r) - gamma: u - l shifted by gamma / b
    s.type = HL_LOSS_DPO_SIGMOID;
    loss = dpo_pair(s, c - F(o.gamma) / b, r, dc, dr);
  } else {
    loss = dpo_pair(o, c - rc, r - rr, dc, dr);
  }
  const F wc = b * (c - rc), wr = b * (r - rr);
  *sum = add(*sum, PrefSums<F>{loss, wc, wr, c, r, F(1), F(1), wc > wr ? F(1) : F(0), lor, lo, F(1)});
}

// A KTO sequence of kind `label` (1 desirable, 0 undesirable) at log-prob v, reference ref, KL
// baseline z0: its sums added to *sum; returns dL/dv.
template <class F>
HL_HD F kto_seq(const PrefOptions &o, int label, F v, F ref, F z0, PrefSums<F> *sum) {
  const F b = F(o.beta), reward = b * (v - ref);
  const bool good = label > 0;
  const F x = good ? b * (v - ref - z0) : b * (z0 - v + ref), s = sigmoid(x);
  const F w = good ? F(o.w_desirable) : F(o.w_undesirable);
  PrefSums<F> d = pref_zero<F>();
  d.loss = w * (F(1) - s);
  d.units = F(1);
  if (good) d.reward_c = reward, d.logp_c = v, d.n_c = F(1);
  else d.reward_r = reward, d.logp_r = v, d.n_r = F(1);
  *sum = add(*sum, d);
  const F dx = -w * s * (F(1) - s);
  return good ? b * dx : -b * dx;
}

// KTO's KL baseline z0 from the sum of v_s - ref_s over its n KL completions (a constant).
template <class F>
HL_HD F kto_z0(F sum, F n) { return n > F(0) ? m_max(sum / n, F(0)) : F(0); }

// What each token of a sequence adds to its logp's upstream gradient, from dL/dv_s of its pair's
// (or sequence's) loss: grad_scale times the term's weight, over the term's units; over n_s for a
// mean. units == 0 (no pairs) gives 0.
template <class F>
HL_HD F pref_token_grad(const PrefOptions &o, F dv, const SeqSums<F> &s, F units, F grad_scale) {
  if (units <= F(0)) return F(0);
  const F g = grad_scale * F(o.weight) * dv / units;
  return o.mean ? (s.n > F(0) ? g / s.n : F(0)) : g;
}

// The preference scalars (HL_LOSS_OUT_PREFERENCE on, the first n of the caller's) and the term's
// share of HL_LOSS_OUT_LOSS; kl: KTO's baseline.
constexpr int kPrefScalars = HL_LOSS_OUT_KTO_KL + 1 - HL_LOSS_OUT_PREFERENCE;
template <class F>
HL_HD void pref_scalars(const PrefOptions &o, const PrefSums<F> &s, F kl, float out[kPrefScalars], F *loss) {
  const auto mean = [](F x, F n) { return n > F(0) ? x / n : F(0); };
  const F term = mean(s.loss, s.units);
  const F rc = mean(s.reward_c, s.n_c), rr = mean(s.reward_r, s.n_r);
  out[0] = float(term);
  out[1] = float(rc);
  out[2] = float(rr);
  out[3] = float(mean(s.acc, s.units));
  out[4] = float(rc - rr);
  out[5] = float(mean(s.logp_c, s.n_c));
  out[6] = float(mean(s.logp_r, s.n_r));
  out[7] = float(mean(s.lor, s.units));
  out[8] = float(mean(s.lo, s.units));
  out[9] = float(kl);
  *loss = F(o.weight) * term;
}

// The term's scalars into the caller's first n (an older header's fewer), its share added to loss.
HL_HD void pref_store(const float out[kPrefScalars], float loss, int n, float *scalars) {
  if (n > HL_LOSS_OUT_LOSS) scalars[HL_LOSS_OUT_LOSS] += loss;
  for (int k = 0; k < kPrefScalars && HL_LOSS_OUT_PREFERENCE + k < n; ++k) scalars[HL_LOSS_OUT_PREFERENCE + k] = out[k];
}

}  // namespace hl::loss
