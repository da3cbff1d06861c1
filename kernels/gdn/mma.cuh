// Warp-level tensor-core pieces for the GDN kernels: cp.async, ldmatrix and mma.sync m16n8k16
// (fp32 accumulation), which run on sm_80 and sm_90 alike. Tiles live in shared memory as
// [64][kLd] 16-bit elements; the 8-element row padding keeps ldmatrix free of bank conflicts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace hl::cuda::gdn {

constexpr int kTile = 64;              // rows and columns of every shared tile
constexpr int kLd = kTile + 8;         // row pitch in elements (144 bytes)
constexpr int kTileElems = kTile * kLd;

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; bytes past src_bytes (0 or 16) are zero-filled.
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

template <class T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One warp's 16 x 32 block of a 64 x 64 product: acc += A[m0:m0+16, :] * B[:, n0:n0+32], summed
// over the 64-long inner dimension. A_T: A is stored transposed ([k][m]); B_KN: B is stored
// [k][n] (else [n][k], i.e. both operands k-contiguous). acc[j] is the n8 tile j in mma layout:
// rows m0 + lane/4 (+8), columns n0 + 8j + 2 (lane % 4) (+1).
template <class T, bool A_T, bool B_KN>
__device__ __forceinline__ void warp_mma(float (&acc)[4][4], const T *A, const T *B, int m0, int n0, int lane) {
  const int r8 = lane % 8, hi = lane / 16, mid = (lane / 8) % 2;
#pragma unroll
  for (int k0 = 0; k0 < kTile; k0 += 16) {
    uint32_t a[4];
    if (A_T) ldsm_x4_t(a, A + (k0 + hi * 8 + r8) * kLd + m0 + mid * 8);
    else ldsm_x4(a, A + (m0 + lane % 16) * kLd + k0 + hi * 8);
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      uint32_t b[4];
      const int n = n0 + 16 * p;
      if (B_KN) ldsm_x4_t(b, B + (k0 + mid * 8 + r8) * kLd + n + hi * 8);
      else ldsm_x4(b, B + (n + hi * 8 + r8) * kLd + k0 + mid * 8);
      mma16816<T>(acc[2 * p], a, b[0], b[1]);
      mma16816<T>(acc[2 * p + 1], a, b[2], b[3]);
    }
  }
}

__device__ __forceinline__ void zero(float (&acc)[4][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
}

}  // namespace hl::cuda::gdn
