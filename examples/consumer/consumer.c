/* A program built against the installed headloss (find_package or pkg-config): checks that the
 * library it loads is the version of the header it was compiled with, then runs RMSNorm and a CE
 * loss on the CPU backend and compares them with values computed here. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <headloss.h>

static int check(hl_status_t s, const char *what) {
  if (s == HL_STATUS_SUCCESS) return 0;
  fprintf(stderr, "%s: %s (%s)\n", what, hl_get_error_string(s), hl_get_last_error());
  return 1;
}

int main(void) {
  if (hl_get_version() != HL_VERSION) {
    fprintf(stderr, "library version %d, header %d\n", hl_get_version(), HL_VERSION);
    return 1;
  }
  const float x[4] = {1, 2, 3, 4};
  float y[4];
  hl_rmsnorm_fwd_args_t a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.backend = HL_BACKEND_CPU;
  a.rows = 1;
  a.cols = 4;
  a.cast = HL_RMSNORM_CAST_LLAMA;
  a.eps = 0.0f;
  a.x_dtype = a.y_dtype = HL_DTYPE_F32;
  a.x = x;
  a.y = y;
  if (check(hl_rmsnorm_fwd(&a, NULL), "rmsnorm_fwd")) return 1;
  for (int j = 0; j < 4; ++j)
    if (fabs(y[j] - x[j] / sqrt(7.5)) > 1e-6) {
      fprintf(stderr, "rmsnorm: y[%d] = %g\n", j, (double)y[j]);
      return 1;
    }

  /* CE of one row of logits {0, 1, 2} with label 2: log(1 + e + e^2) - 2. */
  const float logits[3] = {0, 1, 2};
  const int64_t label = 2;
  hl_loss_plan_desc_t d;
  memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  d.backend = HL_BACKEND_CPU;
  d.vocab = 3;
  d.logits_dtype = HL_DTYPE_F32;
  d.labels_dtype = HL_DTYPE_I64;
  d.terms = HL_LOSS_CE;
  d.ce_weight = 1.0f;
  hl_loss_plan_t plan;
  if (check(hl_loss_plan_create(&d, &plan), "hl_loss_plan_create")) return 1;
  float scalars[HL_LOSS_NUM_SCALARS];
  hl_loss_args_t e;
  memset(&e, 0, sizeof e);
  e.struct_size = sizeof e;
  e.rows = 1;
  e.logits = logits;
  e.labels = &label;
  e.scalars = scalars;
  const int bad = check(hl_loss_plan_execute(plan, &e, NULL, 0, NULL), "hl_loss_plan_execute");
  hl_loss_plan_destroy(plan);
  if (bad) return 1;
  const double want = log(1 + exp(1.0) + exp(2.0)) - 2;
  if (fabs(scalars[HL_LOSS_OUT_LOSS] - want) > 1e-6) {
    fprintf(stderr, "loss %g, want %g\n", (double)scalars[HL_LOSS_OUT_LOSS], want);
    return 1;
  }
  printf("headloss %d.%d.%d: rmsnorm and loss ok\n", hl_get_version() / 10000, hl_get_version() / 100 % 100,
         hl_get_version() % 100);
  return 0;
}
