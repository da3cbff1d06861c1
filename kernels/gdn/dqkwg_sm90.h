// The Hopper (sm_90a) gdn_bwd_dqkwg kernel: TMA and warpgroup MMAs. It takes every shape (any GVA, K
// and V up to 256, 16-bit or fp32 states, either state layout) of 16-byte aligned tensors on a compute
// capability 9.0 device when the library holds sm_90a code. K or V not a multiple of 8 runs its ODD
// variants: q, k (do, v, dv) through folded maps where H K (HV V) is a multiple of 8, else copied by
// its producer warps (as are states whose rows TMA cannot map, and fp32 states always).
// Everything else (unaligned tensors, other devices) runs the portable kernel (dqkwg.cu).
// HEADLOSS_GDN_KERNEL (config.h's forced_kernel()) forces either.
#pragma once

#include <cstdint>

#include "gdn/config.h"
#include "headloss.h"
#include "hl/gdn/chunks.h"

namespace hl::gdn::dev {

bool sm90_takes(const hl_gdn_bwd_dqkwg_args_t &a, int64_t chunks);
hl_status_t cuda_dqkwg_sm90(const hl_gdn_bwd_dqkwg_args_t &a, const ChunkTable &table,
                            int64_t chunks, hl_stream_t stream);

}  // namespace hl::gdn::dev
