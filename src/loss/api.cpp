// hl_loss_plan_* entry points: validate the description once at creation and every call's
// arguments at execution, then hand over to a backend.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <utility>
#include <vector>

#include "common.h"
#include "cpu/scalar.h"
#include "kernels/loss/launch.h"
#include "loss.h"
#include "loss/preference.h"

namespace hl::loss {
namespace {

constexpr unsigned kAllTerms = HL_LOSS_CE | HL_LOSS_Z | HL_LOSS_ENTROPY | HL_LOSS_DISTILL_FWD |
                               HL_LOSS_DISTILL_REV | HL_LOSS_GRPO | HL_LOSS_GRPO_KL_REF |
                               HL_LOSS_CISPO | HL_LOSS_DISTILL_JSD | HL_LOSS_PREFERENCE;
constexpr unsigned kDistillTerms = HL_LOSS_DISTILL_FWD | HL_LOSS_DISTILL_REV | HL_LOSS_DISTILL_JSD;
constexpr unsigned kLabelTerms = HL_LOSS_CE | HL_LOSS_GRPO | HL_LOSS_GRPO_KL_REF | HL_LOSS_CISPO |
                                 HL_LOSS_PREFERENCE;
// struct_size of earlier headers' descriptors (headloss.h lists them).
constexpr std::initializer_list<size_t> kEarlierDescSizes = {128, 136, 176, 192, 232};
constexpr std::initializer_list<size_t> kEarlierArgsSizes = {160, 256, 312, 336};
constexpr unsigned kTokenGradFlags = HL_LOSS_GRAD_TOKEN_LOGP | HL_LOSS_GRAD_TOKEN_ENTROPY | HL_LOSS_GRAD_TOKEN_LSE;
constexpr unsigned kAllFlags = HL_LOSS_UNCHECKED | kTokenGradFlags | HL_LOSS_TOKEN_SCALING;

hl_status_t check_finite(const char *fn, const char *arg, float v) {
  if (!std::isfinite(v)) return fail(HL_STATUS_INVALID_VALUE, "%s: %s is not finite", fn, arg);
  return HL_STATUS_SUCCESS;
}

// Defaults that the validation of an option that is off must recognise too (HL_LOSS_PLAN_DESC_INIT
// spells them out).
constexpr float kRolloutCap = 2.0f, kJsdBeta = 0.5f;

// A field of a group, for the checks that a group is absent: its name and whether it is set.
struct Field {
  const char *name;
  bool set;
};
// The name of the first field of `group` that is set, or nullptr.
const char *first_set(std::initializer_list<Field> group) {
  for (const Field &f : group)
    if (f.set) return f.name;
  return nullptr;
}

// A value that must be > 0, where 0 selects the default `def`.
hl_status_t positive_or_default(const char *fn, const char *arg, float v, float def, float *out) {
  HL_TRY(check_finite(fn, arg, v));
  if (v < 0.0f)
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s is %g; must be > 0 (or 0 for the default %g)", fn,
                arg, double(v), double(def));
  *out = v == 0.0f ? def : v;
  return HL_STATUS_SUCCESS;
}

// A gradient's dtype: F32 or `own` (NONE: own); NONE without a gradient.
hl_status_t resolve_grad_dtype(const char *fn, const char *arg, hl_loss_grad_mode_t m, hl_dtype_t own,
                               hl_dtype_t &dt) {
  if (m == HL_LOSS_GRAD_NONE) {
    dt = HL_DTYPE_NONE;
    return HL_STATUS_SUCCESS;
  }
  if (dt == HL_DTYPE_NONE) dt = own;
  if (dt != own && dt != HL_DTYPE_F32)
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s is %s; use F32%s%s", fn, arg, dtype_name(dt),
                own == HL_DTYPE_F32 ? "" : " or ", own == HL_DTYPE_F32 ? "" : dtype_name(own));
  return HL_STATUS_SUCCESS;
}

// Each term's weight, finite; 0 replaced by the term's conventional weight, refused for the terms
// that have none (ENTROPY, GRPO_KL_REF). A term that is off keeps its field as given (unused).
hl_status_t resolve_weights(const char *fn, hl_loss_plan_desc_t &d) {
  struct Term { unsigned bits; const char *name; float *w; float def; };
  const Term terms[] = {
      {HL_LOSS_CE, "ce_weight", &d.ce_weight, 1.0f},
      {HL_LOSS_Z, "z_weight", &d.z_weight, 1e-4f},
      {HL_LOSS_ENTROPY, "entropy_weight", &d.entropy_weight, 0.0f},
      {kDistillTerms, "distill_weight", &d.distill_weight, 1.0f},
      {HL_LOSS_GRPO, "grpo_weight", &d.grpo_weight, 1.0f},
      {HL_LOSS_GRPO_KL_REF, "kl_ref_beta", &d.kl_ref_beta, 0.0f},
      {HL_LOSS_CISPO, "cispo_weight", &d.cispo_weight, 1.0f},
  };
  for (const Term &t : terms) {
    HL_TRY(check_finite(fn, t.name, *t.w));
    if (!(d.terms & t.bits) || *t.w != 0.0f) continue;
    if (t.def == 0.0f)
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s is 0, and its term has no conventional weight: set "
                  "it (%s)", fn, t.name, t.bits == HL_LOSS_ENTROPY ? "negative for an entropy bonus, "
                  "e.g. -1e-3" : "e.g. 1e-3 as verl, 0.04 as TRL");
    *t.w = t.def;
  }
  return HL_STATUS_SUCCESS;
}

// The fused linear form's fields (hidden > 0), or their absence; resolves logits_dtype to
// weight_dtype (the logits' dtype between the products).
hl_status_t validate_linear_desc(const char *fn, hl_loss_plan_desc_t &d) {
  if (d.hidden == 0) {
    if (const char *f = first_set({{"weight_dtype", d.weight_dtype != HL_DTYPE_NONE},
                                   {"teacher_hidden", d.teacher_hidden != 0},
                                   {"grad_hidden_mode", d.grad_hidden_mode != HL_LOSS_GRAD_NONE},
                                   {"grad_hidden_dtype", d.grad_hidden_dtype != HL_DTYPE_NONE},
                                   {"grad_weight_mode", d.grad_weight_mode != HL_LOSS_GRAD_NONE},
                                   {"grad_weight_dtype", d.grad_weight_dtype != HL_DTYPE_NONE},
                                   {"grad_bias_mode", d.grad_bias_mode != HL_LOSS_GRAD_NONE},
                                   {"grad_bias_dtype", d.grad_bias_dtype != HL_DTYPE_NONE}}))
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s is set, but it belongs to the fused linear form and "
                  "hidden is 0 (the logits form)", fn, f);
    return HL_STATUS_SUCCESS;
  }
  HL_TRY(check_float_dtype(fn, "weight_dtype", d.weight_dtype));
  if (d.logits_dtype == HL_DTYPE_NONE) d.logits_dtype = d.weight_dtype;
  if (d.logits_dtype != d.weight_dtype)
    return fail(HL_STATUS_INVALID_VALUE, "%s: logits_dtype is %s; the fused linear form holds its "
                "logits in weight_dtype (%s): pass NONE or that", fn, dtype_name(d.logits_dtype),
                dtype_name(d.weight_dtype));
  if (d.grad_mode != HL_LOSS_GRAD_NONE || d.grad_dtype != HL_DTYPE_NONE)
    return fail(HL_STATUS_INVALID_VALUE, "%s: grad_mode / grad_dtype are the logits form's; the "
                "fused linear form has grad_hidden_mode and grad_weight_mode", fn);
  HL_TRY(resolve_grad_dtype(fn, "grad_hidden_dtype", d.grad_hidden_mode, d.weight_dtype, d.grad_hidden_dtype));
  HL_TRY(resolve_grad_dtype(fn, "grad_weight_dtype", d.grad_weight_mode, d.weight_dtype, d.grad_weight_dtype));
  if (!d.grad_bias_mode && d.grad_bias_dtype != HL_DTYPE_NONE)
    return fail(HL_STATUS_INVALID_VALUE, "%s: grad_bias_dtype is %s but grad_bias_mode is NONE", fn,
                dtype_name(d.grad_bias_dtype));
  HL_TRY(resolve_grad_dtype(fn, "grad_bias_dtype", d.grad_bias_mode, d.weight_dtype, d.grad_bias_dtype));
  if (d.teacher_hidden > 0 && !(d.terms & kDistillTerms))
    return fail(HL_STATUS_INVALID_VALUE, "%s: teacher_hidden is %lld but the plan has no "
                "distillation term", fn, (long long)d.teacher_hidden);
  return HL_STATUS_SUCCESS;
}

// The sequence-level and rollout-correction options.
hl_status_t validate_sequence_options(const char *fn, hl_loss_plan_desc_t &d, Options &o) {
  const bool seqs = d.cu_seqlens_dtype != HL_DTYPE_NONE;
  if (seqs && d.cu_seqlens_dtype != HL_DTYPE_I32 && d.cu_seqlens_dtype != HL_DTYPE_I64)
    return fail(HL_STATUS_INVALID_VALUE, "%s: cu_seqlens_dtype is %s (%d); expected I32, I64 or NONE",
                fn, dtype_name(d.cu_seqlens_dtype), int(d.cu_seqlens_dtype));
  if (d.ratio_level != HL_LOSS_LEVEL_TOKEN && d.ratio_level != HL_LOSS_LEVEL_SEQ_MEAN)
    return fail(HL_STATUS_INVALID_VALUE, "%s: ratio_level is %d; use HL_LOSS_LEVEL_TOKEN (0) or "
                "HL_LOSS_LEVEL_SEQ_MEAN (2: GSPO)", fn, d.ratio_level);
  if (d.rollout_correction < HL_LOSS_ROLLOUT_NONE || d.rollout_correction > HL_LOSS_ROLLOUT_REJECT)
    return fail(HL_STATUS_INVALID_VALUE, "%s: rollout_correction is %d; use HL_LOSS_ROLLOUT_NONE (0), "
                "_TIS (1), _MIS (2) or _REJECT (3)", fn, d.rollout_correction);
  if (d.rollout_level < HL_LOSS_LEVEL_TOKEN || d.rollout_level > HL_LOSS_LEVEL_SEQ_MEAN)
    return fail(HL_STATUS_INVALID_VALUE, "%s: rollout_level is %d; use HL_LOSS_LEVEL_TOKEN (0), "
                "_SEQ_PRODUCT (1) or _SEQ_MEAN (2)", fn, d.rollout_level);
  const bool correct = d.rollout_correction != HL_LOSS_ROLLOUT_NONE;
  // Without a correction its options must be off: 0, or the value 0 stands for (spelled out by
  // HL_LOSS_PLAN_DESC_INIT), not a setting that would silently do nothing.
  const bool cap_set = d.rollout_cap != 0.0f && d.rollout_cap != kRolloutCap;
  if (!correct && (d.rollout_level || cap_set || d.rollout_floor != 0.0f))
    return fail(HL_STATUS_INVALID_VALUE, "%s: rollout_level / rollout_cap / rollout_floor are set "
                "but rollout_correction is NONE", fn);
  if (correct && !(d.terms & (HL_LOSS_GRPO | HL_LOSS_CISPO)))
    return fail(HL_STATUS_INVALID_VALUE, "%s: a rollout correction weights GRPO and CISPO, but the "
                "plan has neither", fn);
  const bool seq_ratio = d.ratio_level == HL_LOSS_LEVEL_SEQ_MEAN;
  if (seq_ratio && !(d.terms & (HL_LOSS_GRPO | HL_LOSS_CISPO)))
    return fail(HL_STATUS_INVALID_VALUE, "%s: ratio_level SEQ_MEAN (GSPO) sets GRPO's and CISPO's "
                "ratio, but the plan has neither", fn);
  const bool wants = seq_ratio || d.rollout_level != HL_LOSS_LEVEL_TOKEN;
  if (wants && !seqs)
    return fail(HL_STATUS_INVALID_VALUE, "%s: a sequence-level ratio_level or rollout_level needs "
                "sequences: set cu_seqlens_dtype (I32 or I64)", fn);
  if (seqs && !wants && !(d.terms & HL_LOSS_PREFERENCE))
    return fail(HL_STATUS_INVALID_VALUE, "%s: cu_seqlens_dtype is set but no option is sequence-level "
                "(ratio_level, rollout_level, HL_LOSS_PREFERENCE)", fn);
  HL_TRY(positive_or_default(fn, "rollout_cap", d.rollout_cap, kRolloutCap, &o.rollout_cap));
  HL_TRY(check_finite(fn, "rollout_floor", d.rollout_floor));
  o.rollout_floor = d.rollout_floor == 0.0f ? 1.0f / o.rollout_cap : d.rollout_floor;
  if (d.rollout_floor < 0.0f || o.rollout_floor >= o.rollout_cap)
    return fail(HL_STATUS_INVALID_VALUE, "%s: rollout_floor is %g; must be in [0, rollout_cap = %g) "
                "(0: 1 / rollout_cap)", fn, double(d.rollout_floor), double(o.rollout_cap));
  o.seq_ratio = seq_ratio;
  o.rollout = d.rollout_correction;
  o.rollout_level = d.rollout_level;
  return HL_STATUS_SUCCESS;
}

// The distillation term's divergence (JSD at b = 0 or 1 is forward / reverse KL, as TRL's), the
// sparse teacher's fields and what the sharded plans cannot do. tt: the teacher temperature.
hl_status_t validate_distill_desc(const char *fn, const hl_loss_plan_desc_t &d, float tt, Options &o) {
  const bool jsd = d.terms & HL_LOSS_DISTILL_JSD;
  HL_TRY(check_finite(fn, "jsd_beta", d.jsd_beta));
  if (!jsd && d.jsd_beta != 0.0f && d.jsd_beta != kJsdBeta)
    return fail(HL_STATUS_INVALID_VALUE, "%s: jsd_beta is %g but the plan has no HL_LOSS_DISTILL_JSD",
                fn, double(d.jsd_beta));
  if (d.jsd_beta < 0.0f || d.jsd_beta > 1.0f)
    return fail(HL_STATUS_INVALID_VALUE, "%s: jsd_beta is %g; must be in (0, 1] (0: the default 0.5; "
                "forward KL is HL_LOSS_DISTILL_FWD)", fn, double(d.jsd_beta));
  o.jsd_beta = !jsd ? 0.0f : d.jsd_beta == 0.0f ? kJsdBeta : d.jsd_beta;
  o.divergence = (d.terms & HL_LOSS_DISTILL_FWD) ? kDistillFwd
                 : (d.terms & HL_LOSS_DISTILL_REV) || (jsd && o.jsd_beta == 1.0f) ? kDistillRev
                 : jsd ? kDistillJsd : kDistillNone;
  o.topk = d.teacher_topk;
  o.distill = o.divergence != kDistillNone && o.topk > 0 ? kDistillSparse : o.divergence;
  if (d.teacher_topk == 0) {
    if (d.teacher_topk_ids_dtype != HL_DTYPE_NONE)
      return fail(HL_STATUS_INVALID_VALUE, "%s: teacher_topk_ids_dtype is %s but teacher_topk is 0 "
                  "(a dense teacher)", fn, dtype_name(d.teacher_topk_ids_dtype));
  } else {
    if (d.teacher_topk > kMaxTopk || d.teacher_topk > d.vocab_global)
      return fail(HL_STATUS_INVALID_VALUE, "%s: teacher_topk is %d; must be in [1, min(%d, "
                  "vocab_global = %lld)] (0: a dense teacher)", fn, d.teacher_topk, kMaxTopk,
                  (long long)d.vocab_global);
    if (o.divergence == kDistillNone)
      return fail(HL_STATUS_INVALID_VALUE, "%s: teacher_topk is %d but the plan has no distillation "
                  "term", fn, d.teacher_topk);
    if (d.teacher_topk_ids_dtype != HL_DTYPE_I32 && d.teacher_topk_ids_dtype != HL_DTYPE_I64)
      return fail(HL_STATUS_INVALID_VALUE, "%s: teacher_topk_ids_dtype is %s (%d); expected I32 or "
                  "I64", fn, dtype_name(d.teacher_topk_ids_dtype), int(d.teacher_topk_ids_dtype));
    if (d.teacher_hidden > 0)
      return fail(HL_STATUS_INVALID_VALUE, "%s: teacher_topk and teacher_hidden both set; a teacher "
                  "is sparse or dense", fn);
    if (tt != 1.0f)
      return fail(HL_STATUS_INVALID_VALUE, "%s: teacher_temperature is %g, but a sparse teacher's "
                  "log-probs are used as given (pass 0)", fn, double(d.teacher_temperature));
  }
  return HL_STATUS_SUCCESS;
}

hl_status_t validate_desc(const char *fn, hl_loss_plan_desc_t &d, Options &o) {
  HL_TRY(check_extents(fn, {{"vocab", d.vocab}, {"vocab_start", d.vocab_start},
                            {"vocab_global", d.vocab_global}, {"hidden", d.hidden},
                            {"teacher_hidden", d.teacher_hidden}, {"ranks", d.ranks},
                            {"teacher_topk", d.teacher_topk}}));
  HL_TRY(check_enums(fn, {enum_field("backend", d.backend), enum_field("logits_dtype", d.logits_dtype),
                          enum_field("labels_dtype", d.labels_dtype), enum_field("grad_mode", d.grad_mode),
                          enum_field("grad_dtype", d.grad_dtype), enum_field("weight_dtype", d.weight_dtype),
                          enum_field("grad_hidden_mode", d.grad_hidden_mode),
                          enum_field("grad_hidden_dtype", d.grad_hidden_dtype),
                          enum_field("grad_weight_mode", d.grad_weight_mode),
                          enum_field("grad_weight_dtype", d.grad_weight_dtype),
                          enum_field("cu_seqlens_dtype", d.cu_seqlens_dtype),
                          enum_field("teacher_topk_ids_dtype", d.teacher_topk_ids_dtype),
                          enum_field("grad_bias_mode", d.grad_bias_mode),
                          enum_field("grad_bias_dtype", d.grad_bias_dtype)}));
  HL_TRY(check_backend(fn, d.backend));
  HL_TRY(validate_linear_desc(fn, d));
  const bool grads = d.grad_mode || d.grad_hidden_mode || d.grad_weight_mode || d.grad_bias_mode;
  const bool token_grads = d.flags & kTokenGradFlags;
  if (!d.terms && !token_grads && grads)
    return fail(HL_STATUS_INVALID_VALUE, "%s: terms is 0 (metrics only) and no HL_LOSS_GRAD_TOKEN_* "
                "flag is set, so there is nothing to differentiate: the grad modes must be NONE", fn);
  if (token_grads && !grads)
    return fail(HL_STATUS_INVALID_VALUE, "%s: flags has HL_LOSS_GRAD_TOKEN_* bits but no gradient is "
                "formed: set a grad mode", fn);
  if ((d.flags & HL_LOSS_GRAD_TOKEN_LOGP) && d.labels_dtype == HL_DTYPE_NONE)
    return fail(HL_STATUS_INVALID_VALUE, "%s: HL_LOSS_GRAD_TOKEN_LOGP needs labels (the label's "
                "log-prob), but labels_dtype is NONE", fn);
  if (d.vocab < 1)
    return fail(HL_STATUS_INVALID_VALUE, "%s: vocab is %lld; must be >= 1", fn, (long long)d.vocab);
  HL_TRY(check_float_dtype(fn, "logits_dtype", d.logits_dtype));
  if (d.labels_dtype != HL_DTYPE_NONE && d.labels_dtype != HL_DTYPE_I32 &&
      d.labels_dtype != HL_DTYPE_I64)
    return fail(HL_STATUS_INVALID_VALUE, "%s: labels_dtype is %s (%d); expected I32, I64 or NONE",
                fn, dtype_name(d.labels_dtype), int(d.labels_dtype));
  if (d.terms & ~kAllTerms)
    return fail(HL_STATUS_INVALID_VALUE, "%s: terms has unknown bits 0x%x", fn, d.terms & ~kAllTerms);
  if (d.flags & ~kAllFlags)
    return fail(HL_STATUS_INVALID_VALUE, "%s: flags has unknown bits 0x%x", fn, d.flags & ~kAllFlags);
  if ((d.flags & HL_LOSS_TOKEN_SCALING) && (d.labels_dtype == HL_DTYPE_NONE || (d.terms & ~(HL_LOSS_CE | HL_LOSS_Z))))
    return fail(HL_STATUS_INVALID_VALUE, "%s: flags has HL_LOSS_TOKEN_SCALING, which scales CE and Z by "
                "p_y: it needs labels and no other term (terms 0x%x, labels_dtype %s)", fn, d.terms,
                dtype_name(d.labels_dtype));
  const unsigned distill = d.terms & kDistillTerms;
  if (distill & (distill - 1))
    return fail(HL_STATUS_INVALID_VALUE, "%s: terms has more than one of HL_LOSS_DISTILL_FWD, "
                "_REV and _JSD; pick one", fn);
  if ((d.terms & kLabelTerms) && d.labels_dtype == HL_DTYPE_NONE)
    return fail(HL_STATUS_INVALID_VALUE,
                "%s: CE, GRPO, CISPO, GRPO_KL_REF and PREFERENCE need labels, but labels_dtype is NONE", fn);
  HL_TRY(resolve_weights(fn, d));
  if (d.use_ignore_index != 0 && d.use_ignore_index != 1)
    return fail(HL_STATUS_INVALID_VALUE, "%s: use_ignore_index is %d; use 0 or 1", fn, d.use_ignore_index);
  if (!(d.label_smoothing >= 0.0f && d.label_smoothing < 1.0f))
    return fail(HL_STATUS_INVALID_VALUE, "%s: label_smoothing is %g; must be in [0, 1)", fn,
                double(d.label_smoothing));
  float tt = 1.0f, ts = 1.0f;
  HL_TRY(positive_or_default(fn, "logit_scale", d.logit_scale, 1.0f, &o.scale));
  HL_TRY(positive_or_default(fn, "teacher_temperature", d.teacher_temperature, 1.0f, &tt));
  HL_TRY(positive_or_default(fn, "student_temperature", d.student_temperature, 1.0f, &ts));
  HL_TRY(positive_or_default(fn, "eps_low", d.eps_low, 0.2f, &o.eps_low));
  if (o.eps_low >= 1.0f)
    return fail(HL_STATUS_INVALID_VALUE, "%s: eps_low is %g; must be in (0, 1) (the ratio's lower "
                "clip is 1 - eps_low; 0 means 0.2)", fn, double(d.eps_low));
  HL_TRY(positive_or_default(fn, "eps_high", d.eps_high, 0.2f, &o.eps_high));
  HL_TRY(positive_or_default(fn, "cispo_eps_high", d.cispo_eps_high, o.eps_high, &o.cispo_eps));
  // c <= 1 would cap a negative advantage's loss below its unclipped value at r = 1.
  if (!(d.dual_clip == 0.0f || (d.dual_clip > 1.0f && std::isfinite(d.dual_clip))))
    return fail(HL_STATUS_INVALID_VALUE, "%s: dual_clip is %g; must be finite and > 1 (or 0: off)",
                fn, double(d.dual_clip));
  o.dual_clip = d.dual_clip;
  if (d.kl_estimator != HL_LOSS_KL_K3 && d.kl_estimator != HL_LOSS_KL_K1 &&
      d.kl_estimator != HL_LOSS_KL_K2)
    return fail(HL_STATUS_INVALID_VALUE, "%s: kl_estimator is %d; use HL_LOSS_KL_K3 (0), "
                "HL_LOSS_KL_K1 (1) or HL_LOSS_KL_K2 (2)", fn, d.kl_estimator);
  o.kl_estimator = d.kl_estimator;
  HL_TRY(validate_sequence_options(fn, d, o));
  // A caller built against an older header has room for the scalars that header listed: 0.2's
  // descriptor ended before kl_estimator, 0.3's before cu_seqlens_dtype, 0.4-0.6's before preference.
  const auto has = [&](size_t end) { return d.struct_size >= end; };
  o.scalars = has(offsetof(hl_loss_plan_desc_t, pref_loss_type) + sizeof(int))         ? HL_LOSS_NUM_SCALARS
              : has(offsetof(hl_loss_plan_desc_t, cu_seqlens_dtype) + sizeof(hl_dtype_t)) ? HL_LOSS_OUT_PREFERENCE
              : has(offsetof(hl_loss_plan_desc_t, kl_estimator) + sizeof(int))       ? HL_LOSS_OUT_ROLLOUT_KL_K1
                                                                                      : HL_LOSS_OUT_CISPO;
  HL_TRY(check_finite(fn, "softcap", d.softcap));
  if (d.softcap < 0.0f)
    return fail(HL_STATUS_INVALID_VALUE, "%s: softcap is %g; must be >= 0 (0: no cap)", fn,
                double(d.softcap));
  HL_TRY(resolve_grad_dtype(fn, "grad_dtype", d.grad_mode, d.logits_dtype, d.grad_dtype));
  if (d.vocab_global == 0 && d.vocab_start == 0) d.vocab_global = d.vocab;  // not sharded
  if (d.vocab_start < 0 || d.vocab_global < d.vocab || d.vocab_start > d.vocab_global - d.vocab)
    return fail(HL_STATUS_INVALID_VALUE,
                "%s: the shard [vocab_start, vocab_start + vocab) = [%lld, %lld) is not inside "
                "[0, vocab_global = %lld)", fn, (long long)d.vocab_start,
                (long long)(d.vocab_start + d.vocab), (long long)d.vocab_global);
  if (d.ranks > d.vocab_global)
    return fail(HL_STATUS_INVALID_VALUE, "%s: ranks is %d; must be in [0, vocab_global = %lld] (0 "
                "means 1)", fn, d.ranks, (long long)d.vocab_global);
  if (d.ranks == 0) d.ranks = 1;
  if ((d.ranks > 1) != (d.vocab < d.vocab_global))
    return fail(HL_STATUS_INVALID_VALUE, "%s: ranks is %d but the shard has %lld of %lld columns; a "
                "shard of the vocabulary needs ranks >= 2, the whole of it ranks = 1", fn, d.ranks,
                (long long)d.vocab, (long long)d.vocab_global);
  const auto on = [&](unsigned t, float w) { return (d.terms & t) ? w : 0.0f; };
  o.ce_w = on(HL_LOSS_CE, d.ce_weight);
  o.z_w = on(HL_LOSS_Z, d.z_weight);
  o.ent_w = on(HL_LOSS_ENTROPY, d.entropy_weight);
  o.dist_w = on(kDistillTerms, d.distill_weight);
  o.grpo_w = on(HL_LOSS_GRPO, d.grpo_weight);
  o.beta = on(HL_LOSS_GRPO_KL_REF, d.kl_ref_beta);
  o.cispo_w = on(HL_LOSS_CISPO, d.cispo_weight);
  o.token_scaling = (d.flags & HL_LOSS_TOKEN_SCALING) != 0;
  o.smoothing = (d.terms & HL_LOSS_CE) ? d.label_smoothing : 0.0f;
  o.cap = d.softcap;
  o.inv_tt = 1.0f / tt;
  o.inv_ts = 1.0f / ts;
  HL_TRY(validate_distill_desc(fn, d, tt, o));
  o.terms = d.terms;
  o.vocab = d.vocab_global;  // label smoothing averages over the whole vocabulary
  return HL_STATUS_SUCCESS;
}

// FNV-1a of what the ranks of one sharded plan must share: the resolved options (so that a default
// spelled as 0 or as its value, and a weight of a term that is off, agree) and the fields outside
// them, value by value (never the caller's padding bytes); not the shard's own vocab_start, vocab.
uint64_t fingerprint(const hl_loss_plan_desc_t &d, const Options &o, const PrefOptions &pref) {
  uint64_t h = 1469598103934665603ull;
  const auto add = [&h](const auto &v) {
    const unsigned char *b = reinterpret_cast<const unsigned char *>(&v);
    for (size_t i = 0; i < sizeof v; ++i) h = (h ^ b[i]) * 1099511628211ull;
  };
  Options c;
  std::memcpy(&c, &o, sizeof c);  // o is value-initialised at creation: its padding is zero
  c.scalars = 0;                  // the caller's header version, not the plan
  add(c);
  for (int64_t v : {int64_t(pref.kind), int64_t(pref.type), int64_t(pref.mean), int64_t(pref.reference)})
    add(v);
  for (float v : {pref.weight, pref.beta, pref.gamma, pref.smoothing, pref.tau, pref.w_desirable,
                  pref.w_undesirable})
    add(v);
  for (int64_t v : {int64_t(d.backend), int64_t(d.logits_dtype), int64_t(d.labels_dtype),
                    int64_t(d.use_ignore_index), d.use_ignore_index ? d.ignore_index : 0, d.vocab_global,
                    int64_t(d.ranks), d.hidden, int64_t(d.weight_dtype), d.teacher_hidden,
                    int64_t(d.cu_seqlens_dtype), int64_t(d.teacher_topk_ids_dtype)})
    add(v);
  return h;
}

// An argument that `what` requires.
hl_status_t require(const char *fn, const char *name, const void *p, const char *what) {
  if (!p) return fail(HL_STATUS_INVALID_VALUE, "%s: %s is NULL; %s needs it", fn, name, what);
  return HL_STATUS_SUCCESS;
}

// Every matrix and vector a call passes (strides resolved), for the pointer and aliasing checks.
// Without rows only grad_weight and grad_bias (written whole), the scalars and cu_seqlens are used.
std::vector<Buffer> arg_buffers(const hl_loss_plan_st &p, const hl_loss_args_t &a) {
  const hl_loss_plan_desc_t &d = p.desc;
  const int64_t V = d.vocab, H = d.hidden, Ht = d.teacher_hidden, N = a.rows, K = d.teacher_topk;
  const hl_dtype_t wd = d.weight_dtype, f32 = HL_DTYPE_F32;
  std::vector<Buffer> used = {
      {"grad_weight", a.grad_weight, V, H, a.grad_weight_stride, d.grad_weight_dtype, true, "grad_weight_stride"},
      {"grad_bias", a.grad_bias, 1, V, V, d.grad_bias_dtype, true},
      {"scalars", a.scalars, 1, p.opt.scalars, p.opt.scalars, f32, true},
      {"cu_seqlens", a.cu_seqlens, a.num_seqs + 1, 1, 1, d.cu_seqlens_dtype, false},
      {"ref_seq_logprobs", a.ref_seq_logprobs, a.num_seqs, 1, 1, f32, false},
      {"kto_labels", a.kto_labels, a.num_seqs, 1, 1, HL_DTYPE_I32, false},
  };
  if (N == 0) return used;
  used.insert(used.end(), {
      {"logits", a.logits, N, V, a.logits_stride, d.logits_dtype, false, "logits_stride"},
      {"hidden", a.hidden, N, H, a.hidden_stride, wd, false, "hidden_stride"},
      {"weight", a.weight, V, H, a.weight_stride, wd, false, "weight_stride"},
      {"labels", a.labels, N, 1, 1, d.labels_dtype, false},
      {"weights", a.weights, N, 1, 1, f32, false},
      {"teacher_logits", a.teacher_logits, N, V, a.teacher_stride, d.logits_dtype, false, "teacher_stride"},
      {"teacher_hidden", a.teacher_hidden, N, Ht, a.teacher_hidden_stride, wd, false, "teacher_hidden_stride"},
      {"teacher_weight", a.teacher_weight, V, Ht, a.teacher_weight_stride, wd, false, "teacher_weight_stride"},
      {"advantages", a.advantages, N, 1, 1, f32, false},
      {"old_logprobs", a.old_logprobs, N, 1, 1, f32, false},
      {"ref_logprobs", a.ref_logprobs, N, 1, 1, f32, false},
      {"rollout_logprobs", a.rollout_logprobs, N, 1, 1, f32, false},
      {"teacher_topk_ids", a.teacher_topk_ids, N, K, a.teacher_topk_ids_stride, d.teacher_topk_ids_dtype, false,
       "teacher_topk_ids_stride"},
      {"teacher_topk_logprobs", a.teacher_topk_logprobs, N, K, a.teacher_topk_logprobs_stride, f32, false,
       "teacher_topk_logprobs_stride"},
      {"grad", a.grad, N, V, a.grad_stride, d.grad_dtype, true, "grad_stride"},
      {"grad_hidden", a.grad_hidden, N, H, a.grad_hidden_stride, d.grad_hidden_dtype, true, "grad_hidden_stride"},
      {"token_loss", a.token_loss, N, 1, 1, f32, true},
      {"token_logp", a.token_logp, N, 1, 1, f32, true},
      {"token_entropy", a.token_entropy, N, 1, 1, f32, true},
      {"token_lse", a.token_lse, N, 1, 1, f32, true},
      {"grad_token_logp", a.grad_token_logp, N, 1, 1, f32, false},
      {"grad_token_entropy", a.grad_token_entropy, N, 1, 1, f32, false},
      {"grad_token_lse", a.grad_token_lse, N, 1, 1, f32, false},
      {"bias", a.bias, 1, V, V, wd, false},
      {"token_argmax", a.token_argmax, N, 1, 1, HL_DTYPE_I64, true},
  });
  return used;
}

// Pointers of the form the plan does not take must be NULL.
hl_status_t check_form(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a) {
  const char *other = p.linear ? first_set({{"logits", a.logits != nullptr}, {"grad", a.grad != nullptr}})
                              : first_set({{"hidden", a.hidden != nullptr}, {"weight", a.weight != nullptr},
                                           {"teacher_hidden", a.teacher_hidden != nullptr},
                                           {"teacher_weight", a.teacher_weight != nullptr},
                                           {"grad_hidden", a.grad_hidden != nullptr},
                                           {"grad_weight", a.grad_weight != nullptr},
                                           {"bias", a.bias != nullptr},
                                           {"grad_bias", a.grad_bias != nullptr}});
  if (other)
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s is set, but the plan is the %s form (hidden = %lld)", fn,
                other, p.linear ? "fused linear" : "logits", (long long)p.desc.hidden);
  if (p.linear) {
    const bool fused_teacher = p.desc.teacher_hidden > 0;
    if (fused_teacher && a.teacher_logits)
      return fail(HL_STATUS_INVALID_VALUE, "%s: teacher_logits is set, but the plan's teacher comes "
                  "as teacher_hidden and teacher_weight", fn);
    if (!fused_teacher && (a.teacher_hidden || a.teacher_weight))
      return fail(HL_STATUS_INVALID_VALUE, "%s: teacher_hidden / teacher_weight are set, but the "
                  "plan's teacher_hidden is 0 (its teacher comes as teacher_logits)", fn);
  }
  return HL_STATUS_SUCCESS;
}

// An output the plan's mode asks for (required where it has elements, except in the statistics
// step), or must not get.
hl_status_t check_output(const char *fn, const char *name, const void *ptr, int64_t rows,
                         hl_loss_grad_mode_t mode, const char *mode_name, Phase phase) {
  if (mode == HL_LOSS_GRAD_NONE && ptr)
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s is set but the plan's %s is NONE", fn, name, mode_name);
  if (mode != HL_LOSS_GRAD_NONE && writes_outputs(phase) && rows > 0 && !ptr)
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s is NULL; the plan's %s needs it", fn, name, mode_name);
  return HL_STATUS_SUCCESS;
}

// The rows of a call (or a size query): in range, and on CUDA within the row kernels' 32-bit row
// counters.
hl_status_t check_rows(const char *fn, const hl_loss_plan_st &p, int64_t rows) {
  HL_TRY(check_extents(fn, {{"rows", rows}}));
  if (p.desc.backend == HL_BACKEND_CUDA && rows > INT32_MAX)
    return fail(HL_STATUS_NOT_SUPPORTED, "%s: rows is %lld; the CUDA backend takes rows <= 2^31 - 1", fn,
                (long long)rows);
  return HL_STATUS_SUCCESS;
}

// The per-token upstream gradients of a call, each with its flag.
struct TokenGrad {
  const char *name;
  const float *ptr;
  unsigned flag;
  const char *flag_name;
};
std::array<TokenGrad, 3> token_grads(const hl_loss_args_t &a) {
  return {{{"grad_token_logp", a.grad_token_logp, HL_LOSS_GRAD_TOKEN_LOGP, "HL_LOSS_GRAD_TOKEN_LOGP"},
           {"grad_token_entropy", a.grad_token_entropy, HL_LOSS_GRAD_TOKEN_ENTROPY, "HL_LOSS_GRAD_TOKEN_ENTROPY"},
           {"grad_token_lse", a.grad_token_lse, HL_LOSS_GRAD_TOKEN_LSE, "HL_LOSS_GRAD_TOKEN_LSE"}}};
}

// The arguments of a call with rows: what its terms and form require, row strides resolved.
hl_status_t check_row_args(const char *fn, const hl_loss_plan_st &p, hl_loss_args_t &a, Phase phase) {
  const hl_loss_plan_desc_t &d = p.desc;
  const int64_t V = d.vocab, H = d.hidden, Ht = d.teacher_hidden, K = p.opt.topk;
  const bool distill = p.opt.distill != kDistillNone, fused_teacher = p.linear && Ht > 0;
  if (p.linear) {
    HL_TRY(require(fn, "hidden", a.hidden, "the fused linear form"));
    HL_TRY(require(fn, "weight", a.weight, "the fused linear form"));
    HL_TRY(resolve_stride(fn, "hidden_stride", a.hidden_stride, H, &a.hidden_stride));
    HL_TRY(resolve_stride(fn, "weight_stride", a.weight_stride, H, &a.weight_stride));
    if (a.grad_hidden) HL_TRY(resolve_stride(fn, "grad_hidden_stride", a.grad_hidden_stride, H, &a.grad_hidden_stride));
    if (d.backend == HL_BACKEND_CUDA && reinterpret_cast<uintptr_t>(a.bias) % 16)  // cuBLASLt's bias epilogue
      return fail(HL_STATUS_MISALIGNED, "%s: bias (%p) must be 16-byte aligned on CUDA", fn, a.bias);
  } else {
    HL_TRY(check_not_null(fn, "logits", a.logits));
    HL_TRY(resolve_stride(fn, "logits_stride", a.logits_stride, V, &a.logits_stride));
    if (a.grad) HL_TRY(resolve_stride(fn, "grad_stride", a.grad_stride, V, &a.grad_stride));
  }
  if (p.needs_labels) HL_TRY(require(fn, "labels", a.labels, "CE, GRPO, CISPO, GRPO_KL_REF or PREFERENCE"));
  if (distill && fused_teacher) {
    HL_TRY(require(fn, "teacher_hidden", a.teacher_hidden, "distillation from a fused teacher"));
    HL_TRY(require(fn, "teacher_weight", a.teacher_weight, "distillation from a fused teacher"));
    HL_TRY(resolve_stride(fn, "teacher_hidden_stride", a.teacher_hidden_stride, Ht, &a.teacher_hidden_stride));
    HL_TRY(resolve_stride(fn, "teacher_weight_stride", a.teacher_weight_stride, Ht, &a.teacher_weight_stride));
  } else if (distill && K) {
    HL_TRY(require(fn, "teacher_topk_ids", a.teacher_topk_ids, "a sparse teacher"));
    HL_TRY(require(fn, "teacher_topk_logprobs", a.teacher_topk_logprobs, "a sparse teacher"));
    HL_TRY(resolve_stride(fn, "teacher_topk_ids_stride", a.teacher_topk_ids_stride, K, &a.teacher_topk_ids_stride));
    HL_TRY(resolve_stride(fn, "teacher_topk_logprobs_stride", a.teacher_topk_logprobs_stride, K,
                          &a.teacher_topk_logprobs_stride));
  } else if (distill) {
    HL_TRY(require(fn, "teacher_logits", a.teacher_logits, "distillation"));
    HL_TRY(resolve_stride(fn, "teacher_stride", a.teacher_stride, V, &a.teacher_stride));
  }
  if (!writes_outputs(phase)) return HL_STATUS_SUCCESS;
  const std::pair<unsigned, const char *> policy_terms[] = {{HL_LOSS_GRPO, "GRPO"}, {HL_LOSS_CISPO, "CISPO"}};
  for (const auto &[bit, term] : policy_terms)
    if (d.terms & bit) {
      HL_TRY(require(fn, "advantages", a.advantages, term));
      HL_TRY(require(fn, "old_logprobs", a.old_logprobs, term));
    }
  if (d.terms & HL_LOSS_GRPO_KL_REF) HL_TRY(require(fn, "ref_logprobs", a.ref_logprobs, "GRPO_KL_REF"));
  if (d.flags & HL_LOSS_GRAD_TOKEN_LOGP) HL_TRY(require(fn, "labels", a.labels, "HL_LOSS_GRAD_TOKEN_LOGP"));
  for (const TokenGrad &t : token_grads(a))
    if (d.flags & t.flag) HL_TRY(require(fn, t.name, t.ptr, t.flag_name));
  if (p.opt.rollout != HL_LOSS_ROLLOUT_NONE) {
    HL_TRY(require(fn, "rollout_logprobs", a.rollout_logprobs, "a rollout correction"));
    HL_TRY(require(fn, "old_logprobs", a.old_logprobs, "a rollout correction"));
  }
  return HL_STATUS_SUCCESS;
}

// A call's arguments against its plan and phase, sizes and strides first; strides resolved in a.
// *bufs: every buffer the call passes, each checked (check_buffers) but not yet for overlaps.
hl_status_t validate_args(const char *fn, const hl_loss_plan_st &p, hl_loss_args_t &a, Phase phase,
                          std::vector<Buffer> *bufs) {
  const hl_loss_plan_desc_t &d = p.desc;
  HL_TRY(check_rows(fn, p, a.rows));
  HL_TRY(check_extents(fn, {{"logits_stride", a.logits_stride}, {"teacher_stride", a.teacher_stride},
                            {"grad_stride", a.grad_stride}, {"hidden_stride", a.hidden_stride},
                            {"weight_stride", a.weight_stride}, {"teacher_hidden_stride", a.teacher_hidden_stride},
                            {"teacher_weight_stride", a.teacher_weight_stride},
                            {"grad_hidden_stride", a.grad_hidden_stride}, {"grad_weight_stride", a.grad_weight_stride},
                            {"num_seqs", a.num_seqs}, {"teacher_topk_ids_stride", a.teacher_topk_ids_stride},
                            {"teacher_topk_logprobs_stride", a.teacher_topk_logprobs_stride}}));
  if (!std::isfinite(a.divisor) || a.divisor < 0)
    return fail(HL_STATUS_INVALID_VALUE, "%s: divisor is %g; must be finite and >= 0 (0: the sum "
                "of valid weights)", fn, a.divisor);
  HL_TRY(check_finite(fn, "grad_scale", a.grad_scale));
  if (a.labels && d.labels_dtype == HL_DTYPE_NONE)
    return fail(HL_STATUS_INVALID_VALUE, "%s: labels is set but the plan's labels_dtype is NONE", fn);
  if ((a.cu_seqlens || a.num_seqs) && !p.sequences)
    return fail(HL_STATUS_INVALID_VALUE, "%s: cu_seqlens / num_seqs are set but the plan's "
                "cu_seqlens_dtype is NONE", fn);
  if (p.sequences && writes_outputs(phase)) {
    HL_TRY(require(fn, "cu_seqlens", a.cu_seqlens, "a sequence-level option"));
    if (a.num_seqs < 1 && a.rows > 0)
      return fail(HL_STATUS_INVALID_VALUE, "%s: num_seqs is %lld; %lld rows need >= 1 sequence", fn,
                  (long long)a.num_seqs, (long long)a.rows);
  }
  HL_TRY(check_preference_args(fn, p, a, writes_outputs(phase)));
  const char *dense = first_set({{"teacher_logits", a.teacher_logits != nullptr},
                                 {"teacher_hidden", a.teacher_hidden != nullptr},
                                 {"teacher_weight", a.teacher_weight != nullptr}});
  const char *sparse = first_set({{"teacher_topk_ids", a.teacher_topk_ids != nullptr},
                                  {"teacher_topk_logprobs", a.teacher_topk_logprobs != nullptr}});
  if ((dense || sparse) && p.opt.distill == kDistillNone)
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s (a teacher) is set but the plan has no distillation "
                "term", fn, dense ? dense : sparse);
  if (dense && p.opt.topk)
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s (a dense teacher) is set, but the plan's teacher is "
                "sparse (teacher_topk = %d): pass teacher_topk_ids and teacher_topk_logprobs", fn, dense,
                p.opt.topk);
  if (sparse && !p.opt.topk)
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s is set, but the plan's teacher is dense "
                "(teacher_topk = 0)", fn, sparse);
  HL_TRY(check_form(fn, p, a));
  for (const TokenGrad &t : token_grads(a))
    if (t.ptr && !(d.flags & t.flag))
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s is set but the plan's flags lack %s", fn, t.name,
                  t.flag_name);
  HL_TRY(check_output(fn, "grad", a.grad, a.rows, d.grad_mode, "grad_mode", phase));
  HL_TRY(check_output(fn, "grad_hidden", a.grad_hidden, a.rows, d.grad_hidden_mode, "grad_hidden_mode", phase));
  // grad_weight has vocab rows whatever the call's rows (zeros for none: the empty sum).
  HL_TRY(check_output(fn, "grad_weight", a.grad_weight, d.vocab, d.grad_weight_mode, "grad_weight_mode", phase));
  HL_TRY(check_output(fn, "grad_bias", a.grad_bias, d.vocab, d.grad_bias_mode, "grad_bias_mode", phase));
  if (a.grad_weight)
    HL_TRY(resolve_stride(fn, "grad_weight_stride", a.grad_weight_stride, d.hidden, &a.grad_weight_stride));
  if (a.rows > 0) HL_TRY(check_row_args(fn, p, a, phase));
  if (a.grad && a.grad == a.logits && d.grad_mode == HL_LOSS_GRAD_ACCUMULATE)
    return fail(HL_STATUS_INVALID_VALUE, "%s: grad is the logits (in place): it cannot be "
                "accumulated into; use HL_LOSS_GRAD_WRITE", fn);
  *bufs = arg_buffers(p, a);
  return check_buffers(fn, d.backend, bufs->data(), int(bufs->size()));
}

}  // namespace

hl_status_t check_seqlens(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                          const void *host_cu) {
  int64_t prev = 0;
  for (int64_t s = 0; s <= a.num_seqs; ++s) {
    const int64_t v = cpu::load_int(host_cu, p.desc.cu_seqlens_dtype, s);
    if (v < prev || v > a.rows || (s == 0 && v != 0) || (s == a.num_seqs && v != a.rows))
      return fail(HL_STATUS_INVALID_VALUE, "%s: cu_seqlens[%lld] is %lld; cu_seqlens must start at 0, "
                  "not decrease, and end at rows = %lld", fn, (long long)s, (long long)v,
                  (long long)a.rows);
    prev = v;
  }
  return HL_STATUS_SUCCESS;
}

namespace {

// Host inputs: cu_seqlens, the first label that is out of range and not ignored, then a sparse
// teacher's rows (CUDA's order).
hl_status_t check_host_inputs(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a) {
  if (a.cu_seqlens) HL_TRY(check_seqlens(fn, p, a, a.cu_seqlens));
  for (int64_t i = 0; a.labels && i < a.rows; ++i) {
    const int64_t y = cpu::load_int(a.labels, p.desc.labels_dtype, i);
    const bool ignored = y < 0 || (p.desc.use_ignore_index && y == p.desc.ignore_index);
    if (!ignored && y >= p.desc.vocab_global)
      return fail(HL_STATUS_INVALID_VALUE,
                  "%s: labels[%lld] is %lld, outside [0, vocab = %lld) and not ignored", fn,
                  (long long)i, (long long)y, (long long)p.desc.vocab_global);
  }
  if (!p.opt.topk || !a.teacher_topk_ids) return HL_STATUS_SUCCESS;
  const size_t isz = p.desc.teacher_topk_ids_dtype == HL_DTYPE_I64 ? 8 : 4;
  for (int64_t i = 0; i < a.rows; ++i)
    HL_TRY(check_topk_row(fn, p, i, static_cast<const char *>(a.teacher_topk_ids) + i * a.teacher_topk_ids_stride * isz,
                          a.teacher_topk_logprobs + i * a.teacher_topk_logprobs_stride));
  return HL_STATUS_SUCCESS;
}

// The workspace bounds for `rows` rows (0 on the CPU): the least refused past HL_MAX_SPAN_BYTES,
// the fastest capped there (no buffer is larger).
hl_status_t workspace_sizes(const char *fn, const hl_loss_plan_st &p, int64_t rows, size_t *min_bytes,
                            size_t *fast_bytes) {
  *min_bytes = *fast_bytes = 0;
#if HL_HAVE_CUDA
  if (p.desc.backend == HL_BACKEND_CUDA) cuda_workspace_sizes(p, rows, min_bytes, fast_bytes);
#endif
  *fast_bytes = std::min(*fast_bytes, size_t(HL_MAX_SPAN_BYTES));
  return check_bytes(fn, *min_bytes, "the workspace for these rows");
}

// The workspace of a call (large enough, aligned, in the backend's memory) added to its buffers.
hl_status_t add_workspace(const char *fn, const hl_loss_plan_st &p, int64_t rows, void *ws, size_t bytes,
                          std::vector<Buffer> &bufs) {
  size_t need = 0, fast = 0;
  HL_TRY(workspace_sizes(fn, p, rows, &need, &fast));
  bufs.emplace_back();
  return check_workspace(fn, p.desc.backend, ws, bytes, need, 16, &bufs.back());
}

// A buffer of `ranks` blocks of `rows` rows (MIDDLE: of the middle step) named `name`: present,
// large enough, 8-byte aligned, in the backend's memory; added to the call's buffers.
hl_status_t add_blocks(const char *fn, const char *name, const void *buf, size_t bytes, int ranks,
                       int64_t rows, const hl_loss_plan_st &p, bool middle, bool output,
                       std::vector<Buffer> &bufs) {
  HL_TRY(check_not_null(fn, name, buf));
  const uint64_t need = sat_mul(uint64_t(ranks), block_bytes(p, rows, middle));
  HL_TRY(check_bytes(fn, need, "the blocks of these rows and ranks"));
  if (bytes < need)
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s_bytes is %zu; %d block(s) of %lld rows need %llu",
                fn, name, bytes, ranks, (long long)rows, (unsigned long long)need);
  if (reinterpret_cast<uintptr_t>(buf) % 8)
    return fail(HL_STATUS_MISALIGNED, "%s: %s (%p) must be 8-byte aligned", fn, name, buf);
  HL_TRY(check_location(fn, name, buf, p.desc.backend));
  bufs.push_back({name, buf, 1, int64_t(need), int64_t(need), kBytes, output});
  return HL_STATUS_SUCCESS;
}

// The last checks of a call, once every size is: its buffers clear of each other but for the
// gradient over the logits (its kernels read a logit before the thread that reads it stores its
// gradient: the row kernel's passes, the split's finish after its statistics step), then on the
// CPU backend the host data (cu_seqlens, labels, a sparse teacher's ids).
hl_status_t check_call(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                       const std::vector<Buffer> &bufs) {
  HL_TRY(check_aliasing(fn, bufs.data(), int(bufs.size()), {{"grad", "logits"}}));
  return p.desc.backend == HL_BACKEND_CPU ? check_host_inputs(fn, p, a) : HL_STATUS_SUCCESS;
}

// The arguments of a split call (statistics, middle or finish), validated (validate_args) with
// the plan. exchanges: the steps' count of exchanges this call belongs to (0: either).
hl_status_t split_args(const char *fn, hl_loss_plan_t plan, const hl_loss_args_t *args, Phase phase,
                       int exchanges, hl_loss_args_t *a, std::vector<Buffer> *bufs) {
  HL_TRY(check_not_null(fn, "plan", plan));
  if (exchanges == 1 && plan->exchanges == 2)
    return fail(HL_STATUS_INVALID_VALUE, "%s: the plan (dense DISTILL_JSD) needs two exchanges: "
                "hl_loss_plan_execute_middle after the first gather, a second gather, then "
                "hl_loss_plan_execute_finish_with_middle", fn);
  if (exchanges == 2 && plan->exchanges == 1)
    return fail(HL_STATUS_INVALID_VALUE, "%s: the plan needs one exchange and has no middle step "
                "(hl_loss_plan_get_exchanges): finish with hl_loss_plan_execute_finish", fn);
  HL_TRY(read_descriptor(fn, "args", args, a, kEarlierArgsSizes));
  return validate_args(fn, *plan, *a, phase, bufs);
}

// The CPU backend: the headers of `gathered`'s blocks checked (MIDDLE: the middle step's), the
// records after them.
hl_status_t cpu_blocks(const char *fn, const hl_loss_plan_st &p, int64_t rows, const char *gathered,
                       bool middle = false) {
  const size_t bb = block_bytes(p, rows, middle);
  std::vector<BlockHeader> h(size_t(p.desc.ranks));
  for (int r = 0; r < p.desc.ranks; ++r) std::memcpy(&h[size_t(r)], gathered + size_t(r) * bb, sizeof(BlockHeader));
  return check_blocks(fn, p, rows, h.data(), middle);
}

// The CPU backend's merge of the gathered blocks, rows in buffer order.
std::vector<char> cpu_merged(const hl_loss_plan_st &p, int64_t rows, const char *gathered) {
  std::vector<char> merged(size_t(rows) * record_bytes(p));
  cpu_merge(p, rows, gathered + sizeof(BlockHeader), block_bytes(p, rows), p.desc.ranks, merged.data());
  return merged;
}

// The CPU backend's finish: headers checked, rows merged in buffer order, for dense JSD the
// ranks' middle sums added in buffer order (gathered_middle), the rest of the loss.
hl_status_t cpu_merge_finish(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                             const char *gathered, const char *gathered_middle) {
  HL_TRY(cpu_blocks(fn, p, a.rows, gathered));
  std::vector<MidSums<double>> mid(gathered_middle ? size_t(a.rows) : 0);
  if (gathered_middle) {
    HL_TRY(cpu_blocks(fn, p, a.rows, gathered_middle, true));
    cpu_merge_middle(a.rows, gathered_middle + sizeof(BlockHeader), block_bytes(p, a.rows, true),
                     p.desc.ranks, mid.data());
  }
  return cpu_finish(p, a, cpu_merged(p, a.rows, gathered).data(), mid.data());
}

}  // namespace

hl_status_t check_topk_row(const char *fn, const hl_loss_plan_st &p, int64_t i, const void *ids,
                           const float *logprobs) {
  std::vector<int64_t> seen;
  for (int k = 0; k < p.opt.topk; ++k) {
    const int64_t id = cpu::load_int(ids, p.desc.teacher_topk_ids_dtype, k);
    if (id < 0) continue;  // padding
    if (id >= p.desc.vocab_global)
      return fail(HL_STATUS_INVALID_VALUE, "%s: teacher_topk_ids[%lld, %d] is %lld, outside [0, vocab "
                  "= %lld) and not padding (< 0)", fn, (long long)i, k, (long long)id,
                  (long long)p.desc.vocab_global);
    if (!topk_logprob_ok(logprobs[k]))
      return fail(HL_STATUS_INVALID_VALUE, "%s: teacher_topk_logprobs[%lld, %d] is %g; a log-prob "
                  "must be finite and <= 0 (+%g)", fn, (long long)i, k, double(logprobs[k]),
                  double(kTopkLogprobTol));
    seen.push_back(id);
  }
  std::sort(seen.begin(), seen.end());
  const auto dup = std::adjacent_find(seen.begin(), seen.end());
  if (dup != seen.end())
    return fail(HL_STATUS_INVALID_VALUE, "%s: teacher_topk_ids row %lld holds id %lld twice (the "
                "rest bucket needs distinct ids)", fn, (long long)i, (long long)*dup);
  return HL_STATUS_SUCCESS;
}

void CudaPlanDeleter::operator()(dev::CudaPlan *state) const {
#if HL_HAVE_CUDA
  cuda_plan_destroy(state);
#else
  (void)state;  // a build without CUDA makes no CUDA plan
#endif
}

size_t record_bytes(const hl_loss_plan_st &p) {
  const size_t k = size_t(p.opt.topk);
  if (p.desc.backend == HL_BACKEND_CPU) return sizeof(CpuStats) + k * sizeof(double);
  if (p.opt.distill == kDistillNone) return offsetof(RowStats<float>, mt);
  return sizeof(RowStats<float>) + (k * sizeof(float) + 7) / 8 * 8;
}

size_t middle_record_bytes(const hl_loss_plan_st &p) {
  return p.desc.backend == HL_BACKEND_CPU ? sizeof(MidSums<double>) : sizeof(MidSums<float>);
}

size_t block_bytes(const hl_loss_plan_st &p, int64_t rows, bool middle) {
  return sizeof(BlockHeader) + size_t(rows) * (middle ? middle_record_bytes(p) : record_bytes(p));
}

BlockHeader make_header(const hl_loss_plan_st &p, int64_t rows, bool middle) {
  const hl_loss_plan_desc_t &d = p.desc;
  return BlockHeader{middle ? kMiddleTag : kBlockTag, p.fingerprint, rows, d.vocab_start, d.vocab,
                     d.vocab_global, int64_t(middle ? middle_record_bytes(p) : record_bytes(p)), 0};
}

hl_status_t check_blocks(const char *fn, const hl_loss_plan_st &p, int64_t rows,
                         const BlockHeader *headers, bool middle) {
  const hl_loss_plan_desc_t &d = p.desc;
  const char *name = middle ? "gathered_middle" : "gathered";  // the buffer's C name
  std::vector<std::pair<int64_t, int64_t>> shards;  // (vocab_start, vocab)
  bool mine = false;
  const size_t rb = middle ? middle_record_bytes(p) : record_bytes(p);
  for (int r = 0; r < d.ranks; ++r) {
    const BlockHeader &h = headers[r];
    if (h.tag != (middle ? kMiddleTag : kBlockTag))
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s block %d is not a block of %s (bad header)", fn,
                  name, r, middle ? "middle sums from hl_loss_plan_execute_middle"
                  : "statistics from hl_loss_plan_execute_stats");
    if (h.record_bytes != int64_t(rb))
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s block %d has %lld-byte records; this plan's are %zu "
                  "(ranks on different backends?)", fn, name, r, (long long)h.record_bytes, rb);
    if (h.rows != rows)
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s block %d has %lld rows; this call has %lld (the "
                  "ranks disagree on N)", fn, name, r, (long long)h.rows, (long long)rows);
    if (h.fingerprint != p.fingerprint || h.vocab_global != d.vocab_global)
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s block %d comes from a different plan (the ranks "
                  "disagree on the terms, options, ranks or vocab_global)", fn, name, r);
    if (h.zero != 0)
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s block %d's header holds %lld in its reserved 8th "
                  "word; it must be 0", fn, name, r, (long long)h.zero);
    // Checked before any sum of the two: a header is the caller's data.
    if (h.vocab_start < 0 || h.vocab < 1 || h.vocab_start > d.vocab_global - h.vocab)
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s block %d's shard (vocab_start %lld, vocab %lld) is "
                  "not inside [0, vocab_global = %lld)", fn, name, r, (long long)h.vocab_start,
                  (long long)h.vocab, (long long)d.vocab_global);
    shards.emplace_back(h.vocab_start, h.vocab);
    mine |= h.vocab_start == d.vocab_start && h.vocab == d.vocab;
  }
  std::sort(shards.begin(), shards.end());
  int64_t next = 0;
  for (const auto &s : shards) {
    if (s.first != next)
      return fail(HL_STATUS_INVALID_VALUE, "%s: the shards of %s do not tile [0, %lld): column %lld is "
                  "%s", fn, name, (long long)d.vocab_global, (long long)std::min(next, s.first),
                  s.first > next ? "owned by no shard" : "owned by two shards");
    next = s.first + s.second;
  }
  if (next != d.vocab_global)
    return fail(HL_STATUS_INVALID_VALUE, "%s: the shards of %s do not tile [0, %lld): columns from %lld "
                "are owned by no shard", fn, name, (long long)d.vocab_global, (long long)next);
  if (!mine)
    return fail(HL_STATUS_INVALID_VALUE, "%s: this plan's shard [%lld, %lld) is not among the "
                "blocks of %s", fn, (long long)d.vocab_start, (long long)(d.vocab_start + d.vocab), name);
  return HL_STATUS_SUCCESS;
}

}  // namespace hl::loss

using namespace hl;
using namespace hl::loss;

namespace {

// hl_loss_plan_get_workspace_sizes under the name of the entry point asked.
hl_status_t workspace_query(const char *fn, hl_loss_plan_t plan, int64_t rows, size_t *min_bytes,
                            size_t *fast_bytes) {
  HL_TRY(check_not_null(fn, "plan", plan));
  HL_TRY(check_rows(fn, *plan, rows));
  size_t lo = 0, hi = 0;
  HL_TRY(workspace_sizes(fn, *plan, rows, &lo, &hi));
  if (min_bytes) *min_bytes = lo;
  if (fast_bytes) *fast_bytes = hi;
  return HL_STATUS_SUCCESS;
}

// The bytes of one block of statistics (MIDDLE: of middle sums) for `rows` rows.
hl_status_t block_query(const char *fn, hl_loss_plan_t plan, int64_t rows, size_t *bytes, bool middle) {
  HL_TRY(check_not_null(fn, "plan", plan));
  HL_TRY(check_not_null(fn, "bytes", bytes));
  HL_TRY(check_rows(fn, *plan, rows));
  if (middle && plan->exchanges != 2)
    return fail(HL_STATUS_INVALID_VALUE, "%s: the plan needs one exchange and has no middle step", fn);
  *bytes = block_bytes(*plan, rows, middle);
  return HL_STATUS_SUCCESS;
}

// The statistics step, with a workspace or without.
hl_status_t stats_step(const char *fn, hl_loss_plan_t plan, const hl_loss_args_t *args, void *stats,
                       size_t stats_bytes, void *workspace, size_t workspace_bytes, hl_stream_t stream) {
  hl_loss_args_t a;
  std::vector<Buffer> bufs;
  HL_TRY(split_args(fn, plan, args, kStats, 0, &a, &bufs));
  const hl_loss_plan_st &p = *plan;
  HL_TRY(add_blocks(fn, "stats", stats, stats_bytes, 1, a.rows, p, false, true, bufs));
  const bool needs = p.linear && p.desc.backend == HL_BACKEND_CUDA;
  if (needs && !workspace && a.rows)
    return fail(HL_STATUS_INSUFFICIENT_WORKSPACE, "%s: the fused linear form forms its logits in a "
                "workspace: use hl_loss_plan_execute_stats_ws", fn);
  // A workspace given where none is needed is checked as any other: a wrong one is a caller's bug.
  if (needs || workspace || workspace_bytes) HL_TRY(add_workspace(fn, p, a.rows, workspace, workspace_bytes, bufs));
  HL_TRY(check_call(fn, p, a, bufs));
#if HL_HAVE_CUDA
  if (p.desc.backend == HL_BACKEND_CUDA) return cuda_stats(fn, p, a, stats, workspace, workspace_bytes, stream);
#endif
  (void)stream, (void)workspace, (void)workspace_bytes;
  const BlockHeader h = make_header(p, a.rows);
  std::memcpy(stats, &h, sizeof h);
  cpu_stats(p, a, static_cast<char *>(stats) + sizeof h);
  return HL_STATUS_SUCCESS;
}

// hl_loss_plan_execute_finish (exchanges 1) and _finish_with_middle (2: gathered_middle, the middle
// step's blocks).
hl_status_t finish(const char *fn, hl_loss_plan_t plan, const hl_loss_args_t *args, int exchanges,
                   const void *gathered, size_t gathered_bytes, const void *gathered_middle,
                   size_t gathered_middle_bytes, void *workspace, size_t workspace_bytes,
                   hl_stream_t stream) {
  hl_loss_args_t a;
  std::vector<Buffer> bufs;
  HL_TRY(split_args(fn, plan, args, kFinish, exchanges, &a, &bufs));
  const hl_loss_plan_st &p = *plan;
  const int ranks = p.desc.ranks;
  HL_TRY(add_blocks(fn, "gathered", gathered, gathered_bytes, ranks, a.rows, p, false, false, bufs));
  if (exchanges == 2)
    HL_TRY(add_blocks(fn, "gathered_middle", gathered_middle, gathered_middle_bytes, ranks, a.rows, p, true,
                      false, bufs));
  HL_TRY(add_workspace(fn, p, a.rows, workspace, workspace_bytes, bufs));
  HL_TRY(check_call(fn, p, a, bufs));
#if HL_HAVE_CUDA
  if (p.desc.backend == HL_BACKEND_CUDA)
    return cuda_finish(fn, p, a, gathered, gathered_middle, workspace, workspace_bytes, stream);
#endif
  (void)stream;
  return cpu_merge_finish(fn, p, a, static_cast<const char *>(gathered),
                          static_cast<const char *>(gathered_middle));
}

}  // namespace

extern "C" {

HL_API hl_status_t hl_loss_plan_create(const hl_loss_plan_desc_t *desc, hl_loss_plan_t *plan) {
  static const char *fn = "hl_loss_plan_create";
  return guarded(fn, [&]() -> hl_status_t {
    HL_TRY(check_not_null(fn, "plan", plan));
    hl_loss_plan_desc_t d;
    HL_TRY(read_descriptor(fn, "desc", desc, &d, kEarlierDescSizes));
    // 0.4-0.6's descriptors (232 bytes) end in padding where `preference` now lies: not a field.
    if (d.struct_size < offsetof(hl_loss_plan_desc_t, pref_loss_type)) d.preference = 0;
    Options o{};
    HL_TRY(validate_desc(fn, d, o));
    PrefOptions pref{};
    HL_TRY(validate_preference_desc(fn, d, &pref));
    auto p = std::make_unique<hl_loss_plan_st>();
    p->desc = d;
    p->opt = o;
    p->needs_labels = (d.terms & kLabelTerms) != 0;
    p->linear = d.hidden > 0;
    p->dlogits = p->linear ? d.grad_hidden_mode != HL_LOSS_GRAD_NONE || d.grad_weight_mode != HL_LOSS_GRAD_NONE ||
                                 d.grad_bias_mode != HL_LOSS_GRAD_NONE
                           : d.grad_mode != HL_LOSS_GRAD_NONE;
    p->sequences = d.cu_seqlens_dtype != HL_DTYPE_NONE;
    p->pref = pref;
    p->seq_stats = o.seq_ratio || pref.kind >= 0;
    p->exchanges = o.distill == kDistillJsd ? 2 : 1;
    p->fingerprint = fingerprint(d, o, pref);
#if HL_HAVE_CUDA
    if (d.backend == HL_BACKEND_CUDA) HL_TRY(cuda_plan(fn, *p));
#endif
    *plan = p.release();
    return HL_STATUS_SUCCESS;
  });
}

HL_API hl_status_t hl_loss_plan_get_workspace_sizes(hl_loss_plan_t plan, int64_t rows,
                                                    size_t *min_bytes, size_t *fast_bytes) {
  static const char *fn = "hl_loss_plan_get_workspace_sizes";
  return guarded(fn, [&]() { return workspace_query(fn, plan, rows, min_bytes, fast_bytes); });
}

HL_API hl_status_t hl_loss_plan_get_workspace_size(hl_loss_plan_t plan, int64_t rows, size_t *bytes) {
  static const char *fn = "hl_loss_plan_get_workspace_size";
  return guarded(fn, [&]() -> hl_status_t {
    HL_TRY(check_not_null(fn, "bytes", bytes));
    return workspace_query(fn, plan, rows, nullptr, bytes);
  });
}

HL_API hl_status_t hl_loss_plan_execute(hl_loss_plan_t plan, const hl_loss_args_t *args,
                                        void *workspace, size_t workspace_bytes, hl_stream_t stream) {
  static const char *fn = "hl_loss_plan_execute";
  return guarded(fn, [&]() -> hl_status_t {
    HL_TRY(check_not_null(fn, "plan", plan));
    hl_loss_args_t a;
    HL_TRY(read_descriptor(fn, "args", args, &a, kEarlierArgsSizes));
    if (plan->desc.ranks > 1)
      return fail(HL_STATUS_INVALID_VALUE, "%s: the plan is a vocabulary shard; run it with "
                  "hl_loss_plan_execute_stats, a gather, and hl_loss_plan_execute_finish (or "
                  "hl_loss_plan_execute_nccl)", fn);
    std::vector<Buffer> bufs;
    HL_TRY(validate_args(fn, *plan, a, kWhole, &bufs));
    HL_TRY(add_workspace(fn, *plan, a.rows, workspace, workspace_bytes, bufs));
    HL_TRY(check_call(fn, *plan, a, bufs));
#if HL_HAVE_CUDA
    if (plan->desc.backend == HL_BACKEND_CUDA)
      return cuda_execute(fn, *plan, a, workspace, workspace_bytes, stream);
#endif
    (void)stream;
    return cpu_execute(*plan, a);
  });
}

HL_API hl_status_t hl_loss_plan_get_stats_size(hl_loss_plan_t plan, int64_t rows, size_t *bytes) {
  static const char *fn = "hl_loss_plan_get_stats_size";
  return guarded(fn, [&]() { return block_query(fn, plan, rows, bytes, false); });
}

HL_API hl_status_t hl_loss_plan_execute_stats_ws(hl_loss_plan_t plan, const hl_loss_args_t *args,
                                                 void *stats, size_t stats_bytes, void *workspace,
                                                 size_t workspace_bytes, hl_stream_t stream) {
  static const char *fn = "hl_loss_plan_execute_stats_ws";
  return guarded(fn, [&]() {
    return stats_step(fn, plan, args, stats, stats_bytes, workspace, workspace_bytes, stream);
  });
}

HL_API hl_status_t hl_loss_plan_execute_stats(hl_loss_plan_t plan, const hl_loss_args_t *args,
                                              void *stats, size_t stats_bytes, hl_stream_t stream) {
  static const char *fn = "hl_loss_plan_execute_stats";
  return guarded(fn, [&]() { return stats_step(fn, plan, args, stats, stats_bytes, nullptr, 0, stream); });
}

HL_API hl_status_t hl_loss_plan_get_exchanges(hl_loss_plan_t plan, int *exchanges) {
  static const char *fn = "hl_loss_plan_get_exchanges";
  return guarded(fn, [&]() -> hl_status_t {
    HL_TRY(check_not_null(fn, "plan", plan));
    HL_TRY(check_not_null(fn, "exchanges", exchanges));
    *exchanges = plan->exchanges;
    return HL_STATUS_SUCCESS;
  });
}

HL_API hl_status_t hl_loss_plan_get_middle_size(hl_loss_plan_t plan, int64_t rows, size_t *bytes) {
  static const char *fn = "hl_loss_plan_get_middle_size";
  return guarded(fn, [&]() { return block_query(fn, plan, rows, bytes, true); });
}

HL_API hl_status_t hl_loss_plan_execute_middle(hl_loss_plan_t plan, const hl_loss_args_t *args,
                                               const void *gathered, size_t gathered_bytes,
                                               void *middle, size_t middle_bytes, void *workspace,
                                               size_t workspace_bytes, hl_stream_t stream) {
  static const char *fn = "hl_loss_plan_execute_middle";
  return guarded(fn, [&]() -> hl_status_t {
    hl_loss_args_t a;
    std::vector<Buffer> bufs;
    HL_TRY(split_args(fn, plan, args, kMiddle, 2, &a, &bufs));
    const hl_loss_plan_st &p = *plan;
    HL_TRY(add_blocks(fn, "gathered", gathered, gathered_bytes, p.desc.ranks, a.rows, p, false, false, bufs));
    HL_TRY(add_blocks(fn, "middle", middle, middle_bytes, 1, a.rows, p, true, true, bufs));
    HL_TRY(add_workspace(fn, p, a.rows, workspace, workspace_bytes, bufs));
    HL_TRY(check_call(fn, p, a, bufs));
#if HL_HAVE_CUDA
    if (p.desc.backend == HL_BACKEND_CUDA)
      return cuda_middle(fn, p, a, gathered, middle, workspace, workspace_bytes, stream);
#endif
    (void)stream;
    HL_TRY(cpu_blocks(fn, p, a.rows, static_cast<const char *>(gathered)));
    std::vector<MidSums<double>> mid(size_t(a.rows));
    cpu_middle(p, a, cpu_merged(p, a.rows, static_cast<const char *>(gathered)).data(), mid.data());
    const BlockHeader h = make_header(p, a.rows, true);
    std::memcpy(middle, &h, sizeof h);
    if (a.rows) std::memcpy(static_cast<char *>(middle) + sizeof h, mid.data(), mid.size() * sizeof mid[0]);
    return HL_STATUS_SUCCESS;
  });
}

HL_API hl_status_t hl_loss_plan_execute_finish(hl_loss_plan_t plan, const hl_loss_args_t *args,
                                               const void *gathered, size_t gathered_bytes,
                                               void *workspace, size_t workspace_bytes,
                                               hl_stream_t stream) {
  static const char *fn = "hl_loss_plan_execute_finish";
  return guarded(fn, [&]() {
    return finish(fn, plan, args, 1, gathered, gathered_bytes, nullptr, 0, workspace, workspace_bytes, stream);
  });
}

HL_API hl_status_t hl_loss_plan_execute_finish_with_middle(hl_loss_plan_t plan,
                                                           const hl_loss_args_t *args,
                                                           const void *gathered, size_t gathered_bytes,
                                                           const void *gathered_middle,
                                                           size_t gathered_middle_bytes,
                                                           void *workspace, size_t workspace_bytes,
                                                           hl_stream_t stream) {
  static const char *fn = "hl_loss_plan_execute_finish_with_middle";
  return guarded(fn, [&]() {
    return finish(fn, plan, args, 2, gathered, gathered_bytes, gathered_middle, gathered_middle_bytes,
                  workspace, workspace_bytes, stream);
  });
}

HL_API hl_status_t hl_loss_plan_execute_nccl(hl_loss_plan_t plan, const hl_loss_args_t *args,
                                             void *nccl_comm, void *workspace,
                                             size_t workspace_bytes, hl_stream_t stream) {
  static const char *fn = "hl_loss_plan_execute_nccl";
  return guarded(fn, [&]() -> hl_status_t {
    hl_loss_args_t a;
    std::vector<Buffer> bufs;
    HL_TRY(split_args(fn, plan, args, kFinish, 0, &a, &bufs));
    HL_TRY(check_not_null(fn, "nccl_comm", nccl_comm));
    if (plan->desc.backend != HL_BACKEND_CUDA)
      return fail(HL_STATUS_NOT_SUPPORTED, "%s: NCCL needs a CUDA plan; on the CPU backend use "
                  "hl_loss_plan_execute_stats, your gather, and hl_loss_plan_execute_finish", fn);
    if (a.grad_hidden && a.rows > 1 && a.grad_hidden_stride != plan->desc.hidden)
      return fail(HL_STATUS_INVALID_VALUE, "%s: grad_hidden_stride is %lld; the all-reduce of "
                  "grad_hidden needs it packed (%lld)", fn, (long long)a.grad_hidden_stride,
                  (long long)plan->desc.hidden);
    HL_TRY(add_workspace(fn, *plan, a.rows, workspace, workspace_bytes, bufs));
    HL_TRY(check_call(fn, *plan, a, bufs));
#if HL_HAVE_CUDA
    return nccl_execute(fn, *plan, a, nccl_comm, workspace, workspace_bytes, stream);
#else
    (void)stream;
    return fail(HL_STATUS_INTERNAL_ERROR, "%s: a CUDA plan in a build without CUDA", fn);
#endif
  });
}

HL_API const char *hl_loss_scalar_name(int index) {
  static const char *const names[] = {
      "loss", "ce", "z", "entropy", "distill", "grpo", "kl_ref", "divisor", "weight_sum",
      "valid_rows", "lse_mean", "entropy_mean", "logp_mean", "accuracy", "ratio_mean", "ratio_min",
      "ratio_max", "clip_low", "clip_high", "clip_any", "k3_old", "kl_ref_mean", "adv_mean",
      "adv_min", "adv_max", "distill_kl_mean", "cispo", "dual_clip", "rollout_kl_k1",
      "rollout_kl_k3", "rollout_weight_mean", "rollout_corrected", "topk_mass", "preference",
      "rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin", "logps_chosen",
      "logps_rejected", "log_odds_ratio", "log_odds_chosen", "kto_kl"};
  static_assert(sizeof names / sizeof names[0] == HL_LOSS_NUM_SCALARS, "one name per scalar");
  return index >= 0 && index < HL_LOSS_NUM_SCALARS ? names[index] : nullptr;
}

HL_API hl_status_t hl_loss_plan_destroy(hl_loss_plan_t plan) {
  delete plan;
  return succeed();
}

}  // extern "C"
