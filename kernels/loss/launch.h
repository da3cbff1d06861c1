// The loss plan's CUDA backend as src/ sees it: the only header of kernels/loss/ that src/ includes
// (CMake gives the host library this file alone). Plain C++ on the validated plan and arguments
// (hl/loss/plan.h): no CUDA type crosses here. Defined in launch.cu and nccl.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include "headloss.h"
#include "hl/loss/plan.h"

namespace hl::loss {

// Chooses the plan's kernels and launch shapes (and for the fused linear form makes its cuBLASLt
// state) into p.cuda.
hl_status_t cuda_plan(const char *fn, hl_loss_plan_st &p);
// Releases what cuda_plan made (CudaPlanDeleter, src/loss/api.cpp).
void cuda_plan_destroy(dev::CudaPlan *state);
// hl_loss_plan_get_workspace_sizes on CUDA.
void cuda_workspace_sizes(const hl_loss_plan_st &p, int64_t rows, size_t *min_bytes, size_t *fast_bytes);
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
// grad_hidden (nccl.cpp).
hl_status_t nccl_execute(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                         void *comm, void *workspace, size_t workspace_bytes, hl_stream_t stream);

}  // namespace hl::loss
