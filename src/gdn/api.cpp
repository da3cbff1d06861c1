// gdn_bwd_dqkwg entry points: validate everything (cu_seqlens contents included), then hand over
// to a backend.
#include <cmath>
#include <utility>
#include <vector>

#include "common.h"
#include "cpu/scalar.h"
#include "gdn.h"
#include "hl/gdn/chunks.h"
#include "kernels/gdn/launch.h"

namespace hl::gdn {
namespace {

constexpr std::initializer_list<size_t> kEarlierSizes = {240};  // headloss.h: 0.1, before flags

// The tensors' element counts (headloss.h's layouts), each within HL_MAX_SPAN_BYTES once checked.
struct Counts {
  uint64_t qk, vv, w, state, gate;  // q, k, dq, dk; v, do, dv; dw; h, dh; g, dg
};
Counts counts(const hl_gdn_bwd_dqkwg_args_t &a, int64_t nt) {
  const uint64_t tok = sat_mul(uint64_t(a.B), uint64_t(a.T)), hv = uint64_t(a.HV);
  return {sat_mul(sat_mul(tok, uint64_t(a.H)), uint64_t(a.K)), sat_mul(sat_mul(tok, hv), uint64_t(a.V)),
          sat_mul(sat_mul(tok, hv), uint64_t(a.K)),
          sat_mul(sat_mul(sat_mul(uint64_t(a.B), uint64_t(nt)), hv), uint64_t(a.K * a.V)), sat_mul(tok, hv)};
}

// The CUDA kernels' limits: heads in int, and one CTA per (chunk, q/k head, 64-wide K slice) in
// one grid dimension.
hl_status_t check_cuda_limits(const char *fn, const hl_gdn_bwd_dqkwg_args_t &a, int64_t nt) {
  if (a.HV > INT32_MAX)
    return fail(HL_STATUS_NOT_SUPPORTED, "%s: HV is %lld; the CUDA backend takes HV <= 2^31 - 1", fn,
                (long long)a.HV);
  const uint64_t ctas = sat_mul(sat_mul(sat_mul(uint64_t(a.B), uint64_t(nt)), uint64_t(a.H)),
                                uint64_t((a.K + kChunk - 1) / kChunk));
  if (ctas > uint64_t(INT32_MAX))
    return fail(HL_STATUS_NOT_SUPPORTED, "%s: B * num_chunks (ceil(T / 64) without cu_seqlens) * H * "
                "ceil(K / 64) is %llu; the CUDA backend takes at most 2^31 - 1 (one CTA each)", fn,
                (unsigned long long)ctas);
  return HL_STATUS_SUCCESS;
}

// Sizes and options that need no memory access, sizes and enumerations first.
hl_status_t check_shape(const char *fn, const hl_gdn_bwd_dqkwg_args_t &a) {
  HL_TRY(check_extents(fn, {{"B", a.B}, {"T", a.T}, {"H", a.H}, {"HV", a.HV}, {"K", a.K}, {"V", a.V},
                            {"num_chunks", a.num_chunks}, {"num_seqs", a.num_seqs}}));
  HL_TRY(check_enums(fn, {enum_field("backend", a.backend), enum_field("dtype", a.dtype),
                          enum_field("h_dtype", a.h_dtype), enum_field("gate", a.gate),
                          enum_field("cu_seqlens_dtype", a.cu_seqlens_dtype)}));
  HL_TRY(check_backend(fn, a.backend));
  if (a.H < 1 || a.HV < 1 || a.HV % a.H)
    return fail(HL_STATUS_INVALID_VALUE, "%s: H is %lld and HV is %lld; need H >= 1 and HV a multiple of H",
                fn, (long long)a.H, (long long)a.HV);
  if (a.K < 1 || a.V < 1)
    return fail(HL_STATUS_INVALID_VALUE, "%s: K is %lld and V is %lld; both must be >= 1", fn,
                (long long)a.K, (long long)a.V);
  if (a.K > kMaxDim || a.V > kMaxDim)
    return fail(HL_STATUS_NOT_SUPPORTED, "%s: K is %lld and V is %lld; at most %lld is supported", fn,
                (long long)a.K, (long long)a.V, (long long)kMaxDim);
  if (a.dtype != HL_DTYPE_F16 && a.dtype != HL_DTYPE_BF16)
    return fail(HL_STATUS_INVALID_VALUE, "%s: dtype is %s; expected F16 or BF16", fn, dtype_name(a.dtype));
  if (a.h_dtype != a.dtype && a.h_dtype != HL_DTYPE_F32)
    return fail(HL_STATUS_INVALID_VALUE, "%s: h_dtype is %s; expected dtype (%s) or F32", fn,
                dtype_name(a.h_dtype), dtype_name(a.dtype));
  const bool per_token = has_dg(a.gate), decay = a.gate >= HL_GDN_GATE_CONST_DECAY;
  if (per_token != (a.g != nullptr))
    return fail(HL_STATUS_INVALID_VALUE, "%s: g is %s; it is required with gate LOG or LOG2 and only then",
                fn, a.g ? "set" : "NULL");
  if (decay != (a.g_gamma != nullptr))
    return fail(HL_STATUS_INVALID_VALUE, "%s: g_gamma is %s; it is required with gate CONST_DECAY* and only then",
                fn, a.g_gamma ? "set" : "NULL");
  if (per_token != (a.dg != nullptr))
    return fail(HL_STATUS_INVALID_VALUE,
                "%s: dg is %s; it is produced with gate LOG or LOG2 (required) and not otherwise (as fla)",
                fn, a.dg ? "set" : "NULL");
  if (a.reverse_cumsum != 0 && a.reverse_cumsum != 1)
    return fail(HL_STATUS_INVALID_VALUE, "%s: reverse_cumsum is %d; use 0 or 1", fn, a.reverse_cumsum);
  if (a.dw && !a.dv) return fail(HL_STATUS_INVALID_VALUE, "%s: dw is set but dv is NULL", fn);
  if (!std::isfinite(a.scale)) return fail(HL_STATUS_INVALID_VALUE, "%s: scale is not finite", fn);
  if (a.flags & ~(HL_GDN_UNCHECKED | HL_GDN_STATE_V_FIRST))
    return fail(HL_STATUS_INVALID_VALUE, "%s: flags is 0x%x; only HL_GDN_UNCHECKED and HL_GDN_STATE_V_FIRST are defined",
                fn, a.flags);
  const int64_t nt = chunks_in(a.T);
  if (a.cu_seqlens) {
    if (a.B != 1)
      return fail(HL_STATUS_INVALID_VALUE, "%s: B is %lld with cu_seqlens; varlen needs B = 1", fn, (long long)a.B);
    if (a.cu_seqlens_dtype != HL_DTYPE_I32 && a.cu_seqlens_dtype != HL_DTYPE_I64)
      return fail(HL_STATUS_INVALID_VALUE, "%s: cu_seqlens_dtype is %s; expected I32 or I64", fn,
                  dtype_name(a.cu_seqlens_dtype));
    if (a.num_seqs < 1)
      return fail(HL_STATUS_INVALID_VALUE, "%s: num_seqs is %lld; must be >= 1 with cu_seqlens", fn,
                  (long long)a.num_seqs);
  } else if (a.num_chunks != 0 && a.num_chunks != nt) {
    return fail(HL_STATUS_INVALID_VALUE, "%s: num_chunks is %lld; without cu_seqlens it is ceil(T / 64) = %lld",
                fn, (long long)a.num_chunks, (long long)nt);
  }
  const Counts c = counts(a, a.cu_seqlens ? a.num_chunks : nt);
  const size_t e = dtype_size(a.dtype);
  HL_TRY(check_bytes(fn, sat_mul(c.qk, e), "q, k, dq and dk ([B, T, H, K])"));
  HL_TRY(check_bytes(fn, sat_mul(c.vv, e), "v, do and dv ([B, T, HV, V])"));
  if (a.dw) HL_TRY(check_bytes(fn, sat_mul(c.w, e), "dw ([B, T, HV, K])"));
  HL_TRY(check_bytes(fn, sat_mul(c.state, dtype_size(a.h_dtype)), "h and dh ([B, num_chunks, HV, K, V])"));
  if (per_token) HL_TRY(check_bytes(fn, sat_mul(c.gate, 4), "g and dg ([B, T, HV])"));
  return a.backend == HL_BACKEND_CUDA ? check_cuda_limits(fn, a, a.cu_seqlens ? a.num_chunks : nt)
                                      : HL_STATUS_SUCCESS;
}

// cu_seqlens (host copy) starts at 0, never decreases, ends at T and has num_chunks chunks.
hl_status_t check_cu_seqlens(const char *fn, const hl_gdn_bwd_dqkwg_args_t &a, const std::vector<int64_t> &cu) {
  if (cu[0] != 0)
    return fail(HL_STATUS_INVALID_VALUE, "%s: cu_seqlens[0] is %lld; must be 0", fn, (long long)cu[0]);
  for (size_t i = 1; i < cu.size(); ++i)
    if (cu[i] < cu[i - 1] || cu[i] > a.T)
      return fail(HL_STATUS_INVALID_VALUE, "%s: cu_seqlens[%zu] is %lld after %lld; cu_seqlens never "
                  "decreases and must end at T (%lld)", fn, i, (long long)cu[i], (long long)cu[i - 1],
                  (long long)a.T);
  if (cu.back() != a.T)
    return fail(HL_STATUS_INVALID_VALUE, "%s: cu_seqlens[%zu] is %lld; cu_seqlens must end at T (%lld)", fn,
                cu.size() - 1, (long long)cu.back(), (long long)a.T);
  const int64_t chunks = Chunks(1, a.T, cu).count();
  if (chunks != a.num_chunks)
    return fail(HL_STATUS_INVALID_VALUE, "%s: num_chunks is %lld; cu_seqlens makes %lld chunks", fn,
                (long long)a.num_chunks, (long long)chunks);
  return HL_STATUS_SUCCESS;
}

size_t workspace_bytes(const hl_gdn_bwd_dqkwg_args_t &a) {
#if HL_HAVE_CUDA
  if (a.backend == HL_BACKEND_CUDA) return cuda_workspace_bytes(a);
#endif
  return 0;
}

// Pointers, workspace and aliasing (no output may share memory with an input: every input is
// read after outputs start); then cu_seqlens, read to the host (*cu) and checked.
hl_status_t check_memory(const char *fn, const hl_gdn_bwd_dqkwg_args_t &a, hl_stream_t stream,
                         std::vector<int64_t> *cu) {
  for (const auto &[name, p] : {std::pair<const char *, const void *>{"q", a.q}, {"k", a.k}, {"v", a.v},
                                {"do_", a.do_}, {"h", a.h}, {"dh", a.dh}, {"dq", a.dq}, {"dk", a.dk}})
    HL_TRY(check_not_null(fn, name, p));
  // Element counts fit int64: check_shape bounded their bytes.
  const Counts c = counts(a, a.num_chunks);
  const int64_t qk = int64_t(c.qk), vv = int64_t(c.vv), w = int64_t(c.w), st = int64_t(c.state);
  const int64_t gt = int64_t(c.gate), ns = a.num_seqs + 1;
  const hl_dtype_t dt = a.dtype, f32 = HL_DTYPE_F32;
  Buffer bufs[] = {
      {"q", a.q, 1, qk, qk, dt, false},
      {"k", a.k, 1, qk, qk, dt, false},
      {"v", a.v, 1, vv, vv, dt, false},
      {"do_", a.do_, 1, vv, vv, dt, false},
      {"dv", a.dw ? a.dv : nullptr, 1, vv, vv, dt, false},
      {"h", a.h, 1, st, st, a.h_dtype, false},
      {"dh", a.dh, 1, st, st, a.h_dtype, false},
      {"g", a.g, 1, gt, gt, f32, false},
      {"g_gamma", a.g_gamma, 1, a.HV, a.HV, f32, false},
      {"cu_seqlens", a.cu_seqlens, 1, ns, ns, a.cu_seqlens_dtype, false},
      {"dq", a.dq, 1, qk, qk, dt, true},
      {"dk", a.dk, 1, qk, qk, dt, true},
      {"dw", a.dw, 1, w, w, dt, true},
      {"dg", a.dg, 1, gt, gt, f32, true},
      {},
  };
  constexpr int n = int(sizeof bufs / sizeof bufs[0]);
  HL_TRY(check_buffers(fn, a.backend, bufs, n - 1));
  HL_TRY(check_workspace(fn, a.backend, a.workspace, a.workspace_bytes, workspace_bytes(a), 16, &bufs[n - 1]));
  HL_TRY(check_aliasing(fn, bufs, n, {}));
  if (!a.cu_seqlens) return HL_STATUS_SUCCESS;
#if HL_HAVE_CUDA
  if (a.backend == HL_BACKEND_CUDA && (a.flags & HL_GDN_UNCHECKED)) return HL_STATUS_SUCCESS;  // table on the device
  if (a.backend == HL_BACKEND_CUDA) {
    HL_TRY(cuda_read_cu_seqlens(a, stream, cu));
    return check_cu_seqlens(fn, a, *cu);
  }
#endif
  (void)stream;
  cu->resize(size_t(ns));
  for (int64_t i = 0; i <= a.num_seqs; ++i) (*cu)[size_t(i)] = cpu::load_int(a.cu_seqlens, a.cu_seqlens_dtype, i);
  return check_cu_seqlens(fn, a, *cu);
}

}  // namespace
}  // namespace hl::gdn

using namespace hl;
using namespace hl::gdn;

extern "C" {

HL_API hl_status_t hl_gdn_bwd_dqkwg_workspace_size(const hl_gdn_bwd_dqkwg_args_t *args, size_t *bytes) {
  static const char *fn = "hl_gdn_bwd_dqkwg_workspace_size";
  return guarded(fn, [&]() -> hl_status_t {
    HL_TRY(check_not_null(fn, "bytes", bytes));
    hl_gdn_bwd_dqkwg_args_t a;
    HL_TRY(read_descriptor(fn, "args", args, &a, kEarlierSizes));
    HL_TRY(check_shape(fn, a));
    *bytes = workspace_bytes(a);
    return HL_STATUS_SUCCESS;
  });
}

HL_API hl_status_t hl_gdn_bwd_dqkwg(const hl_gdn_bwd_dqkwg_args_t *args, hl_stream_t stream) {
  static const char *fn = "hl_gdn_bwd_dqkwg";
  return guarded(fn, [&]() -> hl_status_t {
    hl_gdn_bwd_dqkwg_args_t a;
    HL_TRY(read_descriptor(fn, "args", args, &a, kEarlierSizes));
    HL_TRY(check_shape(fn, a));
    if (!a.cu_seqlens) a.num_chunks = chunks_in(a.T);
    if (a.scale == 0.0f) a.scale = float(1.0 / std::sqrt(double(a.K)));  // fla's default
    if (a.B == 0 || a.T == 0) return HL_STATUS_SUCCESS;
    std::vector<int64_t> cu;
    HL_TRY(check_memory(fn, a, stream, &cu));
#if HL_HAVE_CUDA
    if (a.backend == HL_BACKEND_CUDA) return cuda_dqkwg(a, cu, a.B * a.num_chunks, stream);
#endif
    return cpu_dqkwg(a, cu);
  });
}

}  // extern "C"
