// RMSNorm forward: the entry point. The kernels are in fwd.cuh, compiled per x dtype in
// fwd_<dtype>.cu.
#include "rmsnorm/fwd.cuh"

// The entry point src/rmsnorm/api.cpp calls.
namespace hl::rmsnorm {
using namespace dev;

hl_status_t cuda_fwd(const hl_rmsnorm_fwd_args_t &a, hl_stream_t stream) {
  const FwdParams p{a.rows, a.cols, a.x, a.x_stride, a.residual, a.residual_stride,
                    a.residual_out, a.residual_out_stride, a.weight, a.weight_dtype, a.offset,
                    a.y, a.y_stride, a.rstd, a.eps, 1.0f / float(a.cols),
                    a.cast != HL_RMSNORM_CAST_GEMMA, a.cast == HL_RMSNORM_CAST_NONE, false, 0};
  hl_status_t st = HL_STATUS_INTERNAL_ERROR;
  dispatch_float(a.x_dtype, [&](auto tx) { st = fwd_x<typename decltype(tx)::type>(p, a.y_dtype, stream); });
  return st == HL_STATUS_INTERNAL_ERROR ? fail(st, "no kernel for this case") : st;
}

}  // namespace hl::rmsnorm
