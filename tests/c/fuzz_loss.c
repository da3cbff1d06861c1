/* The loss plan's cases of the ABI fuzz harness (test_fuzz.c): every hl_loss_plan_* entry point on
 * six controls, each checked against an independent computation or an equivalent call form:
 *   ce      CE + Z, I32 labels (one ignored), per-token outputs, gradient written with the per-token
 *           upstream gradients' product: checked in full
 *   full    every term but the exclusive ones, every optional input (teacher logits, weights,
 *           advantages, old / ref / rollout log-probs, sequences), padded strides, gradient
 *           accumulated: per-token outputs, metrics and the closed-form terms checked
 *   linear  the fused linear form with a fused teacher: against the logits form on X W^T
 *   topk    BF16, a sparse teacher with padding, JSD
 *   tp, jsd two ranks: statistics, a gather by memcpy, finish (dense JSD: middle and finish with
 *           middle), against the unsharded plan; corrupted gathered blocks. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"

/* Case.flags: the descriptor under test is the plan's (create; args are bound beside it); the
 * statistics or middle step (the args' outputs are not written). */
enum { LOSS_CREATE = 1 << 8, LOSS_READS = 1 << 9 };
enum { IGNORE_INDEX = 7, IGNORED_ROW = 2, IGNORE_INDEX_ROW = 4 };

typedef struct LossSpec {
  const char *name;
  int64_t N, Vg, V0; /* rows; the vocabulary, rank 0's shard [0, V0) of it (V0 = Vg: unsharded) */
  hl_dtype_t ldt, labdt, gdt;
  hl_loss_grad_mode_t gmode;
  int64_t ls, ts, gs; /* logits, teacher, grad strides (0: packed) */
  unsigned terms;
  int teacher, rl, seqs, ignore, noweights, topk;
  hl_dtype_t idt;
  int64_t ids_stride;
  int64_t H, Ht, hs, ws, ths, tws, ghs, gws; /* the fused linear form (H > 0) */
  hl_loss_grad_mode_t ghmode, gwmode;
  void (*opts)(hl_loss_plan_desc_t *, hl_loss_args_t *);
} LossSpec;

typedef struct {
  hl_loss_plan_t plan;
  int64_t rows;
  void *stats;
  size_t stats_bytes;
  const void *gathered;
  size_t gathered_bytes;
  void *middle;
  size_t middle_bytes;
  const void *gathered_middle;
  size_t gathered_middle_bytes;
  void *workspace;
  size_t workspace_bytes;
  void *nccl_comm;
  size_t *min_bytes, *fast_bytes, *bytes;
  int *exchanges;
  hl_loss_plan_t *plan_out;
  int index;
} LossParams;

static void ce_opts(hl_loss_plan_desc_t *d, hl_loss_args_t *a) {
  d->flags = HL_LOSS_GRAD_TOKEN_LOGP | HL_LOSS_GRAD_TOKEN_ENTROPY | HL_LOSS_GRAD_TOKEN_LSE;
  a->grad_scale = 0.5f;
}

static void full_opts(hl_loss_plan_desc_t *d, hl_loss_args_t *a) {
  d->label_smoothing = 0.1f, d->logit_scale = 0.9f, d->softcap = 20.0f, d->teacher_temperature = 2.0f;
  d->student_temperature = 1.5f, d->eps_high = 0.28f, d->dual_clip = 3.0f, d->cispo_weight = 0.5f;
  d->cispo_eps_high = 4.0f, d->entropy_weight = -1e-3f, d->kl_ref_beta = 0.04f, d->distill_weight = 0.7f;
  a->divisor = 5.0, a->grad_scale = 1.0f;
}

static void linear_opts(hl_loss_plan_desc_t *d, hl_loss_args_t *a) { (void)a, d->distill_weight = 0.5f, d->student_temperature = 1.2f; }
static void topk_opts(hl_loss_plan_desc_t *d, hl_loss_args_t *a) { (void)a, d->jsd_beta = 0.3f; }
static void tp_opts(hl_loss_plan_desc_t *d, hl_loss_args_t *a) { (void)a, d->entropy_weight = -1e-3f; }
static void jsd_opts(hl_loss_plan_desc_t *d, hl_loss_args_t *a) { (void)a, d->jsd_beta = 0.25f; }

#define F32 HL_DTYPE_F32
static const LossSpec kCe = {"ce", 6, 37, 37, F32, HL_DTYPE_I32, F32, HL_LOSS_GRAD_WRITE, .terms = HL_LOSS_CE | HL_LOSS_Z, .opts = ce_opts};
static const LossSpec kFull = {"full", 8, 29, 29, F32, HL_DTYPE_I64, F32, HL_LOSS_GRAD_ACCUMULATE, 32, 31, 33,
                               HL_LOSS_CE | HL_LOSS_Z | HL_LOSS_ENTROPY | HL_LOSS_DISTILL_FWD | HL_LOSS_GRPO |
                                   HL_LOSS_GRPO_KL_REF | HL_LOSS_CISPO,
                               .teacher = 1, .rl = 1, .seqs = 1, .ignore = 1, .opts = full_opts};
static const LossSpec kLinear = {"linear", 5, 23, 23, F32, HL_DTYPE_I64, .terms = HL_LOSS_CE | HL_LOSS_DISTILL_REV,
                                 .teacher = 1, .H = 12, .Ht = 7, .hs = 13, .ws = 14, .tws = 9, .ghs = 13, .gws = 14,
                                 .ghmode = HL_LOSS_GRAD_WRITE, .gwmode = HL_LOSS_GRAD_ACCUMULATE, .opts = linear_opts};
static const LossSpec kTopk = {"topk", 6, 41, 41, HL_DTYPE_BF16, HL_DTYPE_I32, HL_DTYPE_BF16, HL_LOSS_GRAD_WRITE,
                               .terms = HL_LOSS_CE | HL_LOSS_DISTILL_JSD, .noweights = 1, .topk = 4,
                               .idt = HL_DTYPE_I32, .ids_stride = 5, .opts = topk_opts};
static const LossSpec kTp = {"tp", 6, 29, 13, F32, HL_DTYPE_I64, F32, HL_LOSS_GRAD_WRITE,
                             .terms = HL_LOSS_CE | HL_LOSS_Z | HL_LOSS_ENTROPY | HL_LOSS_GRPO | HL_LOSS_DISTILL_REV,
                             .teacher = 1, .rl = 1, .opts = tp_opts};
static const LossSpec kJsd = {"jsd", 5, 19, 7, F32, HL_DTYPE_I64, F32, HL_LOSS_GRAD_WRITE,
                              .terms = HL_LOSS_CE | HL_LOSS_DISTILL_JSD, .teacher = 1, .opts = jsd_opts};

/* ---- the scenarios' data: functions of (scenario, row, column), the same on every rank -------- */

static double gval(const LossSpec *s, const char *what, int64_t i, int64_t j) {
  uint64_t h = seed_of(s->name, what) + (uint64_t)i * 0x9E3779B97F4A7C15ull + (uint64_t)j * 0xD1B54A32D192ED03ull;
  (void)rng_next(&h);
  return rng_unit(&h);
}

static double logit_at(const LossSpec *s, const char *what, int64_t i, int64_t j) {
  return round_to(s->ldt, 5 * gval(s, what, i, j) - 2.5);
}

static int64_t label_at(const LossSpec *s, int64_t i) {
  if (i == IGNORED_ROW) return -100;
  if (s->ignore && i == IGNORE_INDEX_ROW) return IGNORE_INDEX;
  return (i * 7 + 3) % s->Vg;
}

static int valid_row(const LossSpec *s, int64_t i) {
  const int64_t y = s->labdt ? label_at(s, i) : 0;
  return y >= 0 && !(s->ignore && y == IGNORE_INDEX);
}

/* A sparse teacher's k distinct ids a row (row IGNORED_ROW padded after two), and log-probs. */
static int64_t topk_id(const LossSpec *s, int64_t i, int m) { return i == IGNORED_ROW && m >= 2 ? -1 : (i * 5 + 11 * m + 1) % s->Vg; }
static double topk_lp(int m) { return log(0.35 / (m + 1)); }

typedef struct {
  double lse, ent, zy, mean;
  int64_t amax;
} RowRef;

/* A row's statistics over z_hat = softcap tanh(scale z / softcap) (scale z without a cap). */
static RowRef row_ref(const double *z, int64_t V, int64_t y, double scale, double cap) {
  double *zh = dalloc(V), m = -INFINITY, s = 0, pz = 0, sum = 0;
  RowRef r = {0, 0, NAN, 0, 0};
  for (int64_t j = 0; j < V; ++j) {
    zh[j] = cap ? cap * tanh(scale * z[j] / cap) : scale * z[j];
    if (zh[j] > m) m = zh[j], r.amax = j;
  }
  for (int64_t j = 0; j < V; ++j) s += exp(zh[j] - m), sum += zh[j];
  r.lse = m + log(s);
  for (int64_t j = 0; j < V; ++j) pz += exp(zh[j] - r.lse) * zh[j];
  r.ent = r.lse - pz;
  r.mean = sum / (double)V;
  if (y >= 0 && y < V) r.zy = zh[y];
  free(zh);
  return r;
}

static hl_loss_plan_desc_t *ldesc(Call *c) { return (c->cs->flags & LOSS_CREATE) ? DESC(c, hl_loss_plan_desc_t) : SIDE(c, hl_loss_plan_desc_t); }
static hl_loss_args_t *largs(Call *c) { return (c->cs->flags & LOSS_CREATE) ? SIDE(c, hl_loss_args_t) : DESC(c, hl_loss_args_t); }

/* Row i's statistics on the whole vocabulary as the plan of c sees its logits. */
static RowRef spec_row(Call *c, int64_t i) {
  const LossSpec *s = c->cs->spec;
  const hl_loss_plan_desc_t *d = ldesc(c);
  double *z = dalloc(s->Vg);
  for (int64_t j = 0; j < s->Vg; ++j) z[j] = logit_at(s, "logits", i, j);
  const RowRef r = row_ref(z, s->Vg, s->labdt ? label_at(s, i) : -1, d->logit_scale ? d->logit_scale : 1.0, d->softcap);
  free(z);
  return r;
}

/* ---- declaring a call ------------------------------------------------------------------------- */

static int is_reading_input(const char *name) {
  static const char *const names[] = {"logits", "labels", "teacher_logits", "teacher_topk_ids", "teacher_topk_logprobs",
                                      "hidden", "weight", "teacher_hidden", "teacher_weight"};
  for (int i = 0; i < NF(names); ++i)
    if (!strcmp(names[i], name)) return 1;
  return 0;
}

static Buf *row_input(Call *c, const char *name, int required) {
  Buf *b = buf_vec(c, name, R_IN, F32, ((const LossSpec *)c->cs->spec)->N);
  b->optional = !required;
  return b;
}

static void declare_logits_form(Call *c, const LossSpec *s, hl_loss_args_t *a) {
  Buf *l = buf_mat(c, "logits", R_IN, s->ldt, s->N, s->V0, s->ls);
  for (int64_t i = 0; i < s->N; ++i)
    for (int64_t j = 0; j < s->V0; ++j) buf_set(l, i, j, logit_at(s, "logits", i, j));
  a->logits_stride = s->ls;
  if (s->teacher) {
    Buf *t = buf_mat(c, "teacher_logits", R_IN, s->ldt, s->N, s->V0, s->ts);
    for (int64_t i = 0; i < s->N; ++i)
      for (int64_t j = 0; j < s->V0; ++j) buf_set(t, i, j, logit_at(s, "teacher", i, j));
    a->teacher_stride = s->ts;
  }
}

static void declare_linear_form(Call *c, const LossSpec *s, hl_loss_args_t *a) {
  const struct {
    const char *name;
    int64_t rows, cols, stride;
  } m[] = {{"hidden", s->N, s->H, s->hs}, {"weight", s->V0, s->H, s->ws},
           {"teacher_hidden", s->N, s->Ht, s->ths}, {"teacher_weight", s->V0, s->Ht, s->tws}};
  for (int i = 0; i < (s->Ht ? 4 : 2); ++i)
    buf_fill(buf_mat(c, m[i].name, R_IN, s->ldt, m[i].rows, m[i].cols, m[i].stride), seed_of(s->name, m[i].name), -1, 1);
  a->hidden_stride = s->hs, a->weight_stride = s->ws, a->teacher_hidden_stride = s->ths, a->teacher_weight_stride = s->tws;
}

/* Advantages and log-probs near the row's own (ratios near 1); whether each is required. */
static void declare_rl(Call *c, const LossSpec *s, const hl_loss_plan_desc_t *d) {
  const unsigned pg = d->terms & (HL_LOSS_GRPO | HL_LOSS_CISPO);
  Buf *adv = row_input(c, "advantages", pg), *old = row_input(c, "old_logprobs", pg || d->rollout_correction);
  Buf *ref = row_input(c, "ref_logprobs", d->terms & HL_LOSS_GRPO_KL_REF);
  Buf *roll = row_input(c, "rollout_logprobs", d->rollout_correction != 0);
  for (int64_t i = 0; i < s->N; ++i) {
    const RowRef r = spec_row(c, i);
    const double logp = isnan(r.zy) ? -1.0 : r.zy - r.lse, o = logp + 0.3 * sin((double)i + 1);
    buf_set(adv, 0, i, 2 * gval(s, "adv", i, 0) - 1);
    buf_set(old, 0, i, o);
    buf_set(ref, 0, i, logp - 0.2 * cos((double)i));
    buf_set(roll, 0, i, o + 0.15 * sin(2.0 * (double)i + 1));
  }
}

static void declare_outputs(Call *c, const LossSpec *s, hl_loss_args_t *a) {
  if (!s->H && s->gmode) {
    buf_mat(c, "grad", s->gmode == HL_LOSS_GRAD_ACCUMULATE ? R_INOUT : R_OUT, s->gdt, s->N, s->V0, s->gs);
    a->grad_stride = s->gs;
  }
  if (s->H) {
    buf_mat(c, "grad_hidden", s->ghmode == HL_LOSS_GRAD_ACCUMULATE ? R_INOUT : R_OUT, F32, s->N, s->H, s->ghs);
    buf_mat(c, "grad_weight", s->gwmode == HL_LOSS_GRAD_ACCUMULATE ? R_INOUT : R_OUT, F32, s->V0, s->H, s->gws);
    a->grad_hidden_stride = s->ghs, a->grad_weight_stride = s->gws;
  }
  buf_vec(c, "scalars", R_OUT, F32, HL_LOSS_NUM_SCALARS)->optional = 1;
  static const char *const tok[] = {"token_loss", "token_logp", "token_entropy", "token_lse"};
  for (int i = 0; i < 4; ++i) buf_vec(c, tok[i], R_OUT, F32, s->N)->optional = 1;
}

/* The query outputs a case's parameters name, in host memory. */
static void declare_query_outputs(Call *c) {
  for (int i = 0; i < c->cs->nparams; ++i) {
    const Field *f = &c->cs->params[i];
    if (!f->buf) continue;
    const int handle = !strcmp(f->buf, "plan"), count = !strcmp(f->buf, "exchanges");
    if (!handle && !count && !strstr(f->buf, "bytes")) continue;
    Buf *b = buf_host(c, f->buf, handle ? EK_HANDLE : count ? EK_I32 : EK_U64);
    b->optional = !strcmp(f->buf, "min_bytes") || !strcmp(f->buf, "fast_bytes"); /* "either pointer may be NULL" */
  }
}

static void loss_declare(Call *c) {
  const LossSpec *s = c->cs->spec;
  hl_loss_plan_desc_t *d = ldesc(c);
  hl_loss_args_t *a = largs(c);
  *d = (hl_loss_plan_desc_t)HL_LOSS_PLAN_DESC_INIT;
  *a = (hl_loss_args_t)HL_LOSS_ARGS_INIT;
  d->backend = c->backend, d->vocab = s->V0, d->logits_dtype = s->H ? HL_DTYPE_NONE : s->ldt;
  d->labels_dtype = s->labdt, d->terms = s->terms, d->grad_mode = s->gmode, d->grad_dtype = s->gdt;
  d->jsd_beta = 0, d->rollout_cap = 0; /* unused here: INIT's values are mutations of their own */
  if (s->V0 < s->Vg) d->vocab_global = s->Vg, d->ranks = 2;
  if (s->ignore) d->use_ignore_index = 1, d->ignore_index = IGNORE_INDEX;
  if (s->H) {
    d->hidden = s->H, d->weight_dtype = s->ldt, d->teacher_hidden = s->Ht;
    d->grad_hidden_mode = s->ghmode, d->grad_hidden_dtype = F32, d->grad_weight_mode = s->gwmode, d->grad_weight_dtype = F32;
  }
  if (s->topk) d->teacher_topk = s->topk, d->teacher_topk_ids_dtype = s->idt;
  if (s->seqs) {
    d->cu_seqlens_dtype = HL_DTYPE_I64, d->rollout_correction = HL_LOSS_ROLLOUT_TIS;
    d->rollout_level = HL_LOSS_LEVEL_SEQ_PRODUCT, d->rollout_cap = 2.0f;
  }
  if (s->opts) s->opts(d, a);
  a->rows = s->N;
  if (s->H)
    declare_linear_form(c, s, a);
  else
    declare_logits_form(c, s, a);
  if (s->labdt) {
    Buf *l = buf_vec(c, "labels", R_IN, s->labdt, s->N);
    for (int64_t i = 0; i < s->N; ++i) buf_seti(l, i, label_at(s, i));
  }
  if (!s->noweights) {
    Buf *w = row_input(c, "weights", 0);
    for (int64_t i = 0; i < s->N; ++i) buf_set(w, 0, i, 0.5 + gval(s, "w", i, 0));
  }
  if (s->rl) declare_rl(c, s, d);
  static const struct {
    const char *name;
    unsigned flag;
  } token_grads[] = {{"grad_token_logp", HL_LOSS_GRAD_TOKEN_LOGP}, {"grad_token_entropy", HL_LOSS_GRAD_TOKEN_ENTROPY},
                     {"grad_token_lse", HL_LOSS_GRAD_TOKEN_LSE}};
  for (int t = 0; t < NF(token_grads); ++t)
    if (d->flags & token_grads[t].flag) {
      Buf *g = row_input(c, token_grads[t].name, 1);
      for (int64_t i = 0; i < s->N; ++i) buf_set(g, 0, i, 2 * gval(s, token_grads[t].name, i, 0) - 1);
    }
  if (s->seqs) {
    Buf *cu = buf_vec(c, "cu_seqlens", R_IN, HL_DTYPE_I64, 4);
    const int64_t v[] = {0, 3, 3, s->N};
    for (int i = 0; i < 4; ++i) buf_seti(cu, i, v[i]);
    a->num_seqs = 3;
  }
  if (s->topk) {
    Buf *ids = buf_mat(c, "teacher_topk_ids", R_IN, s->idt, s->N, s->topk, s->ids_stride);
    Buf *lp = buf_mat(c, "teacher_topk_logprobs", R_IN, F32, s->N, s->topk, 0);
    for (int64_t i = 0; i < s->N; ++i)
      for (int m = 0; m < s->topk; ++m) buf_seti(ids, i * s->ids_stride + m, topk_id(s, i, m)), buf_set(lp, i, m, topk_lp(m));
    a->teacher_topk_ids_stride = s->ids_stride;
  }
  declare_outputs(c, s, a);
  if (c->cs->flags & LOSS_READS) /* the statistics / middle step reads the row's logits, labels and teacher */
    for (int i = 0; i < c->nbufs; ++i) {
      Buf *b = &c->bufs[i];
      if (is_reading_input(b->name)) continue;
      b->optional = 1;
      if (b->role != R_IN) b->role = R_IN;
    }
  PARAMS(c, LossParams)->rows = s->N;
  PARAMS(c, LossParams)->index = HL_LOSS_OUT_TOPK_MASS;
  declare_query_outputs(c);
}

/* ---- preparing: plans, workspace, the gathered blocks ----------------------------------------- */

typedef struct {
  void *p[16];
  int n, dev;
} Tmp;

static void *tmp_alloc(Tmp *t, size_t bytes);

static void *tmp_put(Tmp *t, const void *host, size_t bytes) {
  void *p = tmp_alloc(t, bytes);
  if (t->dev)
    to_dev(p, host, bytes);
  else
    memcpy(p, host, bytes);
  return p;
}

static void *tmp_alloc(Tmp *t, size_t bytes) {
  void *p = t->dev ? dev_alloc(bytes) : malloc(bytes ? bytes : 1);
  return t->p[t->n++] = p;
}

static void tmp_get(const Tmp *t, void *host, const void *p, size_t bytes) {
  if (t->dev)
    from_dev(host, p, bytes);
  else
    memcpy(host, p, bytes);
}

static void tmp_free(Tmp *t) {
  for (int i = 0; i < t->n; ++i) t->dev ? dev_free(t->p[i]) : free(t->p[i]);
  t->n = 0;
}

/* n elements of dt from f(i) (a row-major [rows, cols] with cols packed). */
static void *packed(Tmp *t, hl_dtype_t dt, int64_t n, const double *v) {
  const size_t es = dt == HL_DTYPE_BF16 ? 2 : dt == HL_DTYPE_I64 ? 8 : 4;
  unsigned char *h = malloc((size_t)n * es);
  for (int64_t i = 0; i < n; ++i) {
    const float f = (float)round_to(dt, v[i]);
    const int64_t l = (int64_t)v[i];
    const int32_t l32 = (int32_t)v[i];
    const uint32_t u = (uint32_t)f32_bits(f);
    const uint16_t b = (uint16_t)(u >> 16);
    if (dt == HL_DTYPE_BF16)
      memcpy(h + 2 * i, &b, 2);
    else if (dt == HL_DTYPE_I64)
      memcpy(h + 8 * i, &l, 8);
    else if (dt == HL_DTYPE_I32)
      memcpy(h + 4 * i, &l32, 4);
    else
      memcpy(h + 4 * i, &f, 4);
  }
  void *p = tmp_put(t, h, (size_t)n * es);
  free(h);
  return p;
}

/* Rank r's arguments of a split step (logits form): its columns of the logits and the teacher's,
 * in backend memory. */
static hl_loss_args_t rank_args(Call *c, int r, Tmp *t) {
  const LossSpec *s = c->cs->spec;
  const int64_t N = s->N, vs = r ? s->V0 : 0, V = r ? s->Vg - s->V0 : s->V0;
  hl_loss_args_t a = HL_LOSS_ARGS_INIT;
  double *z = dalloc(N * V), *y = dalloc(N);
  a.rows = N;
  for (int k = 0; k < 1 + s->teacher; ++k) {
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < V; ++j) z[i * V + j] = logit_at(s, k ? "teacher" : "logits", i, vs + j);
    *(k ? &a.teacher_logits : &a.logits) = packed(t, s->ldt, N * V, z);
  }
  for (int64_t i = 0; i < N; ++i) y[i] = (double)label_at(s, i);
  a.labels = packed(t, s->labdt, N, y);
  free(z), free(y);
  return a;
}

/* Rank r's block of statistics (host copy in out, bytes long). */
static void run_stats(Call *c, int r, unsigned char *out, size_t bytes) {
  Tmp t = {.dev = c->cuda};
  const hl_loss_args_t a = rank_args(c, r, &t);
  void *blk = tmp_put(&t, out, bytes);
  if (hl_loss_plan_execute_stats(c->plans[r], &a, blk, bytes, NULL)) fprintf(stderr, "stats: %s\n", hl_get_last_error());
  tmp_get(&t, out, blk, bytes);
  tmp_free(&t);
}

/* Rank r's middle block from the gathered blocks. */
static void run_middle(Call *c, int r, const unsigned char *gathered, size_t gbytes, unsigned char *out, size_t bytes) {
  Tmp t = {.dev = c->cuda};
  const hl_loss_args_t a = rank_args(c, r, &t);
  size_t ws = 0;
  hl_loss_plan_get_workspace_size(c->plans[r], a.rows, &ws);
  void *g = tmp_put(&t, gathered, gbytes), *m = tmp_alloc(&t, bytes), *w = ws ? tmp_alloc(&t, ws) : NULL;
  if (hl_loss_plan_execute_middle(c->plans[r], &a, g, gbytes, m, bytes, w, ws, NULL)) fprintf(stderr, "middle: %s\n", hl_get_last_error());
  tmp_get(&t, out, m, bytes);
  tmp_free(&t);
}

/* Two ranks' blocks, gathered (middle: the middle step's, from `gathered`). */
static Buf *gather(Call *c, const char *name, const Buf *gathered) {
  size_t bb = 0;
  const int64_t N = ((const LossSpec *)c->cs->spec)->N;
  if (gathered)
    hl_loss_plan_get_middle_size(c->plans[0], N, &bb);
  else
    hl_loss_plan_get_stats_size(c->plans[0], N, &bb);
  Buf *b = buf_raw(c, name, R_IN, EK_BYTES, (int64_t)(2 * bb));
  for (int r = 0; r < 2; ++r) {
    if (gathered)
      run_middle(c, r, gathered->init, gathered->bytes, b->init + r * bb, bb);
    else
      run_stats(c, r, b->init + r * bb, bb);
  }
  return b;
}

static int has_param(const Case *cs, const char *buf) {
  for (int i = 0; i < cs->nparams; ++i)
    if (cs->params[i].buf && !strcmp(cs->params[i].buf, buf)) return 1;
  return 0;
}

static void loss_prepare(Call *c) {
  const LossSpec *s = c->cs->spec;
  LossParams *p = PARAMS(c, LossParams);
  hl_loss_plan_desc_t d = *ldesc(c);
  hl_loss_plan_t plan = NULL;
  if (hl_loss_plan_create(&d, &plan)) return; /* the control reports it */
  size_t lo = 0, hi = 0;
  hl_loss_plan_get_workspace_sizes(plan, s->N, &lo, &hi);
  if (hi) {
    c->ws_need = lo;
    buf_raw(c, "workspace", R_SCRATCH, EK_BYTES, (int64_t)hi);
  }
  if (c->cs->flags & LOSS_CREATE) {
    hl_loss_plan_destroy(plan);
    return;
  }
  p->plan = c->plans[0] = plan;
  if (s->V0 == s->Vg) return;
  d.vocab_start = s->V0, d.vocab = s->Vg - s->V0;
  if (hl_loss_plan_create(&d, &c->plans[1])) return;
  size_t bb = 0;
  if (has_param(c->cs, "stats")) {
    hl_loss_plan_get_stats_size(plan, s->N, &bb);
    buf_raw(c, "stats", R_OUT, EK_BYTES, (int64_t)bb);
  }
  if (has_param(c->cs, "middle")) {
    hl_loss_plan_get_middle_size(plan, s->N, &bb);
    buf_raw(c, "middle", R_OUT, EK_BYTES, (int64_t)bb);
  }
  if (has_param(c->cs, "gathered")) {
    const Buf *g = gather(c, "gathered", NULL);
    if (has_param(c->cs, "gathered_middle")) gather(c, "gathered_middle", g);
  }
  if (has_param(c->cs, "nccl_comm")) buf_raw(c, "nccl_comm", R_IN, EK_BYTES, 64); /* never dereferenced on the CPU */
}

/* ---- invoking --------------------------------------------------------------------------------- */

#define LP(c) PARAMS(c, LossParams)
#define LA(c) DP(c, hl_loss_args_t)

static hl_status_t inv_execute(Call *c) { return hl_loss_plan_execute(LP(c)->plan, LA(c), LP(c)->workspace, LP(c)->workspace_bytes, NULL); }
static hl_status_t inv_stats(Call *c) { return hl_loss_plan_execute_stats(LP(c)->plan, LA(c), LP(c)->stats, LP(c)->stats_bytes, NULL); }
static hl_status_t inv_stats_ws(Call *c) {
  const LossParams *p = LP(c);
  return hl_loss_plan_execute_stats_ws(p->plan, LA(c), p->stats, p->stats_bytes, p->workspace, p->workspace_bytes, NULL);
}
static hl_status_t inv_finish(Call *c) {
  const LossParams *p = LP(c);
  return hl_loss_plan_execute_finish(p->plan, LA(c), p->gathered, p->gathered_bytes, p->workspace, p->workspace_bytes, NULL);
}
static hl_status_t inv_middle(Call *c) {
  const LossParams *p = LP(c);
  return hl_loss_plan_execute_middle(p->plan, LA(c), p->gathered, p->gathered_bytes, p->middle, p->middle_bytes,
                                     p->workspace, p->workspace_bytes, NULL);
}
static hl_status_t inv_finish_middle(Call *c) {
  const LossParams *p = LP(c);
  return hl_loss_plan_execute_finish_with_middle(p->plan, LA(c), p->gathered, p->gathered_bytes, p->gathered_middle,
                                                 p->gathered_middle_bytes, p->workspace, p->workspace_bytes, NULL);
}
static hl_status_t inv_nccl(Call *c) {
  return hl_loss_plan_execute_nccl(LP(c)->plan, LA(c), LP(c)->nccl_comm, LP(c)->workspace, LP(c)->workspace_bytes, NULL);
}
static hl_status_t inv_sizes(Call *c) { return hl_loss_plan_get_workspace_sizes(LP(c)->plan, LP(c)->rows, LP(c)->min_bytes, LP(c)->fast_bytes); }
static hl_status_t inv_size(Call *c) { return hl_loss_plan_get_workspace_size(LP(c)->plan, LP(c)->rows, LP(c)->bytes); }
static hl_status_t inv_stats_size(Call *c) { return hl_loss_plan_get_stats_size(LP(c)->plan, LP(c)->rows, LP(c)->bytes); }
static hl_status_t inv_middle_size(Call *c) { return hl_loss_plan_get_middle_size(LP(c)->plan, LP(c)->rows, LP(c)->bytes); }
static hl_status_t inv_exchanges(Call *c) { return hl_loss_plan_get_exchanges(LP(c)->plan, LP(c)->exchanges); }

/* Creates the plan, then runs it on the bound arguments: its outputs are what a mutation of the
 * description is judged by. */
static hl_status_t inv_create(Call *c) {
  hl_loss_plan_t *out = LP(c)->plan_out;
  const hl_status_t st = hl_loss_plan_create(DP(c, hl_loss_plan_desc_t), out);
  snprintf(c->msg, sizeof c->msg, "%s", hl_get_last_error());
  c->msg_set = 1;
  if (st != HL_STATUS_SUCCESS || !out) return st;
  const Buf *ws = buf_find(c, "workspace");
  if (hl_loss_plan_execute(*out, SIDE(c, hl_loss_args_t), ws ? ws->mem : NULL, ws ? ws->bytes : 0, NULL))
    snprintf(c->note, sizeof c->note, "executing the plan: %s", hl_get_last_error());
  if (hl_loss_plan_destroy(*out)) snprintf(c->note, sizeof c->note, "hl_loss_plan_destroy failed");
  return st;
}

static void name_declare(Call *c) {
  loss_declare(c);
  buf_raw(c, "name", R_OUT, EK_BYTES, 40)->host = 1;
}

/* The name of index p->index into the host buffer "name" ("" for NULL). */
static hl_status_t inv_scalar_name(Call *c) {
  const char *n = hl_loss_scalar_name(LP(c)->index);
  Buf *b = buf_find(c, "name");
  memset(b->mem, 0, b->bytes);
  if (n) memcpy(b->mem, n, strlen(n) < b->bytes ? strlen(n) : b->bytes - 1);
  return HL_STATUS_SUCCESS;
}

/* ---- checks ----------------------------------------------------------------------------------- */

static const float *out_f32(Call *c, const char *name) {
  const Buf *b = buf_find(c, name);
  return b ? (const float *)(const void *)buf_out(b) : NULL;
}

/* CE + Z on F32 logits by hand: losses, metrics, per-token outputs and the gradient (with the
 * per-token upstream gradients' product, unweighted). */
static void check_ce(Call *c, Chk *k) {
  const LossSpec *s = c->cs->spec;
  const hl_loss_plan_desc_t *d = ldesc(c);
  const int64_t N = s->N, V = s->Vg;
  const double gs = largs(c)->grad_scale ? largs(c)->grad_scale : 1.0;
  double *grad = dalloc(N * V), *sc = dalloc(HL_LOSS_NUM_SCALARS), *tl = dalloc(N), *tp = dalloc(N), *te = dalloc(N), *tz = dalloc(N);
  double D = 0, ce = 0, z = 0, lse = 0, ent = 0, logp = 0, acc = 0, n = 0;
  RowRef *r = malloc((size_t)N * sizeof *r);
  for (int64_t i = 0; i < N; ++i) {
    r[i] = spec_row(c, i);
    const double w = buf_in(c, "weights", 0, i);
    te[i] = r[i].ent, tz[i] = r[i].lse;
    if (!valid_row(s, i)) continue;
    const int64_t y = label_at(s, i);
    D += w, n += 1, ce += w * (r[i].lse - r[i].zy), z += w * r[i].lse * r[i].lse, lse += w * r[i].lse;
    ent += w * r[i].ent, logp += w * (r[i].zy - r[i].lse), acc += w * (r[i].amax == y);
    tl[i] = d->ce_weight * (r[i].lse - r[i].zy) + d->z_weight * r[i].lse * r[i].lse, tp[i] = r[i].zy - r[i].lse;
  }
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) { /* an ignored row: the entropy's and lse's products alone */
      const double zj = buf_in(c, "logits", i, j), p = exp(zj - r[i].lse), w = buf_in(c, "weights", 0, i);
      const double ge = buf_in(c, "grad_token_entropy", 0, i), dy = j == label_at(s, i);
      grad[i * V + j] = ge * p * (r[i].lse - r[i].ent - zj) + buf_in(c, "grad_token_lse", 0, i) * p;
      if (valid_row(s, i))
        grad[i * V + j] += gs / D * w * (d->ce_weight * (p - dy) + d->z_weight * 2 * r[i].lse * p) +
                           buf_in(c, "grad_token_logp", 0, i) * (dy - p);
    }
  sc[HL_LOSS_OUT_LOSS] = (d->ce_weight * ce + d->z_weight * z) / D, sc[HL_LOSS_OUT_CE] = ce / D, sc[HL_LOSS_OUT_Z] = z / D;
  sc[HL_LOSS_OUT_DIVISOR] = D, sc[HL_LOSS_OUT_WEIGHT_SUM] = D, sc[HL_LOSS_OUT_VALID_ROWS] = n;
  sc[HL_LOSS_OUT_LSE_MEAN] = lse / D, sc[HL_LOSS_OUT_ENTROPY_MEAN] = ent / D, sc[HL_LOSS_OUT_LOGP_MEAN] = logp / D;
  sc[HL_LOSS_OUT_ACCURACY] = acc / D; /* every other metric's inputs are not passed: 0 */
  chk_mat(k, c, "scalars", sc, 1, HL_LOSS_NUM_SCALARS, 1e-5, 1e-7);
  chk_mat(k, c, "grad", grad, N, V, 1e-5, 1e-6);
  chk_mat(k, c, "token_loss", tl, 1, N, 1e-6, 1e-7);
  chk_mat(k, c, "token_logp", tp, 1, N, 1e-6, 1e-7);
  chk_mat(k, c, "token_entropy", te, 1, N, 1e-6, 1e-7);
  chk_mat(k, c, "token_lse", tz, 1, N, 1e-6, 1e-7);
  free(grad), free(sc), free(tl), free(tp), free(te), free(tz), free(r);
}

/* Weighted sums over valid rows for the metrics of the full control. */
typedef struct {
  double sw, lse, ent, logp, acc, adv, ratio, k3old, klref, rk1, rk3, ce, z, n;
  double adv_min, adv_max, r_min, r_max;
} Sums;

static void check_full(Call *c, Chk *k) {
  const LossSpec *s = c->cs->spec;
  const hl_loss_plan_desc_t *d = ldesc(c);
  const int64_t N = s->N;
  double *sc = dalloc(HL_LOSS_NUM_SCALARS), *tl = dalloc(N), *tp = dalloc(N), *te = dalloc(N);
  Sums m = {.adv_min = INFINITY, .adv_max = -INFINITY, .r_min = INFINITY, .r_max = -INFINITY};
  for (int64_t i = 0; i < N; ++i) {
    const RowRef r = spec_row(c, i);
    te[i] = r.ent, tl[i] = r.lse;
    tp[i] = valid_row(s, i) ? r.zy - r.lse : 0;
    if (!valid_row(s, i)) {
      te[i] = tl[i] = NAN; /* the header promises nothing for an ignored row's entropy and lse */
      continue;
    }
    const double w = buf_in(c, "weights", 0, i), logp = r.zy - r.lse, old = buf_in(c, "old_logprobs", 0, i);
    const double A = buf_in(c, "advantages", 0, i), ratio = exp(logp - old), dk = buf_in(c, "ref_logprobs", 0, i) - logp;
    const double dr = old - buf_in(c, "rollout_logprobs", 0, i), eps = d->label_smoothing;
    m.sw += w, m.n += 1, m.lse += w * r.lse, m.ent += w * r.ent, m.logp += w * logp, m.acc += w * (r.amax == label_at(s, i));
    m.adv += w * A, m.ratio += w * ratio, m.k3old += w * (ratio - log(ratio) - 1), m.klref += w * (exp(dk) - dk - 1);
    m.rk1 -= w * dr, m.rk3 += w * (exp(dr) - dr - 1);
    m.ce += w * ((1 - eps) * (r.lse - r.zy) + eps * (r.lse - r.mean)), m.z += w * r.lse * r.lse;
    m.adv_min = fmin(m.adv_min, A), m.adv_max = fmax(m.adv_max, A), m.r_min = fmin(m.r_min, ratio), m.r_max = fmax(m.r_max, ratio);
  }
  const double D = largs(c)->divisor;
  for (int i = 0; i < HL_LOSS_NUM_SCALARS; ++i) sc[i] = NAN; /* the terms of GRPO, CISPO, distillation: not by hand */
  sc[HL_LOSS_OUT_CE] = m.ce / D, sc[HL_LOSS_OUT_Z] = m.z / D, sc[HL_LOSS_OUT_ENTROPY] = m.ent / D;
  sc[HL_LOSS_OUT_KL_REF] = m.klref / D, sc[HL_LOSS_OUT_DIVISOR] = D, sc[HL_LOSS_OUT_WEIGHT_SUM] = m.sw;
  sc[HL_LOSS_OUT_VALID_ROWS] = m.n, sc[HL_LOSS_OUT_LSE_MEAN] = m.lse / m.sw, sc[HL_LOSS_OUT_ENTROPY_MEAN] = m.ent / m.sw;
  sc[HL_LOSS_OUT_LOGP_MEAN] = m.logp / m.sw, sc[HL_LOSS_OUT_ACCURACY] = m.acc / m.sw;
  sc[HL_LOSS_OUT_RATIO_MEAN] = m.ratio / m.sw, sc[HL_LOSS_OUT_RATIO_MIN] = m.r_min, sc[HL_LOSS_OUT_RATIO_MAX] = m.r_max;
  sc[HL_LOSS_OUT_K3_OLD] = m.k3old / m.sw, sc[HL_LOSS_OUT_KL_REF_MEAN] = m.klref / m.sw;
  sc[HL_LOSS_OUT_ADV_MEAN] = m.adv / m.sw, sc[HL_LOSS_OUT_ADV_MIN] = m.adv_min, sc[HL_LOSS_OUT_ADV_MAX] = m.adv_max;
  sc[HL_LOSS_OUT_ROLLOUT_KL_K1] = m.rk1 / m.sw, sc[HL_LOSS_OUT_ROLLOUT_KL_K3] = m.rk3 / m.sw;
  chk_mat(k, c, "scalars", sc, 1, HL_LOSS_NUM_SCALARS, 1e-5, 1e-7);
  chk_mat(k, c, "token_logp", tp, 1, N, 1e-6, 1e-7);
  chk_mat(k, c, "token_entropy", te, 1, N, 1e-6, 1e-7);
  chk_mat(k, c, "token_lse", tl, 1, N, 1e-6, 1e-7);
  free(sc), free(tl), free(tp), free(te);
}

/* A sparse teacher: per-token lse, CE, the top-k mass, zero gradient rows where ignored and rows
 * summing to zero elsewhere (every term's gradient is softmax-shaped). */
static void check_topk(Call *c, Chk *k) {
  const LossSpec *s = c->cs->spec;
  const int64_t N = s->N, V = s->Vg;
  double *lse = dalloc(N), n = 0, ce = 0, mass = 0;
  const Buf *g = buf_find(c, "grad");
  for (int64_t i = 0; i < N; ++i) {
    const RowRef r = spec_row(c, i);
    lse[i] = r.lse;
    double sum = 0, abs = 0;
    for (int64_t j = 0; j < V; ++j) sum += buf_get(g, buf_out(g), i, j), abs += fabs(buf_get(g, buf_out(g), i, j));
    if (!valid_row(s, i)) {
      if (abs != 0) chk_fail(k, "grad row %lld is not zero though its label is ignored", (long long)i);
      lse[i] = NAN;
      continue;
    }
    if (fabs(sum) > 0.05 * abs) chk_fail(k, "grad row %lld sums to %g (of %g)", (long long)i, sum, abs);
    n += 1, ce += r.lse - r.zy;
    for (int m = 0; m < s->topk; ++m) mass += topk_id(s, i, m) >= 0 ? exp(topk_lp(m)) : 0;
  }
  const float *sc = out_f32(c, "scalars");
  chk_val(k, "scalars[VALID_ROWS]", sc[HL_LOSS_OUT_VALID_ROWS], n, 0, 0);
  chk_val(k, "scalars[CE]", sc[HL_LOSS_OUT_CE], ce / n, 1e-5, 0);
  chk_val(k, "scalars[TOPK_MASS]", sc[HL_LOSS_OUT_TOPK_MASS], mass / n, 1e-5, 0);
  chk_mat(k, c, "token_lse", lse, 1, N, 1e-6, 1e-7);
  free(lse);
}

/* The plan of c on whole-vocabulary F32 logits z [N, V] (teacher t) with the CPU backend and the
 * call's row inputs: the gradient written (F32, N x V), scalars and per-token outputs. */
static void whole_run(Call *c, hl_loss_plan_desc_t d, const float *z, const float *t, int64_t V, float *grad,
                      float *scalars, float *tok) {
  const LossSpec *s = c->cs->spec;
  const hl_loss_args_t *own = largs(c);
  d.backend = HL_BACKEND_CPU, d.vocab = V, d.vocab_start = d.vocab_global = 0, d.ranks = 0, d.logits_dtype = F32;
  d.hidden = d.teacher_hidden = 0, d.weight_dtype = HL_DTYPE_NONE;
  d.grad_hidden_mode = d.grad_weight_mode = HL_LOSS_GRAD_NONE, d.grad_hidden_dtype = d.grad_weight_dtype = HL_DTYPE_NONE;
  d.grad_mode = HL_LOSS_GRAD_WRITE, d.grad_dtype = F32;
  hl_loss_args_t a = HL_LOSS_ARGS_INIT;
  const char *const rows[] = {"labels", "weights", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs", "cu_seqlens"};
  const void **ptr[] = {&a.labels, (const void **)&a.weights, (const void **)&a.advantages, (const void **)&a.old_logprobs,
                        (const void **)&a.ref_logprobs, (const void **)&a.rollout_logprobs, &a.cu_seqlens};
  for (int i = 0; i < NF(rows); ++i) {
    const Buf *b = buf_find(c, rows[i]);
    *ptr[i] = b ? b->init : NULL;
  }
  a.rows = s->N, a.logits = z, a.teacher_logits = t, a.grad = grad, a.scalars = scalars, a.num_seqs = own->num_seqs;
  a.divisor = own->divisor, a.grad_scale = own->grad_scale;
  a.token_loss = tok, a.token_logp = tok + s->N, a.token_entropy = tok + 2 * s->N, a.token_lse = tok + 3 * s->N;
  hl_loss_plan_t p;
  if (hl_loss_plan_create(&d, &p) || hl_loss_plan_execute(p, &a, NULL, 0, NULL))
    fprintf(stderr, "the whole-vocabulary reference failed: %s\n", hl_get_last_error());
  hl_loss_plan_destroy(p);
}

static void check_token_outputs(Call *c, Chk *k, const float *scalars, const float *tok) {
  const int64_t N = ((const LossSpec *)c->cs->spec)->N;
  static const char *const names[] = {"token_loss", "token_logp", "token_entropy", "token_lse"};
  double *ref = dalloc(HL_LOSS_NUM_SCALARS + 4 * N);
  for (int64_t i = 0; i < HL_LOSS_NUM_SCALARS + 4 * N; ++i) ref[i] = i < HL_LOSS_NUM_SCALARS ? scalars[i] : tok[i - HL_LOSS_NUM_SCALARS];
  chk_mat(k, c, "scalars", ref, 1, HL_LOSS_NUM_SCALARS, 1e-5, 1e-6);
  for (int i = 0; i < 4; ++i) chk_mat(k, c, names[i], ref + HL_LOSS_NUM_SCALARS + i * N, 1, N, 1e-5, 1e-6);
  free(ref);
}

/* A split step's outputs against the unsharded plan: scalars, per-token outputs, this shard's
 * gradient columns. */
static void check_whole(Call *c, Chk *k) {
  const LossSpec *s = c->cs->spec;
  const int64_t N = s->N, V = s->Vg;
  float *z = calloc((size_t)(2 * N * V), sizeof(float)), *grad = calloc((size_t)(N * V), sizeof(float));
  float *sc = calloc(HL_LOSS_NUM_SCALARS, sizeof(float)), *tok = calloc((size_t)(4 * N), sizeof(float));
  for (int64_t i = 0; i < N * V; ++i) z[i] = (float)logit_at(s, "logits", i / V, i % V), z[N * V + i] = (float)logit_at(s, "teacher", i / V, i % V);
  whole_run(c, *ldesc(c), z, s->teacher ? z + N * V : NULL, V, grad, sc, tok);
  check_token_outputs(c, k, sc, tok);
  double *g = dalloc(N * s->V0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < s->V0; ++j) g[i * s->V0 + j] = grad[i * V + j];
  chk_mat(k, c, "grad", g, N, s->V0, 1e-5, 1e-6);
  free(z), free(grad), free(sc), free(tok), free(g);
}

/* The fused linear form against the logits form on X W^T (the teacher's Xt Wt^T): scalars and
 * per-token outputs, grad_hidden = G W, grad_weight (accumulated) += G^T X. */
static void check_linear(Call *c, Chk *k) {
  const LossSpec *s = c->cs->spec;
  const int64_t N = s->N, V = s->V0, H = s->H;
  float *z = calloc((size_t)(2 * N * V), sizeof(float)), *grad = calloc((size_t)(N * V), sizeof(float));
  float *sc = calloc(HL_LOSS_NUM_SCALARS, sizeof(float)), *tok = calloc((size_t)(4 * N), sizeof(float));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) {
      double a = 0, b = 0;
      for (int64_t h = 0; h < H; ++h) a += buf_in(c, "hidden", i, h) * buf_in(c, "weight", j, h);
      for (int64_t h = 0; h < s->Ht; ++h) b += buf_in(c, "teacher_hidden", i, h) * buf_in(c, "teacher_weight", j, h);
      z[i * V + j] = (float)a, z[N * V + i * V + j] = (float)b;
    }
  whole_run(c, *ldesc(c), z, z + N * V, V, grad, sc, tok);
  check_token_outputs(c, k, sc, tok);
  double *gh = dalloc(N * H), *gw = dalloc(V * H);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < V; ++j) gh[i * H + h] += grad[i * V + j] * buf_in(c, "weight", j, h);
  for (int64_t j = 0; j < V; ++j)
    for (int64_t h = 0; h < H; ++h) {
      gw[j * H + h] = s->gwmode == HL_LOSS_GRAD_ACCUMULATE ? buf_in(c, "grad_weight", j, h) : 0;
      for (int64_t i = 0; i < N; ++i) gw[j * H + h] += grad[i * V + j] * buf_in(c, "hidden", i, h);
    }
  chk_mat(k, c, "grad_hidden", gh, N, H, 1e-5, 1e-6);
  chk_mat(k, c, "grad_weight", gw, V, H, 1e-5, 1e-6);
  free(z), free(grad), free(sc), free(tok), free(gh), free(gw);
}

/* A block's header: tag, rows, this shard, the record size its length implies, the zero word. */
static void check_header(Chk *k, const Buf *b, uint64_t tag, const LossSpec *s) {
  int64_t h[8];
  memcpy(h, buf_out(b), sizeof h);
  const int64_t want[] = {(int64_t)tag, h[1], s->N, 0, s->V0, s->Vg, ((int64_t)b->bytes - 64) / s->N, 0};
  for (int w = 0; w < 8; ++w)
    if (h[w] != want[w]) chk_fail(k, "%s header word %d is %lld, expected %lld", b->name, w, (long long)h[w], (long long)want[w]);
}

/* Rank 0's records (fp64 on the CPU): max, sum e, sum e (z - max), sum z, the label's z (-inf off
 * the shard), the argmax's column; the teacher's max and sum e. */
static void check_stats(Call *c, Chk *k) {
  const LossSpec *s = c->cs->spec;
  const Buf *b = buf_find(c, "stats");
  check_header(k, b, 0x31534c48u, s);
  const size_t rb = (b->bytes - 64) / (size_t)s->N;
  if (c->cuda) return; /* fp32 records of the CUDA layout: judged through finish */
  for (int64_t i = 0; i < s->N; ++i) {
    double rec[13], ref[13] = {-INFINITY, 0, 0, 0, -INFINITY, 0, -INFINITY, 0};
    memcpy(rec, buf_out(b) + 64 + (size_t)i * rb, sizeof rec);
    for (int t = 0; t < 2; ++t) {
      const char *what = t ? "teacher" : "logits";
      double m = -INFINITY, sum = 0, se = 0, sb = 0;
      int64_t amax = 0;
      for (int64_t j = 0; j < s->V0; ++j)
        if (logit_at(s, what, i, j) > m) m = logit_at(s, what, i, j), amax = j;
      for (int64_t j = 0; j < s->V0; ++j) {
        const double z = logit_at(s, what, i, j);
        se += exp(z - m), sb += exp(z - m) * (z - m), sum += z;
      }
      if (t) {
        ref[6] = m, ref[7] = se;
        continue;
      }
      ref[0] = m, ref[1] = se, ref[2] = sb, ref[3] = sum, ref[5] = (double)amax;
      if (label_at(s, i) >= 0 && label_at(s, i) < s->V0) ref[4] = logit_at(s, what, i, label_at(s, i));
    }
    int64_t amax;
    memcpy(&amax, &rec[5], 8);
    rec[5] = (double)amax;
    char what[48];
    for (int f = 0; f < 8; ++f) {
      snprintf(what, sizeof what, "stats record %lld field %d", (long long)i, f);
      chk_val(k, what, rec[f], ref[f], 1e-12, 1e-12);
    }
  }
}

/* Rank 0's middle sums: sum over its columns of b q log(q / m) + (1 - b) p log(p / m), and of the
 * second part, with m = (1 - b) p + b q over the whole row. */
static void check_middle(Call *c, Chk *k) {
  const LossSpec *s = c->cs->spec;
  const Buf *b = buf_find(c, "middle");
  check_header(k, b, 0x314d4c48u, s);
  const double beta = ldesc(c)->jsd_beta;
  const size_t rb = (b->bytes - 64) / (size_t)s->N;
  for (int64_t i = 0; i < s->N; ++i) {
    if (!valid_row(s, i)) continue;
    const RowRef p = spec_row(c, i);
    double *tq = dalloc(s->Vg), q = 0, loss = 0, pa = 0, got[2];
    for (int64_t j = 0; j < s->Vg; ++j) tq[j] = logit_at(s, "teacher", i, j);
    const RowRef t = row_ref(tq, s->Vg, -1, 1, 0);
    for (int64_t j = 0; j < s->V0; ++j) {
      const double pj = exp(logit_at(s, "logits", i, j) - p.lse), qj = exp(tq[j] - t.lse), mj = (1 - beta) * pj + beta * qj;
      q = (1 - beta) * pj * log(pj / mj);
      loss += beta * qj * log(qj / mj) + q, pa += q;
    }
    for (int f = 0; f < 2; ++f) {
      float g32;
      if (rb == 16)
        memcpy(&got[f], buf_out(b) + 64 + (size_t)i * rb + 8 * f, 8);
      else
        memcpy(&g32, buf_out(b) + 64 + (size_t)i * rb + 4 * f, 4), got[f] = g32;
    }
    chk_val(k, "middle loss sum", got[0], loss, 1e-5, 1e-9);
    chk_val(k, "middle (1 - b) p log(p / m) sum", got[1], pa, 1e-5, 1e-9);
    free(tq);
  }
}

static uint64_t out_u64(Call *c, const char *name) {
  const Buf *b = buf_find(c, name);
  return b && buf_out(b) ? (uint64_t)buf_geti(b, buf_out(b), 0) : 0;
}

/* The CPU backend needs no workspace; on CUDA min <= fast. */
static void check_ws_sizes(Call *c, Chk *k) {
  const uint64_t lo = buf_find(c, "min_bytes") ? out_u64(c, "min_bytes") : 0, hi = out_u64(c, buf_find(c, "bytes") ? "bytes" : "fast_bytes");
  if (!c->cuda) chk_eq_u64(k, "workspace bytes", lo + hi, 0);
  if (lo > hi) chk_fail(k, "min_bytes %llu > fast_bytes %llu", (unsigned long long)lo, (unsigned long long)hi);
}

/* 64 + rows records: 104 bytes (+ 8 an id of a sparse teacher) on the CPU, 16 a middle record. */
static void check_block_size(Call *c, Chk *k) {
  const LossSpec *s = c->cs->spec;
  const int middle = c->cs->invoke == inv_middle_size;
  const uint64_t got = out_u64(c, "bytes");
  if (c->cuda)
    chk_eq_u64(k, "(bytes - 64) % rows", (got - 64) % (uint64_t)s->N, 0);
  else
    chk_eq_u64(k, "*bytes", got, 64 + (uint64_t)s->N * (middle ? 16u : 104u + 8u * (unsigned)s->topk));
}

/* For any rows: 64 + rows times the control's record. */
static void qcheck_block_size(Call *ref, Call *c, Chk *k) {
  const LossSpec *s = c->cs->spec;
  const uint64_t rec = (out_u64(ref, "bytes") - 64) / (uint64_t)s->N, rows = (uint64_t)LP(c)->rows;
  chk_eq_u64(k, "*bytes", out_u64(c, "bytes"), 64 + rows * rec);
}

static void check_exchanges(Call *c, Chk *k) {
  const Buf *b = buf_find(c, "exchanges");
  chk_eq_u64(k, "*exchanges", (uint64_t)buf_geti(b, buf_out(b), 0), ((const LossSpec *)c->cs->spec)->terms & HL_LOSS_DISTILL_JSD ? 2 : 1);
}

/* Each index's name: the enumerator's suffix in lower case, NULL outside the range. */
#define SN(n) #n
static const char *const kScalarEnumerators[] = {
    SN(LOSS), SN(CE), SN(Z), SN(ENTROPY), SN(DISTILL), SN(GRPO), SN(KL_REF), SN(DIVISOR), SN(WEIGHT_SUM), SN(VALID_ROWS),
    SN(LSE_MEAN), SN(ENTROPY_MEAN), SN(LOGP_MEAN), SN(ACCURACY), SN(RATIO_MEAN), SN(RATIO_MIN), SN(RATIO_MAX),
    SN(CLIP_LOW), SN(CLIP_HIGH), SN(CLIP_ANY), SN(K3_OLD), SN(KL_REF_MEAN), SN(ADV_MEAN), SN(ADV_MIN), SN(ADV_MAX),
    SN(DISTILL_KL_MEAN), SN(CISPO), SN(DUAL_CLIP), SN(ROLLOUT_KL_K1), SN(ROLLOUT_KL_K3), SN(ROLLOUT_WEIGHT_MEAN),
    SN(ROLLOUT_CORRECTED), SN(TOPK_MASS), SN(PREFERENCE), SN(REWARDS_CHOSEN), SN(REWARDS_REJECTED),
    SN(REWARDS_ACCURACY), SN(REWARDS_MARGIN), SN(LOGPS_CHOSEN), SN(LOGPS_REJECTED), SN(LOG_ODDS_RATIO),
    SN(LOG_ODDS_CHOSEN), SN(KTO_KL)};

static void expected_name(int index, char *out, size_t n) {
  out[0] = 0;
  if (index < 0 || index >= NF(kScalarEnumerators) || index >= HL_LOSS_NUM_SCALARS) return;
  snprintf(out, n, "%s", kScalarEnumerators[index]);
  for (char *p = out; *p; ++p) *p = (char)(*p >= 'A' && *p <= 'Z' ? *p - 'A' + 'a' : *p);
}

static void qcheck_scalar_name(Call *ref, Call *c, Chk *k) {
  (void)ref;
  char want[40];
  expected_name(LP(c)->index, want, sizeof want);
  const char *got = (const char *)buf_out(buf_find(c, "name"));
  if (strcmp(got, want)) chk_fail(k, "hl_loss_scalar_name(%d) is \"%s\", expected \"%s\"", LP(c)->index, got, want);
}

static void check_scalar_name(Call *c, Chk *k) {
  if (NF(kScalarEnumerators) != HL_LOSS_NUM_SCALARS) chk_fail(k, "HL_LOSS_NUM_SCALARS is %d", HL_LOSS_NUM_SCALARS);
  for (int i = -1; i <= HL_LOSS_NUM_SCALARS; ++i) {
    char want[40];
    expected_name(i, want, sizeof want);
    const char *got = hl_loss_scalar_name(i);
    if (strcmp(got ? got : "", want)) chk_fail(k, "hl_loss_scalar_name(%d) is \"%s\", expected \"%s\"", i, got ? got : "NULL", want);
  }
  qcheck_scalar_name(c, c, k);
}

/* ---- mutations of contents and of the split's buffers ----------------------------------------- */

static Mutation *elem(Gen *g, const char *buf, int64_t at, int64_t v, const char *value, Tag tag, const char *needle) {
  char field[NAME_LEN];
  snprintf(field, sizeof field, "%s[%lld]", buf, (long long)at);
  Mutation *m = gen_add(g, field, value, tag, needle ? needle : field);
  Edit *e = mut_edit(m, E_ELEM, buf);
  e->a = at, e->bits = (uint64_t)v;
  return m;
}

/* ... that must give the outputs of `buf`[at] = -100 (an ignored row). */
static void elem_ignored(Gen *g, const char *buf, int64_t at, int64_t v, const char *value) {
  Edit *e = mut_equiv(elem(g, buf, at, v, value, T_MATCH, NULL), E_ELEM, buf);
  e->a = at, e->bits = (uint64_t)(int64_t)-100;
}

/* Labels out of range and not ignored (refused, naming the element), and ignored ones. */
static void label_mutations(Gen *g) {
  const Buf *lb = buf_find(g->ctl, "labels");
  const LossSpec *s = g->cs->spec;
  if (!lb) return;
  const int i64 = lb->kind == EK_I64;
  elem(g, "labels", 3, s->Vg, "vocab_global", T_FAIL, NULL);
  elem(g, "labels", 3, i64 ? INT64_MAX : INT32_MAX, i64 ? "INT64_MAX" : "INT32_MAX", T_FAIL, NULL);
  if (i64) elem(g, "labels", 3, P2(53) + 1, "2^53+1", T_FAIL, NULL);
  if (i64) elem(g, "labels", 3, INT64_MAX - 1, "2^63-2", T_FAIL, NULL);
  elem_ignored(g, "labels", 3, -5, "-5");
  elem_ignored(g, "labels", 3, i64 ? INT64_MIN : INT32_MIN, i64 ? "INT64_MIN" : "INT32_MIN");
  if (s->ignore) elem_ignored(g, "labels", 3, IGNORE_INDEX, "ignore_index");
}

/* The sparse teacher's rows: duplicate or out-of-range ids, log-probs NaN, infinite or positive;
 * padding (any id < 0, any log-prob) is fine. */
static void topk_mutations(Gen *g) {
  const LossSpec *s = g->cs->spec;
  if (!s->topk) return;
  const int64_t at = 1 * s->ids_stride + 1, lat = 1 * s->topk + 1;
  elem(g, "teacher_topk_ids", at, topk_id(s, 1, 0), "a duplicate of the row's first id", T_FAIL, "teacher_topk_ids");
  elem(g, "teacher_topk_ids", at, s->Vg, "vocab_global", T_FAIL, "teacher_topk_ids");
  elem(g, "teacher_topk_ids", at, INT32_MAX, "INT32_MAX", T_FAIL, "teacher_topk_ids");
  elem(g, "teacher_topk_ids", at, -7, "-7 (padding)", T_MAY, NULL);
  static const struct {
    double v;
    const char *name;
    Tag tag;
  } lp[] = {{NAN, "NaN", T_FAIL}, {INFINITY, "+inf", T_FAIL}, {-INFINITY, "-inf", T_FAIL}, {0.5, "0.5", T_FAIL}, {-30, "-30", T_MAY}};
  for (int i = 0; i < NF(lp); ++i) {
    Mutation *m = gen_add(g, "teacher_topk_logprobs[1, 1]", lp[i].name, lp[i].tag, "teacher_topk_logprobs");
    Edit *e = mut_edit(m, E_ELEM, "teacher_topk_logprobs");
    e->a = lat, e->bits = f64_bits(lp[i].v);
  }
  Mutation *m = gen_add(g, "teacher_topk_logprobs[2, 3]", "NaN at padding", T_MAY, NULL);
  Edit *e = mut_edit(m, E_ELEM, "teacher_topk_logprobs");
  e->a = IGNORED_ROW * s->topk + 3, e->bits = f64_bits(NAN);
}

/* cu_seqlens that do not start at 0, decrease, or do not end at rows. */
static void seq_mutations(Gen *g) {
  const LossSpec *s = g->cs->spec;
  if (!s->seqs) return;
  const struct {
    int64_t at, v;
    const char *name;
  } cu[] = {{0, 1, "1"}, {1, 4, "4 (after it 3: decreasing)"}, {1, -1, "-1"}, {1, INT64_MAX, "INT64_MAX"},
            {3, s->N - 1, "rows - 1"}, {3, s->N + 1, "rows + 1"}};
  for (int i = 0; i < NF(cu); ++i) elem(g, "cu_seqlens", cu[i].at, cu[i].v, cu[i].name, T_FAIL, "cu_seqlens");
  elem(g, "cu_seqlens", 1, 0, "0 (an empty sequence)", T_MAY, NULL);
}

enum { EC_SHARDED_PLAN, EC_TWO_EXCHANGE_PLAN, EC_ONE_EXCHANGE_PLAN, EC_SWAP, EC_SWAP_MIDDLE, EC_DUP, EC_GROW };

static void call_edit(Gen *g, const char *field, const char *value, Tag tag, const char *needle, int64_t what) {
  mut_edit(gen_add(g, field, value, tag, needle), E_CALL, NULL)->a = what;
}

static void loss_edit(Call *c, int64_t what, int pre) {
  const LossSpec *s = c->cs->spec;
  Buf *b = buf_find(c, what == EC_SWAP_MIDDLE ? "gathered_middle" : "gathered");
  if (what <= EC_ONE_EXCHANGE_PLAN) { /* after binding: the plan parameter replaced */
    if (pre) return;
    hl_loss_plan_desc_t d = *ldesc(c);
    if (what == EC_SHARDED_PLAN) d.vocab_global = s->V0 + 5, d.ranks = 2;
    if (what == EC_TWO_EXCHANGE_PLAN) d.terms = HL_LOSS_CE | HL_LOSS_DISTILL_JSD, d.jsd_beta = 0.5f, d.entropy_weight = 0;
    if (what == EC_ONE_EXCHANGE_PLAN) d.terms = HL_LOSS_CE, d.jsd_beta = 0;
    if (hl_loss_plan_create(&d, &c->plans[2])) snprintf(c->note, sizeof c->note, "edit: %s", hl_get_last_error());
    LP(c)->plan = c->plans[2];
    return;
  }
  if (!pre) return;
  const size_t bb = b->bytes / 2;
  unsigned char *tmp = malloc(bb);
  if (what == EC_SWAP || what == EC_SWAP_MIDDLE) {
    memcpy(tmp, b->init, bb);
    memmove(b->init, b->init + bb, bb);
    memcpy(b->init + bb, tmp, bb);
  }
  if (what == EC_DUP) memcpy(b->init + bb, b->init, bb);
  if (what == EC_GROW) buf_resize(b, 3 * bb);
  free(tmp);
}

/* Header words of `buf`'s blocks mutated (refused, naming buf; the zero word may be ignored), and
 * record bytes (no header check covers them: anything but a crash or a stray write). */
static void block_mutations(Gen *g, const char *buf) {
  const Buf *b = buf_find(g->ctl, buf);
  if (!b) return;
  const size_t bb = b->bytes / 2, rb = (bb - 64) / (size_t)((const LossSpec *)g->cs->spec)->N;
  static const char *const words[] = {"tag", "fingerprint", "rows", "vocab_start", "vocab", "vocab_global", "record_bytes", "zero"};
  static const struct {
    int op;
    int64_t v;
    const char *name;
  } ops[] = {{OP_ADD, 1, "+1"}, {OP_ADD, -1, "-1"}, {OP_SET, INT64_MAX, "INT64_MAX"}, {OP_SET, INT64_MIN, "INT64_MIN"}};
  char field[NAME_LEN], value[48];
  for (int blk = 0; blk < 2; ++blk)
    for (int w = 0; w < 8; ++w)
      for (int o = 0; o < (blk ? 4 : 1); ++o) {
        snprintf(field, sizeof field, "%s block %d %s", buf, blk, words[w]);
        snprintf(value, sizeof value, "%s", ops[o].name);
        Edit *e = mut_edit(gen_add(g, field, value, w == 7 ? T_MAY : T_FAIL, buf), E_BYTES, buf);
        e->a = (int64_t)(blk * bb) + 8 * w, e->b = ops[o].op, e->bits = (uint64_t)ops[o].v;
      }
  static const uint64_t pat[] = {~0ull, 0x7F7F7F7F7F7F7F7Full, 0};
  for (int blk = 0; blk < 2; ++blk)
    for (size_t off = 0; off + 8 <= rb; off += 8)
      for (int p = 0; p < 3; ++p) {
        snprintf(field, sizeof field, "%s block %d record bytes", buf, blk);
        snprintf(value, sizeof value, "[%zu, %zu) := %s", off, off + 8, p == 0 ? "0xFF.." : p == 1 ? "0x7F.." : "0");
        Edit *e = mut_edit(gen_add(g, field, value, T_MAY, NULL), E_BYTES, buf);
        e->a = (int64_t)(blk * bb + 64 + (blk ? rb * 2 : 0) + off), e->b = OP_SET, e->bits = pat[p];
      }
}

static void exec_extra(Gen *g) {
  const LossSpec *s = g->cs->spec;
  label_mutations(g);
  topk_mutations(g);
  seq_mutations(g);
  if (!s->seqs) mut_set(gen_add(g, "num_seqs", "1 (no sequences in the plan)", T_FAIL, NULL), "num_seqs", 1);
  if (s->H) gen_overlap(g, "grad_hidden", "grad_hidden", "hidden", 0, T_INPLACE); /* the same layout: in place? */
  call_edit(g, "plan", "a vocabulary shard's plan", T_FAIL, "plan", EC_SHARDED_PLAN);
}

static void finish_extra(Gen *g) {
  label_mutations(g);
  block_mutations(g, "gathered");
  call_edit(g, "gathered", "its blocks swapped", T_MAY_FINITE, NULL, EC_SWAP);
  call_edit(g, "gathered", "block 1 a copy of block 0", T_FAIL, NULL, EC_DUP);
  call_edit(g, "gathered", "a third block beyond the plan's ranks", T_MATCH, NULL, EC_GROW);
  call_edit(g, "plan", "a plan of two exchanges", T_FAIL, "plan", EC_TWO_EXCHANGE_PLAN);
  gen_overlap(g, "grad", "grad", "gathered", 0, T_INPLACE);
  gen_overlap(g, "scalars", "scalars", "gathered", 1, T_INPLACE);
}

static void middle_extra(Gen *g) {
  block_mutations(g, "gathered");
  call_edit(g, "plan", "a plan of one exchange", T_FAIL, "plan", EC_ONE_EXCHANGE_PLAN);
  gen_overlap(g, "middle", "middle", "gathered", 1, T_INPLACE);
}

static void finish_middle_extra(Gen *g) {
  block_mutations(g, "gathered_middle");
  call_edit(g, "gathered_middle", "its blocks swapped", T_MAY_FINITE, NULL, EC_SWAP_MIDDLE);
  call_edit(g, "plan", "a plan of one exchange", T_FAIL, "plan", EC_ONE_EXCHANGE_PLAN);
  /* the middle blocks where the statistics are: their tags are wrong */
  Mutation *m = gen_add(g, "gathered_middle", "= gathered", T_FAIL, "gathered_middle|gathered");
  Edit *e = mut_edit(m, E_PTR_TO, "gathered_middle");
  snprintf(e->other, sizeof e->other, "gathered");
}

static void middle_size_extra(Gen *g) { call_edit(g, "plan", "a plan of one exchange", T_FAIL, "plan", EC_ONE_EXCHANGE_PLAN); }

static void nccl_extra(Gen *g) {
  Mutation *m = gen_add(g, "nccl_comm", "NULL", T_FAIL, "nccl_comm|plan");
  m->ok = OK(HL_STATUS_INVALID_VALUE) | OK(HL_STATUS_NOT_SUPPORTED);
  mut_set(m, "nccl_comm", 0);
}

static void scalar_name_extra(Gen *g) {
  static const struct {
    int v;
    const char *name;
  } idx[] = {{-1, "-1"}, {INT32_MIN, "INT_MIN"}, {INT32_MAX, "INT_MAX"}, {HL_LOSS_NUM_SCALARS, "HL_LOSS_NUM_SCALARS"}, {0, "0"}};
  for (int i = 0; i < NF(idx); ++i) mut_set(gen_add(g, "index", idx[i].name, T_QUERY, NULL), "index", (uint64_t)(uint32_t)idx[i].v);
}

/* Descriptions the header refuses that no single hostile value reaches, and equivalent ones. */
static void create_extra(Gen *g) {
  const LossSpec *s = g->cs->spec;
  const hl_dtype_t other = s->ldt == F32 ? HL_DTYPE_BF16 : HL_DTYPE_F16; /* neither its dtype nor F32 */
  mut_set(gen_add(g, "vocab_start", "1 (unsharded)", T_FAIL, NULL), "vocab_start", 1);
  mut_set(gen_add(g, "vocab_global", "vocab - 1", T_FAIL, NULL), "vocab_global", (uint64_t)(s->V0 - 1));
  mut_set(gen_add(g, "ranks", "2 (unsharded)", T_FAIL, NULL), "ranks", 2);
  mut_set(gen_add(g, "terms", "0 (with a gradient)", T_FAIL, "terms|grad_mode|grad_hidden_mode|grad_weight_mode|teacher_hidden"), "terms", 0);
  mut_set(gen_add(g, "terms", "DISTILL_FWD | DISTILL_REV", T_FAIL, NULL), "terms", HL_LOSS_DISTILL_FWD | HL_LOSS_DISTILL_REV);
  if (!s->H) {
    mut_set(gen_add(g, "weight_dtype", "F32 (the logits form)", T_FAIL, "weight_dtype|hidden"), "weight_dtype", F32);
    mut_set(gen_add(g, "hidden", "8 without weight_dtype", T_FAIL, "weight_dtype|hidden"), "hidden", 8);
    mut_set(gen_add(g, "grad_dtype", "NONE (the logits' dtype)", T_MATCH, NULL), "grad_dtype", HL_DTYPE_NONE);
    mut_set(gen_add(g, "grad_dtype", "the other float dtype", T_FAIL, NULL), "grad_dtype", other);
    return;
  }
  mut_set(gen_add(g, "logits_dtype", "weight_dtype", T_MATCH, NULL), "logits_dtype", s->ldt);
  mut_set(gen_add(g, "logits_dtype", "not weight_dtype", T_FAIL, NULL), "logits_dtype", other);
  mut_set(gen_add(g, "grad_hidden_dtype", "NONE (weight_dtype)", T_MATCH, NULL), "grad_hidden_dtype", HL_DTYPE_NONE);
  mut_set(gen_add(g, "grad_weight_dtype", "NONE (weight_dtype)", T_MATCH, NULL), "grad_weight_dtype", HL_DTYPE_NONE);
  mut_set(gen_add(g, "grad_mode", "WRITE (the logits form's)", T_FAIL, NULL), "grad_mode", HL_LOSS_GRAD_WRITE);
  mut_set(gen_add(g, "teacher_topk", "4 with a fused teacher", T_FAIL, "teacher_topk|teacher_hidden|teacher_topk_ids_dtype"), "teacher_topk", 4);
}

/* The full control's labels under other ignore indices: a row whose label is the ignore index is
 * ignored at any int64 value; row IGNORE_INDEX_ROW (label 7) stays ignored through -100. */
static void create_full_extra(Gen *g) {
  create_extra(g);
  static const struct {
    int64_t v;
    const char *name;
  } idx[] = {{P2(53) + 1, "2^53+1"}, {INT64_MAX, "INT64_MAX"}, {INT64_MAX - 1, "2^63-2"}, {HL_MAX_EXTENT + 2, "2^48+1"}};
  char value[64];
  for (int i = 0; i < NF(idx); ++i) {
    snprintf(value, sizeof value, "%s, labels[3] the same", idx[i].name);
    Mutation *m = gen_add(g, "ignore_index", value, T_MATCH, NULL);
    mut_set(m, "ignore_index", (uint64_t)idx[i].v);
    Edit *e = mut_edit(m, E_ELEM, "labels");
    e->a = 3, e->bits = (uint64_t)idx[i].v;
    e = mut_edit(m, E_ELEM, "labels");
    e->a = IGNORE_INDEX_ROW, e->bits = (uint64_t)(int64_t)-100;
    e = mut_equiv(m, E_ELEM, "labels");
    e->a = 3, e->bits = (uint64_t)(int64_t)-100;
  }
}

/* ---- the tables ------------------------------------------------------------------------------- */

#define LD(f, K, ...) FIELD(W_DESC, hl_loss_plan_desc_t, f, K, __VA_ARGS__)
static const Field kDescFields[] = {
    LD(struct_size, F_STRUCT_SIZE, .lo = 0), LD(backend, F_ENUM, .lo = 1, .bad1 = 3), LD(vocab, F_SIZE, .lo = 0),
    LD(logits_dtype, F_ENUM, .lo = 1, .bad1 = HL_DTYPE_I32), LD(labels_dtype, F_ENUM, .bad1 = HL_DTYPE_F32, .buf = "labels"),
    LD(terms, F_FLAGS, .hi = 0x3FF), LD(flags, F_FLAGS, .hi = HL_LOSS_UNCHECKED | HL_LOSS_GRAD_TOKEN_LOGP | HL_LOSS_GRAD_TOKEN_ENTROPY | HL_LOSS_GRAD_TOKEN_LSE |
                                           HL_LOSS_TOKEN_SCALING,
       .lo = HL_LOSS_UNCHECKED),
    LD(ce_weight, F_FLOAT, .def = 1), LD(z_weight, F_FLOAT, .def = 1e-4f), LD(entropy_weight, F_FLOAT, .rule = FR_SET, .def = NAN, .term = HL_LOSS_ENTROPY),
    LD(distill_weight, F_FLOAT, .def = 1), LD(grpo_weight, F_FLOAT, .def = 1),
    LD(kl_ref_beta, F_FLOAT, .rule = FR_SET, .def = NAN, .term = HL_LOSS_GRPO_KL_REF),
    LD(label_smoothing, F_FLOAT, .rule = FR_UNIT, .def = NAN), LD(logit_scale, F_FLOAT, .def = 1),
    LD(softcap, F_FLOAT, .def = NAN), LD(teacher_temperature, F_FLOAT, .def = 1), LD(student_temperature, F_FLOAT, .def = 1),
    LD(eps_low, F_FLOAT, .rule = FR_OPEN01, .def = 0.2f), LD(eps_high, F_FLOAT, .rule = FR_POS, .def = 0.2f),
    LD(use_ignore_index, F_BOOL, .lo = 0), LD(ignore_index, F_I64, .lo = 0), LD(grad_mode, F_ENUM, .bad1 = 3),
    LD(grad_dtype, F_ENUM, .bad1 = HL_DTYPE_I32, .bad2 = HL_DTYPE_F16), LD(vocab_start, F_SIZE, .lo = 0),
    LD(vocab_global, F_SIZE, .lo = 0), LD(ranks, F_INT, .lo = 0), LD(hidden, F_SIZE, .lo = 0),
    LD(weight_dtype, F_ENUM, .bad1 = HL_DTYPE_I32, .bad2 = HL_DTYPE_I64), LD(teacher_hidden, F_SIZE, .lo = 0),
    LD(grad_hidden_mode, F_ENUM, .bad1 = 3), LD(grad_hidden_dtype, F_ENUM, .bad1 = HL_DTYPE_I32, .bad2 = HL_DTYPE_F16),
    LD(grad_weight_mode, F_ENUM, .bad1 = 3), LD(grad_weight_dtype, F_ENUM, .bad1 = HL_DTYPE_I32, .bad2 = HL_DTYPE_F16),
    LD(dual_clip, F_FLOAT, .rule = FR_DUAL, .def = NAN), LD(cispo_weight, F_FLOAT, .def = 1),
    LD(cispo_eps_high, F_FLOAT, .def = NAN), LD(kl_estimator, F_ENUM, .bad1 = 3),
    LD(cu_seqlens_dtype, F_ENUM, .bad1 = HL_DTYPE_F32, .buf = "cu_seqlens"), LD(ratio_level, F_ENUM, .bad1 = 1),
    LD(rollout_correction, F_ENUM, .bad1 = 4), LD(rollout_level, F_ENUM, .bad1 = 3), LD(rollout_cap, F_FLOAT, .def = 2),
    LD(rollout_floor, F_FLOAT, .def = NAN), LD(jsd_beta, F_FLOAT, .rule = FR_BETA, .def = 0.5f, .term = HL_LOSS_DISTILL_JSD),
    LD(teacher_topk, F_INT, .lo = 0, .hi = 256), LD(teacher_topk_ids_dtype, F_ENUM, .bad1 = HL_DTYPE_F32, .buf = "teacher_topk_ids"),
    LD(preference, F_ENUM, .bad1 = 5), LD(pref_loss_type, F_ENUM, .bad1 = 11), LD(pref_logp, F_ENUM, .bad1 = 3),
    LD(pref_weight, F_FLOAT, .def = 1), LD(pref_beta, F_FLOAT, .def = 0.1f), LD(pref_gamma, F_FLOAT, .def = NAN),
    LD(pref_label_smoothing, F_FLOAT, .def = NAN), LD(pref_tau, F_FLOAT, .def = 0.05f),
    LD(kto_desirable_weight, F_FLOAT, .def = 1), LD(kto_undesirable_weight, F_FLOAT, .def = 1),
    LD(grad_bias_mode, F_ENUM, .bad1 = 3), LD(grad_bias_dtype, F_ENUM, .bad1 = HL_DTYPE_I32, .bad2 = HL_DTYPE_F16)};

#define AF(f, K, ...) FIELD(W_DESC, hl_loss_args_t, f, K, __VA_ARGS__)
#define AP(f) AF(f, F_PTR, .buf = #f)
#define AS(f, b) AF(f, F_STRIDE, .buf = #b)
static const Field kArgsFields[] = {
    AF(struct_size, F_STRUCT_SIZE, .lo = 0), AF(rows, F_SIZE, .lo = 0), AP(logits), AS(logits_stride, logits), AP(labels),
    AP(weights), AP(teacher_logits), AS(teacher_stride, teacher_logits), AP(advantages), AP(old_logprobs),
    AP(ref_logprobs), AF(divisor, F_DOUBLE, .def = NAN), AF(grad_scale, F_FLOAT, .def = 1), AP(grad),
    AS(grad_stride, grad), AP(scalars), AP(token_loss), AP(token_logp), AP(token_entropy), AP(token_lse), AP(hidden),
    AS(hidden_stride, hidden), AP(weight), AS(weight_stride, weight), AP(teacher_hidden),
    AS(teacher_hidden_stride, teacher_hidden), AP(teacher_weight), AS(teacher_weight_stride, teacher_weight),
    AP(grad_hidden), AS(grad_hidden_stride, grad_hidden), AP(grad_weight), AS(grad_weight_stride, grad_weight),
    AP(cu_seqlens), AF(num_seqs, F_SIZE, .lo = 0, .buf = "cu_seqlens"), AP(rollout_logprobs), AP(teacher_topk_ids),
    AS(teacher_topk_ids_stride, teacher_topk_ids), AP(teacher_topk_logprobs),
    AS(teacher_topk_logprobs_stride, teacher_topk_logprobs), AP(grad_token_logp), AP(grad_token_entropy),
    AP(grad_token_lse), AP(ref_seq_logprobs), AP(kto_labels), AP(bias), AP(grad_bias), AP(token_argmax)};

#define PF(f, K, ...) FIELD(W_PARAM, LossParams, f, K, __VA_ARGS__)
#define PLAN PF(plan, F_PLAN, .lo = 0)
#define WS PF(workspace, F_WS_PTR, .lo = 0), PF(workspace_bytes, F_WS_BYTES, .lo = 0)
#define BLOCKS(b) PF(b, F_PTR, .buf = #b), PF(b##_bytes, F_BYTES, .buf = #b)
static const Field kExecParams[] = {PLAN, WS};
static const Field kStatsParams[] = {PLAN, BLOCKS(stats)};
static const Field kStatsWsParams[] = {PLAN, BLOCKS(stats), WS};
static const Field kFinishParams[] = {PLAN, BLOCKS(gathered), WS};
static const Field kMiddleParams[] = {PLAN, BLOCKS(gathered), BLOCKS(middle), WS};
static const Field kFinishMiddleParams[] = {PLAN, BLOCKS(gathered), BLOCKS(gathered_middle), WS};
static const Field kNcclParams[] = {PLAN, PF(nccl_comm, F_PTR, .buf = "nccl_comm"), WS};
static const Field kSizesParams[] = {PLAN, PF(rows, F_SIZE, .lo = 0), PF(min_bytes, F_PTR, .buf = "min_bytes"),
                                     PF(fast_bytes, F_PTR, .buf = "fast_bytes")};
static const Field kSizeParams[] = {PLAN, PF(rows, F_SIZE, .lo = 0), PF(bytes, F_PTR, .buf = "bytes")};
static const Field kExchangesParams[] = {PLAN, PF(exchanges, F_PTR, .buf = "exchanges")};
static const Field kCreateParams[] = {{.name = "plan", .where = W_PARAM, .off = offsetof(LossParams, plan_out), .kind = F_PTR, .buf = "plan"}};
static const Field kIndexParams[] = {PF(index, F_FREE, .lo = 0)};

static const size_t kDescEarlier[] = {128, 136, 176, 192, 232, 0}, kArgsEarlier[] = {160, 256, 312, 336, 0};

/* Pointers a control's plan refuses: the other form's, and inputs of options it does not have. */
#define LINEAR_PTRS "hidden weight teacher_hidden teacher_weight grad_hidden grad_weight"
#define TOPK_PTRS "teacher_topk_ids teacher_topk_logprobs"
#define TOKEN_GRAD_PTRS " grad_token_logp grad_token_entropy grad_token_lse" /* where the plan lacks the flags */
#define FORBID_CE LINEAR_PTRS " cu_seqlens " TOPK_PTRS TOKEN_GRAD_PTRS
#define FORBID_FULL LINEAR_PTRS " " TOPK_PTRS TOKEN_GRAD_PTRS
#define FORBID_LINEAR "logits grad teacher_logits cu_seqlens " TOPK_PTRS TOKEN_GRAD_PTRS
#define FORBID_TOPK LINEAR_PTRS " cu_seqlens teacher_logits" TOKEN_GRAD_PTRS

#define LOSS(name, sp, inv, pt, ...)                                                                                \
  {.entry = name, .label = #sp, .spec = &sp, .family = "loss", .params = pt, .nparams = NF(pt), .declare = loss_declare, \
   .prepare = loss_prepare, .invoke = inv, .edit = loss_edit, __VA_ARGS__}
#define ARGS .desc_name = "args", .desc_size = sizeof(hl_loss_args_t), .earlier = kArgsEarlier, .fields = kArgsFields, .nfields = NF(kArgsFields)
#define CREATE(sp, chk, fl, ...)                                                                                     \
  LOSS("hl_loss_plan_create", sp, inv_create, kCreateParams, .desc_name = "desc", .desc_size = sizeof(hl_loss_plan_desc_t), \
       .earlier = kDescEarlier, .fields = kDescFields, .nfields = NF(kDescFields), .side = kArgsFields,                  \
       .nside = NF(kArgsFields), .flags = LOSS_CREATE | CASE_SCALARS_BY_SIZE | (fl), .check = chk, __VA_ARGS__)
#define EXECUTE(sp, chk, fb, ...) \
  LOSS("hl_loss_plan_execute", sp, inv_execute, kExecParams, ARGS, .check = chk, .forbid = fb, .extra = exec_extra, __VA_ARGS__)
#define QUERY(name, sp, inv, pt, chk, ...) LOSS(name, sp, inv, pt, .query = 1, .check = chk, __VA_ARGS__)

static const Case kLoss[] = {
    CREATE(kFull, check_full, 0, .extra = create_full_extra),
    CREATE(kLinear, check_linear, CASE_WS_CHUNKS, .extra = create_extra),
    CREATE(kTopk, check_topk, 0, .extra = create_extra,
           .only = "struct_size terms labels_dtype logits_dtype grad_dtype teacher_topk teacher_topk_ids_dtype jsd_beta "
                   "distill_weight student_temperature teacher_temperature"),
    EXECUTE(kCe, check_ce, FORBID_CE, .inplace = "grad=logits"),
    EXECUTE(kFull, check_full, FORBID_FULL),
    EXECUTE(kLinear, check_linear, FORBID_LINEAR, .flags = CASE_WS_CHUNKS),
    EXECUTE(kTopk, check_topk, FORBID_TOPK, .inplace = "grad=logits"),
    LOSS("hl_loss_plan_execute_stats", kTp, inv_stats, kStatsParams, ARGS, .flags = LOSS_READS, .check = check_stats, .forbid = FORBID_CE),
    LOSS("hl_loss_plan_execute_stats_ws", kTp, inv_stats_ws, kStatsWsParams, ARGS, .flags = LOSS_READS,
         .check = check_stats, .only = "plan stats stats_bytes workspace workspace_bytes"),
    LOSS("hl_loss_plan_execute_finish", kTp, inv_finish, kFinishParams, ARGS, .check = check_whole, .forbid = FORBID_CE,
         .extra = finish_extra),
    LOSS("hl_loss_plan_execute_middle", kJsd, inv_middle, kMiddleParams, ARGS, .flags = LOSS_READS, .check = check_middle,
         .forbid = FORBID_CE, .extra = middle_extra),
    LOSS("hl_loss_plan_execute_finish_with_middle", kJsd, inv_finish_middle, kFinishMiddleParams, ARGS, .check = check_whole,
         .forbid = FORBID_CE, .extra = finish_middle_extra),
    LOSS("hl_loss_plan_execute_nccl", kTp, inv_nccl, kNcclParams, ARGS, .flags = CASE_CPU_ONLY, .only = "plan",
         .control_status = HL_STATUS_NOT_SUPPORTED, .extra = nccl_extra),
    QUERY("hl_loss_plan_get_workspace_sizes", kCe, inv_sizes, kSizesParams, check_ws_sizes),
    QUERY("hl_loss_plan_get_workspace_sizes", kLinear, inv_sizes, kSizesParams, check_ws_sizes),
    QUERY("hl_loss_plan_get_workspace_size", kCe, inv_size, kSizeParams, check_ws_sizes),
    QUERY("hl_loss_plan_get_stats_size", kTp, inv_stats_size, kSizeParams, check_block_size, .qcheck = qcheck_block_size),
    QUERY("hl_loss_plan_get_exchanges", kTp, inv_exchanges, kExchangesParams, check_exchanges),
    QUERY("hl_loss_plan_get_exchanges", kJsd, inv_exchanges, kExchangesParams, check_exchanges),
    QUERY("hl_loss_plan_get_middle_size", kJsd, inv_middle_size, kSizeParams, check_block_size, .qcheck = qcheck_block_size,
          .extra = middle_size_extra),
    {.entry = "hl_loss_scalar_name", .label = "kCe", .spec = &kCe, .family = "loss", .params = kIndexParams,
     .nparams = NF(kIndexParams), .only = "", .query = 1, .declare = name_declare, .invoke = inv_scalar_name,
     .check = check_scalar_name, .qcheck = qcheck_scalar_name, .extra = scalar_name_extra},
};

int loss_cases(const Case **out) {
  for (int i = 0; i < NF(kLoss); ++i) out[i] = &kLoss[i];
  return NF(kLoss);
}
