// Libraries loaded at run time (dlopen) and never unloaded: NCCL and cuBLASLt serve only some
// calls, so headloss neither links them nor needs them to load.
#pragma once

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

namespace hl::dev {

// Why a library is unusable (empty while it is usable).
struct DynlibError {
  char why[512] = "";
};

// Opens the library named by $env_var when set, else the first of `names` that loads; nullptr
// with the reason in err.
inline void *open_library(const char *env_var, const char *const *names, int n, DynlibError &err) {
  const char *env = std::getenv(env_var);
  if (env && *env) names = &env, n = 1;
  for (int i = 0; i < n; ++i)
    if (void *lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL)) return lib;
  std::snprintf(err.why, sizeof err.why, "cannot load %s: %s; install it or name the library in %s",
                names[n - 1], dlerror(), env_var);
  return nullptr;
}

// Binds the library's `name` into f; false with the reason in err.
template <class F>
bool bind(void *lib, const char *name, F &f, DynlibError &err) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (!f) std::snprintf(err.why, sizeof err.why, "the loaded library has no %s (too old?)", name);
  return f != nullptr;
}

}  // namespace hl::dev
