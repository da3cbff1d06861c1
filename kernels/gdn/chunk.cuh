// Where a chunk of the (possibly variable-length) batch lies: its first token, flattened over
// B * T, and how many of its 64 rows are valid.
#pragma once

#include <cstdint>

namespace hl::gdn::dev {

struct ChunkTable {
  const int64_t *chunk_first;  // varlen: [S + 1] first global chunk of each sequence (else null)
  const int64_t *seq_start;    // varlen: [S + 1] cu_seqlens
  int64_t num_seqs, T, nt;     // nt: chunks per batch row (non-varlen)
};

__device__ __forceinline__ void locate_chunk(const ChunkTable &c, int64_t cid, int64_t *tok0, int *rows) {
  int64_t n;
  if (c.chunk_first) {
    int64_t lo = 0, hi = c.num_seqs;  // last s with chunk_first[s] <= cid (a non-empty sequence)
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (c.chunk_first[mid] <= cid) lo = mid; else hi = mid;
    }
    *tok0 = c.seq_start[lo] + (cid - c.chunk_first[lo]) * 64;
    n = c.seq_start[lo + 1] - *tok0;
  } else {
    const int64_t b = cid / c.nt, i = cid % c.nt;
    *tok0 = b * c.T + i * 64;
    n = c.T - i * 64;
  }
  *rows = n < 64 ? int(n) : 64;
}

}  // namespace hl::gdn::dev
