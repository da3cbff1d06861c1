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
//                       4 teacher_logits, 8 advantages, 16 old_logprobs, 32 ref_logprobs)
//                       rets scalars f32[HL_LOSS_NUM_SCALARS], [grad: grad_mode != 0],
//                       [token_loss, token_logp, token_entropy, token_lse: token_outputs]
//                       attrs: the hl_loss_plan_desc_t fields by name (terms, flags, ce_weight, ...,
//                       grad_mode), divisor (f64), grad_scale (f32), inputs, token_outputs (i32).
// Loss plans are created once per configuration (the plan description plus the backend) and kept
// in a process-wide, mutex-guarded cache; plans are immutable and safe to share between threads.
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "headloss.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Fail(hl_status_t s, const char *what) {
  std::string msg = std::string(what) + ": " + hl_get_error_string(s);
  const char *detail = hl_get_last_error();
  if (detail && *detail) msg += std::string(": ") + detail;
  return ffi::Error(s == HL_STATUS_INVALID_VALUE ? ffi::ErrorCode::kInvalidArgument : ffi::ErrorCode::kInternal,
                    msg);
}

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
  void *Get(size_t bytes, bool *ok) {
    *ok = true;
    if (bytes == 0) return nullptr;
    if (scratch) {
      // XLA's FFI allocator accepts alignments up to 16 (its memory is 256-byte aligned anyway);
      // the library asks for 16.
      auto p = scratch->Allocate(bytes, 16);
      if (!p.has_value()) { *ok = false; return nullptr; }
      return *p;
    }
    host.resize(bytes);
    return host.data();
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

ffi::Error RmsnormFwd(hl_backend_t backend, hl_stream_t stream, ffi::RemainingArgs args,
                      ffi::RemainingRets rets, ffi::Dictionary attrs) {
  const int has_res = Get<int32_t>(attrs, "has_residual", 0);
  const int has_w = Get<int32_t>(attrs, "has_weight", 0);
  const int want_rstd = Get<int32_t>(attrs, "want_rstd", 0);
  hl_rmsnorm_fwd_args_t a;
  std::memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.backend = backend;
  a.cast = static_cast<hl_rmsnorm_cast_t>(Get<int32_t>(attrs, "cast", 0));
  a.eps = Get<float>(attrs, "eps", 1e-6f);
  a.offset = Get<float>(attrs, "offset", 0.0f);
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
  hl_status_t s = rmsnorm_fwd(&a, stream);
  return s == HL_STATUS_SUCCESS ? ffi::Error::Success() : Fail(s, "rmsnorm_fwd");
}

ffi::Error RmsnormBwd(hl_backend_t backend, hl_stream_t stream, ffi::ScratchAllocator *scratch,
                      ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  hl_rmsnorm_bwd_args_t a;
  std::memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.backend = backend;
  a.cast = static_cast<hl_rmsnorm_cast_t>(Get<int32_t>(attrs, "cast", 0));
  a.eps = Get<float>(attrs, "eps", 1e-6f);
  a.offset = Get<float>(attrs, "offset", 0.0f);
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
  size_t bytes = 0;
  hl_status_t s = rmsnorm_bwd_workspace_size(&a, &bytes);
  if (s != HL_STATUS_SUCCESS) return Fail(s, "rmsnorm_bwd_workspace_size");
  Workspace ws{scratch, {}};
  bool ok = true;
  a.workspace = ws.Get(bytes, &ok);
  a.workspace_bytes = bytes;
  if (!ok)
    return ffi::Error::Internal("headloss: rmsnorm_bwd: XLA could not allocate a workspace of " +
                                std::to_string(bytes) + " bytes");
  s = rmsnorm_bwd(&a, stream);
  return s == HL_STATUS_SUCCESS ? ffi::Error::Success() : Fail(s, "rmsnorm_bwd");
}

// ---- loss plans, cached per configuration --------------------------------------------------------

std::mutex g_plans_mu;
std::map<std::string, hl_loss_plan_t> g_plans;

ffi::Error GetPlan(const hl_loss_plan_desc_t &d, hl_loss_plan_t *plan) {
  std::string key(reinterpret_cast<const char *>(&d), sizeof d);
  std::lock_guard<std::mutex> lock(g_plans_mu);
  auto it = g_plans.find(key);
  if (it != g_plans.end()) {
    *plan = it->second;
    return ffi::Error::Success();
  }
  hl_status_t s = hl_loss_plan_create(&d, plan);
  if (s != HL_STATUS_SUCCESS) return Fail(s, "hl_loss_plan_create");
  g_plans.emplace(std::move(key), *plan);
  return ffi::Error::Success();
}

ffi::Error Loss(hl_backend_t backend, hl_stream_t stream, ffi::ScratchAllocator *scratch,
                ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  const int inputs = Get<int32_t>(attrs, "inputs", 0);
  size_t ai = 0, ri = 0;
  HL_JAX_ARG(logits, args, ai++);
  hl_loss_plan_desc_t d;
  std::memset(&d, 0, sizeof d);  // also zeroes the padding: the description is the cache key
  d.struct_size = sizeof d;
  d.backend = backend;
  int64_t rows = 0;
  RowsCols(logits, &rows, &d.vocab);
  HL_JAX_DTYPE(d.logits_dtype, logits, "logits");
  d.labels_dtype = HL_DTYPE_NONE;
  d.terms = static_cast<unsigned>(Get<int32_t>(attrs, "terms", HL_LOSS_CE));
  d.flags = static_cast<unsigned>(Get<int32_t>(attrs, "flags", 0));
  d.ce_weight = Get<float>(attrs, "ce_weight", 1.0f);
  d.z_weight = Get<float>(attrs, "z_weight", 1.0f);
  d.entropy_weight = Get<float>(attrs, "entropy_weight", 1.0f);
  d.distill_weight = Get<float>(attrs, "distill_weight", 1.0f);
  d.grpo_weight = Get<float>(attrs, "grpo_weight", 1.0f);
  d.kl_ref_beta = Get<float>(attrs, "kl_ref_beta", 1.0f);
  d.label_smoothing = Get<float>(attrs, "label_smoothing", 0.0f);
  d.logit_scale = Get<float>(attrs, "logit_scale", 0.0f);
  d.softcap = Get<float>(attrs, "softcap", 0.0f);
  d.teacher_temperature = Get<float>(attrs, "teacher_temperature", 0.0f);
  d.student_temperature = Get<float>(attrs, "student_temperature", 0.0f);
  d.eps_low = Get<float>(attrs, "eps_low", 0.0f);
  d.eps_high = Get<float>(attrs, "eps_high", 0.0f);
  d.use_ignore_index = Get<int32_t>(attrs, "use_ignore_index", 0);
  d.ignore_index = Get<int64_t>(attrs, "ignore_index", -100);
  d.grad_mode = static_cast<hl_loss_grad_mode_t>(Get<int32_t>(attrs, "grad_mode", 0));

  hl_loss_args_t a;
  std::memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.rows = rows;
  a.logits = logits.untyped_data();
  a.divisor = Get<double>(attrs, "divisor", 0.0);
  a.grad_scale = Get<float>(attrs, "grad_scale", 0.0f);
  if (inputs & 1) {
    HL_JAX_ARG(b, args, ai++);
    HL_JAX_DTYPE(d.labels_dtype, b, "labels");
    a.labels = b.untyped_data();
  }
  const void **opt[] = {reinterpret_cast<const void **>(&a.weights), &a.teacher_logits,
                        reinterpret_cast<const void **>(&a.advantages),
                        reinterpret_cast<const void **>(&a.old_logprobs),
                        reinterpret_cast<const void **>(&a.ref_logprobs)};
  for (int bit = 1; bit < 6; ++bit) {
    if (inputs & (1 << bit)) {
      HL_JAX_ARG(b, args, ai++);
      *opt[bit - 1] = b.untyped_data();
    }
  }
  HL_JAX_RET(scalars, rets, ri++);
  a.scalars = static_cast<float *>(scalars->untyped_data());
  if (d.grad_mode != HL_LOSS_GRAD_NONE) {
    HL_JAX_RET(grad, rets, ri++);
    HL_JAX_DTYPE(d.grad_dtype, *grad, "grad");
    a.grad = grad->untyped_data();
  }
  if (Get<int32_t>(attrs, "token_outputs", 0)) {
    float **tok[] = {&a.token_loss, &a.token_logp, &a.token_entropy, &a.token_lse};
    for (float **t : tok) {
      HL_JAX_RET(b, rets, ri++);
      *t = static_cast<float *>(b->untyped_data());
    }
  }
  hl_loss_plan_t plan = nullptr;
  ffi::Error err = GetPlan(d, &plan);
  if (!err.success()) return err;
  size_t bytes = 0;
  hl_status_t s = hl_loss_plan_get_workspace_size(plan, rows, &bytes);
  if (s != HL_STATUS_SUCCESS) return Fail(s, "hl_loss_plan_get_workspace_size");
  Workspace ws{scratch, {}};
  bool ok = true;
  void *w = ws.Get(bytes, &ok);
  if (!ok)
    return ffi::Error::Internal("headloss: loss plan: XLA could not allocate a workspace of " +
                                std::to_string(bytes) + " bytes");
  s = hl_loss_plan_execute(plan, &a, w, bytes, stream);
  return s == HL_STATUS_SUCCESS ? ffi::Error::Success() : Fail(s, "hl_loss_plan_execute");
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    hl_jax_loss,
    [](hl_stream_t stream, ffi::ScratchAllocator scratch, ffi::RemainingArgs args,
       ffi::RemainingRets rets, ffi::Dictionary attrs) {
      return Loss(HL_BACKEND_CUDA, stream, &scratch, args, rets, attrs);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    hl_jax_loss_cpu,
    [](ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
      return Loss(HL_BACKEND_CPU, nullptr, nullptr, args, rets, attrs);
    },
    ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());
