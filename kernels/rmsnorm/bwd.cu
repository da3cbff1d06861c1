// RMSNorm backward: the entry points, and the kernel that sums the partial dw rows. The other
// kernels are in bwd.cuh, compiled per x dtype in bwd_<dtype>.cu.
#include "rmsnorm/bwd.cuh"

namespace hl::rmsnorm::dev {

// dw from the partial rows: a block a 32-column tile.
__global__ void __launch_bounds__(kDwReduceBlock) rmsnorm_dw_reduce(const float *partial, int64_t parts, int64_t cols,
                                                          void *dw, hl_dtype_t dt) {
  __shared__ float acc[kDwReduceBlock / 32][33];
  wait_for_previous_grid();
  reduce_dw<kDwReduceBlock>(partial, parts, cols, dw, dt, blockIdx.x, gridDim.x, acc);
}

}  // namespace hl::rmsnorm::dev

// The entry points src/rmsnorm/api.cpp calls.
namespace hl::rmsnorm {
using namespace dev;

size_t cuda_bwd_workspace_bytes(const hl_rmsnorm_bwd_args_t &a) {
  size_t bytes = 0;
  dispatch_float(a.x_dtype, [&](auto tx) { bytes = bwd_workspace_x<typename decltype(tx)::type>(a); });
  return bytes;
}

hl_status_t cuda_bwd(const hl_rmsnorm_bwd_args_t &a, hl_stream_t stream) {
  hl_status_t st = HL_STATUS_INTERNAL_ERROR;
  dispatch_float(a.x_dtype, [&](auto tx) { st = bwd_x<typename decltype(tx)::type>(a, stream); });
  return st;
}

}  // namespace hl::rmsnorm
