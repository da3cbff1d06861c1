// cuBLASLt's candidate algorithms for the shifted path's backward products, each timed (#28): whether the
// heuristic's first answer (what kernels/loss/gemm.cpp takes) is the fastest at a chunk's shape.
//   dw c V H: grad_weight (+)= E^T (alpha X), K = c rows, bf16 out; the time with beta 0 and beta 1
//   dx c V H: E W with an fp32 output, K = V
// Each algorithm's configuration (tile, stages, split-K, swizzle, cluster), the workspace it asks for and its median time; split-K only
// with fp32 partials (the library's reduction mask).
//   nvcc -std=c++17 -O3 -arch=sm_90a -o /tmp/lt_algos bench/experiments/lt_algos.cu -lcublasLt
//   /tmp/lt_algos dw 4096 128256 4096 dw 8192 128256 4096 dx 4096 128256 4096
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)), std::exit(1); \
  } while (0)
#define CKL(x)                                                                              \
  do {                                                                                      \
    cublasStatus_t s_ = (x);                                                                \
    if (s_ != CUBLAS_STATUS_SUCCESS) std::printf("%s:%d cublasLt %d\n", __FILE__, __LINE__, int(s_)), std::exit(1); \
  } while (0)

__global__ void fill(__nv_bfloat16 *p, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed * 0x9e3779b9u;
    h ^= h >> 15, h *= 0x85ebca6bu, h ^= h >> 13;
    p[i] = __float2bfloat16(scale * (float(h & 0xffff) / 65536.f));
  }
}

// Words of a and b that differ.
__global__ void differ(const unsigned *a, const unsigned *b, size_t n, unsigned long long *count) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    c += a[i] != b[i];
  if (c) atomicAdd(count, c);
}

template <class T>
T cfg(const cublasLtMatmulAlgo_t &a, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T v{};
  size_t w = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof v, &w);
  return v;
}

int main(int argc, char **argv) {
  cublasLtHandle_t lt;
  CKL(cublasLtCreate(&lt));
  const size_t ws_bytes = size_t(32) << 20;
  void *ws;
  CK(cudaMalloc(&ws, ws_bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 1; i + 3 < argc; i += 4) {
    const bool dw = std::strcmp(argv[i], "dw") == 0;
    const long c = std::atol(argv[i + 1]), V = std::atol(argv[i + 2]), H = std::atol(argv[i + 3]);
    const long lde = (V + 7) / 8 * 8;
    __nv_bfloat16 *e, *x, *w;
    void *d, *d0;
    unsigned long long *count;
    const size_t dbytes = dw ? size_t(V) * H * 2 : size_t(c) * H * 4;
    CK(cudaMalloc(&e, size_t(c) * lde * 2));
    CK(cudaMalloc(&x, size_t(c) * H * 2));
    CK(cudaMalloc(&w, size_t(V) * H * 2));
    CK(cudaMalloc(&d, dbytes));
    CK(cudaMalloc(&d0, dbytes));
    CK(cudaMalloc(&count, 8));
    fill<<<1024, 256>>>(e, size_t(c) * lde, 1, 1e-3f);
    fill<<<1024, 256>>>(x, size_t(c) * H, 2, 1.f);
    fill<<<1024, 256>>>(w, size_t(V) * H, 3, 0.05f);
    CK(cudaMemset(d, 0, dbytes));
    // The library's calls (kernels/loss/shifted.cu), column-major: dW: m = H, n = V, k = c, A = alpha X (N),
    // B = E (T); dX: m = H, n = c, k = V, A = W (N), B = E (N).
    const long m = H, n = dw ? V : c, k = dw ? c : V;
    const cublasOperation_t ta = CUBLAS_OP_N, tb = dw ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cudaDataType_t out = dw ? CUDA_R_16BF : CUDA_R_32F;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    CKL(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CKL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CKL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CKL(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, m, k, H));
    CKL(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, dw ? n : k, dw ? k : n, lde));
    CKL(cublasLtMatrixLayoutCreate(&ld, out, m, n, H));
    cublasLtMatmulPreference_t pref;
    CKL(cublasLtMatmulPreferenceCreate(&pref));
    const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    CKL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
    CKL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof schemes));
    cublasLtMatmulHeuristicResult_t r[32];
    int found = 0;
    CKL(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 32, r, &found));
    const void *A = dw ? static_cast<void *>(x) : static_cast<void *>(w);
    const float one = 1.f, zero = 0.f;
    const auto run = [&](int j, const float *beta) {
      return cublasLtMatmul(lt, desc, &one, A, la, e, lb, beta, d, ld, d, ld, &r[j].algo, ws, ws_bytes, 0);
    };
    // bits: each algorithm's output (beta 0) against the heuristic's first
    std::vector<unsigned long long> diff(found, 0);
    for (int j = 0; j < found; ++j) {
      CK(cudaMemset(d, 0xff, dbytes));
      CKL(run(j, &zero));
      if (j == 0) CK(cudaMemcpy(d0, d, dbytes, cudaMemcpyDeviceToDevice));
      CK(cudaMemset(count, 0, 8));
      differ<<<1024, 256>>>(static_cast<unsigned *>(d), static_cast<unsigned *>(d0), dbytes / 4, count);
      CK(cudaMemcpy(&diff[j], count, 8, cudaMemcpyDeviceToHost));
    }
    // times[j][0 / 1]: beta 0 / 1 (dX: beta 0 only); medians of 11 rounds, every algorithm once a round
    std::vector<std::vector<float>> t(found * 2);
    for (int j = 0; j < found; ++j) run(j, &zero), run(j, &zero);
    CK(cudaDeviceSynchronize());
    for (int round = 0; round < 11; ++round)
      for (int j = 0; j < found; ++j)
        for (int b = 0; b < (dw ? 2 : 1); ++b) {
          CK(cudaEventRecord(e0));
          const cublasStatus_t s = run(j, b ? &one : &zero);
          CK(cudaEventRecord(e1));
          CK(cudaEventSynchronize(e1));
          float ms = -1.f;
          if (s == CUBLAS_STATUS_SUCCESS) CK(cudaEventElapsedTime(&ms, e0, e1));
          t[j * 2 + b].push_back(ms);
        }
    const double flops = 2.0 * m * n * k;
    std::printf("\n%s c=%ld V=%ld H=%ld (m %ld n %ld k %ld): %d algorithms\n| # | algo id | tile | stages | split-k | "
                "swizzle | cluster | workspace KiB | ms (beta 0) | TFLOP/s | ms (beta 1) | words unlike #0 |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|\n",
                argv[i], c, V, H, m, n, k, found);
    for (int j = 0; j < found; ++j) {
      auto med = [&](int b) {
        std::vector<float> v = t[j * 2 + b];
        if (v.empty()) return -1.f;
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      std::printf("| %d | %d | %d | %d | %d | %d | %d | %zu | %.3f | %.0f | %.3f | %llu |\n", j,
                  cfg<int>(r[j].algo, CUBLASLT_ALGO_CONFIG_ID), cfg<int>(r[j].algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
                  cfg<int>(r[j].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID), cfg<int>(r[j].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                  cfg<int>(r[j].algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                  cfg<int>(r[j].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), r[j].workspaceSize >> 10, med(0), flops / med(0) * 1e-9,
                  dw ? med(1) : 0.f, diff[j]);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    for (void *p : {static_cast<void *>(e), static_cast<void *>(x), static_cast<void *>(w), d, d0, static_cast<void *>(count)}) CK(cudaFree(p));
  }
  return 0;
}
