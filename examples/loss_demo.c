/* `make demo`: one fused loss plan on a realistic batch — CE + z-loss + entropy bonus + GRPO with
 * a KL-to-reference term and every metric — printing the losses, the metrics and the time.
 * On a GPU: 8192 x 128256 bf16 logits (a Llama-3 vocabulary); without one, the CPU backend on a
 * smaller batch. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "example.h"

#if HL_HAVE_CUDA
#include <cuda_runtime.h>
#endif

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t next_u32(void) {
  rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
  return (uint32_t)(rng_state >> 32);
}
/* Roughly normal (a sum of two uniforms), times `scale`. */
static float rnd(float scale) {
  return scale * ((float)(next_u32() >> 8) + (float)(next_u32() >> 8) - 16777216.0f) / 8388608.0f;
}
static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

int main(void) {
  const int gpu = hl_backend_is_available(HL_BACKEND_CUDA);
  const int64_t N = gpu ? 8192 : 256, V = gpu ? 128256 : 32000;
  printf("headloss %d: fused loss plan on %lld x %lld bf16 logits, %s backend\n", hl_get_version(),
         (long long)N, (long long)V, gpu ? "CUDA" : "CPU (no GPU visible)");

  uint16_t *logits = malloc((size_t)N * V * 2);
  int64_t *labels = malloc(N * 8);
  float *adv = malloc(N * 4), *old = malloc(N * 4), *ref = malloc(N * 4);
  if (!logits || !labels || !adv || !old || !ref) return fprintf(stderr, "out of memory\n"), 1;
  for (int64_t i = 0; i < N * V; ++i) logits[i] = to_bf16(rnd(2.0f));
  for (int64_t i = 0; i < N; ++i) {
    labels[i] = i % 13 == 0 ? -100 : (int64_t)(next_u32() % V);
    adv[i] = rnd(1.0f), old[i] = -11.3f + rnd(0.3f), ref[i] = old[i] + rnd(0.25f);
  }

  hl_loss_plan_desc_t d;
  memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  d.backend = gpu ? HL_BACKEND_CUDA : HL_BACKEND_CPU;
  d.vocab = V;
  d.logits_dtype = HL_DTYPE_BF16;
  d.labels_dtype = HL_DTYPE_I64;
  d.terms = HL_LOSS_CE | HL_LOSS_Z | HL_LOSS_ENTROPY | HL_LOSS_GRPO | HL_LOSS_GRPO_KL_REF;
  d.ce_weight = 1.0f, d.z_weight = 1e-4f, d.entropy_weight = -1e-3f, d.grpo_weight = 1.0f;
  d.kl_ref_beta = 0.04f;
  d.grad_mode = HL_LOSS_GRAD_WRITE;
  hl_loss_plan_t plan;
  CHECK_HL(hl_loss_plan_create(&d, &plan));
  size_t ws_bytes = 0;
  CHECK_HL(hl_loss_plan_get_workspace_size(plan, N, &ws_bytes));

  hl_loss_args_t a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.rows = N;
  float scalars[HL_LOSS_NUM_SCALARS];
  void *ws = NULL, *grad = NULL, *dev_scalars = scalars;
  const void *in[5] = {logits, labels, adv, old, ref};
#if HL_HAVE_CUDA
  const size_t sizes[5] = {(size_t)N * V * 2, N * 8, N * 4, N * 4, N * 4};
  if (gpu) {
    for (int k = 0; k < 5; ++k) {
      void *p;
      if (cudaMalloc(&p, sizes[k]) != cudaSuccess) return fprintf(stderr, "cudaMalloc failed\n"), 1;
      cudaMemcpy(p, in[k], sizes[k], cudaMemcpyHostToDevice);
      in[k] = p;
    }
    if (cudaMalloc(&grad, (size_t)N * V * 2) != cudaSuccess || cudaMalloc(&ws, ws_bytes) != cudaSuccess ||
        cudaMalloc(&dev_scalars, sizeof scalars) != cudaSuccess)
      return fprintf(stderr, "cudaMalloc failed\n"), 1;
  }
#endif
  if (!gpu) grad = malloc((size_t)N * V * 2);
  a.logits = in[0], a.labels = in[1], a.advantages = in[2], a.old_logprobs = in[3], a.ref_logprobs = in[4];
  a.grad = grad, a.scalars = dev_scalars;

  const int iters = gpu ? 20 : 1;
  CHECK_HL(hl_loss_plan_execute(plan, &a, ws, ws_bytes, NULL)); /* warm-up */
  double ms = 0;
#if HL_HAVE_CUDA
  if (gpu) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    cudaEventRecord(e0, NULL);
    for (int it = 0; it < iters; ++it) CHECK_HL(hl_loss_plan_execute(plan, &a, ws, ws_bytes, NULL));
    cudaEventRecord(e1, NULL);
    cudaEventSynchronize(e1);
    float f;
    cudaEventElapsedTime(&f, e0, e1);
    ms = f / iters;
    cudaMemcpy(scalars, dev_scalars, sizeof scalars, cudaMemcpyDeviceToHost);
  }
#endif
  if (!gpu) {
    const double t0 = now_ms();
    CHECK_HL(hl_loss_plan_execute(plan, &a, ws, ws_bytes, NULL));
    ms = now_ms() - t0;
  }
  static const char *names[HL_LOSS_NUM_SCALARS] = {
      "loss", "ce", "z", "entropy", "distill", "grpo", "kl_ref", "divisor", "weight_sum", "valid_rows",
      "lse_mean", "entropy_mean", "logp_mean", "accuracy", "ratio_mean", "ratio_min", "ratio_max",
      "clip_low", "clip_high", "clip_any", "k3_old", "kl_ref_mean", "adv_mean", "adv_min", "adv_max",
      "distill_kl_mean"};
  for (int k = 0; k < HL_LOSS_NUM_SCALARS; ++k) printf("  %-16s %12.6f\n", names[k], scalars[k]);
  const double gb = 2.0 * (double)N * V * 2 / 1e9;
  printf("time per step (losses + metrics + bf16 gradient): %.3f ms, %.1f GB/s counting one read of "
         "the logits and one write of the gradient\n", ms, gb / (ms * 1e-3));
  CHECK_HL(hl_loss_plan_destroy(plan));
  return 0;
}
