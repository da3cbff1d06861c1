// The RMSNorm backends. Arguments reach them validated, with every stride resolved (no zeros).
#pragma once

#include "headloss.h"

namespace hl::rmsnorm {

hl_status_t cpu_fwd(const hl_rmsnorm_fwd_args_t &a);
hl_status_t cpu_bwd(const hl_rmsnorm_bwd_args_t &a);

#if HL_HAVE_CUDA
hl_status_t cuda_fwd(const hl_rmsnorm_fwd_args_t &a, hl_stream_t stream);
size_t cuda_bwd_workspace_bytes(const hl_rmsnorm_bwd_args_t &a);
hl_status_t cuda_bwd(const hl_rmsnorm_bwd_args_t &a, hl_stream_t stream);
#endif

}  // namespace hl::rmsnorm
