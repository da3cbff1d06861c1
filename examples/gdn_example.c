/* Gated DeltaNet backward (the chunk_bwd_dqkwg step) from C: dq, dk and dg of a small GVA batch
 * with a per-token log gate, on the GPU when there is one, else on the CPU backend; every status
 * is checked. Build: `make`; run: build/examples/gdn_example. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "example.h"
#if HL_HAVE_CUDA
#include <cuda_runtime.h>
#endif

/* One sequence of 100 tokens (two chunks, the second ragged), 2 q/k heads shared by 4 value
 * heads, K = V = 64. */
#define GB 1
#define GT 100
#define GH 2
#define GHV 4
#define GK 64
#define GV 64
#define GNT ((GT + 63) / 64)

static uint16_t to_bf16(float f) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static void fill_bf16(uint16_t *a, size_t n, float freq, float amp) {
  for (size_t i = 0; i < n; ++i) a[i] = to_bf16(amp * sinf(freq * (float)i + 0.3f));
}

enum { NQ = GB * GT * GH * GK, NV = GB * GT * GHV * GV, NH = GB * GNT * GHV * GK * GV, NG = GB * GT * GHV };

#if HL_HAVE_CUDA
static void *dev_copy(const void *host, size_t bytes) {
  void *d = NULL;
  if (cudaMalloc(&d, bytes) != cudaSuccess || (host && cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess)) {
    fprintf(stderr, "CUDA allocation or copy failed\n");
    exit(1);
  }
  return d;
}
#endif

int main(void) {
  static uint16_t q[NQ], k[NQ], v[NV], do_[NV], dq[NQ], dk[NQ];
  static float h[NH], dh[NH], g[NG], dg[NG];
  fill_bf16(q, NQ, 0.011f, 0.5f);
  fill_bf16(k, NQ, 0.017f, 0.5f);
  fill_bf16(v, NV, 0.013f, 1.0f);
  fill_bf16(do_, NV, 0.007f, 1.0f);
  for (int i = 0; i < NH; ++i) {
    h[i] = 0.1f * cosf(0.003f * (float)i);
    dh[i] = 0.1f * sinf(0.005f * (float)i);
  }
  for (int t = 0; t < GT; ++t) /* chunk-local cumulative log gate: restarts every 64 tokens */
    for (int j = 0; j < GHV; ++j) g[t * GHV + j] = -0.02f * (float)(1 + j) * (float)(t % 64 + 1);

  hl_gdn_bwd_dqkwg_args_t a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.B = GB; a.T = GT; a.H = GH; a.HV = GHV; a.K = GK; a.V = GV;
  a.dtype = HL_DTYPE_BF16;
  a.h_dtype = HL_DTYPE_F32;
  a.gate = HL_GDN_GATE_LOG;
  a.scale = 1.0f / sqrtf((float)GK);

  const int gpu = hl_backend_is_available(HL_BACKEND_CUDA);
#if HL_HAVE_CUDA
  if (gpu) {
    cudaStream_t stream;
    if (cudaStreamCreate(&stream) != cudaSuccess) {
      fprintf(stderr, "cudaStreamCreate failed\n");
      return 1;
    }
    a.backend = HL_BACKEND_CUDA;
    a.q = dev_copy(q, sizeof q); a.k = dev_copy(k, sizeof k); a.v = dev_copy(v, sizeof v);
    a.do_ = dev_copy(do_, sizeof do_); a.h = dev_copy(h, sizeof h); a.dh = dev_copy(dh, sizeof dh);
    a.g = dev_copy(g, sizeof g);
    a.dq = dev_copy(NULL, sizeof dq); a.dk = dev_copy(NULL, sizeof dk); a.dg = dev_copy(NULL, sizeof dg);
    size_t ws = 0;
    CHECK_HL(hl_gdn_bwd_dqkwg_workspace_size(&a, &ws)); /* 0 without varlen */
    a.workspace = ws ? dev_copy(NULL, ws) : NULL;
    a.workspace_bytes = ws;
    CHECK_HL(hl_gdn_bwd_dqkwg(&a, stream));
    if (cudaMemcpyAsync(dq, a.dq, sizeof dq, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaMemcpyAsync(dk, a.dk, sizeof dk, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaMemcpyAsync(dg, a.dg, sizeof dg, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess) {
      fprintf(stderr, "CUDA copy failed\n");
      return 1;
    }
    const void *bufs[] = {a.q, a.k, a.v, a.do_, a.h, a.dh, a.g, a.dq, a.dk, a.dg, a.workspace};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i) cudaFree((void *)bufs[i]);
    cudaStreamDestroy(stream);
  }
#endif
  if (!gpu) {
    a.backend = HL_BACKEND_CPU;
    a.q = q; a.k = k; a.v = v; a.do_ = do_; a.h = h; a.dh = dh; a.g = g;
    a.dq = dq; a.dk = dk; a.dg = dg;
    CHECK_HL(hl_gdn_bwd_dqkwg(&a, NULL));
  }

  double sq = 0, sk = 0, sg = 0;
  for (int i = 0; i < NQ; ++i) {
    sq += fabs(from_bf16(dq[i]));
    sk += fabs(from_bf16(dk[i]));
  }
  for (int i = 0; i < NG; ++i) sg += dg[i];
  printf("headloss %d, gdn_bwd_dqkwg on the %s backend: B=%d T=%d H=%d HV=%d K=%d V=%d\n",
         hl_get_version(), gpu ? "CUDA" : "CPU", GB, GT, GH, GHV, GK, GV);
  printf("sum|dq| %.4f  sum|dk| %.4f  sum dg %.4f\n", sq, sk, sg);
  printf("dq[0, 0, 0, 0..3] = %8.4f %8.4f %8.4f %8.4f\n", from_bf16(dq[0]), from_bf16(dq[1]),
         from_bf16(dq[2]), from_bf16(dq[3]));
  printf("dg[0, 99, 0..3]   = %8.4f %8.4f %8.4f %8.4f\n", dg[99 * GHV], dg[99 * GHV + 1],
         dg[99 * GHV + 2], dg[99 * GHV + 3]);
  return 0;
}
