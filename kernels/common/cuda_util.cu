#include "cuda_util.h"

namespace hl::dev {

namespace {
__global__ void probe_kernel() {}
}  // namespace

int code_arch() {
  static std::atomic<int> cache[kMaxDevices];
  return per_device(cache, [](int) {
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, probe_kernel) != cudaSuccess) return (void)cudaGetLastError(), 0;
    return fa.ptxVersion;
  });
}

int sm_count() {
  static std::atomic<int> cache[kMaxDevices];
  return per_device(cache, [](int dev) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n < 1)
      (void)cudaGetLastError(), n = 1;
    return n;
  });
}

cudaLaunchConfig_t cluster_launch(int64_t ctas, int threads, size_t smem, int cluster, cudaStream_t stream,
                                  cudaLaunchAttribute &attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(ctas));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(cluster);
  attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = cluster > 1 ? 1 : 0;
  return cfg;
}

void allow_early_start(cudaLaunchConfig_t &cfg, cudaLaunchAttribute (&attrs)[2]) {
  if (cfg.numAttrs) attrs[0] = cfg.attrs[0];
  cudaLaunchAttribute &a = attrs[cfg.numAttrs];
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attrs;
  cfg.numAttrs += 1;
}

}  // namespace hl::dev
