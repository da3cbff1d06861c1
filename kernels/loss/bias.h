// The fused linear form's bias gradient on CUDA: grad_bias = the column sums of G, chunk by chunk,
// in fp32 and a fixed order (no atomics: the same bits on every run), rounded once at the end.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "headloss.h"

namespace hl::loss::dev {

// A chunk's rows are summed in this many slices side by side (enough CTAs to stream G at a small
// vocabulary), then the slices added in order.
constexpr int kBiasSlices = 8;
// The workspace of the sums: the slices' partial sums and the running sum, [vocab] fp32 each.
inline size_t bias_workspace(int64_t vocab) { return size_t(kBiasSlices + 1) * size_t(vocab) * sizeof(float); }

// Adds the column sums of g [n, vocab] (row stride ldg, in dt) to the running sum in `sums`
// (bias_workspace bytes; first: it starts from 0). last: stores the sum into out (in out_dt; with
// accumulate, added to what out holds, in fp32 and rounded once) instead of keeping it.
hl_status_t bias_grad_chunk(const void *g, int64_t ldg, hl_dtype_t dt, int64_t n, int64_t vocab,
                            float *sums, bool first, bool last, void *out, hl_dtype_t out_dt,
                            bool accumulate, cudaStream_t stream);

}  // namespace hl::loss::dev
