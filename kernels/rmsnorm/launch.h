// RMSNorm's CUDA backend as src/ sees it: the only header of kernels/rmsnorm/ that src/ includes
// (CMake gives the host library this file alone). Plain C++ on the validated arguments (every
// stride resolved, no zeros): no CUDA type crosses here. Defined in fwd.cu and bwd.cu.
#pragma once

#include <cstddef>

#include "headloss.h"

namespace hl::rmsnorm {

hl_status_t cuda_fwd(const hl_rmsnorm_fwd_args_t &a, hl_stream_t stream);
size_t cuda_bwd_workspace_bytes(const hl_rmsnorm_bwd_args_t &a);
hl_status_t cuda_bwd(const hl_rmsnorm_bwd_args_t &a, hl_stream_t stream);

}  // namespace hl::rmsnorm
