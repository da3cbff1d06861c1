// rmsnorm_fwd / rmsnorm_bwd entry points: validate everything, then hand over to a backend.
#include <cmath>

#include "common.h"
#include "kernels/rmsnorm/launch.h"
#include "rmsnorm.h"

namespace hl::rmsnorm {
namespace {

// In-place pairs (headloss.h). Every kernel (CPU; CUDA's register, cluster, row-by-row and tiled
// ones) reads an element of these inputs in the thread that stores the output's element at the
// same place, before that store, and nothing reads it after.
constexpr std::initializer_list<InPlace> kFwdInPlace = {{"y", "x"}, {"residual_out", "residual"}};
constexpr std::initializer_list<InPlace> kBwdInPlace = {{"dx", "dy"}, {"dx", "dresidual_out"}};

// The backward's tiles of 32 columns (and its dw sum's) in one grid dimension on CUDA.
constexpr int64_t kMaxCudaBwdCols = int64_t(1) << 35;

// The fields both directions share, before anything else: sizes, strides and enumerations as
// integers, then the options.
template <class Args>
hl_status_t check_common(const char *fn, const Args &a, std::initializer_list<Extent> strides,
                         std::initializer_list<EnumField> dtypes) {
  HL_TRY(check_extents(fn, {{"rows", a.rows}, {"cols", a.cols}}));
  HL_TRY(check_extents(fn, strides));
  HL_TRY(check_enums(fn, {enum_field("backend", a.backend), enum_field("cast", a.cast),
                          enum_field("x_dtype", a.x_dtype), enum_field("weight_dtype", a.weight_dtype)}));
  HL_TRY(check_enums(fn, dtypes));
  HL_TRY(check_backend(fn, a.backend));
  if (!std::isfinite(a.offset)) return fail(HL_STATUS_INVALID_VALUE, "%s: offset is not finite", fn);
  HL_TRY(check_float_dtype(fn, "x_dtype", a.x_dtype));
  // Without a weight the offset is ignored (y = s * rstd), as in HF's and Liger's norms.
  if (a.weight) return check_float_dtype(fn, "weight_dtype", a.weight_dtype);
  return HL_STATUS_SUCCESS;
}

hl_status_t check_fwd_fields(const char *fn, const hl_rmsnorm_fwd_args_t &a) {
  HL_TRY(check_common(fn, a, {{"x_stride", a.x_stride}, {"residual_stride", a.residual_stride},
                              {"residual_out_stride", a.residual_out_stride}, {"y_stride", a.y_stride}},
                      {enum_field("y_dtype", a.y_dtype)}));
  return check_float_dtype(fn, "y_dtype", a.y_dtype);
}

hl_status_t check_bwd_fields(const char *fn, const hl_rmsnorm_bwd_args_t &a) {
  HL_TRY(check_common(fn, a, {{"x_stride", a.x_stride}, {"dy_stride", a.dy_stride},
                              {"dresidual_out_stride", a.dresidual_out_stride}, {"dx_stride", a.dx_stride},
                              {"dresidual_stride", a.dresidual_stride}},
                      {enum_field("dy_dtype", a.dy_dtype), enum_field("dw_dtype", a.dw_dtype)}));
  HL_TRY(check_float_dtype(fn, "dy_dtype", a.dy_dtype));
  if (a.backend == HL_BACKEND_CUDA && a.cols > kMaxCudaBwdCols)
    return fail(HL_STATUS_NOT_SUPPORTED, "%s: cols is %lld; the CUDA backend takes cols <= 2^35", fn,
                (long long)a.cols);
  return HL_STATUS_SUCCESS;
}

hl_status_t validate_fwd(const char *fn, hl_rmsnorm_fwd_args_t &a) {
  HL_TRY(check_fwd_fields(fn, a));
  if (!(a.eps >= 0.0f) || !std::isfinite(a.eps))
    return fail(HL_STATUS_INVALID_VALUE, "%s: eps is %g; must be finite and >= 0", fn,
                double(a.eps));
  if (a.residual_out && !a.residual)
    return fail(HL_STATUS_INVALID_VALUE, "%s: residual_out is set but residual is NULL", fn);
  if (a.rows == 0 || a.cols == 0) return HL_STATUS_SUCCESS;
  HL_TRY(check_not_null(fn, "x", a.x));
  HL_TRY(check_not_null(fn, "y", a.y));
  if (a.residual) HL_TRY(check_not_null(fn, "residual_out (required with residual)", a.residual_out));
  const int64_t N = a.rows, C = a.cols;
  Buffer bufs[6];
  HL_TRY(matrix(fn, {"x", a.x, N, C, a.x_stride, a.x_dtype, false, "x_stride"}, &a.x_stride, &bufs[0]));
  HL_TRY(matrix(fn, {"residual", a.residual, N, C, a.residual_stride, a.x_dtype, false, "residual_stride"},
                &a.residual_stride, &bufs[1]));
  HL_TRY(matrix(fn, {"residual_out", a.residual_out, N, C, a.residual_out_stride, a.x_dtype, true,
                     "residual_out_stride"}, &a.residual_out_stride, &bufs[2]));
  HL_TRY(matrix(fn, {"y", a.y, N, C, a.y_stride, a.y_dtype, true, "y_stride"}, &a.y_stride, &bufs[3]));
  bufs[4] = {"weight", a.weight, 1, C, C, a.weight_dtype, false};
  bufs[5] = {"rstd", a.rstd, N, 1, 1, HL_DTYPE_F32, true};
  HL_TRY(check_buffers(fn, a.backend, bufs, 6));
  return check_aliasing(fn, bufs, 6, kFwdInPlace);
}

// The backward's workspace: what the backend needs (0 on the CPU).
size_t bwd_workspace(const hl_rmsnorm_bwd_args_t &a) {
#if HL_HAVE_CUDA
  if (a.backend == HL_BACKEND_CUDA && a.cols) return cuda_bwd_workspace_bytes(a);
#endif
  (void)a;
  return 0;
}

hl_status_t validate_bwd(const char *fn, hl_rmsnorm_bwd_args_t &a) {
  HL_TRY(check_bwd_fields(fn, a));
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
  const int64_t N = a.rows, C = a.cols;
  const Buffer dw{"dw", a.dw, 1, C, C, a.dw_dtype, true};
  // No rows: dw is still the (zero) sum over rows, so it is checked and written.
  if (N == 0) return check_buffers(fn, a.backend, &dw, 1);
  HL_TRY(check_not_null(fn, "x", a.x));
  HL_TRY(check_not_null(fn, "dy", a.dy));
  HL_TRY(check_not_null(fn, "dx", a.dx));
  Buffer bufs[9];
  HL_TRY(matrix(fn, {"x", a.x, N, C, a.x_stride, a.x_dtype, false, "x_stride"}, &a.x_stride, &bufs[0]));
  HL_TRY(matrix(fn, {"dy", a.dy, N, C, a.dy_stride, a.dy_dtype, false, "dy_stride"}, &a.dy_stride, &bufs[1]));
  HL_TRY(matrix(fn, {"dresidual_out", a.dresidual_out, N, C, a.dresidual_out_stride, a.x_dtype, false,
                     "dresidual_out_stride"}, &a.dresidual_out_stride, &bufs[2]));
  HL_TRY(matrix(fn, {"dx", a.dx, N, C, a.dx_stride, a.x_dtype, true, "dx_stride"}, &a.dx_stride, &bufs[3]));
  HL_TRY(matrix(fn, {"dresidual", a.dresidual, N, C, a.dresidual_stride, a.x_dtype, true, "dresidual_stride"},
                &a.dresidual_stride, &bufs[4]));
  bufs[5] = {"rstd", a.rstd, N, 1, 1, HL_DTYPE_F32, false};
  bufs[6] = {"weight", a.weight, 1, C, C, a.weight_dtype, false};
  bufs[7] = dw;
  HL_TRY(check_buffers(fn, a.backend, bufs, 8));
  const size_t need = bwd_workspace(a);
  HL_TRY(check_workspace(fn, a.backend, a.workspace, a.workspace_bytes, need, 16, &bufs[8]));
  return check_aliasing(fn, bufs, 9, kBwdInPlace);
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
    HL_TRY(read_descriptor(fn, "args", args, &a));
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
    HL_TRY(read_descriptor(fn, "args", args, &a));
    HL_TRY(check_bwd_fields(fn, a));
    *bytes = bwd_workspace(a);
    return HL_STATUS_SUCCESS;
  });
}

HL_API hl_status_t hl_rmsnorm_bwd(const hl_rmsnorm_bwd_args_t *args, hl_stream_t stream) {
  static const char *fn = "hl_rmsnorm_bwd";
  return guarded(fn, [&]() -> hl_status_t {
    hl_rmsnorm_bwd_args_t a;
    HL_TRY(read_descriptor(fn, "args", args, &a));
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
