// The loss plan's CPU backend (the plan itself, its block format and the checks both backends share
// are hl/loss/plan.h's; the CUDA backend is reached through kernels/loss/launch.h). Descriptors and
// arguments reach the backends validated, with defaults and strides resolved.
#pragma once

#include <cstdint>

#include "headloss.h"
#include "hl/loss/plan.h"

namespace hl::loss {

using CpuStats = RowStats<double>;

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

}  // namespace hl::loss
