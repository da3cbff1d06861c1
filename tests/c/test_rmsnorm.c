/* rmsnorm_fwd / rmsnorm_bwd: hand-computed CPU results, and every validation path (status,
 * message, outputs untouched). */
#include <math.h>

#include "hl_test.h"

#define POISON -777.0f

static const float X[4] = {1, 2, 3, 4}, W[4] = {1, 0.5f, 2, 1}, DY[4] = {1, -1, 0.5f, 2};

static hl_rmsnorm_fwd_args_t fwd_args(float *y, float *rstd) {
  hl_rmsnorm_fwd_args_t a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.backend = HL_BACKEND_CPU;
  a.rows = 1;
  a.cols = 4;
  a.cast = HL_RMSNORM_CAST_GEMMA;
  a.eps = 1e-6f;
  a.x_dtype = a.y_dtype = a.weight_dtype = HL_DTYPE_F32;
  a.x = X;
  a.weight = W;
  a.y = y;
  a.rstd = rstd;
  return a;
}

static hl_rmsnorm_bwd_args_t bwd_args(float *dx, float *dw) {
  hl_rmsnorm_bwd_args_t a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.backend = HL_BACKEND_CPU;
  a.rows = 1;
  a.cols = 4;
  a.cast = HL_RMSNORM_CAST_GEMMA;
  a.eps = 1e-6f;
  a.x_dtype = a.dy_dtype = a.weight_dtype = a.dw_dtype = HL_DTYPE_F32;
  a.x = X;
  a.weight = W;
  a.dy = DY;
  a.dx = dx;
  a.dw = dw;
  return a;
}

static void fill(float *p, int n) {
  for (int i = 0; i < n; ++i) p[i] = POISON;
}
static void assert_untouched(const float *p, int n) {
  for (int i = 0; i < n; ++i)
    if (p[i] != POISON) fail_msg("output element %d was written (%g)", i, (double)p[i]);
}
static void assert_close(const float *got, const double *want, int n, double tol) {
  for (int i = 0; i < n; ++i)
    if (fabs(got[i] - want[i]) > tol * fabs(want[i]) + 1e-7)
      fail_msg("element %d: got %.9g, want %.9g", i, (double)got[i], want[i]);
}

/* Values worked out by hand: mean(x^2) = 7.5, rstd = 1/sqrt(7.5 + 1e-6). */
static void cpu_forward_matches_hand_values(void **state) {
  (void)state;
  float y[4], rstd[1];
  fill(y, 4);
  fill(rstd, 1);
  hl_rmsnorm_fwd_args_t a = fwd_args(y, rstd);
  assert_ok(hl_rmsnorm_fwd(&a, NULL));
  const double r = 0.3651483473268884;
  const double want[4] = {r, r, 2.1908900839613303, 1.4605933893075536};
  assert_close(y, want, 4, 1e-6);
  assert_close(rstd, &r, 1, 1e-6);

  /* Inference: no rstd buffer, the same y. Gemma's offset: y = xhat * (1 + w). */
  fill(y, 4);
  a.rstd = NULL;
  a.offset = 1.0f;
  assert_ok(hl_rmsnorm_fwd(&a, NULL));
  const double want1[4] = {2 * r, 3 * r, 3 * 3 * r, 2 * 4 * r};
  assert_close(y, want1, 4, 1e-6);
}

static void cpu_forward_fuses_the_residual(void **state) {
  (void)state;
  const float res[4] = {-1, 0, 1, 2};
  float y[4], s[4];
  fill(y, 4);
  fill(s, 4);
  hl_rmsnorm_fwd_args_t a = fwd_args(y, NULL);
  a.weight = NULL;
  a.offset = 1.0f; /* ignored without a weight (Gemma's norm without a scale): y = xhat */
  a.residual = res;
  a.residual_out = s;
  assert_ok(hl_rmsnorm_fwd(&a, NULL));
  const double sum[4] = {0, 2, 4, 6}; /* mean(s^2) = 14 */
  assert_close(s, sum, 4, 0);
  const double r = 1.0 / sqrt(14.0 + 1e-6);
  const double want[4] = {0, 2 * r, 4 * r, 6 * r};
  assert_close(y, want, 4, 1e-6);
}

static void cpu_backward_matches_hand_values(void **state) {
  (void)state;
  float dx[4], dw[4];
  fill(dx, 4);
  fill(dw, 4);
  hl_rmsnorm_bwd_args_t a = bwd_args(dx, dw);
  assert_ok(hl_rmsnorm_bwd(&a, NULL));
  const double want_dx[4] = {0.2312606378253906, -0.45034959266643976, -0.03651478117760501,
                             0.1947458566477856};
  const double want_dw[4] = {0.3651483473268884, -0.7302966946537768, 0.5477225209903326,
                             2.921186778615107};
  assert_close(dx, want_dx, 4, 1e-5);
  assert_close(dw, want_dw, 4, 1e-5);
}

/* Without a weight the offset is ignored: dx = rstd (dy - xhat mean(dy xhat)). */
static void cpu_backward_without_weight_ignores_offset(void **state) {
  (void)state;
  float dx[4];
  fill(dx, 4);
  hl_rmsnorm_bwd_args_t a = bwd_args(dx, NULL);
  a.weight = NULL;
  a.offset = 1.0f;
  assert_ok(hl_rmsnorm_bwd(&a, NULL));
  const double r = 1.0 / sqrt(7.5 + 1e-6); /* mean(x^2) = 30 / 4 */
  double dot = 0, want[4];
  for (int i = 0; i < 4; ++i) dot += DY[i] * X[i] * r;
  for (int i = 0; i < 4; ++i) want[i] = r * (DY[i] - X[i] * r * dot / 4);
  assert_close(dx, want, 4, 1e-5);
}

static void zero_size_is_a_no_op(void **state) {
  (void)state;
  float y[4];
  fill(y, 4);
  hl_rmsnorm_fwd_args_t a = fwd_args(y, NULL);
  a.rows = 0;
  a.x = NULL;
  a.y = NULL;
  assert_ok(hl_rmsnorm_fwd(&a, NULL));
  /* Backward with no rows still owes dw: the empty sum, zero. */
  float dw[4];
  fill(dw, 4);
  hl_rmsnorm_bwd_args_t b = bwd_args(NULL, dw);
  b.rows = 0;
  b.x = b.dy = NULL;
  assert_ok(hl_rmsnorm_bwd(&b, NULL));
  for (int i = 0; i < 4; ++i) assert_true(dw[i] == 0.0f);
}

/* Each bad forward argument: its status, a message naming it, and y / rstd untouched. */
static void forward_rejects_bad_arguments(void **state) {
  (void)state;
  float y[8], rstd[2], s[8];
  struct {
    const char *needle;
    hl_status_t status;
  } expect[] = {
      {"rows is -1", HL_STATUS_INVALID_VALUE},
      {"cols is -4", HL_STATUS_INVALID_VALUE},
      {"cast is 7", HL_STATUS_INVALID_VALUE},
      {"x_dtype is I32", HL_STATUS_INVALID_VALUE},
      {"y_dtype is NONE", HL_STATUS_INVALID_VALUE},
      {"weight_dtype is I64", HL_STATUS_INVALID_VALUE},
      {"eps is -1", HL_STATUS_INVALID_VALUE},
      {"y is NULL", HL_STATUS_INVALID_VALUE},
      {"x_stride is 3, smaller than cols", HL_STATUS_INVALID_VALUE},
      {"offset is not finite", HL_STATUS_INVALID_VALUE},
      {"residual_out is set but residual is NULL", HL_STATUS_INVALID_VALUE},
      {"residual_out (required with residual) is NULL", HL_STATUS_INVALID_VALUE},
      {"x (", HL_STATUS_MISALIGNED},
      {"y overlaps rstd; outputs must not share memory", HL_STATUS_INVALID_VALUE},
      {"y overlaps x; in place, y must be x exactly", HL_STATUS_INVALID_VALUE},
  };
  const int n = (int)(sizeof expect / sizeof expect[0]);
  static float xbuf[9];
  for (int i = 0; i < 9; ++i) xbuf[i] = (float)i + 1;
  for (int k = 0; k < n; ++k) {
    fill(y, 8);
    fill(rstd, 2);
    fill(s, 8);
    hl_rmsnorm_fwd_args_t a = fwd_args(y, rstd);
    switch (k) {
      case 0: a.rows = -1; break;
      case 1: a.cols = -4; break;
      case 2: a.cast = (hl_rmsnorm_cast_t)7; break;
      case 3: a.x_dtype = HL_DTYPE_I32; break;
      case 4: a.y_dtype = HL_DTYPE_NONE; break;
      case 5: a.weight_dtype = HL_DTYPE_I64; break;
      case 6: a.eps = -1; break;
      case 7: a.y = NULL; break;
      case 8: a.x_stride = 3; break;
      case 9: a.offset = INFINITY; break;
      case 10: a.residual_out = s; break;
      case 11: a.residual = X; break;
      case 12: a.x = (const char *)xbuf + 2; break;
      case 13: a.rstd = y + 2; break;
      case 14: a.x = xbuf; a.y = (float *)xbuf + 1; break; /* partial overlap with the input */
    }
    hl_status_t st = hl_rmsnorm_fwd(&a, NULL);
    if (st != expect[k].status || !strstr(hl_get_last_error(), expect[k].needle))
      fail_msg("case %d: got %d \"%s\", want %d \"%s\"", k, (int)st, hl_get_last_error(),
               (int)expect[k].status, expect[k].needle);
    assert_untouched(y, 8);
    assert_untouched(rstd, 2);
    assert_untouched(s, 8);
  }
}

static void forward_allows_exact_in_place(void **state) {
  (void)state;
  float buf[4] = {1, 2, 3, 4};
  float y[4];
  fill(y, 4);
  hl_rmsnorm_fwd_args_t a = fwd_args(y, NULL);
  assert_ok(hl_rmsnorm_fwd(&a, NULL));
  a.x = buf;
  a.y = buf;
  assert_ok(hl_rmsnorm_fwd(&a, NULL));
  for (int i = 0; i < 4; ++i) assert_true(buf[i] == y[i]);
}

static void backward_rejects_bad_arguments(void **state) {
  (void)state;
  float dx[4], dw[4];
  struct {
    const char *needle;
    hl_status_t status;
  } expect[] = {
      {"dw_dtype is BF16", HL_STATUS_INVALID_VALUE},
      {"dw (required with a weight) is NULL", HL_STATUS_INVALID_VALUE},
      {"dw is set but there is no weight", HL_STATUS_INVALID_VALUE},
      {"dy is NULL", HL_STATUS_INVALID_VALUE},
      {"dy_dtype is I32", HL_STATUS_INVALID_VALUE},
      {"rstd is NULL and eps is nan", HL_STATUS_INVALID_VALUE},
      {"dx overlaps dw", HL_STATUS_INVALID_VALUE},
  };
  const int n = (int)(sizeof expect / sizeof expect[0]);
  for (int k = 0; k < n; ++k) {
    fill(dx, 4);
    fill(dw, 4);
    hl_rmsnorm_bwd_args_t a = bwd_args(dx, dw);
    switch (k) {
      case 0: a.dw_dtype = HL_DTYPE_BF16; break;
      case 1: a.dw = NULL; break;
      case 2: a.weight = NULL; break;
      case 3: a.dy = NULL; break;
      case 4: a.dy_dtype = HL_DTYPE_I32; break;
      case 5: a.eps = NAN; break;
      case 6: a.dw = dx + 1; break;
    }
    hl_status_t st = hl_rmsnorm_bwd(&a, NULL);
    if (st != expect[k].status || !strstr(hl_get_last_error(), expect[k].needle))
      fail_msg("case %d: got %d \"%s\", want %d \"%s\"", k, (int)st, hl_get_last_error(),
               (int)expect[k].status, expect[k].needle);
    assert_untouched(dx, 4);
    assert_untouched(dw, 4);
  }
}

/* Outputs of the calls below, poisoned before each. */
typedef struct {
  float y[4], rstd[1], s[4], dx[4], dw[4];
} Outs;
static int outs_untouched(void *ctx) {
  const Outs *o = ctx;
  const float *f = o->y;
  for (size_t i = 0; i < sizeof *o / sizeof *f; ++i)
    if (f[i] != POISON) return 0;
  return 1;
}
static void poison(Outs *o) { fill(o->y, (int)(sizeof *o / sizeof(float))); }
static hl_status_t fwd_with(void *ctx, HlField f, int64_t v) {
  Outs *o = ctx;
  poison(o);
  hl_rmsnorm_fwd_args_t a = fwd_args(o->y, o->rstd);
  a.residual = X, a.residual_out = o->s; /* every stride in use */
  hl_set_field(&a, f, v);
  return hl_rmsnorm_fwd(&a, NULL);
}
static hl_status_t bwd_with(void *ctx, HlField f, int64_t v) {
  Outs *o = ctx;
  poison(o);
  hl_rmsnorm_bwd_args_t a = bwd_args(o->dx, o->dw);
  hl_set_field(&a, f, v);
  size_t ws = 7;
  hl_check_query_refused("hl_rmsnorm_bwd_workspace_size", hl_rmsnorm_bwd_workspace_size(&a, &ws), ws, f, v);
  return hl_rmsnorm_bwd(&a, NULL);
}

/* Every size and stride, then every enum, out of range: INVALID_VALUE naming the field, before any
 * other use of it (a stride of INT64_MAX read wrapped addresses, rows of INT64_MAX crashed, cols
 * of INT64_MAX threw, enums were loaded as their type); nothing written. */
static void sizes_and_enums_are_checked_first(void **state) {
  (void)state;
  const HlField fwd[] = {HL_FIELD(hl_rmsnorm_fwd_args_t, rows), HL_FIELD(hl_rmsnorm_fwd_args_t, cols),
                         HL_FIELD(hl_rmsnorm_fwd_args_t, x_stride), HL_FIELD(hl_rmsnorm_fwd_args_t, residual_stride),
                         HL_FIELD(hl_rmsnorm_fwd_args_t, residual_out_stride),
                         HL_FIELD(hl_rmsnorm_fwd_args_t, y_stride), HL_FIELD(hl_rmsnorm_fwd_args_t, backend),
                         HL_FIELD(hl_rmsnorm_fwd_args_t, cast), HL_FIELD(hl_rmsnorm_fwd_args_t, x_dtype),
                         HL_FIELD(hl_rmsnorm_fwd_args_t, weight_dtype), HL_FIELD(hl_rmsnorm_fwd_args_t, y_dtype)};
  const HlField bwd[] = {HL_FIELD(hl_rmsnorm_bwd_args_t, rows), HL_FIELD(hl_rmsnorm_bwd_args_t, cols),
                         HL_FIELD(hl_rmsnorm_bwd_args_t, x_stride), HL_FIELD(hl_rmsnorm_bwd_args_t, dy_stride),
                         HL_FIELD(hl_rmsnorm_bwd_args_t, dresidual_out_stride),
                         HL_FIELD(hl_rmsnorm_bwd_args_t, dx_stride), HL_FIELD(hl_rmsnorm_bwd_args_t, dresidual_stride),
                         HL_FIELD(hl_rmsnorm_bwd_args_t, backend), HL_FIELD(hl_rmsnorm_bwd_args_t, cast),
                         HL_FIELD(hl_rmsnorm_bwd_args_t, x_dtype), HL_FIELD(hl_rmsnorm_bwd_args_t, weight_dtype),
                         HL_FIELD(hl_rmsnorm_bwd_args_t, dy_dtype), HL_FIELD(hl_rmsnorm_bwd_args_t, dw_dtype)};
  Outs o;
  hl_check_bad_fields("hl_rmsnorm_fwd", fwd, sizeof fwd / sizeof fwd[0], &o, fwd_with, outs_untouched);
  hl_check_bad_fields("hl_rmsnorm_bwd", bwd, sizeof bwd / sizeof bwd[0], &o, bwd_with, outs_untouched);
}

/* Sizes in range whose spans are not: refused naming the size, never as an overlap (cols = 2^61
 * was reported as "rstd overlaps weight"); a span that wraps the address space; nothing read. */
static void spans_are_checked(void **state) {
  (void)state;
  float y[4], rstd[1];
  fill(y, 4);
  hl_rmsnorm_fwd_args_t a = fwd_args(y, rstd);
  a.rows = 1 << 20, a.x_stride = (int64_t)1 << 45; /* 2^67 bytes */
  assert_fails(hl_rmsnorm_fwd(&a, NULL), HL_STATUS_INVALID_VALUE, "x spans more than HL_MAX_SPAN_BYTES");
  a = fwd_args(y, rstd);
  a.rows = (int64_t)1 << 40, a.cols = (int64_t)1 << 30; /* 2^72 bytes */
  assert_fails(hl_rmsnorm_fwd(&a, NULL), HL_STATUS_INVALID_VALUE, "x spans more than HL_MAX_SPAN_BYTES");
  a = fwd_args(y, rstd);
  a.x = (const void *)(UINTPTR_MAX - 11); /* 4-byte aligned; its 16 bytes would wrap */
  assert_fails(hl_rmsnorm_fwd(&a, NULL), HL_STATUS_INVALID_VALUE, "x (");
  assert_non_null(strstr(hl_get_last_error(), "wraps around the address space"));
  assert_untouched(y, 4);
  float dx[4], dw[4];
  hl_rmsnorm_bwd_args_t b = bwd_args(dx, dw);
  b.cols = (int64_t)1 << 47, b.rows = 1 << 20;
  assert_fails(hl_rmsnorm_bwd(&b, NULL), HL_STATUS_INVALID_VALUE, "x spans more than HL_MAX_SPAN_BYTES");
  /* The largest sizes accepted: the workspace query answers (0 on the CPU). */
  b.rows = b.cols = HL_MAX_EXTENT;
  size_t ws = 7;
  assert_ok(hl_rmsnorm_bwd_workspace_size(&b, &ws));
  assert_int_equal(ws, 0);
}

/* Outputs over inputs: y = x, residual_out = residual (alone or together), dx = dy and dx =
 * dresidual_out give separate buffers' bits; any other overlap is refused naming both fields, as
 * is a partial one of an allowed pair. */
static void in_place_pairs(void **state) {
  (void)state;
  const float res[8] = {-1, 0, 1, 2, 0.5f, 3, -2, 1};
  float x8[8], y[8], s[8], buf_x[8], buf_r[8];
  for (int i = 0; i < 8; ++i) x8[i] = (float)(i % 5) - 1.5f;
  hl_rmsnorm_fwd_args_t a = fwd_args(y, NULL);
  a.rows = 2, a.x = x8, a.residual = res, a.residual_out = s;
  assert_ok(hl_rmsnorm_fwd(&a, NULL));
  memcpy(buf_x, x8, sizeof buf_x), memcpy(buf_r, res, sizeof buf_r);
  a.x = a.y = buf_x, a.residual = a.residual_out = buf_r;
  assert_ok(hl_rmsnorm_fwd(&a, NULL));
  assert_memory_equal(buf_x, y, sizeof y);
  assert_memory_equal(buf_r, s, sizeof s);
  a.y = buf_r; /* y over the residual: not a pair */
  assert_fails(hl_rmsnorm_fwd(&a, NULL), HL_STATUS_INVALID_VALUE, "residual_out overlaps y");
  a.y = y, a.residual_out = buf_x;
  assert_fails(hl_rmsnorm_fwd(&a, NULL), HL_STATUS_INVALID_VALUE, "residual_out overlaps x");
  a.residual_out = buf_r + 1;
  assert_fails(hl_rmsnorm_fwd(&a, NULL), HL_STATUS_INVALID_VALUE,
               "residual_out overlaps residual; in place, residual_out must be residual exactly");

  const float dro[8] = {0.25f, -1, 2, 0, 1, 1, -0.5f, 3};
  float dx[8], dw[4], dx2[8], dw2[4], buf[8];
  hl_rmsnorm_bwd_args_t b = bwd_args(dx, dw);
  b.rows = 2, b.x = x8, b.dy = res;
  assert_ok(hl_rmsnorm_bwd(&b, NULL));
  memcpy(buf, res, sizeof buf);
  b.dy = b.dx = buf, b.dw = dw2;
  assert_ok(hl_rmsnorm_bwd(&b, NULL));
  assert_memory_equal(buf, dx, sizeof dx);
  assert_memory_equal(dw2, dw, sizeof dw);
  b = bwd_args(dx, dw), b.rows = 2, b.x = x8, b.dy = res, b.dresidual_out = dro;
  assert_ok(hl_rmsnorm_bwd(&b, NULL));
  memcpy(buf, dro, sizeof buf);
  b.dresidual_out = b.dx = buf, b.dw = dw2;
  assert_ok(hl_rmsnorm_bwd(&b, NULL));
  assert_memory_equal(buf, dx, sizeof dx);
  b.dx = dx2, b.dresidual = buf; /* the copy of dx over an input: not a pair */
  assert_fails(hl_rmsnorm_bwd(&b, NULL), HL_STATUS_INVALID_VALUE, "dresidual overlaps dresidual_out");
  b.dresidual = NULL, b.dx = (float *)x8;
  assert_fails(hl_rmsnorm_bwd(&b, NULL), HL_STATUS_INVALID_VALUE, "dx overlaps x");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(cpu_forward_matches_hand_values),
      cmocka_unit_test(cpu_forward_fuses_the_residual),
      cmocka_unit_test(cpu_backward_matches_hand_values),
      cmocka_unit_test(cpu_backward_without_weight_ignores_offset),
      cmocka_unit_test(zero_size_is_a_no_op),
      cmocka_unit_test(forward_rejects_bad_arguments),
      cmocka_unit_test(forward_allows_exact_in_place),
      cmocka_unit_test(backward_rejects_bad_arguments),
      cmocka_unit_test(sizes_and_enums_are_checked_first),
      cmocka_unit_test(spans_are_checked),
      cmocka_unit_test(in_place_pairs),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
