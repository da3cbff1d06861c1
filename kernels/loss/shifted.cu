// The fused linear form's shifted path (shifted.h): its host side and its row kernels.
#include "loss/shifted.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "common/cuda_util.h"
#include "common/dtype.cuh"
#include "common/tensor_map.h"
#include "loss/params.cuh"
#include "loss/row_kernel.cuh"
#include "loss/shifted_logits_sm90.cuh"
#include "loss/sums.cuh"

namespace hl::loss::dev {
namespace {

using sm90::TileStats;
using bf16 = __nv_bfloat16;
using hl::dev::from_floats;
using hl::dev::load_pack;
using hl::dev::Pack;
using hl::dev::store_pack;
using hl::dev::to_floats;

int64_t tiles_of(int64_t n, int64_t tile) { return (n + tile - 1) / tile; }

// Each row's max over its tiles. A row whose max lies outside the first shift's window takes its
// max as its shift and marks its block of rows to run again.
__global__ void window_kernel(const TileStats *stats, int64_t tiles, int64_t rows, float *shift,
                              unsigned char *redo) {
  const int64_t r = blockIdx.x * int64_t(kRowWarps) + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x % 32;
  float m = -INFINITY;
  for (int64_t t = lane; t < tiles; t += 32) m = fmaxf(m, stats[r * tiles + t].m);
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float d = m - sm90::kFirstShift;
  const bool out = !(d >= sm90::kLowest && d <= sm90::kHighest);
  if (lane == 0) {
    shift[r] = out ? m : sm90::kFirstShift;
    if (out) redo[r / sm90::kBM] = 1;
  }
}

struct FinishArgs {
  const TileStats *stats;
  int64_t tiles;
  const float *shift;
  float *alpha;
  const bf16 *x, *w;
  int64_t ldx, ldw;
  bf16 *e;
  int64_t lde;
  bf16 *xs;  // [rows][H]: alpha X (null without grad_weight)
  int64_t rows, H, V;
  int64_t H8;  // H rounded down to a multiple of 8: the columns read 8 at a time
  Phase phase;  // kWhole; kStats: the row's record into this rank's block; kFinish: from the ranks'
  Params k;     // the per-row inputs and outputs, the records, D, the blocks (launch.h's row_params)
};

// This shard's record of a row from its tile statistics: sums relative to its max, as RowStats
// (e_m = e exp(shift - m)); the label's logit an fp32 dot product where the label is this shard's.
__device__ RowStats<float> shard_stats(const FinishArgs &f, int64_t r, int64_t y, bool labelled, int lane) {
  float s = 0.f, b = 0.f, m = -INFINITY;
  long long am = LLONG_MAX;
  for (int64_t t = lane; t < f.tiles; t += 32) {
    const TileStats v = f.stats[r * f.tiles + t];
    s += v.s, b += v.b;
    if (v.m > m) m = v.m, am = v.amax;  // tiles ascend: the first maximum stays
  }
  for (int o = 16; o > 0; o /= 2) {
    s += __shfl_xor_sync(0xffffffffu, s, o), b += __shfl_xor_sync(0xffffffffu, b, o);
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const long long a2 = __shfl_xor_sync(0xffffffffu, am, o);
    if (m2 > m || (m2 == m && a2 < am)) m = m2, am = a2;
  }
  const bf16 *xr = f.x + r * f.ldx;
  float zy = -INFINITY;
  if (labelled) {  // the label's logit, an fp32 dot product (rows 16-byte aligned: shifted_call)
    const bf16 *wy = f.w + y * f.ldw;
    float d = 0.f;
    for (int64_t h = lane * 8; h < f.H8; h += 32 * 8) {
      float xv[8], wv[8];
      to_floats(load_pack<bf16, 8>(xr + h), xv), to_floats(load_pack<bf16, 8>(wy + h), wv);
#pragma unroll
      for (int j = 0; j < 8; ++j) d = fmaf(xv[j], wv[j], d);
    }
    for (int64_t h = f.H8 + lane; h < f.H; h += 32) d = fmaf(__bfloat162float(xr[h]), __bfloat162float(wy[h]), d);
    for (int o = 16; o > 0; o /= 2) d += __shfl_xor_sync(0xffffffffu, d, o);
    zy = d * f.k.o.scale;
  }
  const float sh = f.shift[r], fm = expf(sh - m);
  RowStats<float> st = empty_stats<float>();
  st.m = m, st.s = s * fm, st.b = fm * (b + (sh - m) * s), st.sum = 0.f, st.zy = zy, st.amax = am;
  return st;
}

// Lane 0's record in every lane.
__device__ __forceinline__ RowStats<float> from_lane0(RowStats<float> st) {
  st.m = __shfl_sync(0xffffffffu, st.m, 0), st.s = __shfl_sync(0xffffffffu, st.s, 0);
  st.b = __shfl_sync(0xffffffffu, st.b, 0), st.sum = __shfl_sync(0xffffffffu, st.sum, 0);
  st.zy = __shfl_sync(0xffffffffu, st.zy, 0);
  st.amax = __shfl_sync(0xffffffffu, (long long)st.amax, 0);
  return st;
}

// A row's loss from its statistics (row_math.h's finish_row, as the row kernel runs it), its outputs
// and record, alpha, E's label element patched, and alpha X; or (kStats) only this shard's record.
// A warp a row; the tiles, the label's dot product and the ranks' records summed lane by lane, then
// by a fixed tree: the same bits on every run (and on every rank).
__global__ void __launch_bounds__(32 * kRowWarps) finish_kernel(const __grid_constant__ FinishArgs f) {
  const int64_t r = blockIdx.x * int64_t(kRowWarps) + threadIdx.x / 32;
  if (r >= f.rows) return;
  const int lane = threadIdx.x % 32;
  const Params &k = f.k;
  const bf16 *xr = f.x + r * f.ldx;
  const int64_t y = read_label(k.src, r) - k.col0;  // in this shard's columns
  const bool labelled = y >= 0 && y < f.V;
  if (f.phase == kStats) {
    const RowStats<float> st = shard_stats(f, r, y, labelled, lane);
    if (lane == 0) write_record<kDistillNone>(k, r, st);
    return;
  }
  const RowStats<float> st =
      f.phase == kFinish ? from_lane0(gathered_stats<kDistillNone>(k, r)) : shard_stats(f, r, y, labelled, lane);
  const float zy = st.zy, sh = f.shift[r];
  const RowResult<float> row = finish_row(st, read_inputs<float>(k.src, r), k.o, k.prep->kd);
  if (lane == 0) {
    if (k.records) store_floats<kRecFields>(k.records + r * kRecStride, row.rec);
    if (k.tok_loss) k.tok_loss[r] = row.token_loss;
    if (k.tok_logp) k.tok_logp[r] = row.logp;
    if (k.tok_entropy) k.tok_entropy[r] = row.entropy;
    if (k.tok_lse) k.tok_lse[r] = row.lse;
    if (k.tok_argmax) k.tok_argmax[r] = row.argmax;
  }
  if (!f.e) return;  // no gradient
  // G = p cp + [v = y] cy = alpha E', E' being E with the label's element G_y / alpha.
  bf16 *er = f.e + r * f.lde;
  float alpha = 0.f;
  if (row.cp != 0.f) {
    alpha = row.cp * expf(sh - row.lse);
    if (labelled && lane == 0)
      er[y] = __float2bfloat16_rn((expf(zy - row.lse) + row.cy / row.cp) * expf(row.lse - sh));
  } else if (labelled && row.cy != 0.f) {  // the label's term alone (the coefficients cancel)
    for (int64_t v = lane; v < f.V; v += 32) er[v] = __float2bfloat16_rn(0.f);
    __syncwarp();
    if (lane == 0) er[y] = __float2bfloat16_rn(row.cy);
    alpha = 1.f;
  }
  if (lane == 0) f.alpha[r] = alpha;
  if (!f.xs) return;
  bf16 *xs = f.xs + r * f.H;
  const int64_t h8 = f.H % 8 == 0 ? f.H : 0;  // xs's rows 16-byte aligned
  for (int64_t h = lane * 8; h < h8; h += 32 * 8) {
    float v[8];
    to_floats(load_pack<bf16, 8>(xr + h), v);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] *= alpha;
    Pack<bf16, 8> o;
    from_floats<bf16, 8>(v, o.v);
    store_pack(xs + h, o);
  }
  for (int64_t h = h8 + lane; h < f.H; h += 32) xs[h] = __float2bfloat16_rn(alpha * __bfloat162float(xr[h]));
}

// grad_hidden rows = alpha (E W) (+ what they hold), rounded once: a CTA a row, 4 columns a thread
// where the rows align (vec), else one.
template <class T>
__global__ void scale_rows_kernel(const float *d32, const float *alpha, T *out, int64_t ldo, int64_t rows,
                                  int64_t H, bool accumulate, bool vec) {
  const auto put = [&](T *o, const float *v, int n) {
    float w[4];
    for (int j = 0; j < n; ++j) w[j] = accumulate ? hl::dev::to_float(o[j]) + v[j] : v[j];
    if (n == 4) {
      Pack<T, 4> p;
      from_floats<T, 4>(w, p.v);
      store_pack(o, p);
    } else {
      o[0] = hl::dev::from_float<T>(w[0]);
    }
  };
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float a = alpha[r];
    const float *src = d32 + r * H;
    T *o = out + r * ldo;
    if (vec) {
      for (int64_t h = threadIdx.x * 4; h < H; h += blockDim.x * 4) {
        const float4 d = *reinterpret_cast<const float4 *>(src + h);
        const float v[4] = {a * d.x, a * d.y, a * d.z, a * d.w};
        put(o + h, v, 4);
      }
    } else {
      for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
        const float v = a * src[h];
        put(o + h, &v, 1);
      }
    }
  }
}

// A [rows][inner] BF16 matrix of row stride ld (elements) in 64 x box_rows boxes.
hl_status_t map(const char *fn, CUtensorMap *m, const void *base, int64_t inner, int64_t rows, int64_t ld,
                uint32_t box_rows) {
  const uint64_t s = uint64_t(ld) * 2;
  return hl::dev::encode_map(fn, m, HL_DTYPE_BF16, base, uint64_t(inner), uint64_t(rows), 1, s, s * uint64_t(rows),
                              64, box_rows, 1);
}

}  // namespace

bool shifted_plan(const hl_loss_plan_st &p) {
#if HL_SM90A
  const hl_loss_plan_desc_t &d = p.desc;
  const Options &o = p.opt;
  if (linear_path_rows()) return false;
  return p.linear && d.weight_dtype == HL_DTYPE_BF16 && d.teacher_hidden == 0 && o.distill == kDistillNone &&
         o.topk == 0 && !p.seq_stats && o.cap == 0.0f && o.smoothing == 0.0f && o.ent_w == 0.0f &&
         !(d.flags & HL_LOSS_GRAD_TOKEN_ENTROPY) && o.scale > 0.0f && d.vocab < INT32_MAX &&
         d.hidden < INT32_MAX;
#else
  (void)p;
  return false;
#endif
}

bool shifted_call(const hl_loss_args_t &a) {
  return !a.bias && !a.grad_bias && a.rows < INT32_MAX && hl::dev::aligned16(a.hidden) && hl::dev::aligned16(a.weight) &&
         a.hidden_stride % 8 == 0 && a.weight_stride % 8 == 0 && hl::dev::device_is_sm90() &&
         hl::dev::tensor_maps_available();
}

size_t shifted_row_bytes(const hl_loss_plan_st &p) {
  const size_t H = size_t(p.desc.hidden);
  return std::max(size_t(tiles_of(p.desc.vocab, sm90::kBN)) * sizeof(TileStats) + H * sizeof(bf16),
                  H * sizeof(float)) + 2 * sizeof(float) + 1;
}

void shifted_buffers(const hl_loss_plan_st &p, int64_t chunk, char *workspace, size_t at, ShiftedBuffers *b) {
  const auto take = [&](size_t bytes) {
    void *q = workspace + at;
    at = round_up(at + bytes, 256);
    return q;
  };
  const size_t n = size_t(chunk), H = size_t(p.desc.hidden);
  // E W (dX's product, after dW's) over the statistics and alpha X, which are spent by then.
  const size_t start = at;
  b->stats = take(n * size_t(tiles_of(p.desc.vocab, sm90::kBN)) * sizeof(TileStats));
  b->xs = take(n * H * sizeof(bf16));
  b->d32 = reinterpret_cast<float *>(workspace + start);
  at = std::max(at, round_up(start + n * H * sizeof(float), 256));
  b->shift = static_cast<float *>(take(n * sizeof(float)));
  b->alpha = static_cast<float *>(take(n * sizeof(float)));
  b->redo = static_cast<unsigned char *>(take(size_t(tiles_of(chunk, sm90::kBM))));
}

hl_status_t shifted_chunk(const char *fn, const hl_loss_plan_st &p, Gemms &g, const hl_loss_args_t &c,
                          const void *x, int64_t i0, int64_t total, Phase phase, bool form, Gathered gathered,
                          void *block, void *grad_hidden, void *grad_weight, bool accumulate_weight,
                          const ShiftedBuffers &b, GemmSpace gemm_ws, void *workspace, cudaStream_t stream) {
  const hl_loss_plan_desc_t &d = p.desc;
  const int64_t n = c.rows, V = d.vocab, H = d.hidden;
  const int64_t row_ctas = tiles_of(n, kRowWarps);
  if (form) {
    sm90::ShiftedParams P{};
    HL_TRY(map(fn, &P.x, x, H, n, c.hidden_stride, sm90::kBM));
    HL_TRY(map(fn, &P.w, c.weight, H, V, c.weight_stride, sm90::kBN));
    if (b.e) HL_TRY(map(fn, &P.e, b.e, V, n, b.lde, 64));
    P.store_e = b.e != nullptr;
    P.stats = static_cast<TileStats *>(b.stats), P.scale = p.opt.scale;
    P.M = int(n), P.N = int(V), P.K = int(H);
    P.tiles_m = int(tiles_of(n, sm90::kBM)), P.tiles_n = int(tiles_of(V, sm90::kBN));
    // Row blocks a group: the group's rows of X (~16 MB) stay in L2 while it runs over W.
    P.group_m = int(std::clamp<int64_t>((int64_t(16) << 20) / (int64_t(sm90::kBM) * H * 2), 1, P.tiles_m));
    const int grid = int(std::min<int64_t>(hl::dev::sm_count(), int64_t(P.tiles_m) * P.tiles_n));
    hl::dev::allow_smem(sm90::shifted_logits_kernel, sm90::kSmem);
    // The first pass at the first shift; rows outside its window again at their own max.
    HL_CUDA_TRY(cudaMemsetAsync(b.redo, 0, size_t(P.tiles_m), stream));
    sm90::shifted_logits_kernel<<<grid, sm90::kThreads, sm90::kSmem, stream>>>(P);
    HL_CUDA_TRY_LAUNCH();
    window_kernel<<<row_ctas, 32 * kRowWarps, 0, stream>>>(P.stats, P.tiles_n, n, b.shift, b.redo);
    HL_CUDA_TRY_LAUNCH();
    P.shift = b.shift, P.redo = b.redo;
    sm90::shifted_logits_kernel<<<grid, sm90::kThreads, sm90::kSmem, stream>>>(P);
    HL_CUDA_TRY_LAUNCH();
  }
  FinishArgs f{};
  f.stats = static_cast<const TileStats *>(b.stats), f.tiles = tiles_of(V, sm90::kBN);
  f.shift = b.shift, f.alpha = b.alpha;
  f.x = static_cast<const bf16 *>(x), f.w = static_cast<const bf16 *>(c.weight);
  f.ldx = c.hidden_stride, f.ldw = c.weight_stride;
  f.e = static_cast<bf16 *>(b.e), f.lde = b.lde;
  f.xs = grad_weight ? static_cast<bf16 *>(b.xs) : nullptr;
  f.rows = n, f.H = H, f.V = V, f.H8 = H / 8 * 8;
  f.phase = phase;
  f.k = row_params(p, c, workspace, i0, total, phase, gathered, block);
  finish_kernel<<<row_ctas, 32 * kRowWarps, 0, stream>>>(f);
  HL_CUDA_TRY_LAUNCH();
  if (phase == kStats) return HL_STATUS_SUCCESS;
  // dW first: dX's product goes where alpha X was.
  if (grad_weight)
    HL_TRY(run_gemm(fn, g, {false, true, H, V, n, b.xs, H, b.e, b.lde, grad_weight, c.grad_weight_stride,
                            d.grad_weight_dtype, accumulate_weight}, gemm_ws, stream));
  if (grad_hidden) {
    HL_TRY(run_gemm(fn, g, {false, false, H, n, V, c.weight, c.weight_stride, b.e, b.lde, b.d32, H, HL_DTYPE_F32,
                            false}, gemm_ws, stream));
    const int64_t ctas = std::min<int64_t>(n, int64_t(hl::dev::sm_count()) * 16);
    const bool acc = d.grad_hidden_mode == HL_LOSS_GRAD_ACCUMULATE;
    const size_t elt = dtype_size(d.grad_hidden_dtype);
    const bool vec = H % 4 == 0 && c.grad_hidden_stride % 4 == 0 && hl::dev::aligned_to(grad_hidden, 4 * elt);
    if (d.grad_hidden_dtype == HL_DTYPE_F32)
      scale_rows_kernel<<<ctas, 256, 0, stream>>>(b.d32, b.alpha, static_cast<float *>(grad_hidden),
                                                  c.grad_hidden_stride, n, H, acc, vec);
    else
      scale_rows_kernel<<<ctas, 256, 0, stream>>>(b.d32, b.alpha, static_cast<bf16 *>(grad_hidden),
                                                  c.grad_hidden_stride, n, H, acc, vec);
    HL_CUDA_TRY_LAUNCH();
  }
  return HL_STATUS_SUCCESS;
}

}  // namespace hl::loss::dev
