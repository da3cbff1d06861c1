/* Launch-bound RMSNorm from C: 1024 x 4096 bf16 (8 MB), the time per call including the launch.
 * Reports back-to-back throughput (calls queued on one stream) and the synchronous latency of one
 * call (call + stream synchronize), median of many. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "headloss.h"

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
static int cmp(const void *a, const void *b) {
  double d = *(const double *)a - *(const double *)b;
  return (d > 0) - (d < 0);
}

int main(int argc, char **argv) {
  const long rows = argc > 1 ? atol(argv[1]) : 1024, cols = argc > 2 ? atol(argv[2]) : 4096;
  const size_t n = (size_t)rows * cols;
  unsigned short *hx = malloc(n * 2), *hw = malloc(cols * 2);
  for (size_t i = 0; i < n; ++i) hx[i] = (unsigned short)(0x3f80 + (rand() & 0x7f) - 0x40); /* ~[0.5, 2) bf16 */
  for (long j = 0; j < cols; ++j) hw[j] = 0x3f80;
  void *x, *w, *y;
  cudaStream_t s;
  if (cudaMalloc(&x, n * 2) || cudaMalloc(&y, n * 2) || cudaMalloc(&w, cols * 2) || cudaStreamCreate(&s)) {
    fprintf(stderr, "CUDA setup failed\n");
    return 1;
  }
  cudaMemcpy(x, hx, n * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(w, hw, cols * 2, cudaMemcpyHostToDevice);
  hl_rmsnorm_fwd_args_t a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.backend = HL_BACKEND_CUDA;
  a.rows = rows;
  a.cols = cols;
  a.eps = 1e-6f;
  a.x_dtype = a.weight_dtype = a.y_dtype = HL_DTYPE_BF16;
  a.x = x;
  a.weight = w;
  a.y = y;
  for (int i = 0; i < 100; ++i)
    if (hl_rmsnorm_fwd(&a, s)) {
      fprintf(stderr, "rmsnorm_fwd: %s\n", hl_get_last_error());
      return 1;
    }
  cudaStreamSynchronize(s);
  enum { CALLS = 5000, SYNCED = 2000 };
  double t0 = now_us();
  for (int i = 0; i < CALLS; ++i) hl_rmsnorm_fwd(&a, s);
  cudaStreamSynchronize(s);
  const double per_call = (now_us() - t0) / CALLS;
  static double lat[SYNCED];
  for (int i = 0; i < SYNCED; ++i) {
    t0 = now_us();
    hl_rmsnorm_fwd(&a, s);
    cudaStreamSynchronize(s);
    lat[i] = now_us() - t0;
  }
  qsort(lat, SYNCED, sizeof lat[0], cmp);
  const double bytes = 2.0 * n * 2;
  printf("rmsnorm_fwd %ldx%ld bf16 from C: %.2f us per call back-to-back (%.0f GB/s), "
         "%.2f us per synchronous call (median)\n", rows, cols, per_call, bytes / per_call / 1e3, lat[SYNCED / 2]);
  return cudaGetLastError() != cudaSuccess;
}
