// Pieces shared by the RMSNorm forward and backward kernels.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <type_traits>

#include "common/bulk_copy.cuh"
#include "common/cp_async.cuh"
#include "common/cuda_util.h"
#include "common/dtype.cuh"

namespace hl::rmsnorm::dev {
using namespace hl::dev;

// offset + w[col] as the casting mode uses it (rounded to x's dtype in NONE mode); 1 without a
// weight. Read once per thread and kept in registers across rows.
template <class Tx>
__device__ __forceinline__ float weight_factor(const void *w, hl_dtype_t wdt, float offset,
                                               bool none_mode, int64_t col) {
  if (!w) return 1.0f;
  const float f = offset + load_as_float(w, wdt, col);
  return none_mode ? round_to<Tx>(f) : f;
}

// Weight factors of the VEC columns starting at col (0 past the end of the row). w_vec: the
// weight is aligned for one VEC-element access (used only for packs inside the row).
template <class Tw, int VEC>
__device__ __forceinline__ void load_weights(const void *w, int64_t col, float (&f)[VEC]) {
  to_floats(load_pack<Tw, VEC>(static_cast<const Tw *>(w) + col), f);
}
// w -> offset + w, rounded to x's dtype in NONE mode.
template <class Tx, int VEC>
__device__ __forceinline__ void add_offset(float *wf, float offset, bool none_mode) {
#pragma unroll
  for (int e = 0; e < VEC; ++e) wf[e] = none_mode ? round_to<Tx>(offset + wf[e]) : offset + wf[e];
}
// The weight factors of a thread's VPT packs at columns col0 + v * stride. Where every pack is
// inside the row and aligned, all VPT loads are issued before the first is converted (a pack at a
// time, a branch on the dtype each, put a memory round trip per pack at the start of every backward
// block); otherwise each pack on its own, element by element where it is not.
template <class Tx, int VPT, int VEC>
__device__ __forceinline__ void weight_packs(const void *w, hl_dtype_t wdt, float offset, bool none_mode,
                                             bool w_vec, int64_t col0, int64_t stride, int64_t cols,
                                             float (&wf)[VPT][VEC]) {
  if (w && w_vec && col0 + (VPT - 1) * stride + VEC <= cols) {
    auto all = [&](auto tag) {
#pragma unroll
      for (int v = 0; v < VPT; ++v) load_weights<typename decltype(tag)::type, VEC>(w, col0 + v * stride, wf[v]);
    };
    if (wdt == HL_DTYPE_BF16) all(TypeTag<__nv_bfloat16>{});
    else if (wdt == HL_DTYPE_F16) all(TypeTag<__half>{});
    else all(TypeTag<float>{});
#pragma unroll
    for (int v = 0; v < VPT; ++v) add_offset<Tx, VEC>(wf[v], offset, none_mode);
  } else if constexpr (VPT > 1) {
#pragma unroll
    for (int v = 0; v < VPT; ++v)
      weight_packs<Tx, 1, VEC>(w, wdt, offset, none_mode, w_vec, col0 + v * stride, 0, cols,
                               reinterpret_cast<float (&)[1][VEC]>(wf[v]));
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e)
      wf[0][e] = col0 + e < cols ? weight_factor<Tx>(w, wdt, offset, none_mode, col0 + e) : 0.0f;
  }
}
// weight_packs for one pack.
template <class Tx, int VEC>
__device__ __forceinline__ void weight_pack(const void *w, hl_dtype_t wdt, float offset,
                                            bool none_mode, bool w_vec, int64_t col, int64_t cols,
                                            float (&wf)[VEC]) {
  weight_packs<Tx, 1, VEC>(w, wdt, offset, none_mode, w_vec, col, 0, cols, reinterpret_cast<float (&)[1][VEC]>(wf));
}

// weight_pack with the weight's dtype Tw known at compile time and its rows 16-byte aligned (the
// common case: one vector load, no run-time dtype switch, ~20 fewer registers), or WeightAny:
// weight_pack as above (no weight, an unaligned one, or a dtype other than x's or fp32).
struct WeightAny {};
template <class Tx, class Tw, int VEC>
__device__ __forceinline__ void weight_pack_as(const void *w, hl_dtype_t wdt, float offset, bool none_mode,
                                               bool w_vec, int64_t col, int64_t cols, float (&wf)[VEC]) {
  if constexpr (std::is_same_v<Tw, WeightAny>) {
    weight_pack<Tx, VEC>(w, wdt, offset, none_mode, w_vec, col, cols, wf);
  } else {
    load_weights<Tw, VEC>(w, col, wf);
    add_offset<Tx, VEC>(wf, offset, none_mode);
  }
}

// Calls f(TypeTag<Tw>{}) for the weight_pack_as kind that fits: x's dtype or fp32 as packs, else
// WeightAny.
template <class Tx, class F>
hl_status_t with_weight_kind(const void *w, hl_dtype_t wdt, bool w_vec, F &&f) {
  if (w && w_vec && wdt == kDtypeOf<Tx>) return f(TypeTag<Tx>{});
  if constexpr (!std::is_same_v<Tx, float>)
    if (w && w_vec && wdt == HL_DTYPE_F32) return f(TypeTag<float>{});
  return f(TypeTag<WeightAny>{});
}

// Sum over the threads that share a row: a sub-warp group of TPR (a butterfly: every lane gets
// the sum, no broadcast), a whole block (CUB and shared memory), or the CL whole blocks of a
// cluster: each block's sum goes to every rank by st.async, completing on that rank's mbarrier,
// and the CL sums are added in rank order (every rank gets the same bits). Not a cluster barrier:
// its release compiles to MEMBAR.GPU, a wait for the block's earlier global stores (H100, backward
// 2048 x 32768: 240 -> 230 us without it). Two slots, alternating, so a slot is reused only after
// every rank has read it (a rank sends row n + 2 only after receiving row n + 1 from all, which
// each sent after its own block's threads had read row n). One object per thread; start() runs
// in every thread before the first sum.
template <int TPR, int BLOCK, int CL = 1>
struct RowSum {
  static_assert(TPR <= 32 || TPR == BLOCK, "a row is a sub-warp group or whole blocks");
  static_assert(CL == 1 || TPR == BLOCK, "a row spans CL whole blocks");
  struct Storage {
    typename cub::BlockReduce<float, BLOCK>::TempStorage reduce;
    float total[CL > 1 ? 2 * CL : 1];
    uint64_t full[CL > 1 ? 2 : 1];  // a slot's CL sums have landed
  };
  unsigned calls = 0;
  __device__ __forceinline__ void start(Storage &s) {
    if constexpr (CL > 1) {
      if (threadIdx.x == 0) mbar_init(&s.full[0], 1), mbar_init(&s.full[1], 1);
      cluster_barrier();  // every rank's barriers exist before a peer sends to them
    }
  }
  __device__ __forceinline__ float sum(float v, Storage &s) {
    if constexpr (TPR <= 32) {
#pragma unroll
      for (int o = TPR / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
      return v;
    } else if constexpr (CL == 1) {
      const float t = cub::BlockReduce<float, BLOCK>(s.reduce).Sum(v);
      if (threadIdx.x == 0) s.total[0] = t;
      __syncthreads();
      const float r = s.total[0];
      __syncthreads();  // the storage is reused by the next row
      return r;
    } else {
      const float t = cub::BlockReduce<float, BLOCK>(s.reduce).Sum(v);
      const unsigned slot = calls & 1, parity = (calls >> 1) & 1;
      ++calls;
      float *const sums = s.total + slot * CL;
      if (threadIdx.x == 0) {
        mbar_expect_tx(&s.full[slot], CL * sizeof(float));
        for (int c = 0; c < CL; ++c) st_async_peer(sums + cluster_rank(), t, &s.full[slot], c);
      }
      mbar_wait_cluster(&s.full[slot], parity);
      float r = 0.0f;
#pragma unroll
      for (int c = 0; c < CL; ++c) r += sums[c];
      return r;
    }
  }
};

// The next rows' packs, staged in shared memory by cp.async while the current rows reduce and
// store: loads stay in flight through a persistent block's whole loop without the registers a
// second set of packs would take. A thread reads back only the packs it copied, so no barrier
// is needed; two stages, so a stage is refilled only after its packs were used. N: packs a
// thread stages a row group, each of at most 16 bytes.
template <int N, int BLOCK>
struct Staging {
  static constexpr size_t kBytes = size_t(2) * N * BLOCK * 16;
  uint4 *buf;  // [2][N][BLOCK] slots of up to 16 bytes: consecutive threads, consecutive slots
  // Pack k of `stage` from src, or zeros when !valid (src must still be a valid address).
  template <class T, int VEC>
  __device__ __forceinline__ void copy(int stage, int k, const T *src, bool valid) const {
    cp_async_bytes<sizeof(Pack<T, VEC>)>(buf + (stage * N + k) * BLOCK + threadIdx.x, src, valid);
  }
  template <class T, int VEC>
  __device__ __forceinline__ Pack<T, VEC> read(int stage, int k) const {
    return *reinterpret_cast<const Pack<T, VEC> *>(buf + (stage * N + k) * BLOCK + threadIdx.x);
  }
};

// Starts L2 fills of rows [row, row + R) (those below `rows`) of a tensor of T, columns [col0,
// col0 + W): one thread of a group, for the rows the group takes next. Rows 16-byte aligned and
// cols a multiple of 16 bytes, as the register kernels require.
template <class T, int R>
__device__ __forceinline__ void prefetch_rows(const void *base, int64_t stride, int64_t row, int64_t rows,
                                              int64_t col0, int W, int64_t cols) {
  const int64_t n = cols - col0 < W ? cols - col0 : W;
  if (n <= 0) return;
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (row + r < rows) prefetch_l2(static_cast<const T *>(base) + (row + r) * stride + col0, uint32_t(n * sizeof(T)));
}

// Register-cached kernel shapes: a row of cols = VEC * TPR * VPT elements is held by TPR threads,
// VPT packs of VEC elements each; a group processes R rows at a time so that enough loads are in
// flight for short rows. A row takes the first shape that holds its packs (up to 4096 a block,
// 16384 across a cluster) and whose min_rows the call reaches.
// In the backward (a persistent grid), blocks of up to 256 threads keep the weight in registers
// across the rows they visit; larger blocks, and the forward, read it per row from L1. One table
// per direction (the backward holds x and dy and sums dw); the choices are measured on H100
// (bench/notes/rmsnorm.md).
struct Shape {
  int tpr, vpt, rows_at_once, block;
  bool staged = false;  // (backward) the next rows load through Staging
  int64_t min_rows = 0;  // taken from this many rows on
  int cluster = 1;       // a row spans this many blocks of a cluster (sm_90 code), each a slice
  bool prefetch = false;  // the rows a group takes next are fetched into L2 while it works on these
};
template <bool BWD>
struct Shapes {
  static constexpr Shape at[] = {
      // Short rows: 2 rows a group in the forward, 1 in the backward, beat 4 (H100: fwd 90 -> 91%,
      // bwd 70 -> 83% of copy at 128 columns). The backward stages its next rows (83/84 -> 86/87%
      // at 128/256 columns); staging lost everywhere else (forward 128: 91 -> 83%, backward 2048:
      // 94 -> 88%, 16384: 83 -> 57%, or 61% with whole rows by bulk copies), where one block per
      // row group (forward) or more resident warps (backward) hide the latency better.
      {8, 1, BWD ? 1 : 2, 256, BWD},   // <= 8 packs   (64 bf16)
      {16, 1, BWD ? 1 : 2, 256, BWD},  // <= 16        (128)
      {32, 1, BWD ? 1 : 2, 256, BWD},  // <= 32        (256)
      {32, 2, 2, 256},   // <= 64        (512)
      // <= 128 (1024) and <= 256 (2048): the forward a block a row of one pack a thread, the weight
      // loaded with x (Liger's shape: 28 registers, 64 warps an SM; H100 131072 x 1024: 182.4 ->
      // 180.1 us, 65536 x 2048: 181.9 -> 181.2, against 8 rows of 32 x 4 a block and a row of 64 x 4).
      // The backward in 8 rows of 32 x 4 a block (193 registers: one block an SM, so its next rows
      // go to L2 ahead; H100 131072 x 1024: 331 -> 309 us), then a block a row of 64 x 4.
      {BWD ? 32 : 128, BWD ? 4 : 1, 1, BWD ? 256 : 128, false, 0, 1, BWD},
      {BWD ? 64 : 256, BWD ? 4 : 1, 1, BWD ? 64 : 256},
      // <= 512 (4096): the forward in 256 threads of 2 packs from 2048 rows (H100 32768 x 4096: 97 ->
      // 98% of copy), 128 of 4 below (1024 x 4096: 8.8 us, 9.4 with 256 x 2). In the backward this
      // entry is the next one (the same kernel).
      {BWD ? 128 : 256, BWD ? 4 : 2, 1, BWD ? 128 : 256, false, BWD ? 0 : 2048},
      {128, 4, 1, 128},
      {256, 4, 1, 256, false, 0, 1, BWD},  // <= 1024 (8192); backward prefetch: 16384 x 8192 349 -> 303-312 us
      // <= 2048 (16384): the forward in 512 threads of 4 packs (63 registers, two blocks an SM; Liger's
      // shape); the backward in clusters of 2 of the entry above, a half row each (H100 8192 x 16384:
      // 318-325 -> 310 us, 2048 x 16384 105 -> 96), which beat a block of 512 threads of 4 packs
      // (118 registers, one block an SM) and 1024 threads of 2.
      {BWD ? 256 : 512, 4, 1, BWD ? 256 : 512, false, 0, BWD ? 2 : 1, BWD},
      // <= 4096 (32K): the forward in 1024 threads of 4 packs (64 registers, one block an SM; 2048 x
      // 32768: 106 us in clusters of 2, 111 reading the row twice, 96.6 so; the fused residual
      // spills 60-100 bytes there). Longer rows span a cluster of blocks, up to 8 (the portable
      // most): 128K bf16 columns in the forward, 64K in the backward, where 4 packs a thread
      // spill (bench/notes/rmsnorm.md, "RMSNorm v9": forward 1024 x 65536 140 -> 119 us, 512 x 131072 153
      // -> 124; backward 2048 x 32768 268 -> 231, 1024 x 65536 255 -> 241).
      {BWD ? 512 : 1024, BWD ? 2 : 4, 1, BWD ? 512 : 1024, false, 0, BWD ? 4 : 1},
      {512, BWD ? 2 : 4, 1, 512, false, 0, BWD ? 8 : 4, !BWD},  // <= 8192 packs (64K)
      {512, BWD ? 2 : 4, 1, 512, false, 0, 8, !BWD},  // <= 16384 packs (128K); the backward's is the
                                                 // entry above
  };
};
template <bool BWD>
constexpr int kNumShapes = int(sizeof(Shapes<BWD>::at) / sizeof(Shape));

// Index of the first shape that holds `packs` packs per row with at least its min_rows rows, or
// -1 when none does. Cluster shapes only where the device runs the sm_90 code.
template <bool BWD>
int shape_for(int64_t packs, int64_t rows) {
  for (int i = 0; i < kNumShapes<BWD>; ++i) {
    const Shape &s = Shapes<BWD>::at[i];
    // code_arch() only for cluster shapes: short rows' calls skip its device query
    if (packs <= int64_t(s.tpr) * s.vpt * s.cluster && rows >= s.min_rows && (s.cluster == 1 || code_arch() >= 90))
      return i;
  }
  return -1;
}

// Calls f(std::integral_constant<int, I>{}) for I == idx, turning a shape index into a constant.
template <bool BWD, int I = 0, class F>
hl_status_t with_shape(int idx, F &&f) {
  if constexpr (I < kNumShapes<BWD>) {
    if (idx == I) return f(std::integral_constant<int, I>{});
    return with_shape<BWD, I + 1>(idx, static_cast<F &&>(f));
  } else {
    return HL_STATUS_INTERNAL_ERROR;
  }
}

template <int BLOCK>
constexpr bool kCacheWeight = BLOCK <= 256;

// True when p and every row start (p + k * stride elements) are aligned to `bytes`.
inline bool rows_aligned(const void *p, int64_t stride, size_t elem, size_t bytes) {
  return !p || (reinterpret_cast<uintptr_t>(p) % bytes == 0 && (uint64_t(stride) * elem) % bytes == 0);
}

}  // namespace hl::rmsnorm::dev
