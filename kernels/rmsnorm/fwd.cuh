// RMSNorm forward kernels. Rows that fit in registers (up to 4096 16-byte packs a block, 32K
// bf16; 128K across a cluster of blocks on sm_90) take rmsnorm_fwd_regs: one HBM read of x (and
// the residual), one write of y (and the sum), rstd only when asked. Longer or unaligned rows take
// rmsnorm_fwd_rows, a block per row that reads the row twice (the second time mostly from L2).
// Each x dtype's kernels compile in a translation unit of their own (fwd_<dtype>.cu), in
// parallel; fwd.cu picks the unit.
#pragma once

#include <cstdint>

#include "common/cuda_util.h"
#include "rmsnorm/common.cuh"
#include "rmsnorm/launch.h"

namespace hl::rmsnorm::dev {

struct FwdParams {
  int64_t rows, cols;
  const void *x;
  int64_t xs;
  const void *res;
  int64_t rs;
  void *res_out;
  int64_t ros;
  const void *w;
  hl_dtype_t wdt;
  float offset;
  void *y;
  int64_t ys;
  float *rstd;
  float eps, inv_cols;
  bool round_mid;  // LLAMA and NONE round s * rstd to x's dtype
  bool none_mode;  // NONE also rounds rstd and offset + w
  bool w_vec;      // the weight can be read in 16-byte packs
  int64_t ahead;   // PF: rows from a block's rows to those of the block that will take its place
};

// The forward for x of dtype Tx (instantiated by fwd_<dtype>.cu): y's dtype, then the kernel.
template <class Tx>
hl_status_t fwd_x(const FwdParams &p, hl_dtype_t y_dtype, hl_stream_t stream);

namespace {
// s = x (+ residual, rounded to x's dtype, and then stored to residual_out at once) for one pack.
// The residual is a compile-time choice. Storing s here rather than with y frees its address and
// packs before the row sum (ptxas: 16K columns 102 -> 56 registers, 2 blocks an SM instead of 1;
// 4096 columns 79 -> 55).
template <bool RES, class Tx, int VEC>
__device__ __forceinline__ void load_s(const FwdParams &p, int64_t row, int64_t col,
                                       Pack<Tx, VEC> &s) {
  s = load_pack<Tx, VEC>(static_cast<const Tx *>(p.x) + row * p.xs + col);
  if constexpr (RES) {
    const Pack<Tx, VEC> r = load_pack<Tx, VEC>(static_cast<const Tx *>(p.res) + row * p.rs + col);
#pragma unroll
    for (int e = 0; e < VEC; ++e) s.v[e] = from_float<Tx>(to_float(s.v[e]) + to_float(r.v[e]));
    store_pack(static_cast<Tx *>(p.res_out) + row * p.ros + col, s);
  }
}

template <class Tx, class Ty, int VEC>
__device__ __forceinline__ void store_y(const FwdParams &p, int64_t row, int64_t col,
                                        const Pack<Tx, VEC> &s, float rstd, const float *wf) {
  Pack<Ty, VEC> y;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    float v = to_float(s.v[e]) * rstd;
    if (p.round_mid) v = round_to<Tx>(v);
    y.v[e] = from_float<Ty>(v * wf[e]);
  }
  store_pack(static_cast<Ty *>(p.y) + row * p.ys + col, y);
}

// A block a row, no residual, x, y and the weight of one 16-bit dtype: the weight's packs load
// with x and are converted only at the store, which shortens a block's last phase (H100: 2048 x
// 16384 50.9 -> 50.0 us, 512 x 16384 15.0 -> 14.4, 2048 x 8192 28.3 -> 27.2). At 4 packs a thread
// only in blocks of 256 or 512 threads (64 registers, as before); at 1 pack (the 1024- and
// 2048-column rows, 28 registers) always. Elsewhere the packs cost occupancy (smaller blocks) or
// spill (fp32, a residual, clusters).
template <bool RES, class Tx, class Ty, class Tw, int TPR, int VPT, int BLOCK, int CL>
constexpr bool kEarlyWeight = !RES && std::is_same_v<Tw, Tx> && std::is_same_v<Ty, Tx> && sizeof(Tx) == 2 &&
                              TPR == BLOCK && (VPT == 1 || VPT == 4 && (BLOCK == 256 || BLOCK == 512)) && CL == 1;

// An empty asm the packs pass through: the compiler cannot convert them before this point (at the
// load it did: 99 registers at 16K columns).
template <class P, int N>
__device__ __forceinline__ void hold_raw(P (&packs)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    uint32_t *u = reinterpret_cast<uint32_t *>(&packs[k]);
#pragma unroll
    for (int i = 0; i < int(sizeof(P) / 4); ++i) asm volatile("" : "+r"(u[i]));
  }
}

__device__ __forceinline__ float row_rstd(const FwdParams &p, float sumsq) {
  return rsqrtf(sumsq * p.inv_cols + p.eps);
}

// CL > 1: a row spans the CL blocks of a cluster, rank c holding columns [c W, (c + 1) W).
// PF: the rows of the block (cluster) that will take this one's place are fetched into L2 while
// this one works. H100, clusters: 1024 x 65536 119 -> 110 us, 512 x 131072 124 -> 113; a block a
// row lost with it (8192 x 16384 182 -> 204, 65536 x 2048 182 -> 220).
template <bool RES, class Tx, class Ty, class Tw, int VEC, int TPR, int VPT, int R, int BLOCK, int CL, bool PF>
__global__ void __launch_bounds__(BLOCK, kEarlyWeight<RES, Tx, Ty, Tw, TPR, VPT, BLOCK, CL> ? 1024 / BLOCK : 0)
    rmsnorm_fwd_regs(const FwdParams p) {
  if constexpr (CL > 1 && !kClusterCode) return;
  RowSum<TPR, BLOCK, CL> row_sum;
  __shared__ typename decltype(row_sum)::Storage smem;
  constexpr int G = BLOCK / TPR, W = TPR * VPT * VEC;
  constexpr bool kEarlyW = kEarlyWeight<RES, Tx, Ty, Tw, TPR, VPT, BLOCK, CL>;
  const int lane = threadIdx.x % TPR, group = threadIdx.x / TPR;
  // One row group a block (cluster), no loop: a grid-stride loop's 64-bit state cost registers
  // (89 -> 56 in the 16K clusters with a weight of another dtype) and spilled 4 bytes at 16K
  // columns (H100: 8192 x 16384 182.3 -> 181.1 us without it). The host keeps grids under 2^31
  // blocks. Columns fit 32 bits (at most 128K here).
  const int64_t row0 = int64_t(blockIdx.x / CL) * (G * R) + group * R;
  const int col0 = CL > 1 ? int(cluster_rank()) * W : 0, cols = int(p.cols);
  row_sum.start(smem);

  // The weight is read at the store (or with x: kEarlyWeight), a pack at a time (L1 hits after the
  // first row): an fp32 copy kept in registers across rows doubled the registers (H100: 96 against
  // Liger's 38 at 4096 columns) and cut the resident warps, while a block sees only R rows.
  if constexpr (PF)
    if (lane == 0) {
      prefetch_rows<Tx, R>(p.x, p.xs, row0 + p.ahead, p.rows, col0, W, p.cols);
      if constexpr (RES) prefetch_rows<Tx, R>(p.res, p.rs, row0 + p.ahead, p.rows, col0, W, p.cols);
    }
  Pack<Tx, VEC> s[R][VPT];
  Pack<std::conditional_t<kEarlyW, Tw, Tx>, VEC> wraw[kEarlyW ? VPT : 1];
  if constexpr (kEarlyW) {
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
      const int col = col0 + (v * TPR + lane) * VEC;
      if (col < cols) wraw[v] = load_pack<Tw, VEC>(static_cast<const Tw *>(p.w) + col);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
      const int col = col0 + (v * TPR + lane) * VEC;
      if (row0 + r < p.rows && col < cols) {
        load_s<RES>(p, row0 + r, col, s[r][v]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) s[r][v].v[e] = from_float<Tx>(0.0f);
      }
    }
  float rstd[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float ss = 0.0f;
#pragma unroll
    for (int v = 0; v < VPT; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) ss += to_float(s[r][v].v[e]) * to_float(s[r][v].v[e]);
    rstd[r] = row_rstd(p, row_sum.sum(ss, smem));
  }
  if constexpr (kEarlyW) hold_raw(wraw);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t row = row0 + r;
    if (row >= p.rows) break;
    if (p.rstd && lane == 0 && col0 == 0) p.rstd[row] = rstd[r];
    const float rr = p.none_mode ? round_to<Tx>(rstd[r]) : rstd[r];
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
      const int col = col0 + (v * TPR + lane) * VEC;
      if (col >= cols) continue;
      float wf[VEC];
      if constexpr (kEarlyW) {
        to_floats(wraw[v], wf);
        add_offset<Tx, VEC>(wf, p.offset, p.none_mode);
      } else {
        weight_pack_as<Tx, Tw, VEC>(p.w, p.wdt, p.offset, p.none_mode, p.w_vec, col, p.cols, wf);
      }
      store_y<Tx, Ty, VEC>(p, row, col, s[r][v], rr, wf);
    }
  }
}

// Any row length and alignment: a block per row, two passes (sum of squares, then y).
template <bool RES, class Tx, class Ty, int VEC, int BLOCK>
__global__ void __launch_bounds__(BLOCK) rmsnorm_fwd_rows(const FwdParams p) {
  RowSum<BLOCK, BLOCK> row_sum;
  __shared__ typename decltype(row_sum)::Storage smem;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    float ss = 0.0f;
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < p.cols; col += int64_t(BLOCK) * VEC) {
      Pack<Tx, VEC> s;
      load_s<RES>(p, row, col, s);
#pragma unroll
      for (int e = 0; e < VEC; ++e) ss += to_float(s.v[e]) * to_float(s.v[e]);
    }
    const float rstd = row_rstd(p, row_sum.sum(ss, smem));
    if (p.rstd && threadIdx.x == 0) p.rstd[row] = rstd;
    const float rr = p.none_mode ? round_to<Tx>(rstd) : rstd;
    // The second pass reads s back (from residual_out when fused: this thread wrote it).
    const Tx *src = static_cast<const Tx *>(RES ? p.res_out : p.x);
    const int64_t ss_stride = RES ? p.ros : p.xs;
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < p.cols; col += int64_t(BLOCK) * VEC) {
      const Pack<Tx, VEC> s = load_pack<Tx, VEC>(src + row * ss_stride + col);
      float wf[VEC];
      weight_pack<Tx, VEC>(p.w, p.wdt, p.offset, p.none_mode, p.w_vec, col, p.cols, wf);
      store_y<Tx, Ty, VEC>(p, row, col, s, rr, wf);
    }
  }
}

// One block per row group, not a persistent grid of SMs x occupancy blocks: the block scheduler
// then overlaps one block's reduction and stores with the next one's loads (docs/rmsnorm.md,
// "Tuning choices"). `blocks` row groups, each a block or a cluster.
template <class Kernel>
hl_status_t launch(Kernel kernel, int block, int64_t blocks, const FwdParams &p, hl_stream_t stream,
                   int cluster = 1) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg =
      cluster_launch(blocks * cluster, block, 0, cluster, static_cast<cudaStream_t>(stream), attr);
  HL_CUDA_TRY(cudaLaunchKernelEx(&cfg, kernel, p));
  HL_CUDA_TRY_LAUNCH();
  return HL_STATUS_SUCCESS;
}

// Rows a block (cluster) of shape sh takes, and how many such groups `rows` make.
constexpr int64_t block_rows(const Shape &sh) { return int64_t(sh.block / sh.tpr) * sh.rows_at_once; }
constexpr int64_t row_groups(const Shape &sh, int64_t rows) { return (rows + block_rows(sh) - 1) / block_rows(sh); }

template <bool RES, class Tx, class Ty>
hl_status_t fwd_typed(FwdParams p, hl_stream_t stream) {
  constexpr int VEC = 16 / sizeof(Tx);
  p.w_vec = p.w && reinterpret_cast<uintptr_t>(p.w) % (VEC * dtype_size(p.wdt)) == 0;
  const bool aligned =
      p.cols % VEC == 0 && rows_aligned(p.x, p.xs, sizeof(Tx), 16) &&
      rows_aligned(p.res, p.rs, sizeof(Tx), 16) && rows_aligned(p.res_out, p.ros, sizeof(Tx), 16) &&
      rows_aligned(p.y, p.ys, sizeof(Ty), VEC * sizeof(Ty));
  int shape = aligned ? shape_for<false>(p.cols / VEC, p.rows) : -1;
  // The register kernels run a row group a block, without a loop; a grid past 2^31 - 1 blocks (not
  // within a GPU's memory) would take the rows kernel, which loops.
  if (shape >= 0 && row_groups(Shapes<false>::at[shape], p.rows) > INT32_MAX / Shapes<false>::at[shape].cluster)
    shape = -1;
  if (shape >= 0)
    return with_shape<false>(shape, [&](auto I) {
      return with_weight_kind<Tx>(p.w, p.wdt, p.w_vec, [&](auto tw) {
        constexpr Shape sh = Shapes<false>::at[decltype(I)::value];
        using Tw = typename decltype(tw)::type;
        auto k = rmsnorm_fwd_regs<RES, Tx, Ty, Tw, VEC, sh.tpr, sh.vpt, sh.rows_at_once, sh.block, sh.cluster,
                                  sh.prefetch>;
        if constexpr (sh.prefetch) {
          static const int resident = clusters_resident(k, sh.block, 0, sh.cluster);
          p.ahead = resident * block_rows(sh);
        }
        return launch(k, sh.block, row_groups(sh, p.rows), p, stream, sh.cluster);
      });
    });
  constexpr int BLOCK = kFwdRowsBlock;
  const int64_t grid = p.rows < INT32_MAX ? p.rows : INT32_MAX;
  if (aligned) return launch(rmsnorm_fwd_rows<RES, Tx, Ty, VEC, BLOCK>, BLOCK, grid, p, stream);
  return launch(rmsnorm_fwd_rows<RES, Tx, Ty, 1, BLOCK>, BLOCK, grid, p, stream);
}

}  // namespace

template <class Tx>
hl_status_t fwd_x(const FwdParams &p, hl_dtype_t y_dtype, hl_stream_t stream) {
  hl_status_t st = HL_STATUS_INTERNAL_ERROR;
  dispatch_float(y_dtype, [&](auto ty) {
    using Ty = typename decltype(ty)::type;
    st = p.res ? fwd_typed<true, Tx, Ty>(p, stream) : fwd_typed<false, Tx, Ty>(p, stream);
  });
  return st;
}
// Instantiated once each, by fwd_<dtype>.cu.
extern template hl_status_t fwd_x<float>(const FwdParams &, hl_dtype_t, hl_stream_t);
extern template hl_status_t fwd_x<__half>(const FwdParams &, hl_dtype_t, hl_stream_t);
extern template hl_status_t fwd_x<__nv_bfloat16>(const FwdParams &, hl_dtype_t, hl_stream_t);

}  // namespace hl::rmsnorm::dev
