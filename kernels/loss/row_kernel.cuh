// The loss plan's row kernel. A cluster of CTAs owns one row at a time (a persistent grid loops
// over rows); each CTA owns one slice of the row's vocabulary.
//   pass 1: read the slice once (16-byte loads), keep it in shared memory, and fold it into
//           per-thread online softmax statistics (RowStats); merge threads, then the cluster's
//           CTAs through distributed shared memory, in a fixed order (deterministic);
//   finish: row_math.h's finish_row turns the merged record into losses, metrics, coefficients;
//   pass 2: the gradient of the slice from shared memory, fp32, one rounding at the store.
// Terms that are off cost nothing: the gradient, the soft-cap and distillation are template
// arguments; the other terms only change per-row coefficients.
// BULK (sm_90, 16-byte aligned rows; no sparse teacher; a dense teacher only in the whole-row
// step, its slice beside the student's): the slice is not loaded through registers but copied
// into shared memory by bulk copies, so the whole slice is in flight at once (1.23x faster at
// 8192 x 128256 than kBatch register loads; dense JSD 1.4x; see bench/notes/loss.md). The slice streams in
// chunks, each with a `full` barrier (landed) and an `empty` one (the row's last pass has read
// it): the next row's chunk is requested as soon as it is free, so its load overlaps this row's
// gradient pass, and pass 1 starts on the first chunk that lands.
// Dense JSD adds a middle pass (the sums of JSD's log m over the slice, exchanged in the cluster)
// between the statistics and finish; a sparse teacher's k logits are gathered at the row's start
// (before any CTA writes the row's gradient: in place, that is over the logits) and its k ids'
// elements rewritten, whole, after pass 2.
// The tensor-parallel split runs the same kernel in two phases: kStats stops after pass 1 and
// writes the row's record into this rank's block; kFinish skips pass 1, merges the ranks' records
// of the row instead, and runs finish and pass 2 (re-reading the logits). A sparse teacher's
// records carry its ids' logits (the owner's), so kFinish gathers them from there. Dense JSD has a
// third phase between them, kMiddle: the merge, then its middle pass into this rank's middle
// block; kFinish adds the ranks' middle sums instead of that pass.
#pragma once

#include <cooperative_groups.h>
#include <cuda/ptx>

#include <climits>
#include <type_traits>

#include "common/bulk_copy.cuh"
#include "common/dtype.cuh"
#include "common/fast_math.cuh"
#include "common/grid_dependency.cuh"
#include "loss/params.cuh"
#include "loss/sums.cuh"

namespace hl::loss::dev {

// Distillation modes that read dense teacher logits (a sparse teacher's k logits are gathered).
template <int DISTILL>
constexpr bool kDenseTeacher = DISTILL == kDistillFwd || DISTILL == kDistillRev || DISTILL == kDistillJsd;

using hl::dev::Pack;
using hl::dev::to_float;
using hl::dev::from_float;

using hl::dev::ex2;
__device__ __forceinline__ float fast_exp(float x) { return ex2(x * kLog2e); }
// The column loops' exponential and log for row_math.h (its LibMath is libm's): one MUFU
// instruction each (lg2.approx: ~2^-22 absolute error).
struct FastMath {
  __device__ __forceinline__ float exp(float x) const { return fast_exp(x); }
  __device__ __forceinline__ float log(float x) const {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y * 0.6931471805599453f;
  }
};

// z_hat from a raw logit; with a cap, t = tanh(scale z / cap) is kept for the chain factor.
template <bool CAP>
__device__ __forceinline__ float zhat(float x, const Options &o, float &t) {
  if (!CAP) return x * o.scale;
  const float y = x * o.scale / o.cap;
  t = 1.0f - __fdividef(2.0f, __expf(2.0f * y) + 1.0f);
  return o.cap * t;
}

// Moves a thread's student sums to a larger max mn (rare: only when a new max appears).
// Without distillation a thread keeps b as sum e z (one FMA a column), made relative to m only
// when the block merges (block_merge); with it, as sum e (z - m) like the other sums.
template <int DISTILL>
__device__ __forceinline__ void raise_max(RowStats<float> &st, float mn, float inv_ts) {
  const float f = rescale(st.m, mn), d = shift(st.m, mn);
  st.b = DISTILL ? moved(f, st.b, st.s, d) : st.b * f;
  st.s *= f;
  if (DISTILL) {
    const float fs = rescale(st.m, mn, inv_ts);
    st.bs = moved(fs, st.bs, st.ss, d);
    st.ss *= fs;
    st.cs *= fs;
    st.ct += st.st * d;
  }
  st.m = mn;
}

__device__ __forceinline__ void raise_teacher_max(RowStats<float> &st, float mn) {
  const float f = rescale(st.mt, mn), d = shift(st.mt, mn);
  st.bt = moved(f, st.bt, st.st, d);
  st.st *= f;
  st.ct *= f;
  st.cs += st.ss * d;
  st.mt = mn;
}

// The first column of a pack holding its largest value.
template <int N>
__device__ __forceinline__ int find_argmax(const float (&z)[N]) {
  float zr = z[0];
#pragma unroll
  for (int k = 1; k < N; ++k) zr = fmaxf(zr, z[k]);
  int first = N - 1;
#pragma unroll
  for (int k = N - 1; k >= 0; --k) first = z[k] == zr ? k : first;
  return first;
}

// Folds n consecutive columns starting at j0 into a thread's statistics. z is z_hat, or without
// distillation the raw logit with z_hat = zs z: then m stays in z_hat units, b and sum in raw
// ones (the caller scales them), and zs rides in the exponent's constant (no multiply a column).
// SUMZ: sum z is kept (label smoothing needs it; an add a column otherwise saved).
// lazy_pack (no distillation): a new maximum only records this pack's index `pack` there, and
// the caller finds its column later (find_argmax), with a cheaper rescale: a warp takes this
// branch whenever any lane meets a new maximum, which is most packs of a row's first pass.
template <int DISTILL, bool SUMZ, int N>
__device__ __forceinline__ void accumulate(RowStats<float> &st, const float (&z)[N],
                                           const float (&v)[N], int64_t j0, float inv_ts,
                                           float zs = 1.0f, int *lazy_pack = nullptr, int pack = 0) {
  float zr = z[0];
#pragma unroll
  for (int k = 1; k < N; ++k) zr = fmaxf(zr, z[k]);
  const float zm = zr * zs;
  if (!DISTILL && lazy_pack && zm > st.m) {
    const float f = ex2((st.m - zm) * kLog2e);  // 0 from an empty record (m = -inf)
    st.s *= f, st.b *= f, st.m = zm;
    *lazy_pack = pack;
  } else if (zm > st.m) {  // columns only grow, so the first k reaching the new max is the argmax
    raise_max<DISTILL>(st, zm, inv_ts);
    st.amax = j0 + find_argmax(z);
  }
  if (kDenseTeacher<DISTILL>) {
    float vm = v[0];
#pragma unroll
    for (int k = 1; k < N; ++k) vm = fmaxf(vm, v[k]);
    if (vm > st.mt) raise_teacher_max(st, vm);
  }
  const float ml = st.m * kLog2e, s2 = zs * kLog2e;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float d = z[k] - st.m, e = ex2(fmaf(z[k], s2, -ml));
    st.s += e;
    st.b = fmaf(e, DISTILL ? d : z[k], st.b);
    if (SUMZ) st.sum += z[k];
    if (DISTILL) {
      const float es = fast_exp(d * inv_ts);
      st.ss += es;
      st.bs = fmaf(es, d, st.bs);
      if (kDenseTeacher<DISTILL>) {
        const float dt = v[k] - st.mt, et = fast_exp(dt);
        st.st += et;
        st.bt = fmaf(et, dt, st.bt);
        st.ct = fmaf(et, d, st.ct);
        st.cs = fmaf(es, dt, st.cs);
      }
    }
  }
}

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

// VEC columns of a row as one 16-byte pack when aligned, else element by element.
template <class T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_cols(const T *p, bool aligned) {
  if (aligned) return hl::dev::load_pack<T, VEC>(p);
  Pack<T, VEC> r;
#pragma unroll
  for (int k = 0; k < VEC; ++k) r.v[k] = p[k];
  return r;
}

// FAST: aligned, no accumulation (a compile-time case: no branches in the column loop).
template <class G, int VEC, bool FAST>
__device__ __forceinline__ void store_grad(G *p, const float (&g)[VEC], bool aligned, bool acc) {
  constexpr int W = 16 / sizeof(G);  // elements per 16-byte store
  if (FAST) aligned = true, acc = false;
#pragma unroll
  for (int h = 0; h < VEC; h += W) {
    Pack<G, W> out;
    float f[W];
    if (acc) out = load_cols<G, W>(p + h, aligned);
#pragma unroll
    for (int k = 0; k < W; ++k) f[k] = acc ? to_float(out.v[k]) + g[h + k] : g[h + k];
    hl::dev::from_floats<G, W>(f, out.v);
    if (aligned) hl::dev::store_pack<G, W>(p + h, out);
    else
#pragma unroll
      for (int k = 0; k < W; ++k) p[h + k] = out.v[k];
  }
}

// How pass 2 forms a gradient element of a row (before the soft-cap's chain factor and the
// label's term), picked per row so that each column loop is branch-free:
//   kGeneric  p (cp + cpz z) + cc, distillation terms: grad_elem
//   kSigned   sign(cp) 2^(z s2 - c2) + cc with log2 |cp| folded into c2 (no entropy loss, cap
//             or distillation): an FMA a column fewer
//   kPure     2^(z s2 - c2) where also cp >= 0 and cc == 0 (CE, z-loss, GRPO without smoothing):
//             nothing after the exponential
enum GradForm : int { kGeneric, kSigned, kPure };
template <int F> using Form = std::integral_constant<int, F>;

// A row's constants of pass 2, in base 2: z_hat log2 e = z s2; lse log2 e; c2 (GradForm); sign(cp).
struct GradConsts {
  float s2, lse2, c2, sg;
};

// The gradient of the first n columns of a pack (z, the cap's tanh t, teacher v) in form F.
template <int F, int DISTILL, bool CAP, int VEC>
__device__ __forceinline__ void grad_pack(const RowResult<float> &rr, const Options &o,
                                          const GradConsts &c, const float (&z)[VEC],
                                          const float (&t)[VEC], const float (&v)[VEC], int n,
                                          float (&g)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    if (k >= n) break;
    if (F == kGeneric) {
      const float pk = ex2(fmaf(z[k], c.s2, -c.lse2));
      const float gk = grad_elem<DISTILL>(rr, o, z[k], v[k], pk, FastMath{});
      g[k] = CAP ? gk * fmaf(-t[k], t[k], 1.0f) : gk;
    } else {
      const float e = ex2(fmaf(z[k], c.s2, -c.c2));
      g[k] = F == kPure ? e : fmaf(e, c.sg, rr.cc);
    }
  }
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

// Block 0 writes this rank's block header at its first row (again for each chunk of rows of the
// fused linear form: the same bytes).
__device__ __forceinline__ void write_header(const Params &p, int64_t r) {
  if (blockIdx.x == 0 && r == 0)
    for (int k = 0; k < 8; ++k) reinterpret_cast<int64_t *>(p.block)[k] = p.header[k];
}

// Row r's record into this rank's block, and the header.
template <int DISTILL>
__device__ void write_record(const Params &p, int64_t r, RowStats<float> st) {
  constexpr int W = kRecordBytes<DISTILL> / 8;
  if (st.amax != INT64_MAX) st.amax += p.col0;  // a global column
  uint2 *rec = reinterpret_cast<uint2 *>(p.block + record_at<DISTILL>(p, r));
  const uint2 *src = reinterpret_cast<const uint2 *>(&st);
#pragma unroll
  for (int k = 0; k < W; ++k) rec[k] = src[k];
  write_header(p, r);
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

// Dense JSD's middle step: row r's sums over this shard into the middle block; and the finish's
// sums over the row, the ranks' added in their order in the buffer (the same bits on every rank).
__device__ __forceinline__ void write_middle(const Params &p, int64_t r, MidSums<float> s) {
  reinterpret_cast<MidSums<float> *>(p.block + 64)[p.row0 + r] = s;
  write_header(p, r);
}
__device__ __forceinline__ MidSums<float> gathered_middle(const Params &p, int64_t r) {
  MidSums<float> s{0.0f, 0.0f};
  for (int c = 0; c < p.ranks; ++c)
    s = add(s, reinterpret_cast<const MidSums<float> *>(p.gathered_middle + c * p.middle_block_bytes + 64)[p.row0 + r]);
  return s;
}

template <class T, bool GRAD, bool CAP, int DISTILL, int PHASE, bool BULK>
__global__ void __launch_bounds__(kThreads, DISTILL ? 2 : kMinBlocks) row_kernel(const Params p) {
  static_assert((PHASE != kStats && PHASE != kMiddle) || !GRAD, "the statistics and middle steps write no gradient");
  static_assert(!BULK || DISTILL == kDistillNone || (kDenseTeacher<DISTILL> && PHASE == kWhole),
                "bulk: the logits, and a dense teacher's beside them in the whole-row step");
  constexpr bool JSD = DISTILL == kDistillJsd, SPARSE = DISTILL == kDistillSparse;
  static_assert(PHASE != kMiddle || JSD, "the middle step is dense JSD's");
  // The bulk kernels are launched where code_arch() >= 90 alone: empty in an sm_80 pass.
  if constexpr (BULK && !hl::dev::kClusterCode) return;
  // kFinish and kMiddle read the ranks' merged records instead of pass 1.
  constexpr bool MERGED = PHASE == kFinish || PHASE == kMiddle;
  constexpr int VEC = 16 / sizeof(T);
  // Without a soft-cap or distillation the passes read raw logits and fold the logit scale into
  // the exponent's constant and the row's coefficients (one multiply a column fewer a pass).
  constexpr bool RAW = !CAP && DISTILL == kDistillNone;
  using V = Pack<T, VEC>;
  extern __shared__ uint4 smem_raw[];
  V *slice_smem = reinterpret_cast<V *>(smem_raw);
  V *teacher_smem = slice_smem + p.slice / VEC;  // BULK with a dense teacher: its slice after ours
#if __CUDA_ARCH__ >= 900
  // The cluster's records of a row by rank, two rows deep: each CTA stores its record into every
  // peer's mailbox (st.async), completing bytes on the peer's mail_full barrier, so a CTA waits
  // for its peers' records alone, not at a cluster-wide barrier.
  __shared__ alignas(16) RowStats<float> mail[2][kMaxCluster];
  __shared__ uint64_t mail_full[2];
  // kWhole: the row after the current one, from rank 0 to every rank (two rows deep, like mail).
  __shared__ alignas(16) long long next_mail[2][2];
  __shared__ uint64_t next_full[2];
#endif
  __shared__ MergeScratch scratch;
  __shared__ RowResult<float> row;
  // JSD and a sparse teacher: the row's lse_s and lse_t, the warps' sums; JSD: the cluster's sums
  // by rank, two rows deep like mail; a sparse teacher: entry tid's logit z_hat, log-prob, column
  // in this slice (kElsewhere, kPadding) and old gradient (accumulating), each its thread's own.
  // (4 KB: the kernel's static shared memory, 7.4 KB on sm_90a, stays under launch.cu's
  // kStaticSmemSlack.)
  constexpr int kElsewhere = -1, kPadding = -2, KT = SPARSE ? kMaxTopk : 1;
  __shared__ float lse_sh[2];
  __shared__ DivSums<float> dsum_part[kThreads / 32];
  __shared__ float tk_z[KT], tk_lq[KT], tk_old[KT];
  __shared__ int tk_col[KT];
#if __CUDA_ARCH__ >= 900
  __shared__ alignas(16) DivSums<float> jmail[2][JSD ? kMaxCluster : 1];
  __shared__ uint64_t jmail_full[2];
#endif
  // The row after the current one: for every thread (next_sh), for thread 0 from the row's start
  // (nxt), the one after that (after). In shared memory: registers held across the column loops
  // would spill there.
  __shared__ long long next_sh, nxt, after;
  __shared__ uint64_t full[kMaxChunks], empty[kMaxChunks];  // BULK: see the top of this file
#if __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank()), csize = int(cluster.num_blocks());
#else
  const int rank = 0, csize = 1;
#endif
  const Options &o = p.o;
  const int tid = threadIdx.x;
  const float zs = RAW ? o.scale : 1.0f;  // z_hat = zs * zval(x)
  const auto zval = [&](float x, float &t) { return RAW ? x : zhat<CAP>(x, o, t); };
  // A pack's columns as z values (see zval).
  const auto unpack = [&](const Pack<T, VEC> &raw, float (&zz)[VEC], float (&tt)[VEC]) {
    hl::dev::to_floats(raw, zz);
    if (!RAW)
#pragma unroll
      for (int k = 0; k < VEC; ++k) zz[k] = zhat<CAP>(zz[k], o, tt[k]);
  };
  const auto unpack_teacher = [&](const Pack<T, VEC> &raw, float (&vv)[VEC]) {  // v = teacher / tau_t
    hl::dev::to_floats(raw, vv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) vv[k] *= o.inv_tt;
  };
  const int64_t lo = min(p.vocab, rank * p.slice), hi = min(p.vocab, lo + p.slice);
  const int64_t nvec = (hi - lo) / VEC, tail_lo = lo + nvec * VEC;
  const int64_t first = blockIdx.x / csize, step = gridDim.x / csize;
  const auto slice_of = [&](int64_t row) { return static_cast<const T *>(p.logits) + row * p.logits_stride + lo; };
  // Chunks of the slice: kChunkPacks packs each with BULK, else one chunk of all of it.
  const int64_t chunk = BULK ? kChunkPacks : (nvec > 0 ? nvec : 1);
  const int nchunks = int((nvec + chunk - 1) / chunk);
  // Pack indices in a slice: 32-bit with BULK (at most kMaxChunks chunks), cheaper loop control.
  using Idx = std::conditional_t<BULK, int, int64_t>;
  const auto teacher_of = [&](int64_t row) { return static_cast<const T *>(p.teacher) + row * p.teacher_stride + lo; };
  const auto request = [&](int64_t row, int c) {  // BULK, one thread: chunk c of a row's slice
    const int64_t i0 = c * chunk, n = min(chunk, nvec - i0);
    const uint32_t bytes = uint32_t(n * 16);
    hl::dev::mbar_expect_tx(&full[c], kDenseTeacher<DISTILL> ? 2 * bytes : bytes);
    hl::dev::bulk_copy(slice_smem + i0, slice_of(row) + i0 * VEC, bytes, &full[c]);
    if (kDenseTeacher<DISTILL>) hl::dev::bulk_copy(teacher_smem + i0, teacher_of(row) + i0 * VEC, bytes, &full[c]);
  };
#if __CUDA_ARCH__ >= 900
  if (csize > 1) {
    if (tid == 0) {
      hl::dev::mbar_init(&mail_full[0], 1);
      hl::dev::mbar_init(&mail_full[1], 1);
      hl::dev::mbar_init(&next_full[0], 1);
      hl::dev::mbar_init(&next_full[1], 1);
      if (JSD) hl::dev::mbar_init(&jmail_full[0], 1), hl::dev::mbar_init(&jmail_full[1], 1);
    }
    cluster.sync();  // every peer's barriers are initialised before the first record arrives
  }
#endif
  if (BULK) {
    if (tid == 0) {
      for (int c = 0; c < nchunks; ++c) {
        hl::dev::mbar_init(&full[c], 1);
        hl::dev::mbar_init(&empty[c], kThreads);
      }
      if (first < p.rows)
        for (int c = 0; c < nchunks; ++c) request(first, c);
    }
    __syncthreads();
  }
  // Rows: a cluster takes its first two in grid order, then the next free one from a counter, so
  // that clusters on SMs that get less memory bandwidth take fewer rows and all finish within
  // about a row of each other (with rows in grid order the first cluster finished at 2/3 of the
  // kernel's time; bench/notes/loss.md "Loss v7"). Thread 0 knows the row after the current one (nxt)
  // from the row's start, for its bulk requests; the one after that (after) is taken at the
  // row's finish, and its round trip hides behind pass 2. kWhole: rank 0 takes rows and hands
  // them to its peers (next_mail); kFinish: the CTAs of a cluster do not talk, each takes rows
  // from its rank's counter; kStats: rows in grid order (no prep kernel zeroes a counter).
  constexpr bool DYN = PHASE != kStats;
  const bool hand_rows = DYN && PHASE == kWhole && csize > 1;
  const bool takes_rows = DYN && (!hand_rows || rank == 0);
  unsigned *const next_counter = p.counters + (PHASE == kWhole ? 0 : rank);
  if (tid == 0) nxt = first + step;
  unsigned taken = 0;  // thread 0: the counter's answer, from a row's finish to its barrier
  int parity = 0;
  for (int64_t r = first, it = 0; r < p.rows; parity ^= 1, ++it) {
    const T *x = slice_of(r);
    const uint32_t phase = uint32_t(it) & 1;
    if (tid == 0) {
      if (!DYN) nxt = r + step;
      else if (it > 0 && takes_rows) nxt = after;
#if __CUDA_ARCH__ >= 900
      if (hand_rows) {
        if (rank == 0)
          for (int c = 0; c < csize; ++c)
            ::cuda::ptx::st_async(reinterpret_cast<uint32_t *>(cluster.map_shared_rank(&next_mail[parity][0], c)),
                                  {uint32_t(nxt), uint32_t(uint64_t(nxt) >> 32), 0u, 0u},
                                  cluster.map_shared_rank(&next_full[parity], c));
        hl::dev::mbar_expect_tx(&next_full[parity], 16);
        hl::dev::mbar_wait(&next_full[parity], uint32_t(it >> 1) & 1);
        nxt = next_mail[parity][0];
      }
#endif
    }
    // The row's last pass over chunk c is done: every thread arrives, and thread 0 requests the
    // next row's chunk c into it once all have. Each thread's own arrival, not a warp's after
    // __syncwarp: 2% faster without a gradient (no warp waits for its slowest lane), and what
    // racecheck can follow (with lane 0 arriving for its warp it reported every pass-1 read).
    const auto release = [&](int c) {
      if (!BULK) return;
      hl::dev::mbar_arrive(&empty[c]);
      if (tid == 0) {  // nxt read by thread 0 alone (volatile: not hoisted out of the branch)
        const int64_t n = *static_cast<volatile long long *>(&nxt);
        if (n < p.rows) {
          hl::dev::mbar_wait(&empty[c], phase);
          request(n, c);
        }
      }
    };
    const T *u = kDenseTeacher<DISTILL> ? teacher_of(r) : nullptr;
    const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                         (!kDenseTeacher<DISTILL> || reinterpret_cast<uintptr_t>(u) % 16 == 0);
    // The student's pack i after pass 1: from shared memory where kept.
    const auto student = [&](Idx i) { return BULK || p.keep_row ? slice_smem[i] : load_cols<T, VEC>(x + i * VEC, aligned); };
    // body(i, student pack, teacher pack) for this thread's packs i of [i0, end) after pass 1.
    // A dense teacher's packs are loaded kBatch ahead of their use, as in pass 1 (one load in
    // flight a thread is latency-bound); so are the student's in the steps after the exchange,
    // which keep no row (kFinish, kMiddle). kWhole's come from shared memory at their use: held
    // in registers too they spilled.
    const auto for_packs = [&](Idx i0, Idx end, auto body) {
      if constexpr (!kDenseTeacher<DISTILL>) {
        for (Idx i = i0 + tid; i < end; i += kThreads) body(i, student(i), V{});
      } else if constexpr (BULK) {
        for (Idx i = i0 + tid; i < end; i += kThreads) body(i, slice_smem[i], teacher_smem[i]);
      } else {
        constexpr bool AHEAD = PHASE != kWhole;
        for (Idx ib = i0 + tid; ib < end; ib += kBatch * kThreads) {
          [[maybe_unused]] V xr[kBatch];  // AHEAD's
          V tr[kBatch];
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            const Idx i = ib + b * kThreads;
            if (i >= end) break;
            if constexpr (AHEAD) xr[b] = load_cols<T, VEC>(x + i * VEC, aligned);
            tr[b] = load_cols<T, VEC>(u + i * VEC, aligned);
          }
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            const Idx i = ib + b * kThreads;
            if (i >= end) break;
            if constexpr (AHEAD) body(i, xr[b], tr[b]);
            else body(i, student(i), tr[b]);
          }
        }
      }
    };
    const RowInputs<float> in = read_inputs<float>(p.src, r);
    const int64_t label = in.label - p.col0;  // in this shard's columns
    float t[VEC], z[VEC], v[VEC] = {};
    if (SPARSE && tid < o.topk) {  // entry tid of the row's sparse teacher (an id out of range: padding)
      const int64_t at = r * p.topk_ids_stride + tid;
      const int64_t id = p.topk_ids64 ? static_cast<const int64_t *>(p.topk_ids)[at]
                                      : int64_t(static_cast<const int32_t *>(p.topk_ids)[at]);
      const int64_t j = id - p.col0;  // in this shard's columns
      const bool ok = id >= 0 && id < o.vocab, mine = ok && j >= 0 && j < p.vocab;
      float tt;
      tk_z[tid] = PHASE == kFinish ? gathered_topk(p, r, tid)
                  : mine ? zhat<CAP>(to_float(x[j - lo]), o, tt) : topk_absent<float>();
      tk_lq[tid] = ok ? p.topk_lp[r * p.topk_lp_stride + tid] : 0.0f;
      tk_col[tid] = !ok ? kPadding : mine && j >= lo && j < hi ? int(j - lo) : kElsewhere;
    }
    RowStats<float> all;  // the row's merged record (thread 0)
    if (!MERGED) {
    // The label's logit, read by one thread before any gradient of this row is written.
    const bool owns_label = tid == 0 && label >= lo && label < hi;
    const T label_raw = owns_label ? x[label - lo] : T(0.0f);
    const auto pass1 = [&](auto sumz) {
      RowStats<float> st = empty_stats<float>();
      if (BULK) {
        // The pack where this thread's maximum first appeared (-1: none pending); its column is
        // found while the pack is still in shared memory.
        int apack = -1;
        const auto resolve_argmax = [&] {
          if (apack < 0) return;
          unpack(slice_smem[apack], z, t);
          st.amax = lo + int64_t(apack) * VEC + find_argmax(z);
          apack = -1;
        };
        for (int c = 0; c < nchunks; ++c) {
          hl::dev::mbar_wait(&full[c], phase);
          const Idx end = Idx(min(nvec, (c + 1) * chunk));
#pragma unroll 4
          for (Idx i = Idx(c * chunk) + tid; i < end; i += kThreads) {
            unpack(slice_smem[i], z, t);
            if (kDenseTeacher<DISTILL>) unpack_teacher(teacher_smem[i], v);
            accumulate<DISTILL, decltype(sumz)::value>(st, z, v, lo + i * VEC, o.inv_ts, zs, &apack, int(i));
          }
          if (!GRAD && !JSD) {  // the chunk is refilled once released: its argmax column first
            resolve_argmax();
            release(c);
          }
        }
        resolve_argmax();
      } else
      // kBatch loads in flight per thread before any is used: enough bytes in flight for HBM.
      // Thread tid owns vectors tid + k * kThreads in both passes, so the kept slice needs no sync.
      for (int64_t i0 = tid; i0 < nvec; i0 += kBatch * kThreads) {
        V raw[kBatch], traw[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t i = i0 + b * kThreads;
          if (i >= nvec) break;
          raw[b] = load_cols<T, VEC>(x + i * VEC, aligned);
          if (kDenseTeacher<DISTILL>) traw[b] = load_cols<T, VEC>(u + i * VEC, aligned);
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t i = i0 + b * kThreads;
          if (i >= nvec) break;
          if (p.keep_row) slice_smem[i] = raw[b];
          unpack(raw[b], z, t);
          if (kDenseTeacher<DISTILL>) unpack_teacher(traw[b], v);
          accumulate<DISTILL, decltype(sumz)::value>(st, z, v, lo + i * VEC, o.inv_ts, zs);
        }
      }
      if (tid == 0)  // the last slice's columns past the last full vector
        for (int64_t j = tail_lo; j < hi; ++j) {
          float z1[1], v1[1] = {0.0f}, t1;
          z1[0] = zval(to_float(x[j - lo]), t1);
          if (kDenseTeacher<DISTILL>) v1[0] = to_float(u[j - lo]) * o.inv_tt;
          accumulate<DISTILL, decltype(sumz)::value>(st, z1, v1, j, o.inv_ts, zs);
        }
      return st;
    };
    RowStats<float> st = o.smoothing != 0.0f ? pass1(std::true_type{}) : pass1(std::false_type{});
    if (owns_label) {
      float tl;
      st.zy = zhat<CAP>(to_float(label_raw), o, tl);
    }
    if (RAW) st.b *= zs, st.sum *= zs;  // to z_hat units
    st = block_merge<DISTILL>(st, scratch, parity, o.inv_ts);
    all = st;  // thread 0's is the CTA's record
#if __CUDA_ARCH__ >= 900
    if (csize > 1) {
      if (tid == 0) {
        hl::dev::mbar_expect_tx(&mail_full[parity], uint32_t(csize * kRecordBytes<DISTILL>));
        post_to_cluster<kRecordBytes<DISTILL> / 16>(st, &mail[parity][0], &mail_full[parity], rank, csize);
      }
      // Warp 0 merges the cluster's records as a tree: every CTA the same records in the same
      // order (deterministic).
      if (tid < 32) {
        hl::dev::mbar_wait(&mail_full[parity], uint32_t(it >> 1) & 1);
        all = tid < csize ? mail[parity][tid] : empty_stats<float>();
        all = warp_tree_merge<DISTILL>(all, csize, o.inv_ts);
      }
    }
#endif
    } else {
      __syncthreads();  // every thread has read the previous row's `row`
      if (tid < 32) all = gathered_stats<DISTILL>(p, r);
    }
    // Dense JSD and a sparse teacher: sums over the slice (JSD's middle pass) or the k ids, taken
    // once the row's lse is known; thread 0 gets the row's DistillRow (kMiddle: writes JSD's sums).
    DistillRow<float> dx{};
    if (JSD && PHASE == kFinish) {
      if (tid == 0) dx = dense_row(gathered_middle(p, r));
    } else if ((JSD || SPARSE) && PHASE != kStats) {
      if (tid == 0) lse_sh[0] = student_lse(all, o), lse_sh[1] = JSD ? teacher_lse(all) : 0.0f;
      __syncthreads();
      const float lse_s = lse_sh[0], lse_t = lse_sh[1], its = o.inv_ts, b = o.jsd_beta;
      DivSums<float> part{0.0f, 0.0f, 0.0f, 0.0f};
      const auto add_cols = [&](const float (&zz)[VEC], const float (&vv)[VEC], int n) {
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          if (k < n) part = add(part, div_elem(kDistillJsd, b, zz[k] * its - lse_s, vv[k] - lse_t, FastMath{}));
      };
      if (SPARSE && tid < o.topk && tk_col[tid] != kPadding)
        part = div_elem(o.divergence, b, tk_z[tid] * its - lse_s, tk_lq[tid]);
      if (JSD) {  // the slice from shared memory (kept) or again from global memory; the teacher again
        for_packs(Idx(0), Idx(nvec), [&](Idx, const V &xr, const V &tr) {
          unpack(xr, z, t);
          unpack_teacher(tr, v);
          add_cols(z, v, VEC);
        });
        if (!GRAD)  // BULK: the middle pass was the row's last over its chunks
          for (int c = 0; c < nchunks; ++c) release(c);
        if (tid == 0)
          for (int64_t j = tail_lo; j < hi; ++j) {
            float z1[VEC] = {}, v1[VEC] = {}, t1;
            z1[0] = zval(to_float(x[j - lo]), t1);
            v1[0] = to_float(u[j - lo]) * o.inv_tt;
            add_cols(z1, v1, 1);
          }
      }
      part = block_sum(part, dsum_part);
#if __CUDA_ARCH__ >= 900
      if (JSD && csize > 1 && tid == 0) {  // the cluster's sums, added in rank order by every CTA
        hl::dev::mbar_expect_tx(&jmail_full[parity], uint32_t(csize * sizeof part));
        post_to_cluster<1>(part, &jmail[parity][0], &jmail_full[parity], rank, csize);
        hl::dev::mbar_wait(&jmail_full[parity], uint32_t(it >> 1) & 1);
        part = jmail[parity][0];
        for (int c = 1; c < csize; ++c) part = add(part, jmail[parity][c]);
      }
#endif
      const MidSums<float> mid{part.loss, part.pa};
      if (tid == 0 && PHASE == kMiddle) write_middle(p, r, mid);
      if (tid == 0) dx = JSD ? dense_row(mid) : sparse_row(o, part);
    }
    // kStats: a sparse teacher's logits at its ids in this shard after the record.
    if (SPARSE && PHASE == kStats && rank == 0 && tid < o.topk) *topk_logit(p.block, p, r, tid) = tk_z[tid];
    if (tid == 0) {
      if (PHASE == kStats) {
        if (rank == 0) write_record<DISTILL>(p, r, all);
      } else {
      hl::dev::wait_for_previous_grid();  // the prep kernel's kd and counters (launch_rows: early)
      if (PHASE != kMiddle) row = finish_row(all, in, o, p.prep->kd, JSD || SPARSE ? &dx : nullptr);
      next_sh = nxt;
      if (takes_rows) taken = atomicAdd(next_counter, 1u);  // stored after the barrier: no wait here
      }
    }
    // A sparse teacher's ids in this slice, accumulating: their old gradient, before pass 2 writes.
    if (SPARSE && GRAD && p.accumulate && tid < o.topk && tk_col[tid] >= 0) {
      const int64_t at = r * p.grad_stride + lo + tk_col[tid];
      tk_old[tid] = p.grad_f32 ? static_cast<const float *>(p.grad)[at] : to_float(static_cast<const T *>(p.grad)[at]);
    }
    if (PHASE != kStats) __syncthreads();
    // The row's outputs, after the barrier: stores before it would hold every warp back.
    if (tid == 0 && takes_rows) after = 2 * step + taken;
    if ((PHASE == kWhole || PHASE == kFinish) && tid == 0 && rank == 0) {
      if (p.records) store_floats<kRecFields>(p.records + r * kRecStride, row.rec);
      if (p.tok_loss) p.tok_loss[r] = row.token_loss;
      if (p.tok_logp) p.tok_logp[r] = row.logp;
      if (p.tok_entropy) p.tok_entropy[r] = row.entropy;
      if (p.tok_lse) p.tok_lse[r] = row.lse;
      if (p.tok_argmax) p.tok_argmax[r] = row.argmax;
    }
    if (GRAD) {
      RowResult<float> rr = row;  // coefficients in registers for the loop
      if (RAW) rr.cpz *= zs;      // on the raw logit
      const float lse2 = rr.lse * kLog2e, s2 = zs * kLog2e;
      // The row's form of a gradient element (GradForm); with kSigned and kPure, |cp| rides in
      // the exponent's constant c2 (log2 of 0 is -inf: e = 0).
      const bool lean = RAW && rr.cpz == 0.0f;
      const float c2 = lean ? lse2 - log2f(fabsf(rr.cp)) : lse2;
      const float sg = rr.cp > 0.0f ? 1.0f : rr.cp < 0.0f ? -1.0f : 0.0f;
      const int form = !lean ? kGeneric : sg >= 0.0f && rr.cc == 0.0f ? kPure : kSigned;
      const GradConsts gc{s2, lse2, c2, sg};
      // The label's term, at column col of a pack.
      const auto add_label = [&](float (&g)[VEC], const float (&tt)[VEC], int col) {
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          if (k == col) g[k] += CAP ? rr.cy * fmaf(-tt[k], tt[k], 1.0f) : rr.cy;
      };
      // The pack holding the label (-1: none in this slice's packs) and its column there.
      const int64_t lrel = label - lo;
      const Idx lpack = lrel >= 0 && lrel < nvec * VEC ? Idx(lrel / VEC) : Idx(-1);
      const int lk = int(lrel % VEC);
      const auto write = [&](auto *gp) {
        using G = typename std::remove_pointer<decltype(gp)>::type;
        G *grow = gp + r * p.grad_stride + lo;
        const bool galigned = aligned && reinterpret_cast<uintptr_t>(grow) % 16 == 0;
        // fast: aligned stores that do not accumulate; form_c: the row's GradForm.
        const auto columns = [&](auto fast, auto form_c) {
          for (int c = 0; c < nchunks; ++c) {
            if (BULK && PHASE == kFinish) hl::dev::mbar_wait(&full[c], phase);
            const Idx end = Idx(min(nvec, (c + 1) * chunk));
            for_packs(Idx(c * chunk), end, [&](Idx i, const V &raw, const V &traw) {
              unpack(raw, z, t);
              if (kDenseTeacher<DISTILL>) unpack_teacher(traw, v);
              float g[VEC];
              grad_pack<decltype(form_c)::value, DISTILL, CAP>(rr, o, gc, z, t, v, VEC, g);
              if (i == lpack) add_label(g, t, lk);
              store_grad<G, VEC, decltype(fast)::value>(grow + i * VEC, g, galigned, p.accumulate);
            });
            release(c);
          }
        };
        // (without RAW, form is kGeneric: the other two instantiate nothing new)
        if (!galigned || p.accumulate) columns(std::false_type{}, Form<kGeneric>{});
        else if (form == kPure) columns(std::true_type{}, Form<RAW ? kPure : kGeneric>{});
        else if (form == kSigned) columns(std::true_type{}, Form<RAW ? kSigned : kGeneric>{});
        else columns(std::true_type{}, Form<kGeneric>{});
        if (tid == 0)
          for (int64_t j = tail_lo; j < hi; ++j) {
            float z1[VEC] = {}, t1[VEC] = {}, v1[VEC] = {}, g1[VEC];
            z1[0] = zval(to_float(x[j - lo]), t1[0]);
            if (kDenseTeacher<DISTILL>) v1[0] = to_float(u[j - lo]) * o.inv_tt;
            grad_pack<kGeneric, DISTILL, CAP>(rr, o, gc, z1, t1, v1, 1, g1);
            if (j == label) add_label(g1, t1, 0);
            G *gj = grow + (j - lo);
            *gj = from_float<G>(p.accumulate ? to_float(*gj) + g1[0] : g1[0]);
          }
        if (SPARSE) {  // the ids in this slice: their whole element from the gathered logit, stored once
          __syncthreads();  // after pass 2's stores there
          const int col = tid < o.topk ? tk_col[tid] : kElsewhere;
          if (col >= 0) {
            const float zk = tk_z[tid], pk = ex2(fmaf(zk, gc.s2, -gc.lse2));
            float g = grad_elem<DISTILL>(rr, o, zk, 0.0f, pk, FastMath{}) +
                      topk_correction(rr, o, zk, tk_lq[tid]);
            if (lo + col == label) g += rr.cy;
            if (CAP) g *= 1.0f - (zk / o.cap) * (zk / o.cap);
            grow[col] = from_float<G>(p.accumulate ? tk_old[tid] + g : g);
          }
        }
      };
      if (p.grad_f32) write(static_cast<float *>(p.grad));
      else write(static_cast<T *>(p.grad));
    }
    r = PHASE != kStats ? next_sh : r + step;  // next_sh changes after the next row's first barrier
  }
#if __CUDA_ARCH__ >= 900
  if (csize > 1) cluster.sync();  // no CTA leaves while its records may still be on the way
#endif
}

// Dense JSD's statistics step is forward KL's (the same record); its middle step has no gradient
// and no other divergence has one (null).
template <class T, int PHASE, bool GRAD, bool CAP>
const void *pick_distill(int distill) {
  using K = const void *;
  if constexpr (PHASE == kMiddle) {
    if constexpr (GRAD) return nullptr;
    else return distill == kDistillJsd ? K(row_kernel<T, false, CAP, kDistillJsd, kMiddle, false>) : nullptr;
  } else {
    switch (distill) {
      case kDistillFwd: return K(row_kernel<T, GRAD, CAP, kDistillFwd, PHASE, false>);
      case kDistillRev: return K(row_kernel<T, GRAD, CAP, kDistillRev, PHASE, false>);
      case kDistillJsd: return K(row_kernel<T, GRAD, CAP, PHASE == kStats ? kDistillFwd : kDistillJsd, PHASE, false>);
      case kDistillSparse: return K(row_kernel<T, GRAD, CAP, kDistillSparse, PHASE, false>);
      default: return K(row_kernel<T, GRAD, CAP, kDistillNone, PHASE, false>);
    }
  }
}

// The statistics step has no gradient; without one, finish has no use for the soft-cap's
// chain factor (its records already hold z_hat).
template <class T>
const void *pick_row_kernel(int phase, bool grad, bool cap, int distill) {
  if (phase == kMiddle)
    return cap ? pick_distill<T, kMiddle, false, true>(distill) : pick_distill<T, kMiddle, false, false>(distill);
  if (phase == kStats)
    return cap ? pick_distill<T, kStats, false, true>(distill) : pick_distill<T, kStats, false, false>(distill);
  if (phase == kFinish) {
    if (!grad) return pick_distill<T, kFinish, false, false>(distill);
    return cap ? pick_distill<T, kFinish, true, true>(distill) : pick_distill<T, kFinish, true, false>(distill);
  }
  if (grad) return cap ? pick_distill<T, kWhole, true, true>(distill) : pick_distill<T, kWhole, true, false>(distill);
  return cap ? pick_distill<T, kWhole, false, true>(distill) : pick_distill<T, kWhole, false, false>(distill);
}

// The bulk-copy whole-row kernel of a dense teacher's divergence (nullptr for the others).
template <class T, bool GRAD, bool CAP>
const void *pick_bulk_distill(int distill) {
  using K = const void *;
  switch (distill) {
    case kDistillFwd: return K(row_kernel<T, GRAD, CAP, kDistillFwd, kWhole, true>);
    case kDistillRev: return K(row_kernel<T, GRAD, CAP, kDistillRev, kWhole, true>);
    case kDistillJsd: return K(row_kernel<T, GRAD, CAP, kDistillJsd, kWhole, true>);
    default: return nullptr;
  }
}

// The bulk-copy variant of a phase's kernel (nullptr where it does not apply: a sparse teacher,
// distillation in the split's steps, and a finish without a gradient, which reads no logits).
template <class T>
const void *pick_bulk_kernel(int phase, bool grad, bool cap, int distill) {
  using K = const void *;
  if (distill != kDistillNone) {
    if (phase != kWhole) return nullptr;
    if (grad) return cap ? pick_bulk_distill<T, true, true>(distill) : pick_bulk_distill<T, true, false>(distill);
    return cap ? pick_bulk_distill<T, false, true>(distill) : pick_bulk_distill<T, false, false>(distill);
  }
  if (phase == kStats)
    return cap ? K(row_kernel<T, false, true, kDistillNone, kStats, true>)
               : K(row_kernel<T, false, false, kDistillNone, kStats, true>);
  if (phase == kFinish) {
    if (!grad) return nullptr;
    return cap ? K(row_kernel<T, true, true, kDistillNone, kFinish, true>)
               : K(row_kernel<T, true, false, kDistillNone, kFinish, true>);
  }
  if (grad) return cap ? K(row_kernel<T, true, true, kDistillNone, kWhole, true>)
                       : K(row_kernel<T, true, false, kDistillNone, kWhole, true>);
  return cap ? K(row_kernel<T, false, true, kDistillNone, kWhole, true>)
             : K(row_kernel<T, false, false, kDistillNone, kWhole, true>);
}

}  // namespace hl::loss::dev
