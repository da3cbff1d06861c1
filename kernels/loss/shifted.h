// The fused linear form's shifted path (sm_90a): for plans whose logits gradient is
// G = p cp + [v = y] cy (no entropy term or entropy gradient, label smoothing, soft cap or
// distillation), the first product stores E = exp(z_hat - shift_r) with its tile statistics
// (shifted_logits_sm90.cuh), a per-row kernel finishes the loss from those statistics and patches
// E's label elements, and the
// other two products run on E: grad_hidden = alpha (E W), grad_weight (+)= E^T (alpha X), with
// alpha_r = cp exp(shift_r - lse_r). No pass over the logits between the products.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "hl/loss/plan.h"
#include "loss/gemm.h"
#include "loss/steps.h"

namespace hl::loss::dev {

// Whether the plan's terms and options have the shifted path's gradient form (and the library
// holds its kernel); HEADLOSS_LINEAR_PATH=rows turns it off (tests, A/B timing). Read when a plan is
// created (CudaPlan::shifted, cuda_plan.h).
bool shifted_plan(const hl_loss_plan_st &p);
// Whether this call can take it: no bias and no grad_bias, a 9.0 device, hidden and weight 16-byte
// aligned with row strides of multiples of 8 elements.
bool shifted_call(const hl_loss_args_t &a);
// The workspace a chunk row takes beyond its logits, and the slack of its buffers' alignment.
size_t shifted_row_bytes(const hl_loss_plan_st &p);
constexpr size_t kShiftedSlack = 6 * 256;

// A chunk's buffers in the workspace (each 256-byte aligned, for `chunk` rows).
struct ShiftedBuffers {
  void *e;        // [chunk][lde] weight dtype: E, where the logits chunk lives
  int64_t lde;
  void *stats;    // [chunk][tiles of 256 columns] TileStats
  void *xs;       // [chunk][H] weight dtype: alpha X
  float *d32;     // [chunk][H]: E W before alpha, over stats and xs (spent by then)
  float *shift, *alpha;
  unsigned char *redo;  // a flag a 128-row block
};
// Carves the buffers for `chunk` rows out of the workspace from byte offset `at` on (at most
// chunk shifted_row_bytes + kShiftedSlack bytes).
void shifted_buffers(const hl_loss_plan_st &p, int64_t chunk, char *workspace, size_t at, ShiftedBuffers *b);

// Rows [i0, i0 + c.rows) of a call of `total` rows (c: the chunk's arguments, per-row pointers
// already offset; x: its hidden rows) in `phase`: kWhole; kStats, the rows' records into this rank's
// block (no products); kFinish, from the ranks' gathered blocks. form: run the first product (not where
// a finish reuses its statistics step's E, statistics and shifts, all rows kept in the workspace, or
// forms no gradient).
// grad_hidden / grad_weight: where the chunk's products go (null: none); accumulate_weight:
// grad_weight += (a later chunk, or ACCUMULATE).
hl_status_t shifted_chunk(const char *fn, const hl_loss_plan_st &p, Gemms &g, const hl_loss_args_t &c,
                          const void *x, int64_t i0, int64_t total, Phase phase, bool form, Gathered gathered,
                          void *block, void *grad_hidden, void *grad_weight, bool accumulate_weight,
                          const ShiftedBuffers &b, GemmSpace gemm_ws, void *workspace, cudaStream_t stream);

}  // namespace hl::loss::dev
