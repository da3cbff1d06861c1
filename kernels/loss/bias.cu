// The column sums behind grad_bias (bias.h): a thread a column, reading G's rows in order.
#include "common/cuda_util.h"
#include "common/dtype.cuh"
#include "loss/bias.h"

namespace hl::loss::dev {
namespace {

using hl::dev::from_float;
using hl::dev::to_float;

constexpr int kBiasThreads = 256;

// Slice blockIdx.y of the rows: its column sums into part[blockIdx.y][:]. Adjacent threads read
// adjacent columns of a row (coalesced).
template <class T>
__global__ void __launch_bounds__(kBiasThreads) slice_sums(const T *g, int64_t ldg, int64_t n, int64_t V, float *part) {
  const int64_t j = blockIdx.x * int64_t(kBiasThreads) + threadIdx.x;
  if (j >= V) return;
  const int64_t per = (n + kBiasSlices - 1) / kBiasSlices, r0 = blockIdx.y * per;
  const int64_t r1 = r0 + per < n ? r0 + per : n;
  float s = 0.f;
#pragma unroll 8
  for (int64_t r = r0; r < r1; ++r) s += to_float(g[r * ldg + j]);
  part[blockIdx.y * V + j] = s;
}

// The slices added in order to the running sum; on the last chunk stored into out.
template <class O>
__global__ void __launch_bounds__(kBiasThreads) fold_sums(float *sums, int64_t V, bool first, bool last, O *out,
                                                          bool accumulate) {
  const int64_t j = blockIdx.x * int64_t(kBiasThreads) + threadIdx.x;
  if (j >= V) return;
  const float *part = sums + V;
  float s = first ? 0.f : sums[j];
  for (int k = 0; k < kBiasSlices; ++k) s += part[k * V + j];
  if (!last) {
    sums[j] = s;
    return;
  }
  out[j] = from_float<O>(accumulate ? to_float(out[j]) + s : s);
}

}  // namespace

hl_status_t bias_grad_chunk(const void *g, int64_t ldg, hl_dtype_t dt, int64_t n, int64_t vocab,
                            float *sums, bool first, bool last, void *out, hl_dtype_t out_dt,
                            bool accumulate, cudaStream_t stream) {
  const unsigned cols = unsigned((vocab + kBiasThreads - 1) / kBiasThreads);
  hl::dev::dispatch_float(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    slice_sums<T><<<dim3(cols, kBiasSlices), kBiasThreads, 0, stream>>>(static_cast<const T *>(g), ldg, n, vocab,
                                                                        sums + vocab);
  });
  hl::dev::dispatch_float(out_dt, [&](auto tag) {
    using O = typename decltype(tag)::type;
    fold_sums<O><<<cols, kBiasThreads, 0, stream>>>(sums, vocab, first, last, static_cast<O *>(out), accumulate);
  });
  HL_CUDA_TRY_LAUNCH();
  return HL_STATUS_SUCCESS;
}

}  // namespace hl::loss::dev
