// Argument checks shared by every entry point, and dtype facts.
#include "common.h"

namespace hl {

const char *dtype_name(hl_dtype_t dt) {
  switch (dt) {
    case HL_DTYPE_NONE: return "NONE";
    case HL_DTYPE_F32: return "F32";
    case HL_DTYPE_F16: return "F16";
    case HL_DTYPE_BF16: return "BF16";
    case HL_DTYPE_I32: return "I32";
    case HL_DTYPE_I64: return "I64";
  }
  return "unknown";
}

size_t dtype_size(hl_dtype_t dt) {
  switch (dt) {
    case HL_DTYPE_F32: case HL_DTYPE_I32: return 4;
    case HL_DTYPE_F16: case HL_DTYPE_BF16: return 2;
    case HL_DTYPE_I64: return 8;
    case HL_DTYPE_NONE: return 0;
  }
  return 0;
}

hl_status_t check_backend(const char *fn, hl_backend_t backend) {
  if (backend != HL_BACKEND_CPU && backend != HL_BACKEND_CUDA)
    return fail(HL_STATUS_INVALID_VALUE,
                "%s: backend is %d; use HL_BACKEND_CPU (1) or HL_BACKEND_CUDA (2)", fn,
                int(backend));
  if (!hl_backend_is_available(backend))
    return fail(HL_STATUS_NOT_SUPPORTED,
                "%s: the CUDA backend is not available (library built without CUDA, or no "
                "device visible)", fn);
  return HL_STATUS_SUCCESS;
}

hl_status_t check_float_dtype(const char *fn, const char *arg, hl_dtype_t dt) {
  if (!is_float_dtype(dt))
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s is %s (%d); expected F32, F16 or BF16", fn, arg,
                dtype_name(dt), int(dt));
  return HL_STATUS_SUCCESS;
}

hl_status_t check_not_null(const char *fn, const char *arg, const void *p) {
  if (!p) return fail(HL_STATUS_INVALID_VALUE, "%s: %s is NULL", fn, arg);
  return HL_STATUS_SUCCESS;
}

hl_status_t check_positive(const char *fn, const char *arg, int64_t v) {
  if (v < 0) return fail(HL_STATUS_INVALID_VALUE, "%s: %s is %lld; must be >= 0", fn, arg, (long long)v);
  return HL_STATUS_SUCCESS;
}

hl_status_t resolve_stride(const char *fn, const char *arg, int64_t stride, int64_t cols,
                           int64_t *out) {
  if (stride == 0) stride = cols;
  if (stride < cols)
    return fail(HL_STATUS_INVALID_VALUE,
                "%s: %s_stride is %lld, smaller than cols (%lld): rows would overlap", fn, arg,
                (long long)stride, (long long)cols);
  *out = stride;
  return HL_STATUS_SUCCESS;
}

hl_status_t check_pointer(const char *fn, hl_backend_t backend, const char *arg, const void *p,
                          hl_dtype_t dt) {
  if (!p) return HL_STATUS_SUCCESS;
  HL_TRY(check_element_aligned(fn, arg, p, dt));
  return check_location(fn, arg, p, backend);
}

hl_status_t check_element_aligned(const char *fn, const char *arg, const void *p, hl_dtype_t dt) {
  const size_t a = dtype_size(dt);
  if (a && reinterpret_cast<uintptr_t>(p) % a)
    return fail(HL_STATUS_MISALIGNED, "%s: %s (%p) is not aligned to its element size (%zu bytes)",
                fn, arg, p, a);
  return HL_STATUS_SUCCESS;
}

}  // namespace hl

namespace hl {

hl_status_t check_aliasing(const char *fn, const Buffer *bufs, int n) {
  for (int i = 0; i < n; ++i) {
    const Buffer &a = bufs[i];
    if (!a.output || !a.ptr) continue;
    const uint64_t na = span_bytes(a.rows, a.cols, a.stride, a.dtype);
    for (int j = 0; j < n; ++j) {
      const Buffer &b = bufs[j];
      if (j == i || !b.ptr || (b.output && j < i)) continue;
      if (!overlaps(a.ptr, na, b.ptr, span_bytes(b.rows, b.cols, b.stride, b.dtype))) continue;
      const bool same = a.ptr == b.ptr && a.stride == b.stride && a.rows == b.rows &&
                        a.cols == b.cols && dtype_size(a.dtype) == dtype_size(b.dtype);
      if (b.output)
        return fail(HL_STATUS_INVALID_VALUE, "%s: %s overlaps %s; outputs must not share memory",
                    fn, a.name, b.name);
      if (!same)
        return fail(HL_STATUS_INVALID_VALUE,
                    "%s: %s overlaps %s; an output may only alias an input exactly (in place)",
                    fn, a.name, b.name);
    }
  }
  return HL_STATUS_SUCCESS;
}

}  // namespace hl
