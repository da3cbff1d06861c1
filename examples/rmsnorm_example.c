/* RMSNorm from C: normalise a small batch on the GPU when there is one, else on the CPU backend,
 * and check every status. Build: `make`; run: build/examples/rmsnorm_example. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "example.h"
#if HL_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#define ROWS 4
#define COLS 8

int main(void) {
  float x[ROWS * COLS], w[COLS], y[ROWS * COLS], rstd[ROWS];
  for (int i = 0; i < ROWS * COLS; ++i) x[i] = sinf(0.37f * (float)i) * (1.0f + (float)(i / COLS));
  for (int j = 0; j < COLS; ++j) w[j] = 1.0f + 0.1f * (float)j;

  hl_rmsnorm_fwd_args_t a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.rows = ROWS;
  a.cols = COLS;
  a.cast = HL_RMSNORM_CAST_LLAMA;
  a.eps = 1e-6f;
  a.x_dtype = a.weight_dtype = a.y_dtype = HL_DTYPE_F32;

  const int gpu = hl_backend_is_available(HL_BACKEND_CUDA);
#if HL_HAVE_CUDA
  if (gpu) {
    float *dx, *dw, *dy, *dr;
    cudaStream_t stream;
    if (cudaStreamCreate(&stream) != cudaSuccess || cudaMalloc((void **)&dx, sizeof x) != cudaSuccess ||
        cudaMalloc((void **)&dw, sizeof w) != cudaSuccess || cudaMalloc((void **)&dy, sizeof y) != cudaSuccess ||
        cudaMalloc((void **)&dr, sizeof rstd) != cudaSuccess) {
      fprintf(stderr, "CUDA allocation failed\n");
      return 1;
    }
    cudaMemcpy(dx, x, sizeof x, cudaMemcpyHostToDevice);
    cudaMemcpy(dw, w, sizeof w, cudaMemcpyHostToDevice);
    a.backend = HL_BACKEND_CUDA;
    a.x = dx;
    a.weight = dw;
    a.y = dy;
    a.rstd = dr;
    CHECK_HL(hl_rmsnorm_fwd(&a, stream));
    if (cudaMemcpyAsync(y, dy, sizeof y, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaMemcpyAsync(rstd, dr, sizeof rstd, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess) {
      fprintf(stderr, "CUDA copy failed\n");
      return 1;
    }
    cudaFree(dx); cudaFree(dw); cudaFree(dy); cudaFree(dr);
    cudaStreamDestroy(stream);
  }
#endif
  if (!gpu) {
    a.backend = HL_BACKEND_CPU;
    a.x = x;
    a.weight = w;
    a.y = y;
    a.rstd = rstd;
    CHECK_HL(hl_rmsnorm_fwd(&a, NULL));
  }
  printf("headloss %d, rmsnorm_fwd on the %s backend\n", hl_get_version(), gpu ? "CUDA" : "CPU");
  for (int i = 0; i < ROWS; ++i) {
    printf("row %d  rstd %.5f  y[0..3] = %8.4f %8.4f %8.4f %8.4f\n", i, rstd[i], y[i * COLS],
           y[i * COLS + 1], y[i * COLS + 2], y[i * COLS + 3]);
  }
  return 0;
}
