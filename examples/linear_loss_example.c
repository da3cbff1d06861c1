/* The fused linear form of the loss plan from C: hidden states [N, H] and the head's weight [V, H]
 * in, CE + z-loss and the gradients w.r.t. both out, the [N, V] logits never in memory (the plan
 * forms them a chunk of rows at a time in the workspace). On the CUDA backend when a GPU is
 * visible (and cuBLASLt loads), else on the CPU backend. The workspace query gives two sizes: the
 * least any call accepts and the one it runs fastest with; the example runs with both and checks
 * each result against a naive fp64 reference (logits = X W^T, softmax, G, G W, G^T X).
 * Build: `make`; run: build/examples/linear_loss_example. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "example.h"

#if HL_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#define N 37   /* rows (tokens); row 5 is ignored */
#define H 96   /* hidden size */
#define V 1000 /* vocabulary */
#define Z_WEIGHT 1e-3f

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static double from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* CE + Z_WEIGHT * z-loss, averaged over the valid rows, and G = d loss / d logits, in fp64. */
static double reference(const uint16_t *x, const uint16_t *w, const int64_t *y, double *gh, double *gw) {
  static double z[V];
  double loss = 0;
  int valid = 0;
  for (int i = 0; i < N; ++i) valid += y[i] >= 0;
  memset(gh, 0, sizeof(double) * N * H);
  memset(gw, 0, sizeof(double) * V * H);
  for (int i = 0; i < N; ++i) {
    if (y[i] < 0) continue;
    double mx = -INFINITY, sum = 0;
    for (int j = 0; j < V; ++j) {
      z[j] = 0;
      for (int k = 0; k < H; ++k) z[j] += from_bf16(x[i * H + k]) * from_bf16(w[j * H + k]);
      mx = z[j] > mx ? z[j] : mx;
    }
    for (int j = 0; j < V; ++j) sum += exp(z[j] - mx);
    const double lse = mx + log(sum);
    loss += (lse - z[y[i]] + Z_WEIGHT * lse * lse) / valid;
    for (int j = 0; j < V; ++j) {
      const double p = exp(z[j] - lse);
      const double g = (p * (1 + 2 * Z_WEIGHT * lse) - (j == y[i])) / valid; /* G[i][j] */
      for (int k = 0; k < H; ++k) {
        gh[i * H + k] += g * from_bf16(w[j * H + k]); /* G W   */
        gw[j * H + k] += g * from_bf16(x[i * H + k]); /* G^T X */
      }
    }
  }
  return loss;
}

static double rel_err(const double *ref, int64_t n, double (*at)(const void *, int64_t), const void *got) {
  double e = 0, r = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = at(got, i) - ref[i];
    e += d * d, r += ref[i] * ref[i];
  }
  return sqrt(e / r);
}
static double at_bf16(const void *p, int64_t i) { return from_bf16(((const uint16_t *)p)[i]); }
static double at_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }

static hl_status_t make_plan(hl_backend_t backend, hl_loss_plan_t *plan) {
  hl_loss_plan_desc_t d;
  memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  d.backend = backend;
  d.vocab = V;
  d.labels_dtype = HL_DTYPE_I64;
  d.terms = HL_LOSS_CE | HL_LOSS_Z;
  d.ce_weight = 1.0f, d.z_weight = Z_WEIGHT;
  d.hidden = H;                        /* the fused linear form ...                       */
  d.weight_dtype = HL_DTYPE_BF16;      /* ... hidden and weight in bf16                   */
  d.grad_hidden_mode = HL_LOSS_GRAD_WRITE;
  d.grad_hidden_dtype = HL_DTYPE_BF16; /* grad_hidden in the weight's dtype               */
  d.grad_weight_mode = HL_LOSS_GRAD_WRITE;
  d.grad_weight_dtype = HL_DTYPE_F32;  /* grad_weight summed over the chunks in fp32      */
  return hl_loss_plan_create(&d, plan);
}

int main(void) {
  static uint16_t x[N * H], w[V * H], gh[N * H];
  static float gw[V * H];
  static double ref_gh[N * H], ref_gw[V * H];
  int64_t y[N];
  for (int i = 0; i < N * H; ++i) x[i] = to_bf16(sinf(0.37f * (float)i) + 0.5f * cosf(1.3f * (float)(i % 17)));
  for (int i = 0; i < V * H; ++i) w[i] = to_bf16(0.3f * sinf(0.71f * (float)i + 0.2f * (float)(i / H)));
  for (int i = 0; i < N; ++i) y[i] = i == 5 ? -100 : (i * 389 + 7) % V;
  const double ref_loss = reference(x, w, y, ref_gh, ref_gw);

  /* The CUDA backend where a GPU is visible and the plan can load cuBLASLt, else the CPU one. */
  int gpu = hl_backend_is_available(HL_BACKEND_CUDA);
  hl_loss_plan_t plan;
  if (gpu && make_plan(HL_BACKEND_CUDA, &plan) != HL_STATUS_SUCCESS) {
    printf("CUDA plan not available (%s); using the CPU backend\n", hl_get_last_error());
    gpu = 0;
  }
  if (!gpu) CHECK_HL(make_plan(HL_BACKEND_CPU, &plan));
  size_t min_bytes = 0, fast_bytes = 0;
  CHECK_HL(hl_loss_plan_get_workspace_sizes(plan, N, &min_bytes, &fast_bytes));
  printf("headloss %d: fused linear loss, hidden [%d, %d] x weight [%d, %d] bf16, %s backend\n",
         hl_get_version(), N, H, V, H, gpu ? "CUDA" : "CPU");
  printf("workspace: min %zu bytes, fast %zu bytes (the logits would take %zu)\n", min_bytes,
         fast_bytes, (size_t)N * V * 2);

  void *dx = put(gpu, x, sizeof x), *dw = put(gpu, w, sizeof w), *dy = put(gpu, y, sizeof y);
  void *dgh = put(gpu, NULL, sizeof gh), *dgw = put(gpu, NULL, sizeof gw);
  void *dscalars = put(gpu, NULL, HL_LOSS_NUM_SCALARS * sizeof(float));
  hl_loss_args_t a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.rows = N;
  a.hidden = dx, a.weight = dw, a.labels = dy; /* packed: strides 0 */
  a.grad_hidden = dgh, a.grad_weight = dgw, a.scalars = dscalars;

  /* The fastest workspace, then the least: more chunks, the same result to rounding. */
  const size_t sizes[2] = {fast_bytes, min_bytes};
  const double tol_loss = gpu ? 1e-2 : 1e-6, tol_gh = gpu ? 2e-2 : 5e-3, tol_gw = gpu ? 2e-2 : 1e-5;
  int ok = 1;
  for (int run = 0; run < 2; ++run) {
    void *ws = sizes[run] ? put(gpu, NULL, sizes[run]) : NULL;
    CHECK_HL(hl_loss_plan_execute(plan, &a, ws, sizes[run], NULL));
    float scalars[HL_LOSS_NUM_SCALARS];
    get(gpu, scalars, dscalars, sizeof scalars);
    get(gpu, gh, dgh, sizeof gh);
    get(gpu, gw, dgw, sizeof gw);
    if (ws) release(gpu, ws);
    const double e_loss = fabs(scalars[HL_LOSS_OUT_LOSS] - ref_loss) / fabs(ref_loss);
    const double e_gh = rel_err(ref_gh, N * H, at_bf16, gh), e_gw = rel_err(ref_gw, V * H, at_f32, gw);
    printf("workspace %zu bytes: loss %.6f (ce %.6f, z %.4f; reference %.6f), valid rows %.0f\n",
           sizes[run], scalars[HL_LOSS_OUT_LOSS], scalars[HL_LOSS_OUT_CE], scalars[HL_LOSS_OUT_Z],
           ref_loss, scalars[HL_LOSS_OUT_VALID_ROWS]);
    printf("  grad_hidden[0][0..2] %+.6f %+.6f %+.6f   grad_weight[%lld][0..2] %+.6f %+.6f %+.6f\n",
           from_bf16(gh[0]), from_bf16(gh[1]), from_bf16(gh[2]), (long long)y[0], gw[y[0] * H],
           gw[y[0] * H + 1], gw[y[0] * H + 2]);
    printf("  relative error against the fp64 reference: loss %.2e, grad_hidden %.2e, grad_weight %.2e\n",
           e_loss, e_gh, e_gw);
    ok &= e_loss <= tol_loss && e_gh <= tol_gh && e_gw <= tol_gw && from_bf16(gh[5 * H]) == 0;
    if (min_bytes == fast_bytes) break; /* one size (the CPU backend needs no workspace) */
  }
  CHECK_HL(hl_loss_plan_destroy(plan));
  void *bufs[] = {dx, dw, dy, dgh, dgw, dscalars};
  for (int i = 0; i < 6; ++i) release(gpu, bufs[i]);
  printf("%s\n", ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}
