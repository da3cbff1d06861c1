// Backend availability and the host/device check of pointers. The runtime is asked on the CUDA side
// (kernels/common/launch.h); a build without CUDA takes every pointer as host memory.
#include "common.h"
#include "kernels/common/launch.h"

namespace hl {

hl_status_t check_location(const char *fn, const char *arg, const void *p, hl_backend_t backend) {
#if HL_HAVE_CUDA
  return cuda_check_location(fn, arg, p, backend);
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
  if (b == HL_BACKEND_CUDA) return hl::cuda_backend_available();
#endif
  return 0;
}
