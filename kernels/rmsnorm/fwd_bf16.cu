// RMSNorm forward kernels for __nv_bfloat16 x (one file per x dtype so that they compile in parallel).
#include "rmsnorm/fwd.cuh"

namespace hl::rmsnorm::dev {
template hl_status_t fwd_x<__nv_bfloat16>(const FwdParams &p, hl_dtype_t y_dtype, hl_stream_t stream);
}  // namespace hl::rmsnorm::dev
