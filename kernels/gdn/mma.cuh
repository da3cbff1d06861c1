// Warp-level tensor-core pieces for the GDN kernels: ldmatrix and mma.sync m16n8k16
// (fp32 accumulation), which run on sm_80 and sm_90 alike. Tiles live in shared memory either as
// [64][kLd] 16-bit elements (Padded: the 8-element row padding keeps ldmatrix free of bank
// conflicts) or as TMA wrote them (Swizzled: the swizzle does the same).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "common/bulk_copy.cuh"
#include "common/cp_async.cuh"
#include "common/dtype.cuh"

namespace hl::gdn::dev {
using namespace hl::dev;  // the common device helpers (kernels/common)

constexpr int kTile = 64;              // rows and columns of every shared tile
constexpr int kLd = kTile + 8;         // row pitch in elements (144 bytes)
constexpr int kTileElems = kTile * kLd;

using hl::dev::smem_addr;

// The lane, read so that the compiler cannot treat it (or what is computed from it) as known.
__device__ __forceinline__ int lane_id() {
  int l;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
  return l;
}

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

// Shared tile layouts: element offset of (row, column).
struct Padded {  // [64][kLd], rows padded by 8 elements
  static __device__ __forceinline__ int off(int r, int c) { return r * kLd + c; }
};
struct Swizzled {  // 64-row boxes of 64 columns side by side, 128-byte rows in TMA's 128-byte swizzle
  static __device__ __forceinline__ int off(int r, int c) {
    return (c >> 6) * (kTile * 64) + r * 64 + ((((c >> 3) ^ r) & 7) << 3) + (c & 7);
  }
};

// One warp's 16 x 8NB block of a 64-row product: acc += A[m0:m0+16, :] * B[:, n0:n0+8NB], summed
// over the 64-long inner dimension. A_T: A is stored transposed ([k][m]); B_KN: B is stored
// [k][n] (else [n][k], i.e. both operands k-contiguous). acc[j] is the n8 tile j in mma layout:
// rows m0 + lane/4 (+8), columns n0 + 8j + 2 (lane % 4) (+1).
template <class T, bool A_T, bool B_KN, int NB = 4, class LA = Padded, class LB = Padded>
__device__ __forceinline__ void warp_mma(float (&acc)[NB][4], const T *A, const T *B, int m0, int n0, int lane) {
  const int r8 = lane % 8, hi = lane / 16, mid = (lane / 8) % 2;
#pragma unroll
  for (int k0 = 0; k0 < kTile; k0 += 16) {
    uint32_t a[4];
    if (A_T) ldsm_x4_t(a, A + LA::off(k0 + hi * 8 + r8, m0 + mid * 8));
    else ldsm_x4(a, A + LA::off(m0 + lane % 16, k0 + hi * 8));
#pragma unroll
    for (int p = 0; p < NB / 2; ++p) {
      uint32_t b[4];
      const int n = n0 + 16 * p;
      if (B_KN) ldsm_x4_t(b, B + LB::off(k0 + mid * 8 + r8, n + hi * 8));
      else ldsm_x4(b, B + LB::off(n + hi * 8 + r8, k0 + mid * 8));
      mma16816<T>(acc[2 * p], a, b[0], b[1]);
      mma16816<T>(acc[2 * p + 1], a, b[2], b[3]);
    }
  }
}

template <int NB>
__device__ __forceinline__ void zero(float (&acc)[NB][4]) {
#pragma unroll
  for (int j = 0; j < NB; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
}

__device__ __forceinline__ float gexp(float x, bool log2) { return log2 ? exp2f(x) : expf(x); }

// Stores a warp's accumulator block (times mul) to a row-major [rows, ld] output: rows < nr,
// columns < nc. pairs: two columns at a time (nc even, 4-byte aligned rows).
template <class T, int NB>
__device__ __forceinline__ void store_block(T *out, int64_t ld, int nr, int nc, const float (&acc)[NB][4], float mul,
                                            int m0, int n0, int lane, bool pairs) {
#pragma unroll
  for (int j = 0; j < NB; ++j)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = m0 + lane / 4 + 8 * half, c = n0 + 8 * j + 2 * (lane % 4);
      if (r >= nr) continue;
      const float x0 = acc[j][2 * half] * mul, x1 = acc[j][2 * half + 1] * mul;
      T *p = out + r * ld + c;
      if (pairs && c + 1 < nc) {
        store_pack<T, 2>(p, pack_pair<T>(x0, x1));
      } else {
        if (c < nc) p[0] = from_float<T>(x0);
        if (c + 1 < nc) p[1] = from_float<T>(x1);
      }
    }
}

}  // namespace hl::gdn::dev
