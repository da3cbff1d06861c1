// Experiment for #28 (written 2026-11-27, not yet run): the fused linear + loss plan's forward product as our
// own kernel, logits = X W^T (X [M, K], W [N, K] row-major, bf16, fp32 accumulation, bf16 out), timed beside
// cuBLASLt's product of the same shapes, in three forms: the logits alone; with each 256-column tile's row
// statistics (max and sum of exp) from the epilogue; and e = exp(z - tile max) stored instead of z, the
// operand the backward products would read (bench/NOTES.md "Fused linear + loss", "Where G can be formed":
// the loss inside the products is what reaches under 1.05x at 4096 x 2048 x 262144). The question: how close
// a TMA + wgmma kernel of ours gets to cuBLAS, and what the statistics cost.
//
// v0 design: persistent CTAs of 384 threads over 128 x 256 tiles (M fastest, so a wave shares W's tiles in
// L2); warp 0 loads A (128 x 64) and B (256 x 64) k-blocks with TMA into a ring of 4 stages; two consumer
// warpgroups each run m64n256k16 wgmma on their 64 rows, one commit group in flight, and do the epilogue
// (statistics, then 4-byte stores straight from the accumulators) while the ring refills for the next tile.
// Known costs to measure before going further: the epilogue idles the tensor cores (128 exp a thread a tile:
// ~6% of a K = 2048 tile's MMA time; a ping-pong of the two warpgroups would hide it), and the stores are
// 4-byte pieces (stmatrix + TMA store would make them whole lines).
//
// On the device (after tools/device.sh build, for the include paths only):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Ikernels -o /tmp/gemm_rowstats bench/experiments/gemm_rowstats.cu -lcublasLt
//   /tmp/gemm_rowstats                # 4096 x 262144 x 2048 and 4096 x 128256 x 4096 (M x N x K)
//   /tmp/gemm_rowstats M N K [...]    # N even, K a multiple of 8
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/bulk_copy.cuh"
#include "gdn/wgmma.cuh"

using namespace hl::cuda;
using hl::cuda::gdn::wgmma_commit;
using hl::cuda::gdn::wgmma_desc;
using hl::cuda::gdn::wgmma_fence;
using hl::cuda::gdn::wgmma_pin;

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

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;  // 16 + 32 KB
constexpr int kThreads = 384;                                                                       // producer + 2 WGs
constexpr size_t kSmem = size_t(kStages) * kStageBytes + 2 * kStages * 8 + 1024;

struct Params {
  CUtensorMap a, b;  // X [M][K] in 64 x 128 boxes, W [N][K] in 64 x 256 boxes (128-byte swizzle)
  __nv_bfloat16 *out;
  float2 *stats;  // [M][tiles_n]: (max, sum exp(z - max)) of row m over tile n's columns
  int M, N, K, tiles_m, tiles_n;
};

// D[64 x 256] (+)= A[64 x 16] B[16 x 256], operands in shared memory (descriptors); scale_d 0: D = A B.
__device__ __forceinline__ void wgmma256(float (&d)[32][4], uint64_t a, uint64_t b, int scale_d) {
#define HL_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, "
      "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, "
      "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, "
      "%106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, "
      "%124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : HL_D4(0), HL_D4(1), HL_D4(2), HL_D4(3), HL_D4(4), HL_D4(5), HL_D4(6), HL_D4(7), HL_D4(8), HL_D4(9),
        HL_D4(10), HL_D4(11), HL_D4(12), HL_D4(13), HL_D4(14), HL_D4(15), HL_D4(16), HL_D4(17), HL_D4(18),
        HL_D4(19), HL_D4(20), HL_D4(21), HL_D4(22), HL_D4(23), HL_D4(24), HL_D4(25), HL_D4(26), HL_D4(27),
        HL_D4(28), HL_D4(29), HL_D4(30), HL_D4(31)
      : "l"(a), "l"(b), "r"(scale_d));
#undef HL_D4
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// The epilogue of one warp's 16 rows (m0..) of tile columns n0..n0 + 255 (EDGE: a partial last tile, whose
// columns from N on are TMA's zeros). MODE 0: the logits rounded to bf16, stored; 1: also their max and sum of
// exp per row (of the rounded logits); 2: the statistics of the fp32 logits, and e = exp(z - max) stored in
// place of z (what the backward products would read: bench/NOTES.md "Where G can be formed").
template <int MODE, bool EDGE>
__device__ __forceinline__ void epilogue(const Params &P, float (&acc)[32][4], int m0, int n0, int tile_n,
                                         int lane) {
  const int r = m0 + lane / 4, c = n0 + 2 * (lane % 4);
  const auto in = [&](int j, int e) { return !EDGE || c + 8 * j + e % 2 < P.N; };
  if constexpr (MODE < 2) {
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = __bfloat162float(__float2bfloat16(acc[j][e]));
  }
  if constexpr (MODE > 0) {
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
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (r + 8 * h >= P.M) continue;
    __nv_bfloat16 *row = P.out + int64_t(r + 8 * h) * P.N;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      if (EDGE && c + 8 * j >= P.N) continue;  // N even: a pair lies wholly in or out
      *reinterpret_cast<__nv_bfloat162 *>(row + c + 8 * j) =
          __floats2bfloat162_rn(acc[j][2 * h], acc[j][2 * h + 1]);
    }
  }
}

template <int MODE>
__global__ void __launch_bounds__(kThreads, 1) gemm_rowstats(const __grid_constant__ Params P) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char *sm = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  uint64_t *full = reinterpret_cast<uint64_t *>(sm + kStages * kStageBytes), *empty = full + kStages;
  const int warp = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 8);  // 8 consumer warps
  }
  __syncthreads();
  const int tiles = P.tiles_m * P.tiles_n, kblocks = (P.K + kBK - 1) / kBK;
  if (warp < 4) {  // producer warpgroup: warp 0 lane 0 issues every load
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (warp != 0 || lane != 0) return;
    uint32_t it = 0;  // k-blocks issued
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      const int m0 = (t % P.tiles_m) * kBM, n0 = (t / P.tiles_m) * kBN;
      for (int kb = 0; kb < kblocks; ++kb, ++it) {
        const uint32_t s = it % kStages;
        if (it >= kStages) mbar_wait(&empty[s], (it / kStages - 1) & 1);
        unsigned char *a = sm + s * kStageBytes;
        mbar_expect_tx(&full[s], kStageBytes);
        tma_load_3d(a, &P.a, kb * kBK, m0, 0, &full[s]);
        tma_load_3d(a + kABytes, &P.b, kb * kBK, n0, 0, &full[s]);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int wg = warp / 4 - 1, m_off = 64 * wg + 16 * (warp % 4);  // this warp's rows in the tile
  uint32_t it = 0;  // k-blocks consumed
  float acc[32][4];
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int tile_m = t % P.tiles_m, tile_n = t / P.tiles_m;
    uint32_t prev = 0;
    for (int kb = 0; kb < kblocks; ++kb, ++it) {
      const uint32_t s = it % kStages;
      mbar_wait(&full[s], (it / kStages) & 1);
      const unsigned char *a = sm + s * kStageBytes;
      const uint64_t da = wgmma_desc(a + wg * 64 * 128), db = wgmma_desc(a + kABytes);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) wgmma256(acc, da + 2 * kk, db + 2 * kk, kb > 0 || kk > 0);
      wgmma_commit();
      wgmma_wait<1>();  // the previous k-block's products are done: its stage goes back to the producer
      if (kb > 0) {
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[prev]);
      }
      prev = s;
    }
    wgmma_wait<0>();
    wgmma_pin(acc);  // the epilogue reads the accumulators no earlier
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[prev]);
    const int m0 = tile_m * kBM + m_off, n0 = tile_n * kBN;
    if (n0 + kBN <= P.N) epilogue<MODE, false>(P, acc, m0, n0, tile_n, lane);
    else epilogue<MODE, true>(P, acc, m0, n0, tile_n, lane);
  }
}

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  void *p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess) std::exit(1);
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
}

// A row-major [rows][K] bf16 matrix read in K-contiguous boxes of 64 x box_rows (as 3-D, the last of size 1).
void make_map(CUtensorMap *m, const void *base, uint64_t rows, uint64_t K, uint32_t box_rows) {
  const cuuint64_t dims[3] = {K, rows, 1}, strides[2] = {K * 2, K * rows * 2};
  const cuuint32_t box[3] = {uint32_t(kBK), box_rows, 1}, step[3] = {1, 1, 1};
  const CUresult r = encoder()(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void *>(base), dims, strides, box,
                               step, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) std::fprintf(stderr, "cuTensorMapEncodeTiled: %d\n", int(r)), std::exit(1);
}

__global__ void fill(__nv_bfloat16 *x, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed ^ uint32_t(i >> 32) * 40503u;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    x[i] = __float2bfloat16(scale * (float(h & 0xffffff) / 8388608.f - 1.f));
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

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run_shape(int M, int N, int K, cublasLtHandle_t lt, void *ws, size_t ws_bytes) {
  __nv_bfloat16 *x, *w, *out, *ref;
  float2 *stats;
  const int tiles_m = (M + kBM - 1) / kBM, tiles_n = (N + kBN - 1) / kBN;
  CK(cudaMalloc(&x, size_t(M) * K * 2));
  CK(cudaMalloc(&w, size_t(N) * K * 2));
  CK(cudaMalloc(&out, size_t(M) * N * 2));
  CK(cudaMalloc(&ref, size_t(M) * N * 2));
  CK(cudaMalloc(&stats, size_t(M) * tiles_n * sizeof(float2)));
  // logits of a realistic spread: entries of x and w ~U(-1, 1) scaled so that a logit's sd is ~3
  fill<<<1024, 256>>>(x, int64_t(M) * K, 1u, 1.f);
  fill<<<1024, 256>>>(w, int64_t(N) * K, 2u, 3.f * std::sqrt(9.f / K));
  CK(cudaMemset(out, 0xff, size_t(M) * N * 2));  // poisoned: an unwritten element fails the comparison
  CK(cudaGetLastError());

  Params p{};
  make_map(&p.a, x, M, K, kBM);
  make_map(&p.b, w, N, K, kBN);
  p.out = out, p.stats = stats, p.M = M, p.N = N, p.K = K, p.tiles_m = tiles_m, p.tiles_n = tiles_n;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int grid = std::min(sms, tiles_m * tiles_n);
  const auto kernel = [](int mode) {
    return mode == 0 ? gemm_rowstats<0> : mode == 1 ? gemm_rowstats<1> : gemm_rowstats<2>;
  };
  for (int mode = 0; mode < 3; ++mode)
    CK(cudaFuncSetAttribute(kernel(mode), cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
  auto ours = [&](int mode) { kernel(mode)<<<grid, kThreads, kSmem>>>(p); };

  // cuBLASLt, column-major: ref^T [N][M] = W [N][K] . X^T, i.e. ref [M][N] row-major.
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc;
  CKL(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t tr = CUBLAS_OP_T, nt = CUBLAS_OP_N;
  CKL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof tr));
  CKL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt));
  CKL(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, N, K));
  CKL(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K));
  CKL(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, N, M, N));
  cublasLtMatmulPreference_t pref;
  CKL(cublasLtMatmulPreferenceCreate(&pref));
  CKL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  CKL(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &heur, &found));
  if (!found) std::fprintf(stderr, "cuBLASLt: no algorithm\n"), std::exit(1);
  const float one = 1.f, zero = 0.f;
  auto cublas = [&] {
    CKL(cublasLtMatmul(lt, desc, &one, w, la, x, lb, &zero, ref, lc, ref, lc, &heur.algo, ws, ws_bytes, 0));
  };

  // Correctness. Mode 1: the logits against cuBLAS's (both fp32 sums rounded once to bf16), the statistics of
  // sampled rows against fp64 ones of our own stored logits. Mode 2: e against exp(cuBLAS's logit - our max)
  // (absolute: e <= 1; cuBLAS's bf16 rounding alone moves it by up to |z| 2^-9), and its tile sums against the
  // statistics (e's own rounding).
  ours(1);
  cublas();
  CK(cudaDeviceSynchronize());
  double2 *parts;
  CK(cudaMalloc(&parts, 1024 * sizeof(double2)));
  diff_norms<<<1024, 256>>>(out, ref, int64_t(M) * N, parts);
  std::vector<double2> hp(1024);
  CK(cudaMemcpy(hp.data(), parts, 1024 * sizeof(double2), cudaMemcpyDeviceToHost));
  double dd = 0, rr = 0;
  for (const double2 &v : hp) dd += v.x, rr += v.y;
  const int rows[] = {0, 1, M / 3, M / 2 + 7, M - 1};
  std::vector<__nv_bfloat16> z(N), zr(N);
  std::vector<float2> st(tiles_n);
  const auto fetch = [&](std::vector<__nv_bfloat16> &v, const __nv_bfloat16 *src, int m) {
    CK(cudaMemcpy(v.data(), src + int64_t(m) * N, size_t(N) * 2, cudaMemcpyDeviceToHost));
  };
  const auto fetch_stats = [&](int m) {
    CK(cudaMemcpy(st.data(), stats + int64_t(m) * tiles_n, tiles_n * sizeof(float2), cudaMemcpyDeviceToHost));
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
  ours(2);
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

  // Timing: cuBLAS and the three modes in turns (the products heat the GPU), medians of 5 rounds of 10.
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> times[4];  // cuBLAS, modes 0, 1, 2
  const auto time10 = [&](auto &&fn) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < 10; ++i) fn();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms / 10;
  };
  for (int round = 0; round < 5; ++round) {
    times[0].push_back(time10(cublas));
    for (int mode = 0; mode < 3; ++mode) times[mode + 1].push_back(time10([&] { ours(mode); }));
  }
  CK(cudaGetLastError());
  const double flop = 2.0 * M * N * K;
  float t[4];
  for (int i = 0; i < 4; ++i) t[i] = median(times[i]);
  std::printf("| %d x %d x %d | %.3f (%.0f TF/s) |", M, N, K, t[0], flop / t[0] / 1e9);
  for (int i = 1; i < 4; ++i) std::printf(" %.3f (%.3fx) |", t[i], t[i] / t[0]);
  std::printf(" %.1e | %.1e | %.1e | %.1e |\n", std::sqrt(dd / rr), err_stats, err_e, err_esum);
  CK(cudaFree(x));
  CK(cudaFree(w));
  CK(cudaFree(out));
  CK(cudaFree(ref));
  CK(cudaFree(stats));
  CK(cudaFree(parts));
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
}

}  // namespace

int main(int argc, char **argv) {
  std::vector<int> shapes;
  for (int i = 1; i < argc; ++i) shapes.push_back(std::atoi(argv[i]));
  if (shapes.empty()) shapes = {4096, 262144, 2048, 4096, 128256, 4096};
  if (shapes.size() % 3) return std::fprintf(stderr, "usage: %s [M N K ...]\n", argv[0]), 2;
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  cublasLtHandle_t lt;
  CKL(cublasLtCreate(&lt));
  const size_t ws_bytes = size_t(32) << 20;
  void *ws;
  CK(cudaMalloc(&ws, ws_bytes));
  std::printf("# logits = X W^T, bf16 (fp32 accumulation), %s: cuBLASLt (the heuristic's first algorithm) and ours "
              "(ms, median of 5 x 10; in brackets: to cuBLAS)\n\n",
              prop.name);
  std::printf("| M x N x K | cuBLASLt | ours: logits | logits + row stats | e = exp(z - max) + row stats | "
              "logits vs cuBLAS (rel. norm) | stats vs fp64 | e vs cuBLAS's (abs) | e sums vs stats |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  for (size_t i = 0; i < shapes.size(); i += 3) run_shape(shapes[i], shapes[i + 1], shapes[i + 2], lt, ws, ws_bytes);
  CK(cudaFree(ws));
  cublasLtDestroy(lt);
  return 0;
}
