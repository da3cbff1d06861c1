// gdn_bwd_dqkwg entry points: validate everything (cu_seqlens contents included), then hand over
// to a backend.
#include <cmath>
#include <vector>

#include "../common.h"
#include "../cpu/scalar.h"
#include "gdn.h"

namespace hl::gdn {
namespace {

// Sizes and options that need no memory access. *varlen is set when cu_seqlens is given.
hl_status_t check_shape(const char *fn, const hl_gdn_bwd_dqkwg_args_t &a) {
  HL_TRY(check_backend(fn, a.backend));
  HL_TRY(check_positive(fn, "B", a.B));
  HL_TRY(check_positive(fn, "T", a.T));
  if (a.H < 1 || a.HV < 1 || a.HV % a.H)
    return fail(HL_STATUS_INVALID_VALUE, "%s: H is %lld and HV is %lld; need H >= 1 and HV a multiple of H",
                fn, (long long)a.H, (long long)a.HV);
  if (a.K < 1 || a.V < 1)
    return fail(HL_STATUS_INVALID_VALUE, "%s: K is %lld and V is %lld; both must be >= 1", fn,
                (long long)a.K, (long long)a.V);
  if (a.K > kMaxDim || a.V > kMaxDim)
    return fail(HL_STATUS_NOT_SUPPORTED, "%s: K is %lld and V is %lld; at most %lld is supported", fn,
                (long long)a.K, (long long)a.V, (long long)kMaxDim);
  // Every tensor's element count must fit comfortably in int64 (B*T*HV*256 and NT*HV*K*V).
  const double tokens = double(a.B) * double(a.T), chunks = double(a.B) * double(a.num_chunks);
  if (tokens * double(a.HV) * kMaxDim > 4e18 || chunks * double(a.HV) * kMaxDim * kMaxDim > 4e18)
    return fail(HL_STATUS_INVALID_VALUE, "%s: B, T, num_chunks and HV are too large", fn);
  if (a.dtype != HL_DTYPE_F16 && a.dtype != HL_DTYPE_BF16)
    return fail(HL_STATUS_INVALID_VALUE, "%s: dtype is %s; expected F16 or BF16", fn, dtype_name(a.dtype));
  if (a.h_dtype != a.dtype && a.h_dtype != HL_DTYPE_F32)
    return fail(HL_STATUS_INVALID_VALUE, "%s: h_dtype is %s; expected dtype (%s) or F32", fn,
                dtype_name(a.h_dtype), dtype_name(a.dtype));
  if (a.gate < HL_GDN_GATE_NONE || a.gate > HL_GDN_GATE_CONST_DECAY_LOG2)
    return fail(HL_STATUS_INVALID_VALUE, "%s: gate is %d; use an hl_gdn_gate_t value", fn, int(a.gate));
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
  if (a.cu_seqlens) {
    if (a.B != 1)
      return fail(HL_STATUS_INVALID_VALUE, "%s: B is %lld with cu_seqlens; varlen needs B = 1", fn, (long long)a.B);
    if (a.cu_seqlens_dtype != HL_DTYPE_I32 && a.cu_seqlens_dtype != HL_DTYPE_I64)
      return fail(HL_STATUS_INVALID_VALUE, "%s: cu_seqlens_dtype is %s; expected I32 or I64", fn,
                  dtype_name(a.cu_seqlens_dtype));
    if (a.num_seqs < 1)
      return fail(HL_STATUS_INVALID_VALUE, "%s: num_seqs is %lld; must be >= 1 with cu_seqlens", fn,
                  (long long)a.num_seqs);
    if (a.num_chunks < 0)
      return fail(HL_STATUS_INVALID_VALUE, "%s: num_chunks is %lld", fn, (long long)a.num_chunks);
  } else {
    const int64_t nt = (a.T + kChunk - 1) / kChunk;
    if (a.num_chunks != 0 && a.num_chunks != nt)
      return fail(HL_STATUS_INVALID_VALUE, "%s: num_chunks is %lld; without cu_seqlens it is ceil(T / 64) = %lld",
                  fn, (long long)a.num_chunks, (long long)nt);
  }
  return HL_STATUS_SUCCESS;
}

// cu_seqlens (host copy) starts at 0, never decreases, ends at T and has num_chunks chunks.
hl_status_t check_cu_seqlens(const char *fn, const hl_gdn_bwd_dqkwg_args_t &a, const std::vector<int64_t> &cu) {
  if (cu[0] != 0)
    return fail(HL_STATUS_INVALID_VALUE, "%s: cu_seqlens[0] is %lld; must be 0", fn, (long long)cu[0]);
  int64_t chunks = 0;
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1])
      return fail(HL_STATUS_INVALID_VALUE, "%s: cu_seqlens decreases at %zu (%lld after %lld)", fn, i,
                  (long long)cu[i], (long long)cu[i - 1]);
    chunks += (cu[i] - cu[i - 1] + kChunk - 1) / kChunk;
  }
  if (cu.back() != a.T)
    return fail(HL_STATUS_INVALID_VALUE, "%s: cu_seqlens ends at %lld; must end at T (%lld)", fn,
                (long long)cu.back(), (long long)a.T);
  if (chunks != a.num_chunks)
    return fail(HL_STATUS_INVALID_VALUE, "%s: num_chunks is %lld; cu_seqlens makes %lld chunks", fn,
                (long long)a.num_chunks, (long long)chunks);
  return HL_STATUS_SUCCESS;
}

hl_status_t check_tensor(const char *fn, hl_backend_t backend, const char *name, const void *p, hl_dtype_t dt) {
  HL_TRY(check_not_null(fn, name, p));
  return check_pointer(fn, backend, name, p, dt);
}

size_t workspace_bytes(const hl_gdn_bwd_dqkwg_args_t &a) {
#if HL_HAVE_CUDA
  if (a.backend == HL_BACKEND_CUDA) return cuda_workspace_bytes(a);
#endif
  return 0;
}

// Pointers, aliasing and workspace; then cu_seqlens, read to the host (*cu) and checked.
hl_status_t check_memory(const char *fn, const hl_gdn_bwd_dqkwg_args_t &a, hl_stream_t stream,
                         std::vector<int64_t> *cu) {
  const hl_backend_t be = a.backend;
  const int64_t tok = a.B * a.T, nt = a.B * a.num_chunks;
  HL_TRY(check_tensor(fn, be, "q", a.q, a.dtype));
  HL_TRY(check_tensor(fn, be, "k", a.k, a.dtype));
  HL_TRY(check_tensor(fn, be, "v", a.v, a.dtype));
  HL_TRY(check_tensor(fn, be, "do_", a.do_, a.dtype));
  HL_TRY(check_tensor(fn, be, "h", a.h, a.h_dtype));
  HL_TRY(check_tensor(fn, be, "dh", a.dh, a.h_dtype));
  HL_TRY(check_tensor(fn, be, "dq", a.dq, a.dtype));
  HL_TRY(check_tensor(fn, be, "dk", a.dk, a.dtype));
  if (a.dw) {
    HL_TRY(check_tensor(fn, be, "dv", a.dv, a.dtype));
    HL_TRY(check_tensor(fn, be, "dw", a.dw, a.dtype));
  }
  if (a.g) HL_TRY(check_tensor(fn, be, "g", a.g, HL_DTYPE_F32));
  if (a.g_gamma) HL_TRY(check_tensor(fn, be, "g_gamma", a.g_gamma, HL_DTYPE_F32));
  if (a.dg) HL_TRY(check_tensor(fn, be, "dg", a.dg, HL_DTYPE_F32));
  if (a.cu_seqlens) HL_TRY(check_tensor(fn, be, "cu_seqlens", a.cu_seqlens, a.cu_seqlens_dtype));
  const size_t need = workspace_bytes(a);
  if (a.workspace_bytes < need)
    return fail(HL_STATUS_INSUFFICIENT_WORKSPACE, "%s: workspace_bytes is %zu; this call needs %zu", fn,
                a.workspace_bytes, need);
  if (need) {
    HL_TRY(check_tensor(fn, be, "workspace", a.workspace, HL_DTYPE_I64));
  }
  const int64_t qk = tok * a.H * a.K, vv = tok * a.HV * a.V, st = nt * a.HV * a.K * a.V;
  const int64_t ws = int64_t(need / 8);
  const Buffer bufs[] = {
      {"q", a.q, 1, qk, qk, a.dtype, false},
      {"k", a.k, 1, qk, qk, a.dtype, false},
      {"v", a.v, 1, vv, vv, a.dtype, false},
      {"do_", a.do_, 1, vv, vv, a.dtype, false},
      {"dv", a.dw ? a.dv : nullptr, 1, vv, vv, a.dtype, false},
      {"h", a.h, 1, st, st, a.h_dtype, false},
      {"dh", a.dh, 1, st, st, a.h_dtype, false},
      {"g", a.g, 1, tok * a.HV, tok * a.HV, HL_DTYPE_F32, false},
      {"g_gamma", a.g_gamma, 1, a.HV, a.HV, HL_DTYPE_F32, false},
      {"cu_seqlens", a.cu_seqlens, 1, a.num_seqs + 1, a.num_seqs + 1, a.cu_seqlens_dtype, false},
      {"dq", a.dq, 1, qk, qk, a.dtype, true},
      {"dk", a.dk, 1, qk, qk, a.dtype, true},
      {"dw", a.dw, 1, tok * a.HV * a.K, tok * a.HV * a.K, a.dtype, true},
      {"dg", a.dg, 1, tok * a.HV, tok * a.HV, HL_DTYPE_F32, true},
      {"workspace", need ? a.workspace : nullptr, 1, ws, ws, HL_DTYPE_I64, true},
  };
  HL_TRY(check_aliasing(fn, bufs, int(sizeof bufs / sizeof bufs[0])));
  // No output may alias an input here, not even exactly: every input is read after outputs start.
  for (int i = 10; i < 15; ++i)
    for (int j = 0; j < 10; ++j)
      if (bufs[i].ptr && bufs[i].ptr == bufs[j].ptr)
        return fail(HL_STATUS_INVALID_VALUE, "%s: %s is %s; in-place is not supported", fn, bufs[i].name,
                    bufs[j].name);
  if (!a.cu_seqlens) return HL_STATUS_SUCCESS;
#if HL_HAVE_CUDA
  if (be == HL_BACKEND_CUDA && (a.flags & HL_GDN_UNCHECKED)) return HL_STATUS_SUCCESS;  // table on the device
  if (be == HL_BACKEND_CUDA) {
    HL_TRY(cuda_read_cu_seqlens(a, stream, cu));
    return check_cu_seqlens(fn, a, *cu);
  }
#endif
  (void)stream;
  cu->resize(size_t(a.num_seqs + 1));
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
    HL_TRY(read_descriptor(fn, args, &a));
    HL_TRY(check_shape(fn, a));
    *bytes = workspace_bytes(a);
    return HL_STATUS_SUCCESS;
  });
}

HL_API hl_status_t hl_gdn_bwd_dqkwg(const hl_gdn_bwd_dqkwg_args_t *args, hl_stream_t stream) {
  static const char *fn = "hl_gdn_bwd_dqkwg";
  return guarded(fn, [&]() -> hl_status_t {
    hl_gdn_bwd_dqkwg_args_t a;
    HL_TRY(read_descriptor(fn, args, &a));
    HL_TRY(check_shape(fn, a));
    if (!a.cu_seqlens) a.num_chunks = (a.T + kChunk - 1) / kChunk;
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
