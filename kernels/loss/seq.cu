// The sequence values of a call's rows (row_math.h, SeqSums / seq_values): one CTA per sequence
// sums its tokens' log-ratios in a fixed order (deterministic), then writes the sequence's values
// into each of its rows (and, for a preference term, its sums). GSPO's log-ratio and a preference
// term's log-probs need each row's logp_y, from the gathered blocks' records merged over the ranks
// (the statistics step ran before).
#include <algorithm>
#include <cstddef>

#include "common/cuda_util.h"
#include "loss/params.cuh"
#include "loss/steps.h"

namespace hl::loss::dev {
namespace {

struct SeqArgs {
  const void *cu;
  bool cu64;
  int64_t seqs, rows;
  RowSource src;
  const char *gathered;  // with lr
  int64_t block_bytes, record_bytes;
  int ranks;
  bool lr, roll;         // which sums the plan needs
  Options o;
  float *out;            // seq_lr [rows], then seq_roll [rows]
  SeqSums<float> *sums;  // [seqs] with a preference term, else null
};

__device__ int64_t bound(const SeqArgs &a, int64_t s) {
  const int64_t v = a.cu64 ? static_cast<const int64_t *>(a.cu)[s]
                           : int64_t(static_cast<const int32_t *>(a.cu)[s]);
  return v < 0 ? 0 : v > a.rows ? a.rows : v;  // unchecked calls stay in bounds
}

// logp_y of row i from the ranks' records, merged in rank order.
__device__ float row_logp(const SeqArgs &a, int64_t i) {
  RowStats<float> all = empty_stats<float>();
  for (int c = 0; c < a.ranks; ++c) {
    RowStats<float> s = empty_stats<float>();
    const char *rec = a.gathered + c * a.block_bytes + 64 + i * a.record_bytes;
    memcpy(&s, rec, offsetof(RowStats<float>, mt));  // the student's fields
    all = c == 0 ? s : merge<false>(all, s, 1.0f);
  }
  return label_logp(all);
}

__global__ void __launch_bounds__(kSeqThreads) seq_kernel(const SeqArgs a) {
  __shared__ float part[kSeqThreads / 32][3];
  __shared__ float val[2];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int64_t s = blockIdx.x; s < a.seqs; s += gridDim.x) {
    const int64_t b = bound(a, s), e = max(b, bound(a, s + 1));
    float f[3] = {0.0f, 0.0f, 0.0f};  // SeqSums: n, lr, roll
    for (int64_t i = b + tid; i < e; i += kSeqThreads) {
      if (a.src.labels && read_label(a.src, i) < 0) continue;
      const float old = a.src.old_logp ? a.src.old_logp[i] : 0.0f;
      f[0] += 1.0f;
      if (a.lr) f[1] += row_logp(a, i) - old;
      if (a.roll) f[2] += old - a.src.rollout_logp[i];
    }
    for (int k = 0; k < 3; ++k)
      for (int off = 16; off > 0; off >>= 1) f[k] += __shfl_xor_sync(0xffffffffu, f[k], off);
    if (lane == 0)
      for (int k = 0; k < 3; ++k) part[warp][k] = f[k];
    __syncthreads();
    if (tid == 0) {
      SeqSums<float> sum{0.0f, 0.0f, 0.0f};
      for (int w = 0; w < kSeqThreads / 32; ++w)
        sum.n += part[w][0], sum.lr += part[w][1], sum.roll += part[w][2];
      seq_values(sum, a.o, &val[0], &val[1]);
      if (a.sums) a.sums[s] = sum;
    }
    __syncthreads();
    for (int64_t i = b + tid; i < e; i += kSeqThreads) a.out[i] = val[0], a.out[a.rows + i] = val[1];
    __syncthreads();  // part and val are reused by the next sequence
  }
}

}  // namespace

hl_status_t seq_run(const hl_loss_plan_st &p, const hl_loss_args_t &a, const void *gathered,
                    const SeqArea &area, cudaStream_t stream) {
  // Rows of no sequence (possible only unchecked) read zeros, not stale workspace.
  HL_CUDA_TRY(cudaMemsetAsync(area.lr, 0, seq_area_floats(p, a.rows) * sizeof(float), stream));
  if (a.num_seqs == 0) return p.pref.kind < 0 ? HL_STATUS_SUCCESS : pref_run(p, a, area, stream);
  SeqArgs k{};
  k.cu = a.cu_seqlens, k.cu64 = p.desc.cu_seqlens_dtype == HL_DTYPE_I64;
  k.seqs = a.num_seqs, k.rows = a.rows;
  k.src = row_source(p, a, nullptr, nullptr);
  k.gathered = static_cast<const char *>(gathered);
  k.block_bytes = int64_t(block_bytes(p, a.rows)), k.record_bytes = int64_t(record_bytes(p));
  k.ranks = p.desc.ranks;
  k.lr = p.seq_stats;  // of logp_y - old_logprob (0 without): GSPO, preference
  k.roll = p.opt.rollout_level != HL_LOSS_LEVEL_TOKEN && a.old_logprobs && a.rollout_logprobs;
  k.o = p.opt;
  k.out = area.lr;
  k.sums = area.sums;
  const int ctas = int(std::min<int64_t>(a.num_seqs, kMaxSeqCtas));
  seq_kernel<<<ctas, kSeqThreads, 0, stream>>>(k);
  HL_CUDA_TRY_LAUNCH();
  return p.pref.kind < 0 ? HL_STATUS_SUCCESS : pref_run(p, a, area, stream);
}

}  // namespace hl::loss::dev
