// The scalars' sums over rows, in a fixed order (deterministic, no float atomics). Two users:
//   the reduce kernel (launch.cu) sums per-row records from global memory (the split's finish,
//     whose bits must not depend on a rank's own grid);
//   the row kernel sums its own rows as it finishes them, one partial per cluster, and the last
//     cluster to finish merges the partials (row_kernel.cuh): no reduce kernel.
#pragma once

#include "loss/params.cuh"

namespace hl::loss::cuda {

// The weighted sums of the record fields, then ratio min / max and advantage min / max (rows with
// w > 0).
constexpr int kSumFields = kRecFields + 4;

__device__ __forceinline__ void sums_init(float *acc) {
#pragma unroll
  for (int k = 0; k < kRecFields; ++k) acc[k] = 0.0f;
  acc[kRecFields] = acc[kRecFields + 2] = INFINITY;
  acc[kRecFields + 1] = acc[kRecFields + 3] = -INFINITY;
}

// Merges a partial of field k: sums, then min / max pairs.
__device__ __forceinline__ float combine(int k, float a, float o) {
  return k < kRecFields ? a + o : ((k - kRecFields) % 2 ? fmaxf(a, o) : fminf(a, o));
}

// Adds one row's record to acc; rec(k) is its field k.
template <class Rec>
__device__ __forceinline__ void add_row(float *acc, Rec rec) {
  const float w = rec(R_W);
#pragma unroll
  for (int k = 0; k < kRecFields; ++k) {
    const float x = rec(k);
    acc[k] += (k == R_W || k == R_VALID) ? x : w * x;
  }
  if (w > 0.0f) {
    const float ratio = rec(R_RATIO), adv = rec(R_ADV);
    acc[kRecFields] = fminf(acc[kRecFields], ratio);
    acc[kRecFields + 1] = fmaxf(acc[kRecFields + 1], ratio);
    acc[kRecFields + 2] = fminf(acc[kRecFields + 2], adv);
    acc[kRecFields + 3] = fmaxf(acc[kRecFields + 3], adv);
  }
}

// Merges the THREADS threads' acc: a shuffle tree in each warp, then thread 0 takes the warps'
// results in warp order (part: THREADS / 32 rows of shared memory). Thread 0 holds the result.
template <int THREADS>
__device__ __forceinline__ void block_combine(float (&acc)[kSumFields], float (*part)[kSumFields]) {
#pragma unroll
  for (int k = 0; k < kSumFields; ++k)
    for (int off = 16; off > 0; off >>= 1) acc[k] = combine(k, acc[k], __shfl_xor_sync(0xffffffffu, acc[k], off));
  if (threadIdx.x % 32 == 0)
#pragma unroll
    for (int k = 0; k < kSumFields; ++k) part[threadIdx.x / 32][k] = acc[k];
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < THREADS / 32; ++w)
#pragma unroll
      for (int k = 0; k < kSumFields; ++k) acc[k] = combine(k, acc[k], part[w][k]);
}

// The scalars from the merged sums (thread 0); D is the divisor the prep kernel used.
__device__ __forceinline__ void write_scalars(const float (&acc)[kSumFields], float D, bool has_ratio,
                                              bool has_adv, unsigned terms, float *out) {
  finish_scalars<float>(acc, acc[kRecFields], acc[kRecFields + 1], acc[kRecFields + 2],
                        acc[kRecFields + 3], D, has_ratio, has_adv, terms, out);
}

}  // namespace hl::loss::cuda
