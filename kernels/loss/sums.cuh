// The scalars' sums over rows, in a fixed order that depends on the row count alone (no float
// atomics: the same bits on every run whichever cluster ran which row, and on every rank of a
// split). The row kernel stores each row's record in the workspace (kRecStride floats a row; rows
// go to clusters dynamically, so the sums cannot follow the clusters); the reduce kernel
// (launch.cu) sums them: each CTA a fixed range of rows, then the last CTA the CTAs' partials in
// CTA order.
#pragma once

#include "loss/params.cuh"

namespace hl::loss::dev {

// The weighted sums of the record fields, then ratio min / max and advantage min / max (rows with
// w > 0).
constexpr int kSumFields = kRecFields + 4;
constexpr int kRecStride = (kRecFields + 3) / 4 * 4;  // floats a row's record takes (16-byte packs)
constexpr int kSumStride = (kSumFields + 3) / 4 * 4;  // floats a partial of the sums takes

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
                                              bool has_adv, unsigned terms, int n, float *out) {
  finish_scalars<float>(acc, acc[kRecFields], acc[kRecFields + 1], acc[kRecFields + 2],
                        acc[kRecFields + 3], D, has_ratio, has_adv, terms, n, out);
}

// N floats of a 16-byte aligned workspace row, in 16-byte packs; L2: bypassing L1 (what other
// CTAs of the running kernel wrote).
template <int N, bool L2 = false>
__device__ __forceinline__ void load_floats(const float *src, float (&dst)[N]) {
#pragma unroll
  for (int k = 0; k < N; k += 4) {
    const float4 *p = reinterpret_cast<const float4 *>(src + k);
    const float4 v = L2 ? __ldcg(p) : *p;
    dst[k] = v.x;
    if (k + 1 < N) dst[k + 1] = v.y;
    if (k + 2 < N) dst[k + 2] = v.z;
    if (k + 3 < N) dst[k + 3] = v.w;
  }
}
template <int N>
__device__ __forceinline__ void store_floats(float *dst, const float *src) {
#pragma unroll
  for (int k = 0; k < N; k += 4)
    *reinterpret_cast<float4 *>(dst + k) = make_float4(src[k], k + 1 < N ? src[k + 1] : 0.0f,
                                                       k + 2 < N ? src[k + 2] : 0.0f, k + 3 < N ? src[k + 3] : 0.0f);
}

}  // namespace hl::loss::dev
