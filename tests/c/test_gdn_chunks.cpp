// GDN's chunk decomposition (common/hl/gdn/chunks.h, compiled for the host): the kernels' lookup of a
// chunk by its number (locate_chunk) against the host's walk (Chunks::list), over dense batches and
// ragged cu_seqlens (empty sequences, lengths around multiples of 64); and the walk itself covers
// every token once, in chunks that stay inside their sequence.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {  // cmocka.h declares C functions without saying so
#include <cmocka.h>
}

#include <vector>

#include "hl/gdn/chunks.h"

using namespace hl::gdn;

// cu: cu_seqlens, or empty (B rows of T tokens).
static void check(int64_t B, int64_t T, const std::vector<int64_t> &cu) {
  const Chunks host(B, T, cu);
  const std::vector<Chunk> list = host.list();
  std::vector<int64_t> ends;  // where sequences end, in tokens
  for (int64_t b = 1; cu.empty() && b <= B; ++b) ends.push_back(b * T);
  for (size_t s = 1; s < cu.size(); ++s) ends.push_back(cu[s]);
  int64_t expect = 0;
  for (size_t s = 0; s < ends.size(); ++s) expect += chunks_in(ends[s] - (s ? ends[s - 1] : 0));
  assert_int_equal(host.count(), expect);
  assert_int_equal(int64_t(list.size()), expect);

  const int64_t S = cu.empty() ? 0 : int64_t(cu.size()) - 1;
  const ChunkTable table = chunk_table(cu.empty() ? nullptr : host.table().data(), S, T, chunks_in(T));
  int64_t next = 0;  // the first token no chunk has covered yet
  size_t seq = 0;
  for (int64_t cid = 0; cid < int64_t(list.size()); ++cid) {
    const Chunk &c = list[size_t(cid)];
    while (ends[seq] <= c.tok0) ++seq;
    assert_int_equal(c.tok0, next);
    assert_true(c.rows >= 1 && c.rows <= kChunk);
    assert_true(c.tok0 + c.rows <= ends[seq]);
    if (c.rows < kChunk) assert_int_equal(c.tok0 + c.rows, ends[seq]);  // only a sequence's last is partial
    next = c.tok0 + c.rows;
    int64_t tok0 = -1;
    int rows = -1;
    locate_chunk(table, cid, &tok0, &rows);
    assert_int_equal(tok0, c.tok0);
    assert_int_equal(rows, c.rows);
  }
  assert_int_equal(next, ends.back());
}

static void dense(void **) {
  for (int64_t B : {1, 2, 5})
    for (int64_t T : {1, 63, 64, 65, 127, 128, 129, 1000}) check(B, T, {});
}

static void varlen_ragged(void **) {
  check(1, 0, {0, 0});
  check(1, 64, {0, 64});
  check(1, 65, {0, 0, 0, 65, 65});  // empty sequences first, between and last
  uint64_t x = 12345;
  const auto rand = [&](uint64_t n) {  // a fixed LCG: the same cases every run
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return int64_t((x >> 33) % n);
  };
  const int64_t lens[] = {0, 0, 1, 2, 63, 64, 65, 127, 128, 129, 191, 200, 4096};
  for (int round = 0; round < 500; ++round) {
    std::vector<int64_t> cu{0};
    const int64_t S = 1 + rand(40);
    for (int64_t s = 0; s < S; ++s)
      cu.push_back(cu.back() + (rand(2) ? lens[rand(sizeof lens / sizeof lens[0])] : rand(300)));
    check(1, cu.back(), cu);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(dense), cmocka_unit_test(varlen_ragged)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
