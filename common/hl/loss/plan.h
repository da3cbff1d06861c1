// The loss plan as both backends read it: the validated description (src/loss/api.cpp makes it at
// hl_loss_plan_create), the phases of a call, the format of the statistics blocks that ranks
// exchange, and the host checks whose messages both backends give. The CUDA launch state sits behind
// an opaque pointer (hl_loss_plan_st::cuda), made and released by the CUDA side
// (kernels/loss/launch.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "headloss.h"
#include "hl/loss/preference.h"
#include "hl/loss/row_math.h"

namespace hl::loss {

// Which call runs: the whole loss, or a step of the split (tensor-parallel) execution. The
// statistics step reads logits, labels and teacher logits only; the middle step (dense JSD's second
// exchange) writes each row's sums over this shard once the merged statistics are known.
enum Phase : int { kWhole = 0, kStats = 1, kFinish = 2, kMiddle = 3, kPhases = 4 };
// The phases that write the call's outputs (and so need every input of the terms).
inline bool writes_outputs(Phase ph) { return ph == kWhole || ph == kFinish; }

namespace dev {
struct CudaPlan;  // how the CUDA backend runs the plan (kernels/loss/cuda_plan.h)
}
// Releases a plan's CUDA state (through kernels/loss/launch.h: the type is the CUDA side's).
struct CudaPlanDeleter {
  void operator()(dev::CudaPlan *state) const;
};

}  // namespace hl::loss

struct hl_loss_plan_st {
  hl_loss_plan_desc_t desc;  // validated; dtypes, vocab_global and ranks resolved
  hl::loss::Options opt;     // opt.vocab is the global vocabulary
  bool needs_labels;         // CE, GRPO, CISPO or GRPO_KL_REF is on
  bool linear;               // the fused linear form (desc.hidden > 0)
  bool dlogits;              // a gradient w.r.t. the logits is formed (stored, or multiplied on)
  bool sequences;            // calls pass cu_seqlens: rows read their sequence's values (SeqValues)
  bool seq_stats;            // those values need every row's statistics first (GSPO, preference):
                             // a call runs as its statistics step, then its finish
  hl::loss::PrefOptions pref; // the preference term's options (kind -1: none)
  int exchanges;             // of the split: 1, or 2 with a middle step (dense JSD on a shard)
  uint64_t fingerprint;      // of every field the ranks of a sharded plan must share
  // A CUDA plan's kernels, launch shapes and cuBLASLt state, chosen once (cuda_plan); null on the CPU.
  std::unique_ptr<hl::loss::dev::CudaPlan, hl::loss::CudaPlanDeleter> cuda;
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

// A call's per-row pointers; seq_lr / seq_roll / seq_g: its rows' sequence values, where the plan
// has them.
inline RowSource row_source(const hl_loss_plan_st &p, const hl_loss_args_t &a, const float *seq_lr,
                            const float *seq_roll, const float *seq_g = nullptr) {
  const hl_loss_plan_desc_t &d = p.desc;
  return RowSource{a.labels, a.weights, a.advantages, a.old_logprobs, a.ref_logprobs,
                   a.rollout_logprobs, seq_lr, seq_roll, d.labels_dtype == HL_DTYPE_I64,
                   d.use_ignore_index != 0, d.ignore_index, a.grad_token_logp, a.grad_token_entropy,
                   a.grad_token_lse, seq_g};
}

// The block format and the host checks below are defined in src/loss/api.cpp.
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

// cu_seqlens as read from host memory (num_seqs + 1 values): starts at 0, non-decreasing, ends at
// rows.
hl_status_t check_seqlens(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                          const void *host_cu);

}  // namespace hl::loss
