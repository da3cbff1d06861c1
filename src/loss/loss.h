// The loss plan object and its backends. Descriptors and arguments reach the backends validated,
// with defaults and strides resolved.
#pragma once

#include <cstdint>
#include <memory>

#include "headloss.h"
#include "row_math.h"

namespace hl::loss {

// Which call runs: the whole loss, or a step of the split (tensor-parallel) execution. The
// statistics step reads logits, labels and teacher logits only; the middle step (dense JSD's second
// exchange) writes each row's sums over this shard once the merged statistics are known.
enum Phase : int { kWhole = 0, kStats = 1, kFinish = 2, kMiddle = 3, kPhases = 4 };
// The phases that write the call's outputs (and so need every input of the terms).
inline bool writes_outputs(Phase ph) { return ph == kWhole || ph == kFinish; }

// How the CUDA backend runs one phase of a plan, chosen once at plan creation.
struct CudaLaunch {
  const void *kernel = nullptr;  // the specialised instantiation
  int cluster = 1;               // CTAs sharing one row through distributed shared memory
  int grid = 0;                  // CTAs of the persistent grid (a multiple of cluster)
  size_t smem = 0;               // dynamic shared memory per CTA: its slice of the row
  bool keep_row = false;         // the slice stays in shared memory between the two passes
};
struct CudaChoice {
  CudaLaunch phase[kPhases];  // by Phase
  CudaLaunch bulk[kPhases];   // the same through bulk copies (sm_90, aligned rows); kernel null if none
  int small_cluster = 1;  // the most CTAs of the prep kernel (one cluster)
  bool early_start = false;  // the row kernel may overlap the prep kernel (sm_90)
  bool shifted = false;      // the fused linear form's shifted path (kernels/loss/shifted.h), chosen once
};

struct Gemms;  // the fused linear form's cuBLASLt state (kernels/loss/linear.cu)

}  // namespace hl::loss

struct hl_loss_plan_st {
  hl_loss_plan_desc_t desc;  // validated; dtypes, vocab_global and ranks resolved
  hl::loss::Options opt;     // opt.vocab is the global vocabulary
  bool needs_labels;         // CE, GRPO, CISPO or GRPO_KL_REF is on
  bool linear;               // the fused linear form (desc.hidden > 0)
  bool dlogits;              // a gradient w.r.t. the logits is formed (stored, or multiplied on)
  bool sequences;            // calls pass cu_seqlens: rows read their sequence's values (SeqValues)
  bool seq_stats;            // those values need every row's statistics first (GSPO): a call runs
                             // as its statistics step, then its finish
  int exchanges;             // of the split: 1, or 2 with a middle step (dense JSD on a shard)
  uint64_t fingerprint;      // of every field the ranks of a sharded plan must share
  hl::loss::CudaChoice cuda;
  std::shared_ptr<hl::loss::Gemms> gemms;  // CUDA linear form: released with the plan
};

namespace hl::loss {

// The header of one rank's block of statistics (see hl_loss_plan_execute_stats).
struct BlockHeader {
  uint64_t tag, fingerprint;
  int64_t rows, vocab_start, vocab, vocab_global, record_bytes, zero;
};
static_assert(sizeof(BlockHeader) == 64, "the header is documented as 64 bytes");
constexpr uint64_t kBlockTag = 0x31534c48u;  // "HLS1"
constexpr uint64_t kMiddleTag = 0x314d4c48u; // "HLM1": a block of the middle step's sums

using CpuStats = RowStats<double>;

// A call's per-row pointers; seq_lr / seq_roll: its rows' sequence values, where the plan has them.
inline RowSource row_source(const hl_loss_plan_st &p, const hl_loss_args_t &a, const float *seq_lr,
                            const float *seq_roll) {
  const hl_loss_plan_desc_t &d = p.desc;
  return RowSource{a.labels, a.weights, a.advantages, a.old_logprobs, a.ref_logprobs,
                   a.rollout_logprobs, seq_lr, seq_roll, d.labels_dtype == HL_DTYPE_I64,
                   d.use_ignore_index != 0, d.ignore_index};
}

// Bytes of one row's record in a block: fp64 RowStats on the CPU; fp32 on CUDA, without the
// distillation fields when the plan has none; a sparse teacher's k z_hat after them (topk_absent
// at ids of other shards and padding; CUDA rounds their bytes up to 8).
size_t record_bytes(const hl_loss_plan_st &p);
// The same for the middle step's blocks: a row's MidSums, fp64 on the CPU, fp32 on CUDA.
size_t middle_record_bytes(const hl_loss_plan_st &p);
// Bytes of one rank's block (header and records) for `rows` rows; a multiple of 8. MIDDLE: a
// block of the middle step.
size_t block_bytes(const hl_loss_plan_st &p, int64_t rows, bool middle = false);
// The header of this plan's block for `rows` rows.
BlockHeader make_header(const hl_loss_plan_st &p, int64_t rows, bool middle = false);
// The ranks' headers, already read into host memory, against the plan: same plan and rows,
// shards tiling [0, vocab_global), this plan's shard among them.
hl_status_t check_blocks(const char *fn, const hl_loss_plan_st &p, int64_t rows,
                         const BlockHeader *headers, bool middle = false);

// A sparse teacher's row i, in host memory (its k ids and log-probs): ids in [0, vocab_global) or
// padding, none twice, log-probs finite and <= kTopkLogprobTol. Both backends' message.
hl_status_t check_topk_row(const char *fn, const hl_loss_plan_st &p, int64_t i, const void *ids,
                           const float *logprobs);

// Both forms: the fused linear form's logits are formed row by row in fp64 (cpu.cpp).
// Every row at once (one shard that is the whole vocabulary).
hl_status_t cpu_execute(const hl_loss_plan_st &p, const hl_loss_args_t &a);
// The records of every row over this shard's columns (record_bytes(p) each: CpuStats, then a
// sparse teacher's k z_hat) into `out`.
void cpu_stats(const hl_loss_plan_st &p, const hl_loss_args_t &a, char *out);
// Every row's records merged over the blocks of `ranks` ranks, `stride` bytes apart (in their
// order: the same bits on every rank), into `merged` (record_bytes(p) each).
void cpu_merge(const hl_loss_plan_st &p, int64_t rows, const char *blocks, size_t stride, int ranks,
               char *merged);
// The middle step's blocks of `ranks` ranks, `stride` bytes apart: each row's MidSums added in
// their order (the same bits on every rank) into `out`.
void cpu_merge_middle(int64_t rows, const char *blocks, size_t stride, int ranks, MidSums<double> *out);
// Dense JSD's middle step: each row's MidSums over this shard's columns, from the merged records.
void cpu_middle(const hl_loss_plan_st &p, const hl_loss_args_t &a, const char *merged,
                MidSums<double> *out);
// Losses, metrics, per-token outputs and this shard's gradient from every row's merged records;
// mid: dense JSD's MidSums over the whole row (the middle step's, summed over the ranks).
hl_status_t cpu_finish(const hl_loss_plan_st &p, const hl_loss_args_t &a, const char *merged,
                       const MidSums<double> *mid);

// cu_seqlens as read from host memory (num_seqs + 1 values): starts at 0, non-decreasing, ends at
// rows.
hl_status_t check_seqlens(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                          const void *host_cu);

#if HL_HAVE_CUDA
hl_status_t cuda_plan(const char *fn, hl_loss_plan_st &p);
// The prep kernel's output, the counters, the per-row records and the reduce kernel's partials
// (kernels/loss/sums.cuh), then room for `ranks` gathered blocks (hl_loss_plan_execute_nccl): the
// logits form's workspace, and the start of the fused linear form's.
size_t cuda_base_workspace(const hl_loss_plan_st &p, int64_t rows);
// hl_loss_plan_get_workspace_sizes on CUDA.
void cuda_workspace_sizes(const hl_loss_plan_st &p, int64_t rows, size_t *min_bytes, size_t *fast_bytes);
// Where the gathered blocks live in a workspace (MIDDLE: the middle step's, after them).
void *cuda_gathered(const hl_loss_plan_st &p, int64_t rows, void *workspace, bool middle = false);
hl_status_t cuda_execute(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                         void *workspace, size_t workspace_bytes, hl_stream_t stream);
// This rank's block (header and records) into device memory.
hl_status_t cuda_stats(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                       void *block, void *workspace, size_t workspace_bytes, hl_stream_t stream);
// Merges the gathered blocks (device memory) and runs the rest of the loss (dense JSD: with the
// middle step's gathered blocks); checks the headers (check_blocks) and labels with one
// synchronisation unless the plan is HL_LOSS_UNCHECKED.
hl_status_t cuda_finish(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                        const void *gathered, const void *gathered_middle, void *workspace,
                        size_t workspace_bytes, hl_stream_t stream);
// Dense JSD's middle step: merges the gathered blocks and writes this rank's block of MidSums.
hl_status_t cuda_middle(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                        const void *gathered, void *middle, void *workspace, size_t workspace_bytes,
                        hl_stream_t stream);
// stats, one in-place ncclAllGather of the blocks in the workspace (dense JSD: middle and a
// second one of its blocks), finish; for the fused linear form then an in-place ncclAllReduce of
// grad_hidden.
hl_status_t nccl_execute(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                         void *comm, void *workspace, size_t workspace_bytes, hl_stream_t stream);
#endif

}  // namespace hl::loss
