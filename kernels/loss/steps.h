// The loss plan's CUDA steps, shared by the logits form (launch.cu) and the fused linear form
// (linear.cu), which runs a call's rows in chunks between rows_begin and rows_end. Internal to
// kernels/loss/ (launch.h is what src/ calls).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "hl/loss/plan.h"

namespace hl::loss::dev {

// The prep kernel's output, the counters, the per-row records and the reduce kernel's partials
// (sums.cuh), then room for `ranks` gathered blocks (hl_loss_plan_execute_nccl): the logits form's
// workspace, and the start of the fused linear form's.
size_t cuda_base_workspace(const hl_loss_plan_st &p, int64_t rows);
// Where the gathered blocks live in a workspace (MIDDLE: the middle step's, after them).
void *cuda_gathered(const hl_loss_plan_st &p, int64_t rows, void *workspace, bool middle = false);

// The gathered blocks a phase reads (device memory): the statistics (kFinish, kMiddle), and dense
// JSD's middle sums (its kFinish).
struct Gathered {
  const void *stats = nullptr, *middle = nullptr;
};

// The prep kernel over all of a call's rows (a.rows > 0): D and zeroed counters, and the rows'
// sequence values where the plan has sequences; then, unless the plan is unchecked, one
// synchronisation that checks the labels, cu_seqlens and the gathered blocks' headers.
hl_status_t rows_begin(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                       Gathered gathered, void *workspace, cudaStream_t stream);
// The row kernel of `phase` over rows [row0, row0 + a.rows) of a call of `total` rows, whose
// per-row pointers in `a` are already those rows'. block: kStats' and kMiddle's output; gathered:
// kFinish's and kMiddle's input (every row's). after_prep: the prep kernel ran just before (it
// zeroed the counters, and the row kernel may start early).
hl_status_t rows_run(const hl_loss_plan_st &p, const hl_loss_args_t &a, Phase phase, int64_t row0,
                     int64_t total, Gathered gathered, void *block, void *workspace,
                     cudaStream_t stream, bool after_prep);
// The reduce kernel: the scalars from the records of all of a call's rows (when a.scalars).
hl_status_t rows_end(const hl_loss_plan_st &p, const hl_loss_args_t &a, void *workspace,
                     cudaStream_t stream);
// The workspace's sequence area: seq_lr [rows], seq_roll [rows]; with a preference term then
// seq_g [rows], each sequence's SeqSums and dL/dv (num_seqs <= rows), and the term's results
// (kPrefScalars scalars, then its share of the loss).
struct SeqArea {
  float *lr, *roll, *g;
  SeqSums<float> *sums;
  float *dv, *results;
};
inline size_t seq_area_floats(const hl_loss_plan_st &p, int64_t rows) {
  const size_t n = size_t(rows);
  return p.pref.kind < 0 ? 2 * n : 7 * n + kPrefScalars + 1;
}
inline SeqArea seq_area(const hl_loss_plan_st &p, int64_t rows, float *base) {
  const size_t n = size_t(rows);
  if (p.pref.kind < 0) return {base, base + n, nullptr, nullptr, nullptr, nullptr};
  return {base, base + n, base + 2 * n, reinterpret_cast<SeqSums<float> *>(base + 3 * n), base + 6 * n,
          base + 7 * n};
}
// The rows' sequence values (SeqValues) into `area` from the inputs and, for GSPO and a preference
// term, the gathered blocks (seq.cu); a preference term's gradients and results too (preference.cu).
hl_status_t seq_run(const hl_loss_plan_st &p, const hl_loss_args_t &a, const void *gathered,
                    const SeqArea &area, cudaStream_t stream);
hl_status_t pref_run(const hl_loss_plan_st &p, const hl_loss_args_t &a, const SeqArea &area,
                     cudaStream_t stream);
// After the reduce kernel: the term's scalars into a.scalars, its share added to the loss.
hl_status_t pref_store_scalars(const hl_loss_plan_st &p, const hl_loss_args_t &a, const SeqArea &area,
                               cudaStream_t stream);
hl_status_t zero_scalars(const hl_loss_plan_st &p, const hl_loss_args_t &a, cudaStream_t stream);
// The row kernel's arguments for rows [row0, row0 + a.rows) of a call of `total` rows, without a
// launch's specialisation: the per-row inputs and outputs, the records, D and the phase's blocks
// (as rows_run's), for kernels that finish rows from statistics of their own (shifted.cu).
struct Params;
Params row_params(const hl_loss_plan_st &p, const hl_loss_args_t &a, void *workspace, int64_t row0,
                  int64_t total, Phase phase, Gathered gathered, void *block);

// The fused linear form (linear.cu).
void linear_workspace(const hl_loss_plan_st &p, int64_t rows, size_t *min_bytes, size_t *fast_bytes);
hl_status_t linear_run(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                       Phase phase, void *block, Gathered gathered, void *workspace,
                       size_t workspace_bytes, cudaStream_t stream);

}  // namespace hl::loss::dev
