// The preference term's host side (preference.cpp): its options' validation at plan creation, a
// call's per-sequence arguments, and the CPU backend's step from the sequences' sums to each row's
// upstream gradient and the term's scalars (the math is hl/loss/preference.h's).
#pragma once

#include <vector>

#include "headloss.h"
#include "hl/loss/plan.h"

namespace hl::loss {

// The descriptor's preference fields (all off without HL_LOSS_PREFERENCE) into *o, defaults
// resolved.
hl_status_t validate_preference_desc(const char *fn, const hl_loss_plan_desc_t &d, PrefOptions *o);
// A call's ref_seq_logprobs and kto_labels against the plan; OUTPUTS: the phase writes the loss
// (the statistics step needs neither).
hl_status_t check_preference_args(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                                  bool outputs);
// From every sequence's sums (SeqSums::lr: the sum of its tokens' logp): each row's seq_g
// (RowInputs) into row_g, the term's scalars into out and its share of the loss into *loss.
void cpu_preference(const hl_loss_plan_st &p, const hl_loss_args_t &a,
                    const std::vector<SeqSums<double>> &sums, std::vector<double> &row_g,
                    float out[kPrefScalars], double *loss);

}  // namespace hl::loss
