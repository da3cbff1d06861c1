// The gdn_bwd_dqkwg CPU backend (the CUDA one is reached through kernels/gdn/launch.h; what both
// build on is hl/gdn/facts.h's and hl/gdn/chunks.h's). Arguments reach it validated; `cu` holds the
// host copy of cu_seqlens as int64 (empty without varlen).
#pragma once

#include <cstdint>
#include <vector>

#include "headloss.h"
#include "hl/gdn/facts.h"

namespace hl::gdn {

hl_status_t cpu_dqkwg(const hl_gdn_bwd_dqkwg_args_t &a, const std::vector<int64_t> &cu);

}  // namespace hl::gdn
