// RMSNorm backward kernels for __half x (one file per x dtype so that they compile in parallel).
#include "rmsnorm/bwd.cuh"

namespace hl::rmsnorm::dev {
template size_t bwd_workspace_x<__half>(const hl_rmsnorm_bwd_args_t &a);
template hl_status_t bwd_x<__half>(const hl_rmsnorm_bwd_args_t &a, hl_stream_t stream);
}  // namespace hl::rmsnorm::dev
