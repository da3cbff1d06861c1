// The fused linear form's matrix products on cuBLASLt, loaded at run time (common/dynlib.h). One Gemms
// object per plan: its handle, and the algorithm of each product shape chosen once (among the
// heuristic's deterministic answers, split-K only with fp32 partials in the workspace: its first,
// or a tile measured faster for the product's form; gemm.cpp's preferred()).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "headloss.h"

namespace hl::loss::dev {

// D = op(A) op(B) (+ D), column-major as cuBLASLt sees it: op(A) is m x k, op(B) k x n, D m x n.
// A and B share the plan's operand dtype; accumulation is fp32.
struct GemmCall {
  bool ta, tb;  // op(A) = A^T, op(B) = B^T
  int64_t m, n, k;
  const void *a;
  int64_t lda;
  const void *b;
  int64_t ldb;
  void *d;
  int64_t ldd;
  hl_dtype_t d_dtype;
  bool accumulate;  // D += op(A) op(B), else D = op(A) op(B)
  const void *bias = nullptr;  // [m] in d_dtype added to every column of D (cuBLASLt's bias epilogue)
};

struct Gemms;

// The state for one plan: loads cuBLASLt (NOT_SUPPORTED with the reason where it cannot) and makes
// a handle on the current device.
hl_status_t make_gemms(const char *fn, hl_dtype_t operand, std::shared_ptr<Gemms> *out);
// The device the state was made on (its plan runs there only).
int gemms_device(const Gemms &g);
// cuBLASLt's workspace for the products (split-K partials; the algorithms without them need none).
struct GemmSpace {
  void *ptr;
  size_t bytes;
};
// Runs one product on `stream`: the algorithm chosen for its shape among those that fit the workspace.
hl_status_t run_gemm(const char *fn, Gemms &g, const GemmCall &c, GemmSpace ws, cudaStream_t stream);

// The most cuBLASLt workspace a product may use (the fused linear form gives it less where the
// caller's workspace is tight: linear.cu's layout()).
constexpr size_t kGemmWorkspace = size_t(32) << 20;

}  // namespace hl::loss::dev
