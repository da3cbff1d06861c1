// The preference term's validation and its CPU step (preference.h).
#include "loss/preference.h"

#include <cmath>

#include "common.h"
#include "cpu/scalar.h"

namespace hl::loss {
namespace {

constexpr float kBeta = 0.1f, kTau = 0.05f;

hl_status_t in_range(const char *fn, const char *name, int v, int lo, int hi, const char *names) {
  if (v < lo || v > hi)
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s is %d; use %s", fn, name, v, names);
  return HL_STATUS_SUCCESS;
}

// A float option: finite and >= 0, 0 for `def`; `used` false: it must hold 0 (or `def`).
hl_status_t option(const char *fn, const char *name, float v, float def, bool used, const char *owner,
                   float *out) {
  if (!std::isfinite(v) || v < 0.0f)
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s is %g; must be finite and >= 0 (0: %g)", fn, name,
                double(v), double(def));
  if (!used && v != 0.0f && v != def)
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s is %g but the plan has no %s", fn, name, double(v), owner);
  *out = v == 0.0f ? def : v;
  return HL_STATUS_SUCCESS;
}

}  // namespace

hl_status_t validate_preference_desc(const char *fn, const hl_loss_plan_desc_t &d, PrefOptions *o) {
  *o = PrefOptions{};
  const bool on = d.terms & HL_LOSS_PREFERENCE;
  const int kind = on ? d.preference : -1;
  if (!on && (d.preference || d.pref_loss_type || d.pref_logp))
    return fail(HL_STATUS_INVALID_VALUE, "%s: preference / pref_loss_type / pref_logp are set but "
                "terms lacks HL_LOSS_PREFERENCE", fn);
  if (on) {
    HL_TRY(in_range(fn, "preference", d.preference, HL_LOSS_PREF_DPO, HL_LOSS_PREF_KTO,
                    "HL_LOSS_PREF_DPO (0), _SIMPO (1), _ORPO (2), _CPO (3) or _KTO (4)"));
    HL_TRY(in_range(fn, "pref_loss_type", d.pref_loss_type, HL_LOSS_DPO_SIGMOID, HL_LOSS_DPO_DISCOPOP,
                    "HL_LOSS_DPO_SIGMOID (0) to _DISCOPOP (10)"));
    HL_TRY(in_range(fn, "pref_logp", d.pref_logp, HL_LOSS_SEQ_LOGP_DEFAULT, HL_LOSS_SEQ_LOGP_MEAN,
                    "HL_LOSS_SEQ_LOGP_DEFAULT (0), _SUM (1) or _MEAN (2)"));
    if (d.cu_seqlens_dtype == HL_DTYPE_NONE)
      return fail(HL_STATUS_INVALID_VALUE, "%s: HL_LOSS_PREFERENCE needs sequences: set "
                  "cu_seqlens_dtype (I32 or I64)", fn);
    if (d.labels_dtype == HL_DTYPE_NONE)
      return fail(HL_STATUS_INVALID_VALUE, "%s: HL_LOSS_PREFERENCE needs labels (each token's "
                  "log-prob), but labels_dtype is NONE", fn);
    if (d.ratio_level != HL_LOSS_LEVEL_TOKEN)
      return fail(HL_STATUS_INVALID_VALUE, "%s: ratio_level SEQ_MEAN (GSPO) and HL_LOSS_PREFERENCE "
                  "both define the sequences' sums; use one", fn);
  }
  const bool dpo_like = kind == HL_LOSS_PREF_DPO || kind == HL_LOSS_PREF_CPO;
  if (!dpo_like && d.pref_loss_type)
    return fail(HL_STATUS_INVALID_VALUE, "%s: pref_loss_type is %d; only DPO and CPO have loss types",
                fn, d.pref_loss_type);
  const int type = kind == HL_LOSS_PREF_SIMPO ? HL_LOSS_DPO_SIGMOID : d.pref_loss_type;
  const bool smoothed = (dpo_like && (type == HL_LOSS_DPO_SIGMOID || type == HL_LOSS_DPO_ROBUST ||
                                      type == HL_LOSS_DPO_EXO_PAIR)) || kind == HL_LOSS_PREF_SIMPO;
  const bool kto = kind == HL_LOSS_PREF_KTO;
  HL_TRY(option(fn, "pref_weight", d.pref_weight, 1.0f, on, "HL_LOSS_PREFERENCE", &o->weight));
  HL_TRY(option(fn, "pref_beta", d.pref_beta, kBeta, on, "HL_LOSS_PREFERENCE", &o->beta));
  HL_TRY(option(fn, "pref_tau", d.pref_tau, kTau, dpo_like && type == HL_LOSS_DPO_DISCOPOP,
                "DISCOPOP loss type", &o->tau));
  HL_TRY(option(fn, "kto_desirable_weight", d.kto_desirable_weight, 1.0f, kto, "KTO", &o->w_desirable));
  HL_TRY(option(fn, "kto_undesirable_weight", d.kto_undesirable_weight, 1.0f, kto, "KTO", &o->w_undesirable));
  if (!(d.pref_label_smoothing >= 0.0f && d.pref_label_smoothing < 0.5f))
    return fail(HL_STATUS_INVALID_VALUE, "%s: pref_label_smoothing is %g; must be in [0, 0.5)", fn,
                double(d.pref_label_smoothing));
  if (!smoothed && d.pref_label_smoothing != 0.0f)
    return fail(HL_STATUS_INVALID_VALUE, "%s: pref_label_smoothing is %g but the plan's preference "
                "loss has none (DPO / CPO SIGMOID, ROBUST, EXO_PAIR and SimPO have)", fn,
                double(d.pref_label_smoothing));
  if (!std::isfinite(d.pref_gamma))
    return fail(HL_STATUS_INVALID_VALUE, "%s: pref_gamma is not finite", fn);
  if (kind != HL_LOSS_PREF_SIMPO && d.pref_gamma != 0.0f)
    return fail(HL_STATUS_INVALID_VALUE, "%s: pref_gamma is %g but the plan's preference loss is not "
                "SimPO", fn, double(d.pref_gamma));
  o->kind = kind;
  o->type = type;
  o->gamma = kind == HL_LOSS_PREF_SIMPO ? d.pref_gamma : 0.0f;
  o->smoothing = d.pref_label_smoothing;
  const bool mean_default = kind == HL_LOSS_PREF_SIMPO || kind == HL_LOSS_PREF_ORPO ||
                            (dpo_like && type == HL_LOSS_DPO_IPO);
  o->mean = d.pref_logp == HL_LOSS_SEQ_LOGP_MEAN || (d.pref_logp == HL_LOSS_SEQ_LOGP_DEFAULT && mean_default);
  o->reference = kind == HL_LOSS_PREF_DPO || kto;
  return HL_STATUS_SUCCESS;
}

hl_status_t check_preference_args(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                                  bool outputs) {
  const PrefOptions &o = p.pref;
  if (o.kind < 0) {
    if (a.ref_seq_logprobs || a.kto_labels)
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s is set but the plan has no HL_LOSS_PREFERENCE", fn,
                  a.ref_seq_logprobs ? "ref_seq_logprobs" : "kto_labels");
    return HL_STATUS_SUCCESS;
  }
  if (a.num_seqs > a.rows)
    return fail(HL_STATUS_INVALID_VALUE, "%s: num_seqs is %lld; a preference term takes at most rows "
                "= %lld sequences", fn, (long long)a.num_seqs, (long long)a.rows);
  const bool kto = o.kind == HL_LOSS_PREF_KTO;
  if (!kto && a.num_seqs % 2)
    return fail(HL_STATUS_INVALID_VALUE, "%s: num_seqs is %lld; a paired preference loss takes the "
                "chosen sequences then the rejected ones (an even count)", fn, (long long)a.num_seqs);
  const struct {
    const char *name;
    const void *ptr;
    bool wanted;
    const char *why;
  } args[] = {{"ref_seq_logprobs", a.ref_seq_logprobs, o.reference, "a reference-free loss (SimPO, ORPO, CPO)"},
              {"kto_labels", a.kto_labels, kto, "a paired loss"}};
  for (const auto &g : args) {
    if (g.ptr && !g.wanted)
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s is set, but the plan's is %s", fn, g.name, g.why);
    if (!g.ptr && g.wanted && outputs && a.num_seqs > 0)
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s is NULL; the plan's preference loss needs it", fn,
                  g.name);
  }
  return HL_STATUS_SUCCESS;
}

void cpu_preference(const hl_loss_plan_st &p, const hl_loss_args_t &a,
                    const std::vector<SeqSums<double>> &sums, std::vector<double> &row_g,
                    float out[kPrefScalars], double *loss) {
  const PrefOptions &o = p.pref;
  const int64_t S = a.num_seqs;
  std::vector<double> v(static_cast<size_t>(S)), dv(static_cast<size_t>(S), 0.0);
  for (int64_t s = 0; s < S; ++s) v[size_t(s)] = seq_logp(sums[size_t(s)], o);
  const auto ref = [&](int64_t s) { return o.reference ? double(a.ref_seq_logprobs[s]) : 0.0; };
  PrefSums<double> sum = pref_zero<double>();
  double z0 = 0.0;
  if (o.kind == HL_LOSS_PREF_KTO) {
    double kl = 0.0, n = 0.0;
    for (int64_t s = 0; s < S; ++s)
      if (a.kto_labels[s] < 0) kl += v[size_t(s)] - ref(s), n += 1.0;
    z0 = kto_z0(kl, n);
    for (int64_t s = 0; s < S; ++s)
      if (a.kto_labels[s] >= 0) dv[size_t(s)] = kto_seq(o, int(a.kto_labels[s]), v[size_t(s)], ref(s), z0, &sum);
  } else {
    const int64_t P = S / 2;
    for (int64_t i = 0; i < P; ++i)
      pref_pair(o, v[size_t(i)], v[size_t(P + i)], ref(i), ref(P + i), &sum, &dv[size_t(i)], &dv[size_t(P + i)]);
  }
  const double gs = a.grad_scale == 0.0f ? 1.0 : double(a.grad_scale);
  row_g.assign(size_t(a.rows), 0.0);
  for (int64_t s = 0; s < S; ++s) {
    const double g = pref_token_grad(o, dv[size_t(s)], sums[size_t(s)], sum.units, gs);
    const int64_t b = cpu::load_int(a.cu_seqlens, p.desc.cu_seqlens_dtype, s);
    const int64_t e = cpu::load_int(a.cu_seqlens, p.desc.cu_seqlens_dtype, s + 1);
    for (int64_t i = b; i < e; ++i) row_g[size_t(i)] = g;
  }
  pref_scalars(o, sum, z0, out, loss);
}

}  // namespace hl::loss
