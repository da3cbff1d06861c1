// The row kernel's slice source: where a CTA's slice of a row comes from. BULK (sm_90, 16-byte
// aligned rows; no sparse teacher; a dense teacher only in the whole-row step, its slice beside
// the student's): the slice is not loaded through registers but copied into shared memory by bulk
// copies, so the whole slice is in flight at once (1.23x faster at 8192 x 128256 than kBatch
// register loads; dense JSD 1.4x; see bench/notes/loss.md). The slice streams in chunks, each with a
// `full` barrier (landed) and an `empty` one (the row's last pass has read it): the next row's chunk
// is requested as soon as it is free, so its load overlaps this row's gradient pass, and pass 1
// starts on the first chunk that lands. Otherwise each thread has kBatch 16-byte loads in flight,
// and the slice is kept in shared memory (keep_row) for the later passes.
#pragma once

#include "common/dtype.cuh"

namespace hl::loss::dev {

// VEC columns of a row as one 16-byte pack when aligned, else element by element.
template <class T, int VEC>
__device__ __forceinline__ hl::dev::Pack<T, VEC> load_cols(const T *p, bool aligned) {
  if (aligned) return hl::dev::load_pack<T, VEC>(p);
  hl::dev::Pack<T, VEC> r;
#pragma unroll
  for (int k = 0; k < VEC; ++k) r.v[k] = p[k];
  return r;
}

}  // namespace hl::loss::dev
