// The loss plan on CUDA: the kernels and their cluster / shared-memory shapes are chosen once per
// plan; an execution runs three kernels on the stream:
//   prep:   the divisor D (sum of valid weights, fixed order), the label check, and zeroed
//           counters for the row kernel;
//   rows:   statistics, gradient, and each row's record;
//   reduce: the scalars from the records (sums.cuh: an order fixed by the row count, no float
//           atomics: deterministic, and the same bits on every rank of a split).
// The split execution runs rows in its kStats phase alone, then prep, rows (kFinish) and reduce;
// dense JSD's middle step between them runs prep and rows (kMiddle).
#include <climits>
#include <cstring>
#include <vector>

#include "common/cuda_util.h"
#include "common/dtype.cuh"
#include "common/grid_dependency.cuh"
#include "hl/loss/plan.h"
#include "loss/cuda_plan.h"
#include "loss/gemm.h"
#include "loss/launch.h"
#include "loss/params.cuh"
#include "loss/shifted.h"
#include "loss/steps.h"
#include "loss/sums.cuh"

#include <cooperative_groups.h>

namespace hl::loss {
namespace dev {
namespace {

namespace cg = cooperative_groups;

constexpr int kReduceRows = kReduceThreads * kReduceBatch;
// The prep kernel's CTAs (<= 32 registers) are resident beside three row-kernel CTAs, so the row
// kernel, launched to start early (allow_early_start), begins its first rows while prep runs; each
// row kernel CTA waits for prep only at its first finish.
constexpr size_t kPrepBytes = (sizeof(PrepOut) + 15) / 16 * 16;

struct PrepArgs {
  const void *labels;
  const float *weights;
  int64_t rows, vocab, ignore_index;
  double divisor;
  float grad_scale;
  bool labels64, use_ignore;
  unsigned *counters;  // kCounters (params.cuh), zeroed here
};

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// The prep kernel runs as one cluster of CTAs (Hopper; else one CTA): each CTA reduces a
// contiguous range of rows, then rank 0 merges the CTAs' results in rank order through
// distributed shared memory (deterministic; no counter to zero first). One CTA per
// kPrepRowsPerThread x 128 rows, up to kSmallCluster.

struct ClusterPos {
  int rank, size;
};
__device__ __forceinline__ ClusterPos cluster_pos() {
#if __CUDA_ARCH__ >= 900
  const cg::cluster_group c = cg::this_cluster();
  return {int(c.block_rank()), int(c.num_blocks())};
#else
  return {0, 1};
#endif
}
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
  cg::this_cluster().sync();
#else
  __syncthreads();
#endif
}
// Rank c's copy of a shared variable.
template <class T>
__device__ __forceinline__ T *peer(T *p, int c) {
#if __CUDA_ARCH__ >= 900
  return cg::this_cluster().map_shared_rank(p, c);
#else
  return p;
#endif
}
// This CTA's rows [lo, hi) of n.
__device__ __forceinline__ void cta_rows(int64_t n, int64_t &lo, int64_t &hi) {
  const ClusterPos c = cluster_pos();
  const int64_t per = (n + c.size - 1) / c.size;
  lo = min(n, c.rank * per), hi = min(n, lo + per);
}

__global__ void __launch_bounds__(kPrepThreads, 16) prep_kernel(const PrepArgs a, PrepOut *out) {
  hl::dev::let_next_grid_start();
  __shared__ float wsum[kPrepThreads / 32];
  __shared__ long long wbad[kPrepThreads / 32];
  float w = 0.0f;
  long long bad = LLONG_MAX;
  static_assert(kCounters <= kPrepThreads, "one thread a counter");
  if (cluster_pos().rank == 0 && threadIdx.x < kCounters) a.counters[threadIdx.x] = 0;
  int64_t lo, hi;
  cta_rows(a.rows, lo, hi);
  constexpr int B = 4;  // rows a thread reads before using any: latency, not bandwidth, bounds this
  for (int64_t i0 = lo + threadIdx.x; i0 < hi; i0 += B * kPrepThreads) {
    int64_t y[B];
    float wt[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int64_t i = i0 + b * kPrepThreads;
      if (i >= hi) break;
      y[b] = !a.labels ? 0 : a.labels64 ? static_cast<const int64_t *>(a.labels)[i]
                                         : int64_t(static_cast<const int32_t *>(a.labels)[i]);
      wt[b] = a.weights ? a.weights[i] : 1.0f;
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int64_t i = i0 + b * kPrepThreads;
      if (i >= hi) break;
      if (!label_counts(y[b], a.use_ignore, a.ignore_index)) continue;
      w += wt[b];
      if (y[b] >= a.vocab && bad == LLONG_MAX) bad = i;
    }
  }
  w = warp_sum(w);
  for (int off = 16; off > 0; off >>= 1) {
    const long long o = __shfl_xor_sync(0xffffffffu, bad, off);
    bad = o < bad ? o : bad;
  }
  if (threadIdx.x % 32 == 0) wsum[threadIdx.x / 32] = w, wbad[threadIdx.x / 32] = bad;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < kPrepThreads / 32; ++i) {
      w += wsum[i];
      bad = wbad[i] < bad ? wbad[i] : bad;
    }
    wsum[0] = w, wbad[0] = bad;  // this CTA's result
  }
  cluster_sync();
  const bool last = cluster_pos().rank == 0 && threadIdx.x == 0;
  if (last) {
    w = 0.0f, bad = LLONG_MAX;
    for (int c = 0; c < cluster_pos().size; ++c) {
      w += *peer(&wsum[0], c);
      bad = min(bad, *peer(&wbad[0], c));
    }
  }
  cluster_sync();  // peers keep their shared memory until rank 0 has read it
  if (!last) return;
  const float D = a.divisor > 0 ? float(a.divisor) : w;
  const float gs = a.grad_scale == 0.0f ? 1.0f : a.grad_scale;
  out->kd = D > 0.0f ? gs / D : 0.0f;
  out->D = D;
  out->bad = bad;
  out->bad_topk = LLONG_MAX;  // topk_check_kernel's, which runs after this one
}

// A sparse teacher's check (before the row kernel, with the label check's synchronisation): the
// first row with an id out of [0, vocab) other than padding, a log-prob topk_logprob_ok refuses,
// or an id twice goes to out->bad_topk (an integer minimum: the same row whatever the order).
// Each CTA takes rows in grid order; thread k checks entry k against the entries before it.
struct TopkCheckArgs {
  const void *ids;
  const float *lp;
  int64_t ids_stride, lp_stride, rows, vocab;
  int k;
  bool ids64;
};
static_assert(kMaxTopk <= kThreads, "a thread an entry");

__global__ void __launch_bounds__(kThreads) topk_check_kernel(const TopkCheckArgs a, PrepOut *out) {
  __shared__ long long ids[kMaxTopk];
  const int k = threadIdx.x;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    long long id = -1;
    if (k < a.k) {
      const int64_t at = r * a.ids_stride + k;
      id = a.ids64 ? static_cast<const long long *>(a.ids)[at] : static_cast<const int32_t *>(a.ids)[at];
      ids[k] = id;
    }
    __syncthreads();
    bool bad = false;
    if (id >= 0) {
      bad = id >= a.vocab || !topk_logprob_ok(a.lp[r * a.lp_stride + k]);
      for (int j = 0; j < k && !bad; ++j) bad = ids[j] == id;
    }
    if (bad) atomicMin(&out->bad_topk, (long long)r);
    __syncthreads();  // ids are read before the next row's
  }
}

// The reduce kernel: CTA b sums the records of rows [b kReduceRows, (b + 1) kReduceRows) (each
// thread kReduceBatch of them, all loaded before any is added: one round trip) into a partial;
// the CTA that takes the last ticket merges the partials in CTA order and writes the scalars.
// The order of additions depends on the row count alone. Many CTAs rather than one: one CTA's
// latency-bound loop took 14 us at 8192 rows (a third of the fixed cost of a call there).
__global__ void __launch_bounds__(kReduceThreads)
reduce_kernel(const float *rec, int64_t rows, float *partials, unsigned *ticket, const PrepOut *prep,
              bool has_ratio, bool has_adv, unsigned terms, int n, float *out) {
  __shared__ float part[kReduceThreads / 32][kSumFields];
  __shared__ bool last;
  float acc[kSumFields];
  sums_init(acc);
  const int64_t i0 = int64_t(blockIdx.x) * kReduceRows + threadIdx.x;
  float r[kReduceBatch][kRecFields];
#pragma unroll
  for (int b = 0; b < kReduceBatch; ++b)
    if (i0 + b * kReduceThreads < rows) load_floats(rec + (i0 + b * kReduceThreads) * kRecStride, r[b]);
#pragma unroll
  for (int b = 0; b < kReduceBatch; ++b)
    if (i0 + b * kReduceThreads < rows) add_row(acc, [&](int k) { return r[b][k]; });
  block_combine<kReduceThreads>(acc, part);
  if (threadIdx.x == 0) {
    store_floats<kSumFields>(partials + size_t(blockIdx.x) * kSumStride, acc);
    __threadfence();  // the partial before the ticket
    last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other CTAs' partials after their tickets
  sums_init(acc);
  for (unsigned c = threadIdx.x; c < gridDim.x; c += kReduceThreads) {
    float o[kSumFields];
    load_floats<kSumFields, true>(partials + size_t(c) * kSumStride, o);
#pragma unroll
    for (int k = 0; k < kSumFields; ++k) acc[k] = combine(k, acc[k], o[k]);
  }
  block_combine<kReduceThreads>(acc, part);
  if (threadIdx.x == 0) write_scalars(acc, prep->D, has_ratio, has_adv, terms, n, out);
}

const void *pick_bulk(hl_dtype_t dt, int phase, bool grad, bool cap, int distill) {
  switch (dt) {
    case HL_DTYPE_F32: return pick_bulk_kernel<float>(phase, grad, cap, distill);
    case HL_DTYPE_F16: return pick_bulk_kernel<__half>(phase, grad, cap, distill);
    default: return pick_bulk_kernel<__nv_bfloat16>(phase, grad, cap, distill);
  }
}

const void *pick(hl_dtype_t dt, int phase, bool grad, bool cap, int distill) {
  switch (dt) {
    case HL_DTYPE_F32: return pick_row_kernel<float>(phase, grad, cap, distill);
    case HL_DTYPE_F16: return pick_row_kernel<__half>(phase, grad, cap, distill);
    default: return pick_row_kernel<__nv_bfloat16>(phase, grad, cap, distill);
  }
}

}  // namespace

// The workspace: PrepOut, the counters (params.cuh), the rows' records (sums.cuh), the reduce
// kernel's partials, then the gathered blocks of a split.
constexpr size_t kRecordsAt = kPrepBytes + (kCounters * sizeof(unsigned) + 15) / 16 * 16;
static int64_t reduce_ctas(int64_t rows) { return (rows + kReduceRows - 1) / kReduceRows; }
static size_t partials_at(int64_t rows) { return kRecordsAt + size_t(rows) * kRecStride * sizeof(float); }
// The sequence area (steps.h, SeqArea) where the plan has sequences.
static size_t seq_at(int64_t rows) {
  return partials_at(rows) + size_t(reduce_ctas(rows)) * kSumStride * sizeof(float);
}
static SeqArea seq_area_of(const hl_loss_plan_st &p, int64_t rows, void *workspace) {
  return seq_area(p, rows, reinterpret_cast<float *>(static_cast<char *>(workspace) + seq_at(rows)));
}
static size_t gathered_at(const hl_loss_plan_st &p, int64_t rows) {
  return seq_at(rows) + (p.sequences ? (seq_area_floats(p, rows) * sizeof(float) + 15) / 16 * 16 : 0);
}
// The gathered middle blocks (a plan of two exchanges), after the gathered blocks. Saturated where
// ranks and rows ask for more than any workspace holds (the entry points refuse that).
static size_t middle_at(const hl_loss_plan_st &p, int64_t rows) {
  return sat_add(gathered_at(p, rows), sat_mul(size_t(p.desc.ranks), block_bytes(p, rows)));
}

// The kernel arguments every phase shares, for rows [row0, row0 + a.rows) of a call of `total`
// rows (a's per-row pointers are those rows').
static Params make_params(const hl_loss_plan_st &p, const CudaLaunch &c, const hl_loss_args_t &a,
                          void *workspace, int64_t row0, int64_t total) {
  const hl_loss_plan_desc_t &d = p.desc;
  Params k{};
  k.logits = a.logits, k.teacher = a.teacher_logits, k.grad = a.grad;
  k.logits_stride = a.logits_stride, k.teacher_stride = a.teacher_stride, k.grad_stride = a.grad_stride;
  const SeqArea seq = workspace && p.sequences ? seq_area_of(p, total, workspace) : SeqArea{};
  const auto at = [row0](const float *v) { return v ? v + row0 : nullptr; };
  k.src = row_source(p, a, at(seq.lr), at(seq.roll), at(seq.g));
  k.topk_ids = a.teacher_topk_ids, k.topk_lp = a.teacher_topk_logprobs;
  k.topk_ids_stride = a.teacher_topk_ids_stride, k.topk_lp_stride = a.teacher_topk_logprobs_stride;
  k.topk_ids64 = d.teacher_topk_ids_dtype == HL_DTYPE_I64;
  k.tok_loss = a.token_loss, k.tok_logp = a.token_logp, k.tok_entropy = a.token_entropy;
  k.tok_lse = a.token_lse, k.tok_argmax = a.token_argmax;
  if (workspace) {
    char *w = static_cast<char *>(workspace);
    k.prep = reinterpret_cast<PrepOut *>(w);
    k.counters = reinterpret_cast<unsigned *>(w + kPrepBytes);
    k.records = a.scalars ? reinterpret_cast<float *>(w + kRecordsAt) + row0 * kRecStride : nullptr;
  }
  k.has_ratio = a.labels && a.old_logprobs, k.has_adv = a.advantages != nullptr;
  k.rows = a.rows, k.vocab = d.vocab;
  k.slice = slice_cols(d.vocab, c.cluster, int(16 / dtype_size(d.logits_dtype)));
  k.o = p.opt;
  k.grad_f32 = d.grad_dtype == HL_DTYPE_F32 && d.logits_dtype != HL_DTYPE_F32;
  k.accumulate = d.grad_mode == HL_LOSS_GRAD_ACCUMULATE, k.keep_row = c.keep_row;
  k.col0 = d.vocab_start;
  k.block_bytes = int64_t(block_bytes(p, total));
  k.middle_block_bytes = int64_t(block_bytes(p, total, true));
  k.record_bytes = int64_t(record_bytes(p));
  k.ranks = d.ranks;
  k.row0 = row0;
  return k;
}

// The blocks a phase reads and writes: the gathered ones, and this rank's with its header.
static void set_blocks(const hl_loss_plan_st &p, Phase phase, int64_t total, Gathered gathered, void *block,
                       Params &k) {
  k.gathered = static_cast<const char *>(gathered.stats);
  k.gathered_middle = static_cast<const char *>(gathered.middle);
  if (block) {
    k.block = static_cast<char *>(block);
    const BlockHeader h = make_header(p, total, phase == kMiddle);
    static_assert(sizeof h == sizeof k.header, "the header is 8 int64 fields");
    std::memcpy(k.header, &h, sizeof h);
  }
}

// early: the kernel before it on the stream is the prep kernel, which it may overlap (sm_90).
static hl_status_t launch_rows(const CudaLaunch &c, const Params &k, cudaStream_t stream, bool early) {
  const int64_t clusters = std::min<int64_t>(k.rows, c.grid / c.cluster);
  cudaLaunchAttribute attr, attrs[2];
  cudaLaunchConfig_t cfg = hl::dev::cluster_launch(clusters * c.cluster, kThreads, c.smem, c.cluster, stream, attr);
  if (early) hl::dev::allow_early_start(cfg, attrs);
  Params arg = k;
  void *args[] = {&arg};
  HL_CUDA_TRY(cudaLaunchKernelExC(&cfg, c.kernel, args));
  return HL_STATUS_SUCCESS;
}

// The bulk-copy kernel of a phase where it exists and the rows (a dense teacher's too) are
// 16-byte aligned, else the other.
static const CudaLaunch &pick_launch(const hl_loss_plan_st &p, const hl_loss_args_t &a, Phase phase) {
  const size_t elt = dtype_size(p.desc.logits_dtype);
  const auto rows16 = [&](const void *x, int64_t stride) {
    return reinterpret_cast<uintptr_t>(x) % 16 == 0 && stride * elt % 16 == 0;
  };
  const bool aligned = rows16(a.logits, a.logits_stride) &&
                       (!a.teacher_logits || rows16(a.teacher_logits, a.teacher_stride));
  return aligned && p.cuda->bulk[phase].kernel ? p.cuda->bulk[phase] : p.cuda->phase[phase];
}

static int prep_cluster(const hl_loss_plan_st &p, int64_t rows) {
  const int64_t per = int64_t(kPrepThreads) * kPrepRowsPerThread;
  return int(std::min<int64_t>(p.cuda->small_cluster, (rows + per - 1) / per));
}

// Launches the prep or reduce kernel: `ctas` CTAs in clusters of `cluster`.
template <class... Exp, class... Act>
static hl_status_t launch_small(void (*kernel)(Exp...), int threads, int64_t ctas, int cluster,
                                cudaStream_t stream, Act... args) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = hl::dev::cluster_launch(ctas, threads, 0, cluster, stream, attr);
  HL_CUDA_TRY(cudaLaunchKernelEx(&cfg, kernel, args...));
  return HL_STATUS_SUCCESS;
}

// The prep kernel (D, first bad label), then unless the plan is unchecked one synchronisation
// that checks the labels and, for a finish, the gathered blocks' headers.
}  // namespace dev

hl_status_t dev::rows_begin(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                             Gathered g, void *workspace, cudaStream_t stream) {
  const void *gathered = g.stats;
  char *w = static_cast<char *>(workspace);
  PrepOut *prep = reinterpret_cast<PrepOut *>(w);
  const hl_loss_plan_desc_t &d = p.desc;
  const bool l64 = d.labels_dtype == HL_DTYPE_I64;
  const PrepArgs pa{a.labels, a.weights, a.rows, d.vocab_global, d.ignore_index, a.divisor,
                    a.grad_scale, l64, d.use_ignore_index != 0,
                    reinterpret_cast<unsigned *>(w + kPrepBytes)};
  const int cluster = prep_cluster(p, a.rows);
  HL_TRY(launch_small(prep_kernel, kPrepThreads, cluster, cluster, stream, pa, prep));
  // Before the checks, but no row is written until they pass (a bad cu_seqlens is clamped here).
  if (p.sequences) HL_TRY(seq_run(p, a, gathered, seq_area_of(p, a.rows, workspace), stream));
  const bool unchecked = d.flags & HL_LOSS_UNCHECKED, topk = p.opt.topk > 0;
  const bool i64 = d.teacher_topk_ids_dtype == HL_DTYPE_I64;
  if (topk && !unchecked) {
    const TopkCheckArgs ta{a.teacher_topk_ids, a.teacher_topk_logprobs, a.teacher_topk_ids_stride,
                           a.teacher_topk_logprobs_stride, a.rows, d.vocab_global, p.opt.topk, i64};
    HL_TRY(launch_small(topk_check_kernel, kThreads, std::min<int64_t>(a.rows, kTopkCheckCtas), 1, stream, ta, prep));
  }
  if (unchecked || (!a.labels && !gathered && !topk && !p.sequences)) return HL_STATUS_SUCCESS;
  long long bad = LLONG_MAX, bad_topk = LLONG_MAX;
  std::vector<BlockHeader> headers(gathered ? size_t(d.ranks) : 0), middles(g.middle ? size_t(d.ranks) : 0);
  const size_t cu_elt = dtype_size(d.cu_seqlens_dtype);
  std::vector<char> cu(p.sequences ? size_t(a.num_seqs + 1) * cu_elt : 0);
  if (a.labels) HL_CUDA_TRY(cudaMemcpyAsync(&bad, &prep->bad, sizeof bad, cudaMemcpyDeviceToHost, stream));
  if (topk) HL_CUDA_TRY(cudaMemcpyAsync(&bad_topk, &prep->bad_topk, sizeof bad_topk, cudaMemcpyDeviceToHost, stream));
  if (gathered)
    HL_CUDA_TRY(cudaMemcpy2DAsync(headers.data(), sizeof(BlockHeader), gathered, block_bytes(p, a.rows),
                                  sizeof(BlockHeader), size_t(d.ranks), cudaMemcpyDeviceToHost, stream));
  if (g.middle)
    HL_CUDA_TRY(cudaMemcpy2DAsync(middles.data(), sizeof(BlockHeader), g.middle, block_bytes(p, a.rows, true),
                                  sizeof(BlockHeader), size_t(d.ranks), cudaMemcpyDeviceToHost, stream));
  if (p.sequences)
    HL_CUDA_TRY(cudaMemcpyAsync(cu.data(), a.cu_seqlens, cu.size(), cudaMemcpyDeviceToHost, stream));
  HL_CUDA_TRY(cudaStreamSynchronize(stream));
  if (p.sequences) HL_TRY(check_seqlens(fn, p, a, cu.data()));
  if (bad != LLONG_MAX) {
    int64_t y = 0;
    HL_CUDA_TRY(cudaMemcpy(&y, static_cast<const char *>(a.labels) + bad * (l64 ? 8 : 4),
                           l64 ? 8 : 4, cudaMemcpyDeviceToHost));
    if (!l64) y = int64_t(int32_t(y));
    return fail(HL_STATUS_INVALID_VALUE,
                "%s: labels[%lld] is %lld, outside [0, vocab = %lld) and not ignored", fn, bad,
                (long long)y, (long long)d.vocab_global);
  }
  if (bad_topk != LLONG_MAX) {  // the row's entries to the host, for the CPU backend's message
    const int K = p.opt.topk;
    std::vector<int64_t> ids(static_cast<size_t>(K));  // I32 ids fill its first half
    std::vector<float> lp(static_cast<size_t>(K));
    const size_t isz = i64 ? 8 : 4;
    HL_CUDA_TRY(cudaMemcpy(ids.data(), static_cast<const char *>(a.teacher_topk_ids) + bad_topk * a.teacher_topk_ids_stride * isz,
                           K * isz, cudaMemcpyDeviceToHost));
    HL_CUDA_TRY(cudaMemcpy(lp.data(), a.teacher_topk_logprobs + bad_topk * a.teacher_topk_logprobs_stride,
                           K * sizeof(float), cudaMemcpyDeviceToHost));
    HL_TRY(check_topk_row(fn, p, bad_topk, ids.data(), lp.data()));
    return fail(HL_STATUS_INTERNAL_ERROR, "%s: the device found a bad entry in teacher_topk row %lld "
                "that the host check passes", fn, bad_topk);
  }
  if (gathered) HL_TRY(check_blocks(fn, p, a.rows, headers.data()));
  return g.middle ? check_blocks(fn, p, a.rows, middles.data(), true) : HL_STATUS_SUCCESS;
}

hl_status_t dev::rows_run(const hl_loss_plan_st &p, const hl_loss_args_t &a, Phase phase,
                           int64_t row0, int64_t total, Gathered gathered, void *block,
                           void *workspace, cudaStream_t stream, bool after_prep) {
  const CudaLaunch &c = pick_launch(p, a, phase);
  Params k = make_params(p, c, a, workspace, row0, total);
  set_blocks(p, phase, total, gathered, block, k);
  // The row counters are the prep kernel's to zero; a later chunk's launch zeroes them again.
  if (phase != kStats && !after_prep)
    HL_CUDA_TRY(cudaMemsetAsync(k.counters, 0, kMaxCluster * sizeof(unsigned), stream));
  return launch_rows(c, k, stream, after_prep && p.cuda->early_start);
}

dev::Params dev::row_params(const hl_loss_plan_st &p, const hl_loss_args_t &a, void *workspace, int64_t row0,
                              int64_t total, Phase phase, Gathered gathered, void *block) {
  Params k = make_params(p, CudaLaunch{}, a, workspace, row0, total);
  set_blocks(p, phase, total, gathered, block, k);
  return k;
}

hl_status_t dev::rows_end(const hl_loss_plan_st &p, const hl_loss_args_t &a, void *workspace,
                           cudaStream_t stream) {
  if (!a.scalars) return HL_STATUS_SUCCESS;
  char *w = static_cast<char *>(workspace);
  const float *records = reinterpret_cast<const float *>(w + kRecordsAt);
  float *partials = reinterpret_cast<float *>(w + partials_at(a.rows));
  unsigned *counters = reinterpret_cast<unsigned *>(w + kPrepBytes);
  HL_TRY(launch_small(reduce_kernel, kReduceThreads, reduce_ctas(a.rows), 1, stream, records, a.rows,
                      partials, counters + kTicket, reinterpret_cast<const PrepOut *>(w),
                      a.labels && a.old_logprobs, a.advantages != nullptr, unsigned(p.desc.terms),
                      p.opt.scalars, a.scalars));
  return p.pref.kind < 0 ? HL_STATUS_SUCCESS : pref_store_scalars(p, a, seq_area_of(p, a.rows, workspace), stream);
}

namespace dev {
namespace {

// prep, rows (kWhole or kFinish), reduce; kMiddle: prep, rows into `block`.
hl_status_t run_loss(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a, Phase phase,
                     Gathered gathered, void *block, void *workspace, cudaStream_t stream) {
  if (a.rows == 0) return phase == kMiddle ? HL_STATUS_SUCCESS : zero_scalars(p, a, stream);
  HL_TRY(rows_begin(fn, p, a, gathered, workspace, stream));
  HL_TRY(rows_run(p, a, phase, 0, a.rows, gathered, block, workspace, stream, true));
  return phase == kMiddle ? HL_STATUS_SUCCESS : rows_end(p, a, workspace, stream);
}

}  // namespace

// A block of no rows: the header alone (a pageable copy: staged before this returns).
static hl_status_t write_header(const hl_loss_plan_st &p, const hl_loss_args_t &a, void *block,
                                bool middle, cudaStream_t s) {
  const BlockHeader h = make_header(p, a.rows, middle);
  HL_CUDA_TRY(cudaMemcpyAsync(block, &h, sizeof h, cudaMemcpyHostToDevice, s));
  return HL_STATUS_SUCCESS;
}
}  // namespace dev

hl_status_t dev::zero_scalars(const hl_loss_plan_st &p, const hl_loss_args_t &a, cudaStream_t stream) {
  if (a.scalars) HL_CUDA_TRY(cudaMemsetAsync(a.scalars, 0, size_t(p.opt.scalars) * sizeof(float), stream));
  return HL_STATUS_SUCCESS;
}

hl_status_t cuda_plan(const char *fn, hl_loss_plan_st &p) {
  using namespace dev;
  const hl_loss_plan_desc_t &d = p.desc;
  const bool grad = p.dlogits;
  // A sparse teacher's ids are kept as int columns of a slice.
  if (p.opt.distill == kDistillSparse && d.vocab > INT_MAX)
    return fail(HL_STATUS_NOT_SUPPORTED, "%s: a sparse teacher needs vocab <= %d on CUDA (vocab is %lld)",
                fn, INT_MAX, (long long)d.vocab);
  p.cuda.reset(new CudaPlan());
  if (p.linear) HL_TRY(make_gemms(fn, d.weight_dtype, &p.cuda->gemms));
  // Fixed with the plan: the workspace a caller sized for it keeps fitting its calls.
  p.cuda->shifted = shifted_plan(p);
  int dev = 0, optin = 0;
  HL_CUDA_TRY(cudaGetDevice(&dev));
  HL_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  // not major >= 9: a newer GPU runs the sm_80 code
  const RowShape rs = row_shape(d.vocab, dtype_size(d.logits_dtype), size_t(optin), hl::dev::code_arch() >= 90,
                                p.opt.distill != kDistillNone && p.opt.distill != kDistillSparse);
  p.cuda->small_cluster = rs.small_cluster;
  p.cuda->early_start = rs.early_start;
  // The row kernel takes the most shared memory an SM has; an SM whose L1 / shared split suits a
  // kernel asking for less cannot host its CTAs, so prep asks for the same split to share SMs.
  HL_CUDA_TRY(cudaFuncSetAttribute(prep_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                   cudaSharedmemCarveoutMaxShared));
  const auto finish_choice = [&](CudaLaunch &c) -> hl_status_t {
    // The attribute belongs to the kernel, which plans of other vocabularies share: allow the most
    // any plan may use, so that a later plan never lowers it under an earlier one's launch.
    HL_CUDA_TRY(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(rs.smem_cap)));
    if (c.cluster > 8)
      HL_CUDA_TRY(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    c.grid = hl::dev::clusters_resident(c.kernel, kThreads, c.smem, c.cluster) * c.cluster;  // 0: cannot run
    return HL_STATUS_SUCCESS;
  };
  for (int ph = kWhole; ph < kPhases; ++ph) {
    CudaLaunch &c = p.cuda->phase[ph];
    c.kernel = pick(d.logits_dtype, ph, grad, p.opt.cap > 0, p.opt.distill);
    if (!c.kernel) continue;  // kMiddle: dense JSD's alone
    // The split's phases re-read the logits; a finish without a gradient has no columns to share.
    // kMiddle's CTAs take rows alone like kFinish's, so each needs the whole row: no cluster.
    c.keep_row = ph == kWhole && rs.keep_row;
    c.cluster = (ph == kFinish && !grad) || ph == kMiddle ? 1 : rs.cluster;
    c.smem = c.keep_row ? rs.slice_bytes : 0;
    HL_TRY(finish_choice(c));
    if (c.grid == 0)
      return fail(HL_STATUS_NOT_SUPPORTED,
                  "%s: no cluster of %d CTAs with %zu bytes of shared memory fits this device (vocab "
                  "%lld)", fn, c.cluster, c.smem, (long long)d.vocab);
    // Bulk copies (Hopper): the whole-row shape, the slices kept in shared memory, where they fit.
    CudaLaunch &b = p.cuda->bulk[ph];
    b.kernel = rs.bulk ? pick_bulk(d.logits_dtype, ph, grad, p.opt.cap > 0, p.opt.distill) : nullptr;
    if (b.kernel) {
      b.cluster = rs.bulk_cluster;
      b.keep_row = true;
      b.smem = rs.bulk_bytes;
      HL_TRY(finish_choice(b));
      if (b.grid == 0) b.kernel = nullptr;
    }
  }
  return HL_STATUS_SUCCESS;
}

void cuda_plan_destroy(dev::CudaPlan *state) { delete state; }

size_t dev::cuda_base_workspace(const hl_loss_plan_st &p, int64_t rows) {
  const size_t middles = p.exchanges == 2 ? sat_mul(size_t(p.desc.ranks), block_bytes(p, rows, true)) : 0;
  return sat_add(dev::middle_at(p, rows), middles);
}

void cuda_workspace_sizes(const hl_loss_plan_st &p, int64_t rows, size_t *min_bytes, size_t *fast_bytes) {
  if (p.linear) return dev::linear_workspace(p, rows, min_bytes, fast_bytes);
  *min_bytes = *fast_bytes = dev::cuda_base_workspace(p, rows);
}

void *dev::cuda_gathered(const hl_loss_plan_st &p, int64_t rows, void *workspace, bool middle) {
  return static_cast<char *>(workspace) + (middle ? dev::middle_at(p, rows) : dev::gathered_at(p, rows));
}

hl_status_t cuda_execute(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                         void *workspace, size_t workspace_bytes, hl_stream_t stream) {
  if (p.seq_stats) {  // the split with one rank, its blocks in the workspace
    void *block = dev::cuda_gathered(p, a.rows, workspace);
    void *middle = p.exchanges == 2 ? dev::cuda_gathered(p, a.rows, workspace, true) : nullptr;
    HL_TRY(cuda_stats(fn, p, a, block, workspace, workspace_bytes, stream));
    if (middle) HL_TRY(cuda_middle(fn, p, a, block, middle, workspace, workspace_bytes, stream));
    return cuda_finish(fn, p, a, block, middle, workspace, workspace_bytes, stream);
  }
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.linear) return dev::linear_run(fn, p, a, kWhole, nullptr, {}, workspace, workspace_bytes, s);
  return dev::run_loss(fn, p, a, kWhole, {}, nullptr, workspace, s);
}

hl_status_t cuda_finish(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                        const void *gathered, const void *gathered_middle, void *workspace,
                        size_t workspace_bytes, hl_stream_t stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const dev::Gathered g{gathered, gathered_middle};
  if (p.linear) return dev::linear_run(fn, p, a, kFinish, nullptr, g, workspace, workspace_bytes, s);
  return dev::run_loss(fn, p, a, kFinish, g, nullptr, workspace, s);
}

hl_status_t cuda_middle(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                        const void *gathered, void *middle, void *workspace, size_t workspace_bytes,
                        hl_stream_t stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a.rows == 0) return dev::write_header(p, a, middle, true, s);
  const dev::Gathered g{gathered, nullptr};
  if (p.linear) return dev::linear_run(fn, p, a, kMiddle, middle, g, workspace, workspace_bytes, s);
  return dev::run_loss(fn, p, a, kMiddle, g, middle, workspace, s);
}

hl_status_t cuda_stats(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a, void *block,
                       void *workspace, size_t workspace_bytes, hl_stream_t stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a.rows == 0) return dev::write_header(p, a, block, false, s);
  if (p.linear) return dev::linear_run(fn, p, a, kStats, block, {}, workspace, workspace_bytes, s);
  return dev::rows_run(p, a, kStats, 0, a.rows, {}, block, nullptr, s, false);
}

}  // namespace hl::loss
