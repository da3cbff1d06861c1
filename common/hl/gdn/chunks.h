// The chunk decomposition, written once: the batch's sequences (the B rows of T tokens, or with
// cu_seqlens the variable-length sequences of one row) cut into chunks of kChunk tokens, the last
// of each sequence partial, numbered in order (a chunk's number indexes h and dh). The host walks it
// (Chunks: the validation's count, the CPU reference's list, the table the CUDA launcher uploads);
// a kernel finds one chunk by its number (locate_chunk, host and device, checked against the walk
// by tests/c/test_gdn_chunks.cpp).
#pragma once

// No <algorithm>: nvcc 13.0's front end crashes on dqkwg_sm90.cu's std::min<int64_t>(...) with it
// (internal error in i_copy_expr_tree).
#include <cstdint>
#include <vector>

#include "hl/gdn/facts.h"
#include "hl/host_device.h"

namespace hl::gdn {

HL_HD int64_t chunks_in(int64_t tokens) { return (tokens + kChunk - 1) / kChunk; }

// The kernels' view. Varlen: sequence s holds tokens [seq_start[s], seq_start[s + 1]) and chunks from
// chunk_first[s] on (each [S + 1]: Chunks::table()); else chunk_first is null and chunk cid is chunk
// cid % nt of batch row cid / nt.
struct ChunkTable {
  const int64_t *chunk_first;
  const int64_t *seq_start;
  int64_t num_seqs, T, nt;
};

// table: varlen, a copy of Chunks::table() (on the device: uploaded, or built there from cu_seqlens);
// null without. nt: chunks a batch row (without varlen).
inline ChunkTable chunk_table(const int64_t *table, int64_t num_seqs, int64_t T, int64_t nt) {
  return {table, table ? table + num_seqs + 1 : nullptr, num_seqs, T, nt};
}

// Chunk cid's first token (flattened over B T) and its valid rows: a binary search of the sequences
// (varlen) or a division.
HL_HD void locate_chunk(const ChunkTable &c, int64_t cid, int64_t *tok0, int *rows) {
  int64_t n;
  if (c.chunk_first) {
    int64_t lo = 0, hi = c.num_seqs;  // last s with chunk_first[s] <= cid (a non-empty sequence)
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (c.chunk_first[mid] <= cid) lo = mid; else hi = mid;
    }
    *tok0 = c.seq_start[lo] + (cid - c.chunk_first[lo]) * kChunk;
    n = c.seq_start[lo + 1] - *tok0;
  } else {
    const int64_t b = cid / c.nt, i = cid % c.nt;
    *tok0 = b * c.T + i * kChunk;
    n = c.T - i * kChunk;
  }
  *rows = n < kChunk ? int(n) : int(kChunk);
}

struct Chunk {
  int64_t tok0, rows;  // first token (flattened over B T), valid rows
};

// The host's walk. cu: the host copy of cu_seqlens (starting at 0, never decreasing), or empty: B
// sequences of T tokens.
class Chunks {
 public:
  Chunks(int64_t B, int64_t T, const std::vector<int64_t> &cu) {
    std::vector<int64_t> start = cu;
    if (cu.empty())
      for (int64_t b = 0; b <= B; ++b) start.push_back(b * T);
    const size_t S = start.size() - 1;
    table_.resize(2 * (S + 1));
    for (size_t s = 0; s <= S; ++s) {
      table_[s] = s ? table_[s - 1] + chunks_in(start[s] - start[s - 1]) : 0;
      table_[S + 1 + s] = start[s];
    }
  }
  int64_t count() const { return table_[table_.size() / 2 - 1]; }
  // Every chunk, in order (a chunk's place in the list is its number).
  std::vector<Chunk> list() const {
    const size_t S = table_.size() / 2 - 1;
    const int64_t *start = table_.data() + S + 1;
    std::vector<Chunk> out;
    for (size_t s = 0; s < S; ++s)
      for (int64_t t0 = start[s]; t0 < start[s + 1]; t0 += kChunk) out.push_back({t0, start[s + 1] - t0 < kChunk ? start[s + 1] - t0 : kChunk});
    return out;
  }
  // The sequences' first chunks (the last entry: the count), then their starts: 2 (S + 1) entries.
  const std::vector<int64_t> &table() const { return table_; }

 private:
  std::vector<int64_t> table_;
};

}  // namespace hl::gdn
