// The gdn_bwd_dqkwg backends. Arguments reach them validated; `cu` holds the host copy of
// cu_seqlens as int64 (empty without varlen) and `chunks` the total chunk count NT.
#pragma once

#include <cstdint>
#include <vector>

#include "headloss.h"

namespace hl::gdn {

constexpr int64_t kChunk = 64;  // BT, the chunk length
constexpr int64_t kMaxDim = 256;  // largest K and V

inline bool has_dg(hl_gdn_gate_t g) { return g == HL_GDN_GATE_LOG || g == HL_GDN_GATE_LOG2; }
inline bool is_log2(hl_gdn_gate_t g) {
  return g == HL_GDN_GATE_LOG2 || g == HL_GDN_GATE_CONST_DECAY_LOG2;
}

hl_status_t cpu_dqkwg(const hl_gdn_bwd_dqkwg_args_t &a, const std::vector<int64_t> &cu);

#if HL_HAVE_CUDA
size_t cuda_workspace_bytes(const hl_gdn_bwd_dqkwg_args_t &a);
// Copies cu_seqlens (device memory) to the host as int64; synchronises the stream.
hl_status_t cuda_read_cu_seqlens(const hl_gdn_bwd_dqkwg_args_t &a, hl_stream_t stream,
                                 std::vector<int64_t> *cu);
hl_status_t cuda_dqkwg(const hl_gdn_bwd_dqkwg_args_t &a, const std::vector<int64_t> &cu,
                       int64_t chunks, hl_stream_t stream);
#endif

}  // namespace hl::gdn
