// gdn_bwd_dqkwg's CUDA backend as src/ sees it: the only header of kernels/gdn/ that src/ includes
// (CMake gives the host library this file alone). Plain C++ on the validated arguments: no CUDA
// type crosses here. Defined in dqkwg.cu. `cu` holds the host copy of cu_seqlens as int64 (empty
// without varlen) and `chunks` the total chunk count NT.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "headloss.h"

namespace hl::gdn {

size_t cuda_workspace_bytes(const hl_gdn_bwd_dqkwg_args_t &a);
// Copies cu_seqlens (device memory) to the host as int64; synchronises the stream.
hl_status_t cuda_read_cu_seqlens(const hl_gdn_bwd_dqkwg_args_t &a, hl_stream_t stream,
                                 std::vector<int64_t> *cu);
hl_status_t cuda_dqkwg(const hl_gdn_bwd_dqkwg_args_t &a, const std::vector<int64_t> &cu,
                       int64_t chunks, hl_stream_t stream);

}  // namespace hl::gdn
