// headloss_jax: XLA FFI handlers over the headloss C ABI, for jax.ffi.ffi_call.
//
// Built only when the XLA FFI headers are found (jax.ffi.include_dir(), or -DHL_JAX_FFI_INCLUDE=...);
// python/headloss/jax.py loads this library and registers each handler with
// jax.ffi.register_ffi_target, for platform "CUDA" (hl_jax_*: HL_BACKEND_CUDA on XLA's stream) and
// "cpu" (hl_jax_*_cpu: the CPU reference backend on host buffers).
//
// Handlers (arguments and results are dense row-major XLA buffers; optional ones are present when
// the named attribute is 1, in the order listed):
//   hl_jax_rmsnorm_fwd  args x, [residual: has_residual], [weight: has_weight]
//                       rets y, [residual_out: has_residual], [rstd: want_rstd]
//                       attrs eps, offset (f32), cast, has_weight, has_residual, want_rstd (i32)
//   hl_jax_rmsnorm_bwd  args dy, s, [rstd: has_rstd], [weight: has_weight], [dres_out: has_dres]
//                       rets dx, [dw: has_weight]       attrs eps, offset, cast, has_* (as above)
//   hl_jax_loss         args logits, then one buffer per bit of `inputs` (1 labels, 2 weights,
//                       4 teacher_logits, 8 advantages, 16 old_logprobs, 32 ref_logprobs,
//                       256 rollout_logprobs, 512 cu_seqlens [sequences + 1] in the attribute
//                       cu_seqlens_dtype, 1024 teacher_topk_ids [.., k] s32 / s64, 2048
//                       teacher_topk_logprobs [.., k] f32: a sparse teacher, teacher_topk = k from
//                       their shape; 4096 grad_token_logp, 8192 grad_token_entropy, 16384
//                       grad_token_lse f32 [rows]: per-token upstream gradients, each setting its
//                       HL_LOSS_GRAD_TOKEN_* flag; with cu_seqlens, 32768 ref_seq_logprobs f32 and
//                       65536 kto_labels s32 [sequences]: the preference term's)
//                       rets scalars f32[HL_LOSS_NUM_SCALARS], [grad: grad_mode != 0],
//                       [token_loss, token_logp, token_entropy, token_lse: token_outputs]
//                       attrs: the hl_loss_plan_desc_t fields by name (terms, flags, ce_weight, ...,
//                       grad_mode; vocab_global (i64) and ranks for a shard), divisor (f64),
//                       grad_scale (f32), inputs, token_outputs (i32), max_workspace_bytes (i64,
//                       optional: caps the workspace, never below the plan's minimum).
//   The fused linear form (attr linear = 1), through the same handlers: args hidden [.., H], weight
//                       [V, H] instead of logits, inputs bits as above plus 64 teacher_hidden,
//                       128 teacher_weight; rets scalars, [grad_hidden: grad_hidden_mode],
//                       [grad_weight: grad_weight_mode], [tokens]. Its workspace (the chunks of
//                       logits) comes from XLA's scratch allocator: the plan's fast size unless
//                       max_workspace_bytes caps it.
// The vocabulary-sharded loss (hl_loss_plan_execute_stats / _finish; the caller all-gathers the
// blocks in between, e.g. jax.lax.all_gather under shard_map), attrs as hl_jax_loss:
//   hl_jax_loss_stats   args logits (or hidden, weight), [labels], [teacher_logits], [teacher_hidden,
//                       teacher_weight] (bits of `inputs`), vocab_start
//                       rets block u8[hl_loss_plan_get_stats_size]; attrs grad_dtype (or
//                       grad_hidden_dtype, grad_weight_dtype; i32 hl_dtype_t) name the finish's
//                       gradient dtypes (the block's plan must match). The linear form's statistics
//                       step takes a workspace of its own (finish forms the logits again).
//   hl_jax_loss_middle  dense JSD's middle step (hl_loss_plan_execute_middle): args as
//                       hl_jax_loss_stats with gathered before vocab_start; rets its middle block
//                       u8[hl_loss_plan_get_middle_size]; attrs as hl_jax_loss_stats
//   hl_jax_loss_finish  args as hl_jax_loss, then gathered (u8, the ranks' blocks), with attr
//                       middle = 1 the ranks' middle blocks (hl_loss_plan_execute_finish_with_middle),
//                       vocab_start; rets as hl_jax_loss
// vocab_start is a scalar s32 / s64 operand, not an attribute: under shard_map every device runs
// one program and learns its shard's first column at run time (from jax.lax.axis_index).
// Loss plans are created once per configuration (the plan description, vocab_start included, plus
// the backend and the device) and kept in a process-wide, mutex-guarded cache; plans are immutable
// and safe to share between threads.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "headloss.h"
#include "xla/ffi/api/ffi.h"
#if HL_JAX_CUDA
#include <cuda_runtime_api.h>  // only to read vocab_start from device memory
#endif

namespace ffi = xla::ffi;

namespace {

ffi::Error Fail(hl_status_t s, const char *what) {
  std::string msg = std::string(what) + ": " + hl_get_error_string(s);
  const char *detail = hl_get_last_error();
  if (detail && *detail) msg += std::string(": ") + detail;
  return ffi::Error(s == HL_STATUS_INVALID_VALUE ? ffi::ErrorCode::kInvalidArgument : ffi::ErrorCode::kInternal,
                    msg);
}

ffi::Error Done(hl_status_t s, const char *what) {
  return s == HL_STATUS_SUCCESS ? ffi::Error::Success() : Fail(s, what);
}

#define HL_JAX_TRY(expr)                    \
  do {                                      \
    ffi::Error hl_err_ = (expr);            \
    if (!hl_err_.success()) return hl_err_; \
  } while (0)

bool ToHl(ffi::DataType t, hl_dtype_t *out) {
  switch (t) {
    case ffi::DataType::F32: *out = HL_DTYPE_F32; return true;
    case ffi::DataType::F16: *out = HL_DTYPE_F16; return true;
    case ffi::DataType::BF16: *out = HL_DTYPE_BF16; return true;
    case ffi::DataType::S32: *out = HL_DTYPE_I32; return true;
    case ffi::DataType::S64: *out = HL_DTYPE_I64; return true;
    default: return false;
  }
}

// Reads attribute `name` when present, else `def`.
template <typename T>
T Get(const ffi::Dictionary &d, std::string_view name, T def) {
  if (!d.contains(name)) return def;
  auto v = d.get<T>(name);
  return v.has_value() ? *v : def;
}

// Sets *field from attribute `name` (of type A) when present: descriptors start from their
// defaults (zero: the header's INIT) and take only the options given.
template <typename A = void, typename F>
void Take(const ffi::Dictionary &d, std::string_view name, F *field) {
  using T = std::conditional_t<std::is_void_v<A>, F, A>;
  if (d.contains(name))
    if (auto v = d.get<T>(name); v.has_value()) *field = static_cast<F>(*v);
}

// [rows, cols] of a buffer seen as its leading dims flattened over the last one.
void RowsCols(const ffi::AnyBuffer &b, int64_t *rows, int64_t *cols) {
  auto dims = b.dimensions();
  *cols = dims.size() ? dims.back() : 1;
  int64_t r = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) r *= dims[i];
  *rows = dims.size() ? r : 1;
}

// Workspace: XLA's scratch allocator on CUDA, host memory on the CPU backend.
struct Workspace {
  ffi::ScratchAllocator *scratch;
  std::vector<unsigned char> host;
  ffi::Error Get(size_t bytes, const char *what, void **out) {
    *out = nullptr;
    if (bytes == 0) return ffi::Error::Success();
    if (!scratch) {
      host.resize(bytes);
      *out = host.data();
      return ffi::Error::Success();
    }
    // XLA's FFI allocator accepts alignments up to 16 (its memory is 256-byte aligned anyway);
    // the library asks for 16.
    auto p = scratch->Allocate(bytes, 16);
    if (!p.has_value())
      return ffi::Error::Internal(std::string("headloss: ") + what +
                                  ": XLA could not allocate a workspace of " + std::to_string(bytes) +
                                  " bytes");
    *out = *p;
    return ffi::Error::Success();
  }
};

#define HL_JAX_ARG(var, args, i)                                         \
  auto var##_or = (args).get<ffi::AnyBuffer>(i);                         \
  if (!var##_or.has_value()) return var##_or.error();                   \
  ffi::AnyBuffer var = *var##_or
#define HL_JAX_RET(var, rets, i)                                         \
  auto var##_or = (rets).get<ffi::AnyBuffer>(i);                         \
  if (!var##_or.has_value()) return var##_or.error();                   \
  ffi::Result<ffi::AnyBuffer> var = *var##_or
#define HL_JAX_DTYPE(out, buf, what)                                               \
  if (!ToHl((buf).element_type(), &(out)))                                         \
    return ffi::Error::InvalidArgument(std::string("headloss: unsupported dtype for ") + (what))

// The fields an RMSNorm descriptor (forward or backward, from its INIT) takes from the attributes.
template <class A>
void RmsnormOptions(hl_backend_t backend, const ffi::Dictionary &attrs, A *a) {
  a->backend = backend;
  Take<int32_t>(attrs, "cast", &a->cast);
  Take(attrs, "eps", &a->eps);
  Take(attrs, "offset", &a->offset);
}

ffi::Error RmsnormFwd(hl_backend_t backend, hl_stream_t stream, ffi::RemainingArgs args,
                      ffi::RemainingRets rets, ffi::Dictionary attrs) {
  const int has_res = Get<int32_t>(attrs, "has_residual", 0);
  const int has_w = Get<int32_t>(attrs, "has_weight", 0);
  const int want_rstd = Get<int32_t>(attrs, "want_rstd", 0);
  hl_rmsnorm_fwd_args_t a = HL_RMSNORM_FWD_ARGS_INIT;
  RmsnormOptions(backend, attrs, &a);
  size_t ai = 0, ri = 0;
  HL_JAX_ARG(x, args, ai++);
  RowsCols(x, &a.rows, &a.cols);
  HL_JAX_DTYPE(a.x_dtype, x, "x");
  a.x = x.untyped_data();
  HL_JAX_RET(y, rets, ri++);
  HL_JAX_DTYPE(a.y_dtype, *y, "y");
  a.y = y->untyped_data();
  if (has_res) {
    HL_JAX_ARG(r, args, ai++);
    HL_JAX_RET(s, rets, ri++);
    a.residual = r.untyped_data();
    a.residual_out = s->untyped_data();
  }
  if (has_w) {
    HL_JAX_ARG(w, args, ai++);
    HL_JAX_DTYPE(a.weight_dtype, w, "weight");
    a.weight = w.untyped_data();
  }
  if (want_rstd) {
    HL_JAX_RET(rstd, rets, ri++);
    a.rstd = static_cast<float *>(rstd->untyped_data());
  }
  return Done(hl_rmsnorm_fwd(&a, stream), "rmsnorm_fwd");
}

ffi::Error RmsnormBwd(hl_backend_t backend, hl_stream_t stream, ffi::ScratchAllocator *scratch,
                      ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  hl_rmsnorm_bwd_args_t a = HL_RMSNORM_BWD_ARGS_INIT;
  RmsnormOptions(backend, attrs, &a);
  size_t ai = 0, ri = 0;
  HL_JAX_ARG(dy, args, ai++);
  HL_JAX_ARG(x, args, ai++);
  RowsCols(x, &a.rows, &a.cols);
  HL_JAX_DTYPE(a.dy_dtype, dy, "dy");
  HL_JAX_DTYPE(a.x_dtype, x, "x");
  a.dy = dy.untyped_data();
  a.x = x.untyped_data();
  if (Get<int32_t>(attrs, "has_rstd", 0)) {
    HL_JAX_ARG(rstd, args, ai++);
    a.rstd = static_cast<const float *>(rstd.untyped_data());
  }
  const int has_w = Get<int32_t>(attrs, "has_weight", 0);
  if (has_w) {
    HL_JAX_ARG(w, args, ai++);
    HL_JAX_DTYPE(a.weight_dtype, w, "weight");
    a.weight = w.untyped_data();
  }
  if (Get<int32_t>(attrs, "has_dres", 0)) {
    HL_JAX_ARG(dr, args, ai++);
    a.dresidual_out = dr.untyped_data();
  }
  HL_JAX_RET(dx, rets, ri++);
  a.dx = dx->untyped_data();
  if (has_w) {
    HL_JAX_RET(dw, rets, ri++);
    HL_JAX_DTYPE(a.dw_dtype, *dw, "dw");
    a.dw = dw->untyped_data();
  }
  HL_JAX_TRY(Done(hl_rmsnorm_bwd_workspace_size(&a, &a.workspace_bytes), "rmsnorm_bwd_workspace_size"));
  Workspace ws{scratch, {}};
  HL_JAX_TRY(ws.Get(a.workspace_bytes, "rmsnorm_bwd", &a.workspace));
  return Done(hl_rmsnorm_bwd(&a, stream), "rmsnorm_bwd");
}

// ---- loss plans, cached per configuration --------------------------------------------------------

std::mutex g_plans_mu;
std::map<std::string, hl_loss_plan_t> g_plans;

// The key is the whole description (so one plan per shard: vocab_start, vocab_global and ranks are
// in it) and the device: a CUDA plan sets its kernels' attributes on the device that created it.
ffi::Error GetPlan(const hl_loss_plan_desc_t &d, int32_t device, hl_loss_plan_t *plan) {
  std::string key(reinterpret_cast<const char *>(&d), sizeof d);
  key.append(reinterpret_cast<const char *>(&device), sizeof device);
  std::lock_guard<std::mutex> lock(g_plans_mu);
  auto it = g_plans.find(key);
  if (it != g_plans.end()) {
    *plan = it->second;
    return ffi::Error::Success();
  }
  HL_JAX_TRY(Done(hl_loss_plan_create(&d, plan), "hl_loss_plan_create"));
  g_plans.emplace(std::move(key), *plan);
  return ffi::Error::Success();
}

// One loss call's plan description and arguments; ai, ri: the next argument and result;
// max_ws: the workspace cap (negative: none).
struct LossCall {
  hl_loss_plan_desc_t d;
  hl_loss_args_t a;
  size_t ai = 0, ri = 0;
  int64_t max_ws = -1;
};

ffi::Error Invalid(const std::string &msg) { return ffi::Error::InvalidArgument("headloss: " + msg); }

// A matrix argument the plan reads as `want` (its pointer carries no dtype).
ffi::Error CheckDtype(const ffi::AnyBuffer &b, hl_dtype_t want, const char *name) {
  hl_dtype_t t;
  if (!ToHl(b.element_type(), &t) || t != want)
    return Invalid(std::string(name) + " has another dtype than the plan reads it as");
  return ffi::Error::Success();
}

// The main operands: logits, or (linear = 1) hidden [rows, H] and weight [vocab, H].
ffi::Error LossOperands(ffi::RemainingArgs args, ffi::Dictionary attrs, LossCall *c) {
  hl_loss_plan_desc_t &d = c->d;
  hl_loss_args_t &a = c->a;
  if (!Get<int32_t>(attrs, "linear", 0)) {
    HL_JAX_ARG(logits, args, c->ai++);
    RowsCols(logits, &a.rows, &d.vocab);
    HL_JAX_DTYPE(d.logits_dtype, logits, "logits");
    a.logits = logits.untyped_data();
    Take<int32_t>(attrs, "grad_mode", &d.grad_mode);
    return ffi::Error::Success();
  }
  HL_JAX_ARG(hidden, args, c->ai++);
  HL_JAX_ARG(weight, args, c->ai++);
  int64_t wcols = 0;
  RowsCols(hidden, &a.rows, &d.hidden);
  RowsCols(weight, &d.vocab, &wcols);
  HL_JAX_DTYPE(d.weight_dtype, hidden, "hidden");
  HL_JAX_TRY(CheckDtype(weight, d.weight_dtype, "weight"));
  if (wcols != d.hidden || weight.dimensions().size() != 2)
    return Invalid("weight must be [vocab, " + std::to_string(d.hidden) + "] (hidden's last dimension)");
  a.hidden = hidden.untyped_data();
  a.weight = weight.untyped_data();
  Take<int32_t>(attrs, "grad_hidden_mode", &d.grad_hidden_mode);
  Take<int32_t>(attrs, "grad_weight_mode", &d.grad_weight_mode);
  return ffi::Error::Success();
}

// The description from the attributes and the operands; the arguments from the operands and the
// per-row inputs that the `inputs` bits name.
ffi::Error LossInputs(hl_backend_t backend, ffi::RemainingArgs args, ffi::Dictionary attrs,
                      LossCall *c) {
  hl_loss_plan_desc_t &d = c->d;
  hl_loss_args_t &a = c->a;
  // Zero with struct_size, which means what HL_LOSS_PLAN_DESC_INIT spells out; zeroed bytes (the
  // padding too) because the description is the plan cache's key.
  std::memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  d.backend = backend;
  a = HL_LOSS_ARGS_INIT;
  HL_JAX_TRY(LossOperands(args, attrs, c));
  // Only the options given: every other field keeps its default (the Python side sends none
  // of those it was not given).
  Take<int32_t>(attrs, "terms", &d.terms);
  Take<int32_t>(attrs, "flags", &d.flags);
  for (auto [name, field] : {std::pair{"ce_weight", &d.ce_weight}, {"z_weight", &d.z_weight},
                             {"entropy_weight", &d.entropy_weight}, {"distill_weight", &d.distill_weight},
                             {"grpo_weight", &d.grpo_weight}, {"kl_ref_beta", &d.kl_ref_beta},
                             {"label_smoothing", &d.label_smoothing}, {"logit_scale", &d.logit_scale},
                             {"softcap", &d.softcap}, {"teacher_temperature", &d.teacher_temperature},
                             {"student_temperature", &d.student_temperature}, {"eps_low", &d.eps_low},
                             {"eps_high", &d.eps_high}, {"dual_clip", &d.dual_clip},
                             {"cispo_weight", &d.cispo_weight}, {"cispo_eps_high", &d.cispo_eps_high},
                             {"rollout_cap", &d.rollout_cap}, {"rollout_floor", &d.rollout_floor},
                             {"jsd_beta", &d.jsd_beta}, {"pref_weight", &d.pref_weight},
                             {"pref_beta", &d.pref_beta}, {"pref_gamma", &d.pref_gamma},
                             {"pref_label_smoothing", &d.pref_label_smoothing}, {"pref_tau", &d.pref_tau},
                             {"kto_desirable_weight", &d.kto_desirable_weight},
                             {"kto_undesirable_weight", &d.kto_undesirable_weight}})
    Take(attrs, name, field);
  for (auto [name, field] : {std::pair{"kl_estimator", &d.kl_estimator}, {"ratio_level", &d.ratio_level},
                             {"rollout_correction", &d.rollout_correction},
                             {"rollout_level", &d.rollout_level}, {"use_ignore_index", &d.use_ignore_index},
                             {"ranks", &d.ranks}, {"preference", &d.preference},
                             {"pref_loss_type", &d.pref_loss_type}, {"pref_logp", &d.pref_logp}})
    Take(attrs, name, field);
  // An attribute (the statistics step gets no cu_seqlens, and its plan must be the finish's).
  Take<int32_t>(attrs, "cu_seqlens_dtype", &d.cu_seqlens_dtype);
  Take(attrs, "ignore_index", &d.ignore_index);
  Take(attrs, "vocab_global", &d.vocab_global);
  Take(attrs, "divisor", &a.divisor);
  Take(attrs, "grad_scale", &a.grad_scale);
  Take(attrs, "max_workspace_bytes", &c->max_ws);
  const int inputs = Get<int32_t>(attrs, "inputs", 0);
  // The library takes bare pointers: a buffer shorter than the rows it reads is refused here.
  const auto per_row = [&](const ffi::AnyBuffer &b, const char *name) {
    if (int64_t(b.element_count()) == a.rows) return ffi::Error::Success();
    return Invalid(std::string(name) + " has " + std::to_string(b.element_count()) + " elements; expected " +
                   std::to_string(a.rows) + ", one a row");
  };
  if (inputs & 1) {
    HL_JAX_ARG(b, args, c->ai++);
    HL_JAX_DTYPE(d.labels_dtype, b, "labels");
    HL_JAX_TRY(per_row(b, "labels"));
    a.labels = b.untyped_data();
  }
  // The teacher's matrices are in the logits' dtype (the linear form: the weight's).
  const hl_dtype_t mat = d.hidden ? d.weight_dtype : d.logits_dtype;
  struct Opt {
    const void **ptr;
    hl_dtype_t dtype;
    const char *name;
  } const opt[] = {{reinterpret_cast<const void **>(&a.weights), HL_DTYPE_F32, "weights"},
                   {&a.teacher_logits, mat, "teacher_logits"},
                   {reinterpret_cast<const void **>(&a.advantages), HL_DTYPE_F32, "advantages"},
                   {reinterpret_cast<const void **>(&a.old_logprobs), HL_DTYPE_F32, "old_logprobs"},
                   {reinterpret_cast<const void **>(&a.ref_logprobs), HL_DTYPE_F32, "ref_logprobs"},
                   {&a.teacher_hidden, mat, "teacher_hidden"},
                   {&a.teacher_weight, mat, "teacher_weight"},
                   {reinterpret_cast<const void **>(&a.rollout_logprobs), HL_DTYPE_F32, "rollout_logprobs"}};
  for (int bit = 1; bit < 9; ++bit) {
    if (!(inputs & (1 << bit))) continue;
    HL_JAX_ARG(b, args, c->ai++);
    HL_JAX_TRY(CheckDtype(b, opt[bit - 1].dtype, opt[bit - 1].name));
    *opt[bit - 1].ptr = b.untyped_data();
    int64_t rows = 0, cols = 0;
    RowsCols(b, &rows, &cols);
    constexpr int kPerRow = 2 | 8 | 16 | 32 | 256;  // weights, advantages, old / ref / rollout log-probs
    if ((1 << bit) & kPerRow) HL_JAX_TRY(per_row(b, opt[bit - 1].name));
    if (bit == 2 && (rows != a.rows || cols != d.vocab))
      return Invalid("teacher_logits must be [rows, vocab] as the logits");
    if (bit == 6 && rows != a.rows) return Invalid("teacher_hidden must have the hidden states' rows");
    if (bit == 6) d.teacher_hidden = cols;
    if (bit == 7 && (rows != d.vocab || cols != d.teacher_hidden))
      return Invalid("teacher_weight must be [vocab, teacher_hidden's last dimension]");
  }
  if (inputs & 512) {
    HL_JAX_ARG(b, args, c->ai++);
    HL_JAX_TRY(CheckDtype(b, d.cu_seqlens_dtype, "cu_seqlens"));
    a.cu_seqlens = b.untyped_data();
    a.num_seqs = std::max<int64_t>(int64_t(b.element_count()) - 1, 0);
  }
  if (inputs & (1 << 10)) {  // a sparse teacher: k and the ids' dtype from the ids
    HL_JAX_ARG(b, args, c->ai++);
    HL_JAX_DTYPE(d.teacher_topk_ids_dtype, b, "teacher_topk_ids");
    a.teacher_topk_ids = b.untyped_data();
    int64_t rows = 0, cols = 0;
    RowsCols(b, &rows, &cols);
    d.teacher_topk = int(cols);
  }
  if (inputs & (1 << 11)) {
    HL_JAX_ARG(b, args, c->ai++);
    HL_JAX_TRY(CheckDtype(b, HL_DTYPE_F32, "teacher_topk_logprobs"));
    a.teacher_topk_logprobs = static_cast<const float *>(b.untyped_data());
    int64_t rows = 0, cols = 0;
    RowsCols(b, &rows, &cols);
    if (cols != d.teacher_topk) return Invalid("teacher_topk_logprobs must be [..., k] as teacher_topk_ids");
  }
  // Per-token upstream gradients: each buffer given sets its flag, so the plan is the one it needs.
  const struct {
    const float **ptr;
    unsigned flag;
    const char *name;
  } up[] = {{&a.grad_token_logp, HL_LOSS_GRAD_TOKEN_LOGP, "grad_token_logp"},
            {&a.grad_token_entropy, HL_LOSS_GRAD_TOKEN_ENTROPY, "grad_token_entropy"},
            {&a.grad_token_lse, HL_LOSS_GRAD_TOKEN_LSE, "grad_token_lse"}};
  for (int k = 0; k < 3; ++k) {
    if (!(inputs & (1 << (12 + k)))) continue;
    HL_JAX_ARG(b, args, c->ai++);
    HL_JAX_TRY(CheckDtype(b, HL_DTYPE_F32, up[k].name));
    HL_JAX_TRY(per_row(b, up[k].name));
    *up[k].ptr = static_cast<const float *>(b.untyped_data());
    d.flags |= up[k].flag;
  }
  // The preference term's per-sequence inputs: one value a sequence of cu_seqlens.
  const struct {
    const void **ptr;
    hl_dtype_t dtype;
    const char *name;
  } seq[] = {{reinterpret_cast<const void **>(&a.ref_seq_logprobs), HL_DTYPE_F32, "ref_seq_logprobs"},
             {reinterpret_cast<const void **>(&a.kto_labels), HL_DTYPE_I32, "kto_labels"}};
  for (int k = 0; k < 2; ++k) {
    if (!(inputs & (1 << (15 + k)))) continue;
    HL_JAX_ARG(b, args, c->ai++);
    HL_JAX_TRY(CheckDtype(b, seq[k].dtype, seq[k].name));
    if (!(inputs & 512) || int64_t(b.element_count()) != a.num_seqs)
      return Invalid(std::string(seq[k].name) + " has " + std::to_string(b.element_count()) +
                     " elements; expected one a sequence of cu_seqlens (" + std::to_string(a.num_seqs) + ")");
    *seq[k].ptr = b.untyped_data();
  }
  return ffi::Error::Success();
}

// A gradient result, where its mode asks for one: its dtype and pointer.
ffi::Error GradOutput(ffi::RemainingRets rets, hl_loss_grad_mode_t mode, hl_dtype_t *dtype, void **ptr,
                      const char *name, LossCall *c) {
  if (mode == HL_LOSS_GRAD_NONE) return ffi::Error::Success();
  HL_JAX_RET(g, rets, c->ri++);
  HL_JAX_DTYPE(*dtype, *g, name);
  *ptr = g->untyped_data();
  return ffi::Error::Success();
}

// The results of a loss or finish call: scalars, [grad: grad_mode != 0] (the linear form:
// [grad_hidden], [grad_weight] by their modes), [4 per-token outputs].
ffi::Error LossOutputs(ffi::RemainingRets rets, ffi::Dictionary attrs, LossCall *c) {
  HL_JAX_RET(scalars, rets, c->ri++);
  c->a.scalars = static_cast<float *>(scalars->untyped_data());
  hl_loss_plan_desc_t &d = c->d;
  HL_JAX_TRY(GradOutput(rets, d.grad_mode, &d.grad_dtype, &c->a.grad, "grad", c));
  HL_JAX_TRY(GradOutput(rets, d.grad_hidden_mode, &d.grad_hidden_dtype, &c->a.grad_hidden, "grad_hidden", c));
  HL_JAX_TRY(GradOutput(rets, d.grad_weight_mode, &d.grad_weight_dtype, &c->a.grad_weight, "grad_weight", c));
  if (Get<int32_t>(attrs, "token_outputs", 0)) {
    float **tok[] = {&c->a.token_loss, &c->a.token_logp, &c->a.token_entropy, &c->a.token_lse};
    for (float **t : tok) {
      HL_JAX_RET(b, rets, c->ri++);
      *t = static_cast<float *>(b->untyped_data());
    }
  }
  return ffi::Error::Success();
}

// This shard's first column, the next argument: a scalar s32 / s64. On CUDA it is in device memory,
// so reading it costs an 8-byte copy and a synchronisation of XLA's stream, once per call (the
// library's own label and header checks add theirs unless flags has HL_LOSS_UNCHECKED).
ffi::Error VocabStart(hl_backend_t backend, hl_stream_t stream, ffi::RemainingArgs args, LossCall *c) {
  HL_JAX_ARG(b, args, c->ai++);
  const ffi::DataType t = b.element_type();
  if (b.element_count() != 1 || (t != ffi::DataType::S32 && t != ffi::DataType::S64))
    return ffi::Error::InvalidArgument("headloss: vocab_start must be a scalar int32 or int64");
  int32_t v32 = 0;
  int64_t v64 = 0;
  void *host = t == ffi::DataType::S32 ? static_cast<void *>(&v32) : static_cast<void *>(&v64);
  if (backend == HL_BACKEND_CPU) {
    std::memcpy(host, b.untyped_data(), b.size_bytes());
  } else {
#if HL_JAX_CUDA
    cudaError_t e = cudaMemcpyAsync(host, b.untyped_data(), b.size_bytes(), cudaMemcpyDeviceToHost, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess)
      return ffi::Error::Internal(std::string("headloss: reading vocab_start: ") + cudaGetErrorString(e));
#else
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "headloss: libheadloss_jax was built without CUDA; it cannot read vocab_start "
                      "from device memory");
#endif
  }
  c->d.vocab_start = t == ffi::DataType::S32 ? v32 : v64;
  return ffi::Error::Success();
}

// Finds c's plan and runs `run(plan, workspace, workspace_bytes)` with a workspace for its rows
// (unless want_ws is false): the plan's fast size, capped by c.max_ws, never below its minimum.
template <typename Run>
ffi::Error WithPlan(const LossCall &c, int32_t device, ffi::ScratchAllocator *scratch, Run run,
                    bool want_ws = true) {
  hl_loss_plan_t plan = nullptr;
  HL_JAX_TRY(GetPlan(c.d, device, &plan));
  size_t lo = 0, bytes = 0;
  if (want_ws)
    HL_JAX_TRY(Done(hl_loss_plan_get_workspace_sizes(plan, c.a.rows, &lo, &bytes),
                    "hl_loss_plan_get_workspace_sizes"));
  if (c.max_ws >= 0) bytes = std::max(lo, std::min(bytes, static_cast<size_t>(c.max_ws)));
  Workspace ws{scratch, {}};
  void *w = nullptr;
  HL_JAX_TRY(ws.Get(bytes, "loss plan", &w));
  return run(plan, w, bytes);
}

ffi::Error Loss(hl_backend_t backend, hl_stream_t stream, int32_t device, ffi::ScratchAllocator *scratch,
                ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  LossCall c;
  HL_JAX_TRY(LossInputs(backend, args, attrs, &c));
  HL_JAX_TRY(LossOutputs(rets, attrs, &c));
  return WithPlan(c, device, scratch, [&](hl_loss_plan_t plan, void *w, size_t bytes) {
    return Done(hl_loss_plan_execute(plan, &c.a, w, bytes, stream), "hl_loss_plan_execute");
  });
}

// The operands of the statistics and middle steps (gathered: the middle step's gathered blocks,
// before vocab_start). They have no gradient buffers to take the gradients' dtypes from, yet their
// plan must be the finish's: the attributes name them.
ffi::Error SplitInputs(hl_backend_t backend, hl_stream_t stream, ffi::RemainingArgs args,
                       ffi::Dictionary attrs, LossCall *c, const void **gathered = nullptr,
                       size_t *gathered_bytes = nullptr) {
  HL_JAX_TRY(LossInputs(backend, args, attrs, c));
  if (gathered) {
    HL_JAX_ARG(g, args, c->ai++);
    *gathered = g.untyped_data(), *gathered_bytes = g.size_bytes();
  }
  HL_JAX_TRY(VocabStart(backend, stream, args, c));
  const auto dtype = [&](const char *name) {
    return static_cast<hl_dtype_t>(Get<int32_t>(attrs, name, HL_DTYPE_NONE));
  };
  c->d.grad_dtype = dtype("grad_dtype");
  c->d.grad_hidden_dtype = dtype("grad_hidden_dtype");
  c->d.grad_weight_dtype = dtype("grad_weight_dtype");
  return ffi::Error::Success();
}

// The plan's size of a block (`size`: the statistics' or the middle step's), which the result
// `block` must have exactly: a larger one would pass the library's check but misplace the gathered
// blocks.
ffi::Error BlockBytes(hl_status_t (*size)(hl_loss_plan_t, int64_t, size_t *), const char *what,
                      hl_loss_plan_t plan, const LossCall &c, const ffi::AnyBuffer &block, size_t *bytes) {
  HL_JAX_TRY(Done(size(plan, c.a.rows, bytes), "the block size"));
  if (block.size_bytes() == *bytes) return ffi::Error::Success();
  return Invalid(std::string("the ") + what + " block has " + std::to_string(block.size_bytes()) +
                 " bytes; this plan's has " + std::to_string(*bytes) + " (sized for another platform?)");
}

ffi::Error LossStats(hl_backend_t backend, hl_stream_t stream, int32_t device, ffi::ScratchAllocator *scratch,
                     ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  LossCall c;
  HL_JAX_TRY(SplitInputs(backend, stream, args, attrs, &c));
  HL_JAX_RET(block, rets, c.ri++);
  // The linear form forms its logits in a workspace; the logits form needs none here.
  return WithPlan(c, device, scratch, [&](hl_loss_plan_t plan, void *w, size_t ws_bytes) {
    size_t bytes = 0;
    HL_JAX_TRY(BlockBytes(hl_loss_plan_get_stats_size, "stats", plan, c, *block, &bytes));
    return Done(hl_loss_plan_execute_stats_ws(plan, &c.a, block->untyped_data(), bytes, w, ws_bytes, stream),
                "hl_loss_plan_execute_stats");
  }, c.d.hidden > 0);
}

ffi::Error LossMiddle(hl_backend_t backend, hl_stream_t stream, int32_t device, ffi::ScratchAllocator *scratch,
                      ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  LossCall c;
  const void *gathered = nullptr;
  size_t gathered_bytes = 0;
  HL_JAX_TRY(SplitInputs(backend, stream, args, attrs, &c, &gathered, &gathered_bytes));
  HL_JAX_RET(block, rets, c.ri++);
  return WithPlan(c, device, scratch, [&](hl_loss_plan_t plan, void *w, size_t ws_bytes) {
    size_t bytes = 0;
    HL_JAX_TRY(BlockBytes(hl_loss_plan_get_middle_size, "middle", plan, c, *block, &bytes));
    return Done(hl_loss_plan_execute_middle(plan, &c.a, gathered, gathered_bytes, block->untyped_data(),
                                            bytes, w, ws_bytes, stream),
                "hl_loss_plan_execute_middle");
  });
}

ffi::Error LossFinish(hl_backend_t backend, hl_stream_t stream, int32_t device,
                      ffi::ScratchAllocator *scratch, ffi::RemainingArgs args, ffi::RemainingRets rets,
                      ffi::Dictionary attrs) {
  LossCall c;
  HL_JAX_TRY(LossInputs(backend, args, attrs, &c));
  HL_JAX_ARG(gathered, args, c.ai++);
  const bool two = Get<int32_t>(attrs, "middle", 0) != 0;
  const void *middle = nullptr;
  size_t middle_bytes = 0;
  if (two) {
    HL_JAX_ARG(m, args, c.ai++);
    middle = m.untyped_data(), middle_bytes = m.size_bytes();
  }
  HL_JAX_TRY(VocabStart(backend, stream, args, &c));
  HL_JAX_TRY(LossOutputs(rets, attrs, &c));
  return WithPlan(c, device, scratch, [&](hl_loss_plan_t plan, void *w, size_t bytes) {
    const void *g = gathered.untyped_data();
    if (two)
      return Done(hl_loss_plan_execute_finish_with_middle(plan, &c.a, g, gathered.size_bytes(), middle,
                                                          middle_bytes, w, bytes, stream),
                  "hl_loss_plan_execute_finish_with_middle");
    return Done(hl_loss_plan_execute_finish(plan, &c.a, g, gathered.size_bytes(), w, bytes, stream),
                "hl_loss_plan_execute_finish");
  });
}

}  // namespace

// The number of loss plans created so far (tests check that jit reuses them).
extern "C" __attribute__((visibility("default"))) int64_t hl_jax_loss_plan_count(void) {
  std::lock_guard<std::mutex> lock(g_plans_mu);
  return static_cast<int64_t>(g_plans.size());
}

// ---- CUDA: XLA's stream, device buffers -----------------------------------------------------------

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    hl_jax_rmsnorm_fwd,
    [](hl_stream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
      return RmsnormFwd(HL_BACKEND_CUDA, stream, args, rets, attrs);
    },
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<hl_stream_t>>().RemainingArgs().RemainingRets().Attrs());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    hl_jax_rmsnorm_bwd,
    [](hl_stream_t stream, ffi::ScratchAllocator scratch, ffi::RemainingArgs args,
       ffi::RemainingRets rets, ffi::Dictionary attrs) {
      return RmsnormBwd(HL_BACKEND_CUDA, stream, &scratch, args, rets, attrs);
    },
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<hl_stream_t>>()
        .Ctx<ffi::ScratchAllocator>()
        .RemainingArgs()
        .RemainingRets()
        .Attrs());

// ---- CPU: the reference backend on host buffers ---------------------------------------------------

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    hl_jax_rmsnorm_fwd_cpu,
    [](ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
      return RmsnormFwd(HL_BACKEND_CPU, nullptr, args, rets, attrs);
    },
    ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    hl_jax_rmsnorm_bwd_cpu,
    [](ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
      return RmsnormBwd(HL_BACKEND_CPU, nullptr, nullptr, args, rets, attrs);
    },
    ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());

// ---- the loss handlers on both platforms (the CPU ones as device -1) ----------------------------

#define HL_JAX_LOSS_HANDLERS(name, impl)                                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                  \
      name,                                                                                       \
      [](hl_stream_t stream, int32_t device, ffi::ScratchAllocator scratch, ffi::RemainingArgs args, \
         ffi::RemainingRets rets, ffi::Dictionary attrs) {                                        \
        return impl(HL_BACKEND_CUDA, stream, device, &scratch, args, rets, attrs);                \
      },                                                                                          \
      ffi::Ffi::Bind()                                                                            \
          .Ctx<ffi::PlatformStream<hl_stream_t>>()                                                \
          .Ctx<ffi::DeviceOrdinal>()                                                              \
          .Ctx<ffi::ScratchAllocator>()                                                           \
          .RemainingArgs()                                                                        \
          .RemainingRets()                                                                        \
          .Attrs());                                                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                  \
      name##_cpu,                                                                                 \
      [](ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {               \
        return impl(HL_BACKEND_CPU, nullptr, -1, nullptr, args, rets, attrs);                     \
      },                                                                                          \
      ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs())

HL_JAX_LOSS_HANDLERS(hl_jax_loss, Loss);
HL_JAX_LOSS_HANDLERS(hl_jax_loss_stats, LossStats);
HL_JAX_LOSS_HANDLERS(hl_jax_loss_middle, LossMiddle);
HL_JAX_LOSS_HANDLERS(hl_jax_loss_finish, LossFinish);
