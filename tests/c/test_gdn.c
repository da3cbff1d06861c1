/* hl_gdn_bwd_dqkwg's validation: sizes, enumerations, cu_seqlens read exactly, descriptor sizes and
 * aliasing, each refused with a message naming the field and nothing written. Results are
 * tests/python/test_gdn.py's. */
#include "hl_test.h"

enum { T = 10, K = 8, V = 8 };

typedef struct {
  uint16_t q[T * K], k[T * K], v[T * V], do_[T * V], h[2 * K * V], dh[2 * K * V], dq[T * K], dk[T * K];
  float g[T], dg[T];
} Bufs;

/* A valid CPU call on b: one sequence of T tokens (two chunks), one head, F16, a LOG gate. */
static hl_gdn_bwd_dqkwg_args_t args_for(Bufs *b) {
  hl_gdn_bwd_dqkwg_args_t a = HL_GDN_BWD_DQKWG_ARGS_INIT;
  a.backend = HL_BACKEND_CPU;
  a.B = 1, a.T = T, a.H = a.HV = 1, a.K = K, a.V = V;
  a.dtype = a.h_dtype = HL_DTYPE_F16;
  a.q = b->q, a.k = b->k, a.v = b->v, a.do_ = b->do_, a.h = b->h, a.dh = b->dh;
  a.dq = b->dq, a.dk = b->dk;
  a.gate = HL_GDN_GATE_LOG, a.g = b->g, a.dg = b->dg;
  return a;
}

static void poison(Bufs *b) {
  memset(b, 0, sizeof *b);
  memset(b->dq, 0x7b, sizeof b->dq), memset(b->dk, 0x7b, sizeof b->dk), memset(b->dg, 0x7b, sizeof b->dg);
}
static int untouched(const Bufs *b) {
  Bufs p;
  poison(&p);
  return !memcmp(b->dq, p.dq, sizeof p.dq) && !memcmp(b->dk, p.dk, sizeof p.dk) && !memcmp(b->dg, p.dg, sizeof p.dg);
}

/* The call fails with status and a message with needle, and writes nothing; so does the
 * workspace query where it reads the field. */
static void call_fails(hl_gdn_bwd_dqkwg_args_t a, Bufs *b, hl_status_t status, const char *needle) {
  assert_fails(hl_gdn_bwd_dqkwg(&a, NULL), status, needle);
  assert_true(untouched(b));
}

static int bufs_untouched(void *b) { return untouched(b); }
static hl_status_t call_with(void *b, HlField f, int64_t v) {
  hl_gdn_bwd_dqkwg_args_t a = args_for(b);
  hl_set_field(&a, f, v);
  size_t ws = 7;
  hl_check_query_refused("hl_gdn_bwd_dqkwg_workspace_size", hl_gdn_bwd_dqkwg_workspace_size(&a, &ws), ws, f, v);
  return hl_gdn_bwd_dqkwg(&a, NULL);
}

/* Out-of-range sizes (num_seqs = INT64_MAX threw; B * T * ... overflowed) and enum values as
 * integers (never loaded as the enum type), each named. */
static void sizes_and_enums(void **state) {
  (void)state;
  Bufs b;
  poison(&b);
  const HlField fields[] = {
      HL_FIELD(hl_gdn_bwd_dqkwg_args_t, B), HL_FIELD(hl_gdn_bwd_dqkwg_args_t, T),
      HL_FIELD(hl_gdn_bwd_dqkwg_args_t, H), HL_FIELD(hl_gdn_bwd_dqkwg_args_t, HV),
      HL_FIELD(hl_gdn_bwd_dqkwg_args_t, K), HL_FIELD(hl_gdn_bwd_dqkwg_args_t, V),
      HL_FIELD(hl_gdn_bwd_dqkwg_args_t, num_chunks), HL_FIELD(hl_gdn_bwd_dqkwg_args_t, num_seqs),
      HL_FIELD(hl_gdn_bwd_dqkwg_args_t, backend), HL_FIELD(hl_gdn_bwd_dqkwg_args_t, dtype),
      HL_FIELD(hl_gdn_bwd_dqkwg_args_t, h_dtype), HL_FIELD(hl_gdn_bwd_dqkwg_args_t, gate),
      HL_FIELD(hl_gdn_bwd_dqkwg_args_t, cu_seqlens_dtype)};
  hl_check_bad_fields("hl_gdn_bwd_dqkwg", fields, sizeof fields / sizeof fields[0], &b, call_with, bufs_untouched);
  /* In range one by one, too large together: the tensors' bytes, named by their sizes. */
  hl_gdn_bwd_dqkwg_args_t a = args_for(&b);
  a.B = a.T = (int64_t)1 << 30;
  call_fails(a, &b, HL_STATUS_INVALID_VALUE, "q, k, dq and dk ([B, T, H, K]) would span more than HL_MAX_SPAN_BYTES");
  a = args_for(&b);
  a.T = (int64_t)1 << 40, a.HV = a.H = 1 << 20;
  call_fails(a, &b, HL_STATUS_INVALID_VALUE, "[B, T, H, K]");
}

/* cu_seqlens read as integers, checked entry by entry before any sum (INT64_MAX overflowed the
 * chunk count), named by index. */
static void cu_seqlens_exactly(void **state) {
  (void)state;
  Bufs b;
  poison(&b);
  int64_t cu[3] = {0, 4, T};
  hl_gdn_bwd_dqkwg_args_t a = args_for(&b);
  a.cu_seqlens = cu, a.cu_seqlens_dtype = HL_DTYPE_I64, a.num_seqs = 2, a.num_chunks = 2;
  assert_ok(hl_gdn_bwd_dqkwg(&a, NULL));
  poison(&b);
  cu[1] = INT64_MAX;
  call_fails(a, &b, HL_STATUS_INVALID_VALUE, "cu_seqlens[1] is 9223372036854775807");
  cu[1] = (int64_t)1 << 53 | 1;
  call_fails(a, &b, HL_STATUS_INVALID_VALUE, "cu_seqlens[1] is 9007199254740993");
  cu[1] = 4, cu[2] = T + 1;
  call_fails(a, &b, HL_STATUS_INVALID_VALUE, "cu_seqlens[2] is 11");
}

/* struct_size: this header's, 0.1's (240, before flags) or a later one's with a zero tail;
 * anything else (SIZE_MAX scanned that many bytes) is INVALID_VALUE naming struct_size. */
static void struct_sizes(void **state) {
  (void)state;
  Bufs b;
  poison(&b);
  hl_gdn_bwd_dqkwg_args_t a = args_for(&b);
  a.struct_size = 240;
  assert_ok(hl_gdn_bwd_dqkwg(&a, NULL));
  poison(&b);
  const size_t bad[] = {0, 3, 200, 244, HL_MAX_STRUCT_SIZE + 1, SIZE_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
    a.struct_size = bad[i];
    call_fails(a, &b, HL_STATUS_INVALID_VALUE, "struct_size");
    assert_non_null(strstr(hl_get_last_error(), "240"));
  }
}

/* Nothing is in place: an output over an input is refused naming both. */
static void no_output_over_an_input(void **state) {
  (void)state;
  Bufs b;
  poison(&b);
  hl_gdn_bwd_dqkwg_args_t a = args_for(&b);
  a.dq = (void *)a.q;
  call_fails(a, &b, HL_STATUS_INVALID_VALUE, "dq overlaps q");
  a = args_for(&b);
  a.dg = b.g + 1;
  call_fails(a, &b, HL_STATUS_INVALID_VALUE, "dg overlaps g");
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(sizes_and_enums), cmocka_unit_test(cu_seqlens_exactly),
                                     cmocka_unit_test(struct_sizes), cmocka_unit_test(no_output_over_an_input)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
