// gdn_bwd_dqkwg on the CPU: the fp64 reference the CUDA kernel is tested against. Every product
// and sum is in double; each output is rounded once at its store.
#include <cmath>
#include <vector>

#include "cpu/scalar.h"
#include "gdn.h"
#include "hl/gdn/chunks.h"

namespace hl::gdn {
using cpu::load;
using cpu::store;

namespace {

// A [rows, cols] block of a tensor read as double; `base` and the strides in elements, `col_stride`
// the stride along its columns (1: a row-major block).
std::vector<double> read_block(const void *p, hl_dtype_t dt, int64_t base, int64_t row_stride, int64_t rows,
                               int64_t cols, int64_t col_stride = 1) {
  std::vector<double> m(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) m[size_t(r * cols + c)] = load(p, dt, base + r * row_stride + c * col_stride);
  return m;
}

// out[i, j] = sum_l a[i, l] * b[j, l]   (a [n, L], b [m, L])
std::vector<double> mul_abt(const std::vector<double> &a, const std::vector<double> &b, int64_t n, int64_t m,
                            int64_t L) {
  std::vector<double> out(size_t(n * m), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j) {
      double s = 0;
      for (int64_t l = 0; l < L; ++l) s += a[size_t(i * L + l)] * b[size_t(j * L + l)];
      out[size_t(i * m + j)] = s;
    }
  return out;
}

}  // namespace

hl_status_t cpu_dqkwg(const hl_gdn_bwd_dqkwg_args_t &a, const std::vector<int64_t> &cu) {
  const int64_t H = a.H, HV = a.HV, K = a.K, V = a.V, G = HV / H;
  const bool gated = a.gate != HL_GDN_GATE_NONE, dg_out = has_dg(a.gate);
  const auto E = [&](double x) { return is_log2(a.gate) ? std::exp2(x) : std::exp(x); };
  const hl_dtype_t dt = a.dtype;
  const bool vf = a.flags & HL_GDN_STATE_V_FIRST;
  const std::vector<Chunk> chunks = Chunks(a.B, a.T, cu).list();
  for (int64_t id = 0; id < int64_t(chunks.size()); ++id) {
    const int64_t n = chunks[size_t(id)].rows, tok = chunks[size_t(id)].tok0;
    for (int64_t hq = 0; hq < H; ++hq) {
      const std::vector<double> q = read_block(a.q, dt, (tok * H + hq) * K, H * K, n, K);
      const std::vector<double> k = read_block(a.k, dt, (tok * H + hq) * K, H * K, n, K);
      std::vector<double> dq_sum(size_t(n * K), 0.0), dk_sum(size_t(n * K), 0.0);
      for (int64_t hv = hq * G; hv < (hq + 1) * G; ++hv) {
        const std::vector<double> v = read_block(a.v, dt, (tok * HV + hv) * V, HV * V, n, V);
        const std::vector<double> dO = read_block(a.do_, dt, (tok * HV + hv) * V, HV * V, n, V);
        // h, dh as [K, V]; with state_v_first they are stored [V, K]
        const int64_t hbase = (id * HV + hv) * K * V, rs = vf ? 1 : V, cs = vf ? K : 1;
        const std::vector<double> h = read_block(a.h, a.h_dtype, hbase, rs, K, V, cs);
        const std::vector<double> dh = read_block(a.dh, a.h_dtype, hbase, rs, K, V, cs);
        std::vector<double> gam(size_t(n), 0.0);  // chunk-local cumulative gate
        for (int64_t t = 0; t < n && gated; ++t)
          gam[size_t(t)] = a.g ? double(a.g[(tok + t) * HV + hv]) : double(a.g_gamma[hv]) * double(t + 1);
        const double gl = gam[size_t(n - 1)];
        std::vector<double> ds = mul_abt(dO, v, n, n, V), dq = mul_abt(dO, h, n, K, V), dk = mul_abt(v, dh, n, K, V);
        if (a.dw) {
          const std::vector<double> dv = read_block(a.dv, dt, (tok * HV + hv) * V, HV * V, n, V);
          const std::vector<double> dw = mul_abt(dv, h, n, K, V);
          for (int64_t t = 0; t < n; ++t)
            for (int64_t j = 0; j < K; ++j) store(a.dw, dt, ((tok + t) * HV + hv) * K + j, -dw[size_t(t * K + j)]);
        }
        double dgl = 0;
        for (size_t i = 0; i < h.size(); ++i) dgl += h[i] * dh[i];
        dgl *= E(gl);
        for (int64_t t = 0; t < n; ++t)
          for (int64_t j = 0; j < K; ++j) {
            dq[size_t(t * K + j)] *= E(gam[size_t(t)]) * a.scale;
            dk[size_t(t * K + j)] *= E(gl - gam[size_t(t)]);
            dgl += dk[size_t(t * K + j)] * k[size_t(t * K + j)];
          }
        for (int64_t t = 0; t < n; ++t)
          for (int64_t s = 0; s < n; ++s) {
            double &x = ds[size_t(t * n + s)];
            x = s <= t ? x * E(gam[size_t(t)] - gam[size_t(s)]) * a.scale : 0.0;  // a select: E may overflow above
          }
        for (int64_t t = 0; t < n; ++t)
          for (int64_t s = 0; s <= t; ++s)
            for (int64_t j = 0; j < K; ++j) {
              dq[size_t(t * K + j)] += ds[size_t(t * n + s)] * k[size_t(s * K + j)];
              dk[size_t(s * K + j)] += ds[size_t(t * n + s)] * q[size_t(t * K + j)];
            }
        if (dg_out) {
          std::vector<double> dg(gam.size());
          for (int64_t t = 0; t < n; ++t) {
            double s = 0;
            for (int64_t j = 0; j < K; ++j)
              s += dq[size_t(t * K + j)] * q[size_t(t * K + j)] - dk[size_t(t * K + j)] * k[size_t(t * K + j)];
            dg[size_t(t)] = s;
          }
          dg[size_t(n - 1)] += dgl;
          for (int64_t t = n - 2; t >= 0 && a.reverse_cumsum; --t) dg[size_t(t)] += dg[size_t(t + 1)];
          for (int64_t t = 0; t < n; ++t) a.dg[(tok + t) * HV + hv] = float(dg[size_t(t)]);
        }
        for (size_t i = 0; i < dq.size(); ++i) {
          dq_sum[i] += dq[i];
          dk_sum[i] += dk[i];
        }
      }
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < K; ++j) {
          store(a.dq, dt, ((tok + t) * H + hq) * K + j, dq_sum[size_t(t * K + j)]);
          store(a.dk, dt, ((tok + t) * H + hq) * K + j, dk_sum[size_t(t * K + j)]);
        }
    }
  }
  return HL_STATUS_SUCCESS;
}

}  // namespace hl::gdn
