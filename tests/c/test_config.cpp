// The tuning choices of every op (kernels/<op>/config.h), checked without a GPU: the tables cover
// every shape up to the ops' limits, the environment switches parse, and a choice depends on the
// shape alone. `test_config --print` also prints the choice for representative shapes (the table
// the docs' "Tuning choices" sections explain).
#include <cstdio>
#include <cstring>
#include <string>

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

}  // namespace

int main(int argc, char **argv) {
  const bool print = argc > 1 && std::strcmp(argv[1], "--print") == 0;
  check_rmsnorm<false>();
  check_rmsnorm<true>();
  if (print) print_rmsnorm();
  std::printf("%s: %d failures\n", argv[0], failures);
  return failures ? 1 : 0;
}
