// gdn_bwd_dqkwg on the GPU: the portable kernel (sm_80 and later, every dtype and option), and the
// dispatch between it and the Hopper kernel (dqkwg_sm90.cu).
//
// Work: one CTA (8 warps) per (chunk, q/k head, 64-wide K slice). On sm_90 the K slices of one
// (chunk, q/k head) form a thread-block cluster: each CTA streams its own rows of h and dh exactly
// once, and the slices' dg partials are summed through distributed shared memory in rank order
// (deterministic, no atomics, no workspace). do, v, dv are shared by the slices through L2 (the
// cluster's CTAs run together). Without clusters (sm_80) one CTA walks all K slices in turn.
// Inside a CTA: the value heads of the q/k head (GVA; their dq, dk sum stays on chip), then V in
// 32-wide chunks streamed with cp.async through three shared-memory stages (one barrier per
// chunk). Each warp owns a 16 x 32 block of the four 64 x 64 products (ds = do v^T, dq = do h^T,
// dk = v dh^T, dw = dv h^T) and shares its fragments between them (do feeds ds and dq, h feeds dq
// and dw). ~105 KB of shared memory and <= 128 registers: two CTAs per SM, so one CTA's epilogue
// (ds gated and rounded, ds k, ds^T q, dg from the final dq, dk) overlaps the other's loads.
// K and V that are not multiples of 64 / 32 run through zero-filled tiles.
#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <vector>

#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>

#include "common/cuda_util.h"
#include "common/dtype.cuh"
#include "gdn/dqkwg_sm90.h"
#include "gdn/launch.h"
#include "gdn/mma.cuh"
#include "hl/gdn/chunks.h"

namespace hl::gdn::dev {
using namespace hl::dev;  // the common device helpers (kernels/common)

namespace {

constexpr int kLdS = kVC + 8;         // stage tile pitch (80 bytes: ldmatrix conflict-free)
constexpr int kStageTile = kTile * kLdS;

struct Params {
  const void *q, *k, *v, *do_, *dv, *h, *dh;
  void *dq, *dk, *dw;
  const float *g, *g_gamma;
  float *dg;
  ChunkTable chunks;
  int H, HV, K, V, G, KS, VCN;  // KS: 64-wide K slices; VCN: 32-wide V chunks
  int nsplit;                   // CTAs per (chunk, q/k head): KS (cluster) or 1
  float scale;
  int vw;  // 16-bit elements a copy of q, k, v, do, dv (and 16-bit h, dh): 8, 4, 2 or 1 (element-wise)
  bool gated, log2, dg_on, dw_on, vec4, reverse_cumsum, v_first;  // v_first: h, dh [.., V, K]
};

// A 64 x COLS block by cp.async copies of W elements (nc, ld multiples of W; rows aligned to them).
template <int W, int COLS, int LDS, class T>
__device__ __forceinline__ void load_vectors(T *dst, const T *src, int64_t ld, int nr, int nc) {
  constexpr int kSeg = COLS / W, kPer = kTile * kSeg / kThreads;
  static_assert(kPer * kThreads == kTile * kSeg, "whole copies a thread");
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int id = threadIdx.x + i * kThreads, r = id / kSeg, c = (id % kSeg) * W;
    const bool ok = r < nr && c < nc;
    cp_async_bytes<W * sizeof(T)>(dst + r * LDS + c, ok ? src + r * ld + c : src, ok);
  }
}

// Loads a 64 x COLS block (row stride ld elements) into a shared tile of pitch LDS; zero outside
// nr x nc. vw > 1: cp.async copies of vw elements (S == T: Params::vw). vec4: fp32 source read 16
// bytes at a time and rounded (nc, ld multiples of 4, aligned). Else element-wise (odd K or V).
// trans: the block is stored transposed (element (r, c) at src[c * ld + r]; element-wise).
template <int COLS, int LDS, class T, class S>
__device__ __forceinline__ void load_tile(T *dst, const S *src, int64_t ld, int nr, int nc, int vw, bool vec4,
                                          bool trans = false) {
  const int tid = threadIdx.x;
  if (trans) {  // consecutive threads read consecutive rows: contiguous in the source
#pragma unroll 4
    for (int i = 0; i < kTile * COLS / kThreads; ++i) {
      const int id = tid + i * kThreads, r = id % kTile, c = id / kTile;
      dst[r * LDS + c] = from_float<T>(r < nr && c < nc ? to_float(src[c * ld + r]) : 0.f);
    }
    return;
  }
  if constexpr (sizeof(S) == sizeof(T)) {
    switch (vw) {
      case 8: return load_vectors<8, COLS, LDS>(dst, src, ld, nr, nc);
      case 4: return load_vectors<4, COLS, LDS>(dst, src, ld, nr, nc);
      case 2: return load_vectors<2, COLS, LDS>(dst, src, ld, nr, nc);
      default: break;
    }
  } else {
    if (vec4) {
      constexpr int kSeg = COLS / 4, kPer = kTile * kSeg / kThreads;
      float4 x[kPer];
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int id = tid + i * kThreads, r = id / kSeg, c = (id % kSeg) * 4;
        x[i] = r < nr && c < nc ? *reinterpret_cast<const float4 *>(src + r * ld + c) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int id = tid + i * kThreads, r = id / kSeg, c = (id % kSeg) * 4;
        Pack<T, 4> pk;
        pk.v[0] = from_float<T>(x[i].x), pk.v[1] = from_float<T>(x[i].y);
        pk.v[2] = from_float<T>(x[i].z), pk.v[3] = from_float<T>(x[i].w);
        store_pack<T, 4>(dst + r * LDS + c, pk);
      }
      return;
    }
  }
#pragma unroll 4
  for (int i = 0; i < kTile * COLS / kThreads; ++i) {
    const int id = tid + i * kThreads, r = id / COLS, c = id % COLS;
    dst[r * LDS + c] = from_float<T>(r < nr && c < nc ? to_float(src[r * ld + c]) : 0.f);
  }
}

// The four products of one stage for one warp's 16 x 32 block, over the stage's 32 V columns.
// All tiles are [64][kLdS], k (= V) contiguous: ds += do v^T, dq += do h^T, dk += v dh^T,
// dw += dv h^T. Fragments are shared: do's A feeds ds and dq, h's B feeds dq and dw.
template <class T>
__device__ __forceinline__ void stage_mma(float (&ds)[4][4], float (&dq)[4][4], float (&dk)[4][4], float (&dw)[4][4],
                                          const T *do_t, const T *v_t, const T *dv_t, const T *h_t, const T *dh_t,
                                          bool dw_on, int m0, int n0, int lane) {
  const int r8 = lane % 8, hi = lane / 16, mid = (lane / 8) % 2;
#pragma unroll
  for (int k0 = 0; k0 < kVC; k0 += 16) {
    const int aoff = (m0 + lane % 16) * kLdS + k0 + hi * 8;
    uint32_t a_do[4], a_v[4], a_dv[4];
    ldsm_x4(a_do, do_t + aoff);
    ldsm_x4(a_v, v_t + aoff);
    if (dw_on) ldsm_x4(a_dv, dv_t + aoff);
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int boff = (n0 + 16 * p + hi * 8 + r8) * kLdS + k0 + mid * 8;
      uint32_t b[4];
      ldsm_x4(b, v_t + boff);
      mma16816<T>(ds[2 * p], a_do, b[0], b[1]);
      mma16816<T>(ds[2 * p + 1], a_do, b[2], b[3]);
      ldsm_x4(b, h_t + boff);
      mma16816<T>(dq[2 * p], a_do, b[0], b[1]);
      mma16816<T>(dq[2 * p + 1], a_do, b[2], b[3]);
      if (dw_on) {
        mma16816<T>(dw[2 * p], a_dv, b[0], b[1]);
        mma16816<T>(dw[2 * p + 1], a_dv, b[2], b[3]);
      }
      ldsm_x4(b, dh_t + boff);
      mma16816<T>(dk[2 * p], a_v, b[0], b[1]);
      mma16816<T>(dk[2 * p + 1], a_v, b[2], b[3]);
    }
  }
}

// NARROW: K or V not a multiple of 8 (or a pointer not 16-byte aligned): the copies of P.vw
// elements; else 16-byte copies alone (the narrow paths' code would cost registers: 2x the spills).
template <class T, class HT, bool NARROW>
__global__ void __launch_bounds__(kThreads, 2) dqkwg_kernel(Params P) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int vw = NARROW ? P.vw : 8;
  const int n_stage = P.dw_on ? 5 : 4;  // do, v, h, dh (, dv)
  T *stage = reinterpret_cast<T *>(smem);
  T *q_s = stage + kStages * n_stage * kStageTile, *k_s = q_s + kTileElems, *ds_s = k_s + kTileElems;
  float *gam_s = reinterpret_cast<float *>(ds_s + kTileElems);  // [2][64] gate, by (slice, head) parity
  float *red_s = gam_s + 2 * kTile;                              // [2][64] dg row partials
  float *red8 = red_s + 2 * kTile;                               // [8] per-warp dgl partials
  float *dg_s = red8 + 8;                                        // [G][64] dg per value head
  float *dgl_s = dg_s + P.G * kTile;                             // [G] last-row term
  float *sum_s = dgl_s + ((P.G + 3) & ~3);                       // GVA: [32][kThreads] dq, dk sums

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int m0 = 16 * (warp % 4), n0 = 32 * (warp / 4);
  const int64_t blk = blockIdx.x;
  const int rank = int(blk % P.nsplit);  // cluster rank = this CTA's K slice when split
  const int64_t ch = blk / P.nsplit, cid = ch / P.H;
  const int hq = int(ch % P.H);
  const int ks_lo = P.nsplit > 1 ? rank : 0, ks_n = P.nsplit > 1 ? 1 : P.KS;

  int64_t tok0;
  int nr;
  locate_chunk(P.chunks, cid, &tok0, &nr);

  for (int i = tid; i < P.G * (kTile + 1); i += kThreads) dg_s[i] = 0.f;  // dg_s and dgl_s

  const T *q = static_cast<const T *>(P.q), *k = static_cast<const T *>(P.k);
  const T *v = static_cast<const T *>(P.v), *dO = static_cast<const T *>(P.do_), *dv = static_cast<const T *>(P.dv);
  const HT *h = static_cast<const HT *>(P.h), *dh = static_cast<const HT *>(P.dh);
  const int64_t ldqk = int64_t(P.H) * P.K, ldv = int64_t(P.HV) * P.V, ldw = int64_t(P.HV) * P.K;
  const int per_slice = P.G * P.VCN, total = ks_n * per_slice;

  auto issue_stage = [&](int it) {
    if (it >= total) return;
    const int ks = ks_lo + it / per_slice, hvl = (it % per_slice) / P.VCN, vc = it % P.VCN;
    const int hv = hq * P.G + hvl;
    T *buf = stage + (it % kStages) * n_stage * kStageTile;
    const int ncv = min(kVC, P.V - vc * kVC), nrk = min(kTile, P.K - ks * kTile);
    const int64_t tv = (tok0 * P.HV + hv) * P.V + vc * kVC;
    // this stage's [K slice][V chunk] of h, dh; stored [V, K] with state_v_first
    const int64_t th = (cid * P.HV + hv) * P.K * P.V +
                       (P.v_first ? int64_t(vc) * kVC * P.K + ks * kTile : int64_t(ks) * kTile * P.V + vc * kVC);
    const int64_t ldh = P.v_first ? P.K : P.V;
    load_tile<kVC, kLdS>(buf, dO + tv, ldv, nr, ncv, vw, false);
    load_tile<kVC, kLdS>(buf + kStageTile, v + tv, ldv, nr, ncv, vw, false);
    load_tile<kVC, kLdS>(buf + 2 * kStageTile, h + th, ldh, nrk, ncv, vw, P.vec4, P.v_first);
    load_tile<kVC, kLdS>(buf + 3 * kStageTile, dh + th, ldh, nrk, ncv, vw, P.vec4, P.v_first);
    if (P.dw_on) load_tile<kVC, kLdS>(buf + 4 * kStageTile, dv + tv, ldv, nr, ncv, vw, false);
  };

  float ds[4][4], dq[4][4], dk[4][4], dw[4][4];
  zero(ds), zero(dq), zero(dk), zero(dw);
  float hdh = 0.f;  // this thread's share of sum(h * dh) for the current (slice, value head)

  // Commit groups: s0, (empty), s1, then per iteration: [q, k of a new slice], s(it + 2).
  issue_stage(0);
  cp_async_commit();
  cp_async_commit();
  issue_stage(1);
  cp_async_commit();
  int it_slice = 0;  // first iteration of the current slice
  for (int it = 0; it < total; ++it) {
    const int ks = ks_lo + it / per_slice, hvl = (it % per_slice) / P.VCN, vc = it % P.VCN;
    const int hv = hq * P.G + hvl, nck = min(kTile, P.K - ks * kTile);
    const int epoch = it / P.VCN;  // (slice, value head) index: picks the gate buffer
    const int64_t tqk = (tok0 * P.H + hq) * P.K + ks * kTile;
    if (vc == 0 && tid < kTile) {  // this (slice, head)'s gate; visible after the barrier below
      float gv = 0.f;
      if (P.gated && tid < nr) gv = P.g ? P.g[(tok0 + tid) * P.HV + hv] : P.g_gamma[hv] * float(tid + 1);
      gam_s[(epoch & 1) * kTile + tid] = gv;
    }
    cp_async_wait<2>();  // stage it landed (this thread's part)
    __syncthreads();     // ... everyone's; and iteration it - 1 is over: its buffer may be refilled
    const bool new_slice = it % per_slice == 0;
    if (new_slice) {  // this slice's q, k (the previous slice's epilogues are over)
      it_slice = it;
      load_tile<kTile, kLd>(q_s, q + tqk, ldqk, nr, nck, vw, false);
      load_tile<kTile, kLd>(k_s, k + tqk, ldqk, nr, nck, vw, false);
    }
    cp_async_commit();
    issue_stage(it + 2);
    cp_async_commit();

    const T *buf = stage + (it % kStages) * n_stage * kStageTile;
    const T *h_t = buf + 2 * kStageTile, *dh_t = buf + 3 * kStageTile;
    stage_mma<T>(ds, dq, dk, dw, buf, buf + kStageTile, buf + 4 * kStageTile, h_t, dh_t, P.dw_on, m0, n0, lane);
    if (P.dg_on) {  // 8 consecutive elements of one row of h and dh
      const int off = (tid / 4) * kLdS + (tid % 4) * 8;
      const Pack<T, 8> a = load_pack<T, 8>(h_t + off), b = load_pack<T, 8>(dh_t + off);
#pragma unroll
      for (int c = 0; c < 8; ++c) hdh += to_float(a.v[c]) * to_float(b.v[c]);
    }

    if (vc == P.VCN - 1) {  // epilogue of (slice ks, value head hv)
      if (it - it_slice < 2) {  // q, k were committed too recently for the wait above
        cp_async_wait<0>();
        __syncthreads();
      }
      const float *gam = gam_s + (epoch & 1) * kTile;
      const float gl = gam[nr - 1];
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = m0 + lane / 4 + 8 * (e / 2), c = n0 + 8 * j + 2 * (lane % 4) + e % 2;
          // a select, never a multiply by a mask: E(g_t - g_s) overflows above the diagonal
          ds[j][e] = c <= r && r < nr ? ds[j][e] * gexp(gam[r] - gam[c], P.log2) * P.scale : 0.f;
          dq[j][e] *= gexp(gam[r], P.log2) * P.scale;
          dk[j][e] = r < nr ? dk[j][e] * gexp(gl - gam[r], P.log2) : 0.f;
        }
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = m0 + lane / 4 + 8 * half, c = n0 + 8 * j + 2 * (lane % 4);
          store_pack<T, 2>(ds_s + r * kLd + c, pack_pair<T>(ds[j][2 * half], ds[j][2 * half + 1]));
        }
      __syncthreads();
      float dglk = 0.f;  // sum(dk_inter * k), part of the last-row term
      if (P.dg_on) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = m0 + lane / 4 + 8 * half, c = n0 + 8 * j + 2 * (lane % 4);
            const Pack<T, 2> kk = load_pack<T, 2>(k_s + r * kLd + c);
            dglk += dk[j][2 * half] * to_float(kk.v[0]) + dk[j][2 * half + 1] * to_float(kk.v[1]);
          }
      }
      warp_mma<T, false, true>(dq, ds_s, k_s, m0, n0, lane);
      warp_mma<T, true, true>(dk, ds_s, q_s, m0, n0, lane);
      if (P.dg_on) {
        float p[2] = {0.f, 0.f};  // this thread's part of dg for its two rows
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = m0 + lane / 4 + 8 * half, c = n0 + 8 * j + 2 * (lane % 4);
            const Pack<T, 2> qq = load_pack<T, 2>(q_s + r * kLd + c), kk = load_pack<T, 2>(k_s + r * kLd + c);
            p[half] += dq[j][2 * half] * to_float(qq.v[0]) + dq[j][2 * half + 1] * to_float(qq.v[1]) -
                       dk[j][2 * half] * to_float(kk.v[0]) - dk[j][2 * half + 1] * to_float(kk.v[1]);
          }
        float l = hdh * gexp(gl, P.log2) + dglk;
#pragma unroll
        for (int o = 1; o < 4; o *= 2) {
          p[0] += __shfl_xor_sync(0xffffffffu, p[0], o);
          p[1] += __shfl_xor_sync(0xffffffffu, p[1], o);
        }
#pragma unroll
        for (int o = 1; o < 32; o *= 2) l += __shfl_xor_sync(0xffffffffu, l, o);
        if (lane % 4 == 0) {
          red_s[(warp / 4) * kTile + m0 + lane / 4] = p[0];
          red_s[(warp / 4) * kTile + m0 + lane / 4 + 8] = p[1];
        }
        if (lane == 0) red8[warp] = l;
        __syncthreads();
        if (tid < kTile) dg_s[hvl * kTile + tid] += red_s[tid] + red_s[kTile + tid];
        if (tid == kTile) {
          float s = 0.f;
          for (int w = 0; w < 8; ++w) s += red8[w];
          dgl_s[hvl] += s;
        }
      }
      if (P.dw_on)
        store_block(static_cast<T *>(P.dw) + (tok0 * P.HV + hv) * P.K + ks * kTile, ldw, nr, nck, dw, -1.f, m0, n0,
                    lane, vw > 1);
      if (P.G > 1) {  // GVA: running dq, dk sums over the value heads, each thread its own words
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float *sq = sum_s + (j * 4 + e) * kThreads + tid, *sk = sq + 16 * kThreads;
            if (hvl > 0) dq[j][e] += *sq, dk[j][e] += *sk;
            if (hvl < P.G - 1) *sq = dq[j][e], *sk = dk[j][e];
          }
      }
      if (hvl == P.G - 1) {
        store_block(static_cast<T *>(P.dq) + tqk, ldqk, nr, nck, dq, 1.f, m0, n0, lane, vw > 1);
        store_block(static_cast<T *>(P.dk) + tqk, ldqk, nr, nck, dk, 1.f, m0, n0, lane, vw > 1);
      }
      zero(ds), zero(dq), zero(dk), zero(dw);
      hdh = 0.f;
    }
  }

  if (!P.dg_on) return;
  __syncthreads();
  if (tid < P.G) dg_s[tid * kTile + nr - 1] += dgl_s[tid];  // this CTA's last-row term
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (P.nsplit > 1) {  // sum the K slices' partials into rank 0, in rank order
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    if (rank == 0)
      for (int i = tid; i < P.G * kTile; i += kThreads) {
        float s = dg_s[i];
        for (int r = 1; r < P.nsplit; ++r) s += cluster.map_shared_rank(dg_s, r)[i];
        dg_s[i] = s;
      }
    cluster.sync();  // the other ranks' shared memory stays alive until rank 0 has read it
    if (rank != 0) return;
  }
#endif
  __syncthreads();
  if (tid < P.G && P.reverse_cumsum) {  // the optional in-chunk reverse cumsum, one thread per value head
    float *d = dg_s + tid * kTile;
    for (int t = nr - 2; t >= 0; --t) d[t] += d[t + 1];
  }
  __syncthreads();
  for (int i = tid; i < P.G * kTile; i += kThreads) {
    const int hvl = i / kTile, t = i % kTile;
    if (t < nr) P.dg[(tok0 + t) * P.HV + hq * P.G + hvl] = dg_s[i];
  }
}

size_t smem_bytes(const hl_gdn_bwd_dqkwg_args_t &a) {
  const int n_stage = a.dw ? 5 : 4;
  const size_t G = size_t(a.HV / a.H);
  size_t b = size_t(kStages * n_stage) * kStageTile * 2 + 3 * size_t(kTileElems) * 2;
  b += (kTile * 4 + 8 + G * kTile + ((G + 3) & ~size_t(3))) * sizeof(float);
  if (G > 1) b += 32 * kThreads * sizeof(float);
  return b;
}

template <class T, class HT>
hl_status_t launch(Params p, int64_t heads_chunks, size_t smem, hl_stream_t stream) {
  auto kernel = p.vw == 8 ? dqkwg_kernel<T, HT, false> : dqkwg_kernel<T, HT, true>;
  // The limit belongs to the kernel, which calls of other sizes (maybe on other threads) share:
  // raise it to the most the device allows rather than to this call's size.
  int dev = 0, optin = 0;
  cudaFuncAttributes fa{};
  HL_CUDA_TRY(cudaGetDevice(&dev));
  HL_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  HL_CUDA_TRY(cudaFuncGetAttributes(&fa, kernel));
  const int most = optin - int(fa.sharedSizeBytes);
  if (int64_t(smem) > most)
    return fail(HL_STATUS_NOT_SUPPORTED, "%zu bytes of shared memory needed, %d available",
                smem, most);
  HL_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, most));
  p.nsplit = portable_split(p.KS, hl::dev::code_arch() >= 90);  // one CTA per K slice, in one cluster
  const int64_t blocks = heads_chunks * p.nsplit;  // < 2^31: checked with the arguments (gdn/api.cpp)
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg =
      hl::dev::cluster_launch(blocks, kThreads, smem, p.nsplit, static_cast<cudaStream_t>(stream), attr);
  HL_CUDA_TRY(cudaLaunchKernelEx(&cfg, kernel, p));
  HL_CUDA_TRY_LAUNCH();
  return HL_STATUS_SUCCESS;
}

// The varlen chunk table on the device (HL_GDN_UNCHECKED: cu_seqlens is never copied to the
// host): seq_start = cu_seqlens clamped to [0, T] and made non-decreasing (so a bad one cannot send
// an access out of bounds), chunk_first = the exclusive sum of ceil(length / 64); the same table
// the host builds from a valid cu_seqlens. One CTA, tiles of kTableThreads entries with carries.
constexpr int kTableThreads = 512;
struct MaxOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a > b ? a : b; }
};
__global__ void __launch_bounds__(kTableThreads)
chunk_table_kernel(const void *cu, bool cu64, int64_t n, int64_t T, int64_t *chunk_first, int64_t *seq_start) {
  using Scan = cub::BlockScan<int64_t, kTableThreads>;
  __shared__ typename Scan::TempStorage tmp[2];
  __shared__ int64_t ends[kTableThreads];
  const int tid = threadIdx.x;
  int64_t carry_m = 0, carry_c = 0;  // the previous tiles' last start and chunk count
  for (int64_t base = 0; base < n; base += kTableThreads) {
    const int64_t i = base + tid;
    int64_t c = 0;
    if (i < n) c = cu64 ? static_cast<const int64_t *>(cu)[i] : static_cast<const int32_t *>(cu)[i];
    c = c < 0 ? 0 : c > T ? T : c;
    int64_t m, cnt_incl, tile_chunks;
    Scan(tmp[0]).InclusiveScan(c, m, MaxOp());
    m = m > carry_m ? m : carry_m;
    ends[tid] = m;
    __syncthreads();
    const int64_t prev = tid ? ends[tid - 1] : carry_m;
    const int64_t cnt = i < n && i > 0 ? chunks_in(m - prev) : 0;  // chunks of sequence i - 1
    Scan(tmp[1]).InclusiveSum(cnt, cnt_incl, tile_chunks);
    if (i < n) seq_start[i] = m, chunk_first[i] = carry_c + cnt_incl;
    carry_m = ends[kTableThreads - 1];
    carry_c += tile_chunks;
    __syncthreads();  // ends and the scans' storage are reused by the next tile
  }
}

}  // namespace

// The portable kernel (sm_80 and sm_90, every dtype and option).
hl_status_t cuda_dqkwg_portable(const hl_gdn_bwd_dqkwg_args_t &a, const ChunkTable &table, int64_t chunks,
                                hl_stream_t stream) {
  Params p{};
  p.q = a.q, p.k = a.k, p.v = a.v, p.do_ = a.do_, p.dv = a.dv, p.h = a.h, p.dh = a.dh;
  p.dq = a.dq, p.dk = a.dk, p.dw = a.dw, p.g = a.g, p.g_gamma = a.g_gamma, p.dg = a.dg;
  p.chunks = table;
  p.H = int(a.H), p.HV = int(a.HV), p.K = int(a.K), p.V = int(a.V), p.G = int(a.HV / a.H);
  p.KS = int((a.K + kTile - 1) / kTile), p.VCN = int((a.V + kVC - 1) / kVC);
  p.nsplit = 1;
  p.scale = a.scale;
  p.gated = a.gate != HL_GDN_GATE_NONE, p.log2 = is_log2(a.gate), p.dg_on = has_dg(a.gate);
  p.dw_on = a.dw != nullptr, p.reverse_cumsum = a.reverse_cumsum != 0;
  p.v_first = a.flags & HL_GDN_STATE_V_FIRST;
  // The widest copies of the 16-bit tensors their K, V and pointers allow (16, 8 or 4 bytes; dq, dk,
  // dw stored in pairs from 4); fp32 states are read 16 bytes at a time and rounded
  std::vector<const void *> ptrs{a.q, a.k, a.v, a.do_, a.dq, a.dk};
  if (a.h_dtype == a.dtype) ptrs.insert(ptrs.end(), {a.h, a.dh});
  if (a.dw) ptrs.insert(ptrs.end(), {a.dv, a.dw});
  int align = 16;
  while (align > 2 && !std::all_of(ptrs.begin(), ptrs.end(), [&](const void *x) { return aligned_to(x, align); }))
    align /= 2;
  p.vw = portable_copy(a.K, a.V, align);
  p.vec4 = a.h_dtype == HL_DTYPE_F32 && a.V % 4 == 0 && aligned16(a.h) && aligned16(a.dh);

  const int64_t heads_chunks = chunks * a.H;
  const size_t smem = smem_bytes(a);
  if (smem > 227 * 1024)
    return fail(HL_STATUS_NOT_SUPPORTED, "HV / H = %lld value heads per q/k head is too many",
                (long long)(a.HV / a.H));
  const bool f32_state = a.h_dtype == HL_DTYPE_F32;
  if (a.dtype == HL_DTYPE_BF16)
    return f32_state ? launch<__nv_bfloat16, float>(p, heads_chunks, smem, stream)
                     : launch<__nv_bfloat16, __nv_bfloat16>(p, heads_chunks, smem, stream);
  return f32_state ? launch<__half, float>(p, heads_chunks, smem, stream)
                   : launch<__half, __half>(p, heads_chunks, smem, stream);
}

}  // namespace hl::gdn::dev

// The entry points src/gdn/api.cpp calls.
namespace hl::gdn {
using namespace dev;

size_t cuda_workspace_bytes(const hl_gdn_bwd_dqkwg_args_t &a) {
  return a.cu_seqlens ? size_t(2 * (a.num_seqs + 1)) * sizeof(int64_t) : 0;
}

hl_status_t cuda_read_cu_seqlens(const hl_gdn_bwd_dqkwg_args_t &a, hl_stream_t stream, std::vector<int64_t> *cu) {
  const size_t n = size_t(a.num_seqs + 1);
  cu->resize(n);
  if (a.cu_seqlens_dtype == HL_DTYPE_I64) {
    HL_CUDA_TRY(cudaMemcpyAsync(cu->data(), a.cu_seqlens, n * 8, cudaMemcpyDeviceToHost, stream));
    HL_CUDA_TRY(cudaStreamSynchronize(stream));
    return HL_STATUS_SUCCESS;
  }
  std::vector<int32_t> c32(n);
  HL_CUDA_TRY(cudaMemcpyAsync(c32.data(), a.cu_seqlens, n * 4, cudaMemcpyDeviceToHost, stream));
  HL_CUDA_TRY(cudaStreamSynchronize(stream));
  std::copy(c32.begin(), c32.end(), cu->begin());
  return HL_STATUS_SUCCESS;
}

hl_status_t cuda_dqkwg(const hl_gdn_bwd_dqkwg_args_t &a, const std::vector<int64_t> &cu, int64_t chunks,
                       hl_stream_t stream) {
  int64_t *t = static_cast<int64_t *>(a.workspace);  // varlen: the chunk table (Chunks::table())
  if (a.cu_seqlens && (a.flags & HL_GDN_UNCHECKED)) {  // built on the device (cu is empty)
    const int64_t n = a.num_seqs + 1;
    chunk_table_kernel<<<1, kTableThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        a.cu_seqlens, a.cu_seqlens_dtype == HL_DTYPE_I64, n, a.T, t, t + n);
    HL_CUDA_TRY_LAUNCH();
  } else if (!cu.empty()) {
    const Chunks host(a.B, a.T, cu);
    // From pageable memory the copy returns once the table has been staged: it may go out of scope.
    HL_CUDA_TRY(cudaMemcpyAsync(t, host.table().data(), host.table().size() * 8, cudaMemcpyHostToDevice, stream));
  }
  const ChunkTable table = chunk_table(a.cu_seqlens ? t : nullptr, a.num_seqs, a.T, a.num_chunks);
  if (chunks * a.H == 0) return HL_STATUS_SUCCESS;
  if (sm90_takes(a, chunks)) return cuda_dqkwg_sm90(a, table, chunks, stream);
  if (forced_kernel() == Forced::kSm90)
    return fail(HL_STATUS_NOT_SUPPORTED, "HEADLOSS_GDN_KERNEL=sm90, but the Hopper kernel does not take "
                "this call (device, build or inputs)");
  return cuda_dqkwg_portable(a, table, chunks, stream);
}

}  // namespace hl::gdn
