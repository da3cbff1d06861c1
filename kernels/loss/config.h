// Every tuning choice of the loss plan's CUDA kernels and products, and its environment switch,
// host-only (plain C++17: the kernels take their constants from here, and tests/c/test_config.cpp
// prints and checks the choices without a GPU). The reasons, with the measurements, are in
// docs/loss.md, "Tuning choices".
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace hl::loss {

// The row kernel: CTAs of kThreads threads, kMinBlocks of them an SM (2 with a teacher), each
// thread kBatch 16-byte loads in flight before it uses any.
constexpr int kThreads = 256;
constexpr int kMinBlocks = 3;
constexpr int kBatch = 4;
// The bulk-copy kernels stream a slice through shared memory in chunks of kChunkPacks 16-byte packs
// (4 a thread, 16 KB); a slice has at most kMaxChunks of them.
constexpr int kChunkPacks = 4 * kThreads;
constexpr int kMaxChunks = 16;
constexpr int kMaxCluster = 16;  // CTAs a row may be split over (Hopper's non-portable maximum)
// A row's slices: the smallest cluster whose slice is at most kKeepTarget bytes (3 CTAs an SM), or
// with a dense teacher whose two slices are at most kKeepTargetTeacher (2 CTAs an SM).
constexpr size_t kKeepTarget = 72 * 1024;
constexpr size_t kKeepTargetTeacher = 100 * 1024;
constexpr size_t kStaticSmemSlack = 8 * 1024;  // the kernel's own shared memory, rounded up
// The prep kernel: 128-thread CTAs (small enough to be resident beside three row CTAs), one per
// kPrepRowsPerThread x 128 rows, in one cluster of up to kSmallCluster.
constexpr int kPrepThreads = 128;
constexpr int kPrepRowsPerThread = 16;
constexpr int kSmallCluster = 8;
// The reduce kernel: a CTA sums kReduceThreads x kReduceBatch records.
constexpr int kReduceThreads = 256, kReduceBatch = 4;
constexpr int kTopkCheckCtas = 1024;  // the sparse teacher's id check: at most this many CTAs
constexpr int kSeqThreads = 256, kMaxSeqCtas = 2048;  // the per-sequence sums
constexpr int kRowWarps = 8;  // the shifted path's row kernels: rows a CTA, a warp a row
// The fused linear form: chunks of up to kFastRows rows where the workspace allows (a plan of one rank).
constexpr int64_t kFastRows = 4096;
// cuBLASLt's share of a workspace too small for every row: 1 / kGemmShare of what is left past one
// row, at most kGemmWorkspace (docs/loss.md "Workspace and chunking").
constexpr size_t kGemmShare = 8;

// cuBLASLt: of the heuristic's first kAnswers answers, the first, unless one has a tile measured
// faster for the product's form (and no split-K); in order of preference, {0, 0} for none.
constexpr int kAnswers = 8;
struct Tile {
  int rows, cols;
};
struct GemmTiles {
  Tile want[2];
};
// A product D = op(A) op(B) with op(A) m rows (the hidden size for grad_weight).
inline GemmTiles gemm_tiles(bool ta, bool tb, int64_t m) {
  if (ta && !tb) return {{{176, 128}, {168, 128}}};           // logits = W X^T
  if (!ta && tb) return {{m <= 4096 ? Tile{128, 160} : Tile{0, 0}, {256, 128}}};  // grad_weight (+)= G^T X
  return {};                                                  // grad_hidden = G W: the first answer
}

// HEADLOSS_LINEAR_PATH=rows: the fused linear form never takes the shifted path (tests, A/B timing);
// read when a plan is created.
inline bool linear_path_rows() {
  const char *e = std::getenv("HEADLOSS_LINEAR_PATH");
  return e && std::strcmp(e, "rows") == 0;
}

// Columns a CTA when a row is split over `cluster` CTAs: a whole number of 16-byte vectors of `vec`.
inline int64_t slice_cols(int64_t vocab, int cluster, int vec) {
  const int64_t per = (vocab + cluster - 1) / cluster;
  return (per + vec - 1) / vec * vec;
}

// The row kernels' shape for a plan: logits of `elt` bytes, rows of `vocab`, `optin` bytes of shared
// memory a CTA may take, `sm90` when the device runs the sm_90 code, `teacher` with a dense
// teacher's slice beside the logits' in the bulk kernels. The smallest cluster whose slice fits the
// target (Hopper clusters go to 8 CTAs portably, 16 with the non-portable opt-in); a row too long
// for that is re-read from global memory.
struct RowShape {
  int cluster;        // CTAs a row (the whole-row and split kernels)
  bool keep_row;      // the slice stays in shared memory (else pass 2 re-reads it)
  int bulk_cluster;   // CTAs a row of the bulk-copy kernels
  bool bulk;          // the bulk-copy kernels can run (sm_90, the row kept, the slices fit)
  size_t slice_bytes, bulk_bytes;  // a CTA's shared memory: the row kernel's slice, the bulk kernels'
  size_t smem_cap;    // the most a CTA asks for (optin less the kernels' own)
  int small_cluster;  // the prep kernel's most CTAs
  bool early_start;   // the row kernel launched to start while prep runs
};
inline RowShape row_shape(int64_t vocab, size_t elt, size_t optin, bool sm90, bool teacher) {
  const size_t cap = optin - kStaticSmemSlack, slices = teacher ? 2 : 1;
  const auto bytes = [&](int cl) { return size_t(slice_cols(vocab, cl, int(16 / elt))) * elt; };
  const int most = sm90 ? kMaxCluster : 1;
  RowShape s{};
  s.cluster = 1;
  while (s.cluster < most && bytes(s.cluster) > kKeepTarget) s.cluster *= 2;
  s.keep_row = bytes(s.cluster) <= cap;
  if (!s.keep_row && s.cluster > 8) s.cluster = 8;  // re-read anyway: a portable cluster
  s.bulk_cluster = teacher ? 1 : s.cluster;
  while (teacher && s.bulk_cluster < most && 2 * bytes(s.bulk_cluster) > kKeepTargetTeacher) s.bulk_cluster *= 2;
  s.slice_bytes = bytes(s.cluster);
  s.bulk_bytes = slices * bytes(s.bulk_cluster);
  s.smem_cap = cap;
  s.bulk = sm90 && s.keep_row && bytes(s.bulk_cluster) <= size_t(kMaxChunks) * kChunkPacks * 16 && s.bulk_bytes <= cap;
  s.small_cluster = sm90 ? kSmallCluster : 1;
  s.early_start = sm90;
  return s;
}

inline std::string describe(const RowShape &s) {
  std::string d = "rows: cluster " + std::to_string(s.cluster) + ", " +
                  (s.keep_row ? "slice of " + std::to_string(s.slice_bytes) + " bytes kept" : std::string("re-read"));
  d += s.bulk ? "; bulk: cluster " + std::to_string(s.bulk_cluster) + ", " + std::to_string(s.bulk_bytes) + " bytes"
              : "; no bulk";
  d += "; prep cluster " + std::to_string(s.small_cluster) + (s.early_start ? ", early start" : "");
  return d;
}

inline std::string describe(const GemmTiles &t) {
  std::string d;
  for (const Tile &w : t.want)
    if (w.rows) d += (d.empty() ? "" : ", then ") + std::to_string(w.rows) + " x " + std::to_string(w.cols);
  return d.empty() ? "the heuristic's first answer" : d + ", else the first answer";
}

}  // namespace hl::loss
