// Pieces shared by the RMSNorm forward and backward kernels.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <type_traits>

#include "common/bulk_copy.cuh"
#include "common/cp_async.cuh"
#include "common/cuda_util.h"
#include "common/dtype.cuh"
#include "rmsnorm/config.h"

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

// The kernel shapes (config.h), cluster shapes only where the device runs the sm_90 code: the
// device query only for rows a cluster shape takes.
template <bool BWD>
int shape_for(int64_t packs, int64_t rows) {
  const int i = rmsnorm::shape_for<BWD>(packs, rows, true);
  return i >= 0 && Shapes<BWD>::at[i].cluster > 1 && code_arch() < 90 ? rmsnorm::shape_for<BWD>(packs, rows, false) : i;
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

// True when p and every row start (p + k * stride elements) are aligned to `bytes`.
inline bool rows_aligned(const void *p, int64_t stride, size_t elem, size_t bytes) {
  return !p || (reinterpret_cast<uintptr_t>(p) % bytes == 0 && (uint64_t(stride) * elem) % bytes == 0);
}

}  // namespace hl::rmsnorm::dev
