// What the loss plan's kernels take, shared by the launcher and the row kernel.
#pragma once

#include <cstdint>

#include "loss/row_math.h"

namespace hl::loss::cuda {

constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

struct Params {
  const void *logits, *teacher, *labels;
  void *grad;
  int64_t logits_stride, teacher_stride, grad_stride;
  const float *weights, *adv, *old_logp, *ref_logp;
  float *tok_loss, *tok_logp, *tok_entropy, *tok_lse;
  float *records;      // [kRecFields][rows]
  const float *prep;   // the prep kernel's output: grad_scale / D, D
  int64_t rows, vocab;
  int64_t slice;       // columns per CTA, a multiple of the vector width
  Options o;
  int64_t ignore_index;
  bool labels64, use_ignore, grad_f32, accumulate, keep_row;
};

// The row kernel for a plan's features; one explicit instantiation per logits dtype (rows_*.cu).
template <class T>
const void *pick_row_kernel(bool grad, bool cap, int distill);

}  // namespace hl::loss::cuda
