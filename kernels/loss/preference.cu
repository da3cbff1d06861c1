// A preference term's step between the sequence sums (seq.cu) and the finish (hl/loss/preference.h):
// one CTA takes every pair (KTO: sequence), its threads strided over them, and adds their sums in
// thread order (deterministic); then writes each row's seq_g. num_seqs is small (pairs of a batch),
// and the step runs once a call.
#include "common/cuda_util.h"
#include "loss/steps.h"

namespace hl::loss::dev {
namespace {

constexpr int kPrefThreads = 256;

struct PrefArgs {
  const void *cu;
  bool cu64;
  int64_t seqs, rows;
  const float *ref;    // ref_seq_logprobs, with a reference
  const int32_t *kto;  // kto_labels, for KTO
  PrefOptions o;
  float grad_scale;
  SeqArea area;
};

__device__ int64_t bound(const PrefArgs &a, int64_t s) {
  const int64_t v = a.cu64 ? static_cast<const int64_t *>(a.cu)[s]
                           : int64_t(static_cast<const int32_t *>(a.cu)[s]);
  return v < 0 ? 0 : v > a.rows ? a.rows : v;  // unchecked calls stay in bounds
}

__global__ void __launch_bounds__(kPrefThreads) pref_kernel(const PrefArgs a) {
  __shared__ PrefSums<float> part[kPrefThreads];
  __shared__ float z0, units;
  const int tid = threadIdx.x;
  const PrefOptions &o = a.o;
  const auto v = [&](int64_t s) { return seq_logp(a.area.sums[s], o); };
  const auto ref = [&](int64_t s) { return o.reference ? a.ref[s] : 0.0f; };
  const bool kto = o.kind == HL_LOSS_PREF_KTO;
  if (kto) {  // the KL baseline over the KL completions: thread sums, added in thread order
    PrefSums<float> kl = pref_zero<float>();
    for (int64_t s = tid; s < a.seqs; s += kPrefThreads)
      if (a.kto[s] < 0) kl.loss += v(s) - ref(s), kl.units += 1.0f;
    part[tid] = kl;
    __syncthreads();
    if (tid == 0) {
      for (int t = 1; t < kPrefThreads; ++t) kl = add(kl, part[t]);
      z0 = kto_z0(kl.loss, kl.units);
    }
    __syncthreads();
  }
  PrefSums<float> sum = pref_zero<float>();
  if (kto) {
    for (int64_t s = tid; s < a.seqs; s += kPrefThreads)
      a.area.dv[s] = a.kto[s] < 0 ? 0.0f : kto_seq(o, int(a.kto[s]), v(s), ref(s), z0, &sum);
  } else {
    const int64_t P = a.seqs / 2;
    for (int64_t i = tid; i < P; i += kPrefThreads)
      pref_pair(o, v(i), v(P + i), ref(i), ref(P + i), &sum, &a.area.dv[i], &a.area.dv[P + i]);
  }
  __syncthreads();  // part is reused
  part[tid] = sum;
  __syncthreads();
  if (tid == 0) {
    for (int t = 1; t < kPrefThreads; ++t) sum = add(sum, part[t]);
    float loss = 0.0f;
    pref_scalars(o, sum, kto ? z0 : 0.0f, a.area.results, &loss);
    a.area.results[kPrefScalars] = loss;
    units = sum.units;
  }
  __syncthreads();  // units, and every dv
  for (int64_t s = 0; s < a.seqs; ++s) {
    const float g = pref_token_grad(o, a.area.dv[s], a.area.sums[s], units, a.grad_scale);
    for (int64_t i = bound(a, s) + tid; i < bound(a, s + 1); i += kPrefThreads) a.area.g[i] = g;
  }
}

__global__ void pref_store_kernel(const float *results, int n, float *scalars) {
  pref_store(results, results[kPrefScalars], n, scalars);
}

}  // namespace

hl_status_t pref_run(const hl_loss_plan_st &p, const hl_loss_args_t &a, const SeqArea &area,
                     cudaStream_t stream) {
  PrefArgs k{};
  k.cu = a.cu_seqlens, k.cu64 = p.desc.cu_seqlens_dtype == HL_DTYPE_I64;
  k.seqs = a.num_seqs, k.rows = a.rows;
  k.ref = a.ref_seq_logprobs, k.kto = a.kto_labels;
  k.o = p.pref;
  k.grad_scale = a.grad_scale == 0.0f ? 1.0f : a.grad_scale;
  k.area = area;
  pref_kernel<<<1, kPrefThreads, 0, stream>>>(k);
  HL_CUDA_TRY_LAUNCH();
  return HL_STATUS_SUCCESS;
}

hl_status_t pref_store_scalars(const hl_loss_plan_st &p, const hl_loss_args_t &a, const SeqArea &area,
                               cudaStream_t stream) {
  if (!a.scalars) return HL_STATUS_SUCCESS;
  pref_store_kernel<<<1, 1, 0, stream>>>(area.results, p.opt.scalars, a.scalars);
  HL_CUDA_TRY_LAUNCH();
  return HL_STATUS_SUCCESS;
}

}  // namespace hl::loss::dev
