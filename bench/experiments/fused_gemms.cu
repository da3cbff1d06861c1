// Experiment for #28: the products of the fused linear + loss plan as our own TMA + wgmma kernels, each timed
// beside cuBLASLt's product of the same shapes in the same run (bench/notes/linear.md "Fused linear + loss": the loss
// inside the products is what reaches under 1.05x at 4096 x 2048 x 262144; tables in
// bench/results/fused_gemms_h100.md). bf16 operands, fp32 accumulation, bf16 outputs.
// - forward, logits = X W^T (X [M, K], W [N, K] row-major), three forms: the logits alone (MODE 0); with each
//   256-column tile's row statistics, max and sum of exp, from the epilogue (1); and e = exp(z - tile max)
//   stored instead of z (2), the operand the backward reads. Also on clusters of two CTAs sharing B by TMA
//   multicast, and without an epilogue (a diagnostic: the products alone).
// - dX = G W with G = e F (MODE 3): e [M, V] as MODE 2 stores it, F a factor per (row, 256-wide tile of V) (the
//   loss's exp(m_t - lse_r) and scale), W [V, H] (the B operand, N-major).
// - dW = G^T X (MODE 4): e [c, V] as the M-major A operand (vocabulary rows, token columns), F per (token,
//   tile of V), X [c, H].
//   Both form G in registers: ldmatrix of e, times F in fp32, rounded once to bf16 as G materialised would be,
//   and wgmma with A from registers; cuBLAS runs the same product on G materialised.
// - shifted: the library's forward for the shifted path (loss/shifted_logits_sm90.cuh: e = exp(z - shift), one
//   shift a row, and tile statistics), and cuBLASLt's dX (fp32 output) and dW on its e: what the plan runs.
//
// Design: persistent CTAs of 384 threads over 128 x 256 output tiles (forward M fastest, so a wave shares B's
// tiles in L2; dX, dW N fastest, so an A block's N tiles run together); warp 0 loads A (128 x 64) and B (64 x
// 256) k-blocks by TMA into a ring of 3 stages; two consumer warpgroups run m64n256k16 wgmma on 64 rows each
// and write the tile into a shared-memory staging tile that TMA stores while they go on.
//
// On the device (-DFG_DEBUG: a hung launch prints where each warp waits, then exits):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Ikernels -Iinclude -o /tmp/fused_gemms bench/experiments/fused_gemms.cu -lcublasLt -lcuda
//   timeout 300 /tmp/fused_gemms      # each product at c x V x H = 4096 x 262144 x 2048 and 4096 x 128256 x 4096
//   /tmp/fused_gemms [fwd M N K | dx c V H | dw c V H | shifted M N K] ...   # N, H, K multiples of 8; V of 256; dw: c of 64
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include <unistd.h>

#include "common/bulk_copy.cuh"
#include "common/sm90/wgmma.cuh"
#include "gdn/mma.cuh"
#include "loss/shifted_logits_sm90.cuh"

using namespace hl::dev;
using hl::dev::wgmma_commit;
using hl::dev::wgmma_desc;
using hl::dev::wgmma_desc_n_major;
using hl::dev::wgmma_fence;
using hl::dev::wgmma_pin;
using hl::dev::wgmma_wait;

static void fail_if(bool bad, const char *call, const char *file, int line, const char *why) {
  if (bad) std::fprintf(stderr, "%s:%d %s: %s\n", file, line, call, why), std::exit(1);
}
#define CK(x)                                                                   \
  do {                                                                          \
    const cudaError_t e_ = (x);                                                 \
    fail_if(e_ != cudaSuccess, #x, __FILE__, __LINE__, cudaGetErrorString(e_)); \
  } while (0)
#define CKL(x) fail_if((x) != CUBLAS_STATUS_SUCCESS, #x, __FILE__, __LINE__, "cuBLASLt failed")

namespace {

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 3, kStatTile = 256;
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;  // 16 + 32 KB
constexpr int kThreads = 384;                                                                       // producer + 2 WGs
// The ring, then the output tile staged for TMA stores (64 KB), the barriers, and (dW) 64 factors a stage.
constexpr int kOutOff = kStages * kStageBytes, kBarOff = kOutOff + kBM * kBN * 2, kFactorOff = kBarOff + 256;
constexpr size_t kSmem = size_t(kFactorOff) + kStages * 256 + 1024;

struct Params {
  // A: [M][K] in 64 x 128 boxes (K-major); dW: e [K = c][M = V] in 64 x 64 boxes (M-major, two a stage).
  // B: forward W [N][K] in 64 x 256 boxes (K-major); dX W [K = V][N = H], dW X [K = c][N = H] in 64 x 64
  // boxes (N-major, four a stage). 128-byte swizzle.
  CUtensorMap a, b, b_half;  // b_half (CL = 2): B in boxes of half its rows
  CUtensorMap o;             // the output [M][N] in 64 x 64 boxes (TMA stores)
  float2 *stats;             // forward: [M][tiles_n], (max, sum exp(z - max)) of row m over tile n's columns
  // G = e times a factor per (token, 256-wide tile of V): dX [M][K / 256]; dW transposed, [M / 256][K] (the
  // 64 of a k-block contiguous)
  const float *factor;
  int M, N, K, tiles_m, tiles_n;
  int units;       // work items: tiles, or (CL = 2) pairs of M-adjacent tiles, one a CTA of the cluster
  bool n_fastest;  // tile order (dX, dW: the N tiles of an A block together, so A comes from memory once)
};

// HL_ACC_LIST / HL_ACC_OUT (the accumulator operands of an m64n256 wgmma): loss/shifted_logits_sm90.cuh.

// D[64 x 256] (+)= A[64 x 16] B[16 x 256], operands in shared memory (descriptors: K-major, or M- / N-major
// where TA / TB = 1); scale_d 0: D = A B.
template <int TA, int TB>
__device__ __forceinline__ void wgmma256(float (&d)[32][4], uint64_t a, uint64_t b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      HL_ACC_LIST ", %128, %129, p, 1, 1, %131, %132;\n}\n"
      : HL_ACC_OUT
      : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB));
}

// -DFG_DEBUG: every wait first records (tag, k-block count) in host-mapped memory, a word per (CTA, warp), so
// a hung launch says where each warp waits (the host polls with a deadline: Launcher).
#ifdef FG_DEBUG
__device__ unsigned *g_diag;
#endif
__device__ __forceinline__ void wait_at(uint64_t *bar, uint32_t parity, unsigned tag, uint32_t it) {
#ifdef FG_DEBUG
  if (threadIdx.x % 32 == 0)
    *(volatile unsigned *)(g_diag + blockIdx.x * 12 + threadIdx.x / 32) = tag << 28 | (it & 0xfffffff);
#endif
  mbar_wait(bar, parity);
}

// tma_load_3d into this CTA's and its cluster peers' shared memory at dst's offset (ranks in mask), each
// completing its bytes on its own barrier at bar's offset.
__device__ __forceinline__ void tma_load_3d_multicast(void *dst, const void *map, int c0, int c1, int c2, uint64_t *bar,
                                                      uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], "
      "[%1, {%2, %3, %4}], [%5], %6;" ::"r"(smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar)), "h"(mask)
      : "memory");
}

// wgmma256 with A from registers (a: this thread's m64k16 fragment, the mma.sync A layout of its warp's 16
// rows); B N-major. The registers must not change until the wgmma has completed.
__device__ __forceinline__ void wgmma256_rs(float (&d)[32][4], const uint32_t (&a)[4], uint64_t b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      HL_ACC_LIST ", {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : HL_ACC_OUT
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

// x (two bf16) times (f.x, f.y), in fp32, rounded once.
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t x, float2 f) {
  __nv_bfloat162 h;
  std::memcpy(&h, &x, 4);
  const float2 v = __bfloat1622float2(h);
  h = __floats2bfloat162_rn(v.x * f.x, v.y * f.y);
  std::memcpy(&x, &h, 4);
  return x;
}


// The epilogue of one warp's 16 rows (m0..) of tile columns n0..n0 + 255 (EDGE: a partial last tile, whose
// columns from N on are TMA's zeros). MODE 0: the logits rounded to bf16, stored; 1: also their max and sum of
// exp per row (of the rounded logits); 2: the statistics of the fp32 logits, and e = exp(z - max) stored in
// place of z (what the backward products would read: bench/notes/linear.md "Where G can be formed"). MODE 3, 4: dX, dW
// stored as they are.
template <int MODE, bool EDGE>
__device__ __forceinline__ void epilogue(const Params &P, float (&acc)[32][4], int m0, int n0, int tile_n,
                                         int lane, unsigned char *staging) {
  const int r = m0 + lane / 4, c = n0 + 2 * (lane % 4);
  const auto in = [&](int j, int e) { return !EDGE || c + 8 * j + e % 2 < P.N; };
  if constexpr (MODE == 1) {  // the statistics of the logits as stored
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = __bfloat162float(__float2bfloat16(acc[j][e]));
  }
  if constexpr (MODE == 1 || MODE == 2) {
    constexpr float kLog2e = 1.4426950408889634f;
    float mx[2] = {-INFINITY, -INFINITY}, s[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (in(j, e)) mx[e / 2] = fmaxf(mx[e / 2], acc[j][e]);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int o = 1; o < 4; o *= 2) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], o));
    const float base[2] = {mx[0] * kLog2e, mx[1] * kLog2e};
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = exp2f(fmaf(acc[j][e], kLog2e, -base[e / 2]));
        if (in(j, e)) s[e / 2] += x;
        if (MODE == 2) acc[j][e] = x;
      }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int o = 1; o < 4; o *= 2) s[h] += __shfl_xor_sync(0xffffffffu, s[h], o);
    if (lane % 4 == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (r + 8 * h < P.M) P.stats[int64_t(r + 8 * h) * P.tiles_n + tile_n] = make_float2(mx[h], s[h]);
    }
  }
  {
    // This warpgroup's 64 rows into its staging tile (four 64 x 64 boxes, 128-byte swizzle: row r's
    // 16-byte chunk j at j ^ (r % 8), conflict-free), then one thread stores them by TMA, which clips the
    // rows and columns outside the tensor. The consumers go on to the next tile while the stores drain.
    const int wg = (int(threadIdx.x) - 128) / 128, wt = threadIdx.x % 128, row0 = 16 * (wt / 32) + lane / 4;
    unsigned char *tile = staging + wg * (kBM / 2) * kBN * 2;
    if (wt == 0) bulk_wait_all<true>();  // the previous tile's stores have read the staging tile
    named_barrier(1 + wg, 128);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<__nv_bfloat162 *>(tile + (j / 8) * 8192 + (row0 + 8 * h) * 128 +
                                            ((j % 8) ^ (lane / 4)) * 16 + (lane % 4) * 4) =
            __floats2bfloat162_rn(acc[j][2 * h], acc[j][2 * h + 1]);
    fence_proxy_async();
    named_barrier(1 + wg, 128);
    if (wt == 0) {
      for (int b = 0; b < 4; ++b) tma_store_3d(&P.o, tile + b * 8192, n0 + 64 * b, m0, 0);  // m0: warp 0 of the WG
      bulk_commit();
    }
  }
}

// CL = 2 (forward only): clusters of two CTAs on M-adjacent tiles of one N tile; each loads its A and half
// of B, the B half multicast to both, so a CTA pulls 32 of its 48 KB a k-block from L2. Each stage's
// empty barrier then counts both CTAs' consumer warps (the peer's copies write into this CTA's stage).
template <int MODE, int CL>
__global__ void __launch_bounds__(kThreads, 1) fused_gemm(const __grid_constant__ Params P) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char *sm = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  // full: the stage's TMA bytes landed; empty: the consumers are done with it
  uint64_t *full = reinterpret_cast<uint64_t *>(sm + kBarOff), *empty = full + kStages;
  const int warp = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 8 * CL);
  }
  if constexpr (CL > 1) cluster_barrier();  // the peer's barriers are initialised before any copy signals them
  else __syncthreads();
  const uint32_t rank = cluster_rank();
  const int kblocks = (P.K + kBK - 1) / kBK, first = blockIdx.x / CL, step = gridDim.x / CL;
  const auto tile_mn = [&](int t) {  // (tile of M, tile of N) of work item t
    if constexpr (CL > 1) {
      const int pairs_m = (P.tiles_m + 1) / 2;
      return make_int2(t % pairs_m * 2 + int(rank), t / pairs_m);
    }
    return P.n_fastest ? make_int2(t / P.tiles_n, t % P.tiles_n) : make_int2(t % P.tiles_m, t / P.tiles_m);
  };
  if (warp < 4) {  // producer warpgroup: warp 0 lane 0 issues every load
    // registers a thread: 40 + 2 x 232, the launch's 384 x 168 (more, and a consumer warp waits in
    // setmaxnreg.inc forever: measured, 64 + 2 x 224 hung)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (warp == 0 && lane == 0) {
      uint32_t it = 0;  // k-blocks issued
      for (int t = first; t < P.units; t += step) {
        const int m0 = tile_mn(t).x * kBM, n0 = tile_mn(t).y * kBN;
        for (int kb = 0; kb < kblocks; ++kb, ++it) {
          const uint32_t s = it % kStages;
          if (it >= kStages) wait_at(&empty[s], (it / kStages - 1) & 1, 1, it);
          unsigned char *a = sm + s * kStageBytes;
          mbar_expect_tx(&full[s], kStageBytes + (MODE == 4 ? 256 : 0));
          if constexpr (MODE == 4) {  // e [c][V]: two 64 x 64 boxes side by side along V; the k-block's factors
            bulk_copy(sm + kFactorOff + s * 256, P.factor + int64_t(m0 / kStatTile) * P.K + kb * kBK, 256, &full[s]);
            for (int i = 0; i < kBM / 64; ++i) tma_load_3d(a + i * 8192, &P.a, m0 + 64 * i, kb * kBK, 0, &full[s]);
          } else {
            tma_load_3d(a, &P.a, kb * kBK, m0, 0, &full[s]);
          }
          if constexpr (MODE >= 3) {  // W [V][H] or X [c][H]: four 64 x 64 boxes side by side along H
            for (int i = 0; i < kBN / 64; ++i)
              tma_load_3d(a + kABytes + i * 8192, &P.b, n0 + 64 * i, kb * kBK, 0, &full[s]);
          } else if constexpr (CL > 1) {
            tma_load_3d_multicast(a + kABytes + rank * (kBBytes / 2), &P.b_half, kb * kBK, n0 + rank * (kBN / 2), 0,
                                  &full[s], 0x3);
          } else {
            tma_load_3d(a + kABytes, &P.b, kb * kBK, n0, 0, &full[s]);
          }
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int wg = warp / 4 - 1, m_off = 64 * wg + 16 * (warp % 4);  // this warp's rows in the tile
    uint32_t it = 0;  // k-blocks consumed
    float acc[32][4];
    uint32_t frag[2][4][4];  // dX, dW: A fragments, two sets
    const auto release = [&](uint32_t s) {  // this warp is done with stage s (in every CTA that fills it)
      mbar_arrive(&empty[s]);
      if constexpr (CL > 1) mbar_arrive_peer(&empty[s], rank ^ 1);
    };
    for (int t = first; t < P.units; t += step) {
      const int tile_m = tile_mn(t).x, tile_n = tile_mn(t).y;
      if constexpr (MODE >= 3) {
        // dX, dW: G = e F formed in registers. A k-block's e fragments (ldmatrix; dW: .trans of the M-major
        // tile, which gives the K-major fragment) times their factors, in fp32, rounded once (as G
        // materialised), into one register set while the previous k-block's wgmmas read the other; then
        // wait<0> (waiting with wait<1> instead, ptxas serialises every wgmma: C7513).
        // dX: a factor per row (two a thread) and 256-wide tile of K, loaded a tile ahead. dW: the tile's rows
        // of V lie in one 256-wide tile, so the factor is the token's: four a fragment, from the stage.
        const int rlo = tile_m * kBM + m_off + lane / 4, tiles_k = P.K / kStatTile;
        const auto factor = [&](int r, int tk) {
          return r < P.M && tk < tiles_k ? __ldg(P.factor + int64_t(r) * tiles_k + tk) : 0.f;
        };
        float f[2] = {0.f, 0.f}, fn[2] = {0.f, 0.f};
        if constexpr (MODE == 3) f[0] = factor(rlo, 0), f[1] = factor(rlo + 8, 0), fn[0] = factor(rlo, 1), fn[1] = factor(rlo + 8, 1);
        const auto load = [&](uint32_t (&fr)[4][4], int kb, uint32_t i) {  // k-block kb, the i-th consumed
          const uint32_t s = i % kStages;
          wait_at(&full[s], (i / kStages) & 1, 3, i);
          const unsigned char *a = sm + s * kStageBytes;
          if constexpr (MODE == 3) {
            if (kb % 4 == 0 && kb > 0) {
              f[0] = fn[0], f[1] = fn[1];
              fn[0] = factor(rlo, kb / 4 + 1), fn[1] = factor(rlo + 8, kb / 4 + 1);
            }
            const int r = m_off + lane % 16;  // this lane's ldmatrix row of the tile
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
              hl::gdn::dev::ldsm_x4(fr[kk], a + r * 128 + (((2 * kk + lane / 16) ^ (r % 8)) * 16));
#pragma unroll
              for (int q = 0; q < 4; ++q) fr[kk][q] = scale_bf16x2(fr[kk][q], make_float2(f[q % 2], f[q % 2]));
            }
          } else {
            const float *fs = reinterpret_cast<const float *>(sm + kFactorOff + s * 256);
            const int chunk = 2 * (warp % 4) + (lane / 8) % 2, kq = 2 * (lane % 4);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
              const int k = 16 * kk + lane % 8 + 8 * (lane / 16);  // this lane's token row of the box
              hl::gdn::dev::ldsm_x4_t(fr[kk], a + wg * 8192 + k * 128 + ((chunk ^ (k % 8)) * 16));
              const float2 lo = *reinterpret_cast<const float2 *>(fs + 16 * kk + kq),
                           hi = *reinterpret_cast<const float2 *>(fs + 16 * kk + kq + 8);
              fr[kk][0] = scale_bf16x2(fr[kk][0], lo), fr[kk][1] = scale_bf16x2(fr[kk][1], lo);
              fr[kk][2] = scale_bf16x2(fr[kk][2], hi), fr[kk][3] = scale_bf16x2(fr[kk][3], hi);
            }
          }
        };
        const auto kblock = [&](uint32_t (&fr)[4][4], uint32_t (&next)[4][4], int kb) {
          const uint32_t s = it % kStages;
          wgmma_fence();
          const uint64_t db = wgmma_desc_n_major(sm + s * kStageBytes + kABytes);
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) wgmma256_rs(acc, fr[kk], db + 128 * kk, kb > 0 || kk > 0);
          wgmma_commit();
          if (kb + 1 < kblocks) load(next, kb + 1, it + 1);
          wgmma_wait<0>();
          __syncwarp();
          if (lane == 0) release(s);
          ++it;
        };
        load(frag[0], 0, it);
        for (int kb = 0; kb < kblocks; kb += 2) {
          kblock(frag[0], frag[1], kb);
          if (kb + 1 < kblocks) kblock(frag[1], frag[0], kb + 1);
        }
      } else {
        uint32_t prev = 0;
        for (int kb = 0; kb < kblocks; ++kb, ++it) {
          const uint32_t s = it % kStages;
          wait_at(&full[s], (it / kStages) & 1, 3, it);
          const unsigned char *a = sm + s * kStageBytes;
          wgmma_fence();
          const uint64_t da = wgmma_desc(a + wg * 64 * 128), db = wgmma_desc(a + kABytes);
#pragma unroll
          for (int kk = 0; kk < kBK / 16; ++kk) wgmma256<0, 0>(acc, da + 2 * kk, db + 2 * kk, kb > 0 || kk > 0);
          wgmma_commit();
          wgmma_wait<1>();  // the previous k-block's products are done: its stage goes back to the producer
          if (kb > 0) {
            __syncwarp();
            if (lane == 0) release(prev);
          }
          prev = s;
        }
        wgmma_wait<0>();
        __syncwarp();
        if (lane == 0) release(prev);
      }
      wgmma_pin(acc);  // the epilogue reads the accumulators no earlier
      if constexpr (MODE < 0) continue;  // the products alone (a diagnostic: no epilogue, nothing stored)
      const int m0 = tile_m * kBM + m_off, n0 = tile_n * kBN;
      if (n0 + kBN <= P.N) epilogue<MODE, false>(P, acc, m0, n0, tile_n, lane, sm + kOutOff);
      else epilogue<MODE, true>(P, acc, m0, n0, tile_n, lane, sm + kOutOff);
    }
    if (threadIdx.x % 128 == 0) bulk_wait_all<false>();  // the last stores done before the CTA ends
  }
  // No CTA leaves while its peer may still copy into it or arrive on its barriers.
  if constexpr (CL > 1) cluster_barrier();
}

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  void *p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess) std::exit(1);
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
}

// A row-major [rows][inner] bf16 matrix read in inner-contiguous boxes of 64 x box_rows (3-D, the last of size 1).
void make_map(CUtensorMap *m, const void *base, uint64_t rows, uint64_t inner, uint32_t box_rows) {
  const cuuint64_t dims[3] = {inner, rows, 1}, strides[2] = {inner * 2, inner * rows * 2};
  const cuuint32_t box[3] = {64, box_rows, 1}, step[3] = {1, 1, 1};
  const CUresult r = encoder()(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void *>(base), dims, strides, box,
                               step, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) std::fprintf(stderr, "cuTensorMapEncodeTiled: %d\n", int(r)), std::exit(1);
}

// Uniform in [lo, hi), from a hash of the index (bf16, or fp32 where f is given).
__global__ void fill(__nv_bfloat16 *x, float *f, int64_t n, uint32_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed ^ uint32_t(i >> 32) * 40503u;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    const float v = lo + (hi - lo) * float(h & 0xffffff) / 16777216.f;
    if (f) f[i] = v;
    else x[i] = __float2bfloat16(v);
  }
}

// G = e times the factor of its (row, 256-wide column tile), rounded once to bf16 (what MODE 3 forms).
__global__ void materialise_g(const __nv_bfloat16 *e, const float *factor, __nv_bfloat16 *g, int M, int V) {
  const int64_t n = int64_t(M) * V;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / V;
    const int v = int(i % V);
    g[i] = __float2bfloat16(__bfloat162float(e[i]) * factor[r * (V / kStatTile) + v / kStatTile]);
  }
}

// Sums of (a - b)^2 and b^2 over n elements, one double pair a block (no atomics: summed on the host).
__global__ void diff_norms(const __nv_bfloat16 *a, const __nv_bfloat16 *b, int64_t n, double2 *out) {
  __shared__ double2 red[256];
  double d = 0, r = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    d += (x - y) * (x - y), r += y * y;
  }
  red[threadIdx.x] = make_double2(d, r);
  __syncthreads();
  for (int o = 128; o > 0; o /= 2) {
    if (threadIdx.x < o) red[threadIdx.x].x += red[threadIdx.x + o].x, red[threadIdx.x].y += red[threadIdx.x + o].y;
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = red[0];
}

double rel_diff(const __nv_bfloat16 *a, const __nv_bfloat16 *b, int64_t n) {
  double2 *parts;
  CK(cudaMalloc(&parts, 1024 * sizeof(double2)));
  diff_norms<<<1024, 256>>>(a, b, n, parts);
  std::vector<double2> hp(1024);
  CK(cudaMemcpy(hp.data(), parts, 1024 * sizeof(double2), cudaMemcpyDeviceToHost));
  CK(cudaFree(parts));
  double dd = 0, rr = 0;
  for (const double2 &v : hp) dd += v.x, rr += v.y;
  return std::sqrt(dd / rr);
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Medians of 5 rounds of 10 calls of each function, the functions in turns (the products heat the GPU).
std::vector<float> time_in_turns(const std::vector<std::function<void()>> &fns) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<std::vector<float>> t(fns.size());
  for (int round = 0; round < 5; ++round)
    for (size_t i = 0; i < fns.size(); ++i) {
      CK(cudaEventRecord(e0));
      for (int k = 0; k < 10; ++k) fns[i]();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t[i].push_back(ms / 10);
    }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::vector<float> med;
  for (auto &v : t) med.push_back(median(v));
  return med;
}

// One cuBLASLt product C = op(A) op(B) (column-major, bf16, fp32 accumulation), the heuristic's first algorithm.
struct LtProduct {
  cublasLtHandle_t lt;
  void *ws;
  size_t ws_bytes;
  cublasLtMatmulDesc_t desc{};
  cublasLtMatrixLayout_t la{}, lb{}, lc{};
  cublasLtMatmulAlgo_t algo{};
  LtProduct(cublasLtHandle_t h, void *w, size_t wb, bool ta, bool tb, int m, int n, int k, int lda, int ldb, int ldc,
            bool f32_out = false)
      : lt(h), ws(w), ws_bytes(wb) {
    CKL(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    CKL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
    CKL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
    CKL(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, ta ? k : m, ta ? m : k, lda));
    CKL(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, tb ? n : k, tb ? k : n, ldb));
    CKL(cublasLtMatrixLayoutCreate(&lc, f32_out ? CUDA_R_32F : CUDA_R_16BF, m, n, ldc));
    cublasLtMatmulPreference_t pref;
    CKL(cublasLtMatmulPreferenceCreate(&pref));
    CKL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                             sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t heur{};
    int found = 0;
    CKL(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &heur, &found));
    fail_if(!found, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__, "no algorithm");
    algo = heur.algo;
    cublasLtMatmulPreferenceDestroy(pref);
  }
  LtProduct(const LtProduct &) = delete;  // owns its descriptors
  ~LtProduct() {
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
  }
  void operator()(const void *a, const void *b, void *c) const {
    const float one = 1.f, zero = 0.f;
    CKL(cublasLtMatmul(lt, desc, &one, a, la, b, lb, &zero, c, lc, c, lc, &algo, ws, ws_bytes, 0));
  }
};

// Modes 0-4 on single CTAs; 5-7: modes 0-2 on clusters of two (B multicast); 8, 9: the forward's products
// without an epilogue, single CTAs and clusters.
struct Launcher {
  Params p{};
  int sms = 0, grid = 0, grid2 = 0;
  cudaLaunchAttribute cluster{};  // what config's answer points to
  explicit Launcher(int M, int N, int K) {
    p.M = M, p.N = N, p.K = K, p.tiles_m = (M + kBM - 1) / kBM, p.tiles_n = (N + kBN - 1) / kBN;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    grid = std::min(sms, p.tiles_m * p.tiles_n);
    for (int mode = 0; mode < 10; ++mode)
      CK(cudaFuncSetAttribute(kernel(mode), cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
    cudaLaunchConfig_t cfg = config(5, 2 * sms);
    int clusters = 0;
    CK(cudaOccupancyMaxActiveClusters(&clusters, kernel(5), &cfg));
    grid2 = 2 * std::min(clusters, (p.tiles_m + 1) / 2 * p.tiles_n);
  }
  static void (*kernel(int mode))(Params) {
    void (*const k[])(Params) = {fused_gemm<0, 1>, fused_gemm<1, 1>, fused_gemm<2, 1>, fused_gemm<3, 1>,
                                 fused_gemm<4, 1>, fused_gemm<0, 2>, fused_gemm<1, 2>, fused_gemm<2, 2>,
                                 fused_gemm<-1, 1>, fused_gemm<-1, 2>};
    return k[mode];
  }
  static bool clustered(int mode) { return (mode >= 5 && mode <= 7) || mode == 9; }
  cudaLaunchConfig_t config(int mode, int blocks) {
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = clustered(mode) ? 2 : 1, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(blocks), cfg.blockDim = dim3(kThreads), cfg.dynamicSmemBytes = kSmem;
    cfg.attrs = &cluster, cfg.numAttrs = 1;
    return cfg;
  }
  void operator()(int mode) {
#ifdef FG_DEBUG
    static unsigned *diag = nullptr;
    if (!diag) {
      CK(cudaHostAlloc(&diag, size_t(sms) * 12 * 4, cudaHostAllocMapped));  // a word a warp; grid <= sms
      std::memset(diag, 0, size_t(sms) * 12 * 4);
      unsigned *dev;
      CK(cudaHostGetDevicePointer(&dev, diag, 0));
      CK(cudaMemcpyToSymbol(g_diag, &dev, sizeof dev));
    }
#endif
    p.units = clustered(mode) ? (p.tiles_m + 1) / 2 * p.tiles_n : p.tiles_m * p.tiles_n;
    const cudaLaunchConfig_t cfg = config(mode, clustered(mode) ? grid2 : grid);
    CK(cudaLaunchKernelEx(&cfg, kernel(mode), p));
#ifdef FG_DEBUG
    for (int ms = 0; cudaStreamQuery(0) == cudaErrorNotReady; ++ms) {
      if (ms == 10000) {
        std::printf("mode %d hung; (tag, k-block) a warp, CTAs 0-3 and the last:\n", mode);
        for (int b : {0, 1, 2, 3, grid - 1}) {
          std::printf("CTA %d:", b);
          for (int w = 0; w < 12; ++w) std::printf(" %u/%u", diag[b * 12 + w] >> 28, diag[b * 12 + w] & 0xfffffff);
          std::printf("\n");
        }
        std::fflush(stdout);
        std::_Exit(3);
      }
      usleep(1000);
    }
#endif
  }
};

const char *kTableHead =
    "| product, M x N x K | cuBLASLt | ours | ours / cuBLAS | ours vs cuBLAS (rel. norm) | other checks |\n"
    "|---|---|---|---|---|---|\n";

void print_row(const char *what, int M, int N, int K, float t_cublas, float t_ours, double err, const char *more) {
  const double tf = 2.0 * M * N * K / 1e9;
  std::printf("| %s, %d x %d x %d | %.3f ms (%.0f TF/s) | %.3f ms (%.0f) | %.3fx | %.1e | %s |\n", what, M, N, K,
              t_cublas, tf / t_cublas, t_ours, tf / t_ours, t_ours / t_cublas, err, more);
}

// The forward product, three forms. Checks: mode 1's logits against cuBLAS's (both fp32 sums rounded once to
// bf16), its statistics of sampled rows against fp64 ones of its own stored logits; mode 2's e against
// exp(cuBLAS's logit - its max) (absolute: e <= 1; cuBLAS's bf16 rounding alone moves it by up to |z| 2^-9),
// and its tile sums against its statistics (e's own rounding).
void run_forward(int M, int N, int K, cublasLtHandle_t lt, void *ws, size_t ws_bytes) {
  __nv_bfloat16 *x, *w, *out, *ref;
  Launcher run(M, N, K);
  const int tiles_n = run.p.tiles_n;
  CK(cudaMalloc(&x, size_t(M) * K * 2));
  CK(cudaMalloc(&w, size_t(N) * K * 2));
  CK(cudaMalloc(&out, size_t(M) * N * 2));
  CK(cudaMalloc(&ref, size_t(M) * N * 2));
  CK(cudaMalloc(&run.p.stats, size_t(M) * tiles_n * sizeof(float2)));
  // logits of a realistic spread (sd ~3): x ~ U(-1, 1), w ~ U(-9 / sqrt(K), 9 / sqrt(K))
  fill<<<1024, 256>>>(x, nullptr, int64_t(M) * K, 1u, -1.f, 1.f);
  fill<<<1024, 256>>>(w, nullptr, int64_t(N) * K, 2u, -9.f / std::sqrt(float(K)), 9.f / std::sqrt(float(K)));
  CK(cudaMemset(out, 0xff, size_t(M) * N * 2));  // poisoned (NaN): an unwritten element fails the comparison
  CK(cudaGetLastError());
  make_map(&run.p.a, x, M, K, kBM);
  make_map(&run.p.b, w, N, K, kBN);
  make_map(&run.p.b_half, w, N, K, kBN / 2);
  make_map(&run.p.o, out, M, N, 64);
  // ref [M][N] row-major = (W [N][K] . X^T) column-major
  const LtProduct cublas(lt, ws, ws_bytes, true, false, N, M, K, K, K, N);

  run(1);
  cublas(w, x, ref);
  CK(cudaDeviceSynchronize());
  const double err = rel_diff(out, ref, int64_t(M) * N);
  const int rows[] = {0, 1, M / 3, M / 2 + 7, M - 1};
  std::vector<__nv_bfloat16> z(N), zr(N);
  std::vector<float2> st(tiles_n);
  const auto fetch = [&](std::vector<__nv_bfloat16> &v, const __nv_bfloat16 *src, int m) {
    CK(cudaMemcpy(v.data(), src + int64_t(m) * N, size_t(N) * 2, cudaMemcpyDeviceToHost));
  };
  const auto fetch_stats = [&](int m) {
    CK(cudaMemcpy(st.data(), run.p.stats + int64_t(m) * tiles_n, tiles_n * sizeof(float2), cudaMemcpyDeviceToHost));
  };
  const auto f = [](__nv_bfloat16 v) { return double(__bfloat162float(v)); };
  double err_stats = 0, err_e = 0, err_esum = 0;
  for (int m : rows) {
    fetch(z, out, m), fetch_stats(m);
    for (int tn = 0; tn < tiles_n; ++tn) {
      const int c0 = tn * kBN, c1 = std::min(N, c0 + kBN);
      double mx = -INFINITY, sum = 0;
      for (int c = c0; c < c1; ++c) mx = std::max(mx, f(z[c]));
      for (int c = c0; c < c1; ++c) sum += std::exp(f(z[c]) - mx);
      err_stats = std::max({err_stats, std::fabs(st[tn].x - mx), std::fabs(st[tn].y - sum) / sum});
    }
  }
  run(2);
  CK(cudaDeviceSynchronize());
  for (int m : rows) {
    fetch(z, out, m), fetch(zr, ref, m), fetch_stats(m);
    for (int tn = 0; tn < tiles_n; ++tn) {
      const int c0 = tn * kBN, c1 = std::min(N, c0 + kBN);
      double sum = 0;
      for (int c = c0; c < c1; ++c) {
        err_e = std::max(err_e, std::fabs(f(z[c]) - std::exp(f(zr[c]) - st[tn].x)));
        sum += f(z[c]);
      }
      err_esum = std::max(err_esum, std::fabs(sum - st[tn].y) / st[tn].y);
    }
  }
  // the clusters' forms against the single CTAs' (the same sums in the same order: equal bits)
  __nv_bfloat16 *out1;
  CK(cudaMalloc(&out1, size_t(M) * N * 2));
  CK(cudaMemcpy(out1, out, size_t(M) * N * 2, cudaMemcpyDeviceToDevice));
  CK(cudaMemset(out, 0xff, size_t(M) * N * 2));
  run(7);
  CK(cudaDeviceSynchronize());
  const double err_cl_e = rel_diff(out, out1, int64_t(M) * N);
  CK(cudaMemset(out, 0xff, size_t(M) * N * 2));
  run(5);
  CK(cudaDeviceSynchronize());
  const double err_cl = rel_diff(out, ref, int64_t(M) * N);
  CK(cudaFree(out1));
  const std::vector<float> t = time_in_turns({[&] { cublas(w, x, ref); }, [&] { run(0); }, [&] { run(1); },
                                              [&] { run(2); }, [&] { run(5); }, [&] { run(6); }, [&] { run(7); },
                                              [&] { run(8); }, [&] { run(9); }});
  char more[160];
  print_row("logits = X W^T", M, N, K, t[0], t[1], err, "");
  std::snprintf(more, sizeof more, "stats vs fp64 of its logits %.1e", err_stats);
  print_row("logits + row stats", M, N, K, t[0], t[2], err, more);
  std::snprintf(more, sizeof more, "e vs exp(cuBLAS's - max) %.1e (abs), tile sums vs stats %.1e", err_e, err_esum);
  print_row("e = exp(z - tile max) + row stats", M, N, K, t[0], t[3], err, more);
  print_row("logits, clusters of 2 (B multicast)", M, N, K, t[0], t[4], err_cl, "");
  print_row("logits + row stats, clusters of 2", M, N, K, t[0], t[5], err_cl, "");
  std::snprintf(more, sizeof more, "e vs single CTAs' e %.1e", err_cl_e);
  print_row("e + row stats, clusters of 2", M, N, K, t[0], t[6], err_cl, more);
  std::printf("| (diagnostic) the products alone, no epilogue: single CTAs %.3f ms (%.3fx cuBLAS), clusters of 2 "
              "%.3f ms (%.3fx); %d clusters of 2 resident |\n", t[7], t[7] / t[0], t[8], t[8] / t[0], run.grid2 / 2);
  CK(cudaFree(x));
  CK(cudaFree(w));
  CK(cudaFree(out));
  CK(cudaFree(ref));
  CK(cudaFree(run.p.stats));
}

// A backward product with G = e F formed in shared memory, against cuBLAS's product on G materialised (e, F
// and G of c tokens x V; b: W [V][H] for dX, X [c][H] for dW):
//   dX [c][H] = G W (mode 3); as column-major (W^T [H][V] . G^T [V][c]): W, G as stored.
//   dW [V][H] = G^T X (mode 4); as column-major (X^T [H][c] . G [c][V]): X as stored, G transposed.
void run_backward(bool dw, int c, int V, int H, cublasLtHandle_t lt, void *ws, size_t ws_bytes) {
  fail_if(V % kStatTile != 0, "run_backward", __FILE__, __LINE__, "V must be a multiple of 256");
  fail_if(dw && c % 64 != 0, "run_backward", __FILE__, __LINE__, "dW: c must be a multiple of 64");
  const int rows_b = dw ? c : V, rows_out = dw ? V : c, tiles_v = V / kStatTile;
  __nv_bfloat16 *e, *g, *b, *out, *ref;
  float *factor, *factor_t;  // [c][V / 256], and transposed for dW
  Launcher run(rows_out, H, dw ? c : V);
  CK(cudaMalloc(&e, size_t(c) * V * 2));
  CK(cudaMalloc(&g, size_t(c) * V * 2));
  CK(cudaMalloc(&b, size_t(rows_b) * H * 2));
  CK(cudaMalloc(&out, size_t(rows_out) * H * 2));
  CK(cudaMalloc(&ref, size_t(rows_out) * H * 2));
  CK(cudaMalloc(&factor, size_t(c) * tiles_v * sizeof(float)));
  CK(cudaMalloc(&factor_t, size_t(c) * tiles_v * sizeof(float)));
  fill<<<1024, 256>>>(e, nullptr, int64_t(c) * V, 3u, 0.f, 1.f);
  fill<<<1024, 256>>>(b, nullptr, int64_t(rows_b) * H, 4u, dw ? -1.f : -0.05f, dw ? 1.f : 0.05f);
  fill<<<1024, 256>>>(nullptr, factor, int64_t(c) * tiles_v, 5u, 1e-3f, 1.f);
  {
    std::vector<float> f(size_t(c) * tiles_v), ft(f.size());
    CK(cudaMemcpy(f.data(), factor, f.size() * 4, cudaMemcpyDeviceToHost));
    for (int k = 0; k < c; ++k)
      for (int tv = 0; tv < tiles_v; ++tv) ft[size_t(tv) * c + k] = f[size_t(k) * tiles_v + tv];
    CK(cudaMemcpy(factor_t, ft.data(), ft.size() * 4, cudaMemcpyHostToDevice));
  }
  materialise_g<<<1024, 256>>>(e, factor, g, c, V);
  CK(cudaMemset(out, 0xff, size_t(rows_out) * H * 2));
  CK(cudaGetLastError());
  make_map(&run.p.a, e, c, V, dw ? 64 : kBM);
  make_map(&run.p.b, b, rows_b, H, 64);
  make_map(&run.p.o, out, rows_out, H, 64);
  run.p.factor = dw ? factor_t : factor, run.p.n_fastest = true;
  const LtProduct cublas = dw ? LtProduct(lt, ws, ws_bytes, false, true, H, V, c, H, V, H)
                              : LtProduct(lt, ws, ws_bytes, false, false, H, c, V, H, V, H);
  const int mode = dw ? 4 : 3;
  run(mode);
  cublas(b, g, ref);
  CK(cudaDeviceSynchronize());
  const double err = rel_diff(out, ref, int64_t(rows_out) * H);
  const std::vector<float> t = time_in_turns({[&] { cublas(b, g, ref); }, [&] { run(mode); }});
  if (dw) print_row("dW = (e F)^T X, G formed in registers", V, H, c, t[0], t[1], err, "cuBLAS: G^T X");
  else print_row("dX = (e F) W, G formed in registers", c, H, V, t[0], t[1], err, "cuBLAS: G W");
  for (void *p : {static_cast<void *>(e), static_cast<void *>(g), static_cast<void *>(b), static_cast<void *>(out),
                  static_cast<void *>(ref), static_cast<void *>(factor), static_cast<void *>(factor_t)})
    CK(cudaFree(p));
}


// z = X W^T in fp32 for the rows listed (a reference for the shifted epilogue's checks), [rows.size()][N].
__global__ void ref_logits(const __nv_bfloat16 *x, const __nv_bfloat16 *w, const int *rows, int nrows, int N, int K,
                           float *z) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(nrows) * N;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int r = rows[i / N], v = int(i % N);
    float a = 0.f;
    for (int k = 0; k < K; ++k) a += __bfloat162float(x[int64_t(r) * K + k]) * __bfloat162float(w[int64_t(v) * K + k]);
    z[i] = a;
  }
}

// The plan's forward with the loss's element work in the epilogue (loss/shifted_logits_sm90.cuh): E = exp(scale z -
// shift) and the tile statistics, against fp64 ones of an fp32 reference of the sampled rows; timed beside cuBLAS's
// logits, and the backward it feeds (cuBLAS on E: dX with an fp32 output, dW) beside cuBLAS's on G.
void run_shifted(int M, int N, int K, cublasLtHandle_t lt, void *ws, size_t ws_bytes) {
  namespace sl = hl::loss::dev::sm90;
  __nv_bfloat16 *x, *w, *e, *ref, *dw_out;
  float *dx32, *zref;
  sl::TileStats *stats;
  const int tiles_m = (M + sl::kBM - 1) / sl::kBM, tiles_n = (N + sl::kBN - 1) / sl::kBN;
  CK(cudaMalloc(&x, size_t(M) * K * 2));
  CK(cudaMalloc(&w, size_t(N) * K * 2));
  CK(cudaMalloc(&e, size_t(M) * N * 2));
  CK(cudaMalloc(&ref, size_t(M) * N * 2));
  CK(cudaMalloc(&dw_out, size_t(N) * K * 2));
  CK(cudaMalloc(&dx32, size_t(M) * K * 4));
  CK(cudaMalloc(&stats, size_t(M) * tiles_n * sizeof(sl::TileStats)));
  fill<<<1024, 256>>>(x, nullptr, int64_t(M) * K, 1u, -1.f, 1.f);
  fill<<<1024, 256>>>(w, nullptr, int64_t(N) * K, 2u, -9.f / std::sqrt(float(K)), 9.f / std::sqrt(float(K)));
  CK(cudaMemset(e, 0xff, size_t(M) * N * 2));
  CK(cudaMemset(stats, 0xff, size_t(M) * tiles_n * sizeof(sl::TileStats)));
  sl::ShiftedParams P{};
  make_map(&P.x, x, M, K, sl::kBM);
  make_map(&P.w, w, N, K, sl::kBN);
  make_map(&P.e, e, M, N, 64);
  P.stats = stats, P.scale = 1.0f, P.M = M, P.N = N, P.K = K, P.tiles_m = tiles_m, P.tiles_n = tiles_n;
  P.group_m = tiles_m;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaFuncSetAttribute(sl::shifted_logits_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sl::kSmem)));
  const int grid = int(std::min<int64_t>(sms, int64_t(tiles_m) * tiles_n));
  const auto ours = [&] { sl::shifted_logits_kernel<<<grid, sl::kThreads, sl::kSmem>>>(P); };
  ours();
  CK(cudaDeviceSynchronize());
  // checks on sampled rows
  const std::vector<int> rows = {0, 1, M / 3, M / 2 + 7, M - 1};
  int *drows;
  CK(cudaMalloc(&drows, rows.size() * 4));
  CK(cudaMalloc(&zref, rows.size() * size_t(N) * 4));
  CK(cudaMemcpy(drows, rows.data(), rows.size() * 4, cudaMemcpyHostToDevice));
  ref_logits<<<1024, 256>>>(x, w, drows, int(rows.size()), N, K, zref);
  CK(cudaDeviceSynchronize());
  std::vector<float> z(N);
  std::vector<__nv_bfloat16> eh(N);
  std::vector<sl::TileStats> st(tiles_n);
  double err_e = 0, err_s = 0, err_b = 0, err_m = 0;
  int bad_amax = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int r = rows[i];
    CK(cudaMemcpy(z.data(), zref + i * size_t(N), size_t(N) * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(eh.data(), e + int64_t(r) * N, size_t(N) * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(st.data(), stats + int64_t(r) * tiles_n, tiles_n * sizeof(sl::TileStats), cudaMemcpyDeviceToHost));
    for (int tn = 0; tn < tiles_n; ++tn) {
      const int c0 = tn * sl::kBN, c1 = std::min(N, c0 + sl::kBN);
      double s = 0, b = 0, m = -INFINITY;
      int am = -1;
      for (int c = c0; c < c1; ++c) {
        const double ev = std::exp(double(z[c]) - sl::kFirstShift);
        s += ev, b += ev * (double(z[c]) - sl::kFirstShift);
        if (z[c] > m) m = z[c], am = c;
        err_e = std::max(err_e, std::fabs(double(__bfloat162float(eh[c])) - ev) / ev);
      }
      err_s = std::max(err_s, std::fabs(st[tn].s - s) / s);
      err_b = std::max(err_b, std::fabs(st[tn].b - b) / std::fabs(b));
      err_m = std::max(err_m, std::fabs(st[tn].m - m));
      // the argmax may differ where two logits are within the reference's rounding of each other
      if (st[tn].amax != am && std::fabs(double(z[st[tn].amax]) - m) > 1e-4) ++bad_amax;
    }
  }
  // timing: cuBLAS's logits; ours; cuBLAS dX on E with fp32 and bf16 outputs; cuBLAS dW on E
  const LtProduct fwd(lt, ws, ws_bytes, true, false, N, M, K, K, K, N);
  const LtProduct dx16(lt, ws, ws_bytes, false, false, K, M, N, K, N, K);
  const LtProduct dx32p(lt, ws, ws_bytes, false, false, K, M, N, K, N, K, true);
  const LtProduct dwp(lt, ws, ws_bytes, false, true, K, N, M, K, N, K);
  const auto grouped = [&](int g) {
    return [&, g] {
      sl::ShiftedParams Q = P;
      Q.group_m = std::min(g, tiles_m);
      sl::shifted_logits_kernel<<<grid, sl::kThreads, sl::kSmem>>>(Q);
    };
  };
  const std::vector<float> t = time_in_turns({[&] { fwd(w, x, ref); }, ours, [&] { dx16(w, e, ref); },
                                              [&] { dx32p(w, e, dx32); }, [&] { dwp(x, e, dw_out); }, grouped(16),
                                              grouped(8), grouped(4)});
  std::printf("| groups of row blocks: all %d %.3f ms, 16 %.3f, 8 %.3f, 4 %.3f |\n", tiles_m, t[1], t[5], t[6], t[7]);
  std::printf("| shifted logits: E = exp(z - shift) + tile stats (s, b, max, argmax), %d x %d x %d | cuBLAS logits "
              "%.3f ms | ours %.3f ms | %.3fx | E rel %.1e, s %.1e, b %.1e, max abs %.1e, argmax misses %d | dX bf16 "
              "%.3f, dX fp32 out %.3f, dW %.3f ms; the design: (ours + dX fp32 + dW) / (3 cuBLAS) = %.3fx |\n",
              M, N, K, t[0], t[1], t[1] / t[0], err_e, err_s, err_b, err_m, bad_amax, t[2], t[3], t[4],
              (t[1] + t[3] + t[4]) / (t[0] + t[2] + t[4]));
  for (void *p : {static_cast<void *>(x), static_cast<void *>(w), static_cast<void *>(e), static_cast<void *>(ref),
                  static_cast<void *>(dw_out), static_cast<void *>(dx32), static_cast<void *>(zref),
                  static_cast<void *>(stats), static_cast<void *>(drows)})
    CK(cudaFree(p));
}
}  // namespace

int main(int argc, char **argv) {
  struct Job {
    int kind;  // 0 forward, 1 dX, 2 dW
    int a, b, c;
  };
  std::vector<Job> jobs;
  const char *kinds[] = {"fwd", "dx", "dw", "shifted"};
  for (int i = 1; i < argc; i += 4) {
    int kind = -1;
    for (int k = 0; k < 4; ++k)
      if (std::strcmp(argv[i], kinds[k]) == 0) kind = k;
    if (i + 3 >= argc || kind < 0)
      return std::fprintf(stderr, "usage: %s [fwd M N K | dx M V H | dw M V H | shifted M N K] ...\n", argv[0]), 2;
    jobs.push_back({kind, std::atoi(argv[i + 1]), std::atoi(argv[i + 2]), std::atoi(argv[i + 3])});
  }
  if (jobs.empty())
    for (int kind = 0; kind < 3; ++kind) jobs.push_back({kind, 4096, 262144, 2048}), jobs.push_back({kind, 4096, 128256, 4096});
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each row as it is measured
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  cublasLtHandle_t lt;
  CKL(cublasLtCreate(&lt));
  const size_t ws_bytes = size_t(32) << 20;
  void *ws;
  CK(cudaMalloc(&ws, ws_bytes));
  std::printf("# the fused linear + loss plan's products, ours (bench/experiments/fused_gemms.cu) against cuBLASLt "
              "(the heuristic's first algorithm), bf16, fp32 accumulation, %s; ms: medians of 5 x 10, in turns\n\n%s",
              prop.name, kTableHead);
  for (const Job &j : jobs) {
    if (j.kind == 3) run_shifted(j.a, j.b, j.c, lt, ws, ws_bytes);
    else if (j.kind == 0) run_forward(j.a, j.b, j.c, lt, ws, ws_bytes);
    else run_backward(j.kind == 2, j.a, j.b, j.c, lt, ws, ws_bytes);
  }
  CK(cudaFree(ws));
  cublasLtDestroy(lt);
  return 0;
}
