// cuBLASLt, loaded at run time; the product shapes' algorithms, chosen once per plan.
#include "loss/gemm.h"

#include <cublasLt.h>

#include <mutex>
#include <vector>

#include "common/dynlib.h"
#include "hl/status.h"
#include "loss/config.h"

namespace hl::loss::dev {
using namespace hl::dev;  // dynlib.h

namespace {

// The cuBLASLt entry points used (cublasLt.h's declarations give their types).
struct Lt {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtDestroy) destroy = nullptr;
  decltype(&cublasLtGetStatusString) status_string = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  decltype(&cublasLtMatmulAlgoConfigGetAttribute) algo_get = nullptr;
  DynlibError err;
};

const Lt &lt() {
  static const Lt loaded = [] {
    Lt l;
    const char *names[] = {"libcublasLt.so.13", "libcublasLt.so"};
    void *lib = open_library("HL_CUBLASLT_LIBRARY", names, 2, l.err);
    if (lib && !(bind(lib, "cublasLtCreate", l.create, l.err) &&
                 bind(lib, "cublasLtDestroy", l.destroy, l.err) &&
                 bind(lib, "cublasLtGetStatusString", l.status_string, l.err) &&
                 bind(lib, "cublasLtMatmulDescCreate", l.desc_create, l.err) &&
                 bind(lib, "cublasLtMatmulDescDestroy", l.desc_destroy, l.err) &&
                 bind(lib, "cublasLtMatmulDescSetAttribute", l.desc_set, l.err) &&
                 bind(lib, "cublasLtMatrixLayoutCreate", l.layout_create, l.err) &&
                 bind(lib, "cublasLtMatrixLayoutDestroy", l.layout_destroy, l.err) &&
                 bind(lib, "cublasLtMatmulPreferenceCreate", l.pref_create, l.err) &&
                 bind(lib, "cublasLtMatmulPreferenceDestroy", l.pref_destroy, l.err) &&
                 bind(lib, "cublasLtMatmulPreferenceSetAttribute", l.pref_set, l.err) &&
                 bind(lib, "cublasLtMatmulAlgoGetHeuristic", l.heuristic, l.err) &&
                 bind(lib, "cublasLtMatmul", l.matmul, l.err) &&
                 bind(lib, "cublasLtMatmulAlgoConfigGetAttribute", l.algo_get, l.err)))
      l.matmul = nullptr;
    return l;
  }();
  return loaded;
}

cudaDataType_t cuda_type(hl_dtype_t dt) {
  return dt == HL_DTYPE_F32 ? CUDA_R_32F : dt == HL_DTYPE_F16 ? CUDA_R_16F : CUDA_R_16BF;
}

// The largest power of two (up to 256) dividing a pointer: the alignment cuBLASLt may assume.
uint32_t alignment(const void *p) {
  const uintptr_t u = reinterpret_cast<uintptr_t>(p) | 256;
  return uint32_t(u & (~u + 1));
}

// What the algorithm of a product depends on.
struct Shape {
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldd;
  hl_dtype_t d_dtype;
  uint32_t align_a, align_b, align_d;
  size_t ws;  // the workspace the algorithm may use
  bool bias;  // the bias epilogue
  bool operator==(const Shape &o) const {
    return ta == o.ta && tb == o.tb && m == o.m && n == o.n && k == o.k && lda == o.lda &&
           ldb == o.ldb && ldd == o.ldd && d_dtype == o.d_dtype && align_a == o.align_a &&
           align_b == o.align_b && align_d == o.align_d && ws == o.ws && bias == o.bias;
  }
};

// A shape's descriptors and algorithm, made once.
struct Prepared {
  Shape shape;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Prepared() {
    const Lt &l = lt();
    for (cublasLtMatrixLayout_t x : {a, b, d})
      if (x) l.layout_destroy(x);
    if (desc) l.desc_destroy(desc);
  }
};

}  // namespace

struct Gemms {
  cublasLtHandle_t handle = nullptr;
  hl_dtype_t operand = HL_DTYPE_NONE;
  int device = 0;
  std::mutex mu;                                // plans may run from several threads
  std::vector<std::unique_ptr<Prepared>> cache;  // a handful of shapes a plan

  ~Gemms() {
    cache.clear();
    if (handle) lt().destroy(handle);
  }
};

#define HL_LT_TRY(call)                                                                           \
  do {                                                                                            \
    const cublasStatus_t hl_lt_s_ = (call);                                                       \
    if (hl_lt_s_ != CUBLAS_STATUS_SUCCESS)                                                        \
      return fail(HL_STATUS_CUDA_ERROR, "%s: cuBLASLt: %s failed: %s (%d)", fn, #call,            \
                  lt().status_string(hl_lt_s_), int(hl_lt_s_));                                   \
  } while (0)

namespace {

int algo_attr(const cublasLtMatmulAlgo_t &a, cublasLtMatmulAlgoConfigAttributes_t attr) {
  uint32_t v = 0;  // the tile and split-k attributes are 32-bit
  size_t written = 0;
  return lt().algo_get(&a, attr, &v, sizeof v, &written) == CUBLAS_STATUS_SUCCESS ? int(v) : -1;
}

// cuBLASLt's id of a tile config.h prefers, or -1.
int tile_id(Tile t) {
  static constexpr struct {
    Tile t;
    cublasLtMatmulTile_t id;
  } kIds[] = {{{176, 128}, CUBLASLT_MATMUL_TILE_176x128},
              {{168, 128}, CUBLASLT_MATMUL_TILE_168x128},
              {{128, 160}, CUBLASLT_MATMUL_TILE_128x160},
              {{256, 128}, CUBLASLT_MATMUL_TILE_256x128}};
  for (const auto &e : kIds)
    if (e.t.rows == t.rows && e.t.cols == t.cols) return int(e.id);
  return -1;
}

// Which answer to take: the first, unless the heuristic also offers a tile config.h prefers for
// the product's form (gemm_tiles(); measured in docs/loss.md, "Tuning choices").
int preferred(const Shape &s, const cublasLtMatmulHeuristicResult_t *r, int found) {
  for (const Tile &want : gemm_tiles(s.ta, s.tb, s.m).want) {
    const int tile = tile_id(want);
    for (int i = 0; tile >= 0 && i < found; ++i)
      if (algo_attr(r[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID) == tile &&
          algo_attr(r[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) == 1)
        return i;
  }
  return 0;
}

// A shape's operation descriptor; with the bias epilogue, `bias` is its vector (the bias's dtype
// is D's, cuBLASLt's default).
hl_status_t make_desc(const char *fn, const Shape &s, const void *bias, cublasLtMatmulDesc_t *desc) {
  const Lt &l = lt();
  HL_LT_TRY(l.desc_create(desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = s.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = s.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  HL_LT_TRY(l.desc_set(*desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  HL_LT_TRY(l.desc_set(*desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (!s.bias) return HL_STATUS_SUCCESS;
  const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  HL_LT_TRY(l.desc_set(*desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue));
  HL_LT_TRY(l.desc_set(*desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  return HL_STATUS_SUCCESS;
}

// The descriptors of a shape and its algorithm: the heuristic's deterministic answer that
// preferred() picks. bias: a stand-in for the bias epilogue's vector (each call sets its own).
hl_status_t prepare(const char *fn, Gemms &g, const Shape &s, const void *bias, Prepared &p) {
  const Lt &l = lt();
  p.shape = s;
  const cudaDataType_t in = cuda_type(g.operand), out = cuda_type(s.d_dtype);
  HL_TRY(make_desc(fn, s, bias, &p.desc));
  HL_LT_TRY(l.layout_create(&p.a, in, uint64_t(s.ta ? s.k : s.m), uint64_t(s.ta ? s.m : s.k), s.lda));
  HL_LT_TRY(l.layout_create(&p.b, in, uint64_t(s.tb ? s.n : s.k), uint64_t(s.tb ? s.k : s.n), s.ldb));
  HL_LT_TRY(l.layout_create(&p.d, out, uint64_t(s.m), uint64_t(s.n), s.ldd));
  cublasLtMatmulPreference_t pref = nullptr;
  HL_LT_TRY(l.pref_create(&pref));
  struct Release {
    cublasLtMatmulPreference_t p;
    ~Release() { lt().pref_destroy(p); }
  } release{pref};
  const size_t ws = s.ws;
  // Split-K only with fp32 partials in the workspace (not summed in place in a 16-bit output).
  const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  HL_LT_TRY(l.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  HL_LT_TRY(l.pref_set(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof schemes));
  HL_LT_TRY(l.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &s.align_a, sizeof s.align_a));
  HL_LT_TRY(l.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &s.align_b, sizeof s.align_b));
  HL_LT_TRY(l.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &s.align_d, sizeof s.align_d));
  HL_LT_TRY(l.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &s.align_d, sizeof s.align_d));
  cublasLtMatmulHeuristicResult_t r[kAnswers]{};
  int found = 0;
  HL_LT_TRY(l.heuristic(g.handle, p.desc, p.a, p.b, p.d, p.d, pref, kAnswers, r, &found));
  if (found < 1)
    return fail(HL_STATUS_NOT_SUPPORTED, "%s: cuBLASLt has no algorithm for a %lld x %lld x %lld "
                "product (%s operands)", fn, (long long)s.m, (long long)s.n, (long long)s.k,
                dtype_name(g.operand));
  p.algo = r[preferred(s, r, found)].algo;
  return HL_STATUS_SUCCESS;
}

}  // namespace

hl_status_t make_gemms(const char *fn, hl_dtype_t operand, std::shared_ptr<Gemms> *out) {
  const Lt &l = lt();
  if (!l.matmul) return fail(HL_STATUS_NOT_SUPPORTED, "%s: the fused linear form needs cuBLASLt: %s", fn, l.err.why);
  auto g = std::make_shared<Gemms>();
  g->operand = operand;
  if (cudaGetDevice(&g->device) != cudaSuccess) {
    (void)cudaGetLastError();
    return fail(HL_STATUS_CUDA_ERROR, "%s: cudaGetDevice failed", fn);
  }
  HL_LT_TRY(l.create(&g->handle));
  *out = std::move(g);
  return HL_STATUS_SUCCESS;
}

int gemms_device(const Gemms &g) { return g.device; }

hl_status_t run_gemm(const char *fn, Gemms &g, const GemmCall &c, GemmSpace ws, cudaStream_t stream) {
  const Shape s{c.ta, c.tb, c.m, c.n, c.k, c.lda, c.ldb, c.ldd, c.d_dtype,
                alignment(c.a), alignment(c.b), alignment(c.d), ws.bytes, c.bias != nullptr};
  const Prepared *p = nullptr;
  {
    std::lock_guard<std::mutex> lock(g.mu);
    for (const auto &e : g.cache)
      if (e->shape == s) p = e.get();
    if (!p) {
      auto e = std::make_unique<Prepared>();
      HL_TRY(prepare(fn, g, s, c.bias, *e));
      g.cache.push_back(std::move(e));
      p = g.cache.back().get();
    }
  }
  const float one = 1.0f, beta = c.accumulate ? 1.0f : 0.0f;
  // A call's bias pointer goes into a descriptor of its own: the shape's is shared by threads.
  struct CallDesc {
    cublasLtMatmulDesc_t d = nullptr;
    ~CallDesc() {
      if (d) lt().desc_destroy(d);
    }
  } own;
  if (c.bias) HL_TRY(make_desc(fn, s, c.bias, &own.d));
  HL_LT_TRY(lt().matmul(g.handle, c.bias ? own.d : p->desc, &one, c.a, p->a, c.b, p->b, &beta, c.d, p->d, c.d,
                        p->d, &p->algo, ws.ptr, ws.bytes, stream));
  return HL_STATUS_SUCCESS;
}

}  // namespace hl::loss::dev
