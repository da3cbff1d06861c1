// hl_loss_plan_execute_nccl: statistics, one in-place ncclAllGather, finish, on the caller's
// communicator and stream. NCCL is loaded at run time (dlopen), so the library needs it neither to
// build nor to load; only this call does.
#if HL_HAVE_CUDA
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

#include "../common.h"
#include "loss.h"

namespace hl::loss {
namespace {

// The NCCL entry points used, with nccl.h's ABI: results are ints (0: ncclSuccess), ncclUint8 is 1.
struct Nccl {
  int (*all_gather)(const void *, void *, size_t, int, void *, void *) = nullptr;
  int (*count)(void *, int *) = nullptr;
  int (*user_rank)(void *, int *) = nullptr;
  int (*cu_device)(void *, int *) = nullptr;
  const char *(*error_string)(int) = nullptr;
  char why[512] = "";  // why NCCL is unusable, when it is
};
constexpr int kNcclUint8 = 1;

template <class F>
bool bind(void *lib, const char *name, F &f, char (&why)[512], const char *path) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (!f) std::snprintf(why, sizeof why, "%s has no %s (NCCL too old?)", path, name);
  return f != nullptr;
}

// Loaded once (thread-safe static initialisation) and never unloaded.
const Nccl &nccl() {
  static const Nccl loaded = [] {
    Nccl n;
    const char *env = std::getenv("HL_NCCL_LIBRARY");
    const char *path = env && *env ? env : "libnccl.so.2";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      std::snprintf(n.why, sizeof n.why, "cannot load NCCL: %s; install NCCL or name the library "
                    "in HL_NCCL_LIBRARY", dlerror());
      return n;
    }
    Nccl b;
    if (bind(lib, "ncclCommCount", b.count, n.why, path) &&
        bind(lib, "ncclCommUserRank", b.user_rank, n.why, path) &&
        bind(lib, "ncclCommCuDevice", b.cu_device, n.why, path) &&
        bind(lib, "ncclGetErrorString", b.error_string, n.why, path) &&
        bind(lib, "ncclAllGather", b.all_gather, n.why, path))
      return b;
    return n;
  }();
  return loaded;
}

}  // namespace

#define HL_NCCL_TRY(call)                                                                      \
  do {                                                                                         \
    const int hl_nccl_r_ = (call);                                                             \
    if (hl_nccl_r_ != 0)                                                                       \
      return fail(HL_STATUS_NCCL_ERROR, "%s: %s failed: %s (%d)", fn, #call,                   \
                  n.error_string(hl_nccl_r_), hl_nccl_r_);                                    \
  } while (0)

hl_status_t nccl_execute(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                         void *comm, void *workspace, hl_stream_t stream) {
  const Nccl &n = nccl();
  if (!n.all_gather) return fail(HL_STATUS_NOT_SUPPORTED, "%s: %s", fn, n.why);
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
  char *gathered = static_cast<char *>(cuda_gathered(p, a.rows, workspace));
  const size_t bb = block_bytes(p, a.rows);
  HL_TRY(cuda_stats(fn, p, a, gathered + size_t(rank) * bb, stream));
  HL_NCCL_TRY(n.all_gather(gathered + size_t(rank) * bb, gathered, bb, kNcclUint8, comm, stream));
  return cuda_finish(fn, p, a, gathered, workspace, stream);
}

}  // namespace hl::loss
#endif  // HL_HAVE_CUDA
