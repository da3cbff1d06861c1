// Argument checks shared by every entry point, and dtype facts.
#include <algorithm>
#include <string>

#include "common.h"

namespace hl {

const char *dtype_name(int dt) {
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

size_t dtype_size(int dt) {
  switch (dt) {
    case HL_DTYPE_F32: case HL_DTYPE_I32: return 4;
    case HL_DTYPE_F16: case HL_DTYPE_BF16: return 2;
    case HL_DTYPE_I64: return 8;
  }
  return 0;
}

hl_status_t bad_struct_size(const char *fn, size_t n, size_t own, std::initializer_list<size_t> earlier) {
  std::string sizes;
  for (size_t e : earlier) sizes += ", " + std::to_string(e);
  return fail(HL_STATUS_INVALID_VALUE,
              "%s: struct_size is %zu; set it to sizeof the descriptor (%zu here%s%s), or a later "
              "header's size up to HL_MAX_STRUCT_SIZE (%d)", fn, n, own,
              earlier.size() ? "; earlier headers': " : "", sizes.c_str() + (earlier.size() ? 2 : 0),
              HL_MAX_STRUCT_SIZE);
}

hl_status_t check_enums(const char *fn, std::initializer_list<EnumField> fields) {
  for (const EnumField &f : fields)
    if (f.value < f.lo || f.value > f.hi)
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s is %d; use %s", fn, f.name, f.value, f.values);
  return HL_STATUS_SUCCESS;
}

hl_status_t check_extents(const char *fn, std::initializer_list<Extent> extents) {
  for (const Extent &e : extents)
    if (e.value < 0 || e.value > HL_MAX_EXTENT)
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s is %lld; must be in [0, HL_MAX_EXTENT = 2^48 - 1]",
                  fn, e.name, (long long)e.value);
  return HL_STATUS_SUCCESS;
}

hl_status_t check_bytes(const char *fn, uint64_t bytes, const char *what) {
  if (bytes > uint64_t(HL_MAX_SPAN_BYTES))
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s would span more than HL_MAX_SPAN_BYTES (2^62) bytes",
                fn, what);
  return HL_STATUS_SUCCESS;
}

hl_status_t check_backend(const char *fn, hl_backend_t backend) {
  if (!hl_backend_is_available(backend))
    return fail(HL_STATUS_NOT_SUPPORTED,
                "%s: the CUDA backend is not available (library built without CUDA, or no "
                "device visible)", fn);
  return HL_STATUS_SUCCESS;
}

hl_status_t check_float_dtype(const char *fn, const char *arg, int dt) {
  if (!is_float_dtype(dt))
    return fail(HL_STATUS_INVALID_VALUE, "%s: %s is %s (%d); expected F32, F16 or BF16", fn, arg,
                dtype_name(dt), dt);
  return HL_STATUS_SUCCESS;
}

hl_status_t check_not_null(const char *fn, const char *arg, const void *p) {
  if (!p) return fail(HL_STATUS_INVALID_VALUE, "%s: %s is NULL", fn, arg);
  return HL_STATUS_SUCCESS;
}

hl_status_t resolve_stride(const char *fn, const char *stride_name, int64_t stride, int64_t cols,
                           int64_t *out) {
  if (stride == 0) stride = cols;
  if (stride < cols)
    return fail(HL_STATUS_INVALID_VALUE,
                "%s: %s is %lld, smaller than cols (%lld): rows would overlap", fn, stride_name,
                (long long)stride, (long long)cols);
  *out = stride;
  return HL_STATUS_SUCCESS;
}

hl_status_t check_pointer(const char *fn, hl_backend_t backend, const char *arg, const void *p, int dt) {
  if (!p) return HL_STATUS_SUCCESS;
  HL_TRY(check_element_aligned(fn, arg, p, dt));
  return check_location(fn, arg, p, backend);
}

hl_status_t check_element_aligned(const char *fn, const char *arg, const void *p, int dt) {
  const size_t a = dtype_size(dt);
  if (a && reinterpret_cast<uintptr_t>(p) % a)
    return fail(HL_STATUS_MISALIGNED, "%s: %s (%p) is not aligned to its element size (%zu bytes)",
                fn, arg, p, a);
  return HL_STATUS_SUCCESS;
}

hl_status_t matrix(const char *fn, const Buffer &b, int64_t *stride, Buffer *out) {
  if (b.ptr) HL_TRY(resolve_stride(fn, b.stride_name, b.stride, b.cols, stride));
  *out = b;
  out->stride = *stride;
  return HL_STATUS_SUCCESS;
}

hl_status_t check_workspace(const char *fn, hl_backend_t backend, void *ws, size_t bytes, size_t need,
                            size_t align, Buffer *out) {
  *out = Buffer{"workspace", nullptr, 1, int64_t(need), int64_t(need), kBytes, true};
  if (bytes < need)
    return fail(HL_STATUS_INSUFFICIENT_WORKSPACE, "%s: workspace_bytes is %zu; this call needs %zu",
                fn, bytes, need);
  if (!need) return HL_STATUS_SUCCESS;
  HL_TRY(check_not_null(fn, "workspace", ws));
  if (reinterpret_cast<uintptr_t>(ws) % align)
    return fail(HL_STATUS_MISALIGNED, "%s: workspace (%p) must be %zu-byte aligned", fn, ws, align);
  HL_TRY(check_location(fn, "workspace", ws, backend));
  out->ptr = ws;
  return HL_STATUS_SUCCESS;
}

hl_status_t check_buffers(const char *fn, hl_backend_t backend, const Buffer *bufs, int n) {
  for (int i = 0; i < n; ++i) {
    const Buffer &b = bufs[i];
    if (!b.ptr) continue;
    const uint64_t bytes = span_bytes(b.rows, b.cols, b.stride, b.dtype);
    if (bytes > uint64_t(HL_MAX_SPAN_BYTES))
      return fail(HL_STATUS_INVALID_VALUE,
                  "%s: %s spans more than HL_MAX_SPAN_BYTES (2^62) bytes: %lld x %lld elements of %zu "
                  "bytes%s%s", fn, b.name, (long long)b.rows, (long long)b.cols, element_bytes(b.dtype),
                  b.stride_name ? ", row stride " : "", b.stride_name ? b.stride_name : "");
    if (bytes && reinterpret_cast<uintptr_t>(b.ptr) > UINTPTR_MAX - (bytes - 1))
      return fail(HL_STATUS_INVALID_VALUE, "%s: %s (%p) + %llu bytes wraps around the address space",
                  fn, b.name, b.ptr, (unsigned long long)bytes);
    HL_TRY(check_pointer(fn, backend, b.name, b.ptr, b.dtype));
  }
  return HL_STATUS_SUCCESS;
}

namespace {
// "y = x, residual_out = residual": the pairs a message offers.
std::string in_place_list(std::initializer_list<InPlace> allowed) {
  std::string s;
  for (const InPlace &p : allowed) s += std::string(s.empty() ? "" : ", ") + p.output + " = " + p.input;
  return s.empty() ? "none" : s;
}
}  // namespace

hl_status_t check_aliasing(const char *fn, const Buffer *bufs, int n, std::initializer_list<InPlace> allowed) {
  for (int i = 0; i < n; ++i) {
    const Buffer &a = bufs[i];
    if (!a.output || !a.ptr) continue;
    const uint64_t na = span_bytes(a.rows, a.cols, a.stride, a.dtype);
    for (int j = 0; j < n; ++j) {
      const Buffer &b = bufs[j];
      if (j == i || !b.ptr || (b.output && j < i)) continue;
      if (!overlaps(a.ptr, na, b.ptr, span_bytes(b.rows, b.cols, b.stride, b.dtype))) continue;
      if (b.output)
        return fail(HL_STATUS_INVALID_VALUE, "%s: %s overlaps %s; outputs must not share memory",
                    fn, a.name, b.name);
      const bool pair = std::any_of(allowed.begin(), allowed.end(), [&](const InPlace &p) {
        return !std::strcmp(p.output, a.name) && !std::strcmp(p.input, b.name);
      });
      if (!pair)
        return fail(HL_STATUS_INVALID_VALUE, "%s: %s overlaps %s; an output may share memory with "
                    "an input only in place, as %s", fn, a.name, b.name, in_place_list(allowed).c_str());
      const bool exact = a.ptr == b.ptr && a.stride == b.stride && a.rows == b.rows &&
                         a.cols == b.cols && a.dtype == b.dtype;
      if (!exact)
        return fail(HL_STATUS_INVALID_VALUE, "%s: %s overlaps %s; in place, %s must be %s exactly "
                    "(the same pointer, dtype and stride)", fn, a.name, b.name, a.name, b.name);
    }
  }
  return HL_STATUS_SUCCESS;
}

}  // namespace hl
