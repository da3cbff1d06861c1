// Backend availability and the host/device check of pointers (launch.h): the runtime's answers.
#include <cuda_runtime_api.h>

#include "common/launch.h"
#include "hl/status.h"

namespace hl {

hl_status_t cuda_check_location(const char *fn, const char *arg, const void *p, hl_backend_t backend) {
  if (!p || !hl_backend_is_available(HL_BACKEND_CUDA)) {
    if (backend == HL_BACKEND_CUDA)
      return fail(HL_STATUS_NOT_SUPPORTED, "%s: the CUDA backend is not available", fn);
    return HL_STATUS_SUCCESS;
  }
  cudaPointerAttributes attr;
  cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // an unregistered host pointer is not a sticky error
    attr.type = cudaMemoryTypeUnregistered;
  }
  const bool device_ok = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  const bool host_ok = attr.type != cudaMemoryTypeDevice;
  if (backend == HL_BACKEND_CUDA && !device_ok)
    return fail(HL_STATUS_INVALID_VALUE,
                "%s: %s (%p) is host memory, but the backend is HL_BACKEND_CUDA (pass a device "
                "pointer, or use HL_BACKEND_CPU)", fn, arg, p);
  if (backend == HL_BACKEND_CPU && !host_ok)
    return fail(HL_STATUS_INVALID_VALUE,
                "%s: %s (%p) is device memory, but the backend is HL_BACKEND_CPU (pass a host "
                "pointer, or use HL_BACKEND_CUDA)", fn, arg, p);
  return HL_STATUS_SUCCESS;
}

int cuda_backend_available() {
  static const int available = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return n > 0 ? 1 : 0;
  }();
  return available;
}

}  // namespace hl
