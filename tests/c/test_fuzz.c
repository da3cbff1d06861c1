/* The ABI fuzz harness (issue #49): every exported entry point, each valid control checked against
 * an independent computation, then one-field mutations of its descriptors and arguments with the
 * outcome headloss.h promises for each (fuzz.h has the vocabulary, fuzz.c the machinery, this file
 * the RMSNorm and GDN cases, fuzz_loss.c the loss plan's).
 *
 * CPU backend (default): every call runs in a fork()ed child on guarded buffers. CUDA backend
 * (HL_FUZZ_BACKEND=cuda or --cuda): device buffers with canary zones, in-process, the controls
 * compared with the CPU backend too; exit 77 without a GPU. HL_FUZZ_FILTER=loss,gdn selects
 * cases, HL_FUZZ_FIELD=stride and HL_FUZZ_SKIP=struct_size,rows mutations, HL_FUZZ_MAX=N thins
 * each case's list (0: the controls alone; for compute-sanitizer), -v prints every outcome. Any
 * finding makes the exit status 1. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"

/* The parameters of a workspace query besides its descriptor. */
typedef struct {
  size_t *bytes;
} BytesParams;
static const Field kBytesParams[] = {FIELD(W_PARAM, BytesParams, bytes, F_PTR, .buf = "bytes")};

/* ---- RMSNorm ---------------------------------------------------------------------------------- */

typedef struct {
  hl_dtype_t xdt, wdt, ydt; /* bwd: ydt is dw's */
  int64_t rows, cols, s1, s2, s3, s4; /* strides: fwd x, residual, residual_out, y; bwd x, dy, dx, dresidual */
  hl_rmsnorm_cast_t cast;
  float eps, offset;
  int full; /* every optional buffer (fwd: residual; bwd: rstd, dresidual_out, dresidual) */
} RmsSpec;

static const RmsSpec kFwdF32 = {HL_DTYPE_F32, HL_DTYPE_F32, HL_DTYPE_F32, 5, 37, 0, 0, 0, 0, HL_RMSNORM_CAST_GEMMA, 1e-5f, 0.5f, 1};
static const RmsSpec kFwdBf16 = {HL_DTYPE_BF16, HL_DTYPE_BF16, HL_DTYPE_BF16, 4, 40, 48, 41, 44, 0, HL_RMSNORM_CAST_LLAMA, 1e-6f, 0.0f, 1};
static const RmsSpec kBwdF32 = {HL_DTYPE_F32, HL_DTYPE_F32, HL_DTYPE_F32, 5, 37, 0, 0, 0, 0, HL_RMSNORM_CAST_GEMMA, 1e-6f, 1.0f, 1};
static const RmsSpec kBwdBf16 = {HL_DTYPE_BF16, HL_DTYPE_BF16, HL_DTYPE_BF16, 4, 40, 44, 0, 48, 0, HL_RMSNORM_CAST_LLAMA, 1e-5f, 0.0f, 0};

#define FW(f, K, ...) FIELD(W_DESC, hl_rmsnorm_fwd_args_t, f, K, __VA_ARGS__)
static const Field kFwdFields[] = {
    FW(struct_size, F_STRUCT_SIZE, .lo = 0), FW(backend, F_ENUM, .lo = 1, .bad1 = 3), FW(rows, F_SIZE, .lo = 0),
    FW(cols, F_SIZE, .lo = 0), FW(cast, F_ENUM, .bad1 = 3), FW(eps, F_FLOAT, .def = NAN), FW(offset, F_FLOAT, .def = NAN),
    FW(x_dtype, F_ENUM, .lo = 1, .bad1 = HL_DTYPE_I32), FW(x, F_PTR, .buf = "x"), FW(x_stride, F_STRIDE, .buf = "x"),
    FW(residual, F_PTR, .buf = "residual"), FW(residual_stride, F_STRIDE, .buf = "residual"),
    FW(residual_out, F_PTR, .buf = "residual_out"), FW(residual_out_stride, F_STRIDE, .buf = "residual_out"),
    FW(weight_dtype, F_ENUM, .lo = 1, .bad1 = HL_DTYPE_I64), FW(weight, F_PTR, .buf = "weight"),
    FW(y_dtype, F_ENUM, .lo = 1, .bad1 = HL_DTYPE_I32), FW(y, F_PTR, .buf = "y"), FW(y_stride, F_STRIDE, .buf = "y"),
    FW(rstd, F_PTR, .buf = "rstd")};

#define BW(f, K, ...) FIELD(W_DESC, hl_rmsnorm_bwd_args_t, f, K, __VA_ARGS__)
static const Field kBwdFields[] = {
    BW(struct_size, F_STRUCT_SIZE, .lo = 0), BW(backend, F_ENUM, .lo = 1, .bad1 = 3), BW(rows, F_SIZE, .lo = 0),
    BW(cols, F_SIZE, .lo = 0), BW(cast, F_ENUM, .bad1 = 3), BW(eps, F_FLOAT, .def = NAN), BW(offset, F_FLOAT, .def = NAN),
    BW(x_dtype, F_ENUM, .lo = 1, .bad1 = HL_DTYPE_I32), BW(x, F_PTR, .buf = "x"), BW(x_stride, F_STRIDE, .buf = "x"),
    BW(rstd, F_PTR, .buf = "rstd"), BW(weight_dtype, F_ENUM, .lo = 1, .bad1 = HL_DTYPE_I64),
    BW(weight, F_PTR, .buf = "weight"), BW(dy_dtype, F_ENUM, .lo = 1, .bad1 = HL_DTYPE_I32), BW(dy, F_PTR, .buf = "dy"),
    BW(dy_stride, F_STRIDE, .buf = "dy"), BW(dresidual_out, F_PTR, .buf = "dresidual_out"),
    BW(dresidual_out_stride, F_STRIDE, .buf = "dresidual_out"), BW(dx, F_PTR, .buf = "dx"),
    BW(dx_stride, F_STRIDE, .buf = "dx"), BW(dresidual, F_PTR, .buf = "dresidual"),
    BW(dresidual_stride, F_STRIDE, .buf = "dresidual"), BW(dw_dtype, F_ENUM, .lo = 1, .bad1 = HL_DTYPE_I32, .bad2 = HL_DTYPE_F16),
    BW(dw, F_PTR, .buf = "dw"), BW(workspace, F_WS_PTR, .lo = 0), BW(workspace_bytes, F_WS_BYTES, .lo = 0)};

static void fwd_declare(Call *c) {
  const RmsSpec *s = c->cs->spec;
  hl_rmsnorm_fwd_args_t *a = DESC(c, hl_rmsnorm_fwd_args_t);
  *a = (hl_rmsnorm_fwd_args_t)HL_RMSNORM_FWD_ARGS_INIT;
  a->backend = c->backend, a->rows = s->rows, a->cols = s->cols, a->cast = s->cast, a->eps = s->eps;
  a->offset = s->offset, a->x_dtype = s->xdt, a->weight_dtype = s->wdt, a->y_dtype = s->ydt;
  a->x_stride = s->s1, a->residual_stride = s->s2, a->residual_out_stride = s->s3, a->y_stride = s->s4;
  buf_mat(c, "x", R_IN, s->xdt, s->rows, s->cols, s->s1);
  buf_mat(c, "residual", R_IN, s->xdt, s->rows, s->cols, s->s2)->optional = 1;
  buf_mat(c, "residual_out", R_OUT, s->xdt, s->rows, s->cols, s->s3);
  buf_vec(c, "weight", R_IN, s->wdt, s->cols)->optional = 1;
  buf_mat(c, "y", R_OUT, s->ydt, s->rows, s->cols, s->s4);
  buf_vec(c, "rstd", R_OUT, HL_DTYPE_F32, s->rows)->optional = 1;
}

static hl_status_t fwd_invoke(Call *c) { return hl_rmsnorm_fwd(DP(c, hl_rmsnorm_fwd_args_t), NULL); }
static hl_status_t fwd_alias_invoke(Call *c) { return rmsnorm_fwd(DP(c, hl_rmsnorm_fwd_args_t), NULL); }

/* s = x + residual (stored in x's dtype), rstd = 1 / sqrt(mean(s^2) + eps), y = s rstd (offset + w),
 * s rstd rounded to x's dtype first in LLAMA mode. */
static void fwd_check(Call *c, Chk *k) {
  const RmsSpec *p = c->cs->spec;
  const int64_t R = p->rows, C = p->cols;
  double *s = dalloc(R * C), *y = dalloc(R * C), *rstd = dalloc(R);
  for (int64_t i = 0; i < R; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < C; ++j) {
      s[i * C + j] = round_to(p->xdt, buf_in(c, "x", i, j) + buf_in(c, "residual", i, j));
      ss += s[i * C + j] * s[i * C + j];
    }
    rstd[i] = 1.0 / sqrt(ss / (double)C + p->eps);
    for (int64_t j = 0; j < C; ++j) {
      const double xn = s[i * C + j] * rstd[i];
      y[i * C + j] = (p->cast == HL_RMSNORM_CAST_LLAMA ? round_to(p->xdt, xn) : xn) * (p->offset + buf_in(c, "weight", 0, j));
    }
  }
  chk_mat(k, c, "residual_out", s, R, C, 0, 0);
  chk_mat(k, c, "y", y, R, C, tol_of(p->ydt), tol_of(p->ydt));
  chk_mat(k, c, "rstd", rstd, 1, R, 1e-6, 0);
  free(s), free(y), free(rstd);
}

static void bwd_declare(Call *c) {
  const RmsSpec *s = c->cs->spec;
  hl_rmsnorm_bwd_args_t *a = DESC(c, hl_rmsnorm_bwd_args_t);
  *a = (hl_rmsnorm_bwd_args_t)HL_RMSNORM_BWD_ARGS_INIT;
  a->backend = c->backend, a->rows = s->rows, a->cols = s->cols, a->cast = s->cast, a->eps = s->eps;
  a->offset = s->offset, a->x_dtype = s->xdt, a->weight_dtype = s->wdt, a->dy_dtype = s->xdt, a->dw_dtype = s->ydt;
  a->x_stride = s->s1, a->dy_stride = s->s2, a->dx_stride = s->s3, a->dresidual_stride = s->s4;
  Buf *x = buf_mat(c, "x", R_IN, s->xdt, s->rows, s->cols, s->s1);
  if (s->full) { /* the forward's rstd of x */
    Buf *r = buf_vec(c, "rstd", R_IN, HL_DTYPE_F32, s->rows);
    r->optional = 1;
    for (int64_t i = 0; i < s->rows; ++i) {
      double ss = 0;
      for (int64_t j = 0; j < s->cols; ++j) ss += pow(buf_get(x, x->init, i, j), 2);
      buf_set(r, 0, i, 1.0 / sqrt(ss / (double)s->cols + s->eps));
    }
  }
  buf_vec(c, "weight", R_IN, s->wdt, s->cols)->optional = 1;
  buf_mat(c, "dy", R_IN, s->xdt, s->rows, s->cols, s->s2);
  if (s->full) buf_mat(c, "dresidual_out", R_IN, s->xdt, s->rows, s->cols, 0)->optional = 1;
  buf_mat(c, "dx", R_OUT, s->xdt, s->rows, s->cols, s->s3);
  if (s->full) buf_mat(c, "dresidual", R_OUT, s->xdt, s->rows, s->cols, s->s4)->optional = 1;
  buf_vec(c, "dw", R_OUT, s->ydt, s->cols);
}

/* The CUDA backward's workspace, as its size query answers. The query takes the call's pointers
 * (the kernel, and so the workspace, depends on their alignment, and a weight adds dw's partial
 * sums), which are placed later: stand-ins for the weight, and the larger answer of the two kernel
 * paths, 16-byte aligned rows (as declared: NULL) or not (x one element off, in memory of the
 * call's kind). */
static void bwd_prepare(Call *c) {
  hl_rmsnorm_bwd_args_t q = *DESC(c, hl_rmsnorm_bwd_args_t);
  size_t aligned = 0, unaligned = 0;
  if (buf_find(c, "weight")) q.weight = query_scratch(c->cuda);
  if (hl_rmsnorm_bwd_workspace_size(&q, &aligned) != HL_STATUS_SUCCESS) die(hl_get_last_error());
  q.x = (const char *)query_scratch(c->cuda) + 4; /* aligned for every dtype, not to 16 bytes */
  if (hl_rmsnorm_bwd_workspace_size(&q, &unaligned) != HL_STATUS_SUCCESS) die(hl_get_last_error());
  const size_t ws = aligned > unaligned ? aligned : unaligned;
  if (!ws) return;
  c->ws_need = ws;
  buf_raw(c, "workspace", R_SCRATCH, EK_BYTES, (int64_t)ws);
}

static hl_status_t bwd_invoke(Call *c) { return hl_rmsnorm_bwd(DP(c, hl_rmsnorm_bwd_args_t), NULL); }
static hl_status_t bwd_alias_invoke(Call *c) { return rmsnorm_bwd(DP(c, hl_rmsnorm_bwd_args_t), NULL); }

/* xhat = s rstd, g = dy (offset + w): dx = rstd (g - xhat mean(g xhat)) + dresidual_out, dresidual
 * = dx, dw = sum over rows of dy xhat (xhat rounded to x's dtype in LLAMA mode). */
static void bwd_check(Call *c, Chk *k) {
  const RmsSpec *p = c->cs->spec;
  const int64_t R = p->rows, C = p->cols;
  double *dx = dalloc(R * C), *dw = dalloc(C);
  for (int64_t i = 0; i < R; ++i) {
    double ss = 0, dot = 0;
    for (int64_t j = 0; j < C; ++j) ss += pow(buf_in(c, "x", i, j), 2);
    const double rstd = p->full ? buf_in(c, "rstd", 0, i) : 1.0 / sqrt(ss / (double)C + p->eps);
    for (int64_t j = 0; j < C; ++j) {
      const double xhat = buf_in(c, "x", i, j) * rstd, dy = buf_in(c, "dy", i, j);
      dot += dy * (p->offset + buf_in(c, "weight", 0, j)) * xhat;
      dw[j] += dy * (p->cast == HL_RMSNORM_CAST_LLAMA ? round_to(p->xdt, xhat) : xhat);
    }
    for (int64_t j = 0; j < C; ++j) {
      const double g = buf_in(c, "dy", i, j) * (p->offset + buf_in(c, "weight", 0, j));
      dx[i * C + j] = rstd * (g - buf_in(c, "x", i, j) * rstd * dot / (double)C) + (p->full ? buf_in(c, "dresidual_out", i, j) : 0);
    }
  }
  chk_mat(k, c, "dx", dx, R, C, tol_of(p->xdt), tol_of(p->xdt));
  if (p->full) chk_mat(k, c, "dresidual", dx, R, C, tol_of(p->xdt), tol_of(p->xdt));
  chk_mat(k, c, "dw", dw, 1, C, tol_of(p->ydt), tol_of(p->ydt));
  free(dx), free(dw);
}

static void bwd_ws_declare(Call *c) {
  bwd_declare(c);
  buf_host(c, "bytes", EK_U64);
}

static hl_status_t bwd_ws_invoke(Call *c) { return hl_rmsnorm_bwd_workspace_size(DP(c, hl_rmsnorm_bwd_args_t), PARAMS(c, BytesParams)->bytes); }
static hl_status_t bwd_ws_alias_invoke(Call *c) { return rmsnorm_bwd_workspace_size(DP(c, hl_rmsnorm_bwd_args_t), PARAMS(c, BytesParams)->bytes); }

/* A workspace query's answer: the workspace the control's call is given (0 on the CPU backend; on
 * CUDA at most that, which covers both of the RMSNorm backward's kernel paths). */
static void ws_check(Call *c, Chk *k) {
  const Buf *b = buf_find(c, "bytes");
  const uint64_t got = (uint64_t)buf_geti(b, buf_out(b), 0);
  if (c->cuda && got <= c->ws_need) return;
  chk_eq_u64(k, "*bytes", got, c->ws_need);
}

#define RMS_FWD(name, sp, inv, ...)                                                                          \
  {.entry = name, .label = #sp, .spec = &sp, .family = "rmsnorm", .desc_name = "args", .msg_entry = "hl_rmsnorm_fwd", \
   .desc_size = sizeof(hl_rmsnorm_fwd_args_t), .fields = kFwdFields, .nfields = NF(kFwdFields), .inplace = "y=x",   \
   .declare = fwd_declare, .invoke = inv, .check = fwd_check, __VA_ARGS__}
#define RMS_BWD(name, sp, inv, ...)                                                                          \
  {.entry = name, .label = #sp, .spec = &sp, .family = "rmsnorm", .desc_name = "args", .msg_entry = "hl_rmsnorm_bwd", \
   .desc_size = sizeof(hl_rmsnorm_bwd_args_t), .fields = kBwdFields, .nfields = NF(kBwdFields),                      \
   .declare = bwd_declare, .prepare = bwd_prepare, .invoke = inv, .check = bwd_check, __VA_ARGS__}
#define RMS_BWD_WS(name, sp, inv, ...)                                                                       \
  {.entry = name, .label = #sp, .spec = &sp, .family = "rmsnorm", .desc_name = "args",                          \
   .msg_entry = "hl_rmsnorm_bwd_workspace_size", .desc_size = sizeof(hl_rmsnorm_bwd_args_t), .fields = kBwdFields, \
   .nfields = NF(kBwdFields), .params = kBytesParams, .nparams = 1, .query = 1, .declare = bwd_ws_declare, .prepare = bwd_prepare, .invoke = inv,        \
   .check = ws_check, __VA_ARGS__}

static const Case kRmsCases[] = {
    RMS_FWD("hl_rmsnorm_fwd", kFwdF32, fwd_invoke, .flags = 0),
    RMS_FWD("hl_rmsnorm_fwd", kFwdBf16, fwd_invoke, .flags = 0),
    RMS_FWD("rmsnorm_fwd", kFwdF32, fwd_alias_invoke, .only = ""),
    RMS_BWD("hl_rmsnorm_bwd", kBwdF32, bwd_invoke, .flags = 0),
    RMS_BWD("hl_rmsnorm_bwd", kBwdBf16, bwd_invoke, .flags = 0),
    RMS_BWD("rmsnorm_bwd", kBwdF32, bwd_alias_invoke, .only = ""),
    RMS_BWD_WS("hl_rmsnorm_bwd_workspace_size", kBwdF32, bwd_ws_invoke, .only = "struct_size backend rows cols bytes"),
    RMS_BWD_WS("rmsnorm_bwd_workspace_size", kBwdF32, bwd_ws_alias_invoke, .only = "bytes"),
};

/* ---- Gated DeltaNet backward ------------------------------------------------------------------ */

typedef struct {
  int64_t B, T, H, HV, K, V;
  hl_dtype_t hdt;
  hl_gdn_gate_t gate;
  int reverse, vfirst, dw; /* dw: dv in and dw out */
  float scale;
  int64_t nseqs;           /* varlen: cu_seqlens (I32) */
  int32_t cu[4];
} GdnSpec;

/* Two batches of 70 tokens (a full chunk and a partial one), GVA, per-token gates, dw, reverse
 * cumsum; and varlen (5 + 65 tokens), constant decay in log2 units, fp32 states stored V first. */
static const GdnSpec kGdnLog = {2, 70, 1, 2, 12, 10, HL_DTYPE_BF16, HL_GDN_GATE_LOG, 1, 0, 1, 0.0f, 0, {0}};
static const GdnSpec kGdnVarlen = {1, 70, 2, 2, 8, 8, HL_DTYPE_F32, HL_GDN_GATE_CONST_DECAY_LOG2, 0, 1, 0, 0.3f, 2, {0, 5, 70}};

enum { CHUNK = 64 };

/* The chunks in h's order: (first token, rows). */
static int64_t gdn_chunks(const GdnSpec *s, int64_t *t0, int64_t *n) {
  int64_t nc = 0;
  for (int64_t q = 0; q < (s->nseqs ? s->nseqs : s->B); ++q) {
    const int64_t lo = s->nseqs ? s->cu[q] : q * s->T, hi = s->nseqs ? s->cu[q + 1] : lo + s->T;
    for (int64_t t = lo; t < hi; t += CHUNK, ++nc)
      if (t0) t0[nc] = t, n[nc] = hi - t < CHUNK ? hi - t : CHUNK;
  }
  return nc;
}

#define GW(f, K, ...) FIELD(W_DESC, hl_gdn_bwd_dqkwg_args_t, f, K, __VA_ARGS__)
static const Field kGdnFields[] = {
    GW(struct_size, F_STRUCT_SIZE, .lo = 0), GW(backend, F_ENUM, .lo = 1, .bad1 = 3), GW(B, F_SIZE, .lo = 0),
    GW(T, F_SIZE, .lo = 0), GW(H, F_SIZE, .lo = 0), GW(HV, F_SIZE, .lo = 0), GW(K, F_SIZE, .lo = 1, .hi = 256),
    GW(V, F_SIZE, .lo = 1, .hi = 256), GW(num_chunks, F_SIZE, .lo = 0),
    GW(dtype, F_ENUM, .lo = 1, .bad1 = HL_DTYPE_F32, .bad2 = HL_DTYPE_I32),
    GW(h_dtype, F_ENUM, .lo = 1, .bad1 = HL_DTYPE_F16, .bad2 = HL_DTYPE_I64), GW(q, F_PTR, .buf = "q"),
    GW(k, F_PTR, .buf = "k"), GW(v, F_PTR, .buf = "v"), GW(do_, F_PTR, .buf = "do_"), GW(h, F_PTR, .buf = "h"),
    GW(dh, F_PTR, .buf = "dh"), GW(dv, F_PTR, .buf = "dv"), GW(dq, F_PTR, .buf = "dq"), GW(dk, F_PTR, .buf = "dk"),
    GW(dw, F_PTR, .buf = "dw"), GW(gate, F_ENUM, .bad1 = 5), GW(g, F_PTR, .buf = "g"),
    GW(g_gamma, F_PTR, .buf = "g_gamma"), GW(dg, F_PTR, .buf = "dg"), GW(reverse_cumsum, F_FREE, .lo = 0),
    GW(scale, F_FLOAT, .def = NAN), GW(cu_seqlens_dtype, F_ENUM, .bad1 = HL_DTYPE_F32, .buf = "cu_seqlens"),
    GW(cu_seqlens, F_PTR, .buf = "cu_seqlens"), GW(num_seqs, F_SIZE, .lo = 0, .buf = "cu_seqlens"), GW(workspace, F_WS_PTR, .lo = 0),
    GW(workspace_bytes, F_WS_BYTES, .lo = 0),
    GW(flags, F_FLAGS, .hi = HL_GDN_UNCHECKED | HL_GDN_STATE_V_FIRST, .lo = HL_GDN_UNCHECKED)};

static void gdn_declare(Call *c) {
  const GdnSpec *s = c->cs->spec;
  const int64_t tok = s->B * s->T, nc = gdn_chunks(s, NULL, NULL);
  const int per_token = s->gate == HL_GDN_GATE_LOG || s->gate == HL_GDN_GATE_LOG2;
  hl_gdn_bwd_dqkwg_args_t *a = DESC(c, hl_gdn_bwd_dqkwg_args_t);
  *a = (hl_gdn_bwd_dqkwg_args_t)HL_GDN_BWD_DQKWG_ARGS_INIT;
  a->backend = c->backend, a->B = s->B, a->T = s->T, a->H = s->H, a->HV = s->HV, a->K = s->K, a->V = s->V;
  a->num_chunks = s->nseqs ? nc : 0, a->dtype = HL_DTYPE_BF16, a->h_dtype = s->hdt, a->gate = s->gate;
  a->reverse_cumsum = s->reverse, a->scale = s->scale, a->flags = s->vfirst ? HL_GDN_STATE_V_FIRST : 0;
  buf_mat(c, "q", R_IN, HL_DTYPE_BF16, tok, s->H * s->K, 0);
  buf_mat(c, "k", R_IN, HL_DTYPE_BF16, tok, s->H * s->K, 0);
  buf_mat(c, "v", R_IN, HL_DTYPE_BF16, tok, s->HV * s->V, 0);
  buf_mat(c, "do_", R_IN, HL_DTYPE_BF16, tok, s->HV * s->V, 0);
  buf_mat(c, "h", R_IN, s->hdt, nc * s->HV, s->K * s->V, 0);
  buf_mat(c, "dh", R_IN, s->hdt, nc * s->HV, s->K * s->V, 0);
  if (s->dw) buf_mat(c, "dv", R_IN, HL_DTYPE_BF16, tok, s->HV * s->V, 0);
  if (per_token) { /* g cumulated within each chunk, decaying */
    Buf *g = buf_mat(c, "g", R_IN, HL_DTYPE_F32, tok, s->HV, 0);
    uint64_t seed = 7;
    int64_t t0[16], n[16];
    for (int64_t ch = 0; ch < gdn_chunks(s, t0, n); ++ch)
      for (int64_t hv = 0; hv < s->HV; ++hv)
        for (int64_t t = 0, acc = 0; t < n[ch]; ++t) {
          acc -= 1 + (int64_t)(rng_unit(&seed) * 60);
          buf_set(g, t0[ch] + t, hv, (double)acc / 1000);
        }
  } else if (s->gate != HL_GDN_GATE_NONE) {
    Buf *g = buf_vec(c, "g_gamma", R_IN, HL_DTYPE_F32, s->HV);
    for (int64_t hv = 0; hv < s->HV; ++hv) buf_set(g, 0, hv, -0.05 * (double)(hv + 1));
  }
  if (s->nseqs) {
    Buf *cu = buf_vec(c, "cu_seqlens", R_IN, HL_DTYPE_I32, s->nseqs + 1);
    for (int64_t i = 0; i <= s->nseqs; ++i) buf_seti(cu, i, s->cu[i]);
    a->cu_seqlens_dtype = HL_DTYPE_I32, a->num_seqs = s->nseqs;
  }
  buf_mat(c, "dq", R_OUT, HL_DTYPE_BF16, tok, s->H * s->K, 0);
  buf_mat(c, "dk", R_OUT, HL_DTYPE_BF16, tok, s->H * s->K, 0);
  if (s->dw) buf_mat(c, "dw", R_OUT, HL_DTYPE_BF16, tok, s->HV * s->K, 0)->optional = 1;
  if (per_token) buf_mat(c, "dg", R_OUT, HL_DTYPE_F32, tok, s->HV, 0);
}

/* The CUDA backend's workspace (varlen), as its size query answers for the call's cu_seqlens, with
 * stand-ins for the pointers the query checks (placed later). */
static void gdn_prepare(Call *c) {
  size_t ws = 0;
  hl_gdn_bwd_dqkwg_args_t q = *DESC(c, hl_gdn_bwd_dqkwg_args_t);
  void *s = query_scratch(c->cuda);
  if (q.num_seqs) q.cu_seqlens = s;
  if (buf_find(c, "g")) q.g = s, q.dg = s;
  if (buf_find(c, "g_gamma")) q.g_gamma = s;
  if (hl_gdn_bwd_dqkwg_workspace_size(&q, &ws) != HL_STATUS_SUCCESS) die(hl_get_last_error());
  if (!ws) return;
  c->ws_need = ws;
  buf_raw(c, "workspace", R_SCRATCH, EK_BYTES, (int64_t)ws);
}

static hl_status_t gdn_invoke(Call *c) { return hl_gdn_bwd_dqkwg(DP(c, hl_gdn_bwd_dqkwg_args_t), NULL); }
static hl_status_t gdn_alias_invoke(Call *c) { return gdn_bwd_dqkwg(DP(c, hl_gdn_bwd_dqkwg_args_t), NULL); }
static hl_status_t gdn_ws_invoke(Call *c) {
  return hl_gdn_bwd_dqkwg_workspace_size(DP(c, hl_gdn_bwd_dqkwg_args_t), PARAMS(c, BytesParams)->bytes);
}
static hl_status_t gdn_ws_alias_invoke(Call *c) {
  return gdn_bwd_dqkwg_workspace_size(DP(c, hl_gdn_bwd_dqkwg_args_t), PARAMS(c, BytesParams)->bytes);
}

static void gdn_ws_declare(Call *c) {
  gdn_declare(c);
  buf_host(c, "bytes", EK_U64);
}

/* The header's formula per chunk and value head, in fp64. */
static void gdn_check(Call *c, Chk *k) {
  const GdnSpec *s = c->cs->spec;
  const int64_t H = s->H, HV = s->HV, K = s->K, V = s->V, G = HV / H, tok = s->B * s->T;
  const int log2u = s->gate == HL_GDN_GATE_LOG2 || s->gate == HL_GDN_GATE_CONST_DECAY_LOG2;
  const double scale = s->scale != 0 ? s->scale : 1.0 / sqrt((double)K);
  double *dq = dalloc(tok * H * K), *dk = dalloc(tok * H * K), *dw = dalloc(tok * HV * K), *dg = dalloc(tok * HV);
  double *qv = dalloc(CHUNK * K), *kv = dalloc(CHUNK * K), *gam = dalloc(CHUNK), *dgt = dalloc(CHUNK);
  int64_t t0[16], n[16];
  const int64_t nc = gdn_chunks(s, t0, n);
  for (int64_t ch = 0; ch < nc; ++ch)
    for (int64_t hv = 0; hv < HV; ++hv) {
      const int64_t hq = hv / G, N = n[ch], base = t0[ch], hrow = ch * HV + hv;
#define E(x) (log2u ? exp2(x) : exp(x))
#define ST(name, kk, vv) buf_in(c, name, hrow, s->vfirst ? (vv) * K + (kk) : (kk) * V + (vv))
      for (int64_t t = 0; t < N; ++t)
        gam[t] = s->gate == HL_GDN_GATE_NONE ? 0 : buf_find(c, "g") ? buf_in(c, "g", base + t, hv) : buf_in(c, "g_gamma", 0, hv) * (double)(t + 1);
      const double gl = gam[N - 1];
      double dgl = 0;
      for (int64_t kk = 0; kk < K; ++kk)
        for (int64_t vv = 0; vv < V; ++vv) dgl += ST("h", kk, vv) * ST("dh", kk, vv);
      dgl *= E(gl);
      for (int64_t t = 0; t < N; ++t)
        for (int64_t kk = 0; kk < K; ++kk) {
          double a = 0, b = 0, w = 0;
          for (int64_t vv = 0; vv < V; ++vv) {
            a += buf_in(c, "do_", base + t, hv * V + vv) * ST("h", kk, vv);
            b += buf_in(c, "v", base + t, hv * V + vv) * ST("dh", kk, vv);
            if (s->dw) w += buf_in(c, "dv", base + t, hv * V + vv) * ST("h", kk, vv);
          }
          qv[t * K + kk] = a * E(gam[t]) * scale;
          kv[t * K + kk] = b * E(gl - gam[t]);
          dgl += kv[t * K + kk] * buf_in(c, "k", base + t, hq * K + kk);
          dw[(base + t) * HV * K + hv * K + kk] = -w;
        }
      for (int64_t t = 0; t < N; ++t)
        for (int64_t u = 0; u <= t; ++u) {
          double ds = 0;
          for (int64_t vv = 0; vv < V; ++vv) ds += buf_in(c, "do_", base + t, hv * V + vv) * buf_in(c, "v", base + u, hv * V + vv);
          ds *= E(gam[t] - gam[u]) * scale;
          for (int64_t kk = 0; kk < K; ++kk) {
            qv[t * K + kk] += ds * buf_in(c, "k", base + u, hq * K + kk);
            kv[u * K + kk] += ds * buf_in(c, "q", base + t, hq * K + kk);
          }
        }
      for (int64_t t = 0; t < N; ++t) {
        dgt[t] = 0;
        for (int64_t kk = 0; kk < K; ++kk) {
          dgt[t] += qv[t * K + kk] * buf_in(c, "q", base + t, hq * K + kk) - kv[t * K + kk] * buf_in(c, "k", base + t, hq * K + kk);
          dq[(base + t) * H * K + hq * K + kk] += qv[t * K + kk];
          dk[(base + t) * H * K + hq * K + kk] += kv[t * K + kk];
        }
      }
      dgt[N - 1] += dgl;
      for (int64_t t = N - 2; t >= 0 && s->reverse; --t) dgt[t] += dgt[t + 1];
      for (int64_t t = 0; t < N; ++t) dg[(base + t) * HV + hv] = dgt[t];
#undef E
#undef ST
    }
  const double bt = tol_of(HL_DTYPE_BF16);
  chk_mat(k, c, "dq", dq, tok, H * K, bt, bt);
  chk_mat(k, c, "dk", dk, tok, H * K, bt, bt);
  if (s->dw) chk_mat(k, c, "dw", dw, tok, HV * K, bt, bt);
  if (buf_find(c, "dg")) chk_mat(k, c, "dg", dg, tok, HV, 1e-5, 1e-6);
  free(dq), free(dk), free(dw), free(dg), free(qv), free(kv), free(gam), free(dgt);
}

/* The default scale and chunk count spelled out; chunk counts that do not match; gate NONE with the
 * gate's buffers; cu_seqlens that do not start at 0, decrease, or end elsewhere than T. */
static void gdn_extra(Gen *g) {
  const GdnSpec *s = g->cs->spec;
  const int64_t nc = gdn_chunks(s, NULL, NULL);
  char v[48];
  if (s->scale == 0) mut_set(gen_add(g, "scale", "1 / sqrt(K) (its default)", T_MATCH, NULL), "scale", f32_bits((float)(1.0 / sqrt((double)s->K))));
  if (!s->nseqs) mut_set(gen_add(g, "num_chunks", "ceil(T / 64) (its default)", T_MATCH, NULL), "num_chunks", (uint64_t)nc / s->B);
  const int64_t per = s->nseqs ? nc : nc / s->B, wrong[] = {per + 1, per - 1, P2(31), P2(32), HL_MAX_EXTENT};
  for (int i = 0; i < 5; ++i) {
    if (!wrong[i]) continue;
    snprintf(v, sizeof v, "%lld (chunks: %lld)", (long long)wrong[i], (long long)per);
    Mutation *m = gen_add(g, "num_chunks", v, T_FAIL, NULL);
    mut_set(m, "num_chunks", (uint64_t)wrong[i]);
    /* past the CUDA backend's CTA limit its size check refuses it before cu_seqlens is read */
    if (wrong[i] >= P2(31)) m->ok = OK(HL_STATUS_INVALID_VALUE) | OK(HL_STATUS_NOT_SUPPORTED);
  }
  if (s->gate == HL_GDN_GATE_LOG) mut_set(gen_add(g, "gate", "NONE (g and dg passed)", T_FAIL, "gate|g|dg"), "gate", 0);
  if (!s->nseqs) return;
  const struct {
    int64_t at, v;
    const char *what, *needle;
  } cu[] = {{0, 1, "cu_seqlens[0] = 1", NULL}, {1, -1, "cu_seqlens[1] = -1", NULL},
            {1, s->T + 1, "cu_seqlens[1] = T + 1 (then decreasing)", NULL},
            {s->nseqs, s->T - 1, "cu_seqlens[last] = T - 1", NULL}, {s->nseqs, INT32_MAX, "cu_seqlens[last] = INT32_MAX", NULL},
            {1, 64, "cu_seqlens[1] = 64 (fewer chunks than num_chunks)", "num_chunks|cu_seqlens"}};
  for (size_t i = 0; i < sizeof cu / sizeof *cu; ++i) {
    Mutation *m = gen_add(g, "cu_seqlens", cu[i].what, T_FAIL, cu[i].needle);
    Edit *e = mut_edit(m, E_ELEM, "cu_seqlens");
    e->a = cu[i].at, e->bits = (uint64_t)cu[i].v;
  }
}

#define GDN(name, sp, inv, ...)                                                                                  \
  {.entry = name, .label = #sp, .spec = &sp, .family = "gdn", .desc_name = "args", .msg_entry = "hl_gdn_bwd_dqkwg", \
   .desc_size = sizeof(hl_gdn_bwd_dqkwg_args_t), .earlier = kGdnEarlier, .fields = kGdnFields,                   \
   .nfields = NF(kGdnFields), .declare = gdn_declare, .prepare = gdn_prepare, .invoke = inv,  \
   .check = gdn_check, .extra = gdn_extra, __VA_ARGS__}
#define GDN_WS(name, sp, inv, ...)                                                                                \
  {.entry = name, .label = #sp, .spec = &sp, .family = "gdn", .desc_name = "args",                               \
   .msg_entry = "hl_gdn_bwd_dqkwg_workspace_size", .desc_size = sizeof(hl_gdn_bwd_dqkwg_args_t),                  \
   .earlier = kGdnEarlier, .fields = kGdnFields, .nfields = NF(kGdnFields), .params = kBytesParams, .nparams = 1, .query = 1, .declare = gdn_ws_declare, \
   .prepare = gdn_prepare, .invoke = inv, .check = ws_check, __VA_ARGS__}

static const size_t kGdnEarlier[] = {240, 0};
static const Case kGdnCases[] = {
    GDN("hl_gdn_bwd_dqkwg", kGdnLog, gdn_invoke, .forbid = "cu_seqlens"),
    GDN("hl_gdn_bwd_dqkwg", kGdnVarlen, gdn_invoke, .forbid = "dg"),
    GDN("gdn_bwd_dqkwg", kGdnLog, gdn_alias_invoke, .only = "", .extra = NULL),
    GDN_WS("hl_gdn_bwd_dqkwg_workspace_size", kGdnLog, gdn_ws_invoke, .only = "struct_size backend B T H HV K V num_chunks bytes"),
    GDN_WS("hl_gdn_bwd_dqkwg_workspace_size", kGdnVarlen, gdn_ws_invoke, .only = "struct_size B T num_chunks num_seqs bytes"),
    GDN_WS("gdn_bwd_dqkwg_workspace_size", kGdnLog, gdn_ws_alias_invoke, .only = "bytes"),
};

int main(int argc, char **argv) {
  const Case *cases[64];
  int n = 0;
  for (int i = 0; i < NF(kRmsCases); ++i) cases[n++] = &kRmsCases[i];
  for (int i = 0; i < NF(kGdnCases); ++i) cases[n++] = &kGdnCases[i];
  n += loss_cases(cases + n);
  return fuzz_main(argc, argv, cases, n);
}
