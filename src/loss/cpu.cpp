// The loss plan on the CPU: the fp64 reference the CUDA kernels are tested against. Statistics are
// taken directly (max first, then the sums), the row math is row_math.h's, in double. Two passes
// over each row: its statistics (for one shard: the tensor-parallel split's first step), then
// from the merged statistics the losses, metrics and the gradient.
// The fused linear form forms each row's logits in fp64 from hidden and weight, in both passes
// (nothing of rows x vocab is held), and folds the gradient row into grad_hidden and grad_weight.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/scalar.h"
#include "loss.h"
#include "loss/preference.h"

namespace hl::loss {
namespace {

using cpu::load;

// A [rows, cols] matrix of the caller's, read as double.
struct Mat {
  const void *p;
  int64_t stride;
  hl_dtype_t dt;
  double at(int64_t i, int64_t j) const { return load(p, dt, i * stride + j); }
};

// A weight [vocab, cols] in fp64 (read once a call, since every row uses all of it).
std::vector<double> to_f64(const Mat &m, int64_t rows, int64_t cols) {
  std::vector<double> w(size_t(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t k = 0; k < cols; ++k) w[size_t(i * cols + k)] = m.at(i, k);
  return w;
}

// z[j] = sum_k x[i, k] w[j, k] for the shard's rows j of w (fp64).
void matvec(const Mat &x, int64_t i, const std::vector<double> &w, int64_t cols,
            std::vector<double> &xr, std::vector<double> &z) {
  xr.resize(size_t(cols));
  for (int64_t k = 0; k < cols; ++k) xr[size_t(k)] = x.at(i, k);
  for (size_t j = 0; j < z.size(); ++j) {
    const double *wj = w.data() + j * size_t(cols);
    double acc = 0;
    for (int64_t k = 0; k < cols; ++k) acc += xr[size_t(k)] * wj[k];
    z[j] = acc;
  }
}

// The rows of one call: row i's z_hat and teacher / tau_t over this shard's columns (from the
// logits, or from hidden states and weights), and where its gradient goes.
class Rows {
 public:
  Rows(const hl_loss_plan_st &p, const hl_loss_args_t &a, bool grads) : p_(p), a_(a) {
    const hl_loss_plan_desc_t &d = p.desc;
    const int64_t V = d.vocab;
    if (!p.linear) return;
    if (grads && a.grad_weight) dw_.assign(size_t(V * d.hidden), 0.0);
    if (grads && a.grad_bias) db_.assign(size_t(V), 0.0);
    if (a.rows == 0) return;  // weights neither read nor required: grad_weight is the empty sum
    const hl_dtype_t wd = d.weight_dtype;
    w_ = to_f64({a.weight, a.weight_stride, wd}, V, d.hidden);
    if (a.bias) b_ = to_f64({a.bias, V, wd}, 1, V);
    if (d.teacher_hidden && a.teacher_weight)
      wt_ = to_f64({a.teacher_weight, a.teacher_weight_stride, wd}, V, d.teacher_hidden);
  }

  void load_row(int64_t i, std::vector<double> &z, std::vector<double> &v) {
    const Options &o = p_.opt;
    const hl_loss_plan_desc_t &d = p_.desc;
    if (p_.linear) {
      matvec({a_.hidden, a_.hidden_stride, d.weight_dtype}, i, w_, d.hidden, xr_, z);
      for (size_t j = 0; j < b_.size(); ++j) z[j] += b_[j];
    } else
      for (size_t j = 0; j < z.size(); ++j) z[j] = load(a_.logits, d.logits_dtype, i * a_.logits_stride + int64_t(j));
    for (double &x : z) {
      x *= o.scale;
      x = o.cap > 0 ? o.cap * std::tanh(x / o.cap) : x;
    }
    if (v.empty()) return;
    if (p_.linear && d.teacher_hidden)
      matvec({a_.teacher_hidden, a_.teacher_hidden_stride, d.weight_dtype}, i, wt_, d.teacher_hidden, xr_, v);
    else
      for (size_t j = 0; j < v.size(); ++j)
        v[j] = load(a_.teacher_logits, d.logits_dtype, i * a_.teacher_stride + int64_t(j));
    for (double &x : v) x *= o.inv_tt;
  }

  // Row i's gradient w.r.t. its raw logits (this shard's columns): into grad (logits form), or
  // grad_hidden's row i = g W, grad_weight += g^T x_i and grad_bias += g (linear form; the sums
  // stored at finish()).
  void put_grad(int64_t i, const std::vector<double> &g) {
    const hl_loss_plan_desc_t &d = p_.desc;
    if (!p_.linear) {
      for (size_t j = 0; j < g.size(); ++j) store(a_.grad, d.grad_dtype, d.grad_mode, i * a_.grad_stride + int64_t(j), g[j]);
      return;
    }
    const int64_t H = d.hidden;
    for (size_t j = 0; j < db_.size(); ++j) db_[j] += g[j];
    if (a_.grad_hidden) {
      std::vector<double> gh(size_t(H), 0.0);
      for (size_t j = 0; j < g.size(); ++j) {
        const double *wj = w_.data() + j * size_t(H);
        for (int64_t k = 0; k < H; ++k) gh[size_t(k)] += g[j] * wj[k];
      }
      for (int64_t k = 0; k < H; ++k)
        store(a_.grad_hidden, d.grad_hidden_dtype, d.grad_hidden_mode, i * a_.grad_hidden_stride + k, gh[size_t(k)]);
    }
    if (!dw_.empty()) {
      const Mat x{a_.hidden, a_.hidden_stride, d.weight_dtype};
      xr_.resize(size_t(H));
      for (int64_t k = 0; k < H; ++k) xr_[size_t(k)] = x.at(i, k);
      for (size_t j = 0; j < g.size(); ++j)
        for (int64_t k = 0; k < H; ++k) dw_[j * size_t(H) + size_t(k)] += g[j] * xr_[size_t(k)];
    }
  }

  // Stores grad_weight and grad_bias (written whole with WRITE: zeros where no row contributed).
  void finish() {
    const hl_loss_plan_desc_t &d = p_.desc;
    for (size_t j = 0; j < db_.size(); ++j)
      store(a_.grad_bias, d.grad_bias_dtype, d.grad_bias_mode, int64_t(j), db_[j]);
    if (dw_.empty()) return;
    for (int64_t j = 0; j < d.vocab; ++j)
      for (int64_t k = 0; k < d.hidden; ++k)
        store(a_.grad_weight, d.grad_weight_dtype, d.grad_weight_mode, j * a_.grad_weight_stride + k,
              dw_[size_t(j * d.hidden + k)]);
  }

 private:
  static void store(void *dst, hl_dtype_t dt, hl_loss_grad_mode_t mode, int64_t at, double g) {
    if (mode == HL_LOSS_GRAD_ACCUMULATE) g += load(dst, dt, at);
    cpu::store(dst, dt, at, g);
  }

  const hl_loss_plan_st &p_;
  const hl_loss_args_t &a_;
  std::vector<double> w_, wt_, dw_, db_, b_, xr_;
};

// The statistics of one row's shard; label and argmax in shard-local columns, amax reported
// globally (+ first). The student-temperature sums with any distillation, the teacher's with v.
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
  if (o.distill == kDistillNone) return st;
  for (size_t j = 0; j < v.size(); ++j) st.mt = std::max(st.mt, v[j]);
  for (size_t j = 0; j < V; ++j) {
    const double d = z[j] - st.m, es = std::exp(d * o.inv_ts);
    st.ss += es;
    st.bs += es * d;
    if (v.empty()) continue;
    const double dt = v[j] - st.mt, et = std::exp(dt);
    st.st += et;
    st.bt += et * dt;
    st.ct += et * d;
    st.cs += es * dt;
  }
  return st;
}

// Row i's inputs; the label as a global id.
RowInputs<double> row_inputs(const hl_loss_plan_st &p, const hl_loss_args_t &a, int64_t i) {
  return read_inputs<double>(row_source(p, a, nullptr, nullptr), i);
}

// Row i's merged record (its CpuStats).
CpuStats stats_of(const hl_loss_plan_st &p, const char *merged, int64_t i) {
  CpuStats st;
  std::memcpy(&st, merged + size_t(i) * record_bytes(p), sizeof st);
  return st;
}

// Every row's sequence values (SeqValues: seq_lr, seq_roll) and every sequence's sums, from the
// merged statistics and the inputs; cu_seqlens already checked.
void seq_values_of_rows(const hl_loss_plan_st &p, const hl_loss_args_t &a, const char *merged,
                        std::vector<double> &lr, std::vector<double> &roll,
                        std::vector<SeqSums<double>> &sums) {
  lr.assign(size_t(a.rows), 0.0), roll.assign(size_t(a.rows), 0.0);
  sums.assign(size_t(a.num_seqs), SeqSums<double>{0.0, 0.0, 0.0});
  const bool want_lr = p.seq_stats;  // of logp_y - old_logprob (0 without): GSPO, preference
  const bool want_roll = p.opt.rollout_level != HL_LOSS_LEVEL_TOKEN && a.old_logprobs && a.rollout_logprobs;
  const RowSource src = row_source(p, a, nullptr, nullptr);
  const auto bound = [&](int64_t s) { return cpu::load_int(a.cu_seqlens, p.desc.cu_seqlens_dtype, s); };
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t b = bound(s), e = bound(s + 1);
    SeqSums<double> sum{0.0, 0.0, 0.0};
    for (int64_t i = b; i < e; ++i) {
      if (src.labels && read_label(src, i) < 0) continue;
      const double old = a.old_logprobs ? a.old_logprobs[i] : 0.0;
      sum.n += 1.0;
      if (want_lr) sum.lr += label_logp(stats_of(p, merged, i)) - old;
      if (want_roll) sum.roll += old - a.rollout_logprobs[i];
    }
    sums[size_t(s)] = sum;
    double vl = 0.0, vr = 0.0;
    seq_values(sum, p.opt, &vl, &vr);
    for (int64_t i = b; i < e; ++i) lr[size_t(i)] = vl, roll[size_t(i)] = vr;
  }
}

bool has_teacher(const hl_loss_args_t &a) { return a.teacher_logits || a.teacher_hidden; }

// Entry k of row i of a sparse teacher: its id (< 0: padding) and log-prob.
int64_t topk_id(const hl_loss_plan_st &p, const hl_loss_args_t &a, int64_t i, int k, double *lq) {
  *lq = a.teacher_topk_logprobs[i * a.teacher_topk_logprobs_stride + k];
  return cpu::load_int(a.teacher_topk_ids, p.desc.teacher_topk_ids_dtype, i * a.teacher_topk_ids_stride + k);
}

// The column in this shard of entry k of row i of a sparse teacher (-1: padding or another
// shard's id; no subtraction from an id of any value), and its log-prob.
int64_t topk_col(const hl_loss_plan_st &p, const hl_loss_args_t &a, int64_t i, int k, double *lq) {
  const int64_t id = topk_id(p, a, i, k, lq), first = p.desc.vocab_start;
  return id >= first && id - first < p.desc.vocab ? id - first : -1;
}

// A sparse teacher's z_hat at entry k of a record (after its CpuStats).
double topk_z(const char *rec, int k) {
  double z;
  std::memcpy(&z, rec + sizeof(CpuStats) + size_t(k) * sizeof z, sizeof z);
  return z;
}

// A sparse teacher's DistillRow of row i from its merged record (its ids' z_hat) and log-probs.
DistillRow<double> sparse_distill(const hl_loss_plan_st &p, const hl_loss_args_t &a, int64_t i,
                                  const char *merged) {
  const Options &o = p.opt;
  const char *rec = merged + size_t(i) * record_bytes(p);
  const double lse_s = student_lse(stats_of(p, merged, i), o);
  DivSums<double> sum{0, 0, 0, 0};
  for (int k = 0; k < o.topk; ++k) {
    double lq;
    if (topk_id(p, a, i, k, &lq) >= 0)
      sum = add(sum, div_elem(o.divergence, double(o.jsd_beta), topk_z(rec, k) * o.inv_ts - lse_s, lq));
  }
  return sparse_row(o, sum);
}

// The soft-cap's chain factor at z_hat (1 without a cap).
double chain(const Options &o, double z) {
  const double t = o.cap > 0 ? z / o.cap : 0.0;
  return 1.0 - t * t;
}

// The gradient of one row w.r.t. its raw logits, from its z_hat, teacher and coefficients.
template <int DISTILL>
void grad_row(const Options &o, const std::vector<double> &z, const std::vector<double> &v,
              const RowResult<double> &r, int64_t label, std::vector<double> &g) {
  for (size_t j = 0; j < z.size(); ++j) {
    const double vj = DISTILL && DISTILL != kDistillSparse ? v[j] : 0.0;
    double gj = grad_elem<DISTILL>(r, o, z[j], vj, std::exp(z[j] - r.lse), LibMath<double>{});
    if (int64_t(j) == label) gj += r.cy;
    g[j] = gj * chain(o, z[j]);
  }
}

}  // namespace

void cpu_stats(const hl_loss_plan_st &p, const hl_loss_args_t &a, char *out) {
  const int64_t first = p.desc.vocab_start, V = p.desc.vocab;
  Rows rows(p, a, false);
  std::vector<double> z(static_cast<size_t>(V)), v(has_teacher(a) ? z.size() : 0);
  for (int64_t i = 0; i < a.rows; ++i) {
    rows.load_row(i, z, v);
    char *rec = out + size_t(i) * record_bytes(p);
    const CpuStats st = row_stats(z, v, row_inputs(p, a, i).label - first, first, p.opt);
    std::memcpy(rec, &st, sizeof st);
    for (int k = 0; k < p.opt.topk; ++k) {  // the z_hat of the ids in this shard
      double lq;
      const int64_t j = topk_col(p, a, i, k, &lq);
      const double zk = j >= 0 ? z[size_t(j)] : topk_absent<double>();
      std::memcpy(rec + sizeof st + size_t(k) * sizeof zk, &zk, sizeof zk);
    }
  }
}

void cpu_merge(const hl_loss_plan_st &p, int64_t rows, const char *blocks, size_t stride, int ranks,
               char *merged) {
  const size_t rb = record_bytes(p);
  for (int64_t i = 0; i < rows; ++i) {
    char *out = merged + size_t(i) * rb;
    for (int r = 0; r < ranks; ++r) {
      const char *rec = blocks + size_t(r) * stride + size_t(i) * rb;
      if (r == 0) {
        std::memcpy(out, rec, rb);
        continue;
      }
      CpuStats m, s;
      std::memcpy(&m, out, sizeof m), std::memcpy(&s, rec, sizeof s);
      m = merge(m, s, double(p.opt.inv_ts));
      std::memcpy(out, &m, sizeof m);
      for (int k = 0; k < p.opt.topk; ++k) {  // the owner's z_hat (topk_absent elsewhere)
        const double x = std::max(topk_z(out, k), topk_z(rec, k));
        std::memcpy(out + sizeof m + size_t(k) * sizeof x, &x, sizeof x);
      }
    }
  }
}

void cpu_merge_middle(int64_t rows, const char *blocks, size_t stride, int ranks, MidSums<double> *out) {
  for (int64_t i = 0; i < rows; ++i)
    for (int r = 0; r < ranks; ++r) {
      MidSums<double> m;
      std::memcpy(&m, blocks + size_t(r) * stride + size_t(i) * sizeof m, sizeof m);
      out[i] = r == 0 ? m : add(out[i], m);
    }
}

void cpu_middle(const hl_loss_plan_st &p, const hl_loss_args_t &a, const char *merged,
                MidSums<double> *out) {
  const Options &o = p.opt;
  Rows rows(p, a, false);
  std::vector<double> z(size_t(p.desc.vocab)), v(z.size());
  for (int64_t i = 0; i < a.rows; ++i) {
    rows.load_row(i, z, v);
    const CpuStats st = stats_of(p, merged, i);
    const double lse_s = student_lse(st, o), lse_t = teacher_lse(st), its = o.inv_ts;
    MidSums<double> sum{0, 0};
    for (size_t j = 0; j < z.size(); ++j) {
      const DivSums<double> e = div_elem(kDistillJsd, double(o.jsd_beta), z[j] * its - lse_s, v[j] - lse_t);
      sum = add(sum, MidSums<double>{e.loss, e.pa});
    }
    out[i] = sum;
  }
}

hl_status_t cpu_finish(const hl_loss_plan_st &p, const hl_loss_args_t &a, const char *merged,
                       const MidSums<double> *mid) {
  const Options &o = p.opt;
  double W = 0;
  for (int64_t i = 0; i < a.rows; ++i) {
    const RowInputs<double> in = row_inputs(p, a, i);
    if (in.valid) W += in.w;
  }
  const double D = a.divisor > 0 ? a.divisor : W;
  const double kd = D > 0 ? double(a.grad_scale == 0.0f ? 1.0f : a.grad_scale) / D : 0.0;

  const int64_t first = p.desc.vocab_start;
  const bool grads = a.grad || a.grad_hidden || a.grad_weight || a.grad_bias;
  Rows rows(p, a, grads);
  std::vector<double> z(size_t(p.desc.vocab)), v(has_teacher(a) ? z.size() : 0), g(z.size());
  std::vector<double> sum(kRecFields, 0.0), seq_lr, seq_roll, pref_g;
  std::vector<SeqSums<double>> seq_sums;
  if (p.sequences) seq_values_of_rows(p, a, merged, seq_lr, seq_roll, seq_sums);
  float pref_out[kPrefScalars];
  double pref_loss = 0.0;
  if (p.pref.kind >= 0) cpu_preference(p, a, seq_sums, pref_g, pref_out, &pref_loss);
  double rmin = INFINITY, rmax = -INFINITY, amin = INFINITY, amax = -INFINITY;
  // Dense JSD's sums come from the middle step, a sparse teacher's from its ids' z_hat.
  const bool two_pass = o.distill == kDistillJsd || o.distill == kDistillSparse;
  for (int64_t i = 0; i < a.rows; ++i) {
    RowInputs<double> in = row_inputs(p, a, i);
    if (p.sequences) in.seq_lr = seq_lr[size_t(i)], in.seq_roll = seq_roll[size_t(i)];
    if (!pref_g.empty()) in.seq_g = pref_g[size_t(i)];
    if (grads) rows.load_row(i, z, v);
    const CpuStats st = stats_of(p, merged, i);
    const DistillRow<double> dx = o.distill == kDistillJsd ? dense_row(mid[i])
                                  : o.topk ? sparse_distill(p, a, i, merged) : DistillRow<double>{};
    const RowResult<double> r = finish_row(st, in, o, kd, two_pass ? &dx : nullptr);
    if (grads) {
      const int64_t label = in.label - first;  // outside [0, vocab) when another shard owns it
      switch (o.distill) {
        case kDistillFwd: grad_row<kDistillFwd>(o, z, v, r, label, g); break;
        case kDistillRev: grad_row<kDistillRev>(o, z, v, r, label, g); break;
        case kDistillJsd: grad_row<kDistillJsd>(o, z, v, r, label, g); break;
        case kDistillSparse: grad_row<kDistillSparse>(o, z, v, r, label, g); break;
        default: grad_row<kDistillNone>(o, z, v, r, label, g);
      }
      for (int k = 0; k < o.topk; ++k) {  // a sparse teacher's ids in this shard: their own a_k
        double lq;
        const int64_t j = topk_col(p, a, i, k, &lq);
        if (j >= 0)
          g[size_t(j)] += topk_correction(r, o, z[size_t(j)], lq) * chain(o, z[size_t(j)]);
      }
      rows.put_grad(i, g);
    }
    if (a.token_loss) a.token_loss[i] = float(r.token_loss);
    if (a.token_logp) a.token_logp[i] = float(r.logp);
    if (a.token_entropy) a.token_entropy[i] = float(r.entropy);
    if (a.token_lse) a.token_lse[i] = float(r.lse);
    if (a.token_argmax) a.token_argmax[i] = r.argmax;
    const double w = r.rec[R_W];
    for (int k = 0; k < kRecFields; ++k) sum[size_t(k)] += (k == R_W || k == R_VALID) ? r.rec[k] : w * r.rec[k];
    if (w > 0) {
      rmin = std::min(rmin, r.rec[R_RATIO]), rmax = std::max(rmax, r.rec[R_RATIO]);
      amin = std::min(amin, r.rec[R_ADV]), amax = std::max(amax, r.rec[R_ADV]);
    }
  }
  rows.finish();
  if (a.scalars)
    finish_scalars<double>(sum.data(), rmin, rmax, amin, amax, D, a.labels && a.old_logprobs,
                           a.advantages != nullptr, o.terms, o.scalars, a.scalars);
  if (a.scalars && p.pref.kind >= 0) pref_store(pref_out, float(pref_loss), o.scalars, a.scalars);
  return HL_STATUS_SUCCESS;
}

hl_status_t cpu_execute(const hl_loss_plan_st &p, const hl_loss_args_t &a) {
  std::vector<char> st(size_t(a.rows) * record_bytes(p));
  cpu_stats(p, a, st.data());
  std::vector<MidSums<double>> mid(p.opt.distill == kDistillJsd ? size_t(a.rows) : 0);
  if (!mid.empty()) cpu_middle(p, a, st.data(), mid.data());
  return cpu_finish(p, a, st.data(), mid.data());
}

}  // namespace hl::loss
