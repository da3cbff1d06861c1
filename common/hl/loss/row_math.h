// The loss plan's row-level math, one implementation for both backends: the CPU reference runs it
// in double, the CUDA kernels in float. A row's vocabulary is summarised by a RowStats record
// (softmax statistics that merge exactly by log-sum-exp rescaling, so slices of a row: threads,
// CTAs of a cluster, and later tensor-parallel shards, combine in any fixed order); finish_row
// turns the merged record into the row's losses, metrics and gradient coefficients, and
// grad_elem gives one gradient element from them.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "headloss.h"
#include "hl/host_device.h"

namespace hl::loss {

HL_HD float m_exp(float x) { return expf(x); }
HL_HD double m_exp(double x) { return exp(x); }
HL_HD float m_log(float x) { return logf(x); }
HL_HD double m_log(double x) { return log(x); }
HL_HD float m_expm1(float x) { return expm1f(x); }
HL_HD double m_expm1(double x) { return expm1(x); }
HL_HD float m_abs(float x) { return fabsf(x); }
HL_HD double m_abs(double x) { return fabs(x); }
template <class F> HL_HD F m_max(F a, F b) { return a > b ? a : b; }
template <class F> HL_HD F m_min(F a, F b) { return a < b ? a : b; }
template <class F> HL_HD F neg_inf() { return -F(INFINITY); }

// How a row's distillation runs: a dense teacher's divergence, or a sparse (top-k) teacher of any
// divergence (Options::divergence says which).
enum DistillMode : int {
  kDistillNone = 0, kDistillFwd = 1, kDistillRev = 2, kDistillJsd = 3, kDistillSparse = 4
};
constexpr int kMaxTopk = 256;
// The floor of a sparse teacher's rest masses p_r and q_r (2^-24; headloss.h).
constexpr double kRestFloor = 5.9604644775390625e-08;
// A teacher log-prob above this (or NaN, or infinite) is an error: rounding may lift a log-prob
// of ~0 a little above 0, logits passed by mistake go far above.
constexpr float kTopkLogprobTol = 1e-3f;
HL_HD bool topk_logprob_ok(float lp) { return lp <= kTopkLogprobTol && lp >= -3.402823466e38f; }
// A sparse teacher's id in a record of another shard's (or padding): no z_hat there. The ranks'
// records merge by max, so the owner's z_hat wins (and -inf, a real z_hat of -inf, stays exact).
template <class F> HL_HD F topk_absent() { return neg_inf<F>(); }

// The plan's options as the row math uses them: off terms have weight 0 and defaults resolved.
struct Options {
  float ce_w, z_w, ent_w, dist_w, grpo_w, beta, cispo_w;
  float smoothing, scale, cap, inv_tt, inv_ts, eps_low, eps_high;
  float dual_clip;    // 0: off
  float cispo_eps;    // CISPO's upper clip of r is 1 + cispo_eps
  int distill;        // DistillMode
  int divergence;     // kDistillFwd, _Rev or _Jsd: the distillation term's (also for a sparse teacher)
  float jsd_beta;     // JSD's b in (0, 1)
  int topk;           // k of a sparse teacher; 0: dense
  int kl_estimator;   // HL_LOSS_KL_*
  bool seq_ratio;     // GSPO: r is the sequence's (RowInputs::seq_lr)
  int rollout;        // HL_LOSS_ROLLOUT_*
  int rollout_level;  // HL_LOSS_LEVEL_*
  float rollout_cap, rollout_floor;
  bool token_scaling; // HL_LOSS_TOKEN_SCALING: a token's loss and gradient times its p_y (a constant)
  int scalars;        // how many scalars the caller's header has (an older one: fewer)
  unsigned terms;     // HL_LOSS_* bits
  int64_t vocab;
};

// Softmax statistics of (a slice of) one row. z is z_hat; v = teacher / teacher_temperature.
// Sums are taken relative to the record's own maxima m and mt, so every term stays bounded.
template <class F>
struct RowStats {
  F m, s, b;      // max z; sum e; sum e (z - m); e = exp(z - m)
  F sum;          // sum z (label smoothing)
  F zy;           // the label's z (-inf where the label is not in this slice)
  int64_t amax;   // first column where z == m
  F mt, st, bt;   // teacher: max v; sum et; sum et (v - mt); et = exp(v - mt)
  F ct;           // sum et (z - m)                         (forward KL)
  F ss, bs, cs;   // sum es; sum es (z - m); sum es (v - mt)  es = exp((z - m) / tau_s)
};

template <class F>
HL_HD RowStats<F> empty_stats() {
  const F ni = neg_inf<F>();
  return RowStats<F>{ni, 0, 0, 0, ni, INT64_MAX, ni, 0, 0, 0, 0, 0, 0};
}

// f * (sum + weight * dm): a sum of e * (x - old_max) moved to a new max, f = the rescale of e.
// An empty part (f == 0) stays 0 even where dm is infinite.
template <class F>
HL_HD F moved(F f, F sum, F weight, F dm) { return f > F(0) ? f * (sum + weight * dm) : F(0); }
template <class F>
HL_HD F rescale(F old_max, F new_max, F k = F(1)) {
  return old_max == neg_inf<F>() ? F(0) : m_exp((old_max - new_max) * k);
}
template <class F>
HL_HD F shift(F old_max, F new_max) { return old_max == neg_inf<F>() ? F(0) : old_max - new_max; }

// Exact merge of two records (the order of a and b only affects rounding). TEACHER: also the
// distillation fields (without it they are left as a's: a plan without distillation has none).
template <bool TEACHER = true, class F>
HL_HD RowStats<F> merge(const RowStats<F> &a, const RowStats<F> &b, F inv_ts) {
  RowStats<F> r;
  r.m = m_max(a.m, b.m);
  const F fa = rescale(a.m, r.m), fb = rescale(b.m, r.m);
  const F da = shift(a.m, r.m), db = shift(b.m, r.m);
  r.s = fa * a.s + fb * b.s;
  r.b = moved(fa, a.b, a.s, da) + moved(fb, b.b, b.s, db);
  r.sum = a.sum + b.sum;
  r.zy = m_max(a.zy, b.zy);
  r.amax = a.m > b.m ? a.amax : b.m > a.m ? b.amax : (a.amax < b.amax ? a.amax : b.amax);
  if (!TEACHER) {
    r.mt = a.mt, r.st = a.st, r.bt = a.bt, r.ct = a.ct, r.ss = a.ss, r.bs = a.bs, r.cs = a.cs;
    return r;
  }
  r.mt = m_max(a.mt, b.mt);
  const F ta = rescale(a.mt, r.mt), tb = rescale(b.mt, r.mt);
  const F dta = shift(a.mt, r.mt), dtb = shift(b.mt, r.mt);
  r.st = ta * a.st + tb * b.st;
  r.bt = moved(ta, a.bt, a.st, dta) + moved(tb, b.bt, b.st, dtb);
  r.ct = moved(ta, a.ct, a.st, da) + moved(tb, b.ct, b.st, db);
  const F sa = rescale(a.m, r.m, inv_ts), sb = rescale(b.m, r.m, inv_ts);
  r.ss = sa * a.ss + sb * b.ss;
  r.bs = moved(sa, a.bs, a.ss, da) + moved(sb, b.bs, b.ss, db);
  r.cs = moved(sa, a.cs, a.ss, dta) + moved(sb, b.cs, b.ss, dtb);
  return r;
}

// Per-row record reduced over rows into the scalars (fields are unweighted; W is w_t, 0 if ignored).
enum Rec : int {
  R_W, R_VALID, R_LOSS, R_CE, R_Z, R_ENT, R_DIST, R_GRPO, R_KLREF, R_LSE, R_H, R_LOGP, R_ACC,
  R_RATIO, R_CLIP_LO, R_CLIP_HI, R_CLIP_ANY, R_K3OLD, R_ADV, R_CISPO, R_DUAL, R_RKL1, R_RKL3,
  R_RWEIGHT, R_RCORR, R_COVER, kRecFields
};

// What the caller passed for this row, and its sequence's values (SeqValues).
template <class F>
struct RowInputs {
  int64_t label;  // < 0: ignored (or no labels)
  bool valid;     // the row counts
  bool has_label;
  F w;            // per-token weight (1 without weights)
  F adv, old_logp, ref_logp, rollout_logp;
  bool has_adv, has_old, has_ref, has_rollout;
  F seq_lr, seq_roll;  // see SeqValues (0 without sequences)
  F g_logp, g_ent, g_lse;  // per-token upstream gradients (headloss.h; 0 where not passed)
  F seq_g;  // the sequence's preference gradient on this token's logp (preference.h; else 0)
};

// Per-row pointers of a call (device pointers on CUDA, host ones on the CPU); seq_lr and
// seq_roll are the sequence values of each row (SeqValues), where the plan needs them.
struct RowSource {
  const void *labels;
  const float *weights, *adv, *old_logp, *ref_logp, *rollout_logp, *seq_lr, *seq_roll;
  bool labels64, use_ignore;
  int64_t ignore_index;
  const float *g_logp, *g_ent, *g_lse;
  const float *seq_g;  // [rows] RowInputs::seq_g, where the plan has a preference term
};

// A row is ignored when its label is negative or equals the plan's ignore_index.
HL_HD bool label_counts(int64_t label, bool use_ignore, int64_t ignore_index) {
  return label >= 0 && !(use_ignore && label == ignore_index);
}

// The label of row i; -1 where the row is ignored (or there are no labels).
HL_HD int64_t read_label(const RowSource &s, int64_t i) {
  if (!s.labels) return -1;
  const int64_t y = s.labels64 ? static_cast<const int64_t *>(s.labels)[i]
                               : int64_t(static_cast<const int32_t *>(s.labels)[i]);
  return label_counts(y, s.use_ignore, s.ignore_index) ? y : -1;
}

// Row i's inputs.
template <class F>
HL_HD RowInputs<F> read_inputs(const RowSource &s, int64_t i) {
  RowInputs<F> in;
  in.has_label = s.labels != nullptr;
  in.label = read_label(s, i);
  in.valid = !in.has_label || in.label >= 0;
  in.w = s.weights ? F(s.weights[i]) : F(1);
  const auto opt = [i](const float *p, bool &has) { has = p != nullptr; return has ? F(p[i]) : F(0); };
  in.adv = opt(s.adv, in.has_adv);
  in.old_logp = opt(s.old_logp, in.has_old);
  in.ref_logp = opt(s.ref_logp, in.has_ref);
  in.rollout_logp = opt(s.rollout_logp, in.has_rollout);
  in.seq_lr = s.seq_lr ? F(s.seq_lr[i]) : F(0);
  in.seq_roll = s.seq_roll ? F(s.seq_roll[i]) : F(0);
  const auto grad = [i](const float *p) { return p ? F(p[i]) : F(0); };
  in.g_logp = grad(s.g_logp), in.g_ent = grad(s.g_ent), in.g_lse = grad(s.g_lse);
  in.seq_g = grad(s.seq_g);
  return in;
}

// logp_y of a row's merged record (-inf where no label is in it).
template <class F>
HL_HD F label_logp(const RowStats<F> &st) { return st.zy - (st.m + m_log(st.s)); }

// A sequence's sums over its tokens (rows not ignored), which SeqValues turns into the values
// every row of it reads: n tokens, sum of logp_y - old_logprob (GSPO), sum of old_logprob -
// rollout_logprob (the rollout correction's sequence levels).
template <class F>
struct SeqSums {
  F n, lr, roll;
};
// seq_lr: GSPO's log-ratio, the mean clamped at 10 (verl); seq_roll: the rollout log-ratio x of
// the plan's rollout_level (before the clamp to [-20, 20] of rollout_weight).
template <class F>
HL_HD void seq_values(const SeqSums<F> &s, const Options &o, F *seq_lr, F *seq_roll) {
  const F inv = s.n > F(0) ? F(1) / s.n : F(0);
  *seq_lr = m_min(s.lr * inv, F(10));
  *seq_roll = o.rollout_level == HL_LOSS_LEVEL_SEQ_MEAN ? s.roll * inv : s.roll;
}

// The rollout correction's weight w_is of a token (1 without one); *corrected: w_is != rho.
template <class F>
HL_HD F rollout_weight(const RowInputs<F> &in, const Options &o, bool *corrected) {
  *corrected = false;
  if (o.rollout == HL_LOSS_ROLLOUT_NONE) return F(1);
  const F x = o.rollout_level == HL_LOSS_LEVEL_TOKEN ? in.old_logp - in.rollout_logp : in.seq_roll;
  const F rho = m_exp(m_min(m_max(x, F(-20)), F(20)));
  const F hi = F(o.rollout_cap), lo = F(o.rollout_floor);
  if (o.rollout == HL_LOSS_ROLLOUT_TIS) {
    *corrected = rho > hi;
    return m_min(rho, hi);
  }
  const bool in_band = rho >= lo && rho <= hi;
  *corrected = !in_band;
  return !in_band ? F(0) : o.rollout == HL_LOSS_ROLLOUT_MIS ? rho : F(1);
}

// Gradient of row t w.r.t. the raw logit z_j (before the soft-cap chain factor):
//   g = p_j (cp + cpz z_j) + cc + [j == y] cy  (+ distillation through dk)
template <class F>
struct RowResult {
  F rec[kRecFields];
  F lse, entropy, logp, token_loss;
  int64_t argmax;  // the record's first maximal column
  F cp, cpz, cc, cy, dk;
  F lse_s, lse_t, dist_loss;  // distillation: student lse at tau_s, teacher lse (v units), KL
  F dsum, ar;  // JSD and sparse: sum_i p_s_i a_i; sparse: a_r, the rest bucket's a (headloss.h)
};

// The exponential and log of a column's math: libm's here (the CPU backend's fp64); the CUDA
// kernels pass their one-instruction approximations (row_stats.cuh's FastMath).
template <class F>
struct LibMath {
  HL_HD F exp(F x) const { return m_exp(x); }
  HL_HD F log(F x) const { return m_log(x); }
};

// One outcome's share of a divergence (headloss.h) at student and teacher log-probs lps, lq: its
// term l_j, p_j a_j (a_j = dL/dp_j; formed without dividing by p_j), p_j and q_j. Summed over a
// row's outcomes: the divergence, sum_j p_j a_j, and the masses.
template <class F>
struct DivSums {
  F loss, pa, p, q;
};
// JSD's share from p = e^lps and q = e^lq already formed: log m_j = log((1 - b) p + b q) takes
// one log and no more exponentials; floored at F's least normal, so that a column where both
// underflow adds 0 (not 0 * inf).
template <class F, class M>
HL_HD DivSums<F> jsd_elem(F b, F lps, F lq, F p, F q, const M &m) {
  const F lm = m.log(m_max((F(1) - b) * p + b * q, std::numeric_limits<F>::min())), pl = p * (lps - lm);
  return {b * q * (lq - lm) + (F(1) - b) * pl, (F(1) - b) * pl, p, q};
}
template <class F, class M = LibMath<F>>
HL_HD DivSums<F> div_elem(int divergence, F b, F lps, F lq, const M &m = M{}) {
  const F p = m.exp(lps), q = m.exp(lq);
  if (divergence == kDistillFwd) return {q * (lq - lps), -q, p, q};
  if (divergence == kDistillRev) return {p * (lps - lq), p * (lps - lq + F(1)), p, q};
  return jsd_elem(b, lps, lq, p, q, m);
}
template <class F>
HL_HD DivSums<F> add(const DivSums<F> &a, const DivSums<F> &b) {
  return {a.loss + b.loss, a.pa + b.pa, a.p + b.p, a.q + b.q};
}

// A row's distillation beyond RowStats, from sums over its columns taken once lse_s is known:
// the divergence, sum_i p_i a_i, a_r (sparse) and the teacher mass of the top-k (sparse).
template <class F>
struct DistillRow {
  F loss, pa, ar, cover;
};
// Dense JSD's sums of div_elem over a row's columns that its DistillRow needs: the divergence and
// sum_j p_j a_j. Sharded, each rank's middle step sums its columns, and the finish adds the ranks'.
template <class F>
struct MidSums {
  F loss, pa;
};
template <class F>
HL_HD MidSums<F> add(const MidSums<F> &a, const MidSums<F> &b) { return {a.loss + b.loss, a.pa + b.pa}; }
// A dense JSD row from those sums.
template <class F>
HL_HD DistillRow<F> dense_row(const MidSums<F> &s) { return {s.loss, s.pa, F(0), F(0)}; }
// A sparse teacher's row from the sums of div_elem over its k ids: those plus the rest bucket.
template <class F>
HL_HD DistillRow<F> sparse_row(const Options &o, const DivSums<F> &s) {
  const F pr = m_max(F(1) - s.p, F(kRestFloor)), qr = m_max(F(1) - s.q, F(kRestFloor));
  const DivSums<F> b = div_elem(o.divergence, F(o.jsd_beta), m_log(pr), m_log(qr));
  return {s.loss + b.loss, s.pa + b.pa, b.pa / pr, s.q};
}

// The KL-to-reference estimate at d = ref - logp_y by the plan's estimator; *dk = its derivative
// w.r.t. logp_y (the gradient w.r.t. z_j is *dk (delta_jy - p_j)).
template <class F>
HL_HD F kl_ref(int estimator, F d, F *dk) {
  if (estimator == HL_LOSS_KL_K1) {
    *dk = F(1);
    return -d;
  }
  if (estimator == HL_LOSS_KL_K2) {
    *dk = -d;
    return F(0.5) * d * d;
  }
  const F ed = m_exp(d);
  *dk = F(1) - ed;
  return ed - d - F(1);
}

// The student's lse at its temperature, and the teacher's (v units), from a row's merged record.
template <class F>
HL_HD F student_lse(const RowStats<F> &st, const Options &o) { return st.m * F(o.inv_ts) + m_log(st.ss); }
template <class F>
HL_HD F teacher_lse(const RowStats<F> &st) { return st.mt + m_log(st.st); }

// kd = grad_scale / D (0 when D == 0). dx: dense JSD's and a sparse teacher's sums (else null).
template <class F>
HL_HD RowResult<F> finish_row(const RowStats<F> &st, const RowInputs<F> &in, const Options &o,
                              F kd, const DistillRow<F> *dx = nullptr) {
  RowResult<F> r;
  for (int i = 0; i < kRecFields; ++i) r.rec[i] = F(0);
  const F log_s = m_log(st.s);
  r.lse = st.m + log_s;
  r.entropy = log_s - st.b / st.s;
  const F w = in.valid ? in.w : F(0);
  const F lse = r.lse, H = r.entropy;
  // cg: the policy-gradient terms' coefficient on (p_j - delta_jy), weights included
  F logp = 0, ce = 0, grpo = 0, cispo = 0, klref = 0, dist = 0, cg = 0, ckl = 0;
  if (in.valid && in.has_label) {
    logp = st.zy - lse;
    const F eps = F(o.smoothing);
    ce = (F(1) - eps) * (lse - st.zy) + eps * (lse - st.sum / F(o.vocab));
    r.rec[R_ACC] = st.amax == in.label ? F(1) : F(0);
    if (in.has_old && in.has_rollout) {
      const F d = in.old_logp - in.rollout_logp;
      r.rec[R_RKL1] = -d;
      r.rec[R_RKL3] = m_exp(d) - d - F(1);
    }
    if (in.has_old) {
      const F lr = o.seq_ratio ? in.seq_lr : logp - in.old_logp, ratio = m_exp(lr);
      const F lo = F(1) - F(o.eps_low), hi = F(1) + F(o.eps_high);
      r.rec[R_RATIO] = ratio;
      r.rec[R_K3OLD] = ratio - lr - F(1);
      r.rec[R_CLIP_ANY] = (ratio < lo || ratio > hi) ? F(1) : F(0);
      // The rollout correction's constant weight on the policy-gradient terms.
      bool corrected = false;
      const F wis = in.has_rollout ? rollout_weight(in, o, &corrected) : F(1);
      if (in.has_rollout && o.rollout != HL_LOSS_ROLLOUT_NONE) {
        r.rec[R_RWEIGHT] = wis;
        r.rec[R_RCORR] = corrected ? F(1) : F(0);
      }
      if (in.has_adv) {
        const F A = in.adv, clipped = m_min(m_max(ratio, lo), hi);
        grpo = -m_min(ratio * A, clipped * A);
        bool active = (A >= F(0) && ratio <= hi) || (A < F(0) && ratio >= lo);
        // Dual clip: a negative advantage's loss is capped at -c A, which is constant in r.
        if (o.dual_clip > 0.0f && A < F(0) && grpo > -F(o.dual_clip) * A) {
          grpo = -F(o.dual_clip) * A;
          active = false;
          r.rec[R_DUAL] = F(1);
        }
        const F wcis = m_min(ratio, F(1) + F(o.cispo_eps));  // a constant weight (stop-gradient)
        cispo = -wcis * A * logp;
        cg = F(o.grpo_w) * (active ? A * ratio : F(0)) + F(o.cispo_w) * wcis * A;
        grpo *= wis, cispo *= wis, cg *= wis;
        r.rec[R_CLIP_LO] = (A < F(0) && ratio < lo) ? F(1) : F(0);
        r.rec[R_CLIP_HI] = (A > F(0) && ratio > hi) ? F(1) : F(0);
      }
    }
    if (in.has_ref) klref = kl_ref(o.kl_estimator, in.ref_logp - logp, &ckl);
  }
  if (in.has_adv) r.rec[R_ADV] = in.adv;
  r.lse_s = r.lse_t = r.dist_loss = r.dsum = r.ar = 0;
  if (o.distill != kDistillNone) {
    r.lse_s = student_lse(st, o);
    if (o.distill != kDistillSparse) r.lse_t = teacher_lse(st);
    if (dx) {
      dist = dx->loss;
      r.dsum = dx->pa;
      r.ar = dx->ar;
      r.rec[R_COVER] = dx->cover;
    } else {  // forward or reverse KL from the online sums
      const F log_ss = m_log(st.ss), log_st = m_log(st.st), its = F(o.inv_ts);
      dist = o.distill == kDistillFwd ? st.bt / st.st - log_st - st.ct / st.st * its + log_ss
                                      : st.bs / st.ss * its - log_ss - st.cs / st.ss + log_st;
    }
    r.dist_loss = dist;
  }
  const F ce_w = F(o.ce_w), z_w = F(o.z_w), ent_w = F(o.ent_w), g_w = F(o.grpo_w), beta = F(o.beta);
  // Token scaling's constant p_y (validation keeps it to CE and Z, whose fields it scales).
  const F ts = o.token_scaling && in.valid && in.has_label ? m_exp(logp) : F(1);
  const F tok = ce_w * ce + z_w * lse * lse + ent_w * H + F(o.dist_w) * dist + g_w * grpo +
                F(o.cispo_w) * cispo + beta * klref;
  r.logp = logp;
  r.argmax = st.amax;
  r.token_loss = in.valid ? ts * tok : F(0);
  r.rec[R_W] = w;
  r.rec[R_VALID] = in.valid ? F(1) : F(0);
  r.rec[R_LOSS] = r.token_loss;
  r.rec[R_CE] = ts * ce;
  r.rec[R_Z] = ts * lse * lse;
  r.rec[R_ENT] = H;
  r.rec[R_DIST] = dist;
  r.rec[R_GRPO] = grpo;
  r.rec[R_KLREF] = klref;
  r.rec[R_CISPO] = cispo;
  r.rec[R_LSE] = lse;
  r.rec[R_H] = H;
  r.rec[R_LOGP] = logp;
  // Coefficients of d(token loss)/dz, times grad_scale * w / D and the logit scale; plus the
  // per-token outputs' upstream gradients times the logit scale alone (a plain VJP; logp is 0 on a
  // row without a label, whatever its upstream value holds, while H and lse are every row's); a
  // preference term's share is such an upstream gradient of logp.
  const F k = kd * w * ts * F(o.scale);
  const F gl = in.label >= 0 ? F(o.scale) * (in.g_logp + in.seq_g) : F(0);
  const F ge = F(o.scale) * in.g_ent, gs = F(o.scale) * in.g_lse;
  const F eps = F(o.smoothing);
  r.cp = k * (ce_w + z_w * F(2) * lse + ent_w * (lse - H) + cg - beta * ckl) - gl + ge * (lse - H) + gs;
  r.cpz = -k * ent_w - ge;
  r.cc = -k * ce_w * eps / F(o.vocab);
  r.cy = -k * (ce_w * (F(1) - eps) + cg - beta * ckl) + gl;
  r.dk = k * F(o.dist_w) * F(o.inv_ts);
  return r;
}

// One gradient element w.r.t. z_hat times the logit scale; the caller multiplies by the soft-cap
// factor (1 - tanh^2) and adds cy at the label column. z: z_hat_j, v: teacher_j / tau_t, p: p_j.
// With a sparse teacher this is the element off the top-k ids (v unused); topk_correction adds
// an id's own part.
template <int DISTILL, class F, class M>
HL_HD F grad_elem(const RowResult<F> &r, const Options &o, F z, F v, F p, const M &m) {
  F g = p * (r.cp + r.cpz * z) + r.cc;
  if (DISTILL != kDistillNone) {
    const F lps = z * F(o.inv_ts) - r.lse_s, lq = v - r.lse_t, ps = m.exp(lps);
    if (DISTILL == kDistillFwd) g += r.dk * (ps - m.exp(lq));
    else if (DISTILL == kDistillRev) g += r.dk * ps * (lps - lq - r.dist_loss);
    else if (DISTILL == kDistillJsd) g += r.dk * (jsd_elem(F(o.jsd_beta), lps, lq, ps, m.exp(lq), m).pa - ps * r.dsum);
    else g += r.dk * ps * (r.ar - r.dsum);
  }
  return g;
}

// What a sparse teacher's id k adds to grad_elem's element there (before the soft-cap's chain
// factor): dk p_k (a_k - a_r), with p_k a_k formed without dividing. lq: the id's log-prob.
template <class F>
HL_HD F topk_correction(const RowResult<F> &r, const Options &o, F z, F lq) {
  const DivSums<F> e = div_elem(o.divergence, F(o.jsd_beta), z * F(o.inv_ts) - r.lse_s, lq);
  return r.dk * (e.pa - e.p * r.ar);
}

// Final scalars (hl_loss_scalar_t) from the row sums (sum of w * field; plain sums for R_W and
// R_VALID), the min / max of the ratio and advantage over rows with w > 0, and D as used. The
// first n go to `scalars`.
template <class F>
HL_HD void finish_scalars(const F *sum, F ratio_min, F ratio_max, F adv_min, F adv_max, F D,
                          bool has_ratio, bool has_adv, unsigned terms, int n, float *scalars) {
  float out[HL_LOSS_NUM_SCALARS] = {};  // the preference term's stay 0 (pref_store writes them)
  const F W = sum[R_W];
  const F inv_d = D > F(0) ? F(1) / D : F(0), inv_w = W > F(0) ? F(1) / W : F(0);
  const auto term = [&](unsigned bits, int field) {
    return (terms & bits) ? float(sum[field] * inv_d) : 0.0f;
  };
  const auto mean = [&](int field) { return float(sum[field] * inv_w); };  // over valid rows
  const bool any = W > F(0);
  out[HL_LOSS_OUT_LOSS] = float(sum[R_LOSS] * inv_d);
  out[HL_LOSS_OUT_CE] = term(HL_LOSS_CE, R_CE);
  out[HL_LOSS_OUT_Z] = term(HL_LOSS_Z, R_Z);
  out[HL_LOSS_OUT_ENTROPY] = term(HL_LOSS_ENTROPY, R_ENT);
  out[HL_LOSS_OUT_DISTILL] = term(HL_LOSS_DISTILL_FWD | HL_LOSS_DISTILL_REV | HL_LOSS_DISTILL_JSD, R_DIST);
  out[HL_LOSS_OUT_GRPO] = term(HL_LOSS_GRPO, R_GRPO);
  out[HL_LOSS_OUT_KL_REF] = term(HL_LOSS_GRPO_KL_REF, R_KLREF);
  out[HL_LOSS_OUT_DIVISOR] = float(D);
  out[HL_LOSS_OUT_WEIGHT_SUM] = float(W);
  out[HL_LOSS_OUT_VALID_ROWS] = float(sum[R_VALID]);
  out[HL_LOSS_OUT_LSE_MEAN] = mean(R_LSE);
  out[HL_LOSS_OUT_ENTROPY_MEAN] = mean(R_H);
  out[HL_LOSS_OUT_LOGP_MEAN] = mean(R_LOGP);
  out[HL_LOSS_OUT_ACCURACY] = mean(R_ACC);
  out[HL_LOSS_OUT_RATIO_MEAN] = mean(R_RATIO);
  out[HL_LOSS_OUT_RATIO_MIN] = has_ratio && any ? float(ratio_min) : 0.0f;
  out[HL_LOSS_OUT_RATIO_MAX] = has_ratio && any ? float(ratio_max) : 0.0f;
  out[HL_LOSS_OUT_CLIP_LOW] = mean(R_CLIP_LO);
  out[HL_LOSS_OUT_CLIP_HIGH] = mean(R_CLIP_HI);
  out[HL_LOSS_OUT_CLIP_ANY] = mean(R_CLIP_ANY);
  out[HL_LOSS_OUT_K3_OLD] = mean(R_K3OLD);
  out[HL_LOSS_OUT_KL_REF_MEAN] = mean(R_KLREF);
  out[HL_LOSS_OUT_ADV_MEAN] = mean(R_ADV);
  out[HL_LOSS_OUT_ADV_MIN] = has_adv && any ? float(adv_min) : 0.0f;
  out[HL_LOSS_OUT_ADV_MAX] = has_adv && any ? float(adv_max) : 0.0f;
  out[HL_LOSS_OUT_DISTILL_KL_MEAN] = mean(R_DIST);
  out[HL_LOSS_OUT_CISPO] = term(HL_LOSS_CISPO, R_CISPO);
  out[HL_LOSS_OUT_DUAL_CLIP] = mean(R_DUAL);
  out[HL_LOSS_OUT_ROLLOUT_KL_K1] = mean(R_RKL1);
  out[HL_LOSS_OUT_ROLLOUT_KL_K3] = mean(R_RKL3);
  out[HL_LOSS_OUT_ROLLOUT_WEIGHT_MEAN] = mean(R_RWEIGHT);
  out[HL_LOSS_OUT_ROLLOUT_CORRECTED] = mean(R_RCORR);
  out[HL_LOSS_OUT_TOPK_MASS] = mean(R_COVER);
  for (int k = 0; k < n; ++k) scalars[k] = out[k];
}

}  // namespace hl::loss
