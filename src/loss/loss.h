// The loss plan object and its backends. Descriptors and arguments reach the backends validated,
// with defaults and strides resolved.
#pragma once

#include <cstdint>

#include "headloss.h"
#include "row_math.h"

namespace hl::loss {

// How the CUDA backend runs a plan, chosen once at plan creation.
struct CudaChoice {
  const void *kernel = nullptr;  // the specialised instantiation
  int cluster = 1;               // CTAs sharing one row through distributed shared memory
  int threads = 0;
  int grid = 0;                  // CTAs of the persistent grid (a multiple of cluster)
  size_t smem = 0;               // dynamic shared memory per CTA: its slice of the row
  bool keep_row = false;         // the slice stays in shared memory between the two passes
};

}  // namespace hl::loss

struct hl_loss_plan_st {
  hl_loss_plan_desc_t desc;  // validated; grad_dtype and vocab_global resolved
  hl::loss::Options opt;     // opt.vocab is the global vocabulary
  bool needs_labels;         // CE, GRPO or GRPO_KL_REF is on
  uint64_t fingerprint;      // of every field the ranks of a sharded plan must share
  hl::loss::CudaChoice cuda;
};

namespace hl::loss {

// The header of one rank's block of statistics (see hl_loss_plan_execute_stats).
struct BlockHeader {
  uint64_t tag, fingerprint;
  int64_t rows, vocab_start, vocab, vocab_global, record_bytes, zero;
};
static_assert(sizeof(BlockHeader) == 64, "the header is documented as 64 bytes");
constexpr uint64_t kBlockTag = 0x31534c48u;  // "HLS1"

using CpuStats = RowStats<double>;

// Every row at once (one shard that is the whole vocabulary).
hl_status_t cpu_execute(const hl_loss_plan_st &p, const hl_loss_args_t &a);
// The statistics of every row over this shard's columns.
void cpu_stats(const hl_loss_plan_st &p, const hl_loss_args_t &a, CpuStats *out);
// Losses, metrics, per-token outputs and this shard's gradient from every row's merged statistics.
hl_status_t cpu_finish(const hl_loss_plan_st &p, const hl_loss_args_t &a, const CpuStats *merged);

#if HL_HAVE_CUDA
hl_status_t cuda_plan(const char *fn, hl_loss_plan_st &p);
size_t cuda_workspace_bytes(const hl_loss_plan_st &p, int64_t rows);
hl_status_t cuda_execute(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                         void *workspace, hl_stream_t stream);
#endif

}  // namespace hl::loss
