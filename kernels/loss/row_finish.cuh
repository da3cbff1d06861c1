// The row kernel's row finish: what a row leaves behind once its record is merged. kStats writes
// the record into this rank's block and kMiddle dense JSD's sums into its middle block; the other
// steps turn the record into losses, metrics and the gradient's coefficients (row_math.h's
// finish_row), then store the row's token outputs and its record for the scalars (sums.cuh).
#pragma once

#include "loss/row_merge.cuh"

namespace hl::loss::dev {

// Block 0 writes this rank's block header at its first row (again for each chunk of rows of the
// fused linear form: the same bytes).
__device__ __forceinline__ void write_header(const Params &p, int64_t r) {
  if (blockIdx.x == 0 && r == 0)
    for (int k = 0; k < 8; ++k) reinterpret_cast<int64_t *>(p.block)[k] = p.header[k];
}

// Row r's record into this rank's block, and the header.
template <int DISTILL>
__device__ void write_record(const Params &p, int64_t r, RowStats<float> st) {
  constexpr int W = kRecordBytes<DISTILL> / 8;
  if (st.amax != INT64_MAX) st.amax += p.col0;  // a global column
  uint2 *rec = reinterpret_cast<uint2 *>(p.block + record_at<DISTILL>(p, r));
  const uint2 *src = reinterpret_cast<const uint2 *>(&st);
#pragma unroll
  for (int k = 0; k < W; ++k) rec[k] = src[k];
  write_header(p, r);
}

// Dense JSD's middle step: row r's sums over this shard into the middle block.
__device__ __forceinline__ void write_middle(const Params &p, int64_t r, MidSums<float> s) {
  reinterpret_cast<MidSums<float> *>(p.block + 64)[p.row0 + r] = s;
  write_header(p, r);
}

}  // namespace hl::loss::dev
