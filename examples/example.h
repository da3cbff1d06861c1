/* What every example shares: a check of each headloss call that prints the status and the
 * library's message, then exits; buffers on the backend's side (device memory on CUDA, host
 * memory on the CPU backend). */
#ifndef HEADLOSS_EXAMPLE_H_
#define HEADLOSS_EXAMPLE_H_

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "headloss.h"

#if HL_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#define CHECK_HL(call)                                                                          \
  do {                                                                                          \
    hl_status_t s_ = (call);                                                                    \
    if (s_ != HL_STATUS_SUCCESS) {                                                              \
      fprintf(stderr, "%s failed: %s\n  %s\n", #call, hl_get_error_string(s_), hl_get_last_error()); \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

/* A copy of `host` (or, host NULL, uninitialised memory) of `bytes` on the backend's side. */
static inline void *put(int gpu, const void *host, size_t bytes) {
  void *p = NULL;
#if HL_HAVE_CUDA
  if (gpu) {
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) fprintf(stderr, "cudaMalloc failed\n"), exit(1);
    if (host && cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess)
      fprintf(stderr, "cudaMemcpy failed\n"), exit(1);
    return p;
  }
#endif
  (void)gpu;
  p = malloc(bytes ? bytes : 1);
  if (!p) fprintf(stderr, "out of memory\n"), exit(1);
  if (host) memcpy(p, host, bytes);
  return p;
}

/* `bytes` of `src` (from put) into host memory. */
static inline void get(int gpu, void *host, const void *src, size_t bytes) {
#if HL_HAVE_CUDA
  if (gpu) {
    if (cudaMemcpy(host, src, bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
      fprintf(stderr, "cudaMemcpy failed\n"), exit(1);
    return;
  }
#endif
  (void)gpu;
  memcpy(host, src, bytes);
}

static inline void release(int gpu, void *p) {
#if HL_HAVE_CUDA
  if (gpu) {
    cudaFree(p);
    return;
  }
#endif
  (void)gpu;
  free(p);
}

#endif
