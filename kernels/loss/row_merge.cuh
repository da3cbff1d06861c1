// The row kernel's cluster merge, each merge in a fixed order (the same bits on every run and every
// rank): a CTA's threads (block_merge), the cluster's CTAs through distributed shared memory
// (post_to_cluster: each CTA stores its record into every peer's mailbox, completing bytes on the
// peer's barrier, so a CTA waits for its peers' records alone, not at a cluster-wide barrier), and
// in the split's later steps the ranks' records in their blocks (gathered_*).
#pragma once

#include <cooperative_groups.h>
#include <cuda/ptx>

#include <climits>

#include "loss/row_stats.cuh"

namespace hl::loss::dev {

// Lane `src` of the warp's record (down-shuffle by off); the teacher fields only with distillation.
template <int DISTILL>
__device__ __forceinline__ RowStats<float> shfl_down_stats(const RowStats<float> &a, int off) {
  RowStats<float> r = a;
  const auto d = [&](float v) { return __shfl_down_sync(0xffffffffu, v, off); };
  r.m = d(a.m), r.s = d(a.s), r.b = d(a.b), r.sum = d(a.sum), r.zy = d(a.zy);
  r.amax = __shfl_down_sync(0xffffffffu, (long long)a.amax, off);
  if (DISTILL) {
    r.mt = d(a.mt), r.st = d(a.st), r.bt = d(a.bt), r.ct = d(a.ct);
    r.ss = d(a.ss), r.bs = d(a.bs), r.cs = d(a.cs);
  }
  return r;
}

// Lanes [0, n) of one warp hold records; lane 0 gets their merge, a fixed tree (deterministic).
template <int DISTILL>
__device__ __forceinline__ RowStats<float> warp_tree_merge(RowStats<float> st, int n, float inv_ts) {
  for (int off = 16; off > 0; off >>= 1) {
    if (off >= n) continue;  // uniform: every lane skips the same rounds
    const RowStats<float> o = shfl_down_stats<DISTILL>(st, off);
    if ((threadIdx.x % 32) + off < n) st = merge<DISTILL != kDistillNone>(st, o, inv_ts);
  }
  return st;
}

// The block's sum of every thread's DivSums (thread 0 gets it): a fixed shuffle tree in each warp,
// then the warps in order (deterministic). part: a row of shared memory per warp.
__device__ __forceinline__ DivSums<float> block_sum(DivSums<float> s, DivSums<float> (&part)[kThreads / 32]) {
  for (int off = 16; off > 0; off >>= 1) {
    s.loss += __shfl_xor_sync(0xffffffffu, s.loss, off);
    s.pa += __shfl_xor_sync(0xffffffffu, s.pa, off);
    s.p += __shfl_xor_sync(0xffffffffu, s.p, off);
    s.q += __shfl_xor_sync(0xffffffffu, s.q, off);
  }
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < kThreads / 32; ++w) s = add(s, part[w]);
  return s;
}

#if __CUDA_ARCH__ >= 900
// Thread 0 of a CTA: its W 16-byte words into slot `rank` of mailbox `box` in every CTA of the
// cluster (st.async), completing their bytes on each one's barrier `bar`.
template <int W, class M>
__device__ __forceinline__ void post_to_cluster(const M &mine, M *box, uint64_t *bar, int rank, int csize) {
  static_assert(sizeof(M) >= 16 * W, "the first W 16-byte words of a mailbox slot");
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const uint32_t(&w)[4 * W] = reinterpret_cast<const uint32_t(&)[4 * W]>(mine);
  for (int c = 0; c < csize; ++c) {
    uint32_t *dst = reinterpret_cast<uint32_t *>(cluster.map_shared_rank(&box[rank], c));
    uint64_t *b = cluster.map_shared_rank(bar, c);
#pragma unroll
    for (int k = 0; k < W; ++k)
      ::cuda::ptx::st_async(dst + 4 * k, {w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]}, b);
  }
}
#endif

// Per-warp records of the block-wide merge, two rows deep: a warp may start the next row's merge
// while warp 0 still reads this one's.
struct MergeScratch {
  RowStats<float> warp[2][kThreads / 32];
};

// Merges every thread's record into one (thread 0 holds it) with one barrier: in each warp the
// maxima first, then each lane moves its sums to them and plain sums follow; warp 0 then merges
// the warps' records as a tree.
template <int DISTILL>
__device__ __forceinline__ RowStats<float> block_merge(RowStats<float> st, MergeScratch &sh,
                                                       int parity, float inv_ts) {
  float M = st.m, Mt = st.mt;
  for (int off = 16; off > 0; off >>= 1) {
    M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    if (DISTILL) Mt = fmaxf(Mt, __shfl_xor_sync(0xffffffffu, Mt, off));
  }
  long long amax = st.m == M ? st.amax : LLONG_MAX;
  if (st.m < M) raise_max<DISTILL>(st, M, inv_ts);
  if (!DISTILL) st.b = st.s > 0.0f ? st.b - M * st.s : 0.0f;  // sum e z -> sum e (z - M)
  if (DISTILL && st.mt < Mt) raise_teacher_max(st, Mt);
  constexpr int F = DISTILL ? 10 : 4;  // zy (index 3) reduces by max, the rest by sum
  float f[10] = {st.s, st.b, st.sum, st.zy, st.st, st.bt, st.ct, st.ss, st.bs, st.cs};
  for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
    for (int i = 0; i < F; ++i) {
      const float o = __shfl_xor_sync(0xffffffffu, f[i], off);
      f[i] = i == 3 ? fmaxf(f[i], o) : f[i] + o;
    }
    const long long o = __shfl_xor_sync(0xffffffffu, amax, off);
    amax = o < amax ? o : amax;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    st.m = M, st.mt = Mt, st.amax = amax;
    st.s = f[0], st.b = f[1], st.sum = f[2], st.zy = f[3];
    if (DISTILL) st.st = f[4], st.bt = f[5], st.ct = f[6], st.ss = f[7], st.bs = f[8], st.cs = f[9];
    sh.warp[parity][warp] = st;
  }
  __syncthreads();
  if (warp == 0) {
    constexpr int W = kThreads / 32;
    st = lane < W ? sh.warp[parity][lane] : empty_stats<float>();
    st = warp_tree_merge<DISTILL>(st, W, inv_ts);
  }
  return st;
}

// Bytes of a row's record in a CUDA block: RowStats<float>, without the distillation fields when
// there is no distillation (the layout the header documents).
template <int DISTILL>
constexpr int kRecordBytes = DISTILL ? int(sizeof(RowStats<float>)) : int(offsetof(RowStats<float>, mt));
static_assert(offsetof(RowStats<float>, mt) == 32 && sizeof(RowStats<float>) == 64,
              "the record layout is documented in headloss.h");

// Row r's record in a block: its offset (a sparse teacher's has its k logits after RowStats).
template <int DISTILL>
__device__ __forceinline__ int64_t record_at(const Params &p, int64_t r) {
  return 64 + (p.row0 + r) * (DISTILL == kDistillSparse ? p.record_bytes : kRecordBytes<DISTILL>);
}

// Row r's records from every rank's block, merged by one warp (lane 0 gets the result): lane l
// takes ranks l, l + 32, ..., then a fixed tree; the same bits on every rank.
template <int DISTILL>
__device__ RowStats<float> gathered_stats(const Params &p, int64_t r) {
  constexpr int W = kRecordBytes<DISTILL> / 8;
  const int lane = threadIdx.x % 32;
  RowStats<float> all = empty_stats<float>();
  for (int c = lane; c < p.ranks; c += 32) {
    const uint2 *rec = reinterpret_cast<const uint2 *>(p.gathered + c * p.block_bytes + record_at<DISTILL>(p, r));
    RowStats<float> s = empty_stats<float>();
    uint2 *dst = reinterpret_cast<uint2 *>(&s);
#pragma unroll
    for (int k = 0; k < W; ++k) dst[k] = rec[k];
    all = c == lane ? s : merge<DISTILL != kDistillNone>(all, s, p.o.inv_ts);
  }
  return warp_tree_merge<DISTILL>(all, p.ranks < 32 ? p.ranks : 32, p.o.inv_ts);
}

// A sparse teacher's logit z_hat at id k of row r in a block's record (topk_absent: not this
// block's shard's).
__device__ __forceinline__ float *topk_logit(const char *block, const Params &p, int64_t r, int k) {
  return reinterpret_cast<float *>(const_cast<char *>(block) + record_at<kDistillSparse>(p, r) +
                                   sizeof(RowStats<float>)) + k;
}
// Its value merged over the ranks' blocks: the max, i.e. the owner's (exact, any order).
__device__ __forceinline__ float gathered_topk(const Params &p, int64_t r, int k) {
  float z = topk_absent<float>();
  for (int c = 0; c < p.ranks; ++c) z = fmaxf(z, *topk_logit(p.gathered + c * p.block_bytes, p, r, k));
  return z;
}

// Dense JSD's finish: its sums over the row, the ranks' middle sums added in their order in the
// buffer (the same bits on every rank).
__device__ __forceinline__ MidSums<float> gathered_middle(const Params &p, int64_t r) {
  MidSums<float> s{0.0f, 0.0f};
  for (int c = 0; c < p.ranks; ++c)
    s = add(s, reinterpret_cast<const MidSums<float> *>(p.gathered_middle + c * p.middle_block_bytes + 64)[p.row0 + r]);
  return s;
}

}  // namespace hl::loss::dev
