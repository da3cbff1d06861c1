// The CUDA backend's own questions, as src/ asks them: whether a device is there and where a pointer
// lives. The only header of kernels/common/ that src/ includes (CMake gives the host library this
// file alone); plain C++, no CUDA type crosses here. Defined in device.cpp.
#pragma once

#include "headloss.h"

namespace hl {

// hl_backend_is_available(HL_BACKEND_CUDA): 1 where the runtime sees a device (asked once), else 0.
int cuda_backend_available();
// check_location (src/common.h) in a build with CUDA: the pointer's memory kind, asked of the
// runtime, against the backend.
hl_status_t cuda_check_location(const char *fn, const char *arg, const void *p, hl_backend_t backend);

}  // namespace hl
