// RMSNorm backward kernels. Rows that fit in registers take rmsnorm_bwd_regs: one read of x and
// dy, one write of dx, and dw accumulated in registers across the rows a block visits, then written
// as one fp32 partial row per block. Other rows take two kernels: per-row statistics, then column
// tiles that write dx and a partial dw per chunk of rows. A last kernel, launched to start early,
// sums the partials in a fixed order, so dw is deterministic without atomics; rows of 8K columns
// (a block a row) have the register kernel sum them itself, after a grid-wide barrier.
// Each x dtype's kernels compile in a translation unit of their own (bwd_<dtype>.cu), in
// parallel; bwd.cu picks the unit.
#pragma once

#include <algorithm>

#include <cooperative_groups.h>

#include "common/cuda_util.h"
#include "common/grid_dependency.cuh"
#include "rmsnorm/common.cuh"
#include "rmsnorm/launch.h"

namespace hl::rmsnorm::dev {

// dw from the partial rows (defined in bwd.cu, once for every x dtype).
__global__ void rmsnorm_dw_reduce(const float *partial, int64_t parts, int64_t cols, void *dw, hl_dtype_t dt);

namespace {

struct BwdParams {
  int64_t rows, cols;
  const void *x;
  int64_t xs;
  const float *rstd;
  float eps, inv_cols;
  const void *w;
  hl_dtype_t wdt;
  float offset;
  bool round_mid;  // LLAMA and NONE: dw uses s * rstd rounded to x's dtype, as the forward did
  bool none_mode;
  bool w_vec;  // the weight can be read in packs
  const void *dy;
  int64_t dys;
  const void *dro;  // gradient of residual_out, optional
  int64_t dros;
  void *dx;
  int64_t dxs;
  void *dres;  // optional copy of dx
  int64_t dress;
  float *partial;  // partial dw rows, [parts, cols]; NULL without a weight
  float2 *stats;   // per-row (rstd, mean(g * xhat)) for the tiled path
  void *dw;
  hl_dtype_t dwdt;
  bool fuse_dw;    // the register kernel (a cooperative launch) also sums the partials into dw
};

// dw[c] = sum over parts of partial[part][c], in part order, for the 32-column tiles first,
// first + stride, ...: thread (x, y) of Y = BLOCK / 32 warps sums parts y, y + Y, ... of column x
// of a tile, then warp 0 adds the Y sums in order.
template <int BLOCK>
__device__ __forceinline__ void reduce_dw(const float *partial, int64_t parts, int64_t cols, void *dw,
                                          hl_dtype_t dt, int64_t first, int64_t stride,
                                          float (&acc)[BLOCK / 32][33]) {
  constexpr int Y = BLOCK / 32;
  const int x = threadIdx.x % 32, y = threadIdx.x / 32;
  for (int64_t t = first; t * 32 < cols; t += stride) {
    const int64_t col = t * 32 + x;
    float s = 0.0f;
    if (col < cols)
#pragma unroll 4
      for (int64_t b = y; b < parts; b += Y) s += partial[b * cols + col];
    acc[y][x] = s;
    __syncthreads();
    if (y == 0 && col < cols) {
      float r = 0.0f;
      for (int i = 0; i < Y; ++i) r += acc[i][x];
      store_from_float(dw, dt, col, r);
    }
    __syncthreads();
  }
}

// The stores of dx and of the partial dw rows. ONE_STORE (the cluster kernels): through
// store_pack_global, since there the compiler split a row's first pack into 2- and 4-byte stores
// (H100 backward 8192 x 16384: 326 -> 298 us, 2048 x 32768: 213 -> 210). Elsewhere store_pack, whose
// schedule ran 1.5-3% faster (32768 x 4096: 283 against 287 us, 16384 x 8192: 298 against 306).
template <bool ONE_STORE, class T, int N>
__device__ __forceinline__ void store_out(T *p, const Pack<T, N> &v) {
  if constexpr (ONE_STORE) store_pack_global(p, v);
  else store_pack(p, v);
}

// One pack of the fused residual's gradient (p.dro).
template <class Tx, int VEC>
__device__ __forceinline__ Pack<Tx, VEC> load_dro(const BwdParams &p, int64_t row, int64_t col) {
  return load_pack<Tx, VEC>(static_cast<const Tx *>(p.dro) + row * p.dros + col);
}

// dx for one pack, with the fused residual's gradient added (p.dro): g, loaded earlier (EARLY_G),
// or loaded here; also stores the copy.
template <class Tx, class Tdy, int VEC, bool ONE_STORE = false, bool EARLY_G = false>
__device__ __forceinline__ void store_dx(const BwdParams &p, int64_t row, int64_t col,
                                         const Pack<Tx, VEC> &s, const Pack<Tdy, VEC> &dy,
                                         const Pack<Tx, VEC> &g, const float *wf, float rstd, float mean) {
  float d[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float xhat = to_float(s.v[e]) * rstd;
    d[e] = rstd * (to_float(dy.v[e]) * wf[e] - xhat * mean);
  }
  if (EARLY_G || p.dro) {
    const Pack<Tx, VEC> gv = EARLY_G ? g : load_dro<Tx, VEC>(p, row, col);
#pragma unroll
    for (int e = 0; e < VEC; ++e) d[e] += to_float(gv.v[e]);
  }
  Pack<Tx, VEC> out;
#pragma unroll
  for (int e = 0; e < VEC; ++e) out.v[e] = from_float<Tx>(d[e]);
  store_out<ONE_STORE>(static_cast<Tx *>(p.dx) + row * p.dxs + col, out);
  if (p.dres) store_out<ONE_STORE>(static_cast<Tx *>(p.dres) + row * p.dress + col, out);
}

// dw contribution of one pack: dy * xhat, xhat rounded as the forward rounded it.
template <class Tx, class Tdy, int VEC>
__device__ __forceinline__ void add_dw(const BwdParams &p, const Pack<Tx, VEC> &s,
                                       const Pack<Tdy, VEC> &dy, float rstd, float *acc) {
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    float xhat = to_float(s.v[e]) * rstd;
    if (p.round_mid) xhat = round_to<Tx>(xhat);
    acc[e] += to_float(dy.v[e]) * xhat;
  }
}

// dw: blocks of up to 256 threads accumulate it in registers (sub-warp groups then sum their
// columns in shared memory, in group order); 512-thread blocks, short of registers, keep the dw
// row in dynamic shared memory, where every column has one owner thread (no barrier needed).
// STAGED: the next row group's x and dy (and rstd) load while this one computes (Staging, after
// the dw row in dynamic shared memory).
// PF: the next row group is fetched into L2 while this one computes (a field of the shape: it pays
// only where few warps are resident; docs/rmsnorm.md, "Tuning choices").
// DRO (blocks that cache the weight): the fused residual's gradient (p.dro) loads with x and dy, not
// at the store after dx (which may alias it); a kernel of its own, so that the calls without it do
// not pay its ~50 registers. In the larger blocks (no registers to spare) it loads at the store.
// CL > 1: a row spans the CL blocks of a cluster, rank c holding columns [c W, (c + 1) W); a
// cluster writes one partial dw row. Two blocks an SM, except with the prefetch; no minimum
// otherwise (a minimum of 1 is not the same as none: more registers, fewer blocks an SM).
template <class Tx, class Tdy, int VEC, int TPR, int VPT, int R, int BLOCK, bool STAGED, int CL, bool PF, bool DRO>
__global__ void __launch_bounds__(BLOCK, CL > 1 && !PF ? 2 : 0) rmsnorm_bwd_regs(const BwdParams p) {
  if constexpr (CL > 1 && !kClusterCode) return;
  RowSum<TPR, BLOCK, CL> row_sum;
  constexpr int G = BLOCK / TPR, W = TPR * VPT * VEC;  // W: columns a group covers
  constexpr bool kCacheW = kCacheWeight<BLOCK>, kDwRow = !kCacheW;
  static_assert(!DRO || kCacheW, "DRO: blocks that cache the weight");
  __shared__ typename decltype(row_sum)::Storage smem;
  __shared__ float dw_groups[G > 1 ? G * W : 1];
  extern __shared__ uint4 dyn[];
  // kDwRow: [VEC][W / VEC], element e of pack k at e * W / VEC + k
  float *const dw_row = reinterpret_cast<float *>(dyn);
  const Staging<2 * R * VPT, BLOCK> stage{dyn + (kDwRow ? W / 4 : 0)};  // x, dy of pack (r, v) at 2 (r VPT + v) + 0, 1
  const int lane = threadIdx.x % TPR, group = threadIdx.x / TPR;
  const int64_t col0 = CL > 1 ? int64_t(cluster_rank()) * W : 0;
  row_sum.start(smem);
  let_next_grid_start();  // a resident grid: rmsnorm_dw_reduce's blocks take SMs only as it ends

  float wf[kCacheW ? VPT : 1][VEC], dw[kDwRow ? 1 : VPT][VEC] = {};
  if constexpr (kDwRow)
    if (p.partial)
#pragma unroll
      for (int v = 0; v < VPT; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) dw_row[e * (W / VEC) + v * TPR + lane] = 0.0f;
  if constexpr (kCacheW)
    weight_packs<Tx>(p.w, p.wdt, p.offset, p.none_mode, p.w_vec, col0 + int64_t(lane) * VEC, TPR * VEC, p.cols, wf);

  // Calls f(r, v, row, col, in the rows) for the packs of the row group at base.
  auto each_pack = [&](int64_t base, auto &&f) {
    const int64_t row0 = base + int64_t(group) * R;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int v = 0; v < VPT; ++v) {
        const int64_t col = col0 + int64_t(v * TPR + lane) * VEC;
        f(r, v, row0 + r, col, row0 + r < p.rows && col < p.cols);
      }
  };
  float rstd_next[R];
  auto stage_rows = [&](int st, int64_t base) {  // STAGED: the rows at base into stage st
    if constexpr (STAGED) {
      each_pack(base, [&](int r, int v, int64_t row, int64_t col, bool ok) {
        const Tx *x = static_cast<const Tx *>(p.x);
        const Tdy *dy = static_cast<const Tdy *>(p.dy);
        stage.template copy<Tx, VEC>(st, 2 * (r * VPT + v), ok ? x + row * p.xs + col : x, ok);
        stage.template copy<Tdy, VEC>(st, 2 * (r * VPT + v) + 1, ok ? dy + row * p.dys + col : dy, ok);
      });
      cp_async_commit();
      if (p.rstd)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int64_t row = base + int64_t(group) * R + r;
          rstd_next[r] = row < p.rows ? p.rstd[row] : 0.0f;
        }
    }
  };

  const int64_t step = int64_t(gridDim.x / CL) * G * R, first = int64_t(blockIdx.x / CL) * G * R;
  int st = 0;
  if constexpr (STAGED)
    if (first < p.rows) stage_rows(0, first);
  for (int64_t base = first; base < p.rows; base += step, st ^= 1) {
    const int64_t row0 = base + int64_t(group) * R;
    Pack<Tx, VEC> s[R][VPT], g[DRO ? R : 1][DRO ? VPT : 1];
    Pack<Tdy, VEC> dy[R][VPT];
    float rstd[R], mean[R];
    if constexpr (STAGED) {
      cp_async_wait<0>();
#pragma unroll
      for (int r = 0; r < R; ++r) {
        rstd[r] = rstd_next[r];
#pragma unroll
        for (int v = 0; v < VPT; ++v) {
          s[r][v] = stage.template read<Tx, VEC>(st, 2 * (r * VPT + v));
          dy[r][v] = stage.template read<Tdy, VEC>(st, 2 * (r * VPT + v) + 1);
        }
      }
      if constexpr (DRO)
        each_pack(base, [&](int r, int v, int64_t row, int64_t col, bool ok) {
          if (ok) g[r][v] = load_dro<Tx, VEC>(p, row, col);
        });
      if (base + step < p.rows) stage_rows(st ^ 1, base + step);
    } else {
      if constexpr (PF)
        if (lane == 0 && base + step < p.rows) {
          prefetch_rows<Tx, R>(p.x, p.xs, row0 + step, p.rows, col0, W, p.cols);
          prefetch_rows<Tdy, R>(p.dy, p.dys, row0 + step, p.rows, col0, W, p.cols);
          if (p.dro) prefetch_rows<Tx, R>(p.dro, p.dros, row0 + step, p.rows, col0, W, p.cols);
        }
      each_pack(base, [&](int r, int v, int64_t row, int64_t col, bool ok) {
        if (ok) {
          s[r][v] = load_pack<Tx, VEC>(static_cast<const Tx *>(p.x) + row * p.xs + col);
          dy[r][v] = load_pack<Tdy, VEC>(static_cast<const Tdy *>(p.dy) + row * p.dys + col);
          if constexpr (DRO) g[r][v] = load_dro<Tx, VEC>(p, row, col);
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            s[r][v].v[e] = from_float<Tx>(0.0f);
            dy[r][v].v[e] = from_float<Tdy>(0.0f);
          }
        }
      });
      if (p.rstd)
#pragma unroll
        for (int r = 0; r < R; ++r) rstd[r] = row0 + r < p.rows ? p.rstd[row0 + r] : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (!p.rstd) {
        float ss = 0.0f;
#pragma unroll
        for (int v = 0; v < VPT; ++v)
#pragma unroll
          for (int e = 0; e < VEC; ++e) ss += to_float(s[r][v].v[e]) * to_float(s[r][v].v[e]);
        rstd[r] = rsqrtf(row_sum.sum(ss, smem) * p.inv_cols + p.eps);
      }
      float dot = 0.0f;  // sum of g * s; times rstd it is sum of g * xhat
#pragma unroll
      for (int v = 0; v < VPT; ++v) {
        if constexpr (!kCacheW)
          weight_pack<Tx, VEC>(p.w, p.wdt, p.offset, p.none_mode, p.w_vec, col0 + int64_t(v * TPR + lane) * VEC, p.cols, wf[0]);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          dot += to_float(dy[r][v].v[e]) * wf[kCacheW ? v : 0][e] * to_float(s[r][v].v[e]);
      }
      mean[r] = row_sum.sum(dot, smem) * rstd[r] * p.inv_cols;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r >= p.rows) break;
#pragma unroll
      for (int v = 0; v < VPT; ++v) {
        const int64_t col = col0 + int64_t(v * TPR + lane) * VEC;
        if (col >= p.cols) continue;
        if constexpr (!kCacheW) weight_pack<Tx, VEC>(p.w, p.wdt, p.offset, p.none_mode, p.w_vec, col, p.cols, wf[0]);
        store_dx<Tx, Tdy, VEC, (CL > 1), DRO>(p, row0 + r, col, s[r][v], dy[r][v], g[DRO ? r : 0][DRO ? v : 0],
                                              wf[kCacheW ? v : 0], rstd[r], mean[r]);
        if (!p.partial) continue;
        if constexpr (!kDwRow) {
          add_dw<Tx, Tdy, VEC>(p, s[r][v], dy[r][v], rstd[r], dw[v]);
        } else {
          add_dw<Tx, Tdy, VEC>(p, s[r][v], dy[r][v], rstd[r], dw[0]);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            dw_row[e * (W / VEC) + v * TPR + lane] += dw[0][e];
            dw[0][e] = 0.0f;
          }
        }
      }
    }
  }
  if (!p.partial) return;
  float *out = p.partial + int64_t(blockIdx.x / CL) * p.cols;
  if constexpr (kDwRow || G == 1) {
    // A thread's VEC columns are adjacent: stored 4 floats at a time (the workspace is 16-byte
    // aligned). As 4-byte stores, a warp's store touched 32 sectors for 128 bytes, and every
    // block stores at once, at its end (H100: 1024 x 4096 33 -> 21 us, 4096 x 4096 59 -> 48).
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
      const int64_t col = col0 + int64_t(v * TPR + lane) * VEC;
      if (col >= p.cols) continue;
#pragma unroll
      for (int e0 = 0; e0 < VEC; e0 += 4) {
        Pack<float, 4> d;
#pragma unroll
        for (int e = 0; e < 4; ++e)
          d.v[e] = kDwRow ? dw_row[(e0 + e) * (W / VEC) + v * TPR + lane] : dw[kDwRow ? 0 : v][e0 + e];
        store_out<(CL > 1)>(out + col + e0, d);
      }
    }
  } else {  // sum the groups' columns in shared memory, in group order
#pragma unroll
    for (int v = 0; v < VPT; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) dw_groups[group * W + (v * TPR + lane) * VEC + e] = dw[v][e];
    __syncthreads();
    for (int c = threadIdx.x; c < W && c < p.cols; c += BLOCK) {
      float t = 0.0f;
      for (int g = 0; g < G; ++g) t += dw_groups[g * W + c];
      out[c] = t;
    }
  }
  if constexpr (kCanFuseDw<TPR, BLOCK, CL>)
    if (p.fuse_dw) {
      __shared__ float acc[BLOCK / 32][33];
      cooperative_groups::this_grid().sync();
      reduce_dw<BLOCK>(p.partial, gridDim.x, p.cols, p.dw, p.dwdt, blockIdx.x, gridDim.x, acc);
    }
}

// Tiled path, step 1: per-row rstd and mean(g * xhat), a block per row.
template <class Tx, class Tdy, int VEC, int BLOCK>
__global__ void __launch_bounds__(BLOCK) rmsnorm_bwd_stats(const BwdParams p) {
  RowSum<BLOCK, BLOCK> row_sum;
  __shared__ typename decltype(row_sum)::Storage smem;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    float ss = 0.0f, dot = 0.0f;
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < p.cols; col += int64_t(BLOCK) * VEC) {
      const Pack<Tx, VEC> s = load_pack<Tx, VEC>(static_cast<const Tx *>(p.x) + row * p.xs + col);
      const Pack<Tdy, VEC> dy = load_pack<Tdy, VEC>(static_cast<const Tdy *>(p.dy) + row * p.dys + col);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float sv = to_float(s.v[e]);
        ss += sv * sv;
        dot += to_float(dy.v[e]) * weight_factor<Tx>(p.w, p.wdt, p.offset, p.none_mode, col + e) * sv;
      }
    }
    const float rstd = p.rstd ? p.rstd[row] : rsqrtf(row_sum.sum(ss, smem) * p.inv_cols + p.eps);
    const float mean = row_sum.sum(dot, smem) * rstd * p.inv_cols;
    if (threadIdx.x == 0) p.stats[row] = make_float2(rstd, mean);
  }
}

// Tiled path, step 2: a block covers 32 packs of columns and one chunk of rows; it writes dx and
// the chunk's partial dw row.
template <class Tx, class Tdy, int VEC>
__global__ void __launch_bounds__(32 * kTileY) rmsnorm_bwd_tiles(const BwdParams p, int64_t chunk_rows) {
  __shared__ float dw_rows[kTileY][32 * VEC + 1];
  const int64_t col = (int64_t(blockIdx.x) * 32 + threadIdx.x) * VEC;
  const int64_t r0 = int64_t(blockIdx.y) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < p.rows ? r0 + chunk_rows : p.rows;
  float wf[VEC], dw[VEC] = {};
  const bool live = col < p.cols;
  weight_pack<Tx, VEC>(p.w, p.wdt, p.offset, p.none_mode, p.w_vec, col, p.cols, wf);
  if (live)
    for (int64_t row = r0 + threadIdx.y; row < r1; row += kTileY) {
      const float2 st = p.stats[row];
      const Pack<Tx, VEC> s = load_pack<Tx, VEC>(static_cast<const Tx *>(p.x) + row * p.xs + col);
      const Pack<Tdy, VEC> dy = load_pack<Tdy, VEC>(static_cast<const Tdy *>(p.dy) + row * p.dys + col);
      store_dx<Tx, Tdy, VEC>(p, row, col, s, dy, {}, wf, st.x, st.y);
      if (p.partial) add_dw<Tx, Tdy, VEC>(p, s, dy, st.x, dw);
    }
  if (!p.partial) return;
#pragma unroll
  for (int e = 0; e < VEC; ++e) dw_rows[threadIdx.y][threadIdx.x * VEC + e] = dw[e];
  __syncthreads();
  for (int c = threadIdx.y * 32 + threadIdx.x; c < 32 * VEC; c += 32 * kTileY) {
    const int64_t gc = int64_t(blockIdx.x) * 32 * VEC + c;
    if (gc >= p.cols) continue;
    float t = 0.0f;
    for (int y = 0; y < kTileY; ++y) t += dw_rows[y][c];
    p.partial[int64_t(blockIdx.y) * p.cols + gc] = t;
  }
}


// Which kernels run and how much workspace they need. Computed the same way for the workspace
// query and the launch.
struct BwdPlan {
  int shape = -1;        // register kernel shape, or -1 for the tiled path
  int64_t parts = 0;     // partial dw rows: blocks of the register kernel or row chunks
  int64_t chunk_rows = 0;
  size_t stats_bytes = 0, bytes = 0;
  bool vec = false;      // 16-byte packs
};

template <class Tx, class Tdy>
struct Bwd {
  static constexpr int VEC = 16 / sizeof(Tx);

  static BwdPlan plan(const hl_rmsnorm_bwd_args_t &a) {
    BwdPlan pl;
    pl.vec = a.cols % VEC == 0 && rows_aligned(a.x, a.x_stride, sizeof(Tx), 16) &&
             rows_aligned(a.dy, a.dy_stride, sizeof(Tdy), VEC * sizeof(Tdy)) &&
             rows_aligned(a.dresidual_out, a.dresidual_out_stride, sizeof(Tx), 16) &&
             rows_aligned(a.dx, a.dx_stride, sizeof(Tx), 16) &&
             rows_aligned(a.dresidual, a.dresidual_stride, sizeof(Tx), 16);
    pl.shape = pl.vec ? shape_for<true>(a.cols / VEC, a.rows) : -1;
    if (pl.shape >= 0) {
      with_shape<true>(pl.shape, [&](auto I) {
        constexpr Shape sh = Shapes<true>::at[decltype(I)::value];
        const int64_t per_block = int64_t(sh.block / sh.tpr) * sh.rows_at_once;
        const int64_t want = (a.rows + per_block - 1) / per_block;  // blocks, or clusters
        pl.parts = std::min<int64_t>(want, regs_kernel<decltype(I)::value>(a).resident);
        return HL_STATUS_SUCCESS;
      });
    } else {
      const int vec = pl.vec ? VEC : 1;
      const int64_t strips = (a.cols + 32 * vec - 1) / (32 * vec);
      const int64_t chunks = std::clamp<int64_t>((kTilesPerSm * sm_count() + strips - 1) / strips, 1,
                                                 std::min<int64_t>(std::max<int64_t>(a.rows, 1), kMaxTileChunks));
      pl.chunk_rows = (a.rows + chunks - 1) / chunks;
      pl.parts = a.rows ? (a.rows + pl.chunk_rows - 1) / pl.chunk_rows : 0;
      pl.stats_bytes = (size_t(a.rows) * sizeof(float2) + 255) / 256 * 256;
    }
    pl.bytes = pl.stats_bytes + (a.weight ? size_t(pl.parts) * size_t(a.cols) * sizeof(float) : 0);
    return pl;
  }

  // A register kernel, its dynamic shared memory (the dw row of a block-per-row shape, the
  // staging) and how many blocks (or clusters) fit on the device at once: the persistent grid
  // (the shared-memory limit raised once).
  struct Launch {
    void (*kernel)(BwdParams);
    size_t smem;
    int resident;
  };
  template <int I, bool DRO>
  static const Launch &regs_kernel() {
    static const Launch l = [] {
      constexpr Shape sh = Shapes<true>::at[I];
      constexpr bool staged = sh.staged && sizeof(Tdy) <= sizeof(Tx);  // staging slots hold 16 bytes
      auto k = rmsnorm_bwd_regs<Tx, Tdy, VEC, sh.tpr, sh.vpt, sh.rows_at_once, sh.block, staged, sh.cluster,
                                sh.prefetch, DRO>;
      const size_t smem = (kCacheWeight<sh.block> ? 0 : size_t(sh.tpr) * sh.vpt * VEC * sizeof(float)) +
                          (staged ? Staging<2 * sh.rows_at_once * sh.vpt, sh.block>::kBytes : 0);
      allow_smem(k, smem);
      // at least one, so that a shape that cannot run fails at the launch
      return Launch{k, smem, std::max(1, clusters_resident(k, sh.block, smem, sh.cluster))};
    }();
    return l;
  }
  template <int I>
  static const Launch &regs_kernel(const hl_rmsnorm_bwd_args_t &a) {
    if constexpr (kCacheWeight<Shapes<true>::at[I].block>)
      if (a.dresidual_out) return regs_kernel<I, true>();
    return regs_kernel<I, false>();
  }

  static hl_status_t run(const hl_rmsnorm_bwd_args_t &a, BwdParams p, hl_stream_t stream) {
    const BwdPlan pl = plan(a);
    char *ws = static_cast<char *>(a.workspace);
    p.stats = reinterpret_cast<float2 *>(ws);
    p.partial = a.weight ? reinterpret_cast<float *>(ws + pl.stats_bytes) : nullptr;
    p.dw = a.dw;
    p.dwdt = a.dw_dtype;
    bool fused = false;
    if (a.rows > 0 && pl.shape >= 0) {
      HL_TRY(with_shape<true>(pl.shape, [&](auto I) {
        constexpr Shape sh = Shapes<true>::at[decltype(I)::value];
        const Launch &l = regs_kernel<decltype(I)::value>(a);
        cudaLaunchAttribute attr;
        cudaLaunchConfig_t cfg = cluster_launch(pl.parts * sh.cluster, sh.block, l.smem, sh.cluster,
                                                static_cast<cudaStream_t>(stream), attr);
        if (kCanFuseDw<sh.tpr, sh.block, sh.cluster> && a.weight && (a.cols + 31) / 32 >= pl.parts) {
          // The grid is what fits on the device at once; where the device is shared (MPS) and
          // the cooperative launch is refused, the second kernel sums instead.
          attr.id = cudaLaunchAttributeCooperative;
          attr.val.cooperative = 1;
          cfg.attrs = &attr;
          cfg.numAttrs = 1;
          p.fuse_dw = true;
          if (cudaLaunchKernelEx(&cfg, l.kernel, p) == cudaSuccess) return fused = true, HL_STATUS_SUCCESS;
          (void)cudaGetLastError();
          cfg.numAttrs = 0;
          p.fuse_dw = false;
        }
        HL_CUDA_TRY(cudaLaunchKernelEx(&cfg, l.kernel, p));
        HL_CUDA_TRY_LAUNCH();
        return HL_STATUS_SUCCESS;
      }));
    } else if (a.rows > 0) {
      HL_TRY(pl.vec ? tiled<VEC>(p, pl, stream) : tiled<1>(p, pl, stream));
    }
    if (a.weight && !fused) {  // launched to start early: it waits for the partials in the kernel
      cudaLaunchAttribute attr, attrs[2];
      cudaLaunchConfig_t cfg = cluster_launch((a.cols + 31) / 32, kDwReduceBlock, 0, 1, static_cast<cudaStream_t>(stream), attr);
      if (code_arch() >= 90) allow_early_start(cfg, attrs);
      HL_CUDA_TRY(cudaLaunchKernelEx(&cfg, rmsnorm_dw_reduce, static_cast<const float *>(p.partial), pl.parts,
                                     int64_t(a.cols), a.dw, a.dw_dtype));
      HL_CUDA_TRY_LAUNCH();
    }
    return HL_STATUS_SUCCESS;
  }

  template <int V>
  static hl_status_t tiled(const BwdParams &p, const BwdPlan &pl, hl_stream_t stream) {
    static const int occ = blocks_per_sm(rmsnorm_bwd_stats<Tx, Tdy, V, kStatsBlock>, kStatsBlock);
    const int64_t grid = std::min<int64_t>(p.rows, int64_t(sm_count()) * occ);
    rmsnorm_bwd_stats<Tx, Tdy, V, kStatsBlock><<<unsigned(grid), kStatsBlock, 0, stream>>>(p);
    HL_CUDA_TRY_LAUNCH();
    const dim3 tiles(unsigned((p.cols + 32 * V - 1) / (32 * V)), unsigned(pl.parts));
    rmsnorm_bwd_tiles<Tx, Tdy, V><<<tiles, dim3(32, kTileY), 0, stream>>>(p, pl.chunk_rows);
    HL_CUDA_TRY_LAUNCH();
    return HL_STATUS_SUCCESS;
  }
};

// The weight can be read VEC elements at a time.
inline bool weight_vec(const void *w, hl_dtype_t wdt, int vec) {
  return w && reinterpret_cast<uintptr_t>(w) % (size_t(vec) * dtype_size(wdt)) == 0;
}

inline BwdParams make_params(const hl_rmsnorm_bwd_args_t &a, int vec) {
  BwdParams p{};
  p.rows = a.rows; p.cols = a.cols;
  p.x = a.x; p.xs = a.x_stride; p.rstd = a.rstd;
  p.eps = a.eps; p.inv_cols = 1.0f / float(a.cols);
  p.w = a.weight; p.wdt = a.weight_dtype; p.offset = a.offset;
  p.round_mid = a.cast != HL_RMSNORM_CAST_GEMMA; p.none_mode = a.cast == HL_RMSNORM_CAST_NONE;
  p.w_vec = weight_vec(a.weight, a.weight_dtype, vec);
  p.dy = a.dy; p.dys = a.dy_stride; p.dro = a.dresidual_out; p.dros = a.dresidual_out_stride;
  p.dx = a.dx; p.dxs = a.dx_stride; p.dres = a.dresidual; p.dress = a.dresidual_stride;
  return p;
}

// Calls f(Bwd<Tx, Tdy>{}) for dy's dtype.
template <class Tx, class F>
void with_dy_type(const hl_rmsnorm_bwd_args_t &a, F &&f) {
  dispatch_float(a.dy_dtype, [&](auto td) { f(Bwd<Tx, typename decltype(td)::type>{}); });
}

}  // namespace

// The backward for x of dtype Tx (instantiated by bwd_<dtype>.cu): its workspace, and the call.
template <class Tx>
size_t bwd_workspace_x(const hl_rmsnorm_bwd_args_t &a) {
  size_t bytes = 0;
  with_dy_type<Tx>(a, [&](auto b) { bytes = decltype(b)::plan(a).bytes; });
  return bytes;
}
template <class Tx>
hl_status_t bwd_x(const hl_rmsnorm_bwd_args_t &a, hl_stream_t stream) {
  hl_status_t st = HL_STATUS_INTERNAL_ERROR;
  with_dy_type<Tx>(a, [&](auto b) { st = decltype(b)::run(a, make_params(a, decltype(b)::VEC), stream); });
  return st;
}
// Instantiated once each, by bwd_<dtype>.cu.
extern template size_t bwd_workspace_x<float>(const hl_rmsnorm_bwd_args_t &);
extern template size_t bwd_workspace_x<__half>(const hl_rmsnorm_bwd_args_t &);
extern template size_t bwd_workspace_x<__nv_bfloat16>(const hl_rmsnorm_bwd_args_t &);
extern template hl_status_t bwd_x<float>(const hl_rmsnorm_bwd_args_t &, hl_stream_t);
extern template hl_status_t bwd_x<__half>(const hl_rmsnorm_bwd_args_t &, hl_stream_t);
extern template hl_status_t bwd_x<__nv_bfloat16>(const hl_rmsnorm_bwd_args_t &, hl_stream_t);

}  // namespace hl::rmsnorm::dev
