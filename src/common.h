// Internal helpers shared by the host code of every op: error reporting, descriptor versioning,
// dtype facts and argument validation. Nothing here is exported.
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>

#include "headloss.h"

namespace hl {

// Records a formatted message as this thread's last error and returns `status`.
hl_status_t fail(hl_status_t status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
hl_status_t succeed();  // clears the last error, returns HL_STATUS_SUCCESS

// Runs an entry point's body, turning a C++ exception into a status: none may cross the C ABI.
template <class F>
hl_status_t guarded(const char *fn, F &&body) {
  try {
    hl_status_t s = body();
    return s == HL_STATUS_SUCCESS ? succeed() : s;
  } catch (const std::bad_alloc &) {
    return fail(HL_STATUS_ALLOC_FAILED, "%s: out of host memory", fn);
  } catch (...) {
    return fail(HL_STATUS_INTERNAL_ERROR, "%s: unexpected C++ exception", fn);
  }
}

// Copies a caller's descriptor into a zeroed one of this library's size. An older, smaller
// descriptor leaves the newer fields zero (their defaults); a newer, larger one is accepted only
// when the fields this library does not know are zero (the caller uses no feature it lacks).
template <class T>
hl_status_t read_descriptor(const char *fn, const T *in, T *out) {
  if (!in) return fail(HL_STATUS_INVALID_VALUE, "%s: the descriptor pointer is NULL", fn);
  const size_t n = in->struct_size;
  if (n < offsetof(T, struct_size) + sizeof(size_t) + sizeof(int))
    return fail(HL_STATUS_INVALID_VALUE,
                "%s: struct_size is %zu; set it to sizeof the descriptor (%zu)", fn, n, sizeof(T));
  const unsigned char *bytes = reinterpret_cast<const unsigned char *>(in);
  for (size_t i = sizeof(T); i < n; ++i)
    if (bytes[i] != 0)
      return fail(HL_STATUS_NOT_SUPPORTED,
                  "%s: the descriptor (struct_size %zu) sets fields this library (version %d, "
                  "struct_size %zu) does not know",
                  fn, n, HL_VERSION, sizeof(T));
  std::memset(static_cast<void *>(out), 0, sizeof(T));
  std::memcpy(static_cast<void *>(out), in, n < sizeof(T) ? n : sizeof(T));
  return HL_STATUS_SUCCESS;
}

const char *dtype_name(hl_dtype_t dt);
size_t dtype_size(hl_dtype_t dt);  // 0 for NONE or an unknown value
inline bool is_float_dtype(hl_dtype_t dt) {
  return dt == HL_DTYPE_F32 || dt == HL_DTYPE_F16 || dt == HL_DTYPE_BF16;
}

// --- validation; each returns SUCCESS or records a message naming fn and the argument ---
hl_status_t check_backend(const char *fn, hl_backend_t backend);
hl_status_t check_float_dtype(const char *fn, const char *arg, hl_dtype_t dt);
hl_status_t check_not_null(const char *fn, const char *arg, const void *p);
hl_status_t check_positive(const char *fn, const char *arg, int64_t v);  // v >= 0
// Resolves the row stride of matrix `arg` (0 = packed) and checks it covers a row:
// *out = stride ? stride : cols. Messages name it "<arg>_stride".
hl_status_t resolve_stride(const char *fn, const char *arg, int64_t stride, int64_t cols,
                           int64_t *out);
// Checks that p is aligned to its element size.
hl_status_t check_element_aligned(const char *fn, const char *arg, const void *p, hl_dtype_t dt);
// Checks that a pointer is usable by the backend: host memory for CPU, device (or managed)
// memory for CUDA. Without CUDA in the build every pointer is taken as host memory.
hl_status_t check_location(const char *fn, const char *arg, const void *p, hl_backend_t backend);

// One matrix argument, for the aliasing check.
struct Buffer {
  const char *name;
  const void *ptr;
  int64_t rows, cols, stride;  // stride already resolved
  hl_dtype_t dtype;
  bool output;
};
// Outputs must not overlap one another; an output may share memory with an input only when the
// two are the same matrix (same pointer, stride and element size): that is in-place work.
hl_status_t check_aliasing(const char *fn, const Buffer *bufs, int n);

// An optional pointer argument: NULL passes; otherwise element alignment and memory kind.
hl_status_t check_pointer(const char *fn, hl_backend_t backend, const char *arg, const void *p,
                          hl_dtype_t dt);

// Bytes spanned by a [rows, cols] matrix with the given row stride (elements).
inline uint64_t span_bytes(int64_t rows, int64_t cols, int64_t stride, hl_dtype_t dt) {
  if (rows == 0 || cols == 0) return 0;
  return (uint64_t(rows - 1) * uint64_t(stride) + uint64_t(cols)) * dtype_size(dt);
}
// x rounded up to a multiple of m.
inline size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }
// True when the byte ranges [a, a + na) and [b, b + nb) intersect.
inline bool overlaps(const void *a, uint64_t na, const void *b, uint64_t nb) {
  if (!a || !b || na == 0 || nb == 0) return false;
  const uintptr_t pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + nb && pb < pa + na;
}

}  // namespace hl

#define HL_TRY(expr)                                 \
  do {                                               \
    hl_status_t hl_try_status_ = (expr);             \
    if (hl_try_status_ != HL_STATUS_SUCCESS) return hl_try_status_; \
  } while (0)
