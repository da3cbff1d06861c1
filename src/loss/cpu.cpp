// The loss plan on the CPU: the fp64 reference the CUDA kernels are tested against. Statistics are
// taken directly (max first, then the sums), the row math is row_math.h's, in double. Two passes
// over each row: its statistics (for one shard: the tensor-parallel split's first step), then
// from the merged statistics the losses, metrics and the gradient.
#include <algorithm>
#include <cmath>
#include <vector>

#include "../cpu/scalar.h"
#include "loss.h"

namespace hl::loss {
namespace {

using cpu::load;

// Row i's z_hat over this shard's columns, and teacher / tau_t (when there is a teacher).
void load_row(const hl_loss_plan_st &p, const hl_loss_args_t &a, int64_t i, std::vector<double> &z,
              std::vector<double> &v) {
  const Options &o = p.opt;
  const hl_loss_plan_desc_t &d = p.desc;
  for (size_t j = 0; j < z.size(); ++j) {
    const double x = o.scale * load(a.logits, d.logits_dtype, i * a.logits_stride + int64_t(j));
    z[j] = o.cap > 0 ? o.cap * std::tanh(x / o.cap) : x;
  }
  for (size_t j = 0; j < v.size(); ++j)
    v[j] = o.inv_tt * load(a.teacher_logits, d.logits_dtype, i * a.teacher_stride + int64_t(j));
}

// The statistics of one row's shard; label and argmax in shard-local columns, amax reported
// globally (+ first).
CpuStats row_stats(const std::vector<double> &z, const std::vector<double> &v, int64_t label,
                int64_t first, const Options &o) {
  CpuStats st = empty_stats<double>();
  const size_t V = z.size();
  for (size_t j = 0; j < V; ++j)
    if (z[j] > st.m) st.m = z[j], st.amax = first + int64_t(j);
  for (size_t j = 0; j < V; ++j) {
    const double d = z[j] - st.m, e = std::exp(d);
    st.s += e;
    st.b += e * d;
    st.sum += z[j];
  }
  if (label >= 0 && label < int64_t(V)) st.zy = z[size_t(label)];
  if (v.empty()) return st;
  for (size_t j = 0; j < V; ++j) st.mt = std::max(st.mt, v[j]);
  for (size_t j = 0; j < V; ++j) {
    const double d = z[j] - st.m, dt = v[j] - st.mt, et = std::exp(dt), es = std::exp(d * o.inv_ts);
    st.st += et;
    st.bt += et * dt;
    st.ct += et * d;
    st.ss += es;
    st.bs += es * d;
    st.cs += es * dt;
  }
  return st;
}

// Row i's inputs; the label as a global id.
RowInputs<double> row_inputs(const hl_loss_plan_st &p, const hl_loss_args_t &a, int64_t i) {
  const hl_loss_plan_desc_t &d = p.desc;
  return read_inputs<double>(a.labels, d.labels_dtype == HL_DTYPE_I64, a.weights, a.advantages,
                             a.old_logprobs, a.ref_logprobs, i, d.use_ignore_index != 0,
                             d.ignore_index);
}

template <int DISTILL>
void write_grad(const hl_loss_plan_st &p, const hl_loss_args_t &a, int64_t i,
                const std::vector<double> &z, const std::vector<double> &v,
                const RowResult<double> &r, int64_t label) {
  const Options &o = p.opt;
  const hl_dtype_t gdt = p.desc.grad_dtype;
  const auto ex = [](double x) { return std::exp(x); };
  for (size_t j = 0; j < z.size(); ++j) {
    double g = grad_elem<DISTILL>(r, o, z[j], DISTILL ? v[j] : 0.0, std::exp(z[j] - r.lse), ex);
    if (int64_t(j) == label) g += r.cy;
    if (o.cap > 0) {
      const double t = z[j] / o.cap;
      g *= 1.0 - t * t;
    }
    const int64_t at = i * a.grad_stride + int64_t(j);
    if (p.desc.grad_mode == HL_LOSS_GRAD_ACCUMULATE) g += load(a.grad, gdt, at);
    cpu::store(a.grad, gdt, at, g);
  }
}

}  // namespace

void cpu_stats(const hl_loss_plan_st &p, const hl_loss_args_t &a, CpuStats *out) {
  const int64_t first = p.desc.vocab_start;
  std::vector<double> z(size_t(p.desc.vocab)), v(a.teacher_logits ? z.size() : 0);
  for (int64_t i = 0; i < a.rows; ++i) {
    load_row(p, a, i, z, v);
    out[i] = row_stats(z, v, row_inputs(p, a, i).label - first, first, p.opt);
  }
}

hl_status_t cpu_finish(const hl_loss_plan_st &p, const hl_loss_args_t &a, const CpuStats *merged) {
  const Options &o = p.opt;
  double W = 0;
  for (int64_t i = 0; i < a.rows; ++i) {
    const RowInputs<double> in = row_inputs(p, a, i);
    if (in.valid) W += in.w;
  }
  const double D = a.divisor > 0 ? a.divisor : W;
  const double kd = D > 0 ? double(a.grad_scale == 0.0f ? 1.0f : a.grad_scale) / D : 0.0;

  const int64_t first = p.desc.vocab_start;
  std::vector<double> z(size_t(p.desc.vocab)), v(a.teacher_logits ? z.size() : 0), sum(kRecFields, 0.0);
  double rmin = INFINITY, rmax = -INFINITY, amin = INFINITY, amax = -INFINITY;
  for (int64_t i = 0; i < a.rows; ++i) {
    const RowInputs<double> in = row_inputs(p, a, i);
    const RowResult<double> r = finish_row(merged[i], in, o, kd);
    if (a.grad) {
      load_row(p, a, i, z, v);
      const int64_t label = in.label - first;  // outside [0, vocab) when another shard owns it
      if (o.distill == kDistillFwd) write_grad<kDistillFwd>(p, a, i, z, v, r, label);
      else if (o.distill == kDistillRev) write_grad<kDistillRev>(p, a, i, z, v, r, label);
      else write_grad<kDistillNone>(p, a, i, z, v, r, label);
    }
    if (a.token_loss) a.token_loss[i] = float(r.token_loss);
    if (a.token_logp) a.token_logp[i] = float(r.logp);
    if (a.token_entropy) a.token_entropy[i] = float(r.entropy);
    if (a.token_lse) a.token_lse[i] = float(r.lse);
    const double w = r.rec[R_W];
    for (int k = 0; k < kRecFields; ++k) sum[size_t(k)] += (k == R_W || k == R_VALID) ? r.rec[k] : w * r.rec[k];
    if (w > 0) {
      rmin = std::min(rmin, r.rec[R_RATIO]), rmax = std::max(rmax, r.rec[R_RATIO]);
      amin = std::min(amin, r.rec[R_ADV]), amax = std::max(amax, r.rec[R_ADV]);
    }
  }
  if (a.scalars)
    finish_scalars<double>(sum.data(), rmin, rmax, amin, amax, D, a.labels && a.old_logprobs,
                           a.advantages != nullptr, o.terms, a.scalars);
  return HL_STATUS_SUCCESS;
}

hl_status_t cpu_execute(const hl_loss_plan_st &p, const hl_loss_args_t &a) {
  std::vector<CpuStats> st(size_t(a.rows));
  cpu_stats(p, a, st.data());
  return cpu_finish(p, a, st.data());
}

}  // namespace hl::loss
