// HL_HD marks a function of common/ that both sides compile: inline on the host (the CPU backend,
// the host tests), host-and-device under nvcc (the kernels).
#pragma once

#if defined(__CUDACC__)
#define HL_HD __host__ __device__ __forceinline__
#else
#define HL_HD inline
#endif
