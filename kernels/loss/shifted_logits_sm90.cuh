// The fused linear form's first product with the loss's element work in its epilogue (sm_90a):
// for logits z = X W^T (X [M, K], W [N, K], bf16, fp32 accumulation) it stores
//   E[r, v] = exp(z_hat - shift_r)  (bf16, rounded once from fp32; z_hat = scale z)
// and for each row r and 256-column tile t the statistics of its columns, in fp32 before rounding:
//   s = sum e, b = sum e (z_hat - shift_r), m = max z_hat, amax = the first column where z_hat = m.
// With one shift per row over the whole vocabulary, the loss's gradient G = p cp + [v = y] cy
// (row_math.h's form without entropy, smoothing or distillation) is diag(alpha) E with alpha_r =
// cp exp(shift_r - lse_r) once the label's element is patched, so dX and dW run as plain products
// on E (bench/notes/linear.md "Fused linear + loss"). The logits themselves are never stored.
//
// Persistent CTAs of 384 threads over 128 x 256 tiles, M fastest within groups of row blocks whose X
// stays in L2 while the group runs over W (so a wave shares W's tiles, and X is read from memory once);
// warp 0 loads X (128 x 64) and W (256 x 64) k-blocks by TMA into a ring of 3 stages; two consumer
// warpgroups run m64n256k16 wgmma on 64 rows each. Each tile's e are packed to bf16 in registers
// and stored (shared-memory staging tile, TMA) during the next tile's first k-block, so the store
// runs beside the tensor cores.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common/bulk_copy.cuh"
#include "common/fast_math.cuh"
#include "common/sm90/wgmma.cuh"

namespace hl::loss::dev::sm90 {

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 3;
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
constexpr int kThreads = 384;  // the producer warpgroup and two consumer warpgroups
// The ring, the staging tile (64 KB), the barriers; 1 KB to align the ring (128-byte swizzle).
constexpr int kOutOff = kStages * kStageBytes, kBarOff = kOutOff + kBM * kBN * 2;
constexpr size_t kSmem = size_t(kBarOff) + 256 + 1024;

// A row's statistics over one tile's columns (16 bytes).
struct TileStats {
  float s, b, m;
  int amax;  // a column of the shard
};

struct ShiftedParams {
  CUtensorMap x, w;  // X [M][K] in 64 x 128 boxes, W [N][K] in 64 x 256 boxes (K-major, 128-byte swizzle)
  CUtensorMap e;     // E [M][N] in 64 x 64 boxes (TMA stores), with store_e
  const float *shift;          // [M]; null: every row's is kFirstShift
  TileStats *stats;            // [M][tiles_n]
  const unsigned char *redo;   // null: every tile; else only the row blocks b (of kBM rows) with redo[b]
  float scale;                 // z_hat = scale z, scale > 0
  int M, N, K, tiles_m, tiles_n;
  int group_m;  // tiles run in groups of this many row blocks, each group over every column tile
  int store_e;  // 0: the statistics alone (a call without gradient has no use for E)
};

// The first pass's shift; rows whose max z_hat - shift falls outside [kLowest, kHighest] run again
// with their max as the shift. Inside, the largest e stays a normal number however far below the
// max an element is of interest (e^-64), sum e stays finite for any vocabulary (e^48 2^31), and
// alpha_r (>= cp e^-(48 + log V)) keeps alpha X normal in bf16.
constexpr float kFirstShift = 16.0f, kLowest = -64.0f, kHighest = 48.0f;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HL_SHIFTED_LOGITS_CODE 1
#else
#define HL_SHIFTED_LOGITS_CODE 0
#endif

// The 128 accumulator operands of an m64n256 wgmma (its asm list and constraints, for d[32][4]).
#define HL_ACC_LIST \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, " \
  "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
  "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, " \
  "%106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, " \
  "%124, %125, %126, %127}"
#define HL_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define HL_ACC_OUT \
  HL_D4(0), HL_D4(1), HL_D4(2), HL_D4(3), HL_D4(4), HL_D4(5), HL_D4(6), HL_D4(7), HL_D4(8), HL_D4(9), HL_D4(10), \
  HL_D4(11), HL_D4(12), HL_D4(13), HL_D4(14), HL_D4(15), HL_D4(16), HL_D4(17), HL_D4(18), HL_D4(19), HL_D4(20), \
  HL_D4(21), HL_D4(22), HL_D4(23), HL_D4(24), HL_D4(25), HL_D4(26), HL_D4(27), HL_D4(28), HL_D4(29), HL_D4(30), \
  HL_D4(31)

#if HL_SHIFTED_LOGITS_CODE
// D[64 x 256] (+)= A[64 x 16] B[16 x 256], both K-major in shared memory; scale_d 0: D = A B.
__device__ __forceinline__ void wgmma_m64n256(float (&d)[32][4], uint64_t a, uint64_t b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" HL_ACC_LIST ", %128, %129, p, 1, 1, 0, 0;\n}\n"
      : HL_ACC_OUT
      : "l"(a), "l"(b), "r"(scale_d));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t *>(&h);
}

// One warp's part of a tile's epilogue: rows r0 and r0 + 8 of the tile (this lane's), columns
// n0 + 8 j + 2 (lane % 4) + {0, 1}. e into pk (bf16 pairs), the rows' statistics over the tile's
// columns below N (EDGE: the last tile, partial) into P.stats by the quad's first lane.
template <bool EDGE>
__device__ __forceinline__ void shifted_epilogue(const ShiftedParams &P, const float (&acc)[32][4],
                                                 uint32_t (&pk)[2][32], int r0, int n0, int tile_n,
                                                 const float (&shift2)[2], int lane) {
  constexpr float kLn2 = 0.6931471805599453f;
  const float k2 = P.scale * 1.4426950408889634f;  // z to log2 units
  const int c0 = n0 + 2 * (lane % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float s = 0.f, b = 0.f, mx = -INFINITY;
    int ai = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      float e2[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float z = acc[j][2 * h + q], t = fmaf(z, k2, -shift2[h]);  // log2(e)
        e2[q] = hl::dev::ex2(t);
        if (!EDGE || c0 + 8 * j + q < P.N) {
          s += e2[q], b = fmaf(e2[q], t, b);
          if (z > mx) mx = z, ai = 8 * j + q;  // columns ascend: the first maximum stays
        }
      }
      pk[h][j] = pack_bf16x2(e2[0], e2[1]);
    }
    // The quad's four lanes hold the row's 256 columns: sums, and the max with its first column.
    if (ai != 0x7fffffff) ai += 2 * (lane % 4);
#pragma unroll
    for (int o = 1; o < 4; o *= 2) {
      s += __shfl_xor_sync(0xffffffffu, s, o), b += __shfl_xor_sync(0xffffffffu, b, o);
      const float m2 = __shfl_xor_sync(0xffffffffu, mx, o);
      const int a2 = __shfl_xor_sync(0xffffffffu, ai, o);
      if (m2 > mx || (m2 == mx && a2 < ai)) mx = m2, ai = a2;
    }
    const int r = r0 + 8 * h;
    if (lane % 4 == 0 && r < P.M)
      P.stats[int64_t(r) * P.tiles_n + tile_n] = TileStats{s, b * kLn2, mx * P.scale, n0 + ai};
  }
}

// This warpgroup's 64 rows of e into its half of the staging tile (four 64 x 64 boxes, 128-byte
// swizzle: row r's 16-byte chunk j at j ^ (r % 8), conflict-free), then one thread stores them by
// TMA. m0: the warpgroup's first row.
__device__ __forceinline__ void store_tile(const ShiftedParams &P, const uint32_t (&pk)[2][32], int m0, int n0,
                                           unsigned char *staging, int lane) {
  const int wg = (int(threadIdx.x) - 128) / 128, wt = threadIdx.x % 128, row0 = 16 * (wt / 32) + lane / 4;
  unsigned char *tile = staging + wg * (kBM / 2) * kBN * 2;
  if (wt == 0) hl::dev::bulk_wait_all<true>();  // the previous tile's stores have read the staging tile
  hl::dev::named_barrier(1 + wg, 128);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<uint32_t *>(tile + (j / 8) * 8192 + (row0 + 8 * h) * 128 + ((j % 8) ^ (lane / 4)) * 16 +
                                    (lane % 4) * 4) = pk[h][j];
  hl::dev::fence_proxy_async();
  hl::dev::named_barrier(1 + wg, 128);
  if (wt == 0) {
    for (int b = 0; b < 4; ++b) hl::dev::tma_store_3d(&P.e, tile + b * 8192, n0 + 64 * b, m0, 0);
    hl::dev::bulk_commit();
  }
}
#endif  // HL_SHIFTED_LOGITS_CODE

__global__ void __launch_bounds__(kThreads, 1) shifted_logits_kernel(const __grid_constant__ ShiftedParams P) {
#if HL_SHIFTED_LOGITS_CODE
  using namespace hl::dev;
  extern __shared__ unsigned char smem_raw[];
  unsigned char *sm = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  // full: the stage's bytes landed; empty: the 8 consumer warps are done with it
  uint64_t *full = reinterpret_cast<uint64_t *>(sm + kBarOff), *empty = full + kStages;
  const int warp = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;
  if (threadIdx.x == 0)
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 8);
  __syncthreads();
  const int kblocks = (P.K + kBK - 1) / kBK;
  const int64_t units = int64_t(P.tiles_m) * P.tiles_n;
  const auto tile_of = [&](int64_t t) {  // (row block, column tile) of work item t
    const int64_t per_group = int64_t(P.group_m) * P.tiles_n, g = t / per_group, i = t % per_group;
    const int gm = min(P.group_m, P.tiles_m - int(g) * P.group_m);
    return make_int2(int(g) * P.group_m + int(i % gm), int(i / gm));
  };
  const auto skip = [&](int2 mn) { return P.redo && !P.redo[mn.x]; };
  if (warp < 4) {
    // 40 + 2 x 232 registers a thread fit the launch's 384 x 168.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (warp == 0 && lane == 0) {
      uint32_t it = 0;  // k-blocks issued
      for (int64_t t = blockIdx.x; t < units; t += gridDim.x) {
        const int2 mn = tile_of(t);
        if (skip(mn)) continue;
        const int m0 = mn.x * kBM, n0 = mn.y * kBN;
        for (int kb = 0; kb < kblocks; ++kb, ++it) {
          const uint32_t s = it % kStages;
          if (it >= kStages) mbar_wait(&empty[s], (it / kStages - 1) & 1);
          unsigned char *a = sm + s * kStageBytes;
          mbar_expect_tx(&full[s], kStageBytes);
          tma_load_3d(a, &P.x, kb * kBK, m0, 0, &full[s]);
          tma_load_3d(a + kABytes, &P.w, kb * kBK, n0, 0, &full[s]);
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int wg = warp / 4 - 1, m_off = 64 * wg + 16 * (warp % 4);  // this warp's rows in the tile
    constexpr float kLog2e = 1.4426950408889634f;
    uint32_t it = 0;  // k-blocks consumed
    float acc[32][4];
    uint32_t pk[2][32];  // the previous tile's e, stored during this tile's first k-block
    int pend_m0 = -1, pend_n0 = 0;
    for (int64_t t = blockIdx.x; t < units; t += gridDim.x) {
      const int2 mn = tile_of(t);
      if (skip(mn)) continue;
      const int tile_m = mn.x, tile_n = mn.y;
      const int r0 = tile_m * kBM + m_off + lane / 4, n0 = tile_n * kBN;
      float shift2[2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
        shift2[h] = (P.shift && r0 + 8 * h < P.M ? __ldg(P.shift + r0 + 8 * h) : kFirstShift) * kLog2e;
      // One k-block: its products issued, then (the first) the previous tile's e stored beside them,
      // then the k-block before it waited for and its stage released.
      uint32_t prev = 0;
      const auto kblock = [&](int kb, bool store) {
        const uint32_t s = it % kStages;
        mbar_wait(&full[s], (it / kStages) & 1);
        const unsigned char *a = sm + s * kStageBytes;
        wgmma_fence();
        const uint64_t da = wgmma_desc(a + wg * 64 * 128), db = wgmma_desc(a + kABytes);
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) wgmma_m64n256(acc, da + 2 * kk, db + 2 * kk, kb > 0 || kk > 0);
        wgmma_commit();
        if (store) store_tile(P, pk, pend_m0, pend_n0, sm + kOutOff, lane);
        wgmma_wait<1>();
        if (kb > 0) {
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[prev]);
        }
        prev = s, ++it;
      };
      kblock(0, P.store_e && pend_m0 >= 0);
      for (int kb = 1; kb < kblocks; ++kb) kblock(kb, false);
      wgmma_wait<0>();
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[prev]);
      wgmma_pin(acc);
      if (n0 + kBN <= P.N) shifted_epilogue<false>(P, acc, pk, r0, n0, tile_n, shift2, lane);
      else shifted_epilogue<true>(P, acc, pk, r0, n0, tile_n, shift2, lane);
      pend_m0 = tile_m * kBM + 64 * wg, pend_n0 = n0;
    }
    if (P.store_e && pend_m0 >= 0) store_tile(P, pk, pend_m0, pend_n0, sm + kOutOff, lane);
    if (threadIdx.x % 128 == 0) bulk_wait_all<false>();  // the stores done before the CTA ends
  }
#endif
}

}  // namespace hl::loss::dev::sm90
