// gdn_bwd_dqkwg on the GPU. One CTA per (chunk, q/k head) walks K in 64-column slices and, inside
// each, the value heads that share the q/k head (GVA), so their dq, dk sum stays in registers:
// deterministic and without extra traffic. For each (slice, value head) the V dimension streams
// through shared memory in 64-wide chunks (cp.async, three buffers) feeding four 64x64 products
// (ds, dq, dk, dw) on tensor cores; then ds is gated, rounded to the input dtype and multiplied
// back (ds k, ds^T q), and dg is formed from the final dq, dk (the request's optimisation).
// 8 warps, each owning a 16 x 32 block of every 64 x 64 tile. K and V that are not multiples of
// 64 run through zero-filled tiles.
#include <algorithm>
#include <initializer_list>
#include <vector>

#include "common/cuda_util.h"
#include "common/dtype.cuh"
#include "gdn/gdn.h"
#include "gdn/mma.cuh"

namespace hl::cuda::gdn {
namespace {

constexpr int kThreads = 256;
constexpr int kStages = 3;  // shared buffers of the V-chunk pipeline: two loads in flight during compute

struct Params {
  const void *q, *k, *v, *do_, *dv, *h, *dh;
  void *dq, *dk, *dw;
  const float *g, *g_gamma;
  float *dg;
  const int64_t *chunk_first;  // varlen: [S + 1] first global chunk of each sequence
  const int64_t *seq_start;    // varlen: [S + 1] cu_seqlens
  int64_t T, nt, num_seqs;     // nt: chunks per batch row (non-varlen)
  int H, HV, K, V, G, KS, VC;  // KS, VC: 64-wide slices of K and chunks of V
  float scale;
  bool gated, log2, dg_on, dw_on, vec, reverse_cumsum;
};

// Loads a 64 x 64 block (row stride ld elements) into a shared tile; zero outside nr x nc.
// vec: 16-byte cp.async (S == T, nc and ld multiples of 8, 16-byte aligned rows); otherwise
// element by element through registers, converting (fp32 states).
template <class T, class S>
__device__ __forceinline__ void load_tile(T *dst, const S *src, int64_t ld, int nr, int nc, bool vec) {
  if constexpr (sizeof(S) == sizeof(T)) {
    if (vec) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int id = threadIdx.x + i * kThreads, r = id / 8, c = (id % 8) * 8;
        const bool ok = r < nr && c < nc;
        cp_async16(dst + r * kLd + c, ok ? src + r * ld + c : src, ok ? 16 : 0);
      }
      return;
    }
  }
#pragma unroll 4
  for (int i = 0; i < kTile * kTile / kThreads; ++i) {
    const int id = threadIdx.x + i * kThreads, r = id / kTile, c = id % kTile;
    dst[r * kLd + c] = from_float<T>(r < nr && c < nc ? to_float(src[r * ld + c]) : 0.f);
  }
}

__device__ __forceinline__ float gexp(float x, bool log2) { return log2 ? exp2f(x) : expf(x); }

// Stores an accumulator block (times mul) to a row-major [rows, ld] output: rows < nr, cols < nc.
template <class T>
__device__ __forceinline__ void store_block(T *out, int64_t ld, int nr, int nc, const float (&acc)[4][4], float mul,
                                            int m0, int n0, int lane, bool pairs) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = m0 + lane / 4 + 8 * half, c = n0 + 8 * j + 2 * (lane % 4);
      if (r >= nr) continue;
      const float x0 = acc[j][2 * half] * mul, x1 = acc[j][2 * half + 1] * mul;
      T *p = out + r * ld + c;
      if (pairs && c + 1 < nc) {
        Pack<T, 2> pk;
        pk.v[0] = from_float<T>(x0);
        pk.v[1] = from_float<T>(x1);
        store_pack<T, 2>(p, pk);
      } else {
        if (c < nc) p[0] = from_float<T>(x0);
        if (c + 1 < nc) p[1] = from_float<T>(x1);
      }
    }
}

template <class T, class HT>
__global__ void __launch_bounds__(kThreads) dqkwg_kernel(Params P) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int n_stage = P.dw_on ? 5 : 4;  // do, v, h, dh (, dv)
  T *stage = reinterpret_cast<T *>(smem);
  T *q_s = stage + kStages * n_stage * kTileElems, *k_s = q_s + kTileElems, *ds_s = k_s + kTileElems;
  float *gam_s = reinterpret_cast<float *>(ds_s + kTileElems);  // [64] gate of the value head
  float *red_s = gam_s + kTile;                                  // [2][64] dg row partials
  float *red8 = red_s + 2 * kTile;                               // [8] per-warp dgl partials
  float *dg_s = red8 + 8;                                        // [G][64] dg per value head
  float *dgl_s = dg_s + P.G * kTile;                             // [G] last-row term

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int m0 = 16 * (warp % 4), n0 = 32 * (warp / 4);
  const int64_t cid = blockIdx.x / P.H;
  const int hq = blockIdx.x % P.H;

  // Locate the chunk: first token (flattened over B*T) and valid rows.
  int64_t tok0, n;
  if (P.chunk_first) {
    int64_t lo = 0, hi = P.num_seqs;  // last s with chunk_first[s] <= cid (a non-empty sequence)
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (P.chunk_first[mid] <= cid) lo = mid; else hi = mid;
    }
    tok0 = P.seq_start[lo] + (cid - P.chunk_first[lo]) * kTile;
    n = P.seq_start[lo + 1] - tok0;
  } else {
    const int64_t b = cid / P.nt, i = cid % P.nt;
    tok0 = b * P.T + i * kTile;
    n = P.T - i * kTile;
  }
  const int nr = n < kTile ? int(n) : kTile;

  for (int i = tid; i < P.G * (kTile + 1); i += kThreads) dg_s[i] = 0.f;  // dg_s and dgl_s

  const T *q = static_cast<const T *>(P.q), *k = static_cast<const T *>(P.k);
  const T *v = static_cast<const T *>(P.v), *dO = static_cast<const T *>(P.do_), *dv = static_cast<const T *>(P.dv);
  const HT *h = static_cast<const HT *>(P.h), *dh = static_cast<const HT *>(P.dh);
  const int64_t ldqk = int64_t(P.H) * P.K, ldv = int64_t(P.HV) * P.V, ldw = int64_t(P.HV) * P.K;
  const int per_slice = P.G * P.VC, total = P.KS * per_slice;

  auto issue_stage = [&](int it) {
    const int ks = it / per_slice, hvl = (it % per_slice) / P.VC, vc = it % P.VC;
    const int hv = hq * P.G + hvl;
    T *buf = stage + (it % kStages) * n_stage * kTileElems;
    const int ncv = min(kTile, P.V - vc * kTile), nrk = min(kTile, P.K - ks * kTile);
    const int64_t tv = (tok0 * P.HV + hv) * P.V + vc * kTile;
    const int64_t th = ((cid * P.HV + hv) * P.K + ks * kTile) * P.V + vc * kTile;
    load_tile(buf, dO + tv, ldv, nr, ncv, P.vec);
    load_tile(buf + kTileElems, v + tv, ldv, nr, ncv, P.vec);
    load_tile(buf + 2 * kTileElems, h + th, P.V, nrk, ncv, P.vec);
    load_tile(buf + 3 * kTileElems, dh + th, P.V, nrk, ncv, P.vec);
    if (P.dw_on) load_tile(buf + 4 * kTileElems, dv + tv, ldv, nr, ncv, P.vec);
  };

  float ds[4][4], dq[4][4], dk[4][4], dw[4][4], dq_sum[4][4], dk_sum[4][4];
  zero(ds), zero(dq), zero(dk), zero(dw), zero(dq_sum), zero(dk_sum);
  float hdh = 0.f;  // this thread's share of sum(h * dh) for the current (slice, value head)

  issue_stage(0);
  cp_async_commit();
  if (total > 1) issue_stage(1);
  cp_async_commit();
  for (int it = 0; it < total; ++it) {
    const int ks = it / per_slice, hvl = (it % per_slice) / P.VC, vc = it % P.VC;
    const int hv = hq * P.G + hvl, nck = min(kTile, P.K - ks * kTile);
    const int64_t tqk = (tok0 * P.H + hq) * P.K + ks * kTile;
    const bool load_qk = hvl == 0 && vc == P.VC - 1;  // this slice's q, k: needed from this epilogue on
    if (load_qk) {
      load_tile(q_s, q + tqk, ldqk, nr, nck, P.vec);
      load_tile(k_s, k + tqk, ldqk, nr, nck, P.vec);
      cp_async_commit();
    }
    if (it + 2 < total) issue_stage(it + 2);
    cp_async_commit();
    // Stage it (and q, k) complete; stage it + 1 may stay in flight unless q, k were committed after it.
    if (load_qk) cp_async_wait<1>();
    else cp_async_wait<2>();
    __syncthreads();

    const T *buf = stage + (it % kStages) * n_stage * kTileElems;
    const T *do_t = buf, *v_t = buf + kTileElems, *h_t = buf + 2 * kTileElems, *dh_t = buf + 3 * kTileElems;
    warp_mma<T, false, false>(ds, do_t, v_t, m0, n0, lane);
    warp_mma<T, false, false>(dq, do_t, h_t, m0, n0, lane);
    warp_mma<T, false, false>(dk, v_t, dh_t, m0, n0, lane);
    if (P.dw_on) warp_mma<T, false, false>(dw, buf + 4 * kTileElems, h_t, m0, n0, lane);
    if (P.dg_on) {
      const int e0 = tid * 16, r = e0 / kTile;  // 16 consecutive elements of one row
#pragma unroll
      for (int c = 0; c < 16; ++c) hdh += to_float(h_t[r * kLd + e0 % kTile + c]) * to_float(dh_t[r * kLd + e0 % kTile + c]);
    }

    if (vc == P.VC - 1) {  // epilogue of (slice ks, value head hv)
      if (tid < kTile) {
        float gv = 0.f;
        if (P.gated && tid < nr) gv = P.g ? P.g[(tok0 + tid) * P.HV + hv] : P.g_gamma[hv] * float(tid + 1);
        gam_s[tid] = gv;
      }
      __syncthreads();
      const float gl = gam_s[nr - 1];
      float dglk = 0.f;  // sum(dk_inter * k), part of the last-row term
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = m0 + lane / 4 + 8 * (e / 2), c = n0 + 8 * j + 2 * (lane % 4) + e % 2;
          // a select, never a multiply by a mask: E(g_t - g_s) overflows above the diagonal
          ds[j][e] = c <= r && r < nr ? ds[j][e] * gexp(gam_s[r] - gam_s[c], P.log2) * P.scale : 0.f;
          dq[j][e] *= gexp(gam_s[r], P.log2) * P.scale;
          dk[j][e] = r < nr ? dk[j][e] * gexp(gl - gam_s[r], P.log2) : 0.f;
          dglk += dk[j][e] * to_float(k_s[r * kLd + c]);
        }
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = m0 + lane / 4 + 8 * half, c = n0 + 8 * j + 2 * (lane % 4);
          Pack<T, 2> pk;
          pk.v[0] = from_float<T>(ds[j][2 * half]);
          pk.v[1] = from_float<T>(ds[j][2 * half + 1]);
          store_pack<T, 2>(ds_s + r * kLd + c, pk);
        }
      __syncthreads();
      warp_mma<T, false, true>(dq, ds_s, k_s, m0, n0, lane);
      warp_mma<T, true, true>(dk, ds_s, q_s, m0, n0, lane);
      if (P.dg_on) {
        float p[2] = {0.f, 0.f};  // this thread's part of dg for its two rows
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = m0 + lane / 4 + 8 * (e / 2), c = n0 + 8 * j + 2 * (lane % 4) + e % 2;
            p[e / 2] += dq[j][e] * to_float(q_s[r * kLd + c]) - dk[j][e] * to_float(k_s[r * kLd + c]);
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
                    lane, P.vec);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dq_sum[j][e] += dq[j][e];
          dk_sum[j][e] += dk[j][e];
        }
      zero(ds), zero(dq), zero(dk), zero(dw);
      hdh = 0.f;
      if (hvl == P.G - 1) {
        store_block(static_cast<T *>(P.dq) + tqk, ldqk, nr, nck, dq_sum, 1.f, m0, n0, lane, P.vec);
        store_block(static_cast<T *>(P.dk) + tqk, ldqk, nr, nck, dk_sum, 1.f, m0, n0, lane, P.vec);
        zero(dq_sum), zero(dk_sum);
      }
    }
    __syncthreads();  // the buffer of this iteration is refilled by the next one's prefetch
  }

  if (!P.dg_on) return;
  if (tid < P.G) {  // last-row term and the optional in-chunk reverse cumsum, one thread per value head
    float *d = dg_s + tid * kTile;
    d[nr - 1] += dgl_s[tid];
    for (int t = nr - 2; t >= 0 && P.reverse_cumsum; --t) d[t] += d[t + 1];
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
  return size_t(kStages * n_stage + 3) * kTileElems * 2 + (kTile * 3 + 8 + G * (kTile + 1)) * sizeof(float);
}

template <class T, class HT>
hl_status_t launch(const Params &p, int64_t blocks, size_t smem, hl_stream_t stream) {
  auto kernel = dqkwg_kernel<T, HT>;
  HL_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<unsigned(blocks), kThreads, smem, stream>>>(p);
  HL_CUDA_TRY_LAUNCH();
  return HL_STATUS_SUCCESS;
}

bool aligned16(const void *p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace
}  // namespace hl::cuda::gdn

namespace hl::gdn {
using namespace hl::cuda::gdn;

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
  Params p{};
  p.q = a.q, p.k = a.k, p.v = a.v, p.do_ = a.do_, p.dv = a.dv, p.h = a.h, p.dh = a.dh;
  p.dq = a.dq, p.dk = a.dk, p.dw = a.dw, p.g = a.g, p.g_gamma = a.g_gamma, p.dg = a.dg;
  p.T = a.T, p.nt = a.num_chunks, p.num_seqs = a.num_seqs;
  p.H = int(a.H), p.HV = int(a.HV), p.K = int(a.K), p.V = int(a.V), p.G = int(a.HV / a.H);
  p.KS = int((a.K + kTile - 1) / kTile), p.VC = int((a.V + kTile - 1) / kTile);
  p.scale = a.scale;
  p.gated = a.gate != HL_GDN_GATE_NONE, p.log2 = is_log2(a.gate), p.dg_on = has_dg(a.gate);
  p.dw_on = a.dw != nullptr, p.reverse_cumsum = a.reverse_cumsum != 0;
  // 16-byte paths for the 16-bit tensors (fp32 states always go element by element)
  p.vec = a.K % 8 == 0 && a.V % 8 == 0;
  for (const void *ptr : std::initializer_list<const void *>{a.q, a.k, a.v, a.do_, a.dq, a.dk})
    p.vec = p.vec && aligned16(ptr);
  if (a.h_dtype == a.dtype) p.vec = p.vec && aligned16(a.h) && aligned16(a.dh);
  if (a.dw) p.vec = p.vec && aligned16(a.dv) && aligned16(a.dw);

  const int64_t blocks = chunks * a.H;
  if (blocks > INT32_MAX)
    return fail(HL_STATUS_NOT_SUPPORTED, "gdn_bwd_dqkwg: %lld chunks x %lld heads exceed one launch",
                (long long)chunks, (long long)a.H);
  const size_t smem = smem_bytes(a);
  if (smem > 227 * 1024)
    return fail(HL_STATUS_NOT_SUPPORTED, "gdn_bwd_dqkwg: HV / H = %lld value heads per q/k head is too many",
                (long long)(a.HV / a.H));
  if (!cu.empty()) {  // chunk table: first chunk of each sequence, then cu_seqlens itself
    std::vector<int64_t> table(2 * cu.size());
    int64_t c = 0;
    for (size_t s = 0; s < cu.size(); ++s) {
      table[s] = c;
      table[cu.size() + s] = cu[s];
      if (s + 1 < cu.size()) c += (cu[s + 1] - cu[s] + kTile - 1) / kTile;
    }
    // From pageable memory the copy returns once `table` has been staged: it may go out of scope.
    HL_CUDA_TRY(cudaMemcpyAsync(a.workspace, table.data(), table.size() * 8, cudaMemcpyHostToDevice, stream));
    p.chunk_first = static_cast<const int64_t *>(a.workspace);
    p.seq_start = p.chunk_first + cu.size();
  }
  if (blocks == 0) return HL_STATUS_SUCCESS;
  const bool f32_state = a.h_dtype == HL_DTYPE_F32;
  if (a.dtype == HL_DTYPE_BF16)
    return f32_state ? launch<__nv_bfloat16, float>(p, blocks, smem, stream)
                     : launch<__nv_bfloat16, __nv_bfloat16>(p, blocks, smem, stream);
  return f32_state ? launch<__half, float>(p, blocks, smem, stream) : launch<__half, __half>(p, blocks, smem, stream);
}

}  // namespace hl::gdn
