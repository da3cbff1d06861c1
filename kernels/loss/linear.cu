// The fused linear form on CUDA. A call's rows run in chunks of as many rows as the workspace
// holds; for each chunk the logits (and a fused teacher's) are formed by one product each into the
// workspace, the row kernel runs over them as over any logits (statistics, and the gradient G
// written over them in place), then grad_hidden = G W for the chunk's rows and grad_weight += G^T X.
// The prep kernel runs once before the first chunk (D over every row), the reduce kernel once
// after the last, so the scalars are those of the whole call. A bias rides on the logits' product
// (cuBLASLt's bias epilogue); grad_bias sums G's columns a chunk at a time (bias.h).
//
// The products, column-major as cuBLASLt sees our row-major data (a row-major [r, c] matrix with
// row stride ld is the column-major [c, r] one with leading dimension ld):
//   logits^T [V, n] = W [V, H] X^T [H, n]     A = W (transposed), B = X
//   dX^T     [H, n] = W^T [H, V] G^T [V, n]   A = W, B = G
//   dW^T     [H, V] = X^T [H, n] G [n, V]     A = X, B = G (transposed)
#include <algorithm>
#include <type_traits>

#include "common/cuda_util.h"
#include "loss/bias.h"
#include "loss/config.h"
#include "loss/cuda_plan.h"
#include "loss/gemm.h"
#include "loss/shifted.h"
#include "loss/steps.h"

namespace hl::loss::dev {
namespace {

// Where a call's pieces live in the workspace, after the logits form's part (base). The teacher's
// chunk (or the shifted path's buffers) start 256-byte aligned after the logits': kSlack bytes
// cover that rounding.
constexpr size_t kSlack = 256;
struct Layout {
  int64_t ldz, ldt;      // row strides of the logits and teacher chunks (16-byte multiples)
  size_t bias;           // grad_bias's sums (bias.h), with a grad_bias_mode
  size_t gemm, gemm_bytes, logits, teacher;  // cuBLASLt's workspace (offset, size), the chunks' offsets
  size_t row_bytes;      // a chunk's bytes per row
  size_t fixed;          // bytes before the first row's (base, cuBLASLt's, the alignments)
  int64_t chunk;         // rows a chunk (at most the call's)
  bool keep;             // every row fits: a split's finish reuses its statistics step's logits
};

// bytes: the workspace passed; 0 lays out the least one (one row, no cuBLASLt workspace). logits:
// the chunks hold the logits (or E); a shifted call without gradient needs its statistics alone.
Layout layout(const hl_loss_plan_st &p, int64_t rows, size_t bytes, bool logits = true) {
  const hl_loss_plan_desc_t &d = p.desc;
  const size_t elt = dtype_size(d.weight_dtype);
  Layout L;
  L.ldz = int64_t(round_up(size_t(d.vocab), 16 / elt));
  L.ldt = d.teacher_hidden > 0 ? L.ldz : 0;
  const bool shifted = p.cuda->shifted;  // room for its buffers (shifted.h), after the logits
  L.row_bytes = size_t((logits ? L.ldz : 0) + L.ldt) * elt + (shifted ? shifted_row_bytes(p) : 0);
  L.bias = round_up(cuda_base_workspace(p, rows), 256);  // saturated sizes stay so (refused)
  L.gemm = round_up(sat_add(L.bias, d.grad_bias_mode ? bias_workspace(d.vocab) : 0), 256);
  // past the base, the slack and one row (so that a workspace of min_bytes holds one row)
  const size_t slack = kSlack + (shifted ? kShiftedSlack : 0), least = sat_add(sat_add(L.gemm, slack), L.row_bytes);
  const size_t spare = bytes > least ? bytes - least : 0;
  const bool every_row = spare >= sat_add(kGemmWorkspace, sat_mul(size_t(rows - 1), L.row_bytes));
  L.gemm_bytes = every_row ? kGemmWorkspace : std::min(kGemmWorkspace, spare / kGemmShare / 256 * 256);
  L.logits = sat_add(L.gemm, L.gemm_bytes);
  L.fixed = sat_add(L.logits, slack);
  const int64_t fit = bytes > L.fixed ? int64_t((bytes - L.fixed) / L.row_bytes) : 0;
  L.keep = fit >= rows;
  L.chunk = std::min(rows, fit);
  L.teacher = L.logits + (logits ? round_up(size_t(L.chunk * L.ldz) * elt, 256) : 0);
  return L;
}

// Row pointer i of a [rows, cols] matrix with row stride ld (elements).
template <class P>
P row(P base, int64_t i, int64_t ld, hl_dtype_t dt) {
  using B = std::conditional_t<std::is_const_v<std::remove_pointer_t<P>>, const char *, char *>;
  return base ? P(B(base) + size_t(i) * size_t(ld) * dtype_size(dt)) : base;
}

// The arguments of rows [i0, i0 + n) as the row kernel sees them: logits (and a fused teacher's)
// from the chunks in the workspace, the gradient over the logits, per-row inputs and outputs
// from the call's.
hl_loss_args_t chunk_args(const hl_loss_plan_st &p, const hl_loss_args_t &a, int64_t i0, int64_t n,
                          void *z, void *t, const Layout &L) {
  const hl_loss_plan_desc_t &d = p.desc;
  hl_loss_args_t c = a;
  c.rows = n;
  c.logits = z, c.logits_stride = L.ldz;
  c.grad = p.dlogits ? z : nullptr, c.grad_stride = L.ldz;
  if (d.teacher_hidden > 0) c.teacher_logits = t, c.teacher_stride = L.ldt;
  else c.teacher_logits = row(a.teacher_logits, i0, a.teacher_stride, d.logits_dtype);
  c.labels = row(a.labels, i0, 1, d.labels_dtype);
  const auto at = [i0](auto *x) { return x ? x + i0 : x; };
  c.weights = at(a.weights), c.advantages = at(a.advantages);
  c.teacher_topk_ids = row(a.teacher_topk_ids, i0, a.teacher_topk_ids_stride, d.teacher_topk_ids_dtype);
  c.teacher_topk_logprobs = row(a.teacher_topk_logprobs, i0, a.teacher_topk_logprobs_stride, HL_DTYPE_F32);
  c.old_logprobs = at(a.old_logprobs), c.ref_logprobs = at(a.ref_logprobs);
  c.rollout_logprobs = at(a.rollout_logprobs);
  c.token_loss = at(a.token_loss), c.token_logp = at(a.token_logp);
  c.token_entropy = at(a.token_entropy), c.token_lse = at(a.token_lse);
  c.token_argmax = at(a.token_argmax);
  c.grad_token_logp = at(a.grad_token_logp), c.grad_token_entropy = at(a.grad_token_entropy);
  c.grad_token_lse = at(a.grad_token_lse);
  return c;
}

}  // namespace

void linear_workspace(const hl_loss_plan_st &p, int64_t rows, size_t *min_bytes, size_t *fast_bytes) {
  if (rows == 0) {  // zeros for grad_weight and the scalars: no workspace
    *min_bytes = *fast_bytes = 0;
    return;
  }
  const Layout L = layout(p, rows, 0);
  // A split (ranks, or GSPO's statistics first) keeps every row's logits for its finish.
  const int64_t fast_rows = p.desc.ranks > 1 || p.seq_stats ? rows : std::min(rows, kFastRows);
  *min_bytes = sat_add(L.fixed, L.row_bytes);  // a chunk of one row
  *fast_bytes = sat_add(sat_add(L.fixed, kGemmWorkspace), sat_mul(size_t(fast_rows), L.row_bytes));
}

hl_status_t linear_run(const char *fn, const hl_loss_plan_st &p, const hl_loss_args_t &a,
                       Phase phase, void *block, Gathered gathered, void *workspace,
                       size_t workspace_bytes, cudaStream_t stream) {
  const hl_loss_plan_desc_t &d = p.desc;
  Gemms &g = *p.cuda->gemms;
  int dev = 0;
  HL_CUDA_TRY(cudaGetDevice(&dev));
  if (dev != gemms_device(g))
    return fail(HL_STATUS_INVALID_VALUE, "%s: the plan was made on device %d; the current device "
                "is %d", fn, gemms_device(g), dev);
  const int64_t N = a.rows, V = d.vocab, H = d.hidden;
  const hl_dtype_t wd = d.weight_dtype;
  const bool grads = writes_outputs(phase) && p.dlogits;
  const bool grad_weight = grads && a.grad_weight, grad_hidden = grads && a.grad_hidden;
  const bool grad_bias = grads && a.grad_bias;
  if (N == 0) {
    if (grad_bias && d.grad_bias_mode == HL_LOSS_GRAD_WRITE)
      HL_CUDA_TRY(cudaMemsetAsync(a.grad_bias, 0, size_t(V) * dtype_size(d.grad_bias_dtype), stream));
    if (grad_weight && d.grad_weight_mode == HL_LOSS_GRAD_WRITE)
      HL_CUDA_TRY(cudaMemset2DAsync(a.grad_weight, size_t(a.grad_weight_stride) * dtype_size(d.grad_weight_dtype),
                                    0, size_t(H) * dtype_size(d.grad_weight_dtype), size_t(V), stream));
    return writes_outputs(phase) ? zero_scalars(p, a, stream) : HL_STATUS_SUCCESS;
  }
  const bool shifted = p.cuda->shifted && phase != kMiddle && shifted_call(a);
  // A shifted call without gradient keeps its tile statistics alone (no E): more rows a chunk.
  const bool logits = !shifted || p.dlogits;
  const Layout L = layout(p, N, workspace_bytes, logits);
  char *w = static_cast<char *>(workspace);
  const GemmSpace gemm_ws{w + L.gemm, L.gemm_bytes};
  void *z = w + L.logits, *t = w + L.teacher;
  if (phase == kFinish && !p.dlogits) {  // every row from the gathered records, no logits read: one pass
    HL_TRY(rows_begin(fn, p, a, gathered, workspace, stream));
    HL_TRY(rows_run(p, chunk_args(p, a, 0, N, z, t, L), phase, 0, N, gathered, block, workspace, stream, false));
    return rows_end(p, a, workspace, stream);
  }
  ShiftedBuffers sb{};
  if (shifted) {  // E where the logits chunk would be, its buffers after it
    sb.e = logits ? z : nullptr, sb.lde = L.ldz;
    shifted_buffers(p, L.chunk, w, L.teacher, &sb);
  }
  if (phase != kStats) HL_TRY(rows_begin(fn, p, a, gathered, workspace, stream));
  // A split's middle step and finish reuse the statistics step's logits (the shifted path's E,
  // statistics and shifts) when every row's stayed (the middle step writes no gradient over them).
  const bool form = (phase != kMiddle && phase != kFinish) || !L.keep;
  for (int64_t i0 = 0; i0 < N; i0 += L.chunk) {
    const int64_t n = std::min(L.chunk, N - i0);
    const void *x = row(a.hidden, i0, a.hidden_stride, wd);
    void *gh = grad_hidden ? row(a.grad_hidden, i0, a.grad_hidden_stride, d.grad_hidden_dtype) : nullptr;
    const bool acc_weight = i0 > 0 || d.grad_weight_mode == HL_LOSS_GRAD_ACCUMULATE;
    if (shifted) {
      HL_TRY(shifted_chunk(fn, p, g, chunk_args(p, a, i0, n, z, t, L), x, i0, N, phase, form, gathered, block, gh,
                           grad_weight ? a.grad_weight : nullptr, acc_weight, sb, gemm_ws, workspace, stream));
      continue;
    }
    if (form) {
      HL_TRY(run_gemm(fn, g, {true, false, V, n, H, a.weight, a.weight_stride, x, a.hidden_stride, z,
                              L.ldz, wd, false, a.bias}, gemm_ws, stream));
      if (d.teacher_hidden > 0)
        HL_TRY(run_gemm(fn, g, {true, false, V, n, d.teacher_hidden, a.teacher_weight,
                                a.teacher_weight_stride, row(a.teacher_hidden, i0, a.teacher_hidden_stride, wd),
                                a.teacher_hidden_stride, t, L.ldt, wd, false}, gemm_ws, stream));
    }
    const hl_loss_args_t c = chunk_args(p, a, i0, n, z, t, L);
    HL_TRY(rows_run(p, c, phase, i0, N, gathered, block, workspace, stream, false));
    if (grad_bias)
      HL_TRY(bias_grad_chunk(z, L.ldz, wd, n, V, reinterpret_cast<float *>(w + L.bias), i0 == 0, i0 + n == N,
                             a.grad_bias, d.grad_bias_dtype, d.grad_bias_mode == HL_LOSS_GRAD_ACCUMULATE, stream));
    if (grad_hidden)
      HL_TRY(run_gemm(fn, g, {false, false, H, n, V, a.weight, a.weight_stride, z, L.ldz, gh,
                              a.grad_hidden_stride, d.grad_hidden_dtype,
                              d.grad_hidden_mode == HL_LOSS_GRAD_ACCUMULATE}, gemm_ws, stream));
    if (grad_weight)
      HL_TRY(run_gemm(fn, g, {false, true, H, V, n, x, a.hidden_stride, z, L.ldz, a.grad_weight,
                              a.grad_weight_stride, d.grad_weight_dtype, acc_weight}, gemm_ws, stream));
  }
  return writes_outputs(phase) ? rows_end(p, a, workspace, stream) : HL_STATUS_SUCCESS;
}

}  // namespace hl::loss::dev
