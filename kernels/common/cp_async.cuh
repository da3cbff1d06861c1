// cp.async: 16-byte copies from global into shared memory that complete in the background
// (sm_80 and later), committed in groups and waited for by count.
#pragma once

#include "common/bulk_copy.cuh"

namespace hl::dev {

// 16 bytes global -> shared; bytes past src_bytes (0 or 16) are zero-filled. The memory clobbers
// keep plain shared-memory accesses on their side of the copy and of the wait.
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes) : "memory");
}
// BYTES (4, 8 or 16) global -> shared, zeros instead when !valid (src must still be an address).
// PF256 (4 or 8 bytes): L2 fetches the 256 bytes around src from memory at once, a hint for rows read in
// many small copies, which otherwise wait on memory a sector at a time (bench/notes/gdn.md "GDN v21").
template <int BYTES, bool PF256 = false>
__device__ __forceinline__ void cp_async_bytes(void *dst, const void *src, bool valid) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
  static_assert(!(PF256 && BYTES == 16), "the hint is for the narrow copies");
  if constexpr (BYTES == 16) {
    cp_async16(dst, src, valid ? 16 : 0);  // .cg: streamed data skips L1
  } else if constexpr (PF256) {
    asm volatile("cp.async.ca.shared.global.L2::256B [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "n"(BYTES), "r"(valid ? BYTES : 0) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src), "n"(BYTES),
                 "r"(valid ? BYTES : 0) : "memory");
  }
}
// One arrival on bar once this thread's earlier cp.async copies have landed (noinc: it is one of
// the arrivals the barrier was initialised to expect). sm_90.
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t *bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

}  // namespace hl::dev
