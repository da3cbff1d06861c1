// One-instruction math shared by the kernels.
#pragma once

namespace hl::dev {

// 2^x in one MUFU instruction (exp2f adds a denormal fix-up; results below 2^-126 flush to 0).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace hl::dev
