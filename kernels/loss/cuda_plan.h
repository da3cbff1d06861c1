// A CUDA plan's launch state: what hl_loss_plan_st::cuda points to (hl/loss/plan.h declares the type
// only, so that src/ never sees it). Chosen once, at plan creation (cuda_plan, launch.cu).
#pragma once

#include <cstddef>
#include <memory>

#include "hl/loss/plan.h"
#include "loss/gemm.h"

namespace hl::loss::dev {

// How the CUDA backend runs one phase of a plan.
struct CudaLaunch {
  const void *kernel = nullptr;  // the specialised instantiation
  int cluster = 1;               // CTAs sharing one row through distributed shared memory
  int grid = 0;                  // CTAs of the persistent grid (a multiple of cluster)
  size_t smem = 0;               // dynamic shared memory per CTA: its slice of the row
  bool keep_row = false;         // the slice stays in shared memory between the two passes
};
struct CudaPlan {
  CudaLaunch phase[kPhases];  // by Phase
  CudaLaunch bulk[kPhases];   // the same through bulk copies (sm_90, aligned rows); kernel null if none
  int small_cluster = 1;  // the most CTAs of the prep kernel (one cluster)
  bool early_start = false;  // the row kernel may overlap the prep kernel (sm_90)
  bool shifted = false;      // the fused linear form's shifted path (shifted.h), chosen once
  std::shared_ptr<Gemms> gemms;  // the fused linear form's cuBLASLt state (gemm.h)
};

}  // namespace hl::loss::dev
