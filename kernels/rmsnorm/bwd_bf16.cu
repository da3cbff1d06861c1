// RMSNorm backward kernels for __nv_bfloat16 x (one file per x dtype so that they compile in parallel).
#include "rmsnorm/bwd.cuh"

namespace hl::rmsnorm::dev {
template size_t bwd_workspace_x<__nv_bfloat16>(const hl_rmsnorm_bwd_args_t &a);
template hl_status_t bwd_x<__nv_bfloat16>(const hl_rmsnorm_bwd_args_t &a, hl_stream_t stream);
}  // namespace hl::rmsnorm::dev
