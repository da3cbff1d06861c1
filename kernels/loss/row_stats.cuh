// The row kernel's column math: z_hat, the column loops' exponential and log, and a thread's
// online softmax statistics of its columns (RowStats) in pass 1.
#pragma once

#include "common/dtype.cuh"
#include "common/fast_math.cuh"
#include "loss/params.cuh"

namespace hl::loss::dev {

// Distillation modes that read dense teacher logits (a sparse teacher's k logits are gathered).
template <int DISTILL>
constexpr bool kDenseTeacher = DISTILL == kDistillFwd || DISTILL == kDistillRev || DISTILL == kDistillJsd;

using hl::dev::Pack;
using hl::dev::to_float;
using hl::dev::from_float;

using hl::dev::ex2;
__device__ __forceinline__ float fast_exp(float x) { return ex2(x * kLog2e); }
// The column loops' exponential and log for row_math.h (its LibMath is libm's): one MUFU
// instruction each (lg2.approx: ~2^-22 absolute error).
struct FastMath {
  __device__ __forceinline__ float exp(float x) const { return fast_exp(x); }
  __device__ __forceinline__ float log(float x) const {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y * 0.6931471805599453f;
  }
};

// z_hat from a raw logit; with a cap, t = tanh(scale z / cap) is kept for the chain factor.
template <bool CAP>
__device__ __forceinline__ float zhat(float x, const Options &o, float &t) {
  if (!CAP) return x * o.scale;
  const float y = x * o.scale / o.cap;
  t = 1.0f - __fdividef(2.0f, __expf(2.0f * y) + 1.0f);
  return o.cap * t;
}

// Moves a thread's student sums to a larger max mn (rare: only when a new max appears).
// Without distillation a thread keeps b as sum e z (one FMA a column), made relative to m only
// when the block merges (block_merge); with it, as sum e (z - m) like the other sums.
template <int DISTILL>
__device__ __forceinline__ void raise_max(RowStats<float> &st, float mn, float inv_ts) {
  const float f = rescale(st.m, mn), d = shift(st.m, mn);
  st.b = DISTILL ? moved(f, st.b, st.s, d) : st.b * f;
  st.s *= f;
  if (DISTILL) {
    const float fs = rescale(st.m, mn, inv_ts);
    st.bs = moved(fs, st.bs, st.ss, d);
    st.ss *= fs;
    st.cs *= fs;
    st.ct += st.st * d;
  }
  st.m = mn;
}

__device__ __forceinline__ void raise_teacher_max(RowStats<float> &st, float mn) {
  const float f = rescale(st.mt, mn), d = shift(st.mt, mn);
  st.bt = moved(f, st.bt, st.st, d);
  st.st *= f;
  st.ct *= f;
  st.cs += st.ss * d;
  st.mt = mn;
}

// The first column of a pack holding its largest value.
template <int N>
__device__ __forceinline__ int find_argmax(const float (&z)[N]) {
  float zr = z[0];
#pragma unroll
  for (int k = 1; k < N; ++k) zr = fmaxf(zr, z[k]);
  int first = N - 1;
#pragma unroll
  for (int k = N - 1; k >= 0; --k) first = z[k] == zr ? k : first;
  return first;
}

// Folds n consecutive columns starting at j0 into a thread's statistics. z is z_hat, or without
// distillation the raw logit with z_hat = zs z: then m stays in z_hat units, b and sum in raw
// ones (the caller scales them), and zs rides in the exponent's constant (no multiply a column).
// SUMZ: sum z is kept (label smoothing needs it; an add a column otherwise saved).
// lazy_pack (no distillation): a new maximum only records this pack's index `pack` there, and
// the caller finds its column later (find_argmax), with a cheaper rescale: a warp takes this
// branch whenever any lane meets a new maximum, which is most packs of a row's first pass.
template <int DISTILL, bool SUMZ, int N>
__device__ __forceinline__ void accumulate(RowStats<float> &st, const float (&z)[N],
                                           const float (&v)[N], int64_t j0, float inv_ts,
                                           float zs = 1.0f, int *lazy_pack = nullptr, int pack = 0) {
  float zr = z[0];
#pragma unroll
  for (int k = 1; k < N; ++k) zr = fmaxf(zr, z[k]);
  const float zm = zr * zs;
  if (!DISTILL && lazy_pack && zm > st.m) {
    const float f = ex2((st.m - zm) * kLog2e);  // 0 from an empty record (m = -inf)
    st.s *= f, st.b *= f, st.m = zm;
    *lazy_pack = pack;
  } else if (zm > st.m) {  // columns only grow, so the first k reaching the new max is the argmax
    raise_max<DISTILL>(st, zm, inv_ts);
    st.amax = j0 + find_argmax(z);
  }
  if (kDenseTeacher<DISTILL>) {
    float vm = v[0];
#pragma unroll
    for (int k = 1; k < N; ++k) vm = fmaxf(vm, v[k]);
    if (vm > st.mt) raise_teacher_max(st, vm);
  }
  const float ml = st.m * kLog2e, s2 = zs * kLog2e;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float d = z[k] - st.m, e = ex2(fmaf(z[k], s2, -ml));
    st.s += e;
    st.b = fmaf(e, DISTILL ? d : z[k], st.b);
    if (SUMZ) st.sum += z[k];
    if (DISTILL) {
      const float es = fast_exp(d * inv_ts);
      st.ss += es;
      st.bs = fmaf(es, d, st.bs);
      if (kDenseTeacher<DISTILL>) {
        const float dt = v[k] - st.mt, et = fast_exp(dt);
        st.st += et;
        st.bt = fmaf(et, dt, st.bt);
        st.ct = fmaf(et, d, st.ct);
        st.cs = fmaf(es, dt, st.cs);
      }
    }
  }
}

}  // namespace hl::loss::dev
