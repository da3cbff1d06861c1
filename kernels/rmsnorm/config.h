// Every tuning choice of the RMSNorm kernels, host-only (plain C++17: the kernels instantiate
// from these tables, and tests/c/test_config.cpp prints and checks them without a GPU). The
// reasons, with the measurements, are in docs/rmsnorm.md, "Tuning choices".
#pragma once

#include <cstdint>
#include <string>

namespace hl::rmsnorm {

// A register-cached kernel shape: a row of cols = VEC * TPR * VPT elements (VEC elements a 16-byte
// pack) is held by TPR threads, VPT packs each; a group takes rows_at_once rows at a time.
struct Shape {
  int tpr, vpt, rows_at_once, block;
  bool staged = false;    // (backward) the next rows load through Staging (cp.async)
  int64_t min_rows = 0;   // taken from this many rows on
  int cluster = 1;        // a row spans this many blocks of a cluster (sm_90 code), each a slice
  bool prefetch = false;  // the rows a group takes next are fetched into L2 while it works on these
};

// One table per direction; a row takes the first entry that holds its packs and whose min_rows
// the call reaches. Comments: the most packs an entry holds (bf16 columns).
template <bool BWD>
struct Shapes {
  static constexpr Shape at[] = {
      {8, 1, BWD ? 1 : 2, 256, BWD},   // <= 8 packs (64)
      {16, 1, BWD ? 1 : 2, 256, BWD},  // <= 16 (128)
      {32, 1, BWD ? 1 : 2, 256, BWD},  // <= 32 (256)
      {32, 2, 2, 256},                 // <= 64 (512)
      {BWD ? 32 : 128, BWD ? 4 : 1, 1, BWD ? 256 : 128, false, 0, 1, BWD},  // <= 128 (1024)
      {BWD ? 64 : 256, BWD ? 4 : 1, 1, BWD ? 64 : 256},                     // <= 256 (2048)
      {BWD ? 128 : 256, BWD ? 4 : 2, 1, BWD ? 128 : 256, false, BWD ? 0 : 2048},  // <= 512 (4096), many rows
      {128, 4, 1, 128},                                                     // <= 512 (4096)
      {256, 4, 1, 256, false, 0, 1, BWD},                                   // <= 1024 (8192)
      {BWD ? 256 : 512, 4, 1, BWD ? 256 : 512, false, 0, BWD ? 2 : 1, BWD},  // <= 2048 (16K)
      {BWD ? 512 : 1024, BWD ? 2 : 4, 1, BWD ? 512 : 1024, false, 0, BWD ? 4 : 1},  // <= 4096 (32K)
      {512, BWD ? 2 : 4, 1, 512, false, 0, BWD ? 8 : 4, !BWD},  // <= 8192 (64K)
      {512, BWD ? 2 : 4, 1, 512, false, 0, 8, !BWD},  // <= 16384 (128K); the backward's is the one above
  };
};
template <bool BWD>
constexpr int kNumShapes = int(sizeof(Shapes<BWD>::at) / sizeof(Shape));

// Index of the first shape that holds `packs` packs a row with at least its min_rows rows, or -1
// when none does; cluster shapes only with `clusters` (the device runs the sm_90 code).
template <bool BWD>
int shape_for(int64_t packs, int64_t rows, bool clusters) {
  for (int i = 0; i < kNumShapes<BWD>; ++i) {
    const Shape &s = Shapes<BWD>::at[i];
    if (packs <= int64_t(s.tpr) * s.vpt * s.cluster && rows >= s.min_rows && (s.cluster == 1 || clusters))
      return i;
  }
  return -1;
}

// Backward blocks of up to 256 threads keep the weight in registers across their rows.
constexpr bool cache_weight(int block) { return block <= 256; }
template <int BLOCK>
constexpr bool kCacheWeight = cache_weight(BLOCK);
// Backward register kernels that sum the partial dw rows themselves after a grid barrier
// (cooperative launch): a block a row of at least 256 threads.
constexpr bool can_fuse_dw(int tpr, int block, int cluster) { return cluster == 1 && tpr == block && block >= 256; }
template <int TPR, int BLOCK, int CL>
constexpr bool kCanFuseDw = can_fuse_dw(TPR, BLOCK, CL);

// Rows no shape takes (unaligned, or longer than the tables): the forward a block a row, reading
// the row twice; the backward per-row statistics, then 32 x kTileY tiles over row chunks (about
// kTilesPerSm blocks an SM, at most kMaxTileChunks chunks: partial dw rows).
constexpr int kFwdRowsBlock = 512;
constexpr int kStatsBlock = 512;
constexpr int kTileY = 8;
constexpr int kTilesPerSm = 4;
constexpr int64_t kMaxTileChunks = 1024;
// The partial dw rows' sum (after the register or tiled kernels): a block a 32-column tile.
constexpr int kDwReduceBlock = 1024;

// What a call of `rows` x `cols` elements of `elem` bytes, rows 16-byte aligned, runs.
struct Choice {
  bool bwd;
  int shape;  // into Shapes<bwd>, or -1: the rows kernel (forward) or the tiled kernels (backward)
};
inline Choice choose(bool bwd, int64_t rows, int64_t cols, int elem, bool clusters) {
  const int vec = 16 / elem;
  const int64_t packs = cols % vec ? -1 : cols / vec;
  const int shape = packs < 0 ? -1 : bwd ? shape_for<true>(packs, rows, clusters) : shape_for<false>(packs, rows, clusters);
  return {bwd, shape};
}

inline std::string describe(const Choice &c) {
  if (c.shape < 0) return c.bwd ? "tiled: stats " + std::to_string(kStatsBlock) + " threads, tiles 32 x " +
                                      std::to_string(kTileY)
                                : "rows: a block of " + std::to_string(kFwdRowsBlock) + " a row";
  const Shape &s = c.bwd ? Shapes<true>::at[c.shape] : Shapes<false>::at[c.shape];
  std::string d = "shape " + std::to_string(c.shape) + ": " + std::to_string(s.tpr) + " threads x " +
                  std::to_string(s.vpt) + " packs a row, " + std::to_string(s.rows_at_once) + " rows at once, block " +
                  std::to_string(s.block);
  if (s.cluster > 1) d += ", cluster " + std::to_string(s.cluster);
  if (s.min_rows) d += ", from " + std::to_string(s.min_rows) + " rows";
  if (s.staged) d += ", staged";
  if (s.prefetch) d += ", L2 prefetch";
  if (c.bwd && cache_weight(s.block)) d += ", weight in registers";
  if (c.bwd && can_fuse_dw(s.tpr, s.block, s.cluster)) d += ", dw summed in the kernel (cooperative)";
  return d;
}

}  // namespace hl::rmsnorm
