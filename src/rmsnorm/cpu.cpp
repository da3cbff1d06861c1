// RMSNorm on the CPU: the fp64 reference that the CUDA kernels are tested against. Rounding
// happens exactly where the casting mode puts it, so the GPU results match it to a few ulps.
#include <cmath>
#include <vector>

#include "cpu/scalar.h"
#include "rmsnorm.h"

namespace hl::rmsnorm {
using cpu::load;
using cpu::round_to;
using cpu::store;

namespace {
// offset + w_j as the mode uses it (rounded to x's dtype in NONE mode); 1 without a weight.
std::vector<double> weight_factor(const void *w, hl_dtype_t wdt, float offset, int64_t cols,
                                  hl_rmsnorm_cast_t cast, hl_dtype_t xdt) {
  std::vector<double> f(size_t(cols), 1.0);
  if (!w) return f;
  for (int64_t j = 0; j < cols; ++j) {
    double v = double(offset) + load(w, wdt, j);
    f[size_t(j)] = cast == HL_RMSNORM_CAST_NONE ? round_to(xdt, v) : double(float(v));
  }
  return f;
}

double row_rstd(const double *s, int64_t cols, float eps) {
  double ss = 0;
  for (int64_t j = 0; j < cols; ++j) ss += s[j] * s[j];
  return 1.0 / std::sqrt(ss / double(cols) + double(eps));
}
}  // namespace

hl_status_t cpu_fwd(const hl_rmsnorm_fwd_args_t &a) {
  const std::vector<double> wf = weight_factor(a.weight, a.weight_dtype, a.offset, a.cols, a.cast, a.x_dtype);
  std::vector<double> s(size_t(a.cols));
  for (int64_t i = 0; i < a.rows; ++i) {
    for (int64_t j = 0; j < a.cols; ++j) {
      double v = load(a.x, a.x_dtype, i * a.x_stride + j);
      // The summed residual is stored in x's dtype and normalised as stored.
      if (a.residual) v = round_to(a.x_dtype, v + load(a.residual, a.x_dtype, i * a.residual_stride + j));
      s[size_t(j)] = v;
    }
    const double rstd = row_rstd(s.data(), a.cols, a.eps);
    const double r = a.cast == HL_RMSNORM_CAST_NONE ? round_to(a.x_dtype, rstd) : rstd;
    for (int64_t j = 0; j < a.cols; ++j) {
      double xn = s[size_t(j)] * r;
      if (a.cast != HL_RMSNORM_CAST_GEMMA) xn = round_to(a.x_dtype, xn);
      double y = xn * wf[size_t(j)];
      if (a.residual) store(a.residual_out, a.x_dtype, i * a.residual_out_stride + j, s[size_t(j)]);
      store(a.y, a.y_dtype, i * a.y_stride + j, y);
    }
    if (a.rstd) a.rstd[i] = float(rstd);
  }
  return HL_STATUS_SUCCESS;
}

hl_status_t cpu_bwd(const hl_rmsnorm_bwd_args_t &a) {
  const std::vector<double> wf = weight_factor(a.weight, a.weight_dtype, a.offset, a.cols, a.cast, a.x_dtype);
  std::vector<double> dw(size_t(a.cols), 0.0), s(size_t(a.cols)), g(size_t(a.cols));
  for (int64_t i = 0; i < a.rows; ++i) {
    for (int64_t j = 0; j < a.cols; ++j) s[size_t(j)] = load(a.x, a.x_dtype, i * a.x_stride + j);
    const double rstd = a.rstd ? double(a.rstd[i]) : row_rstd(s.data(), a.cols, a.eps);
    double dot = 0;  // sum_j g_j * xhat_j
    for (int64_t j = 0; j < a.cols; ++j) {
      const double dy = load(a.dy, a.dy_dtype, i * a.dy_stride + j);
      const double xhat = s[size_t(j)] * rstd;
      const double xw = a.cast == HL_RMSNORM_CAST_GEMMA ? xhat : round_to(a.x_dtype, xhat);
      dw[size_t(j)] += dy * xw;
      g[size_t(j)] = dy * wf[size_t(j)];
      dot += g[size_t(j)] * xhat;
    }
    const double mean = dot / double(a.cols);
    for (int64_t j = 0; j < a.cols; ++j) {
      double dx = rstd * (g[size_t(j)] - s[size_t(j)] * rstd * mean);
      if (a.dresidual_out) dx += load(a.dresidual_out, a.x_dtype, i * a.dresidual_out_stride + j);
      store(a.dx, a.x_dtype, i * a.dx_stride + j, dx);
      if (a.dresidual) store(a.dresidual, a.x_dtype, i * a.dresidual_stride + j, dx);
    }
  }
  if (a.dw)
    for (int64_t j = 0; j < a.cols; ++j) store(a.dw, a.dw_dtype, j, dw[size_t(j)]);
  return HL_STATUS_SUCCESS;
}

}  // namespace hl::rmsnorm
