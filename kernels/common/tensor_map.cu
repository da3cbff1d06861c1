#include "tensor_map.h"

#include <cudaTypedefs.h>

#include "cuda_util.h"

namespace hl::dev {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void *p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

}  // namespace

bool device_is_sm90() {
  static std::atomic<int> cache[kMaxDevices];
  return per_device(cache, [](int dev) {
    int major = 0, minor = 0;
    const bool yes = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                     cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
                     major == 9 && minor == 0;
    if (!yes) (void)cudaGetLastError();
    return int(yes);
  }) != 0;
}

bool tensor_maps_available() { return encoder() != nullptr; }

hl_status_t encode_map(const char *fn, CUtensorMap *m, hl_dtype_t dt, const void *base, uint64_t d0, uint64_t d1,
                       uint64_t d2, uint64_t s1, uint64_t s2, uint32_t b0, uint32_t b1, uint32_t b2) {
  const cuuint64_t dims[3] = {d0, d1, d2}, strides[2] = {s1, s2};
  const cuuint32_t box[3] = {b0, b1, b2}, step[3] = {1, 1, 1};
  const CUresult r =
      encoder()(m, dt == HL_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                const_cast<void *>(base), dims, strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return fail(HL_STATUS_CUDA_ERROR, "%s: cuTensorMapEncodeTiled failed (%d)", fn, int(r));
  return HL_STATUS_SUCCESS;
}

}  // namespace hl::dev
