// What the loss plan's kernels take, shared by the launcher and the row kernel.
#pragma once

#include <cstdint>

#include "hl/loss/plan.h"
#include "loss/config.h"

namespace hl::loss::dev {

// The workspace's counters: the row kernel's (kMaxCluster), then the reduce kernel's ticket.
constexpr int kTicket = kMaxCluster, kCounters = kTicket + 1;
constexpr float kLog2e = 1.4426950408889634f;

// The prep kernel's output, at the start of the workspace.
struct PrepOut {
  float kd, D;        // grad_scale / D (0 when D == 0), D
  long long bad;      // the first row whose label is out of range (LLONG_MAX: none)
  long long bad_topk; // the first row of a sparse teacher with a bad entry (LLONG_MAX: none)
};

struct Params {
  const void *logits, *teacher;
  void *grad;
  int64_t logits_stride, teacher_stride, grad_stride;
  RowSource src;  // labels, weights, log-probs and sequence values
  // A sparse teacher (o.topk > 0): [rows, k] ids (I64 or I32) and log-probs, row strides.
  const void *topk_ids;
  const float *topk_lp;
  int64_t topk_ids_stride, topk_lp_stride;
  bool topk_ids64;
  float *tok_loss, *tok_logp, *tok_entropy, *tok_lse;
  int64_t *tok_argmax;
  PrepOut *prep;
  // kCounters counters the prep kernel zeroes: the next row to hand out, one per cluster rank
  // (the split's finish: each rank's CTAs take rows alone), then the reduce kernel's ticket.
  unsigned *counters;
  float *records;  // with scalars (else null): the rows' records for the reduce kernel (sums.cuh)
  bool has_ratio, has_adv;
  int64_t rows, vocab;
  int64_t slice;       // columns per CTA, a multiple of the vector width
  Options o;
  bool grad_f32, accumulate, keep_row;
  // Tensor parallelism: the shard's first global column (labels and the argmax are global ids);
  // kStats: this rank's block and its header (kMiddle: its middle block); kFinish and kMiddle:
  // the ranks' gathered blocks; kFinish of dense JSD: their gathered middle blocks too.
  int64_t col0;
  char *block;
  int64_t header[8];
  const char *gathered, *gathered_middle;
  int64_t block_bytes, middle_block_bytes;
  int64_t record_bytes;  // a sparse teacher's (its k logits after the RowStats)
  int ranks;
  // The fused linear form runs a call's rows in chunks: row r of a chunk is row row0 + r of the
  // call's blocks (the other per-row pointers are the chunk's own).
  int64_t row0;
};

// The row kernel for a phase (Phase) and a plan's features; one explicit instantiation per
// logits dtype (rows_*.cu).
template <class T>
const void *pick_row_kernel(int phase, bool grad, bool cap, int distill);  // null: no such kernel
template <class T>
const void *pick_bulk_kernel(int phase, bool grad, bool cap, int distill);

}  // namespace hl::loss::dev
