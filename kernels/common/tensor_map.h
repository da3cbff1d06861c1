// Hopper tensor maps (TMA descriptors) for the sm_90a kernels, made on the host.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "headloss.h"

namespace hl::dev {

// Compute capability 9.0, the only one sm_90a code runs on (cached per device).
bool device_is_sm90();
// Whether the driver offers cuTensorMapEncodeTiled.
bool tensor_maps_available();
// A 3-D tensor of 16-bit elements (dt: BF16 or F16; d0 contiguous; s1, s2 strides in bytes, multiples of
// 16) read or written in b0 x b1 x b2 boxes with the 128-byte swizzle. HL_STATUS_CUDA_ERROR, with fn
// (the entry point's name) in the message, where the driver refuses it.
hl_status_t encode_map(const char *fn, CUtensorMap *m, hl_dtype_t dt, const void *base, uint64_t d0, uint64_t d1,
                       uint64_t d2, uint64_t s1, uint64_t s2, uint32_t b0, uint32_t b1, uint32_t b2);

}  // namespace hl::dev
