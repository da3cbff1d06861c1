/* `make demo`: one fused loss plan on a realistic batch — CE + z-loss + entropy bonus + GRPO with
 * a KL-to-reference term and every metric — printing the losses, the metrics and the time, in its
 * two input forms: from bf16 logits, then from hidden states and the head's weight (the fused
 * linear form: the logits never whole in memory). On a GPU: 8192 rows, a Llama-3 vocabulary of
 * 128256, hidden size 4096; without one, the CPU backend on a smaller batch. */
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

/* The batch's per-row inputs, on the backend's side: labels (every 13th ignored), GRPO's
 * advantages, old and reference log-probs. */
typedef struct {
  void *labels, *adv, *old, *ref;
} Rows;

static Rows make_rows(int gpu, int64_t N, int64_t V) {
  int64_t *labels = malloc(N * 8);
  float *adv = malloc(N * 4), *old = malloc(N * 4), *ref = malloc(N * 4);
  if (!labels || !adv || !old || !ref) fprintf(stderr, "out of memory\n"), exit(1);
  for (int64_t i = 0; i < N; ++i) {
    labels[i] = i % 13 == 0 ? -100 : (int64_t)(next_u32() % V);
    adv[i] = rnd(1.0f), old[i] = -11.3f + rnd(0.3f), ref[i] = old[i] + rnd(0.25f);
  }
  Rows r = {put(gpu, labels, N * 8), put(gpu, adv, N * 4), put(gpu, old, N * 4), put(gpu, ref, N * 4)};
  free(labels), free(adv), free(old), free(ref);
  return r;
}

static void release_rows(int gpu, Rows r) {
  release(gpu, r.labels), release(gpu, r.adv), release(gpu, r.old), release(gpu, r.ref);
}

/* A bf16 matrix of `n` values, each roughly normal with standard deviation 0.82 * scale. */
static void *bf16_matrix(int gpu, int64_t n, float scale) {
  uint16_t *h = malloc((size_t)n * 2);
  if (!h) fprintf(stderr, "out of memory\n"), exit(1);
  for (int64_t i = 0; i < n; ++i) h[i] = to_bf16(rnd(scale));
  void *p = put(gpu, h, (size_t)n * 2);
  free(h);
  return p;
}

/* Both forms' plan: the losses and metrics of an RL step with CE, bf16 operands, gradients written. */
static hl_loss_plan_desc_t rl_plan(int gpu, int64_t V) {
  hl_loss_plan_desc_t d;
  memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  d.backend = gpu ? HL_BACKEND_CUDA : HL_BACKEND_CPU;
  d.vocab = V;
  d.labels_dtype = HL_DTYPE_I64;
  d.terms = HL_LOSS_CE | HL_LOSS_Z | HL_LOSS_ENTROPY | HL_LOSS_GRPO | HL_LOSS_GRPO_KL_REF;
  d.ce_weight = 1.0f, d.z_weight = 1e-4f, d.entropy_weight = -1e-3f, d.grpo_weight = 1.0f;
  d.kl_ref_beta = 0.04f;
  return d;
}

static hl_loss_args_t rows_args(int64_t N, Rows r, void *scalars) {
  hl_loss_args_t a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.rows = N;
  a.labels = r.labels, a.advantages = r.adv, a.old_logprobs = r.old, a.ref_logprobs = r.ref;
  a.scalars = scalars;
  return a;
}

/* Milliseconds a step (CUDA: events around `iters` calls after a warm-up one; CPU: one call), and
 * the scalars copied back into `scalars`. */
static double time_steps(int gpu, hl_loss_plan_t plan, const hl_loss_args_t *a, void *ws, size_t ws_bytes,
                         float *scalars) {
#if HL_HAVE_CUDA
  if (gpu) {
    CHECK_HL(hl_loss_plan_execute(plan, a, ws, ws_bytes, NULL));
    const int iters = 10;
    cudaEvent_t e0, e1;
    float f = 0;
    if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess)
      fprintf(stderr, "cudaEventCreate failed\n"), exit(1);
    cudaEventRecord(e0, NULL);
    for (int it = 0; it < iters; ++it) CHECK_HL(hl_loss_plan_execute(plan, a, ws, ws_bytes, NULL));
    cudaEventRecord(e1, NULL);
    if (cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&f, e0, e1) != cudaSuccess ||
        cudaMemcpy(scalars, a->scalars, HL_LOSS_NUM_SCALARS * 4, cudaMemcpyDeviceToHost) != cudaSuccess)
      fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(cudaGetLastError())), exit(1);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    return f / iters;
  }
#endif
  const double t0 = now_ms();
  CHECK_HL(hl_loss_plan_execute(plan, a, ws, ws_bytes, NULL));
  memcpy(scalars, a->scalars, HL_LOSS_NUM_SCALARS * 4);
  return now_ms() - t0;
}

static void print_scalars(const float *s, int all) {
  for (int k = 0; k < HL_LOSS_NUM_SCALARS; ++k)
    if (all || k <= HL_LOSS_OUT_KL_REF) printf("  %-19s %12.6f\n", hl_loss_scalar_name(k), s[k]);
}

/* The logits form: [N, V] bf16 logits in, their gradient out. */
static void logits_demo(int gpu, int64_t N, int64_t V) {
  printf("headloss %d: fused loss plan on %lld x %lld bf16 logits, %s backend\n", hl_get_version(),
         (long long)N, (long long)V, gpu ? "CUDA" : "CPU (no GPU visible)");
  hl_loss_plan_desc_t d = rl_plan(gpu, V);
  d.logits_dtype = HL_DTYPE_BF16;
  d.grad_mode = HL_LOSS_GRAD_WRITE;
  hl_loss_plan_t plan;
  CHECK_HL(hl_loss_plan_create(&d, &plan));
  size_t ws_bytes = 0;
  CHECK_HL(hl_loss_plan_get_workspace_size(plan, N, &ws_bytes));

  float scalars[HL_LOSS_NUM_SCALARS];
  Rows r = make_rows(gpu, N, V);
  hl_loss_args_t a = rows_args(N, r, put(gpu, NULL, sizeof scalars));
  a.logits = bf16_matrix(gpu, N * V, 2.0f);
  a.grad = put(gpu, NULL, (size_t)N * V * 2);
  void *ws = ws_bytes ? put(gpu, NULL, ws_bytes) : NULL;
  const double ms = time_steps(gpu, plan, &a, ws, ws_bytes, scalars);
  print_scalars(scalars, 1);
  const double gb = 2.0 * (double)N * V * 2 / 1e9;
  printf("time per step (losses + metrics + bf16 gradient): %.3f ms, %.1f GB/s counting one read of "
         "the logits and one write of the gradient\n", ms, gb / (ms * 1e-3));
  CHECK_HL(hl_loss_plan_destroy(plan));
  void *bufs[] = {(void *)a.logits, a.grad, a.scalars, ws};
  for (int i = 0; i < 4; ++i)
    if (bufs[i]) release(gpu, bufs[i]);
  release_rows(gpu, r);
}

/* The fused linear form: hidden [N, H] and the head's weight [V, H] in, the same losses and
 * metrics, grad_hidden and grad_weight out; the logits exist a chunk of rows at a time, in the
 * workspace (the plan's fastest size). */
static void linear_demo(int gpu, int64_t N, int64_t H, int64_t V) {
  hl_loss_plan_desc_t d = rl_plan(gpu, V);
  d.hidden = H;
  d.weight_dtype = HL_DTYPE_BF16;
  d.grad_hidden_mode = d.grad_weight_mode = HL_LOSS_GRAD_WRITE;
  hl_loss_plan_t plan;
  if (hl_loss_plan_create(&d, &plan) != HL_STATUS_SUCCESS) { /* e.g. cuBLASLt missing */
    printf("\nthe fused linear form is not available here: %s\n", hl_get_last_error());
    return;
  }
  size_t min_bytes = 0, fast_bytes = 0;
  CHECK_HL(hl_loss_plan_get_workspace_sizes(plan, N, &min_bytes, &fast_bytes));
  printf("\nthe fused linear form: hidden [%lld, %lld] x weight [%lld, %lld] bf16, %s backend\n",
         (long long)N, (long long)H, (long long)V, (long long)H, gpu ? "CUDA" : "CPU");

  float scalars[HL_LOSS_NUM_SCALARS];
  Rows r = make_rows(gpu, N, V);
  hl_loss_args_t a = rows_args(N, r, put(gpu, NULL, sizeof scalars));
  a.hidden = bf16_matrix(gpu, N * H, 1.0f);
  a.weight = bf16_matrix(gpu, V * H, 3.0f / sqrtf((float)H)); /* logits of std ~2, as above */
  a.grad_hidden = put(gpu, NULL, (size_t)N * H * 2);
  a.grad_weight = put(gpu, NULL, (size_t)V * H * 2);
  void *ws = fast_bytes ? put(gpu, NULL, fast_bytes) : NULL;
  const double ms = time_steps(gpu, plan, &a, ws, fast_bytes, scalars);
  print_scalars(scalars, 0);
  printf("time per step (forward + backward: three products and the loss): %.3f ms, %.3g TFLOP/s "
         "counting the products' 6 N H V\n", ms, 6.0 * (double)N * H * V / (ms * 1e-3) / 1e12);
  printf("workspace %.1f MiB (least accepted: %.1f MiB); the logits alone would take %.1f MiB\n",
         fast_bytes / 1048576.0, min_bytes / 1048576.0, (double)N * V * 2 / 1048576.0);
  CHECK_HL(hl_loss_plan_destroy(plan));
  void *bufs[] = {(void *)a.hidden, (void *)a.weight, a.grad_hidden, a.grad_weight, a.scalars, ws};
  for (int i = 0; i < 6; ++i)
    if (bufs[i]) release(gpu, bufs[i]);
  release_rows(gpu, r);
}

int main(void) {
  const int gpu = hl_backend_is_available(HL_BACKEND_CUDA);
  logits_demo(gpu, gpu ? 8192 : 256, gpu ? 128256 : 32000);
  linear_demo(gpu, gpu ? 8192 : 64, gpu ? 4096 : 256, gpu ? 128256 : 8000);
  return 0;
}
