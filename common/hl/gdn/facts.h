// What both gdn_bwd_dqkwg backends build on: the chunk length, the largest head dimension, and what
// each gate mode means.
#pragma once

#include <cstdint>

#include "headloss.h"

namespace hl::gdn {

constexpr int64_t kChunk = 64;  // BT, the chunk length
constexpr int64_t kMaxDim = 256;  // largest K and V

inline bool has_dg(hl_gdn_gate_t g) { return g == HL_GDN_GATE_LOG || g == HL_GDN_GATE_LOG2; }
inline bool is_log2(hl_gdn_gate_t g) {
  return g == HL_GDN_GATE_LOG2 || g == HL_GDN_GATE_CONST_DECAY_LOG2;
}

}  // namespace hl::gdn
