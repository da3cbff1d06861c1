// Row kernels for float logits (one file per dtype so that they compile in parallel).
#include "loss/row_kernel.cuh"

namespace hl::loss::dev {
template const void *pick_row_kernel<float>(int phase, bool grad, bool cap, int distill);
template const void *pick_bulk_kernel<float>(int phase, bool grad, bool cap, int distill);
}  // namespace hl::loss::dev
