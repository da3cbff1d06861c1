// rmsnorm_fwd / rmsnorm_bwd entry points: validate everything, then hand over to a backend.
#include <cmath>

#include "../common.h"
#include "rmsnorm.h"

namespace hl::rmsnorm {
namespace {

hl_status_t check_common(const char *fn, hl_backend_t backend, int64_t rows, int64_t cols,
                         hl_rmsnorm_cast_t cast, float offset, hl_dtype_t x_dtype,
                         const void *weight, hl_dtype_t weight_dtype) {
  HL_TRY(check_backend(fn, backend));
  HL_TRY(check_positive(fn, "rows", rows));
  HL_TRY(check_positive(fn, "cols", cols));
  if (cast != HL_RMSNORM_CAST_LLAMA && cast != HL_RMSNORM_CAST_GEMMA && cast != HL_RMSNORM_CAST_NONE)
    return fail(HL_STATUS_INVALID_VALUE,
                "%s: cast is %d; use HL_RMSNORM_CAST_LLAMA, _GEMMA or _NONE", fn, int(cast));
  if (!std::isfinite(offset)) return fail(HL_STATUS_INVALID_VALUE, "%s: offset is not finite", fn);
  HL_TRY(check_float_dtype(fn, "x_dtype", x_dtype));
  // Without a weight the offset is ignored (y = s * rstd), as in HF's and Liger's norms.
  if (weight) return check_float_dtype(fn, "weight_dtype", weight_dtype);
  return HL_STATUS_SUCCESS;
}

// Pointer checks for one optional matrix argument; resolves its stride.
hl_status_t check_matrix(const char *fn, hl_backend_t backend, const char *name, const void *p,
                         hl_dtype_t dt, int64_t cols, int64_t *stride) {
  if (!p) return HL_STATUS_SUCCESS;
  HL_TRY(resolve_stride(fn, name, *stride, cols, stride));
  return check_pointer(fn, backend, name, p, dt);
}

hl_status_t validate_fwd(const char *fn, hl_rmsnorm_fwd_args_t &a) {
  HL_TRY(check_common(fn, a.backend, a.rows, a.cols, a.cast, a.offset, a.x_dtype, a.weight,
                      a.weight_dtype));
  HL_TRY(check_float_dtype(fn, "y_dtype", a.y_dtype));
  if (!(a.eps >= 0.0f) || !std::isfinite(a.eps))
    return fail(HL_STATUS_INVALID_VALUE, "%s: eps is %g; must be finite and >= 0", fn,
                double(a.eps));
  if (a.residual_out && !a.residual)
    return fail(HL_STATUS_INVALID_VALUE, "%s: residual_out is set but residual is NULL", fn);
  if (a.rows == 0 || a.cols == 0) return HL_STATUS_SUCCESS;
  HL_TRY(check_not_null(fn, "x", a.x));
  HL_TRY(check_not_null(fn, "y", a.y));
  if (a.residual) HL_TRY(check_not_null(fn, "residual_out (required with residual)", a.residual_out));
  HL_TRY(check_matrix(fn, a.backend, "x", a.x, a.x_dtype, a.cols, &a.x_stride));
  HL_TRY(check_matrix(fn, a.backend, "residual", a.residual, a.x_dtype, a.cols, &a.residual_stride));
  HL_TRY(check_matrix(fn, a.backend, "residual_out", a.residual_out, a.x_dtype, a.cols,
                      &a.residual_out_stride));
  HL_TRY(check_matrix(fn, a.backend, "y", a.y, a.y_dtype, a.cols, &a.y_stride));
  HL_TRY(check_pointer(fn, a.backend, "weight", a.weight, a.weight_dtype));
  HL_TRY(check_pointer(fn, a.backend, "rstd", a.rstd, HL_DTYPE_F32));
  const Buffer bufs[] = {
      {"x", a.x, a.rows, a.cols, a.x_stride, a.x_dtype, false},
      {"residual", a.residual, a.rows, a.cols, a.residual_stride, a.x_dtype, false},
      {"weight", a.weight, 1, a.cols, a.cols, a.weight_dtype, false},
      {"residual_out", a.residual_out, a.rows, a.cols, a.residual_out_stride, a.x_dtype, true},
      {"y", a.y, a.rows, a.cols, a.y_stride, a.y_dtype, true},
      {"rstd", a.rstd, a.rows, 1, 1, HL_DTYPE_F32, true},
  };
  return check_aliasing(fn, bufs, int(sizeof bufs / sizeof bufs[0]));
}

hl_status_t validate_bwd(const char *fn, hl_rmsnorm_bwd_args_t &a) {
  HL_TRY(check_common(fn, a.backend, a.rows, a.cols, a.cast, a.offset, a.x_dtype, a.weight,
                      a.weight_dtype));
  HL_TRY(check_float_dtype(fn, "dy_dtype", a.dy_dtype));
  if (!a.rstd && (!(a.eps >= 0.0f) || !std::isfinite(a.eps)))
    return fail(HL_STATUS_INVALID_VALUE, "%s: rstd is NULL and eps is %g; eps must be finite and >= 0",
                fn, double(a.eps));
  if (a.weight) {
    if (a.dw_dtype != HL_DTYPE_F32 && a.dw_dtype != a.weight_dtype)
      return fail(HL_STATUS_INVALID_VALUE, "%s: dw_dtype is %s; use F32 or weight_dtype (%s)", fn,
                  dtype_name(a.dw_dtype), dtype_name(a.weight_dtype));
    HL_TRY(check_not_null(fn, "dw (required with a weight)", a.dw));
  } else if (a.dw) {
    return fail(HL_STATUS_INVALID_VALUE, "%s: dw is set but there is no weight", fn);
  }
  if (a.cols == 0) return HL_STATUS_SUCCESS;
  // No rows: dw is still the (zero) sum over rows, so it is checked and written.
  if (a.rows == 0) return check_pointer(fn, a.backend, "dw", a.dw, a.dw_dtype);
  HL_TRY(check_not_null(fn, "x", a.x));
  HL_TRY(check_not_null(fn, "dy", a.dy));
  HL_TRY(check_not_null(fn, "dx", a.dx));
  HL_TRY(check_matrix(fn, a.backend, "x", a.x, a.x_dtype, a.cols, &a.x_stride));
  HL_TRY(check_matrix(fn, a.backend, "dy", a.dy, a.dy_dtype, a.cols, &a.dy_stride));
  HL_TRY(check_matrix(fn, a.backend, "dresidual_out", a.dresidual_out, a.x_dtype, a.cols,
                      &a.dresidual_out_stride));
  HL_TRY(check_matrix(fn, a.backend, "dx", a.dx, a.x_dtype, a.cols, &a.dx_stride));
  HL_TRY(check_matrix(fn, a.backend, "dresidual", a.dresidual, a.x_dtype, a.cols,
                      &a.dresidual_stride));
  HL_TRY(check_pointer(fn, a.backend, "rstd", a.rstd, HL_DTYPE_F32));
  HL_TRY(check_pointer(fn, a.backend, "weight", a.weight, a.weight_dtype));
  HL_TRY(check_pointer(fn, a.backend, "dw", a.dw, a.dw_dtype));
  size_t need = 0;
#if HL_HAVE_CUDA
  if (a.backend == HL_BACKEND_CUDA) need = cuda_bwd_workspace_bytes(a);
#endif
  if (a.workspace_bytes < need)
    return fail(HL_STATUS_INSUFFICIENT_WORKSPACE, "%s: workspace_bytes is %zu; this call needs %zu",
                fn, a.workspace_bytes, need);
  if (need) {
    HL_TRY(check_not_null(fn, "workspace", a.workspace));
    HL_TRY(check_pointer(fn, a.backend, "workspace", a.workspace, HL_DTYPE_F32));
    if (reinterpret_cast<uintptr_t>(a.workspace) % 16)
      return fail(HL_STATUS_MISALIGNED, "%s: workspace (%p) must be 16-byte aligned", fn, a.workspace);
  }
  const int64_t ws_floats = int64_t(need / 4);
  const Buffer bufs[] = {
      {"x", a.x, a.rows, a.cols, a.x_stride, a.x_dtype, false},
      {"dy", a.dy, a.rows, a.cols, a.dy_stride, a.dy_dtype, false},
      {"dresidual_out", a.dresidual_out, a.rows, a.cols, a.dresidual_out_stride, a.x_dtype, false},
      {"rstd", a.rstd, a.rows, 1, 1, HL_DTYPE_F32, false},
      {"weight", a.weight, 1, a.cols, a.cols, a.weight_dtype, false},
      {"dx", a.dx, a.rows, a.cols, a.dx_stride, a.x_dtype, true},
      {"dresidual", a.dresidual, a.rows, a.cols, a.dresidual_stride, a.x_dtype, true},
      {"dw", a.dw, 1, a.cols, a.cols, a.dw_dtype, true},
      {"workspace", need ? a.workspace : nullptr, 1, ws_floats, ws_floats, HL_DTYPE_F32, true},
  };
  return check_aliasing(fn, bufs, int(sizeof bufs / sizeof bufs[0]));
}

}  // namespace
}  // namespace hl::rmsnorm

using namespace hl;
using namespace hl::rmsnorm;

extern "C" {

HL_API hl_status_t hl_rmsnorm_fwd(const hl_rmsnorm_fwd_args_t *args, hl_stream_t stream) {
  static const char *fn = "hl_rmsnorm_fwd";
  return guarded(fn, [&]() -> hl_status_t {
    hl_rmsnorm_fwd_args_t a;
    HL_TRY(read_descriptor(fn, args, &a));
    HL_TRY(validate_fwd(fn, a));
    if (a.rows == 0 || a.cols == 0) return HL_STATUS_SUCCESS;
#if HL_HAVE_CUDA
    if (a.backend == HL_BACKEND_CUDA) return cuda_fwd(a, stream);
#endif
    (void)stream;
    return cpu_fwd(a);
  });
}

HL_API hl_status_t hl_rmsnorm_bwd_workspace_size(const hl_rmsnorm_bwd_args_t *args, size_t *bytes) {
  static const char *fn = "hl_rmsnorm_bwd_workspace_size";
  return guarded(fn, [&]() -> hl_status_t {
    HL_TRY(check_not_null(fn, "bytes", bytes));
    hl_rmsnorm_bwd_args_t a;
    HL_TRY(read_descriptor(fn, args, &a));
    HL_TRY(check_backend(fn, a.backend));
    HL_TRY(check_positive(fn, "rows", a.rows));
    HL_TRY(check_positive(fn, "cols", a.cols));
    *bytes = 0;
#if HL_HAVE_CUDA
    if (a.backend == HL_BACKEND_CUDA && a.cols) *bytes = cuda_bwd_workspace_bytes(a);
#endif
    return HL_STATUS_SUCCESS;
  });
}

HL_API hl_status_t hl_rmsnorm_bwd(const hl_rmsnorm_bwd_args_t *args, hl_stream_t stream) {
  static const char *fn = "hl_rmsnorm_bwd";
  return guarded(fn, [&]() -> hl_status_t {
    hl_rmsnorm_bwd_args_t a;
    HL_TRY(read_descriptor(fn, args, &a));
    HL_TRY(validate_bwd(fn, a));
    if (a.cols == 0 || (a.rows == 0 && !a.dw)) return HL_STATUS_SUCCESS;
#if HL_HAVE_CUDA
    if (a.backend == HL_BACKEND_CUDA) return cuda_bwd(a, stream);
#endif
    (void)stream;
    return cpu_bwd(a);
  });
}

}  // extern "C"
