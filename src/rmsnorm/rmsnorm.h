// The RMSNorm CPU backend (the CUDA one is reached through kernels/rmsnorm/launch.h). Arguments
// reach it validated, with every stride resolved (no zeros).
#pragma once

#include "headloss.h"

namespace hl::rmsnorm {

hl_status_t cpu_fwd(const hl_rmsnorm_fwd_args_t &a);
hl_status_t cpu_bwd(const hl_rmsnorm_bwd_args_t &a);

}  // namespace hl::rmsnorm
