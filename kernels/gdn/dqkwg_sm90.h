// The Hopper (sm_90a) gdn_bwd_dqkwg kernel: TMA and warpgroup MMAs. It takes 16-byte aligned tensors
// (any GVA, 16-bit or fp32 states, either state layout) on a compute capability 9.0 device when the
// library holds sm_90a code, with K and V multiples of 8, or else H K (for K) and HV V (for V)
// multiples of 8 (folded maps; K + 8 - gcd(K, 8) <= 256: folded boxes start up to 8 - gcd(K, 8)
// columns early), or else K (V) even (q, k or do, v, dv copied by hand), and fp32 states in rows (of
// V; K with state_v_first) of a multiple of 4 elements;
// everything else runs the portable kernel (dqkwg.cu). HEADLOSS_GDN_KERNEL=portable forces the
// portable kernel (tests, A/B); HEADLOSS_GDN_KERNEL=sm90 makes a call that the Hopper kernel does not
// take fail instead (tests: which kernel ran).
#pragma once

#include <cstdint>

#include "gdn/chunk.cuh"
#include "headloss.h"

namespace hl::gdn {

bool kernel_forced(const char *name);  // HEADLOSS_GDN_KERNEL is `name`
bool sm90_takes(const hl_gdn_bwd_dqkwg_args_t &a, int64_t chunks);
hl_status_t cuda_dqkwg_sm90(const hl_gdn_bwd_dqkwg_args_t &a, const hl::cuda::gdn::ChunkTable &table,
                            int64_t chunks, hl_stream_t stream);

}  // namespace hl::gdn
