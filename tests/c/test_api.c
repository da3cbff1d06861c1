/* Version, status strings, last-error behaviour and descriptor versioning (struct_size). */
#include <math.h>

#include "hl_test.h"

static void version_matches_header(void **state) {
  (void)state;
  assert_int_equal(hl_get_version(), HL_VERSION);
  assert_int_equal(HL_VERSION, HL_VERSION_MAJOR * 10000 + HL_VERSION_MINOR * 100 + HL_VERSION_PATCH);
}

static void every_status_has_a_distinct_name(void **state) {
  (void)state;
  const char *seen[HL_STATUS_INTERNAL_ERROR + 1];
  for (int s = HL_STATUS_SUCCESS; s <= HL_STATUS_INTERNAL_ERROR; ++s) {
    seen[s] = hl_get_error_string((hl_status_t)s);
    assert_non_null(seen[s]);
    assert_non_null(strstr(seen[s], "HL_STATUS_"));
    for (int t = 0; t < s; ++t) assert_string_not_equal(seen[s], seen[t]);
  }
  assert_string_equal(hl_get_error_string((hl_status_t)12345), "unknown hl_status_t value");
}

static hl_rmsnorm_fwd_args_t tiny_fwd(const float *x, float *y) {
  hl_rmsnorm_fwd_args_t a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.backend = HL_BACKEND_CPU;
  a.rows = 1;
  a.cols = 2;
  a.eps = 1e-6f;
  a.x_dtype = a.y_dtype = HL_DTYPE_F32;
  a.x = x;
  a.y = y;
  return a;
}

static void last_error_is_set_then_cleared(void **state) {
  (void)state;
  float x[2] = {1, 2}, y[2];
  hl_rmsnorm_fwd_args_t a = tiny_fwd(x, y);
  a.x = NULL;
  assert_fails(hl_rmsnorm_fwd(&a, NULL), HL_STATUS_INVALID_VALUE, "rmsnorm_fwd: x is NULL");
  a.x = x;
  assert_ok(hl_rmsnorm_fwd(&a, NULL));
  assert_string_equal(hl_get_last_error(), "");
}

static void struct_size_is_checked(void **state) {
  (void)state;
  float x[2] = {1, 2}, y[2] = {-7, -7};
  hl_rmsnorm_fwd_args_t a = tiny_fwd(x, y);
  assert_fails(hl_rmsnorm_fwd(NULL, NULL), HL_STATUS_INVALID_VALUE, "args (the descriptor) is NULL");
  /* Too small (a truncated one was refused as whichever field it cut off), between sizes, too
   * large (SIZE_MAX was scanned byte by byte): named struct_size, with the size expected. */
  const size_t bad[] = {0, 3, 64, sizeof a - 8, HL_MAX_STRUCT_SIZE + 1, SIZE_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
    char needle[96];
    snprintf(needle, sizeof needle, "struct_size is %zu; set it to sizeof the descriptor (%zu here)", bad[i],
             sizeof a);
    a.struct_size = bad[i];
    assert_fails(hl_rmsnorm_fwd(&a, NULL), HL_STATUS_INVALID_VALUE, needle);
  }
  assert_true(y[0] == -7 && y[1] == -7);

  /* A newer caller's larger descriptor: fine while the unknown tail is zero. */
  struct {
    hl_rmsnorm_fwd_args_t a;
    uint64_t future[2];
  } big;
  memset(&big, 0, sizeof big);
  big.a = tiny_fwd(x, y);
  big.a.struct_size = sizeof big;
  assert_ok(hl_rmsnorm_fwd(&big.a, NULL));
  big.future[1] = 1;
  y[0] = y[1] = -7;
  assert_fails(hl_rmsnorm_fwd(&big.a, NULL), HL_STATUS_NOT_SUPPORTED, "does not know");
  assert_true(y[0] == -7 && y[1] == -7);
}

static void backend_is_checked(void **state) {
  (void)state;
  /* Any int reaches these two: read as integers, never loaded as the enum type. */
  const int odd[] = {0, 99, -1, 12345};
  for (int i = 0; i < 4; ++i) {
    hl_backend_t be;
    hl_status_t st;
    memcpy(&be, &odd[i], sizeof be);
    memcpy(&st, &odd[i], sizeof st);
    assert_int_equal(hl_backend_is_available(be), 0);
    if (odd[i]) assert_string_equal(hl_get_error_string(st), "unknown hl_status_t value");
  }
  float x[2] = {1, 2}, y[2];
  hl_rmsnorm_fwd_args_t a = tiny_fwd(x, y);
  a.backend = (hl_backend_t)0;
  assert_fails(hl_rmsnorm_fwd(&a, NULL), HL_STATUS_INVALID_VALUE, "backend is 0");
  assert_int_equal(hl_backend_is_available(HL_BACKEND_CPU), 1);
  if (!hl_backend_is_available(HL_BACKEND_CUDA)) {
    a.backend = HL_BACKEND_CUDA;
    assert_fails(hl_rmsnorm_fwd(&a, NULL), HL_STATUS_NOT_SUPPORTED, "CUDA backend is not available");
  } else {
    /* Host pointers handed to the CUDA backend are refused before any launch. */
    a.backend = HL_BACKEND_CUDA;
    assert_fails(hl_rmsnorm_fwd(&a, NULL), HL_STATUS_INVALID_VALUE, "is host memory");
  }
}

/* Every scalar has a distinct name, NULL past the last; the names before 0.5 still run. */
static void scalar_names_and_old_names(void **state) {
  (void)state;
  assert_string_equal(hl_loss_scalar_name(HL_LOSS_OUT_LOSS), "loss");
  assert_string_equal(hl_loss_scalar_name(HL_LOSS_OUT_TOPK_MASS), "topk_mass");
  assert_null(hl_loss_scalar_name(-1));
  assert_null(hl_loss_scalar_name(HL_LOSS_NUM_SCALARS));
  for (int i = 0; i < HL_LOSS_NUM_SCALARS; ++i)
    for (int j = 0; j < i; ++j) assert_string_not_equal(hl_loss_scalar_name(i), hl_loss_scalar_name(j));
  float x[4] = {1, 2, 3, 4}, y[4];
  hl_rmsnorm_fwd_args_t a = HL_RMSNORM_FWD_ARGS_INIT;
  a.backend = HL_BACKEND_CPU, a.rows = 1, a.cols = 4;
  a.x_dtype = a.y_dtype = HL_DTYPE_F32, a.x = x, a.y = y;
  assert_ok(rmsnorm_fwd(&a, NULL));
  assert_float_equal(y[3], 4.0 / sqrt(7.5), 1e-6);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(scalar_names_and_old_names),
      cmocka_unit_test(version_matches_header),
      cmocka_unit_test(every_status_has_a_distinct_name),
      cmocka_unit_test(last_error_is_set_then_cleared),
      cmocka_unit_test(struct_size_is_checked),
      cmocka_unit_test(backend_is_checked),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
