// Programmatic dependent launch, the device side (sm_90; no-ops elsewhere). A kernel launched with
// allow_early_start (cuda_util.h) may begin while the kernel before it on the stream still runs:
// that kernel calls let_next_grid_start() once the next may begin, and the next calls
// wait_for_previous_grid() before it reads anything the previous one writes.
#pragma once

namespace hl::dev {

__device__ __forceinline__ void let_next_grid_start() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace hl::dev
