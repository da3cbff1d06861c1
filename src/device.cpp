// Backend availability and the host/device check of pointers. The only host file that talks to
// the CUDA runtime directly; it builds without CUDA too, where every pointer is host memory.
#include "common.h"

#if HL_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace hl {

hl_status_t check_location(const char *fn, const char *arg, const void *p, hl_backend_t backend) {
#if HL_HAVE_CUDA
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
#else
  (void)p;
  if (backend == HL_BACKEND_CUDA)
    return fail(HL_STATUS_NOT_SUPPORTED, "%s: %s: this library was built without CUDA", fn, arg);
  return HL_STATUS_SUCCESS;
#endif
}

}  // namespace hl

extern "C" HL_API int hl_backend_is_available(hl_backend_t backend) {
  const int b = hl::enum_int(backend);  // any int may arrive here: not loaded as the enum
  if (b == HL_BACKEND_CPU) return 1;
#if HL_HAVE_CUDA
  if (b == HL_BACKEND_CUDA) {
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
#endif
  return 0;
}
