// Hopper bulk copies (cp.async.bulk, the TMA engine's 1-D form) from global into shared memory,
// completed through an mbarrier: a whole slice in flight without registers. sm_90 and later.
#pragma once

#include <cstdint>

namespace hl::dev {

// False in the device pass of an architecture without clusters (sm_80): the host launches cluster
// shapes only where code_arch() >= 90, so there their kernels compile to nothing.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
inline constexpr bool kClusterCode = false;
#else
inline constexpr bool kClusterCode = true;
#endif

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread initialises; the fence makes the barrier visible to the async proxy. Sync after.
__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t count) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Arrives on bar (initialised with count 1) and makes its current phase also wait for `bytes`
// more to land (from bulk copies or st.async).
__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}

// bytes (a multiple of 16, both addresses 16-byte aligned) from src into dst, counted on bar's
// current phase (which an mbar_expect_tx of them, or of more, arms).
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
#endif
}

// bulk_copy, arming bar (initialised with count 1) for it: its current phase completes when the
// bytes have landed.
__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
  mbar_expect_tx(bar, bytes);
  bulk_copy(dst, src, bytes, bar);
}

// Starts an L2 fill of [p, p + bytes) (16-byte aligned, a multiple of 16 bytes); nothing to wait
// for: a later load of those bytes finds them in L2 (or goes to memory if they are not there yet).
__device__ __forceinline__ void prefetch_l2(const void *p, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// One arrival on bar (release: this thread's earlier shared-memory reads are done).
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
#endif
}

// Orders this thread's generic-proxy shared-memory accesses (and, after a barrier, those it has
// seen) with its later async-proxy ones (TMA, wgmma), and back.
__device__ __forceinline__ void fence_proxy_async() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Waits until the phase of bar with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#endif
}

// A 3-D box of a tensor (TMA, a CUtensorMap in kernel parameter or global memory) into shared
// memory at coordinates (c0 innermost); completes on bar like bulk_load. Out-of-range elements
// land as zeros and still count in the box's bytes.
__device__ __forceinline__ void tma_load_3d(void *dst, const void *map, int c0, int c1, int c2, uint64_t *bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
#endif
}

// A 3-D box of shared memory to a tensor (TMA; clipped to the tensor's bounds) as part of this
// thread's current bulk group; bulk_commit closes the group, bulk_wait_all waits for them.
__device__ __forceinline__ void tma_store_3d(const void *map, const void *src, int c0, int c1, int c2) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(map),
               "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}
// READ: until this thread's committed groups have read their shared memory (it may be written
// again); else until they are done.
template <bool READ>
__device__ __forceinline__ void bulk_wait_all() {
#if __CUDA_ARCH__ >= 900
  if constexpr (READ) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  else asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

// Waits like mbar_wait, with acquire at cluster scope (the phase was completed from a peer CTA).
__device__ __forceinline__ void mbar_wait_cluster(uint64_t *bar, uint32_t parity) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#endif
}

// The shared::cluster address of `p` (this CTA's shared memory) in cluster rank `rank`.
__device__ __forceinline__ uint32_t peer_addr(const void *p, uint32_t rank) {
  uint32_t r = 0;
#if __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_addr(p)), "r"(rank));
#endif
  return r;
}

// This CTA's rank in its cluster (0 outside a cluster launch).
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r = 0;
#if __CUDA_ARCH__ >= 900
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}

// One arrival, with release at cluster scope, on the barrier at `bar` in cluster rank `rank`.
__device__ __forceinline__ void mbar_arrive_peer(uint64_t *bar, uint32_t rank) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(peer_addr(bar, rank))
               : "memory");
#endif
}

// Stores x at `dst` in cluster rank `rank` and completes 4 bytes on that CTA's barrier `bar`.
__device__ __forceinline__ void st_async_peer(float *dst, float x, uint64_t *bar, uint32_t rank) {
#if __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                   peer_addr(dst, rank)),
               "r"(__float_as_uint(x)), "r"(peer_addr(bar, rank))
               : "memory");
#endif
}

// Every thread of every CTA of the cluster (release, then acquire).
__device__ __forceinline__ void cluster_barrier() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// Barrier `id` (1..15) among `threads` threads (whole warps) of the CTA.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace hl::dev
