/*
 * headloss.h - fused kernels for the language-model head and around it.
 *
 * One C99 header, usable without the CUDA headers. Conventions shared by every call:
 *
 *  - Every function returns an hl_status_t. On failure nothing has been written to any output, and
 *    hl_get_last_error() returns a message that starts with the entry point's name ("hl_rmsnorm_fwd:
 *    ") and names the C field at fault and its value ("x_stride", "labels[3]") (thread-local, valid
 *    until the next call on the same thread). hl_get_error_string() names a status.
 *  - Arguments travel in descriptors whose first member is struct_size: set it to sizeof(the struct)
 *    so that later versions can add fields without breaking callers compiled against this one.
 *    Start from the descriptor's HL_*_INIT macro (or zero it and set struct_size: the same thing),
 *    then fill in what you use. A zero field means its documented default; the INIT macros spell
 *    the defaults out. struct_size is checked: it must be this header's size, an earlier
 *    version's (each descriptor's comment lists them; fields an older descriptor lacks take
 *    their defaults), or a later header's up to HL_MAX_STRUCT_SIZE bytes whose fields this library does
 *    not know are all zero (NOT_SUPPORTED where one is set: a feature this library lacks); anything
 *    else is INVALID_VALUE. Both messages name struct_size.
 *  - Each descriptor names its backend explicitly: HL_BACKEND_CUDA takes device pointers (or managed
 *    memory) and runs asynchronously on the stream passed; HL_BACKEND_CPU takes host pointers, runs
 *    synchronously on the calling thread, accumulates in fp64 and ignores the stream. The CPU backend
 *    is the reference the CUDA kernels are tested against.
 *  - Sizes and strides are int64_t and counted in elements. A row stride of 0 means "packed" (equal
 *    to the number of columns). Zero-size work (no rows or no columns) is a valid no-op.
 *  - Limits: every size, count and stride is at most HL_MAX_EXTENT (2^48 - 1), and every buffer a
 *    call reads or writes spans at most HL_MAX_SPAN_BYTES (2^62) bytes from its pointer without
 *    wrapping the address space ((rows - 1) * stride + cols elements for a matrix). Larger values
 *    are INVALID_VALUE naming the field; all size arithmetic is overflow-checked.
 *  - Enumerations and flag words are checked as integers: an unknown value or bit is
 *    INVALID_VALUE naming the field.
 *  - Buffers: no output may overlap another output or an input, except the in-place pairs each op
 *    lists, and those only exactly (the same pointer, dtype and stride); anything else is
 *    INVALID_VALUE naming both fields. Inputs may overlap one another.
 *  - Results are deterministic: the same inputs give the same bits on every run.
 */
#ifndef HEADLOSS_H_
#define HEADLOSS_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define HL_API __declspec(dllexport)
#else
#define HL_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------------ */
/* Version, status, errors                                                                          */
/* ------------------------------------------------------------------------------------------------ */

#define HL_VERSION_MAJOR 0
#define HL_VERSION_MINOR 7
#define HL_VERSION_PATCH 0
/* HL_VERSION_MAJOR * 10000 + HL_VERSION_MINOR * 100 + HL_VERSION_PATCH */
#define HL_VERSION 700

/* The limits of the conventions above. */
#define HL_MAX_EXTENT ((int64_t)0xFFFFFFFFFFFF)          /* 2^48 - 1: any size, count or stride */
#define HL_MAX_SPAN_BYTES ((int64_t)1 << 62)           /* bytes one buffer may span           */
#define HL_MAX_STRUCT_SIZE 4096                        /* the largest struct_size accepted    */

typedef enum {
  HL_STATUS_SUCCESS = 0,
  HL_STATUS_INVALID_VALUE = 1,          /* a bad argument: null pointer, shape, stride, option    */
  HL_STATUS_NOT_SUPPORTED = 2,          /* valid, but not built in or not available here          */
  HL_STATUS_MISALIGNED = 3,             /* a pointer or stride breaks a documented alignment rule */
  HL_STATUS_INSUFFICIENT_WORKSPACE = 4, /* workspace smaller than the *_workspace_size answer     */
  HL_STATUS_ALLOC_FAILED = 5,           /* host memory allocation failed                          */
  HL_STATUS_CUDA_ERROR = 6,             /* a CUDA runtime call failed; the message has its text   */
  HL_STATUS_NCCL_ERROR = 7,             /* an NCCL call failed; the message has its text          */
  HL_STATUS_INTERNAL_ERROR = 8          /* a bug in headloss: please report the message           */
} hl_status_t;

/* The library's version as HL_VERSION encodes it. Compare with HL_VERSION to detect a mismatch
 * between the header you compiled against and the library you loaded. */
HL_API int hl_get_version(void);

/* A static, human-readable name for a status ("HL_STATUS_INVALID_VALUE: invalid value"). */
HL_API const char *hl_get_error_string(hl_status_t status);

/* The detail of the last failure on this thread ("" after a success). */
HL_API const char *hl_get_last_error(void);

/* ------------------------------------------------------------------------------------------------ */
/* Types shared by every op                                                                         */
/* ------------------------------------------------------------------------------------------------ */

typedef enum {
  HL_DTYPE_NONE = 0,
  HL_DTYPE_F32 = 1,
  HL_DTYPE_F16 = 2,
  HL_DTYPE_BF16 = 3,
  HL_DTYPE_I32 = 4,
  HL_DTYPE_I64 = 5
} hl_dtype_t;

typedef enum {
  HL_BACKEND_CPU = 1, /* host pointers, fp64 reference arithmetic, synchronous */
  HL_BACKEND_CUDA = 2 /* device pointers, asynchronous on the given stream     */
} hl_backend_t;

/* A CUDA stream; identical to cudaStream_t, so a cudaStream_t converts without a cast.
 * NULL is the legacy default stream. */
typedef struct CUstream_st *hl_stream_t;

/* 1 if the backend can run here (for CUDA: the library was built with CUDA and a device is
 * visible), else 0. */
HL_API int hl_backend_is_available(hl_backend_t backend);

/* ------------------------------------------------------------------------------------------------ */
/* RMSNorm                                                                                          */
/* ------------------------------------------------------------------------------------------------ */
/*
 * rstd = 1 / sqrt(mean(s^2) + eps) per row, y = (s * rstd) * (offset + w), with s = x, or s = x + r
 * when a residual r is fused in (then s is also written to residual_out).
 *
 * Casting modes (where rounding happens; statistics always in fp32):
 *   LLAMA: s * rstd is rounded to x's dtype before the weight multiply (Llama, HF default).
 *   GEMMA: everything in fp32, one rounding at the store (use with offset = 1 for Gemma).
 *   NONE:  each step rounded to x's dtype (rstd, s * rstd, offset + w, the product).
 * Without a weight, y = s * rstd whatever the offset (Gemma's norm without a scale; as HF and Liger).
 *
 * Layout: x, residual, residual_out, y are [rows, cols] with their own row strides (elements,
 * 0 = packed); the last dimension is contiguous. residual and residual_out share x's dtype.
 * Any cols and any alignment are accepted; 16-byte aligned pointers with cols and strides that are
 * multiples of 16 bytes take the vectorised path.
 * rstd (fp32, one per row) is written only when the pointer is non-NULL: inference passes NULL
 * and saves the store. In place: y == x and residual_out == residual (either or both; each with
 * its input's dtype and stride) give the same bits as separate buffers on both backends.
 */
typedef enum {
  HL_RMSNORM_CAST_LLAMA = 0,
  HL_RMSNORM_CAST_GEMMA = 1,
  HL_RMSNORM_CAST_NONE = 2
} hl_rmsnorm_cast_t;

typedef struct {
  size_t struct_size; /* sizeof(hl_rmsnorm_fwd_args_t); no earlier size */
  hl_backend_t backend;
  int64_t rows;
  int64_t cols;
  hl_rmsnorm_cast_t cast;
  float eps;
  float offset;

  hl_dtype_t x_dtype; /* F32, F16 or BF16; also residual and residual_out */
  const void *x;
  int64_t x_stride;

  const void *residual; /* optional: s = x + residual */
  int64_t residual_stride;
  void *residual_out; /* required with residual: receives s */
  int64_t residual_out_stride;

  hl_dtype_t weight_dtype; /* F32, F16 or BF16 */
  const void *weight;      /* optional, [cols] */

  hl_dtype_t y_dtype; /* F32, F16 or BF16 */
  void *y;
  int64_t y_stride;

  float *rstd; /* optional, [rows] fp32 */
} hl_rmsnorm_fwd_args_t;

/* No field has a nonzero default: cast LLAMA, eps 0, offset 0, strides packed, rstd not stored. */
#define HL_RMSNORM_FWD_ARGS_INIT { .struct_size = sizeof(hl_rmsnorm_fwd_args_t) }

HL_API hl_status_t hl_rmsnorm_fwd(const hl_rmsnorm_fwd_args_t *args, hl_stream_t stream);

/*
 * Backward of rmsnorm_fwd. With xhat = s * rstd and g = dy * (offset + w) (g = dy without a weight):
 *   dx = rstd * (g - xhat * mean(g * xhat)) + dresidual_out,   dw = sum over rows of dy * xhat
 * (in LLAMA mode xhat is rounded to x's dtype first, as in the forward). dx is the gradient of
 * both x and the fused residual; dresidual_out (optional) is the gradient flowing into
 * residual_out, and dresidual (optional) receives a copy of dx in x's dtype for callers that want
 * two tensors. dw is reduced over rows in fp32 in a fixed order (deterministic) and stored in
 * dw_dtype (F32 or the weight's dtype); with rows = 0 it is written as zeros (the empty sum).
 * rstd may be NULL: it is then recomputed from s and eps.
 * In place: dx == dy (with dy_dtype = x_dtype) and dx == dresidual_out, each with the same
 * stride, give the same bits as separate buffers on both backends.
 * The CUDA backend needs a workspace: ask hl_rmsnorm_bwd_workspace_size with the call's arguments,
 * pointers included (the kernel, and so the size, depends on their alignment). On CUDA,
 * cols <= 2^35 (its tiles of 32 columns in one grid dimension); larger is NOT_SUPPORTED.
 */
typedef struct {
  size_t struct_size; /* sizeof(hl_rmsnorm_bwd_args_t); no earlier size */
  hl_backend_t backend;
  int64_t rows;
  int64_t cols;
  hl_rmsnorm_cast_t cast;
  float eps;    /* used only when rstd is NULL */
  float offset;

  hl_dtype_t x_dtype; /* dtype of x (the forward's s), dresidual_out, dx, dresidual */
  const void *x;      /* the forward's s: x, or x + residual when fused */
  int64_t x_stride;
  const float *rstd;  /* optional, [rows] from the forward */

  hl_dtype_t weight_dtype;
  const void *weight; /* optional, [cols] */

  hl_dtype_t dy_dtype; /* F32, F16 or BF16 */
  const void *dy;
  int64_t dy_stride;

  const void *dresidual_out; /* optional, gradient of residual_out */
  int64_t dresidual_out_stride;

  void *dx;
  int64_t dx_stride;
  void *dresidual; /* optional copy of dx */
  int64_t dresidual_stride;

  hl_dtype_t dw_dtype; /* F32 or weight_dtype; required with a weight */
  void *dw;            /* required with a weight, [cols] */

  void *workspace;
  size_t workspace_bytes;
} hl_rmsnorm_bwd_args_t;

/* No field has a nonzero default (dw_dtype NONE is refused with a weight: name F32 or its dtype). */
#define HL_RMSNORM_BWD_ARGS_INIT { .struct_size = sizeof(hl_rmsnorm_bwd_args_t) }

HL_API hl_status_t hl_rmsnorm_bwd_workspace_size(const hl_rmsnorm_bwd_args_t *args, size_t *bytes);
HL_API hl_status_t hl_rmsnorm_bwd(const hl_rmsnorm_bwd_args_t *args, hl_stream_t stream);

/* ------------------------------------------------------------------------------------------------ */
/* Gated DeltaNet backward: dq, dk, dw, dg of one chunked step                                      */
/* ------------------------------------------------------------------------------------------------ */
/*
 * The chunk_bwd_dqkwg step of the chunked Gated DeltaNet backward (flash-linear-attention's
 * chunk_bwd_kernel_dqkwg), chunk length 64. Per chunk c of n <= 64 rows and value head hv, with
 * q/k head hq = hv / (HV / H), E = exp (or exp2 in log2 units), g the chunk-local cumulative gate
 * and gl = g[n-1]:
 *   ds = do v^T;  dq = do h^T;  dk = v dh^T;  dw = -dv h^T;  dgl = sum(h * dh) E(gl)
 *   dq *= E(g_t) scale;  dk *= E(gl - g_t);  dgl += sum(dk * k)
 *   ds[t,s] = (s <= t < n) ? ds E(g_t - g_s) scale : 0;  dq += ds k;  dk += ds^T q
 *   dg[t] = sum_k dq[t,k] q[t,k] - sum_k dk[t,k] k[t,k];  dg[n-1] += dgl
 * Without a gate E = 1. dg is the gradient w.r.t. the gate in natural-log units in both units
 * (as fla: in log2 units the true d/dg carries a factor ln 2 that the caller's 1/ln 2 scaling of g
 * cancels).
 *
 * GVA (HV a multiple of H): dq, dk have H heads and are the sums over the HV/H value heads sharing
 * a q/k head; dg and dw are per value head, and each value head's dg uses its own contribution to
 * dq, dk (before the sum).
 *
 * Gates: LOG / LOG2 take g [B,T,HV] fp32, already cumulated within each chunk, and produce dg.
 * CONST_DECAY / CONST_DECAY_LOG2 take g_gamma [HV] fp32 with g_t = g_gamma (t + 1), t the row
 * within the chunk (fla's g_gamma; fla 0.6 uses log2 units); as fla, they produce no dg (pass
 * dg = NULL). NONE: no gate, no dg.
 *
 * Layouts (all contiguous, row-major, no strides): q, k, dq, dk [B,T,H,K]; v (the forward's
 * v_new), do, dv [B,T,HV,V]; w, dw [B,T,HV,K]; h, dh [B,NT,HV,K,V] (h: state at the start of each
 * chunk, dh: gradient of the state at its end), or [B,NT,HV,V,K] with HL_GDN_STATE_V_FIRST (fla's
 * state_v_first); g, dg [B,T,HV]. q, k, v, do, dv, dq, dk, dw share
 * one 16-bit dtype (F16 or BF16); h and dh share one dtype, that one or F32 (F32 states are rounded
 * to the 16-bit dtype for the tensor-core products on the CUDA backend). dg is F32.
 * dw is produced when dw is set; it needs dv (w itself is not read: dw does not depend on it).
 *
 * Variable length: cu_seqlens [num_seqs + 1] (I32 or I64) with B = 1, cu_seqlens[0] = 0,
 * non-decreasing, ending at T. Chunks restart at each sequence start; num_chunks (the NT of h, dh)
 * counts chunks of all sequences in order and is required (sum of ceil(len / 64)): it sizes the
 * launch without reading cu_seqlens. The CUDA backend copies cu_seqlens to the host to check it and
 * to build its chunk table in the workspace: a varlen call synchronises the stream once (as fla's
 * prepare_chunk_indices does), unless flags has HL_GDN_UNCHECKED: then the table is built on the
 * device from cu_seqlens as it is (no copy, no check, no synchronisation: CUDA-graph capturable;
 * values outside [previous value, T] are clamped there, so a bad cu_seqlens gives wrong results
 * but no access out of bounds). Without cu_seqlens, num_chunks is ceil(T / 64) (0 = that).
 *
 * K and V: 1..256 each (64, 128 and 256 fastest; other sizes run through zero-padded tiles).
 * reverse_cumsum = 1 writes dg already reverse-cumulated within each chunk (the caller's next
 * step), in fp32. The CUDA backend needs a workspace only for varlen (device memory, 16-byte
 * aligned, as every workspace here): ask gdn_bwd_dqkwg_workspace_size. Results are deterministic (no atomics). Nothing is in place: no
 * output may overlap an input. On CUDA, HV <= 2^31 - 1 and B * num_chunks * H * ceil(K / 64) <=
 * 2^31 - 1 (one CTA each); larger is NOT_SUPPORTED.
 */
typedef enum {
  HL_GDN_GATE_NONE = 0,
  HL_GDN_GATE_LOG = 1,              /* g [B,T,HV], natural-log units: E = exp  */
  HL_GDN_GATE_LOG2 = 2,             /* g [B,T,HV], log2 units: E = exp2        */
  HL_GDN_GATE_CONST_DECAY = 3,      /* g_gamma [HV], natural-log units; no dg  */
  HL_GDN_GATE_CONST_DECAY_LOG2 = 4  /* g_gamma [HV], log2 units (fla); no dg   */
} hl_gdn_gate_t;

/* Options (hl_gdn_bwd_dqkwg_args_t.flags). UNCHECKED: CUDA varlen reads cu_seqlens on the device
 * alone. STATE_V_FIRST: h and dh are [B,NT,HV,V,K] (each state transposed). */
#define HL_GDN_UNCHECKED (1u << 0)
#define HL_GDN_STATE_V_FIRST (1u << 1)

typedef struct {
  size_t struct_size; /* sizeof(hl_gdn_bwd_dqkwg_args_t); earlier: 240 (0.1, before flags) */
  hl_backend_t backend;
  int64_t B, T, H, HV, K, V;
  int64_t num_chunks; /* NT of h and dh; required with cu_seqlens, else 0 or ceil(T / 64) */

  hl_dtype_t dtype;   /* F16 or BF16: q, k, v, do, dv, dq, dk, dw */
  hl_dtype_t h_dtype; /* dtype, or F32: h, dh */
  const void *q, *k, *v, *do_, *h, *dh;
  const void *dv; /* required with dw */
  void *dq, *dk;
  void *dw; /* optional */

  hl_gdn_gate_t gate;
  const float *g;       /* [B,T,HV] with LOG / LOG2 */
  const float *g_gamma; /* [HV] with CONST_DECAY* */
  float *dg;            /* [B,T,HV], required with LOG / LOG2, NULL otherwise */
  int reverse_cumsum;   /* 1: dg reverse-cumulated within each chunk */
  float scale;          /* 0 means 1 / sqrt(K), as fla */

  hl_dtype_t cu_seqlens_dtype; /* I32 or I64 */
  const void *cu_seqlens;      /* optional, [num_seqs + 1], B must be 1 */
  int64_t num_seqs;

  void *workspace;
  size_t workspace_bytes;
  unsigned flags; /* HL_GDN_UNCHECKED, HL_GDN_STATE_V_FIRST */
} hl_gdn_bwd_dqkwg_args_t;

/* No field has a nonzero default: gate NONE, scale 1 / sqrt(K), no flags. */
#define HL_GDN_BWD_DQKWG_ARGS_INIT { .struct_size = sizeof(hl_gdn_bwd_dqkwg_args_t) }

HL_API hl_status_t hl_gdn_bwd_dqkwg_workspace_size(const hl_gdn_bwd_dqkwg_args_t *args, size_t *bytes);
HL_API hl_status_t hl_gdn_bwd_dqkwg(const hl_gdn_bwd_dqkwg_args_t *args, hl_stream_t stream);

/* ------------------------------------------------------------------------------------------------ */
/* Fused LM-head loss plan                                                                          */
/* ------------------------------------------------------------------------------------------------ */
/*
 * One pass of softmax statistics over logits [rows, vocab], then every requested loss, metric,
 * per-token output and one combined gradient. With z_hat = softcap * tanh(logit_scale * z / softcap)
 * (or logit_scale * z without a cap), lse = log sum_j exp(z_hat_j), p = softmax(z_hat), label y:
 *
 *   CE       (1 - eps) (lse - z_hat_y) + eps (lse - mean_j z_hat_j)      (eps = label_smoothing)
 *   Z        lse^2
 *   ENTROPY  H = lse - sum_j p_j z_hat_j   (as a loss: use a negative weight for a bonus)
 *   DISTILL_FWD  KL(q || p_s), DISTILL_REV  KL(p_s || q); q = softmax(teacher / teacher_temperature),
 *            p_s = softmax(z_hat / student_temperature); gradients below (no tau^2 factor)
 *   DISTILL_JSD  generalised JSD (TRL's generalized_jsd_loss, Liger's JSD): with m = (1 - b) p_s + b q,
 *            b = jsd_beta in (0, 1], b KL(q || m) + (1 - b) KL(p_s || m); jsd_beta 0 means 0.5
 *            (TRL's and Liger's default); as TRL, b = 1 is reverse KL (the plan runs DISTILL_REV
 *            there; the formula's own limit is 0), and its b = 0, forward KL, is DISTILL_FWD.
 *            The distillation terms are exclusive.
 *            With a_j = dL/dp_s_j, every divergence's gradient is
 *              d/dz_hat_j = p_s_j (a_j - sum_i p_s_i a_i) / student_temperature,
 *            a_j = -q_j / p_s_j (FWD), log(p_s_j / q_j) + 1 (REV), (1 - b) log(p_s_j / m_j) (JSD).
 *            log m_j does not split into online sums: a dense JSD row takes one more pass over its
 *            columns (sum_j p_s log(p_s / m) and sum_j q log(q / m)) between the statistics and
 *            the gradient; its split (tensor-parallel) execution has a middle step and a second
 *            exchange for them (hl_loss_plan_execute_middle).
 *   GRPO     -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = exp(logp_y - old_logprob);
 *            with dual_clip = c > 1, for A < 0 then min(that, -c A) (dual-clip PPO, as verl's
 *            clip_ratio_c): no gradient where -c A binds (r > c)
 *   CISPO    -sg(min(r, 1 + cispo_eps_high)) A logp_y (MiniMax-M1): the clipped importance weight
 *            is a constant, so d/dz_j = -min(r, 1 + cispo_eps_high) A (delta_jy - p_j); its clip is
 *            an option of its own: an importance-weight truncation is usually wider than PPO's clip
 *   GRPO_KL_REF  KL(new || ref) at the label by kl_estimator, with d = ref - logp_y:
 *            K3 (default) exp(d) - d - 1, K1 -d, K2 d^2 / 2; weighted by kl_ref_beta. Passing
 *            ref_logprobs without this term reports kl_ref_mean alone (a metric; no loss, no
 *            gradient, kl_ref_beta unused)
 *
 * Sparse teacher (teacher_topk = k in [1, 256]): instead of teacher logits, each row passes the
 * teacher's top-k token ids K (teacher_topk_ids, I32 or I64; ids < 0 are padding: a row may have
 * fewer) and their log-probabilities (teacher_topk_logprobs, fp32, as given: teacher_temperature
 * does not apply; student_temperature does). Mass folding by a tail bucket: with
 *   q_k = exp(logprob_k), p_k = p_s at id k,  q_r = max(1 - sum_K q_k, d),  p_r = max(1 - sum_K p_k, d)
 * (d = 2^-24: a floor that keeps 1 / p_r and log q_r finite where the k ids hold all the mass;
 * off by at most ~d |log d| ~ 1e-6 there, exact elsewhere), the divergence (FWD, REV or JSD as
 * above) is that of the two distributions coarsened onto the k ids plus one "rest" outcome. Off K,
 * a_j is the bucket's a_r, so the gradient there is p_s_j (a_r - sum_i p_s_i a_i) / tau_s, one
 * coefficient a row; the k ids get their own a_k. One pass: the k entries' sums are taken once
 * the row's lse is known (no extra pass over the columns). Not chosen: renormalising the
 * teacher's top-k to sum to one (drops the teacher's tail mass), or restricting the student to the
 * top-k support as well (axolotl's top-k KD; the student's mass outside K then gets no gradient).
 * The mean of sum_K q_k is reported (HL_LOSS_OUT_TOPK_MASS). Duplicate ids in a row, ids outside
 * [0, vocab_global) other than padding, and log-probs that are NaN, -inf or > 1e-3 are errors
 * (INVALID_VALUE, nothing written; on CUDA in the label check's synchronisation, which
 * HL_LOSS_UNCHECKED skips; unchecked, an id out of range counts as padding). Sharded plans: ids
 * are global; each rank's record carries the student's z_hat at the row's ids in its shard, so
 * after the one exchange every rank has all k (see hl_loss_plan_execute_stats) and writes the
 * gradient of the ids in its own columns. On CUDA, vocab <= INT_MAX.
 *
 * A row is ignored when its label is negative (this covers the usual -100) or, with
 * use_ignore_index, equal to ignore_index: it contributes to no term and no metric, and its
 * gradient row is zero. Each reported term is sum_t w_t l_t / D (w_t: per-token weight, default 1;
 * D: the divisor, default the sum of valid weights); loss = sum of weight_k * term_k; the gradient
 * row t is (grad_scale / D) w_t d(loss_t)/dz, formed in fp32 and rounded once. Metrics are weighted
 * means over valid rows (sum w x / sum w) or min / max over rows with w > 0.
 * Term weights: 0 means the term's conventional weight: ce_weight 1, z_weight 1e-4 (PaLM's and
 * Liger's), distill_weight 1, grpo_weight 1, cispo_weight 1. ENTROPY and GRPO_KL_REF have no
 * conventional weight (an entropy bonus is negative; KL coefficients run from 1e-3 to 0.04):
 * with those terms entropy_weight / kl_ref_beta must be set (nonzero, finite), else INVALID_VALUE.
 * A term's weight is unused when the term is off. A plan with no term (terms = 0) computes the
 * metrics and per-token outputs alone; it has no gradient (grad modes must be NONE) unless it takes
 * per-token gradients.
 * Per-token gradients (flags HL_LOSS_GRAD_TOKEN_LOGP, _ENTROPY, _LSE; for a caller that forms its
 * own loss from token_logp, token_entropy, token_lse, as RL frameworks do): the call passes the
 * upstream gradients g_logp, g_ent, g_lse [rows] (args.grad_token_*), and the gradient adds the
 * vector-Jacobian product sum_t (g_logp_t dlogp_t + g_ent_t dH_t + g_lse_t dlse_t) / dz, with
 * (w.r.t. z_hat, then through the logit scale and soft cap as the terms' gradient)
 *   dlogp_t / dz_hat_j = [j = y] - p_j,  dH_t / dz_hat_j = p_j (lse - H - z_hat_j),  dlse_t / dz_hat_j = p_j.
 * It is a plain product: neither w_t, D nor grad_scale multiplies it. An ignored row's logp is 0
 * (a constant: its g_logp adds nothing), its entropy and lse are its own (their gradients count,
 * as for any row). With terms = 0 the gradient is the product alone; with terms, the sum of both. A flag needs a gradient (a grad mode); the fused
 * linear form's logits then come again chunk by chunk as for any gradient (a forward-only call,
 * terms = 0 and no gradient, is one product a chunk). Temperature: logit_scale = 1 / T.
 * Sequence-level options (the rows grouped into sequences by args.cu_seqlens, each sequence's
 * "tokens" being its rows that are not ignored; weights do not enter these means):
 *   ratio_level = SEQ_MEAN (GSPO, as verl's gspo loss / GSPO-token): GRPO's and CISPO's r is the
 *            sequence's s = exp(min(mean over its tokens of (logp_y - old_logprob), 10)) for every
 *            token of it, with the token's own gradient (d r / d logp_y = s), so the clip acts per
 *            sequence; the ratio and clip metrics are then sequence-level values, averaged over
 *            tokens. The mean needs every row's logp before any gradient: the plan runs as its
 *            own statistics and finish steps (the tensor-parallel split with one rank; the logits
 *            are read twice, the fused linear form keeps them in a workspace of fast_bytes; dense
 *            DISTILL_JSD adds its middle step)
 * Preference losses (term HL_LOSS_PREFERENCE, desc.preference; TRL's DPO, CPO, ORPO and KTO
 * trainers, Liger's chunked losses): sequence-level, on the rows grouped by args.cu_seqlens. A
 * sequence's log-prob v_s is the sum of logp_y over its tokens (rows not ignored: a prompt's rows
 * carry label -100), or their mean (pref_logp). Paired losses take num_seqs = 2P: sequences
 * [0, P) are the chosen completions, [P, 2P) the rejected ones, pair i = (i, P + i) (TRL's
 * concatenation). args.ref_seq_logprobs [num_seqs] holds the reference's v_s in the same units
 * (DPO and KTO need it; SimPO, ORPO and CPO are reference-free and take none). With b = pref_beta,
 * c, r the pair's v, and u = c - ref_c, l = r - ref_r, x = b (u - l), sigma the logistic function,
 * e = pref_label_smoothing, each pair's loss is (TRL's dpo_loss):
 *   SIGMOID   -(1 - e) log sigma(x) - e log sigma(-x)  (e > 0: cDPO)
 *   HINGE     max(0, 1 - x)
 *   IPO       (u - l - 1 / (2 b))^2                    (mean log-probs by default)
 *   EXO_PAIR  sigma(x) (log sigma(x) - log(1 - e)) + sigma(-x) (log sigma(-x) - log e)  (e = 0: 1e-3)
 *   NCA_PAIR  -log sigma(b u) - log sigma(-b u) / 2 - log sigma(-b l) / 2
 *   ROBUST    (-(1 - e) log sigma(x) + e log sigma(-x)) / (1 - 2 e)
 *   BCO_PAIR  -log sigma(b u) - log sigma(-b l)        (TRL's running-mean shift delta: add
 *             delta / b to both reference log-probs)
 *   SPPO_HARD (u - 1 / (2 b))^2 + (l + 1 / (2 b))^2
 *   APO_ZERO  1 - sigma(b u) + sigma(b l);   APO_DOWN  sigma(b u) + 1 - sigma(x)
 *   DISCOPOP  -log sigma(x) (1 - m) + exp(-x) m,  m = sigma(x / pref_tau)
 * CPO is DPO without a reference (u = c, l = r; TRL's CPO: sums by default); SimPO is SIGMOID at
 * x = b (c - r) - pref_gamma on mean log-probs; ORPO is -b log sigma(o) with the log odds ratio
 * o = c - r - log(1 - e^c) + log(1 - e^r) on mean log-probs. KTO (unpaired: any num_seqs, each
 * sequence's args.kto_labels 1 desirable, 0 undesirable, -1 a completion of TRL's KL batch):
 * z0 = max(0, mean over the KL completions of v_s - ref_s) (0 without any; a constant: no
 * gradient), and a desirable sequence's loss is w_d (1 - sigma(b (v - ref - z0))), an undesirable
 * one's w_u (1 - sigma(b (z0 - v + ref))), averaged over both kinds. The term is the mean over
 * pairs (KTO: over its non-KL sequences), not divided by D nor weighted by w_t; loss adds
 * pref_weight times it, and the gradient grad_scale pref_weight dL/dv_s d v_s / dz: each token of
 * sequence s adds c_s d logp_y / dz (c_s / n_s for a mean), as a per-token upstream gradient.
 * Rewards (the metrics): b u, b l (b c, b r reference-free; KTO b (v - ref)). The NLL of TRL's rpo
 * or ORPO's / CPO's alpha is CE in the same plan, on the chosen tokens: weights w_t = 1 there and
 * 0 on the rejected rows (D, the sum of weights, is then the chosen tokens: TRL's mean). Every
 * v_s needs every row's logp first: the plan runs as GSPO's, statistics then finish (logits read
 * twice; the fused linear form keeps them in a workspace of fast_bytes, else forms them again).
 * num_seqs <= rows. ratio_level SEQ_MEAN is refused with it (both define the sequence sums).
 * Rollout / trainer mismatch (rollout_logprobs: the inference engine's log-probs of the sampled
 * tokens; needs old_logprobs, the trainer's): with d = old_logprob - rollout_logprob and x = d
 * (rollout_level TOKEN), the sum of d over the token's sequence (SEQ_PRODUCT, verl's "sequence")
 * or its mean (SEQ_MEAN, "geometric"), clamped to [-20, 20], rho = exp(x):
 *   TIS    w_is = min(rho, rollout_cap)                              (truncated IS)
 *   MIS    w_is = rho inside [rollout_floor, rollout_cap], else 0     (masked IS, IcePop)
 *   REJECT w_is = 1 inside [rollout_floor, rollout_cap], else 0       (verl's rejection sampling)
 * w_is (a constant) multiplies GRPO's and CISPO's loss and gradient; the other terms and D are
 * unchanged (ms-swift's and slime's convention; verl's rejection also drops those tokens from its
 * token-mean denominator: pass w_t = 0 for them to get that). Metrics: rollout_kl_k1 = mean of
 * -d and rollout_kl_k3 = mean of exp(d) - d - 1 (KL(rollout || old), whenever both log-probs are
 * passed), rollout_weight_mean (of w_is) and rollout_corrected (the fraction truncated / masked).
 * RL loss aggregations are a choice of w and D (the Python package's headloss.aggregation forms
 * them from cu_seqlens): token mean (DAPO) w = 1, D = 0; the mean over sequences of their token
 * means (GRPO) w_t = 1 / (valid tokens of t's sequence), D = sequences; of their token sums w = 1,
 * D = sequences; the token sum over a constant (Dr. GRPO) w = 1, D = the constant.
 *
 * Logits and teacher logits share a dtype (F32, F16, BF16) and have row strides; labels are I32 or
 * I64; weights, advantages, old / reference log-probs and every per-token output are fp32 [rows].
 * The gradient goes to its own buffer or over the logits in place (grad == logits, same dtype and
 * stride, WRITE: the same bits as separate buffers on both backends), in the logits' dtype or F32,
 * written or accumulated (old + new in fp32, one rounding). No other output may be in place; in the
 * fused linear form none is (grad_hidden over hidden would be read after its rows are written).
 * On CUDA every call and size query takes rows <= 2^31 - 1 (the row kernels' counters); larger is
 * NOT_SUPPORTED.
 * Labels that are out of [0, vocab) (of vocab_global for a shard) and not ignored are an error
 * (INVALID_VALUE, nothing written);
 * on CUDA the check costs a stream synchronisation: HL_LOSS_UNCHECKED skips it (then such a
 * row's loss is infinite). Plans are immutable and may be used from several threads at once.
 */
typedef struct hl_loss_plan_st *hl_loss_plan_t;

/* Terms (hl_loss_plan_desc_t.terms), each with its own weight. */
#define HL_LOSS_CE (1u << 0)
#define HL_LOSS_Z (1u << 1)
#define HL_LOSS_ENTROPY (1u << 2)
#define HL_LOSS_DISTILL_FWD (1u << 3) /* forward KL; exclusive with DISTILL_REV */
#define HL_LOSS_DISTILL_REV (1u << 4) /* reverse KL */
#define HL_LOSS_GRPO (1u << 5)
#define HL_LOSS_GRPO_KL_REF (1u << 6)
#define HL_LOSS_CISPO (1u << 7)       /* needs advantages and old_logprobs, as GRPO */
#define HL_LOSS_DISTILL_JSD (1u << 8) /* generalised JSD, jsd_beta; exclusive with FWD / REV */
#define HL_LOSS_PREFERENCE (1u << 9)  /* a sequence-level preference loss (desc.preference) */

/* KL-to-reference estimators (hl_loss_plan_desc_t.kl_estimator), Schulman's k1 / k2 / k3. */
#define HL_LOSS_KL_K3 0
#define HL_LOSS_KL_K1 1
#define HL_LOSS_KL_K2 2

/* Levels of an importance ratio (ratio_level, rollout_level): the token's own, or over its
 * sequence the product (exp of the sum of log-ratios) or the geometric mean (exp of their mean). */
#define HL_LOSS_LEVEL_TOKEN 0
#define HL_LOSS_LEVEL_SEQ_PRODUCT 1
#define HL_LOSS_LEVEL_SEQ_MEAN 2

/* Rollout / trainer mismatch corrections (rollout_correction). */
#define HL_LOSS_ROLLOUT_NONE 0
#define HL_LOSS_ROLLOUT_TIS 1
#define HL_LOSS_ROLLOUT_MIS 2
#define HL_LOSS_ROLLOUT_REJECT 3

/* Preference losses (desc.preference, with the term HL_LOSS_PREFERENCE). */
#define HL_LOSS_PREF_DPO 0
#define HL_LOSS_PREF_SIMPO 1
#define HL_LOSS_PREF_ORPO 2
#define HL_LOSS_PREF_CPO 3
#define HL_LOSS_PREF_KTO 4
/* DPO's and CPO's loss types (desc.pref_loss_type), TRL's loss_type of the same name. */
#define HL_LOSS_DPO_SIGMOID 0
#define HL_LOSS_DPO_HINGE 1
#define HL_LOSS_DPO_IPO 2
#define HL_LOSS_DPO_EXO_PAIR 3
#define HL_LOSS_DPO_NCA_PAIR 4
#define HL_LOSS_DPO_ROBUST 5
#define HL_LOSS_DPO_BCO_PAIR 6
#define HL_LOSS_DPO_SPPO_HARD 7
#define HL_LOSS_DPO_APO_ZERO 8
#define HL_LOSS_DPO_APO_DOWN 9
#define HL_LOSS_DPO_DISCOPOP 10
/* A sequence's log-prob (desc.pref_logp): the sum over its tokens, or their mean (length
 * normalisation). DEFAULT is the loss's convention: MEAN for SimPO, ORPO and IPO, SUM otherwise. */
#define HL_LOSS_SEQ_LOGP_DEFAULT 0
#define HL_LOSS_SEQ_LOGP_SUM 1
#define HL_LOSS_SEQ_LOGP_MEAN 2

/* Options (hl_loss_plan_desc_t.flags). */
/* CUDA: skip the checks of device data that need a stream synchronisation (labels in range, the
 * headers of gathered statistics); execution is then fully asynchronous (CUDA-graph capturable). */
#define HL_LOSS_UNCHECKED (1u << 0)
/* The gradient also takes per-token upstream gradients (see "Per-token gradients" below): calls
 * pass args.grad_token_logp / _entropy / _lse, one flag each. */
#define HL_LOSS_GRAD_TOKEN_LOGP (1u << 1)
#define HL_LOSS_GRAD_TOKEN_ENTROPY (1u << 2)
#define HL_LOSS_GRAD_TOKEN_LSE (1u << 3)
/* Token scaling (0.7, Liger's use_token_scaling): each token's loss and its gradient are multiplied
 * by its own p_y = exp(logp_y), a constant (no gradient flows through it); D, the weights and the
 * metrics are unchanged. Needs labels; terms CE and Z only. */
#define HL_LOSS_TOKEN_SCALING (1u << 4)

typedef enum {
  HL_LOSS_GRAD_NONE = 0,      /* evaluation: no gradient */
  HL_LOSS_GRAD_WRITE = 1,     /* grad = dloss/dlogits */
  HL_LOSS_GRAD_ACCUMULATE = 2 /* grad += dloss/dlogits (sum in fp32, one rounding) */
} hl_loss_grad_mode_t;

typedef struct {
  size_t struct_size; /* sizeof(hl_loss_plan_desc_t); earlier: 128, 136 (0.1), 176 (0.2), 192 (0.3), 232 (0.4 to 0.6) */
  hl_backend_t backend;
  int64_t vocab;           /* columns of the logits */
  hl_dtype_t logits_dtype; /* F32, F16 or BF16; teacher logits share it */
  hl_dtype_t labels_dtype; /* I32 or I64; NONE when no labels are passed */
  unsigned terms;          /* HL_LOSS_CE | ... */
  unsigned flags;          /* HL_LOSS_UNCHECKED, HL_LOSS_GRAD_TOKEN_*, HL_LOSS_TOKEN_SCALING */
  /* Term weights; 0: the term's default (above): 1, 1e-4, none (set it), 1, 1, none (set it). */
  float ce_weight, z_weight, entropy_weight, distill_weight, grpo_weight, kl_ref_beta;
  float label_smoothing;     /* in [0, 1) */
  float logit_scale;         /* 0 means 1 */
  float softcap;             /* 0: no cap */
  float teacher_temperature; /* 0 means 1 */
  float student_temperature; /* 0 means 1 */
  float eps_low, eps_high;   /* GRPO clip range: eps_low in (0, 1), eps_high > 0; 0 means 0.2 */
  int use_ignore_index;      /* 1: labels equal to ignore_index are ignored too (0 or 1) */
  int64_t ignore_index;
  hl_loss_grad_mode_t grad_mode;
  hl_dtype_t grad_dtype;     /* logits_dtype or F32; with a gradient */
  /* Tensor parallelism: this rank's shard is columns [vocab_start, vocab_start + vocab) of a
   * vocabulary of vocab_global columns (0: not sharded), split over `ranks` ranks (0 means 1).
   * See hl_loss_plan_execute_stats. */
  int64_t vocab_start;
  int64_t vocab_global;
  int ranks;
  /* The fused linear form (see below); all zero for the logits form. */
  int64_t hidden;                       /* H > 0: the plan takes hidden states and a weight */
  hl_dtype_t weight_dtype;              /* F32, F16 or BF16: hidden, weight and the teacher's */
  int64_t teacher_hidden;               /* Ht > 0: a teacher of its own hidden states + weight */
  hl_loss_grad_mode_t grad_hidden_mode; /* NONE, WRITE or ACCUMULATE */
  hl_dtype_t grad_hidden_dtype;         /* F32 or weight_dtype (NONE: weight_dtype) */
  hl_loss_grad_mode_t grad_weight_mode; /* NONE, WRITE or ACCUMULATE */
  hl_dtype_t grad_weight_dtype;         /* F32 or weight_dtype (NONE: weight_dtype) */
  /* Policy-gradient options (see the formulas above); zero keeps the plain GRPO / k3 behaviour. */
  float dual_clip;      /* c > 1: GRPO's dual clip for A < 0; 0: off */
  float cispo_weight;   /* 0 means 1 */
  float cispo_eps_high; /* CISPO's upper clip of r is 1 + this; 0 means eps_high (as resolved) */
  int kl_estimator;     /* HL_LOSS_KL_K3 (0), _K1 or _K2 */
  /* Sequence-level and rollout-correction options (see the formulas above); 0 is off. */
  hl_dtype_t cu_seqlens_dtype; /* I32 or I64: args.cu_seqlens is passed; NONE: no sequences */
  int ratio_level;             /* HL_LOSS_LEVEL_TOKEN (0) or _SEQ_MEAN (GSPO; needs sequences) */
  int rollout_correction;      /* HL_LOSS_ROLLOUT_NONE (0), _TIS, _MIS or _REJECT */
  int rollout_level;           /* HL_LOSS_LEVEL_TOKEN (0), _SEQ_PRODUCT or _SEQ_MEAN (sequences) */
  float rollout_cap;           /* TIS's cap, MIS's and REJECT's upper bound; 0 means 2 */
  float rollout_floor;         /* MIS's and REJECT's lower bound; 0 means 1 / rollout_cap */
  /* Distillation options (0.4 too); zero keeps a dense teacher (jsd_beta is unused without JSD). */
  float jsd_beta;                   /* DISTILL_JSD's b in (0, 1]; 0 means 0.5 */
  int teacher_topk;                 /* k in [1, 256]: a sparse teacher (top-k ids and log-probs) */
  hl_dtype_t teacher_topk_ids_dtype; /* I32 or I64, with teacher_topk */
  /* Preference optimisation (0.7), with HL_LOSS_PREFERENCE (see "Preference losses" above);
   * zeros: DPO's sigmoid loss at beta 0.1. Off, every field holds 0. */
  int preference;             /* HL_LOSS_PREF_DPO (0), _SIMPO, _ORPO, _CPO or _KTO */
  int pref_loss_type;         /* HL_LOSS_DPO_* for DPO and CPO; 0: sigmoid */
  int pref_logp;              /* HL_LOSS_SEQ_LOGP_*: the sequences' log-prob, sum or mean */
  float pref_weight;          /* the term's weight; 0 means 1 */
  float pref_beta;            /* 0 means 0.1 (TRL's DPO, CPO, ORPO, KTO; Liger's SimPO) */
  float pref_gamma;           /* SimPO's margin, as given (TRL's and Liger's default: 0.5) */
  float pref_label_smoothing; /* in [0, 0.5): cDPO / robust / exo_pair (0 there: 1e-3), SimPO, CPO */
  float pref_tau;             /* DiscoPOP's tau; 0 means 0.05 */
  float kto_desirable_weight, kto_undesirable_weight; /* KTO's; 0 means 1 */
  /* The fused linear form's bias gradient (0.7): grad_bias = the column sums of G [vocab]. */
  hl_loss_grad_mode_t grad_bias_mode; /* NONE, WRITE or ACCUMULATE */
  hl_dtype_t grad_bias_dtype;         /* F32 or weight_dtype (NONE: weight_dtype) */
} hl_loss_plan_desc_t;

/* The defaults a zero field stands for, spelled out (derived ones stay 0: vocab_global = vocab,
 * ranks 1, cispo_eps_high = eps_high, rollout_floor = 1 / rollout_cap). An option's field may hold
 * its default while the option is off (rollout_cap without a correction, jsd_beta without JSD);
 * any other value there is refused, as a setting that would do nothing. */
#define HL_LOSS_PLAN_DESC_INIT                                                                      \
  { .struct_size = sizeof(hl_loss_plan_desc_t), .ce_weight = 1.0f, .z_weight = 1e-4f,              \
    .distill_weight = 1.0f, .grpo_weight = 1.0f, .logit_scale = 1.0f, .teacher_temperature = 1.0f, \
    .student_temperature = 1.0f, .eps_low = 0.2f, .eps_high = 0.2f, .cispo_weight = 1.0f,          \
    .rollout_cap = 2.0f, .jsd_beta = 0.5f }

/* Indices of hl_loss_args_t.scalars. A metric whose inputs were not passed is 0. */
typedef enum {
  HL_LOSS_OUT_LOSS = 0,      /* sum of weight_k * term_k */
  HL_LOSS_OUT_CE,            /* each term: sum_t w_t l_t / D */
  HL_LOSS_OUT_Z,
  HL_LOSS_OUT_ENTROPY,
  HL_LOSS_OUT_DISTILL,
  HL_LOSS_OUT_GRPO,
  HL_LOSS_OUT_KL_REF,
  HL_LOSS_OUT_DIVISOR,       /* D as used */
  HL_LOSS_OUT_WEIGHT_SUM,    /* sum of w over valid rows */
  HL_LOSS_OUT_VALID_ROWS,    /* rows not ignored */
  HL_LOSS_OUT_LSE_MEAN,      /* weighted means over valid rows: */
  HL_LOSS_OUT_ENTROPY_MEAN,
  HL_LOSS_OUT_LOGP_MEAN,     /* needs labels */
  HL_LOSS_OUT_ACCURACY,      /* argmax (first maximal column) == label; needs labels */
  HL_LOSS_OUT_RATIO_MEAN,    /* needs old_logprobs */
  HL_LOSS_OUT_RATIO_MIN,
  HL_LOSS_OUT_RATIO_MAX,
  HL_LOSS_OUT_CLIP_LOW,      /* fraction with A < 0 and r < 1 - eps_low; needs advantages too */
  HL_LOSS_OUT_CLIP_HIGH,     /* fraction with A > 0 and r > 1 + eps_high */
  HL_LOSS_OUT_CLIP_ANY,      /* fraction with r outside [1 - eps_low, 1 + eps_high] */
  HL_LOSS_OUT_K3_OLD,        /* mean of r - log r - 1, KL(old || new) */
  HL_LOSS_OUT_KL_REF_MEAN,   /* needs ref_logprobs; by kl_estimator */
  HL_LOSS_OUT_ADV_MEAN,      /* needs advantages */
  HL_LOSS_OUT_ADV_MIN,
  HL_LOSS_OUT_ADV_MAX,
  HL_LOSS_OUT_DISTILL_KL_MEAN, /* needs a teacher and a distillation term */
  HL_LOSS_OUT_CISPO,         /* the CISPO term */
  HL_LOSS_OUT_DUAL_CLIP,     /* fraction where the dual clip binds (A < 0, r > dual_clip) */
  HL_LOSS_OUT_ROLLOUT_KL_K1, /* needs rollout_logprobs and old_logprobs: mean of -d */
  HL_LOSS_OUT_ROLLOUT_KL_K3, /* mean of exp(d) - d - 1 */
  HL_LOSS_OUT_ROLLOUT_WEIGHT_MEAN, /* mean of w_is (with a rollout correction) */
  HL_LOSS_OUT_ROLLOUT_CORRECTED,   /* fraction with w_is != rho: truncated (TIS), masked (MIS, REJECT) */
  HL_LOSS_OUT_TOPK_MASS,     /* mean teacher mass the top-k covers, sum_K q_k; sparse teacher */
  /* The preference term and TRL's metrics (0.7; "Preference losses" above). The NLL is ce. */
  HL_LOSS_OUT_PREFERENCE,       /* the preference term: mean over pairs (KTO: sequences) */
  HL_LOSS_OUT_REWARDS_CHOSEN,   /* means over chosen (desirable) sequences of the reward */
  HL_LOSS_OUT_REWARDS_REJECTED, /* ... over rejected (undesirable) ones */
  HL_LOSS_OUT_REWARDS_ACCURACY, /* fraction of pairs whose chosen reward beats the rejected's */
  HL_LOSS_OUT_REWARDS_MARGIN,   /* rewards_chosen - rewards_rejected */
  HL_LOSS_OUT_LOGPS_CHOSEN,     /* mean sequence log-prob (sum or mean, as the loss uses it) */
  HL_LOSS_OUT_LOGPS_REJECTED,
  HL_LOSS_OUT_LOG_ODDS_RATIO,   /* ORPO: mean log sigmoid(log odds ratio) */
  HL_LOSS_OUT_LOG_ODDS_CHOSEN,  /* ORPO: mean log odds ratio */
  HL_LOSS_OUT_KTO_KL,           /* KTO: the KL baseline z0 */
  HL_LOSS_NUM_SCALARS
} hl_loss_scalar_t;

/* The name of scalar `index` ("loss", "ce", ..., "topk_mass": the enumerator's suffix in lower
 * case), or NULL outside [0, HL_LOSS_NUM_SCALARS). */
HL_API const char *hl_loss_scalar_name(int index);

typedef struct {
  size_t struct_size; /* sizeof(hl_loss_args_t); earlier: 160 (0.1), 256 (0.2, 0.3), 312 (0.4, 0.5), 336 (0.6) */
  int64_t rows;
  const void *logits; /* [rows, vocab] */
  int64_t logits_stride;
  const void *labels;  /* [rows]; required by CE, GRPO, CISPO, GRPO_KL_REF; NULL: every row valid */
  const float *weights; /* optional [rows] */
  const void *teacher_logits; /* [rows, vocab], required by distillation */
  int64_t teacher_stride;
  const float *advantages;   /* [rows], required by GRPO and CISPO */
  const float *old_logprobs; /* [rows], required by GRPO and CISPO */
  const float *ref_logprobs; /* [rows], required by GRPO_KL_REF (else optional: kl_ref_mean) */
  double divisor;     /* D; 0: the sum of valid weights */
  float grad_scale;   /* 0 means 1 */
  void *grad;         /* [rows, vocab] in grad_dtype; required with a gradient */
  int64_t grad_stride;
  float *scalars;     /* optional [HL_LOSS_NUM_SCALARS]; a plan whose descriptor is an older
                         header's writes the scalars that header had: 26 if it ends before
                         kl_estimator (0.2), 28 if before cu_seqlens_dtype (0.3), 33 if
                         before preference (0.4 to 0.6) */
  float *token_loss;  /* optional [rows]: sum_k weight_k l_k (unweighted by w_t, D); 0 if ignored */
  float *token_logp;  /* optional [rows]: z_hat_y - lse; 0 if ignored */
  float *token_entropy; /* optional [rows] */
  float *token_lse;     /* optional [rows] */
  /* The fused linear form: these instead of logits and grad (which stay NULL). */
  const void *hidden;          /* [rows, hidden] */
  int64_t hidden_stride;
  const void *weight;          /* [vocab, hidden]: the head's rows (nn.Linear.weight), a shard's */
  int64_t weight_stride;
  const void *teacher_hidden;  /* [rows, teacher_hidden], with teacher_weight: distillation */
  int64_t teacher_hidden_stride;
  const void *teacher_weight;  /* [vocab, teacher_hidden] */
  int64_t teacher_weight_stride;
  void *grad_hidden;           /* [rows, hidden] in grad_hidden_dtype; with grad_hidden_mode */
  int64_t grad_hidden_stride;
  void *grad_weight;           /* [vocab, hidden] in grad_weight_dtype; with grad_weight_mode */
  int64_t grad_weight_stride;
  /* Sequences and the rollout's log-probs (see the plan's sequence and rollout options). */
  const void *cu_seqlens;          /* [num_seqs + 1] in cu_seqlens_dtype: 0, ..., rows (non-decreasing) */
  int64_t num_seqs;
  const float *rollout_logprobs;   /* [rows]; needed by a rollout correction, else optional (metrics) */
  /* A sparse teacher (desc.teacher_topk = k > 0) instead of teacher logits; strides 0: k. */
  const void *teacher_topk_ids;        /* [rows, k] global ids in teacher_topk_ids_dtype; < 0: padding */
  int64_t teacher_topk_ids_stride;
  const float *teacher_topk_logprobs;  /* [rows, k] the teacher's log-probs of those ids */
  int64_t teacher_topk_logprobs_stride;
  /* Per-token upstream gradients (0.6), [rows] each, with the plan's HL_LOSS_GRAD_TOKEN_* flag. */
  const float *grad_token_logp;
  const float *grad_token_entropy;
  const float *grad_token_lse;
  /* Preference optimisation (0.7), [num_seqs] each (see "Preference losses"). */
  const float *ref_seq_logprobs; /* the reference's sequence log-probs, in the policy's units */
  const int32_t *kto_labels;     /* KTO: 1 desirable, 0 undesirable, -1 a KL completion */
  /* 0.7. The fused linear form's head bias: z = X W^T + b (b [vocab] in weight_dtype, a shard's
   * columns for a shard; on CUDA 16-byte aligned), and its gradient (desc.grad_bias_mode). */
  const void *bias;
  void *grad_bias;      /* [vocab] in grad_bias_dtype */
  int64_t *token_argmax; /* optional [rows]: the first column of the row's largest logit (a global
                            id), ignored rows too */
} hl_loss_args_t;

/* No field has a nonzero default: divisor 0 (the sum of valid weights), grad_scale 0 (1). */
#define HL_LOSS_ARGS_INIT { .struct_size = sizeof(hl_loss_args_t) }

/*
 * The fused linear form (desc.hidden = H > 0): the plan takes the hidden states X [rows, H] and
 * the head's weight W [vocab, H] (vocabulary rows, as nn.Linear.weight) instead of logits; the
 * logits z = X W^T exist only a chunk of rows at a time, in the workspace: nothing of rows x vocab
 * elements is allocated. Every term, metric and per-token output is the one above, on those
 * logits. With G [rows, vocab] the gradient the logits form would write (w.r.t. the raw logits):
 *   grad_hidden = G W     [rows, H]     (desc.grad_hidden_mode: NONE, WRITE or ACCUMULATE)
 *   grad_weight = G^T X   [vocab, H]    (desc.grad_weight_mode: likewise)
 * each in F32 or weight_dtype; desc.grad_mode must be NONE (no logits gradient is stored) and
 * logits_dtype NONE or weight_dtype. With WRITE, grad_weight is written whole, zeros for rows = 0.
 * A head bias (0.7, args.bias [vocab]) makes the logits z = X W^T + b; grad_bias = the column sums
 * of G [vocab] (desc.grad_bias_mode, in F32 or weight_dtype; summed in fp32 in a fixed order,
 * rounded once), whether or not the call passes a bias. The logits form has no bias of its own:
 * its logits already hold one, and the column sums of its grad are the bias's gradient.
 * Distillation takes teacher logits [rows, vocab] as in the logits form, or, with
 * desc.teacher_hidden = Ht > 0, a teacher of its own: teacher_hidden [rows, Ht] and teacher_weight
 * [vocab, Ht] in weight_dtype (no gradient), whose logits are formed chunk by chunk the same way.
 *
 * Precision. CUDA: the products run on cuBLASLt, loaded at plan creation ($HL_CUBLASLT_LIBRARY,
 * else libcublasLt.so.13), with fp32 accumulation and deterministic algorithms chosen once per
 * shape. Between the products a chunk's logits are stored in weight_dtype (rounded once from fp32,
 * as a 16-bit matmul's output is), the loss math runs on them in fp32, and G is rounded once to
 * weight_dtype, the products' operand type. Except on a 9.0 GPU (H100, H200) with BF16 hidden and
 * weight (row strides of multiples of 8 elements, 16-byte aligned) for a plan without ENTROPY,
 * distillation, label smoothing, soft cap or GSPO's sequence ratio, and a call without bias or
 * grad_bias (sharded or not): there the
 * logits are never stored. The first product (the library's own kernel) keeps them in fp32 and stores
 * e = exp(z_hat - s_r) in BF16, with s_r a shift per row (16, or the row's max where its max lies
 * outside [s_r - 64, s_r + 48]: those rows' blocks run the product again), and the loss's
 * statistics of the fp32 logits; the gradient is then alpha_r e (the label's element replaced by
 * G's own, formed in fp32), so grad_hidden = alpha (e W) (fp32, rounded once) and grad_weight =
 * e^T (alpha X) (alpha X rounded once to BF16) run on cuBLASLt without a pass over the logits.
 * grad_weight sums over rows chunk by chunk: in F32 the
 * sum stays fp32; in weight_dtype it is rounded once a chunk. So results depend on the chunking
 * (the workspace passed), never on the run. CPU: everything in fp64 with one rounding at each
 * store, no rounding between the products: the reference.
 *
 * Workspace. The CUDA linear form runs chunks of as many rows as the workspace holds: any size
 * from min_bytes (hl_loss_plan_get_workspace_sizes: one row) works, and up to fast_bytes more is
 * faster (fewer passes over grad_weight). Below fast_bytes an eighth of what passes one row (at
 * most 32 MiB) goes to cuBLASLt's own workspace, whose split-K algorithms it enables.
 *
 * Tensor parallelism: W sharded by vocabulary rows (vocab = the shard's rows, vocab_start etc. as
 * for logits); the same stats / gather / finish protocol, one all-gather for the loss. Give stats
 * (and middle) and finish the same workspace (hl_loss_plan_execute_stats_ws): when it holds every row's logits
 * (fast_bytes of a sharded plan), finish reuses them (three products in all; on the shifted path
 * above, e, its statistics and each row's shift, which are this rank's own); otherwise finish
 * forms them again (four). grad_hidden is then this rank's part, G_shard W_shard (added to the
 * buffer with ACCUMULATE): the sum over ranks is the gradient, one all-reduce, the collective every
 * tensor-parallel linear layer has. hl_loss_plan_execute_nccl does it: after the finish, an
 * in-place all-reduce of grad_hidden (which must be packed); with ACCUMULATE rank 0 adds its part
 * to what its buffer holds and the other ranks overwrite theirs, so every rank ends with the old
 * value plus the sum where the ranks' buffers held the same (replicated) values. Collectives a
 * step: 1 all-gather (rows x record bytes a rank; dense JSD: 2) + 1 all-reduce of grad_hidden.
 */

/* Validates the description once and picks a specialised kernel (the fused linear form on CUDA
 * also loads cuBLASLt here: NOT_SUPPORTED with the reason where it cannot). */
HL_API hl_status_t hl_loss_plan_create(const hl_loss_plan_desc_t *desc, hl_loss_plan_t *plan);
/* Workspace bounds for executing on `rows` rows: *min_bytes, the least any execution accepts, and
 * *fast_bytes, the size it runs fastest with (at most HL_MAX_SPAN_BYTES; either pointer may be
 * NULL). 0 on the CPU backend; INVALID_VALUE naming rows where min_bytes would pass
 * HL_MAX_SPAN_BYTES.
 * On CUDA the workspace holds per-row records and, for a plan with ranks > 1, the gathered
 * statistics (dense JSD: and middle blocks) of hl_loss_plan_execute_nccl; the logits form needs
 * one size (min = fast), the fused linear form also its chunks of logits. */
HL_API hl_status_t hl_loss_plan_get_workspace_sizes(hl_loss_plan_t plan, int64_t rows,
                                                    size_t *min_bytes, size_t *fast_bytes);
/* fast_bytes of hl_loss_plan_get_workspace_sizes. */
HL_API hl_status_t hl_loss_plan_get_workspace_size(hl_loss_plan_t plan, int64_t rows, size_t *bytes);
/* workspace: device memory (CUDA), 16-byte aligned, at least min_bytes; NULL if 0. */
HL_API hl_status_t hl_loss_plan_execute(hl_loss_plan_t plan, const hl_loss_args_t *args,
                                        void *workspace, size_t workspace_bytes, hl_stream_t stream);
HL_API hl_status_t hl_loss_plan_destroy(hl_loss_plan_t plan);

/*
 * Tensor parallelism: the vocabulary sharded over ranks, one collective per step.
 * Each rank creates the plan for its shard (vocab_start, vocab = its columns, vocab_global, ranks;
 * labels are global ids; every other field the same on every rank) and, for each batch, with the
 * same hl_loss_args_t for both calls (its logits, teacher logits and gradient are the shard's
 * columns):
 *   1. hl_loss_plan_execute_stats writes this rank's block of per-row statistics (it reads the
 *      logits, labels and teacher logits only);
 *   2. the caller all-gathers the blocks into one buffer on every rank (NCCL, torch.distributed,
 *      jax.lax.all_gather, ...): one collective of ranks * block bytes;
 *   3. hl_loss_plan_execute_finish merges the blocks row by row, exactly (log-sum-exp rescaling),
 *      in an order fixed by their places in the buffer, then writes the scalars and per-token
 *      outputs (the same bits on every rank) and this rank's gradient slice.
 * hl_loss_plan_execute_nccl does the three steps on a communicator the caller owns.
 *
 * Dense DISTILL_JSD needs two exchanges (hl_loss_plan_get_exchanges answers 2; every other plan
 * 1): its sums of log m over the row need the row's merged statistics first. Between steps 2
 * and 3:
 *   2a. hl_loss_plan_execute_middle merges the gathered blocks as finish does and writes this
 *       rank's middle block: per row sum_j (b q_j log(q_j / m_j) + (1 - b) p_j log(p_j / m_j))
 *       and sum_j (1 - b) p_j log(p_j / m_j) over its columns;
 *   2b. the caller all-gathers the middle blocks into a second buffer (any rank order);
 *   3.  hl_loss_plan_execute_finish_with_middle, with both buffers, adds the ranks' middle sums
 *       in their buffer order (the same bits on every rank) and finishes as
 *       hl_loss_plan_execute_finish.
 * hl_loss_plan_execute_finish refuses such a plan, and _middle / _finish_with_middle a plan of one
 * exchange (INVALID_VALUE, nothing written). hl_loss_plan_execute_nccl does all of it (two all-gathers).
 *
 * A block is hl_loss_plan_get_stats_size(plan, rows) bytes, in the plan's backend memory: a 64-byte
 * header of int64 fields (format tag 0x31534c48 "HLS1", a fingerprint of the plan, rows,
 * vocab_start, vocab, vocab_global, record bytes, 0), then one record per row: max z_hat, sum e,
 * sum e (z_hat - max), sum z_hat, the label's z_hat (-inf where another shard owns the label), the
 * argmax's global column (int64), and with distillation the teacher's max and sums and the
 * student-temperature sums (e = exp(z_hat - max)); with a sparse teacher then the student's z_hat
 * at each of the row's k ids, -inf at the ids of other shards and padding (the merge takes the
 * max: the owner's value). Records are fp64 on the CPU backend (104 bytes, + 8 k with a sparse
 * teacher); fp32 on CUDA (32 bytes, 64 with distillation, + 4 k rounded up to a multiple of 8
 * with a sparse teacher), so ranks of one plan share a backend. A middle block
 * (hl_loss_plan_get_middle_size) has the same header with tag 0x314d4c48 "HLM1", then the row's
 * two sums (fp64 on the CPU, fp32 on CUDA).
 * finish refuses (INVALID_VALUE, nothing written) blocks that disagree with the plan or the rows,
 * whose reserved 8th header word is not 0, a buffer smaller than ranks blocks, and shards that do
 * not tile [0, vocab_global) (middle and finish_with_middle check both kinds of blocks so). The
 * records themselves are used as given: NaN, infinite or non-positive sums there are not checked
 * and flow into the results. On CUDA finish reads the headers with one stream synchronisation
 * (with the label check), which HL_LOSS_UNCHECKED skips. The workspace of middle and finish is as
 * for hl_loss_plan_execute.
 */
HL_API hl_status_t hl_loss_plan_get_stats_size(hl_loss_plan_t plan, int64_t rows, size_t *bytes);
HL_API hl_status_t hl_loss_plan_execute_stats(hl_loss_plan_t plan, const hl_loss_args_t *args,
                                              void *stats, size_t stats_bytes, hl_stream_t stream);
/* The statistics step with a workspace: what the fused linear form needs on CUDA (its chunks of
 * logits; pass the finish the same workspace, unchanged in between). With no workspace it is
 * hl_loss_plan_execute_stats. */
HL_API hl_status_t hl_loss_plan_execute_stats_ws(hl_loss_plan_t plan, const hl_loss_args_t *args,
                                                 void *stats, size_t stats_bytes, void *workspace,
                                                 size_t workspace_bytes, hl_stream_t stream);
HL_API hl_status_t hl_loss_plan_execute_finish(hl_loss_plan_t plan, const hl_loss_args_t *args,
                                               const void *gathered, size_t gathered_bytes,
                                               void *workspace, size_t workspace_bytes,
                                               hl_stream_t stream);
/* 1, or 2 for a plan with a middle step (dense DISTILL_JSD). */
HL_API hl_status_t hl_loss_plan_get_exchanges(hl_loss_plan_t plan, int *exchanges);
/* Bytes of one rank's middle block (a plan of two exchanges). */
HL_API hl_status_t hl_loss_plan_get_middle_size(hl_loss_plan_t plan, int64_t rows, size_t *bytes);
/* Step 2a: reads the gathered blocks, the logits and teacher logits (as stats: the same args). */
HL_API hl_status_t hl_loss_plan_execute_middle(hl_loss_plan_t plan, const hl_loss_args_t *args,
                                               const void *gathered, size_t gathered_bytes,
                                               void *middle, size_t middle_bytes, void *workspace,
                                               size_t workspace_bytes, hl_stream_t stream);
/* Step 3 of a plan of two exchanges: gathered_middle holds the ranks' middle blocks. */
HL_API hl_status_t hl_loss_plan_execute_finish_with_middle(hl_loss_plan_t plan,
                                                           const hl_loss_args_t *args,
                                                           const void *gathered, size_t gathered_bytes,
                                                           const void *gathered_middle,
                                                           size_t gathered_middle_bytes,
                                                           void *workspace, size_t workspace_bytes,
                                                           hl_stream_t stream);
/*
 * The three steps on the caller's NCCL communicator (an ncclComm_t passed as void*, of `ranks`
 * ranks; the library never creates, aborts or destroys it): statistics into this rank's slot of
 * the workspace, one in-place ncclAllGather, finish; all on `stream`, which must be one the
 * communicator may use. Needs a CUDA plan. NCCL is loaded at the first call (dlopen of
 * $HL_NCCL_LIBRARY, else libnccl.so.2): where it is absent, HL_STATUS_NOT_SUPPORTED with the reason.
 * Like any NCCL collective, every rank must make this call.
 */
HL_API hl_status_t hl_loss_plan_execute_nccl(hl_loss_plan_t plan, const hl_loss_args_t *args,
                                             void *nccl_comm, void *workspace,
                                             size_t workspace_bytes, hl_stream_t stream);

/* ------------------------------------------------------------------------------------------------ */
/* Names before 0.5, kept as aliases of the hl_-prefixed entry points                               */
/* ------------------------------------------------------------------------------------------------ */

HL_API hl_status_t rmsnorm_fwd(const hl_rmsnorm_fwd_args_t *args, hl_stream_t stream);
HL_API hl_status_t rmsnorm_bwd_workspace_size(const hl_rmsnorm_bwd_args_t *args, size_t *bytes);
HL_API hl_status_t rmsnorm_bwd(const hl_rmsnorm_bwd_args_t *args, hl_stream_t stream);
HL_API hl_status_t gdn_bwd_dqkwg_workspace_size(const hl_gdn_bwd_dqkwg_args_t *args, size_t *bytes);
HL_API hl_status_t gdn_bwd_dqkwg(const hl_gdn_bwd_dqkwg_args_t *args, hl_stream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* HEADLOSS_H_ */
