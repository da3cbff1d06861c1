// Hopper warpgroup MMA (wgmma.mma_async, sm_90a): D[64 x N] (fp32, in registers) += A[64 x 16] B[16 x N]
// with both operands in shared memory in the 128-byte swizzled layout that TMA writes
// (CU_TENSOR_MAP_SWIZZLE_128B: 8-row atoms of 1024 bytes, tiles 1024-byte aligned): A K-major, B
// K-major or (TB = 1) N-major (n contiguous: boxes of [k rows][64 n], see wgmma_desc_n_major). The four
// warps of a warpgroup issue it together; warp w holds rows 16w..16w+15 of D in the mma.sync
// m16n8 accumulator layout (d[4j..4j+3]: columns 8j..8j+7), so mma.sync code can continue on D.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace hl::dev {

// Matrix descriptor of a K-major, 128-byte swizzled operand starting at p (shared memory):
// 8-row groups 1024 bytes apart. Adding 2 moves it 16 elements (32 bytes) along K.
__device__ __forceinline__ uint64_t wgmma_desc(const void *p) {
  const uint64_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return ((a & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Descriptor of an N-major (MN-major) 128-byte swizzled B operand at p: boxes of [64 k rows][64 n
// columns] (8 KB) side by side along N (the leading byte offset), 8-row groups 1024 bytes apart
// (the stride byte offset). Adding 128 moves it 16 rows (2048 bytes) along K.
__device__ __forceinline__ uint64_t wgmma_desc_n_major(const void *p) {
  const uint64_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return ((a & 0x3FFFF) >> 4) | (uint64_t(8192 >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Pins accumulator registers after wgmma_wait<0>, so the compiler reads them no earlier.
template <int NB>
__device__ __forceinline__ void wgmma_pin(float (&d)[NB][4]) {
#pragma unroll
  for (int j = 0; j < NB; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

// D (N/8 blocks of 8 columns) += A B, where a and b are descriptors; TB = 1: B is N-major.
template <class T, int N, int TB = 0>
struct Wgmma;

#define HL_WGMMA_32(T, PTX)  /* PTX: the input type's name in PTX */ \
  template <int TB> \
  struct Wgmma<T, 32, TB> { \
    static __device__ __forceinline__ void run(float (&d)[4][4], uint64_t a, uint64_t b) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n32k16.f32." PTX "." PTX " {" \
                   "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
                   "}, %16, %17, p, 1, 1, 0, %19;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
                     "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
                     "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]) \
                   : "l"(a), "l"(b), "r"(1), "n"(TB)); \
    } \
  };

#define HL_WGMMA_64(T, PTX)  /* PTX: the input type's name in PTX */ \
  template <int TB> \
  struct Wgmma<T, 64, TB> { \
    static __device__ __forceinline__ void run(float (&d)[8][4], uint64_t a, uint64_t b) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " {" \
                   "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18," \
                   "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
                   "}, %32, %33, p, 1, 1, 0, %35;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
                     "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
                     "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
                     "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
                     "+f"(d[7][2]), "+f"(d[7][3]) \
                   : "l"(a), "l"(b), "r"(1), "n"(TB)); \
    } \
  };

#define HL_WGMMA_128(T, PTX)  /* PTX: the input type's name in PTX */ \
  template <int TB> \
  struct Wgmma<T, 128, TB> { \
    static __device__ __forceinline__ void run(float (&d)[16][4], uint64_t a, uint64_t b) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " {" \
                   "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18," \
                   "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35," \
                   "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52," \
                   "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
                   "}, %64, %65, p, 1, 1, 0, %67;\n}\n" \
                   : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
                     "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
                     "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
                     "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
                     "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
                     "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), \
                     "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
                     "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), \
                     "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
                     "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
                   : "l"(a), "l"(b), "r"(1), "n"(TB)); \
    } \
  };

HL_WGMMA_32(__nv_bfloat16, "bf16")
HL_WGMMA_32(__half, "f16")
HL_WGMMA_64(__nv_bfloat16, "bf16")
HL_WGMMA_64(__half, "f16")
HL_WGMMA_128(__nv_bfloat16, "bf16")
HL_WGMMA_128(__half, "f16")
#undef HL_WGMMA_32
#undef HL_WGMMA_64
#undef HL_WGMMA_128

}  // namespace hl::dev
