// The entry points' names before 0.5 (no hl_ prefix), kept exported for callers built against them.
#include "headloss.h"

extern "C" {

HL_API hl_status_t rmsnorm_fwd(const hl_rmsnorm_fwd_args_t *args, hl_stream_t stream) {
  return hl_rmsnorm_fwd(args, stream);
}
HL_API hl_status_t rmsnorm_bwd_workspace_size(const hl_rmsnorm_bwd_args_t *args, size_t *bytes) {
  return hl_rmsnorm_bwd_workspace_size(args, bytes);
}
HL_API hl_status_t rmsnorm_bwd(const hl_rmsnorm_bwd_args_t *args, hl_stream_t stream) {
  return hl_rmsnorm_bwd(args, stream);
}
HL_API hl_status_t gdn_bwd_dqkwg_workspace_size(const hl_gdn_bwd_dqkwg_args_t *args, size_t *bytes) {
  return hl_gdn_bwd_dqkwg_workspace_size(args, bytes);
}
HL_API hl_status_t gdn_bwd_dqkwg(const hl_gdn_bwd_dqkwg_args_t *args, hl_stream_t stream) {
  return hl_gdn_bwd_dqkwg(args, stream);
}

}  // extern "C"
