// Status names, the thread-local last-error message and the version query.
#include <cstdio>
#include <string>

#include "common.h"

namespace {
thread_local std::string last_error;
}

namespace hl {

hl_status_t fail(hl_status_t status, const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  try {
    last_error = buf;
  } catch (...) {
    // Keep the status even if the message cannot be stored.
  }
  return status;
}

hl_status_t named_failure(const char *fn, hl_status_t status) {
  const std::string prefix = std::string(fn) + ": ";
  if (last_error.compare(0, prefix.size(), prefix) != 0) last_error = prefix + last_error;
  return status;
}

hl_status_t succeed() {
  last_error.clear();
  return HL_STATUS_SUCCESS;
}

}  // namespace hl

extern "C" {

HL_API int hl_get_version(void) { return HL_VERSION; }

HL_API const char *hl_get_error_string(hl_status_t status) {
  switch (hl::enum_int(status)) {  // any int may arrive here: not loaded as the enum
    case HL_STATUS_SUCCESS: return "HL_STATUS_SUCCESS: success";
    case HL_STATUS_INVALID_VALUE: return "HL_STATUS_INVALID_VALUE: invalid value";
    case HL_STATUS_NOT_SUPPORTED: return "HL_STATUS_NOT_SUPPORTED: not supported";
    case HL_STATUS_MISALIGNED: return "HL_STATUS_MISALIGNED: misaligned pointer or stride";
    case HL_STATUS_INSUFFICIENT_WORKSPACE:
      return "HL_STATUS_INSUFFICIENT_WORKSPACE: workspace too small";
    case HL_STATUS_ALLOC_FAILED: return "HL_STATUS_ALLOC_FAILED: host allocation failed";
    case HL_STATUS_CUDA_ERROR: return "HL_STATUS_CUDA_ERROR: CUDA runtime error";
    case HL_STATUS_NCCL_ERROR: return "HL_STATUS_NCCL_ERROR: NCCL error";
    case HL_STATUS_INTERNAL_ERROR: return "HL_STATUS_INTERNAL_ERROR: internal error";
  }
  return "unknown hl_status_t value";
}

HL_API const char *hl_get_last_error(void) { return last_error.c_str(); }

}  // extern "C"
