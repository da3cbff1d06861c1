// hl_loss_plan_execute_nccl: statistics, one in-place ncclAllGather (dense JSD: then its middle
// step and a second one), finish (and for the fused linear form an in-place ncclAllReduce of
// grad_hidden), on the caller's communicator and stream. NCCL is loaded at run time (dlopen), so the library needs it neither to
// build nor to load; only this call does.
#include <cuda_runtime.h>

#include "common/cuda_util.h"
#include "common/dynlib.h"
#include "hl/loss/plan.h"
#include "hl/status.h"
#include "loss/launch.h"
#include "loss/steps.h"

namespace hl::loss::dev {
using namespace hl::dev;  // dynlib.h

namespace {

// The NCCL entry points used, with nccl.h's ABI: results are ints (0: ncclSuccess), ncclUint8 is 1.
struct Nccl {
  int (*all_gather)(const void *, void *, size_t, int, void *, void *) = nullptr;
  int (*all_reduce)(const void *, void *, size_t, int, int, void *, void *) = nullptr;
  int (*count)(void *, int *) = nullptr;
  int (*user_rank)(void *, int *) = nullptr;
  int (*cu_device)(void *, int *) = nullptr;
  const char *(*error_string)(int) = nullptr;
  DynlibError err;  // why NCCL is unusable, when it is
};
constexpr int kNcclUint8 = 1, kNcclFloat16 = 6, kNcclFloat32 = 7, kNcclBfloat16 = 9, kNcclSum = 0;

// Loaded once (thread-safe static initialisation).
const Nccl &nccl() {
  static const Nccl loaded = [] {
    Nccl n;
    const char *names[] = {"libnccl.so.2"};
    void *lib = open_library("HL_NCCL_LIBRARY", names, 1, n.err);
    if (lib && !(bind(lib, "ncclCommCount", n.count, n.err) &&
                 bind(lib, "ncclCommUserRank", n.user_rank, n.err) &&
                 bind(lib, "ncclCommCuDevice", n.cu_device, n.err) &&
                 bind(lib, "ncclGetErrorString", n.error_string, n.err) &&
                 bind(lib, "ncclAllReduce", n.all_reduce, n.err) &&
                 bind(lib, "ncclAllGather", n.all_gather, n.err)))
      n.all_gather = nullptr;
    return n;
  }();
  return loaded;
}

}  // namespace
}  // namespace hl::loss::dev

#define HL_NCCL_TRY(call)                                                                      \
  do {                                                                                         \
    const int hl_nccl_r_ = (call);                                                             \
    if (hl_nccl_r_ != 0)                                                                       \
      return fail(HL_STATUS_NCCL_ERROR, "%s: %s failed: %s (%d)", fn, #call,                   \
                  n.error_string(hl_nccl_r_), hl_nccl_r_);                                    \
  } while (0)

namespace hl::loss {
using namespace dev;

hl_status_t nccl_execute(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                         void *comm, void *workspace, size_t workspace_bytes, hl_stream_t stream) {
  const Nccl &n = nccl();
  if (!n.all_gather) return fail(HL_STATUS_NOT_SUPPORTED, "%s: NCCL: %s", fn, n.err.why);
  int ranks = 0, rank = 0, comm_dev = 0, dev = 0;
  HL_NCCL_TRY(n.count(comm, &ranks));
  HL_NCCL_TRY(n.user_rank(comm, &rank));
  HL_NCCL_TRY(n.cu_device(comm, &comm_dev));
  if (ranks != p.desc.ranks)
    return fail(HL_STATUS_INVALID_VALUE, "%s: the communicator has %d ranks; the plan has %d", fn,
                ranks, p.desc.ranks);
  if (cudaGetDevice(&dev) != cudaSuccess || dev != comm_dev)
    return fail(HL_STATUS_INVALID_VALUE, "%s: the communicator is on device %d; the current device "
                "is %d", fn, comm_dev, dev);
  const hl_loss_plan_desc_t &d = p.desc;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  char *gathered = static_cast<char *>(cuda_gathered(p, a.rows, workspace));
  const size_t bb = block_bytes(p, a.rows);
  HL_TRY(cuda_stats(fn, p, a, gathered + size_t(rank) * bb, workspace, workspace_bytes, stream));
  HL_NCCL_TRY(n.all_gather(gathered + size_t(rank) * bb, gathered, bb, kNcclUint8, comm, stream));
  // Dense JSD: the middle step into this rank's slot of the middle blocks, a second all-gather.
  char *middle = p.exchanges == 2 ? static_cast<char *>(cuda_gathered(p, a.rows, workspace, true)) : nullptr;
  if (middle) {
    const size_t mb = block_bytes(p, a.rows, true);
    HL_TRY(cuda_middle(fn, p, a, gathered, middle + size_t(rank) * mb, workspace, workspace_bytes, stream));
    HL_NCCL_TRY(n.all_gather(middle + size_t(rank) * mb, middle, mb, kNcclUint8, comm, stream));
  }
  // The sum of the ranks' grad_hidden parts: with ACCUMULATE, rank 0 adds its part to the buffer
  // and the others start from zero, so the all-reduce adds the old value once.
  const bool reduce = a.grad_hidden && a.rows > 0;
  const size_t gh_bytes = size_t(a.rows) * size_t(d.hidden) * dtype_size(d.grad_hidden_dtype);
  if (reduce && rank != 0 && d.grad_hidden_mode == HL_LOSS_GRAD_ACCUMULATE)
    HL_CUDA_TRY(cudaMemsetAsync(a.grad_hidden, 0, gh_bytes, s));
  HL_TRY(cuda_finish(fn, p, a, gathered, middle, workspace, workspace_bytes, stream));
  if (!reduce) return HL_STATUS_SUCCESS;
  const int dt = d.grad_hidden_dtype == HL_DTYPE_F32 ? kNcclFloat32
                 : d.grad_hidden_dtype == HL_DTYPE_F16 ? kNcclFloat16 : kNcclBfloat16;
  HL_NCCL_TRY(n.all_reduce(a.grad_hidden, a.grad_hidden, size_t(a.rows) * size_t(d.hidden), dt,
                           kNcclSum, comm, stream));
  return HL_STATUS_SUCCESS;
}

}  // namespace hl::loss
