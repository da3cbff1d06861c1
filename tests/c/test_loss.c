/* The loss plan's validation: every bad description or argument gets its status and a message
 * naming it, and writes nothing; plus one small exact case on the CPU backend. */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "hl_test.h"

enum { N = 4, V = 6 };

typedef struct {
  float logits[N * V], teacher[N * V], grad[N * V], weights[N], adv[N], old[N], ref[N];
  int64_t labels[N];
  float scalars[HL_LOSS_NUM_SCALARS], tok[N];
} Bufs;

static hl_loss_plan_desc_t desc_ce(void) {
  hl_loss_plan_desc_t d;
  memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  d.backend = HL_BACKEND_CPU;
  d.vocab = V;
  d.logits_dtype = HL_DTYPE_F32;
  d.labels_dtype = HL_DTYPE_I64;
  d.terms = HL_LOSS_CE;
  d.ce_weight = 1.0f;
  d.grad_mode = HL_LOSS_GRAD_WRITE;
  return d;
}

static void fill(Bufs *b) {
  for (int i = 0; i < N * V; ++i) b->logits[i] = (float)((i * 7) % 11) * 0.25f, b->teacher[i] = (float)(i % 5);
  for (int i = 0; i < N * V; ++i) b->grad[i] = -7.0f;
  for (int i = 0; i < N; ++i) {
    b->labels[i] = i % V, b->weights[i] = 1.0f, b->adv[i] = 0.5f, b->old[i] = -1.0f, b->ref[i] = -1.0f;
    b->tok[i] = -7.0f;
  }
  b->labels[1] = -100;
  for (int i = 0; i < HL_LOSS_NUM_SCALARS; ++i) b->scalars[i] = -7.0f;
}

static hl_loss_args_t args_for(Bufs *b) {
  hl_loss_args_t a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.rows = N;
  a.logits = b->logits;
  a.labels = b->labels;
  a.grad = b->grad;
  a.scalars = b->scalars;
  a.token_loss = b->tok;
  return a;
}

static int untouched(const Bufs *b) {
  for (int i = 0; i < N * V; ++i)
    if (b->grad[i] != -7.0f) return 0;
  for (int i = 0; i < N; ++i)
    if (b->tok[i] != -7.0f) return 0;
  for (int i = 0; i < HL_LOSS_NUM_SCALARS; ++i)
    if (b->scalars[i] != -7.0f) return 0;
  return 1;
}

/* Creating a plan from d fails with status and a message containing needle. */
static void create_fails(hl_loss_plan_desc_t d, hl_status_t status, const char *needle) {
  hl_loss_plan_t p = NULL;
  assert_fails(hl_loss_plan_create(&d, &p), status, needle);
  assert_null(p);
}

static void bad_descriptions(void **state) {
  (void)state;
  hl_loss_plan_desc_t d = desc_ce();
  d.vocab = 0;
  create_fails(d, HL_STATUS_INVALID_VALUE, "vocab is 0");
  d = desc_ce(), d.logits_dtype = HL_DTYPE_I32;
  create_fails(d, HL_STATUS_INVALID_VALUE, "logits_dtype is I32");
  d = desc_ce(), d.labels_dtype = HL_DTYPE_F32;
  create_fails(d, HL_STATUS_INVALID_VALUE, "labels_dtype is F32");
  d = desc_ce(), d.labels_dtype = HL_DTYPE_NONE;
  create_fails(d, HL_STATUS_INVALID_VALUE, "need labels");
  d = desc_ce(), d.terms = HL_LOSS_DISTILL_FWD | HL_LOSS_DISTILL_REV;
  create_fails(d, HL_STATUS_INVALID_VALUE, "pick one");
  d = desc_ce(), d.terms = 1u << 20;
  create_fails(d, HL_STATUS_INVALID_VALUE, "unknown bits");
  d = desc_ce(), d.label_smoothing = 1.0f;
  create_fails(d, HL_STATUS_INVALID_VALUE, "label_smoothing is 1");
  d = desc_ce(), d.softcap = -1.0f;
  create_fails(d, HL_STATUS_INVALID_VALUE, "softcap is -1");
  d = desc_ce(), d.student_temperature = -2.0f;
  create_fails(d, HL_STATUS_INVALID_VALUE, "student_temperature is -2");
  d = desc_ce(), d.z_weight = NAN;
  create_fails(d, HL_STATUS_INVALID_VALUE, "z_weight is not finite");
  d = desc_ce(), d.dual_clip = 1.0f;
  create_fails(d, HL_STATUS_INVALID_VALUE, "dual_clip is 1; must be finite and > 1 (or 0: off)");
  d = desc_ce(), d.dual_clip = -3.0f;
  create_fails(d, HL_STATUS_INVALID_VALUE, "dual_clip is -3");
  d = desc_ce(), d.kl_estimator = 3;
  create_fails(d, HL_STATUS_INVALID_VALUE, "kl_estimator is 3; use HL_LOSS_KL_K3 (0)");
  d = desc_ce(), d.cispo_eps_high = -0.5f;
  create_fails(d, HL_STATUS_INVALID_VALUE, "cispo_eps_high is -0.5");
  d = desc_ce(), d.terms = HL_LOSS_CISPO, d.labels_dtype = HL_DTYPE_NONE;
  create_fails(d, HL_STATUS_INVALID_VALUE, "CE, GRPO, CISPO, GRPO_KL_REF and PREFERENCE need labels");
  d = desc_ce(), d.grad_dtype = HL_DTYPE_F16;
  create_fails(d, HL_STATUS_INVALID_VALUE, "grad_dtype is F16");
  d = desc_ce(), d.grad_mode = (hl_loss_grad_mode_t)7;
  create_fails(d, HL_STATUS_INVALID_VALUE, "grad_mode is 7");
  d = desc_ce(), d.vocab_start = 3;
  create_fails(d, HL_STATUS_INVALID_VALUE, "= [3, 9) is not inside [0, vocab_global = 0)");
  d = desc_ce(), d.vocab_start = 4, d.vocab_global = 9;
  create_fails(d, HL_STATUS_INVALID_VALUE, "= [4, 10) is not inside [0, vocab_global = 9)");
  d = desc_ce(), d.vocab_global = 9, d.ranks = 1;
  create_fails(d, HL_STATUS_INVALID_VALUE, "needs ranks >= 2");
  d = desc_ce(), d.ranks = 2;
  create_fails(d, HL_STATUS_INVALID_VALUE, "the whole of it ranks = 1");
  d = desc_ce(), d.vocab_global = 9, d.ranks = 10;
  create_fails(d, HL_STATUS_INVALID_VALUE, "ranks is 10; must be in [0, vocab_global = 9]");
  d = desc_ce(), d.struct_size = 3;
  create_fails(d, HL_STATUS_INVALID_VALUE, "struct_size is 3");
  d = desc_ce(), d.backend = (hl_backend_t)9;
  create_fails(d, HL_STATUS_INVALID_VALUE, "backend is 9");
  hl_loss_plan_t p;
  assert_fails(hl_loss_plan_create(NULL, &p), HL_STATUS_INVALID_VALUE, "desc (the descriptor) is NULL");
}

/* Runs the plan of d on args a; it must fail with status + needle and leave b untouched. */
static void execute_fails(hl_loss_plan_desc_t d, hl_loss_args_t a, Bufs *b, hl_status_t status,
                          const char *needle) {
  hl_loss_plan_t p = NULL;
  assert_ok(hl_loss_plan_create(&d, &p));
  assert_fails(hl_loss_plan_execute(p, &a, NULL, 0, NULL), status, needle);
  assert_true(untouched(b));
  assert_ok(hl_loss_plan_destroy(p));
}

static void bad_arguments(void **state) {
  (void)state;
  Bufs *b = calloc(1, sizeof *b);
  fill(b);
  hl_loss_plan_desc_t d = desc_ce();
  hl_loss_args_t a = args_for(b);
  a.logits = NULL;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "logits is NULL");
  a = args_for(b), a.labels = NULL;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE,
                "labels is NULL; CE, GRPO, CISPO, GRPO_KL_REF or PREFERENCE needs it");
  a = args_for(b), a.logits_stride = V - 1;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "logits_stride is 5, smaller than cols");
  a = args_for(b), a.rows = -1;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "rows is -1");
  a = args_for(b), a.grad = NULL;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "grad is NULL");
  a = args_for(b), a.divisor = -1.0;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "divisor is -1");
  a = args_for(b), a.teacher_logits = b->teacher;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "no distillation term");
  a = args_for(b), a.token_loss = b->grad + 1; /* an output overlapping another output */
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "overlaps");
  a = args_for(b), b->labels[2] = V;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "labels[2] is 6, outside [0, vocab = 6)");
  b->labels[2] = 2;
  a = args_for(b), a.logits = (const char *)b->logits + 2;
  execute_fails(d, a, b, HL_STATUS_MISALIGNED, "not aligned");

  hl_loss_plan_desc_t g = desc_ce();
  g.terms = HL_LOSS_GRPO;
  a = args_for(b), a.old_logprobs = b->old;
  execute_fails(g, a, b, HL_STATUS_INVALID_VALUE, "advantages is NULL; GRPO needs it");
  g.terms = HL_LOSS_GRPO | HL_LOSS_GRPO_KL_REF, g.kl_ref_beta = 0.04f;
  a = args_for(b), a.old_logprobs = b->old, a.advantages = b->adv;
  execute_fails(g, a, b, HL_STATUS_INVALID_VALUE, "ref_logprobs is NULL; GRPO_KL_REF needs it");
  g.terms = HL_LOSS_CISPO;
  a = args_for(b), a.old_logprobs = b->old;
  execute_fails(g, a, b, HL_STATUS_INVALID_VALUE, "advantages is NULL; CISPO needs it");
  a = args_for(b), a.advantages = b->adv;
  execute_fails(g, a, b, HL_STATUS_INVALID_VALUE, "old_logprobs is NULL; CISPO needs it");
  hl_loss_plan_desc_t t = desc_ce();
  t.terms = HL_LOSS_DISTILL_FWD;
  execute_fails(t, args_for(b), b, HL_STATUS_INVALID_VALUE, "teacher_logits is NULL; distillation needs it");
  hl_loss_plan_desc_t e = desc_ce();
  e.grad_mode = HL_LOSS_GRAD_NONE;
  execute_fails(e, args_for(b), b, HL_STATUS_INVALID_VALUE, "grad_mode is NONE");
  hl_loss_plan_desc_t acc = desc_ce();
  acc.grad_mode = HL_LOSS_GRAD_ACCUMULATE;
  a = args_for(b), a.grad = b->logits;
  execute_fails(acc, a, b, HL_STATUS_INVALID_VALUE, "cannot be accumulated into");
  hl_loss_plan_desc_t f = desc_ce();
  f.grad_dtype = HL_DTYPE_F32;
  f.logits_dtype = HL_DTYPE_BF16;
  a = args_for(b), a.grad = b->logits;
  execute_fails(f, a, b, HL_STATUS_INVALID_VALUE, "grad overlaps logits; in place, grad must be logits exactly");
  assert_fails(hl_loss_plan_execute(NULL, &a, NULL, 0, NULL), HL_STATUS_INVALID_VALUE, "plan is NULL");
  free(b);
}

/* desc_ce() cut to `size` bytes (the fields it lacks read as zero: off) run on the first `rows`
 * rows of b: a caller of that header has room for the scalars before `first_unwritten`, and no
 * more. Returns the plan. */
static hl_loss_plan_t run_cut_descriptor(Bufs *b, size_t size, int rows, int first_unwritten) {
  hl_loss_plan_desc_t d = desc_ce();
  d.struct_size = size;
  hl_loss_plan_t p;
  assert_ok(hl_loss_plan_create(&d, &p));
  hl_loss_args_t a = args_for(b);
  a.rows = rows;
  assert_ok(hl_loss_plan_execute(p, &a, NULL, 0, NULL));
  assert_true(b->scalars[first_unwritten - 1] != -7.0f);
  for (int k = first_unwritten; k < HL_LOSS_NUM_SCALARS; ++k) assert_true(b->scalars[k] == -7.0f);
  return p;
}

/* CE of one row by hand, and the workspace the CPU backend asks for; from descriptors of older
 * headers' sizes: 0.2's, before the policy-gradient options, and 0.3's, before the sequence options. */
static void small_exact_case(void **state) {
  (void)state;
  Bufs *b = calloc(1, sizeof *b);
  fill(b);
  hl_loss_plan_t p = run_cut_descriptor(b, offsetof(hl_loss_plan_desc_t, dual_clip), 1, HL_LOSS_OUT_CISPO);
  size_t ws = 1;
  assert_ok(hl_loss_plan_get_workspace_size(p, N, &ws));
  assert_int_equal(ws, 0);
  double m = -INFINITY, s = 0;
  for (int j = 0; j < V; ++j) m = fmax(m, b->logits[j]);
  for (int j = 0; j < V; ++j) s += exp(b->logits[j] - m);
  const double ce = m + log(s) - b->logits[0];
  assert_float_equal(b->scalars[HL_LOSS_OUT_CE], ce, 1e-6);
  assert_float_equal(b->scalars[HL_LOSS_OUT_LOSS], ce, 1e-6);
  assert_float_equal(b->scalars[HL_LOSS_OUT_VALID_ROWS], 1.0, 0);
  double gsum = 0;
  for (int j = 0; j < V; ++j) gsum += b->grad[j];
  assert_float_equal(gsum, 0.0, 1e-6); /* softmax minus one-hot sums to 0 */
  assert_true(b->grad[V] == -7.0f);     /* row 1 not part of the call */
  assert_ok(hl_loss_plan_destroy(p));
  /* A descriptor of 0.3's size, before the sequence options: its 28 scalars. */
  fill(b);
  assert_ok(hl_loss_plan_destroy(run_cut_descriptor(b, offsetof(hl_loss_plan_desc_t, cu_seqlens_dtype), N,
                                                    HL_LOSS_OUT_ROLLOUT_KL_K1)));
  /* 0.4 to 0.6's, before the preference options: 33. */
  fill(b);
  assert_ok(hl_loss_plan_destroy(run_cut_descriptor(b, 232, N,
                                                    HL_LOSS_OUT_PREFERENCE)));
  free(b);
}

/* A sparse teacher of k = 2 (padding in row 3): runs, reports the teacher mass its ids cover;
 * an id twice in a row fails naming it and writes nothing. */
static void sparse_teacher(void **state) {
  (void)state;
  Bufs *b = calloc(1, sizeof *b);
  fill(b);
  hl_loss_plan_desc_t d = desc_ce();
  d.terms = HL_LOSS_CE | HL_LOSS_DISTILL_REV;
  d.distill_weight = 1.0f;
  d.teacher_topk = 2;
  d.teacher_topk_ids_dtype = HL_DTYPE_I64;
  hl_loss_plan_t p;
  assert_ok(hl_loss_plan_create(&d, &p));
  int64_t ids[N * 2] = {0, 5, 1, 2, 3, 4, -1, -1};
  float lp[N * 2] = {-0.5f, -1.5f, -0.25f, -2.0f, -1.0f, -1.0f, NAN, NAN};
  hl_loss_args_t a = args_for(b);
  a.teacher_topk_ids = ids, a.teacher_topk_logprobs = lp;
  ids[5] = 3;
  assert_fails(hl_loss_plan_execute(p, &a, NULL, 0, NULL), HL_STATUS_INVALID_VALUE,
               "teacher_topk_ids row 2 holds id 3 twice");
  assert_true(untouched(b));
  ids[5] = 4;
  assert_ok(hl_loss_plan_execute(p, &a, NULL, 0, NULL));
  const double mass = (exp(-0.5) + exp(-1.5) + exp(-1.0) * 2) / 3; /* rows 0, 2, 3 (row 1 ignored) */
  assert_float_equal(b->scalars[HL_LOSS_OUT_TOPK_MASS], mass, 1e-6);
  assert_true(b->scalars[HL_LOSS_OUT_DISTILL] > 0.0f);
  assert_ok(hl_loss_plan_destroy(p));
  /* On a shard its records carry the k logits: 8 more bytes an id (fp64), checked by stats. */
  d.vocab_global = V + 3, d.ranks = 2;
  assert_ok(hl_loss_plan_create(&d, &p));
  size_t block = 0;
  assert_ok(hl_loss_plan_get_stats_size(p, N, &block));
  assert_int_equal(block, 64 + N * (104 + 2 * 8));
  int64_t *stats = calloc(block / 8, 8);
  assert_fails(hl_loss_plan_execute_stats(p, &a, stats, block - 8, NULL), HL_STATUS_INVALID_VALUE,
               "stats_bytes is");
  assert_ok(hl_loss_plan_execute_stats(p, &a, stats, block, NULL));
  double z[2];
  memcpy(z, (char *)stats + 64 + 104, sizeof z); /* row 0's ids 0 and 5: the shard [0, 6) has both */
  assert_float_equal(z[0], b->logits[0], 1e-12);
  assert_float_equal(z[1], b->logits[5], 1e-12);
  memcpy(z, (char *)stats + 64 + 3 * (104 + 16) + 104, sizeof z); /* row 3: padding */
  assert_true(isinf(z[0]) && z[0] < 0 && isinf(z[1]));
  free(stats);
  assert_ok(hl_loss_plan_destroy(p));
  free(b);
}

/* The split (tensor-parallel) calls: their buffers are checked, NCCL needs a CUDA plan, and a
 * shard plan is not run whole. Results are covered by tests/python/test_loss_tp.py. */
static void split_calls(void **state) {
  (void)state;
  Bufs *b = calloc(1, sizeof *b);
  fill(b);
  hl_loss_plan_desc_t d = desc_ce();
  d.vocab_start = 0, d.vocab_global = V + 3, d.ranks = 2; /* the shard [0, 6) of 9 columns */
  hl_loss_plan_t p;
  assert_ok(hl_loss_plan_create(&d, &p));
  size_t block = 0;
  assert_ok(hl_loss_plan_get_stats_size(p, N, &block));
  assert_int_equal(block, 64 + N * 104); /* header + fp64 records */
  int64_t *stats = calloc(2 * block / 8, 8);
  hl_loss_args_t a = args_for(b);
  assert_fails(hl_loss_plan_execute(p, &a, NULL, 0, NULL), HL_STATUS_INVALID_VALUE, "vocabulary shard");
  assert_fails(hl_loss_plan_execute_stats(p, &a, stats, block - 1, NULL), HL_STATUS_INVALID_VALUE,
               "stats_bytes is");
  assert_fails(hl_loss_plan_execute_stats(p, &a, NULL, block, NULL), HL_STATUS_INVALID_VALUE,
               "stats is NULL");
  assert_fails(hl_loss_plan_execute_stats(p, &a, (char *)stats + 4, block, NULL), HL_STATUS_MISALIGNED,
               "8-byte aligned");
  assert_ok(hl_loss_plan_execute_stats(p, &a, stats, block, NULL));
  assert_int_equal(stats[0], 0x31534c48); /* "HLS1" */
  assert_int_equal(stats[2], N);
  /* One block where the plan expects two: too small, then (a zeroed second block) a bad header. */
  assert_fails(hl_loss_plan_execute_finish(p, &a, stats, block, NULL, 0, NULL), HL_STATUS_INVALID_VALUE,
               "gathered_bytes is");
  assert_fails(hl_loss_plan_execute_finish(p, &a, stats, 2 * block, NULL, 0, NULL),
               HL_STATUS_INVALID_VALUE, "block 1 is not a block of statistics");
  assert_true(untouched(b));
  assert_fails(hl_loss_plan_execute_nccl(p, &a, (void *)stats, NULL, 0, NULL), HL_STATUS_NOT_SUPPORTED,
               "NCCL needs a CUDA plan");
  assert_fails(hl_loss_plan_execute_nccl(p, &a, NULL, NULL, 0, NULL), HL_STATUS_INVALID_VALUE,
               "nccl_comm is NULL");
  /* One exchange: no middle step. */
  int exchanges = 0;
  assert_ok(hl_loss_plan_get_exchanges(p, &exchanges));
  assert_int_equal(exchanges, 1);
  size_t mid = 0;
  assert_fails(hl_loss_plan_get_middle_size(p, N, &mid), HL_STATUS_INVALID_VALUE, "has no middle step");
  assert_fails(hl_loss_plan_execute_middle(p, &a, stats, 2 * block, stats, block, NULL, 0, NULL),
               HL_STATUS_INVALID_VALUE, "has no middle step");
  assert_fails(hl_loss_plan_execute_finish_with_middle(p, &a, stats, 2 * block, stats, block, NULL, 0, NULL),
               HL_STATUS_INVALID_VALUE, "has no middle step");
  assert_true(untouched(b));
  assert_ok(hl_loss_plan_destroy(p));
  free(stats);
  free(b);
}

/* The stats block's plan fingerprint of d (the shard [0, 6) of 9 columns). */
static int64_t fingerprint_of(hl_loss_plan_desc_t d, Bufs *b) {
  d.vocab_start = 0, d.vocab_global = V + 3, d.ranks = 2;
  hl_loss_plan_t p;
  assert_ok(hl_loss_plan_create(&d, &p));
  size_t block = 0;
  assert_ok(hl_loss_plan_get_stats_size(p, N, &block));
  int64_t *stats = calloc(block / 8, 8);
  hl_loss_args_t a = args_for(b);
  assert_ok(hl_loss_plan_execute_stats(p, &a, stats, block, NULL));
  const int64_t f = stats[1];
  free(stats);
  assert_ok(hl_loss_plan_destroy(p));
  return f;
}

/* Ranks that spell a default as 0 or as its value (or set the weight of a term that is off, or
 * leave garbage in the padding) make one plan; a different option makes another. */
static void ranks_agree_on_spelled_defaults(void **state) {
  (void)state;
  Bufs *b = calloc(1, sizeof *b);
  fill(b);
  hl_loss_plan_desc_t zero = desc_ce(), spelled;
  zero.ce_weight = 0.0f;
  memset(&spelled, 0xA5, sizeof spelled); /* the padding too */
  spelled = (hl_loss_plan_desc_t)HL_LOSS_PLAN_DESC_INIT;
  spelled.backend = HL_BACKEND_CPU, spelled.vocab = V, spelled.logits_dtype = HL_DTYPE_F32;
  spelled.labels_dtype = HL_DTYPE_I64, spelled.terms = HL_LOSS_CE, spelled.grad_mode = HL_LOSS_GRAD_WRITE;
  spelled.entropy_weight = 3.0f; /* its term is off */
  const int64_t f = fingerprint_of(zero, b);
  assert_true(f == fingerprint_of(spelled, b));
  spelled.label_smoothing = 0.1f;
  assert_true(f != fingerprint_of(spelled, b));
  free(b);
}

/* Dense JSD on a shard: two exchanges, its finish refuses to run without the middle blocks. */
static void two_exchanges(void **state) {
  (void)state;
  Bufs *b = calloc(1, sizeof *b);
  fill(b);
  hl_loss_plan_desc_t d = desc_ce();
  d.terms = HL_LOSS_CE | HL_LOSS_DISTILL_JSD, d.distill_weight = 1.0f, d.jsd_beta = 0.5f;
  d.vocab_start = 0, d.vocab_global = V + 3, d.ranks = 2;
  hl_loss_plan_t p;
  assert_ok(hl_loss_plan_create(&d, &p));
  int exchanges = 0;
  size_t block = 0, mid = 0;
  assert_ok(hl_loss_plan_get_exchanges(p, &exchanges));
  assert_int_equal(exchanges, 2);
  assert_ok(hl_loss_plan_get_stats_size(p, N, &block));
  assert_ok(hl_loss_plan_get_middle_size(p, N, &mid));
  assert_int_equal(mid, 64 + N * 16); /* header + two fp64 sums a row */
  int64_t *stats = calloc(2 * block / 8, 8), *mids = calloc(2 * mid / 8, 8);
  hl_loss_args_t a = args_for(b);
  a.teacher_logits = b->teacher;
  assert_ok(hl_loss_plan_execute_stats(p, &a, stats, block, NULL));
  assert_fails(hl_loss_plan_execute_finish(p, &a, stats, 2 * block, NULL, 0, NULL), HL_STATUS_INVALID_VALUE,
               "needs two exchanges");
  assert_fails(hl_loss_plan_execute_middle(p, &a, stats, 2 * block, mids, mid - 1, NULL, 0, NULL),
               HL_STATUS_INVALID_VALUE, "middle_bytes is");
  /* The second block is zeros: a bad header, for the middle step and finish_with_middle alike. */
  assert_fails(hl_loss_plan_execute_middle(p, &a, stats, 2 * block, mids, mid, NULL, 0, NULL),
               HL_STATUS_INVALID_VALUE, "block 1 is not a block of statistics");
  assert_fails(hl_loss_plan_execute_finish_with_middle(p, &a, stats, 2 * block, NULL, 2 * mid, NULL, 0, NULL),
               HL_STATUS_INVALID_VALUE, "gathered_middle is NULL");
  assert_fails(hl_loss_plan_execute_finish_with_middle(p, &a, stats, 2 * block, stats, 2 * mid, NULL, 0, NULL),
               HL_STATUS_INVALID_VALUE, "block 1 is not a block of statistics");
  assert_true(untouched(b));
  assert_ok(hl_loss_plan_destroy(p));
  free(stats);
  free(mids);
  free(b);
}

/* HL_LOSS_PLAN_DESC_INIT's spelled-out defaults make a valid plan (its rollout_cap and jsd_beta
 * were refused without their options). */
static void desc_init_is_valid(void **state) {
  (void)state;
  hl_loss_plan_desc_t d = HL_LOSS_PLAN_DESC_INIT;
  d.backend = HL_BACKEND_CPU, d.vocab = V, d.logits_dtype = HL_DTYPE_F32;
  d.labels_dtype = HL_DTYPE_I64, d.terms = HL_LOSS_CE;
  hl_loss_plan_t p;
  assert_ok(hl_loss_plan_create(&d, &p));
  assert_ok(hl_loss_plan_destroy(p));
}

/* Labels, a sparse teacher's ids and cu_seqlens are read as integers: values past 2^53 are not
 * rounded through a double (INT64_MAX passed the range check with loss = inf; a label equal to an
 * ignore_index of 2^53 + 1 was refused), in every call that reads them. */
static void integers_are_read_exactly(void **state) {
  (void)state;
  const int64_t big = ((int64_t)1 << 53) + 1;
  Bufs *b = calloc(1, sizeof *b);
  fill(b);
  hl_loss_plan_desc_t d = desc_ce();
  hl_loss_args_t a = args_for(b);
  b->labels[2] = INT64_MAX;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "labels[2] is 9223372036854775807, outside [0, vocab = 6)");
  hl_loss_plan_desc_t lin = desc_ce(); /* the fused linear form: the same check */
  lin.grad_mode = HL_LOSS_GRAD_NONE, lin.hidden = 2, lin.weight_dtype = HL_DTYPE_F32;
  hl_loss_args_t la = args_for(b);
  la.logits = NULL, la.grad = NULL, la.hidden = b->logits, la.weight = b->teacher; /* [N, 2], [V, 2] */
  execute_fails(lin, la, b, HL_STATUS_INVALID_VALUE, "labels[2] is 9223372036854775807");
  b->labels[2] = big - 1;
  d.use_ignore_index = 1, d.ignore_index = big;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "labels[2] is 9007199254740992");
  /* The label equal to ignore_index is ignored: the scalars of a row labelled -100. */
  hl_loss_plan_t p;
  assert_ok(hl_loss_plan_create(&d, &p));
  b->labels[2] = -100;
  assert_ok(hl_loss_plan_execute(p, &a, NULL, 0, NULL));
  float want[HL_LOSS_NUM_SCALARS];
  memcpy(want, b->scalars, sizeof want);
  b->labels[2] = big;
  assert_ok(hl_loss_plan_execute(p, &a, NULL, 0, NULL));
  assert_memory_equal(want, b->scalars, sizeof want);
  assert_float_equal(b->scalars[HL_LOSS_OUT_VALID_ROWS], N - 2, 0);
  assert_ok(hl_loss_plan_destroy(p));
  /* I32 labels, and the split's steps (statistics and finish read the labels). */
  fill(b);
  int32_t l32[N] = {0, -100, INT32_MAX, 3};
  hl_loss_plan_desc_t d32 = desc_ce();
  d32.labels_dtype = HL_DTYPE_I32;
  a.labels = l32;
  execute_fails(d32, a, b, HL_STATUS_INVALID_VALUE, "labels[2] is 2147483647");
  a = args_for(b);
  d = desc_ce(), d.vocab_global = V + 3, d.ranks = 2;
  assert_ok(hl_loss_plan_create(&d, &p));
  size_t block = 0;
  assert_ok(hl_loss_plan_get_stats_size(p, N, &block));
  int64_t *stats = calloc(2 * block / 8, 8);
  b->labels[3] = INT64_MAX;
  assert_fails(hl_loss_plan_execute_stats(p, &a, stats, block, NULL), HL_STATUS_INVALID_VALUE, "labels[3]");
  assert_fails(hl_loss_plan_execute_finish(p, &a, stats, 2 * block, NULL, 0, NULL), HL_STATUS_INVALID_VALUE,
               "labels[3]");
  assert_true(untouched(b) && stats[0] == 0);
  assert_ok(hl_loss_plan_destroy(p));
  free(stats);
  b->labels[3] = 3;
  /* A sparse teacher's id of INT64_MAX (a double made it padding) and past 2^53. */
  d = desc_ce(), d.terms = HL_LOSS_DISTILL_FWD, d.teacher_topk = 2, d.teacher_topk_ids_dtype = HL_DTYPE_I64;
  int64_t ids[N * 2] = {0, 5, 1, 2, 3, INT64_MAX, -1, -1};
  float lp[N * 2] = {-0.5f, -1.5f, -0.25f, -2.0f, -1.0f, -1.0f, 0, 0};
  a = args_for(b), a.labels = NULL, a.teacher_topk_ids = ids, a.teacher_topk_logprobs = lp;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "teacher_topk_ids[2, 1] is 9223372036854775807");
  ids[5] = big;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "teacher_topk_ids[2, 1] is 9007199254740993");
  ids[5] = INT64_MIN; /* padding, of any negative value */
  assert_ok(hl_loss_plan_create(&d, &p));
  assert_ok(hl_loss_plan_execute(p, &a, NULL, 0, NULL));
  assert_ok(hl_loss_plan_destroy(p));
  /* cu_seqlens (GSPO). */
  fill(b);
  d = desc_ce(), d.terms = HL_LOSS_GRPO, d.ratio_level = HL_LOSS_LEVEL_SEQ_MEAN, d.cu_seqlens_dtype = HL_DTYPE_I64;
  int64_t cu[3] = {0, big, N};
  a = args_for(b), a.advantages = b->adv, a.old_logprobs = b->old, a.cu_seqlens = cu, a.num_seqs = 2;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "cu_seqlens[1] is 9007199254740993");
  free(b);
}

/* In place only as the header allows: in the fused linear form nothing (grad_hidden over hidden
 * gave a wrong grad_weight behind SUCCESS), and no per-token output over an input. */
static void only_the_allowed_alias(void **state) {
  (void)state;
  enum { H = 3 };
  float hidden[N * H], weight[V * H], gw[V * H];
  for (int i = 0; i < N * H; ++i) hidden[i] = (float)(i % 7) * 0.25f;
  for (int i = 0; i < V * H; ++i) weight[i] = (float)(i % 5) * 0.5f - 1.0f, gw[i] = -7.0f;
  Bufs *b = calloc(1, sizeof *b);
  fill(b);
  hl_loss_plan_desc_t d = desc_ce();
  d.grad_mode = HL_LOSS_GRAD_NONE, d.hidden = H, d.weight_dtype = HL_DTYPE_F32;
  d.grad_hidden_mode = d.grad_weight_mode = HL_LOSS_GRAD_WRITE;
  hl_loss_args_t a = args_for(b);
  a.logits = NULL, a.grad = NULL, a.hidden = hidden, a.weight = weight, a.grad_weight = gw;
  a.grad_hidden = hidden;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "grad_hidden overlaps hidden; an output may share memory with "
                "an input only in place, as grad = logits");
  a.grad_hidden = b->grad, a.grad_weight = weight;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "grad_weight overlaps weight");
  a.grad_weight = gw, a.grad_weight_stride = INT64_MAX; /* it wrote before grad_weight */
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "grad_weight_stride is 9223372036854775807");
  for (int i = 0; i < V * H; ++i) assert_true(gw[i] == -7.0f);
  a = args_for(b), a.token_loss = b->weights, a.weights = b->weights;
  execute_fails(desc_ce(), a, b, HL_STATUS_INVALID_VALUE, "token_loss overlaps weights");
  free(b);
}

/* The fused linear form without rows: grad_weight written whole (zeros), hidden and weight neither
 * required nor read (the CPU backend read a NULL weight). */
static void linear_without_rows(void **state) {
  (void)state;
  float gw[V * 3];
  for (int i = 0; i < V * 3; ++i) gw[i] = -7.0f;
  hl_loss_plan_desc_t d = desc_ce();
  d.grad_mode = HL_LOSS_GRAD_NONE, d.hidden = 3, d.weight_dtype = HL_DTYPE_F32;
  d.grad_weight_mode = HL_LOSS_GRAD_WRITE;
  hl_loss_args_t a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.grad_weight = gw;
  hl_loss_plan_t p;
  assert_ok(hl_loss_plan_create(&d, &p));
  assert_ok(hl_loss_plan_execute(p, &a, NULL, 0, NULL));
  for (int i = 0; i < V * 3; ++i) assert_true(gw[i] == 0.0f);
  assert_ok(hl_loss_plan_destroy(p));
}

#define ARG(f) HL_FIELD(hl_loss_args_t, f)
#define DESC(f) HL_FIELD(hl_loss_plan_desc_t, f)

/* A plan and the buffers of its calls. */
typedef struct {
  hl_loss_plan_t p;
  Bufs *b;
} Call;
static int call_untouched(void *c) { return untouched(((Call *)c)->b); }
static hl_status_t execute_with(void *ctx, HlField f, int64_t v) {
  Call *c = ctx;
  hl_loss_args_t a = args_for(c->b);
  hl_set_field(&a, f, v);
  return hl_loss_plan_execute(c->p, &a, NULL, 0, NULL);
}
static hl_status_t create_with(void *ctx, HlField f, int64_t v) {
  Call *c = ctx;
  hl_loss_plan_desc_t d = desc_ce();
  hl_set_field(&d, f, v);
  c->p = NULL;
  return hl_loss_plan_create(&d, &c->p);
}
static int no_plan(void *ctx) { return ((Call *)ctx)->p == NULL; }

/* Every size, count and stride out of range, and every enumeration out of its type (as an
 * integer, never loaded as the enum), refused naming the field before any other use; spans
 * past HL_MAX_SPAN_BYTES too. Nothing written. */
static void sizes_and_enums(void **state) {
  (void)state;
  Bufs *b = calloc(1, sizeof *b);
  fill(b);
  hl_loss_plan_desc_t d = desc_ce();
  Call c = {NULL, b};
  assert_ok(hl_loss_plan_create(&d, &c.p));
  const HlField args[] = {
      ARG(rows), ARG(logits_stride), ARG(teacher_stride), ARG(grad_stride), ARG(hidden_stride), ARG(weight_stride),
      ARG(teacher_hidden_stride), ARG(teacher_weight_stride), ARG(grad_hidden_stride), ARG(grad_weight_stride),
      ARG(num_seqs), ARG(teacher_topk_ids_stride), ARG(teacher_topk_logprobs_stride)};
  hl_check_bad_fields("hl_loss_plan_execute", args, sizeof args / sizeof args[0], &c, execute_with, call_untouched);
  assert_ok(hl_loss_plan_destroy(c.p));
  const HlField desc[] = {
      DESC(vocab), DESC(vocab_start), DESC(vocab_global), DESC(hidden), DESC(teacher_hidden), DESC(backend),
      DESC(logits_dtype), DESC(labels_dtype), DESC(grad_mode), DESC(grad_dtype), DESC(weight_dtype),
      DESC(grad_hidden_mode), DESC(grad_hidden_dtype), DESC(grad_weight_mode), DESC(grad_weight_dtype),
      DESC(cu_seqlens_dtype), DESC(teacher_topk_ids_dtype)};
  hl_check_bad_fields("hl_loss_plan_create", desc, sizeof desc / sizeof desc[0], &c, create_with, no_plan);
  hl_loss_args_t a = args_for(b);
  a.rows = (int64_t)1 << 40, a.logits_stride = (int64_t)1 << 30;
  execute_fails(desc_ce(), a, b, HL_STATUS_INVALID_VALUE, "logits spans more than HL_MAX_SPAN_BYTES");
  /* Sizes each in range whose matrix is not. */
  d = desc_ce();
  d.grad_mode = HL_LOSS_GRAD_NONE, d.hidden = (int64_t)1 << 40, d.vocab = (int64_t)1 << 30;
  d.weight_dtype = HL_DTYPE_F32;
  a = args_for(b), a.logits = NULL, a.grad = NULL, a.hidden = b->logits, a.weight = b->teacher;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "weight spans more than HL_MAX_SPAN_BYTES");
  /* The stride's own name (teacher_stride was reported as teacher_logits_stride). */
  d = desc_ce(), d.terms = HL_LOSS_DISTILL_FWD;
  a = args_for(b), a.teacher_logits = b->teacher, a.teacher_stride = V - 1;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "teacher_stride is 5, smaller than cols");
  free(b);
}

/* Size queries: rows in range (2^60 and 2^61 wrapped to small answers), the answer at the largest
 * rows accepted, and errors under the name of the query asked. */
static void size_queries(void **state) {
  (void)state;
  hl_loss_plan_desc_t d = desc_ce();
  d.terms = HL_LOSS_DISTILL_JSD, d.labels_dtype = HL_DTYPE_NONE, d.vocab_global = V + 3, d.ranks = 2;
  hl_loss_plan_t p;
  assert_ok(hl_loss_plan_create(&d, &p));
  size_t bytes = 7, lo = 7;
  const int64_t big[] = {(int64_t)1 << 60, (int64_t)1 << 61, INT64_MAX, -1};
  for (int i = 0; i < 4; ++i) {
    assert_fails(hl_loss_plan_get_middle_size(p, big[i], &bytes), HL_STATUS_INVALID_VALUE, "rows is");
    assert_fails(hl_loss_plan_get_stats_size(p, big[i], &bytes), HL_STATUS_INVALID_VALUE, "rows is");
    assert_fails(hl_loss_plan_get_workspace_sizes(p, big[i], &lo, &bytes), HL_STATUS_INVALID_VALUE, "rows is");
    assert_fails(hl_loss_plan_get_workspace_size(p, big[i], &bytes), HL_STATUS_INVALID_VALUE, "rows is");
  }
  assert_true(bytes == 7 && lo == 7);
  assert_ok(hl_loss_plan_get_stats_size(p, HL_MAX_EXTENT, &bytes));
  assert_true(bytes == 64 + (size_t)HL_MAX_EXTENT * 104);
  assert_ok(hl_loss_plan_get_middle_size(p, HL_MAX_EXTENT, &bytes));
  assert_true(bytes == 64 + (size_t)HL_MAX_EXTENT * 16);
  assert_fails(hl_loss_plan_get_workspace_size(p, 4, NULL), HL_STATUS_INVALID_VALUE, "bytes is NULL");
  assert_ok(hl_loss_plan_destroy(p));
}

/* struct_size: this header's, an earlier one's (each descriptor's list), or a later one's up to
 * HL_MAX_STRUCT_SIZE with a zero tail; else INVALID_VALUE naming struct_size and the sizes. */
static void struct_sizes(void **state) {
  (void)state;
  Bufs *b = calloc(1, sizeof *b);
  fill(b);
  const size_t earlier[] = {128, 136, 176, 192, 232}, bad[] = {0, 3, 100, 150, 200, 231, 4097, SIZE_MAX};
  hl_loss_plan_t p;
  for (size_t i = 0; i < sizeof earlier / sizeof earlier[0]; ++i) {
    hl_loss_plan_desc_t d = desc_ce();
    d.struct_size = earlier[i];
    assert_ok(hl_loss_plan_create(&d, &p));
    assert_ok(hl_loss_plan_destroy(p));
  }
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
    char needle[160];
    hl_loss_plan_desc_t d = desc_ce();
    d.struct_size = bad[i];
    snprintf(needle, sizeof needle, "struct_size is %zu; set it to sizeof the descriptor (%zu here; earlier "
             "headers': 128, 136, 176, 192, 232)", bad[i], sizeof d);
    create_fails(d, HL_STATUS_INVALID_VALUE, needle);
    hl_loss_args_t a = args_for(b);
    a.struct_size = bad[i];
    snprintf(needle, sizeof needle, "struct_size is %zu; set it to sizeof the descriptor (%zu here; earlier "
             "headers': 160, 256, 312, 336)", bad[i], sizeof a);
    execute_fails(desc_ce(), a, b, HL_STATUS_INVALID_VALUE, needle);
  }
  union {
    hl_loss_args_t a;
    unsigned char bytes[HL_MAX_STRUCT_SIZE];
  } later;
  memset(&later, 0, sizeof later);
  later.a = args_for(b);
  later.a.struct_size = HL_MAX_STRUCT_SIZE;
  hl_loss_plan_desc_t d = desc_ce();
  assert_ok(hl_loss_plan_create(&d, &p));
  later.a.struct_size = 160; /* 0.1's arguments */
  assert_ok(hl_loss_plan_execute(p, &later.a, NULL, 0, NULL));
  fill(b);
  later.a.struct_size = HL_MAX_STRUCT_SIZE;
  assert_ok(hl_loss_plan_execute(p, &later.a, NULL, 0, NULL));
  fill(b);
  later.bytes[HL_MAX_STRUCT_SIZE - 1] = 1;
  assert_fails(hl_loss_plan_execute(p, &later.a, NULL, 0, NULL), HL_STATUS_NOT_SUPPORTED, "does not know");
  assert_true(untouched(b));
  assert_ok(hl_loss_plan_destroy(p));
  free(b);
}

/* Gathered blocks are the caller's data: a nonzero reserved header word, and shard fields whose
 * sum overflowed, are refused naming the buffer; the records themselves are used as given. */
static void gathered_headers(void **state) {
  (void)state;
  Bufs *b = calloc(1, sizeof *b);
  fill(b);
  hl_loss_plan_desc_t d = desc_ce();
  d.vocab_global = V + 3, d.ranks = 2;
  hl_loss_plan_t p0, p1;
  assert_ok(hl_loss_plan_create(&d, &p0));
  d.vocab = 3, d.vocab_start = V;
  assert_ok(hl_loss_plan_create(&d, &p1));
  size_t b0 = 0, b1 = 0;
  assert_ok(hl_loss_plan_get_stats_size(p0, N, &b0));
  assert_ok(hl_loss_plan_get_stats_size(p1, N, &b1));
  assert_int_equal(b0, b1);
  int64_t *g = calloc(2 * b0 / 8, 8);
  hl_loss_args_t a = args_for(b);
  assert_ok(hl_loss_plan_execute_stats(p0, &a, g, b0, NULL));
  float other[N * 3];
  for (int i = 0; i < N * 3; ++i) other[i] = (float)(i % 4);
  hl_loss_args_t a1 = args_for(b);
  a1.logits = other, a1.grad = NULL, a1.token_loss = NULL, a1.scalars = NULL;
  assert_ok(hl_loss_plan_execute_stats(p1, &a1, g + b0 / 8, b0, NULL));
  int64_t *h1 = g + b0 / 8;
  h1[7] = 1;
  assert_fails(hl_loss_plan_execute_finish(p0, &a, g, 2 * b0, NULL, 0, NULL), HL_STATUS_INVALID_VALUE,
               "gathered block 1's header holds 1 in its reserved 8th word");
  h1[7] = 0, h1[3] = INT64_MAX; /* vocab_start */
  assert_fails(hl_loss_plan_execute_finish(p0, &a, g, 2 * b0, NULL, 0, NULL), HL_STATUS_INVALID_VALUE,
               "gathered block 1's shard (vocab_start 9223372036854775807");
  assert_true(untouched(b));
  h1[3] = V;
  assert_ok(hl_loss_plan_execute_finish(p0, &a, g, 2 * b0, NULL, 0, NULL));
  assert_ok(hl_loss_plan_destroy(p0));
  assert_ok(hl_loss_plan_destroy(p1));
  free(g);
  free(b);
}

/* Per-token upstream gradients: the flags and fields agree (each refused naming the field), and a
 * plan of no term gives their product alone: against central differences of the plan's own
 * token outputs (F32 logits, the CPU backend's fp64 math). */
static void token_gradients(void **state) {
  (void)state;
  Bufs *b = calloc(1, sizeof *b);
  fill(b);
  const unsigned all = HL_LOSS_GRAD_TOKEN_LOGP | HL_LOSS_GRAD_TOKEN_ENTROPY | HL_LOSS_GRAD_TOKEN_LSE;
  hl_loss_plan_desc_t d = desc_ce();
  d.terms = 0, d.grad_mode = HL_LOSS_GRAD_WRITE;
  create_fails(d, HL_STATUS_INVALID_VALUE, "terms is 0 (metrics only) and no HL_LOSS_GRAD_TOKEN_*");
  d.flags = all, d.grad_mode = HL_LOSS_GRAD_NONE;
  create_fails(d, HL_STATUS_INVALID_VALUE, "HL_LOSS_GRAD_TOKEN_* bits but no gradient");
  d.grad_mode = HL_LOSS_GRAD_WRITE, d.labels_dtype = HL_DTYPE_NONE;
  create_fails(d, HL_STATUS_INVALID_VALUE, "HL_LOSS_GRAD_TOKEN_LOGP needs labels");
  d = desc_ce(), d.flags = 1u << 5;
  create_fails(d, HL_STATUS_INVALID_VALUE, "flags has unknown bits 0x20");
  float g_logp[N], g_ent[N], g_lse[N];
  for (int i = 0; i < N; ++i) g_logp[i] = 0.5f - 0.25f * (float)i, g_ent[i] = 0.3f * (float)i - 0.2f, g_lse[i] = 0.125f;
  hl_loss_args_t a = args_for(b);
  a.grad_token_entropy = g_ent;
  execute_fails(desc_ce(), a, b, HL_STATUS_INVALID_VALUE,
                "grad_token_entropy is set but the plan's flags lack HL_LOSS_GRAD_TOKEN_ENTROPY");
  d = desc_ce(), d.flags = all, d.terms = 0;
  a.grad_token_logp = g_logp, a.grad_token_lse = NULL;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "grad_token_lse is NULL; HL_LOSS_GRAD_TOKEN_LSE needs it");
  a.grad_token_lse = g_lse, a.labels = NULL;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "labels is NULL; HL_LOSS_GRAD_TOKEN_LOGP needs it");
  a.labels = b->labels, a.grad_token_lse = (const float *)b->grad;
  execute_fails(d, a, b, HL_STATUS_INVALID_VALUE, "grad overlaps grad_token_lse");

  /* The product alone (terms = 0) against differences of sum_t g_logp logp + g_ent H + g_lse lse;
   * a logit scale, and row 1 ignored (its logp a constant 0). */
  d.logit_scale = 0.7f;
  hl_loss_plan_t p;
  assert_ok(hl_loss_plan_create(&d, &p));
  a.grad_token_lse = g_lse, a.token_loss = NULL;
  assert_ok(hl_loss_plan_execute(p, &a, NULL, 0, NULL));
  hl_loss_plan_desc_t fd = d;
  fd.flags = 0, fd.grad_mode = HL_LOSS_GRAD_NONE;
  hl_loss_plan_t fwd;
  assert_ok(hl_loss_plan_create(&fd, &fwd));
  float tp[N], te[N], tz[N];
  hl_loss_args_t f = args_for(b);
  f.grad = NULL, f.scalars = NULL, f.token_loss = NULL, f.token_logp = tp, f.token_entropy = te, f.token_lse = tz;
  const float h = 1.0f / 64;
  for (int i = 0; i < N * V; ++i) {
    double side[2];
    const float x = b->logits[i];
    for (int k = 0; k < 2; ++k) {
      b->logits[i] = x + (k ? h : -h);
      assert_ok(hl_loss_plan_execute(fwd, &f, NULL, 0, NULL));
      side[k] = 0;
      for (int t = 0; t < N; ++t) side[k] += (double)g_logp[t] * tp[t] + (double)g_ent[t] * te[t] + (double)g_lse[t] * tz[t];
    }
    b->logits[i] = x;
    assert_true(fabs(b->grad[i] - (side[1] - side[0]) / (2 * h)) < 2e-3);

  }
  assert_ok(hl_loss_plan_destroy(fwd));
  assert_ok(hl_loss_plan_destroy(p));
  free(b);
}

/* 0.7's options: token scaling's validation, the logits form refusing a bias, token_argmax (the
 * first maximal column, ignored rows too), and the linear form's bias and grad_bias against the
 * logits form on X W^T + b (H = 1, X = 1: the logits are W + b; grad_bias = the column sums). */
static void options_0_7(void **state) {
  (void)state;
  Bufs *b = calloc(1, sizeof *b);
  fill(b);
  hl_loss_plan_desc_t d = desc_ce();
  d.flags = HL_LOSS_TOKEN_SCALING, d.terms = HL_LOSS_CE | HL_LOSS_ENTROPY, d.entropy_weight = -1e-3f;
  create_fails(d, HL_STATUS_INVALID_VALUE, "flags has HL_LOSS_TOKEN_SCALING");
  d = desc_ce(), d.grad_bias_mode = HL_LOSS_GRAD_WRITE;
  create_fails(d, HL_STATUS_INVALID_VALUE, "grad_bias_mode is set, but it belongs to the fused linear form");
  hl_loss_args_t a = args_for(b);
  float bias[V] = {0};
  a.bias = bias;
  execute_fails(desc_ce(), a, b, HL_STATUS_INVALID_VALUE, "bias is set, but the plan is the logits form");

  b->logits[2 * V + 4] = 9.0f, b->logits[2 * V + 5] = 9.0f;  /* a tie: the first column counts */
  int64_t top[N];
  a = args_for(b), a.token_argmax = top;
  hl_loss_plan_t p;
  d = desc_ce(), d.flags = HL_LOSS_TOKEN_SCALING;
  assert_ok(hl_loss_plan_create(&d, &p));
  assert_ok(hl_loss_plan_execute(p, &a, NULL, 0, NULL));
  assert_ok(hl_loss_plan_destroy(p));
  for (int i = 0; i < N; ++i) {
    int64_t want = 0;
    for (int j = 1; j < V; ++j)
      if (b->logits[i * V + j] > b->logits[i * V + want]) want = j;
    assert_int_equal(top[i], want);
  }

  /* The linear form with H = 1: hidden is 1 a row, weight [V, 1] a column of row 0's logits minus
   * the bias; every row then has row 0's logits. */
  float x[N], w[V], gh[N], gw[V], gb[V], sc[HL_LOSS_NUM_SCALARS], zrep[N * V], g[N * V];
  for (int j = 0; j < V; ++j) bias[j] = 0.125f * (float)j, w[j] = b->logits[j] - bias[j];
  for (int i = 0; i < N; ++i) {
    x[i] = 1.0f;
    for (int j = 0; j < V; ++j) zrep[i * V + j] = b->logits[j];
  }
  hl_loss_plan_desc_t dl = desc_ce();
  dl.hidden = 1, dl.weight_dtype = HL_DTYPE_F32, dl.grad_mode = HL_LOSS_GRAD_NONE, dl.flags = HL_LOSS_TOKEN_SCALING;
  dl.grad_hidden_mode = dl.grad_weight_mode = dl.grad_bias_mode = HL_LOSS_GRAD_WRITE;
  hl_loss_args_t al = args_for(b);
  al.logits = NULL, al.grad = NULL, al.token_loss = NULL, al.scalars = sc;
  al.hidden = x, al.weight = w, al.bias = bias, al.grad_hidden = gh, al.grad_weight = gw, al.grad_bias = gb;
  assert_ok(hl_loss_plan_create(&dl, &p));
  assert_ok(hl_loss_plan_execute(p, &al, NULL, 0, NULL));
  assert_ok(hl_loss_plan_destroy(p));
  a = args_for(b), a.logits = zrep, a.grad = g, a.token_loss = NULL, a.scalars = b->scalars;
  assert_ok(hl_loss_plan_create(&d, &p));
  assert_ok(hl_loss_plan_execute(p, &a, NULL, 0, NULL));
  assert_ok(hl_loss_plan_destroy(p));
  assert_true(fabs(sc[HL_LOSS_OUT_LOSS] - b->scalars[HL_LOSS_OUT_LOSS]) < 1e-6);
  for (int j = 0; j < V; ++j) {
    double col = 0;
    for (int i = 0; i < N; ++i) col += g[i * V + j];
    assert_true(fabs(gb[j] - col) < 1e-6 && fabs(gw[j] - col) < 1e-6);  /* x = 1: grad_weight is the sums too */
  }
  free(b);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(bad_descriptions), cmocka_unit_test(bad_arguments),
                                     cmocka_unit_test(small_exact_case), cmocka_unit_test(split_calls),
                                     cmocka_unit_test(ranks_agree_on_spelled_defaults),
                                     cmocka_unit_test(sparse_teacher), cmocka_unit_test(two_exchanges),
                                     cmocka_unit_test(desc_init_is_valid),
                                     cmocka_unit_test(integers_are_read_exactly), cmocka_unit_test(linear_without_rows),
                                     cmocka_unit_test(only_the_allowed_alias), cmocka_unit_test(sizes_and_enums),
                                     cmocka_unit_test(size_queries), cmocka_unit_test(struct_sizes),
                                     cmocka_unit_test(gathered_headers), cmocka_unit_test(token_gradients),
                                     cmocka_unit_test(options_0_7)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
