// The row kernel's gradient epilogue: pass 2 writes the gradient of the slice, fp32 from the slice in
// shared memory (or read again), one rounding at the store, each column loop branch-free in the
// row's form; a sparse teacher's ids in the slice are rewritten, whole, after it.
#pragma once

#include <type_traits>

#include "loss/row_source.cuh"
#include "loss/row_stats.cuh"

namespace hl::loss::dev {

// FAST: aligned, no accumulation (a compile-time case: no branches in the column loop).
template <class G, int VEC, bool FAST>
__device__ __forceinline__ void store_grad(G *p, const float (&g)[VEC], bool aligned, bool acc) {
  constexpr int W = 16 / sizeof(G);  // elements per 16-byte store
  if (FAST) aligned = true, acc = false;
#pragma unroll
  for (int h = 0; h < VEC; h += W) {
    Pack<G, W> out;
    float f[W];
    if (acc) out = load_cols<G, W>(p + h, aligned);
#pragma unroll
    for (int k = 0; k < W; ++k) f[k] = acc ? to_float(out.v[k]) + g[h + k] : g[h + k];
    hl::dev::from_floats<G, W>(f, out.v);
    if (aligned) hl::dev::store_pack<G, W>(p + h, out);
    else
#pragma unroll
      for (int k = 0; k < W; ++k) p[h + k] = out.v[k];
  }
}

// How pass 2 forms a gradient element of a row (before the soft-cap's chain factor and the
// label's term), picked per row so that each column loop is branch-free:
//   kGeneric  p (cp + cpz z) + cc, distillation terms: grad_elem
//   kSigned   sign(cp) 2^(z s2 - c2) + cc with log2 |cp| folded into c2 (no entropy loss, cap
//             or distillation): an FMA a column fewer
//   kPure     2^(z s2 - c2) where also cp >= 0 and cc == 0 (CE, z-loss, GRPO without smoothing):
//             nothing after the exponential
enum GradForm : int { kGeneric, kSigned, kPure };
template <int F> using Form = std::integral_constant<int, F>;

// A row's constants of pass 2, in base 2: z_hat log2 e = z s2; lse log2 e; c2 (GradForm); sign(cp).
struct GradConsts {
  float s2, lse2, c2, sg;
};

// The gradient of the first n columns of a pack (z, the cap's tanh t, teacher v) in form F.
template <int F, int DISTILL, bool CAP, int VEC>
__device__ __forceinline__ void grad_pack(const RowResult<float> &rr, const Options &o,
                                          const GradConsts &c, const float (&z)[VEC],
                                          const float (&t)[VEC], const float (&v)[VEC], int n,
                                          float (&g)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    if (k >= n) break;
    if (F == kGeneric) {
      const float pk = ex2(fmaf(z[k], c.s2, -c.lse2));
      const float gk = grad_elem<DISTILL>(rr, o, z[k], v[k], pk, FastMath{});
      g[k] = CAP ? gk * fmaf(-t[k], t[k], 1.0f) : gk;
    } else {
      const float e = ex2(fmaf(z[k], c.s2, -c.c2));
      g[k] = F == kPure ? e : fmaf(e, c.sg, rr.cc);
    }
  }
}

}  // namespace hl::loss::dev
