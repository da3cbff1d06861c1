// The loss plan on the CPU: the fp64 reference the CUDA kernels are tested against. Statistics are
// taken directly (max first, then the sums), the row math is row_math.h's, in double.
#include <vector>

#include "../cpu/scalar.h"
#include "loss.h"

namespace hl::loss {
namespace {

using cpu::load;
using Stats = RowStats<double>;

// z_hat of row i, and the row's statistics (teacher ones when v is non-empty).
Stats row_stats(const std::vector<double> &z, const std::vector<double> &v, int64_t label,
                const Options &o) {
  Stats st = empty_stats<double>();
  const size_t V = z.size();
  for (size_t j = 0; j < V; ++j)
    if (z[j] > st.m) st.m = z[j], st.amax = int64_t(j);
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

hl_status_t cpu_execute(const hl_loss_plan_st &p, const hl_loss_args_t &a) {
  const Options &o = p.opt;
  const hl_loss_plan_desc_t &d = p.desc;
  const bool l64 = d.labels_dtype == HL_DTYPE_I64;
  const auto inputs = [&](int64_t i) {
    return read_inputs<double>(a.labels, l64, a.weights, a.advantages, a.old_logprobs,
                               a.ref_logprobs, i, d.use_ignore_index != 0, d.ignore_index);
  };
  double W = 0;
  for (int64_t i = 0; i < a.rows; ++i) {
    const RowInputs<double> in = inputs(i);
    if (in.valid) W += in.w;
  }
  const double D = a.divisor > 0 ? a.divisor : W;
  const double kd = D > 0 ? double(a.grad_scale == 0.0f ? 1.0f : a.grad_scale) / D : 0.0;

  const size_t V = size_t(d.vocab);
  std::vector<double> z(V), v(a.teacher_logits ? V : 0), sum(kRecFields, 0.0);
  double rmin = INFINITY, rmax = -INFINITY, amin = INFINITY, amax = -INFINITY;
  for (int64_t i = 0; i < a.rows; ++i) {
    for (size_t j = 0; j < V; ++j) {
      const double x = o.scale * load(a.logits, d.logits_dtype, i * a.logits_stride + int64_t(j));
      z[j] = o.cap > 0 ? o.cap * std::tanh(x / o.cap) : x;
    }
    for (size_t j = 0; j < v.size(); ++j)
      v[j] = o.inv_tt * load(a.teacher_logits, d.logits_dtype, i * a.teacher_stride + int64_t(j));
    const RowInputs<double> in = inputs(i);
    const RowResult<double> r = finish_row(row_stats(z, v, in.label, o), in, o, kd);
    if (a.grad) {
      if (o.distill == kDistillFwd) write_grad<kDistillFwd>(p, a, i, z, v, r, in.label);
      else if (o.distill == kDistillRev) write_grad<kDistillRev>(p, a, i, z, v, r, in.label);
      else write_grad<kDistillNone>(p, a, i, z, v, r, in.label);
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

}  // namespace hl::loss
