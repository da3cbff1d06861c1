// What the two sides of the library share for reporting: the error record and the small facts its
// messages and size computations need. src/ and kernels/ both include it (this root, common/, is the
// one both include by design); nothing here needs CUDA.
//
// The error contract: a failure anywhere (validation, a CUDA call, cuBLASLt, NCCL) records its message
// with fail() and returns the status; the entry point (src/) prefixes its name and hands the status
// to the caller. fail() and the dtype facts are defined in the host library (src/errors.cpp,
// src/validate.cpp), which owns the thread's last error; the CUDA side calls them through these
// declarations and includes nothing from src/.
#pragma once

#include <cstddef>
#include <cstdint>

#include "headloss.h"

namespace hl {

// Records a formatted message as this thread's last error and returns `status`.
hl_status_t fail(hl_status_t status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

// dtype facts, on the integer (callers pass a field already checked by check_enums).
const char *dtype_name(int dt);
size_t dtype_size(int dt);  // 0 for NONE or an unknown value

// Byte counts that saturate at UINT64_MAX (above every limit they are compared with) instead of
// wrapping.
inline uint64_t sat_add(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_add_overflow(a, b, &r) ? UINT64_MAX : r;
}
inline uint64_t sat_mul(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}
// x rounded up to a multiple of m; past the largest one, that (saturated, as sat_add).
inline size_t round_up(size_t x, size_t m) { return sat_add(x, m - 1) / m * m; }

}  // namespace hl

#define HL_TRY(expr)                                 \
  do {                                               \
    hl_status_t hl_try_status_ = (expr);             \
    if (hl_try_status_ != HL_STATUS_SUCCESS) return hl_try_status_; \
  } while (0)
