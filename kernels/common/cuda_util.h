// Host-side CUDA helpers for the kernels' launchers: checked calls and cached device facts.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "hl/status.h"

// Returns HL_STATUS_CUDA_ERROR with the call and the runtime's message when expr fails.
#define HL_CUDA_TRY(expr)                                                                  \
  do {                                                                                     \
    cudaError_t hl_cuda_err_ = (expr);                                                     \
    if (hl_cuda_err_ != cudaSuccess)                                                       \
      return ::hl::fail(HL_STATUS_CUDA_ERROR, "%s:%d: %s failed: %s (%s)", __FILE__, __LINE__, \
                        #expr, cudaGetErrorName(hl_cuda_err_), cudaGetErrorString(hl_cuda_err_)); \
  } while (0)

// Checks the launch that was just made (configuration errors surface here, not later).
#define HL_CUDA_TRY_LAUNCH() HL_CUDA_TRY(cudaGetLastError())

namespace hl::dev {

constexpr int kMaxDevices = 64;

// fn(device) (an answer >= 0) for the current device, computed once per device and kept in
// `cache` (zero-initialised, one per question); calls may come from any thread.
template <class Fn>
int per_device(std::atomic<int> (&cache)[kMaxDevices], Fn fn) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) (void)cudaGetLastError(), dev = 0;
  if (dev < 0 || dev >= kMaxDevices) return fn(dev);
  int v = cache[dev].load(std::memory_order_relaxed);
  if (!v) cache[dev].store(v = fn(dev) + 1, std::memory_order_relaxed);
  return v - 1;
}

inline bool aligned_to(const void *p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
inline bool aligned16(const void *p) { return aligned_to(p, 16); }

// Multiprocessor count of the current device (cached per device).
int sm_count();

// The architecture (major * 10 + minor) the library's device code that runs on the current device
// was compiled for, as __CUDA_ARCH__ / 10 saw it: 90 on Hopper (sm_90a), 80 on Ampere, and 80 on a
// newer GPU, which JIT-compiles the sm_80 PTX (sm_90a code runs on 9.0 only). Code for clusters,
// distributed shared memory or TMA exists in the binary only where this is >= 90 (cached).
int code_arch();

// How many blocks of `kernel` with `threads` threads and `smem` dynamic shared memory fit on one
// multiprocessor. Call it once per kernel instantiation and cache the answer.
template <class Kernel>
int blocks_per_sm(Kernel kernel, int threads, size_t smem = 0) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 1;
  }
  return n > 0 ? n : 1;
}

// Raises the kernel's dynamic shared-memory limit to `smem` where that passes the default 48 KB
// (a failure to raise it shows at the launch).
template <class Kernel>
void allow_smem(Kernel kernel, size_t smem) {
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess)
    (void)cudaGetLastError();
}

// Launch configuration of `ctas` CTAs in clusters of `cluster` (1: no cluster attribute); attr
// is the storage the configuration points to.
cudaLaunchConfig_t cluster_launch(int64_t ctas, int threads, size_t smem, int cluster, cudaStream_t stream,
                                  cudaLaunchAttribute &attr);

// How many clusters of `cluster` CTAs of `kernel` (or CTAs, when cluster is 1) fit on the device
// at once; 0 if none does. Raise the kernel's shared-memory limit first.
template <class Kernel>
int clusters_resident(Kernel kernel, int threads, size_t smem, int cluster) {
  if (cluster == 1) return blocks_per_sm(kernel, threads, smem) * sm_count();
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_launch(cluster, threads, smem, cluster, nullptr, attr);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) (void)cudaGetLastError(), n = 0;
  return n;
}

// Lets the kernel that cfg launches begin while the kernel before it on the stream still runs
// (programmatic dependent launch, sm_90; grid_dependency.cuh has the device side). The launched
// kernel must wait_for_previous_grid() before it reads what that kernel writes. attrs: storage for
// cfg's attributes, which it takes over.
void allow_early_start(cudaLaunchConfig_t &cfg, cudaLaunchAttribute (&attrs)[2]);

}  // namespace hl::dev
