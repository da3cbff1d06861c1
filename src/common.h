// Internal helpers shared by the host code of every op: descriptor versioning, enumerations and
// argument validation (the error record, dtype facts and byte arithmetic the CUDA side needs too
// are hl/status.h's). Nothing here is exported.
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <new>

#include "headloss.h"
#include "hl/status.h"

namespace hl {

hl_status_t succeed();  // clears the last error, returns HL_STATUS_SUCCESS
// Prefixes the last error with "fn: " unless it starts so (a CUDA call's message names its file).
hl_status_t named_failure(const char *fn, hl_status_t status);

// Runs an entry point's body, turning a C++ exception into a status: none may cross the C ABI.
// Every message then starts with the entry point's name.
template <class F>
hl_status_t guarded(const char *fn, F &&body) {
  try {
    hl_status_t s = body();
    return s == HL_STATUS_SUCCESS ? succeed() : named_failure(fn, s);
  } catch (const std::bad_alloc &) {
    return fail(HL_STATUS_ALLOC_FAILED, "%s: out of host memory", fn);
  } catch (...) {
    return fail(HL_STATUS_INTERNAL_ERROR, "%s: unexpected C++ exception", fn);
  }
}

// read_descriptor's refusal of a struct_size: the sizes it accepts.
hl_status_t bad_struct_size(const char *fn, size_t n, size_t own, std::initializer_list<size_t> earlier);

// Copies a caller's descriptor into a zeroed one of this library's size. struct_size must be
// sizeof(T), one of `earlier` (an older header's: its newer fields stay zero, their defaults), or a
// later header's size up to HL_MAX_STRUCT_SIZE whose fields this library does not know are zero
// (the caller uses no feature it lacks).
template <class T>
hl_status_t read_descriptor(const char *fn, const char *name, const T *in, T *out,
                            std::initializer_list<size_t> earlier = {}) {
  if (!in) return fail(HL_STATUS_INVALID_VALUE, "%s: %s (the descriptor) is NULL", fn, name);
  const size_t n = in->struct_size;
  bool known = n == sizeof(T);  // (a loop: <algorithm> here crashed nvcc 13.0 on dqkwg_sm90.cu)
  for (size_t e : earlier) known |= e == n;
  if (!known && (n < sizeof(T) || n > HL_MAX_STRUCT_SIZE)) return bad_struct_size(fn, n, sizeof(T), earlier);
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

// --- enumerations: a caller's out-of-range value must not be loaded as the enum type (undefined
// behaviour), so each enum-typed field is read as its integer and checked before any other use ---
template <class E>
int enum_int(const E &field) {
  static_assert(sizeof(E) == sizeof(int), "the header's enumerations are int-sized");
  int v;
  std::memcpy(&v, &field, sizeof v);
  return v;
}
// One enum-typed field: its C name, its integer, its type's values and how a message lists them.
struct EnumField {
  const char *name;
  int value, lo, hi;
  const char *values;
};
inline EnumField enum_field(const char *name, const hl_dtype_t &f) {
  return {name, enum_int(f), HL_DTYPE_NONE, HL_DTYPE_I64, "HL_DTYPE_NONE (0), _F32, _F16, _BF16, _I32 or _I64 (5)"};
}
inline EnumField enum_field(const char *name, const hl_backend_t &f) {
  return {name, enum_int(f), HL_BACKEND_CPU, HL_BACKEND_CUDA, "HL_BACKEND_CPU (1) or HL_BACKEND_CUDA (2)"};
}
inline EnumField enum_field(const char *name, const hl_rmsnorm_cast_t &f) {
  return {name, enum_int(f), HL_RMSNORM_CAST_LLAMA, HL_RMSNORM_CAST_NONE,
          "HL_RMSNORM_CAST_LLAMA (0), _GEMMA (1) or _NONE (2)"};
}
inline EnumField enum_field(const char *name, const hl_gdn_gate_t &f) {
  return {name, enum_int(f), HL_GDN_GATE_NONE, HL_GDN_GATE_CONST_DECAY_LOG2,
          "HL_GDN_GATE_NONE (0), _LOG, _LOG2, _CONST_DECAY or _CONST_DECAY_LOG2 (4)"};
}
inline EnumField enum_field(const char *name, const hl_loss_grad_mode_t &f) {
  return {name, enum_int(f), HL_LOSS_GRAD_NONE, HL_LOSS_GRAD_ACCUMULATE,
          "HL_LOSS_GRAD_NONE (0), _WRITE (1) or _ACCUMULATE (2)"};
}
// Each field's integer is one of its type's values.
hl_status_t check_enums(const char *fn, std::initializer_list<EnumField> fields);

inline bool is_float_dtype(int dt) {
  return dt == HL_DTYPE_F32 || dt == HL_DTYPE_F16 || dt == HL_DTYPE_BF16;
}

// --- sizes: every caller's size, count and stride is range-checked before any other use, and
// byte counts are computed with overflow checks ---
struct Extent {
  const char *name;  // the C field
  int64_t value;
};
// Each value in [0, HL_MAX_EXTENT].
hl_status_t check_extents(const char *fn, std::initializer_list<Extent> extents);
// A Buffer's dtype for untyped memory (workspaces, blocks of statistics): elements of one byte.
constexpr int kBytes = -1;
inline size_t element_bytes(int dt) { return dt == kBytes ? 1 : dtype_size(dt); }
// Bytes spanned by a [rows, cols] matrix with the given row stride (elements): (rows - 1) *
// stride + cols elements, saturated.
inline uint64_t span_bytes(int64_t rows, int64_t cols, int64_t stride, int dt) {
  if (rows <= 0 || cols <= 0) return 0;
  return sat_mul(sat_add(sat_mul(uint64_t(rows - 1), uint64_t(stride)), uint64_t(cols)), element_bytes(dt));
}
// A byte count a size query answers or a call needs: at most HL_MAX_SPAN_BYTES, else the call's
// `what` (named by its fields) is too large.
hl_status_t check_bytes(const char *fn, uint64_t bytes, const char *what);
// True when the byte ranges [a, a + na) and [b, b + nb) intersect (neither wraps: check_buffers).
inline bool overlaps(const void *a, uint64_t na, const void *b, uint64_t nb) {
  if (!a || !b || na == 0 || nb == 0) return false;
  const uintptr_t pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa >= pb ? pa - pb < nb : pb - pa < na;
}

// --- validation; each returns SUCCESS or records a message naming fn and the argument ---
// The backend (already a valid hl_backend_t) is available here.
hl_status_t check_backend(const char *fn, hl_backend_t backend);
hl_status_t check_float_dtype(const char *fn, const char *arg, int dt);
hl_status_t check_not_null(const char *fn, const char *arg, const void *p);
// Resolves a matrix's row stride, the field `stride_name` (0 = packed), and checks it covers a
// row: *out = stride ? stride : cols.
hl_status_t resolve_stride(const char *fn, const char *stride_name, int64_t stride, int64_t cols,
                           int64_t *out);
// Checks that p is aligned to its element size.
hl_status_t check_element_aligned(const char *fn, const char *arg, const void *p, int dt);
// Checks that a pointer is usable by the backend: host memory for CPU, device (or managed)
// memory for CUDA. Without CUDA in the build every pointer is taken as host memory.
hl_status_t check_location(const char *fn, const char *arg, const void *p, hl_backend_t backend);

// One matrix (or vector: rows 1 or cols 1) argument of a call.
struct Buffer {
  const char *name;  // the C field of the pointer
  const void *ptr;
  int64_t rows, cols, stride;  // stride already resolved
  int dtype;                   // an hl_dtype_t, or kBytes (above)
  bool output;
  const char *stride_name = nullptr;  // the C field of the stride, where the caller gives one
};
// A matrix argument b given with the caller's stride: the stride resolved into *stride where b is
// set (resolve_stride), and b with it into *out.
hl_status_t matrix(const char *fn, const Buffer &b, int64_t *stride, Buffer *out);
// A call's workspace: at least `need` bytes (INSUFFICIENT_WORKSPACE), and where it is needed, set,
// aligned to `align` bytes and in the backend's memory; *out its Buffer (none when not needed).
hl_status_t check_workspace(const char *fn, hl_backend_t backend, void *ws, size_t bytes, size_t need,
                            size_t align, Buffer *out);
// Each buffer that is set: its span within HL_MAX_SPAN_BYTES and the address space, its pointer
// aligned to its element and in the backend's memory.
hl_status_t check_buffers(const char *fn, hl_backend_t backend, const Buffer *bufs, int n);
// An output that may be the same memory as an input (in place), by their names.
struct InPlace {
  const char *output, *input;
};
// Outputs must not overlap one another or any input, except the pairs `allowed`, and those only
// exactly (same pointer, stride, dtype and shape). Spans already checked (check_buffers).
hl_status_t check_aliasing(const char *fn, const Buffer *bufs, int n, std::initializer_list<InPlace> allowed);

// An optional pointer argument: NULL passes; otherwise element alignment and memory kind.
hl_status_t check_pointer(const char *fn, hl_backend_t backend, const char *arg, const void *p, int dt);

}  // namespace hl
