// RMSNorm backward kernels for float x (one file per x dtype so that they compile in parallel).
#include "rmsnorm/bwd.cuh"

namespace hl::rmsnorm::dev {
template size_t bwd_workspace_x<float>(const hl_rmsnorm_bwd_args_t &a);
template hl_status_t bwd_x<float>(const hl_rmsnorm_bwd_args_t &a, hl_stream_t stream);
}  // namespace hl::rmsnorm::dev
