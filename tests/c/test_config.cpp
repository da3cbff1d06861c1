// The tuning choices of every op (kernels/<op>/config.h), checked without a GPU: the tables cover
// every shape up to the ops' limits, the environment switches parse, and a choice depends on the
// shape alone. `test_config --print` also prints the choice for representative shapes (the table
// the docs' "Tuning choices" sections explain).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "gdn/config.h"
#include "loss/config.h"
#include "rmsnorm/config.h"

namespace {

int failures = 0;
#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      ++failures;                                         \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                           \
      std::printf("\n");                                  \
    }                                                     \
  } while (0)

// RMSNorm: every row length up to the longest shape has one, in both directions, with and without
// clusters up to the cluster-free limit; the picks grow with the row.
template <bool BWD>
void check_rmsnorm() {
  using namespace hl::rmsnorm;
  const char *dir = BWD ? "backward" : "forward";
  int64_t most = 0, most_plain = 0;
  for (const Shape &s : Shapes<BWD>::at) {
    CHECK(s.block % s.tpr == 0, "%s: block %d, %d threads a row", dir, s.block, s.tpr);
    CHECK(s.block <= 1024 && s.cluster <= 8, "%s: block %d, cluster %d", dir, s.block, s.cluster);
    CHECK(!s.staged || BWD, "forward: no staging");
    CHECK(!s.staged || cache_weight(s.block), "backward staging: blocks that cache the weight");
    const int64_t holds = int64_t(s.tpr) * s.vpt * s.cluster;
    CHECK(holds >= most, "%s: the table grows (%lld after %lld)", dir, (long long)holds, (long long)most);
    most = holds;
    if (s.cluster == 1) most_plain = holds;
  }
  CHECK(most == (BWD ? 8192 : 16384), "%s: %lld packs a row at most (docs: 64K / 128K bf16 columns)", dir, (long long)most);
  for (int64_t rows : {int64_t(1), int64_t(2047), int64_t(2048), int64_t(1) << 20}) {
    int last = 0;
    for (int64_t packs = 1; packs <= most + 1; ++packs) {
      const int i = shape_for<BWD>(packs, rows, true);
      if (packs > most) {
        CHECK(i == -1, "%s: %lld packs past the tables", dir, (long long)packs);
        continue;
      }
      CHECK(i >= last, "%s: %lld packs, %lld rows: shape %d after %d", dir, (long long)packs, (long long)rows, i, last);
      last = i;
      const Shape &s = Shapes<BWD>::at[i];
      CHECK(packs <= int64_t(s.tpr) * s.vpt * s.cluster && rows >= s.min_rows, "%s: shape %d holds %lld packs", dir, i, (long long)packs);
      const int j = shape_for<BWD>(packs, rows, false);
      CHECK(packs <= most_plain ? j >= 0 && Shapes<BWD>::at[j].cluster == 1 : j == -1,
            "%s: %lld packs without clusters: shape %d", dir, (long long)packs, j);
      CHECK(s.cluster > 1 || j == i, "%s: clusters change a cluster-free pick (%d, %d)", dir, i, j);
      CHECK(shape_for<BWD>(packs, rows, true) == i, "%s: the pick is a function of the shape", dir);
    }
  }
}

void print_rmsnorm() {
  using namespace hl::rmsnorm;
  std::printf("RMSNorm (kernels/rmsnorm/config.h), bf16 rows (fp32: half the columns a pack):\n");
  for (bool bwd : {false, true})
    for (int64_t cols : {64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144})
      for (int64_t rows : {int64_t(1024), int64_t(32768)}) {
        std::printf("  %s %6lld x %6lld: %s\n", bwd ? "bwd" : "fwd", (long long)rows, (long long)cols,
                    describe(choose(bwd, rows, cols, 2, true)).c_str());
        const Choice plain = choose(bwd, rows, cols, 2, false);
        if (plain.shape != choose(bwd, rows, cols, 2, true).shape)
          std::printf("  %s %6lld x %6lld without clusters (not the sm_90 code): %s\n", bwd ? "bwd" : "fwd",
                      (long long)rows, (long long)cols, describe(plain).c_str());
      }
  std::printf("  fwd   1024 x   4097 (unaligned): %s\n", describe(choose(false, 1024, 4097, 2, true)).c_str());
}

// The loss: a row's cluster is the smallest whose slice fits the target (or the most), kept only
// where it fits the shared memory; no clusters, bulk copies or early start without the sm_90 code.
constexpr size_t kH100Optin = 227 * 1024;
void check_loss() {
  using namespace hl::loss;
  for (bool sm90 : {false, true})
    for (bool teacher : {false, true})
      for (size_t elt : {size_t(2), size_t(4)})
        for (int64_t vocab = 1; vocab < (int64_t(1) << 22); vocab = vocab * 3 / 2 + 1) {
          const RowShape s = row_shape(vocab, elt, kH100Optin, sm90, teacher);
          const auto bytes = [&](int cl) { return size_t(slice_cols(vocab, cl, int(16 / elt))) * elt; };
          const int most = sm90 ? kMaxCluster : 1;
          CHECK(s.cluster >= 1 && s.cluster <= most && (s.cluster & (s.cluster - 1)) == 0, "vocab %lld: cluster %d",
                (long long)vocab, s.cluster);
          CHECK(s.slice_bytes == bytes(s.cluster), "vocab %lld: slice bytes", (long long)vocab);
          CHECK(s.keep_row == (s.slice_bytes <= s.smem_cap), "vocab %lld: kept iff it fits", (long long)vocab);
          CHECK(s.cluster == 1 || bytes(s.cluster / 2) > kKeepTarget, "vocab %lld: cluster %d is not the smallest",
                (long long)vocab, s.cluster);
          CHECK(!s.keep_row || s.slice_bytes <= kKeepTarget || s.cluster == most, "vocab %lld: the target",
                (long long)vocab);
          CHECK(s.keep_row || s.cluster <= 8, "vocab %lld: re-read rows in portable clusters", (long long)vocab);
          CHECK(!s.bulk || (sm90 && s.keep_row && s.bulk_bytes <= s.smem_cap), "vocab %lld: bulk", (long long)vocab);
          CHECK(teacher || s.bulk_cluster == s.cluster, "vocab %lld: bulk cluster", (long long)vocab);
          CHECK(sm90 || (s.small_cluster == 1 && !s.early_start), "vocab %lld: sm_80 code", (long long)vocab);
          const RowShape t = row_shape(vocab, elt, kH100Optin, sm90, teacher);
          CHECK(describe(s) == describe(t), "a function of the shape");
        }
  CHECK(gemm_tiles(false, false, 4096).want[0].rows == 0, "grad_hidden: the first answer");
  CHECK(gemm_tiles(false, true, 4096).want[0].rows == 128 && gemm_tiles(false, true, 8192).want[0].rows == 0,
        "grad_weight: 128 x 160 up to a hidden size of 4096");
  unsetenv("HEADLOSS_LINEAR_PATH");
  CHECK(!linear_path_rows(), "HEADLOSS_LINEAR_PATH unset");
  setenv("HEADLOSS_LINEAR_PATH", "rows", 1);
  CHECK(linear_path_rows(), "HEADLOSS_LINEAR_PATH=rows");
  setenv("HEADLOSS_LINEAR_PATH", "shifted", 1);
  CHECK(!linear_path_rows(), "HEADLOSS_LINEAR_PATH=shifted");
  unsetenv("HEADLOSS_LINEAR_PATH");
}

void print_loss() {
  using namespace hl::loss;
  std::printf("Loss (kernels/loss/config.h), H100 (227 KB a CTA):\n");
  for (int64_t vocab : {32000, 50257, 128256, 151936, 262144, 1000000})
    for (size_t elt : {size_t(2), size_t(4)})
      for (bool teacher : {false, true})
        std::printf("  vocab %7lld, %zu-byte logits%s: %s\n", (long long)vocab, elt, teacher ? ", dense teacher" : "",
                    describe(row_shape(vocab, elt, kH100Optin, true, teacher)).c_str());
  std::printf("  vocab  128256 without the sm_90 code: %s\n",
              describe(row_shape(128256, 2, kH100Optin, false, false)).c_str());
  std::printf("  cuBLASLt: logits = W X^T: %s\n", describe(gemm_tiles(true, false, 128256)).c_str());
  for (int64_t h : {4096, 8192})
    std::printf("  cuBLASLt: grad_weight (+)= G^T X, hidden %lld: %s\n", (long long)h,
                describe(gemm_tiles(false, true, h)).c_str());
  std::printf("  cuBLASLt: grad_hidden = G W: %s\n", describe(gemm_tiles(false, false, 8192)).c_str());
  std::printf("  fused linear: chunks of up to %lld rows\n", (long long)kFastRows);
}

// GDN: every K, V up to kMaxDim has a Hopper shape whose CTAs cover K (two at most) and V, a hand
// copy where a map cannot take the rows, and narrow copies only in ODD = 2; HEADLOSS_GDN_KERNEL parses.
void check_gdn() {
  using namespace hl::gdn;
  for (int64_t H : {1, 2, 3, 15, 16})
    for (int64_t G : {1, 2, 3})
      for (int64_t K = 1; K <= kMaxDim; ++K)
        for (int64_t V : {int64_t(1), int64_t(2), int64_t(4), int64_t(8), int64_t(100), K, kMaxDim})
          for (bool s32 : {false, true})
            for (bool vf : {false, true}) {
              const Sm90Shape s = sm90_shape(H, H * G, K, V, s32, vf);
              CHECK(s.nsplit * s.KH >= s.Kc && s.Kc >= K && s.nsplit <= 2, "K %lld: %d CTAs of %d", (long long)K, s.nsplit, s.KH);
              CHECK(s.VCN * 64 >= s.Vc && s.Vc >= V, "V %lld: %d stages", (long long)V, s.VCN);
              CHECK(!(s.hand_qk && s.fold_k) && (K % 8 == 0) == !(s.hand_qk || s.fold_k), "K %lld: q, k", (long long)K);
              CHECK(!(s.hand_v && s.fold_v) && (V % 8 == 0) == !(s.hand_v || s.fold_v), "V %lld: v", (long long)V);
              CHECK(!s.fold_k || (H * K) % 8 == 0, "K %lld: folded maps need H K a multiple of 8", (long long)K);
              CHECK(!s.hand_states || !s32, "fp32 states are the producer's anyway");
              CHECK((s.odd == 0) == (K % 8 == 0 && V % 8 == 0) || s.odd == 2, "K %lld V %lld: ODD %d", (long long)K,
                    (long long)V, s.odd);
              CHECK(s.odd != 2 || s.stage_regs || (s32 && s.sw < 4) || (s.hand_qk && s.qw == 1),
                    "K %lld V %lld: ODD 2 without narrow copies", (long long)K, (long long)V);
              CHECK(describe(s) == describe(sm90_shape(H, H * G, K, V, s32, vf)), "a function of the shape");
            }
  CHECK(portable_copy(100, 100, 16) == 4 && portable_copy(128, 64, 16) == 8 && portable_copy(128, 64, 4) == 2 &&
            portable_copy(7, 64, 16) == 1,
        "portable copies");
  CHECK(portable_split(4, true) == 4 && portable_split(4, false) == 1 && portable_split(1, true) == 1, "K slices");
  unsetenv("HEADLOSS_GDN_KERNEL");
  CHECK(forced_kernel() == Forced::kNone, "HEADLOSS_GDN_KERNEL unset");
  setenv("HEADLOSS_GDN_KERNEL", "portable", 1);
  CHECK(forced_kernel() == Forced::kPortable, "HEADLOSS_GDN_KERNEL=portable");
  setenv("HEADLOSS_GDN_KERNEL", "sm90", 1);
  CHECK(forced_kernel() == Forced::kSm90, "HEADLOSS_GDN_KERNEL=sm90");
  setenv("HEADLOSS_GDN_KERNEL", "other", 1);
  CHECK(forced_kernel() == Forced::kNone, "HEADLOSS_GDN_KERNEL=other");
  unsetenv("HEADLOSS_GDN_KERNEL");
}

void print_gdn() {
  using namespace hl::gdn;
  std::printf("GDN (kernels/gdn/config.h), the Hopper kernel:\n");
  const struct {
    int64_t H, HV, K, V;
  } shapes[] = {{16, 16, 128, 128}, {16, 32, 128, 128}, {8, 8, 64, 64}, {4, 4, 256, 256},
                {16, 16, 100, 100}, {15, 15, 100, 100}, {16, 16, 100, 128}, {3, 3, 99, 97}};
  for (const auto &x : shapes)
    for (bool s32 : {false, true})
      std::printf("  H %2lld HV %2lld K %3lld V %3lld, %s states: %s\n", (long long)x.H, (long long)x.HV,
                  (long long)x.K, (long long)x.V, s32 ? "fp32" : "16-bit",
                  describe(sm90_shape(x.H, x.HV, x.K, x.V, s32, false)).c_str());
  std::printf("  the portable kernel: %d threads, %d stages of %d V columns; K = V = 100 copies %d elements\n", kThreads,
              kStages, kVC, portable_copy(100, 100, 16));
}

}  // namespace

int main(int argc, char **argv) {
  const bool print = argc > 1 && std::strcmp(argv[1], "--print") == 0;
  check_rmsnorm<false>();
  check_rmsnorm<true>();
  check_loss();
  check_gdn();
  if (print) print_rmsnorm(), print_loss(), print_gdn();
  std::printf("%s: %d failures\n", argv[0], failures);
  return failures ? 1 : 0;
}
