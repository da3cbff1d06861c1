// The loss plan's row kernel. A cluster of CTAs owns one row at a time (a persistent grid loops
// over rows); each CTA owns one slice of the row's vocabulary.
//   pass 1: read the slice once (16-byte loads), keep it in shared memory, and fold it into
//           per-thread online softmax statistics (RowStats); merge threads, then the cluster's
//           CTAs through distributed shared memory, in a fixed order (deterministic);
//   finish: row_math.h's finish_row turns the merged record into losses, metrics, coefficients;
//   pass 2: the gradient of the slice from shared memory, fp32, one rounding at the store.
// Terms that are off cost nothing: the gradient, the soft-cap and distillation are template
// arguments; the other terms only change per-row coefficients. BULK: the slice copied into shared
// memory by bulk copies (row_source.cuh).
// Dense JSD adds a middle pass (the sums of JSD's log m over the slice, exchanged in the cluster)
// between the statistics and finish; a sparse teacher's k logits are gathered at the row's start
// (before any CTA writes the row's gradient: in place, that is over the logits) and its k ids'
// elements rewritten, whole, after pass 2.
// The tensor-parallel split runs the same kernel in two phases: kStats stops after pass 1 and
// writes the row's record into this rank's block; kFinish skips pass 1, merges the ranks' records
// of the row instead, and runs finish and pass 2 (re-reading the logits). A sparse teacher's
// records carry its ids' logits (the owner's), so kFinish gathers them from there. Dense JSD has a
// third phase between them, kMiddle: the merge, then its middle pass into this rank's middle
// block; kFinish adds the ranks' middle sums instead of that pass.
// The body's sections are the kernel's roles, their building blocks in headers of their own:
//   row scheduler      the persistent loop's rows: grid order, the counters, kWhole's hand-out;
//   slice source       where a row's slice comes from: bulk-copy chunks or register loads, their
//                      request and release (row_source.cuh);
//   pass 1             a thread's online statistics of its columns (row_stats.cuh);
//   cluster merge      the CTA's threads, then the cluster's CTAs through their mailboxes, or the
//                      ranks' records in the split's later steps (row_merge.cuh);
//   row finish         the distillation sums, finish_row, the records, the token outputs
//                      (row_finish.cuh);
//   gradient epilogue  pass 2 (row_grad.cuh).
// The body stays one function, its statements in their order: code moved out of it into functions
// or structs, even unchanged, compiles differently (NVVM orders the values ptxas gets otherwise:
// phi copies, hoisted loads). The label's few lines after pass 1 as a __forceinline__ function
// changed the SASS of 3 of rows_f32.cu's 65 sm_80 kernels.
#pragma once

#include <cooperative_groups.h>
#include <cuda/ptx>

#include <type_traits>

#include "common/bulk_copy.cuh"
#include "common/grid_dependency.cuh"
#include "loss/params.cuh"
#include "loss/row_finish.cuh"
#include "loss/row_grad.cuh"
#include "loss/row_merge.cuh"
#include "loss/row_source.cuh"
#include "loss/row_stats.cuh"
#include "loss/sums.cuh"

namespace hl::loss::dev {

template <class T, bool GRAD, bool CAP, int DISTILL, int PHASE, bool BULK>
__global__ void __launch_bounds__(kThreads, DISTILL ? 2 : kMinBlocks) row_kernel(const Params p) {
  static_assert((PHASE != kStats && PHASE != kMiddle) || !GRAD, "the statistics and middle steps write no gradient");
  static_assert(!BULK || DISTILL == kDistillNone || (kDenseTeacher<DISTILL> && PHASE == kWhole),
                "bulk: the logits, and a dense teacher's beside them in the whole-row step");
  constexpr bool JSD = DISTILL == kDistillJsd, SPARSE = DISTILL == kDistillSparse;
  static_assert(PHASE != kMiddle || JSD, "the middle step is dense JSD's");
  // The bulk kernels are launched where code_arch() >= 90 alone: empty in an sm_80 pass.
  if constexpr (BULK && !hl::dev::kClusterCode) return;
  // kFinish and kMiddle read the ranks' merged records instead of pass 1.
  constexpr bool MERGED = PHASE == kFinish || PHASE == kMiddle;
  constexpr int VEC = 16 / sizeof(T);
  // Without a soft-cap or distillation the passes read raw logits and fold the logit scale into
  // the exponent's constant and the row's coefficients (one multiply a column fewer a pass).
  constexpr bool RAW = !CAP && DISTILL == kDistillNone;
  using V = Pack<T, VEC>;
  extern __shared__ uint4 smem_raw[];
  V *slice_smem = reinterpret_cast<V *>(smem_raw);
  V *teacher_smem = slice_smem + p.slice / VEC;  // BULK with a dense teacher: its slice after ours
#if __CUDA_ARCH__ >= 900
  // The cluster's records of a row by rank, two rows deep: each CTA stores its record into every
  // peer's mailbox (st.async), completing bytes on the peer's mail_full barrier, so a CTA waits
  // for its peers' records alone, not at a cluster-wide barrier.
  __shared__ alignas(16) RowStats<float> mail[2][kMaxCluster];
  __shared__ uint64_t mail_full[2];
  // kWhole: the row after the current one, from rank 0 to every rank (two rows deep, like mail).
  __shared__ alignas(16) long long next_mail[2][2];
  __shared__ uint64_t next_full[2];
#endif
  __shared__ MergeScratch scratch;
  __shared__ RowResult<float> row;
  // JSD and a sparse teacher: the row's lse_s and lse_t, the warps' sums; JSD: the cluster's sums
  // by rank, two rows deep like mail; a sparse teacher: entry tid's logit z_hat, log-prob, column
  // in this slice (kElsewhere, kPadding) and old gradient (accumulating), each its thread's own.
  // (4 KB: the kernel's static shared memory, 7.4 KB on sm_90a, stays under launch.cu's
  // kStaticSmemSlack.)
  constexpr int kElsewhere = -1, kPadding = -2, KT = SPARSE ? kMaxTopk : 1;
  __shared__ float lse_sh[2];
  __shared__ DivSums<float> dsum_part[kThreads / 32];
  __shared__ float tk_z[KT], tk_lq[KT], tk_old[KT];
  __shared__ int tk_col[KT];
#if __CUDA_ARCH__ >= 900
  __shared__ alignas(16) DivSums<float> jmail[2][JSD ? kMaxCluster : 1];
  __shared__ uint64_t jmail_full[2];
#endif
  // The row after the current one: for every thread (next_sh), for thread 0 from the row's start
  // (nxt), the one after that (after). In shared memory: registers held across the column loops
  // would spill there.
  __shared__ long long next_sh, nxt, after;
  __shared__ uint64_t full[kMaxChunks], empty[kMaxChunks];  // BULK: see row_source.cuh
#if __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank()), csize = int(cluster.num_blocks());
#else
  const int rank = 0, csize = 1;
#endif
  const Options &o = p.o;
  const int tid = threadIdx.x;
  // Slice source: this CTA's columns of a row as z values, where they come from, BULK's requests.
  const float zs = RAW ? o.scale : 1.0f;  // z_hat = zs * zval(x)
  const auto zval = [&](float x, float &t) { return RAW ? x : zhat<CAP>(x, o, t); };
  // A pack's columns as z values (see zval).
  const auto unpack = [&](const Pack<T, VEC> &raw, float (&zz)[VEC], float (&tt)[VEC]) {
    hl::dev::to_floats(raw, zz);
    if (!RAW)
#pragma unroll
      for (int k = 0; k < VEC; ++k) zz[k] = zhat<CAP>(zz[k], o, tt[k]);
  };
  const auto unpack_teacher = [&](const Pack<T, VEC> &raw, float (&vv)[VEC]) {  // v = teacher / tau_t
    hl::dev::to_floats(raw, vv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) vv[k] *= o.inv_tt;
  };
  const int64_t lo = min(p.vocab, rank * p.slice), hi = min(p.vocab, lo + p.slice);
  const int64_t nvec = (hi - lo) / VEC, tail_lo = lo + nvec * VEC;
  const int64_t first = blockIdx.x / csize, step = gridDim.x / csize;
  const auto slice_of = [&](int64_t row) { return static_cast<const T *>(p.logits) + row * p.logits_stride + lo; };
  // Chunks of the slice: kChunkPacks packs each with BULK, else one chunk of all of it.
  const int64_t chunk = BULK ? kChunkPacks : (nvec > 0 ? nvec : 1);
  const int nchunks = int((nvec + chunk - 1) / chunk);
  // Pack indices in a slice: 32-bit with BULK (at most kMaxChunks chunks), cheaper loop control.
  using Idx = std::conditional_t<BULK, int, int64_t>;
  const auto teacher_of = [&](int64_t row) { return static_cast<const T *>(p.teacher) + row * p.teacher_stride + lo; };
  const auto request = [&](int64_t row, int c) {  // BULK, one thread: chunk c of a row's slice
    const int64_t i0 = c * chunk, n = min(chunk, nvec - i0);
    const uint32_t bytes = uint32_t(n * 16);
    hl::dev::mbar_expect_tx(&full[c], kDenseTeacher<DISTILL> ? 2 * bytes : bytes);
    hl::dev::bulk_copy(slice_smem + i0, slice_of(row) + i0 * VEC, bytes, &full[c]);
    if (kDenseTeacher<DISTILL>) hl::dev::bulk_copy(teacher_smem + i0, teacher_of(row) + i0 * VEC, bytes, &full[c]);
  };
#if __CUDA_ARCH__ >= 900
  // Cluster merge: the mailboxes' barriers (the scheduler's next_mail's too).
  if (csize > 1) {
    if (tid == 0) {
      hl::dev::mbar_init(&mail_full[0], 1);
      hl::dev::mbar_init(&mail_full[1], 1);
      hl::dev::mbar_init(&next_full[0], 1);
      hl::dev::mbar_init(&next_full[1], 1);
      if (JSD) hl::dev::mbar_init(&jmail_full[0], 1), hl::dev::mbar_init(&jmail_full[1], 1);
    }
    cluster.sync();  // every peer's barriers are initialised before the first record arrives
  }
#endif
  if (BULK) {
    if (tid == 0) {
      for (int c = 0; c < nchunks; ++c) {
        hl::dev::mbar_init(&full[c], 1);
        hl::dev::mbar_init(&empty[c], kThreads);
      }
      if (first < p.rows)
        for (int c = 0; c < nchunks; ++c) request(first, c);
    }
    __syncthreads();
  }
  // Row scheduler: a cluster takes its first two rows in grid order, then the next free one from a
  // counter, so that clusters on SMs that get less memory bandwidth take fewer rows and all finish
  // within about a row of each other (with rows in grid order the first cluster finished at 2/3 of
  // the kernel's time; bench/notes/loss.md "Loss v7"). Thread 0 knows the row after the current
  // one (nxt) from the row's start, for its bulk requests; the one after that (after) is taken at
  // the row's finish, and its round trip hides behind pass 2. kWhole: rank 0 takes rows and hands
  // them to its peers (next_mail); kFinish: the CTAs of a cluster do not talk, each takes rows
  // from its rank's counter; kStats: rows in grid order (no prep kernel zeroes a counter).
  constexpr bool DYN = PHASE != kStats;
  const bool hand_rows = DYN && PHASE == kWhole && csize > 1;
  const bool takes_rows = DYN && (!hand_rows || rank == 0);
  unsigned *const next_counter = p.counters + (PHASE == kWhole ? 0 : rank);
  if (tid == 0) nxt = first + step;
  unsigned taken = 0;  // thread 0: the counter's answer, from a row's finish to its barrier
  int parity = 0;
  for (int64_t r = first, it = 0; r < p.rows; parity ^= 1, ++it) {
    const T *x = slice_of(r);
    const uint32_t phase = uint32_t(it) & 1;
    if (tid == 0) {
      if (!DYN) nxt = r + step;
      else if (it > 0 && takes_rows) nxt = after;
#if __CUDA_ARCH__ >= 900
      if (hand_rows) {
        if (rank == 0)
          for (int c = 0; c < csize; ++c)
            ::cuda::ptx::st_async(reinterpret_cast<uint32_t *>(cluster.map_shared_rank(&next_mail[parity][0], c)),
                                  {uint32_t(nxt), uint32_t(uint64_t(nxt) >> 32), 0u, 0u},
                                  cluster.map_shared_rank(&next_full[parity], c));
        hl::dev::mbar_expect_tx(&next_full[parity], 16);
        hl::dev::mbar_wait(&next_full[parity], uint32_t(it >> 1) & 1);
        nxt = next_mail[parity][0];
      }
#endif
    }
    // Slice source, this row. The row's last pass over chunk c is done: every thread arrives, and
    // thread 0 requests the next row's chunk c into it once all have. Each thread's own arrival,
    // not a warp's after __syncwarp: 2% faster without a gradient (no warp waits for its slowest
    // lane), and what racecheck can follow (with lane 0 arriving for its warp it reported every
    // pass-1 read).
    const auto release = [&](int c) {
      if (!BULK) return;
      hl::dev::mbar_arrive(&empty[c]);
      if (tid == 0) {  // nxt read by thread 0 alone (volatile: not hoisted out of the branch)
        const int64_t n = *static_cast<volatile long long *>(&nxt);
        if (n < p.rows) {
          hl::dev::mbar_wait(&empty[c], phase);
          request(n, c);
        }
      }
    };
    const T *u = kDenseTeacher<DISTILL> ? teacher_of(r) : nullptr;
    const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                         (!kDenseTeacher<DISTILL> || reinterpret_cast<uintptr_t>(u) % 16 == 0);
    // The student's pack i after pass 1: from shared memory where kept.
    const auto student = [&](Idx i) { return BULK || p.keep_row ? slice_smem[i] : load_cols<T, VEC>(x + i * VEC, aligned); };
    // body(i, student pack, teacher pack) for this thread's packs i of [i0, end) after pass 1.
    // A dense teacher's packs are loaded kBatch ahead of their use, as in pass 1 (one load in
    // flight a thread is latency-bound); so are the student's in the steps after the exchange,
    // which keep no row (kFinish, kMiddle). kWhole's come from shared memory at their use: held
    // in registers too they spilled.
    const auto for_packs = [&](Idx i0, Idx end, auto body) {
      if constexpr (!kDenseTeacher<DISTILL>) {
        for (Idx i = i0 + tid; i < end; i += kThreads) body(i, student(i), V{});
      } else if constexpr (BULK) {
        for (Idx i = i0 + tid; i < end; i += kThreads) body(i, slice_smem[i], teacher_smem[i]);
      } else {
        constexpr bool AHEAD = PHASE != kWhole;
        for (Idx ib = i0 + tid; ib < end; ib += kBatch * kThreads) {
          [[maybe_unused]] V xr[kBatch];  // AHEAD's
          V tr[kBatch];
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            const Idx i = ib + b * kThreads;
            if (i >= end) break;
            if constexpr (AHEAD) xr[b] = load_cols<T, VEC>(x + i * VEC, aligned);
            tr[b] = load_cols<T, VEC>(u + i * VEC, aligned);
          }
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            const Idx i = ib + b * kThreads;
            if (i >= end) break;
            if constexpr (AHEAD) body(i, xr[b], tr[b]);
            else body(i, student(i), tr[b]);
          }
        }
      }
    };
    const RowInputs<float> in = read_inputs<float>(p.src, r);
    const int64_t label = in.label - p.col0;  // in this shard's columns
    float t[VEC], z[VEC], v[VEC] = {};
    if (SPARSE && tid < o.topk) {  // entry tid of the row's sparse teacher (an id out of range: padding)
      const int64_t at = r * p.topk_ids_stride + tid;
      const int64_t id = p.topk_ids64 ? static_cast<const int64_t *>(p.topk_ids)[at]
                                      : int64_t(static_cast<const int32_t *>(p.topk_ids)[at]);
      const int64_t j = id - p.col0;  // in this shard's columns
      const bool ok = id >= 0 && id < o.vocab, mine = ok && j >= 0 && j < p.vocab;
      float tt;
      tk_z[tid] = PHASE == kFinish ? gathered_topk(p, r, tid)
                  : mine ? zhat<CAP>(to_float(x[j - lo]), o, tt) : topk_absent<float>();
      tk_lq[tid] = ok ? p.topk_lp[r * p.topk_lp_stride + tid] : 0.0f;
      tk_col[tid] = !ok ? kPadding : mine && j >= lo && j < hi ? int(j - lo) : kElsewhere;
    }
    // Pass 1 and the cluster merge.
    RowStats<float> all;  // the row's merged record (thread 0)
    if (!MERGED) {
    // The label's logit, read by one thread before any gradient of this row is written.
    const bool owns_label = tid == 0 && label >= lo && label < hi;
    const T label_raw = owns_label ? x[label - lo] : T(0.0f);
    const auto pass1 = [&](auto sumz) {
      RowStats<float> st = empty_stats<float>();
      if (BULK) {
        // The pack where this thread's maximum first appeared (-1: none pending); its column is
        // found while the pack is still in shared memory.
        int apack = -1;
        const auto resolve_argmax = [&] {
          if (apack < 0) return;
          unpack(slice_smem[apack], z, t);
          st.amax = lo + int64_t(apack) * VEC + find_argmax(z);
          apack = -1;
        };
        for (int c = 0; c < nchunks; ++c) {
          hl::dev::mbar_wait(&full[c], phase);
          const Idx end = Idx(min(nvec, (c + 1) * chunk));
#pragma unroll 4
          for (Idx i = Idx(c * chunk) + tid; i < end; i += kThreads) {
            unpack(slice_smem[i], z, t);
            if (kDenseTeacher<DISTILL>) unpack_teacher(teacher_smem[i], v);
            accumulate<DISTILL, decltype(sumz)::value>(st, z, v, lo + i * VEC, o.inv_ts, zs, &apack, int(i));
          }
          if (!GRAD && !JSD) {  // the chunk is refilled once released: its argmax column first
            resolve_argmax();
            release(c);
          }
        }
        resolve_argmax();
      } else
      // kBatch loads in flight per thread before any is used: enough bytes in flight for HBM.
      // Thread tid owns vectors tid + k * kThreads in both passes, so the kept slice needs no sync.
      for (int64_t i0 = tid; i0 < nvec; i0 += kBatch * kThreads) {
        V raw[kBatch], traw[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t i = i0 + b * kThreads;
          if (i >= nvec) break;
          raw[b] = load_cols<T, VEC>(x + i * VEC, aligned);
          if (kDenseTeacher<DISTILL>) traw[b] = load_cols<T, VEC>(u + i * VEC, aligned);
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t i = i0 + b * kThreads;
          if (i >= nvec) break;
          if (p.keep_row) slice_smem[i] = raw[b];
          unpack(raw[b], z, t);
          if (kDenseTeacher<DISTILL>) unpack_teacher(traw[b], v);
          accumulate<DISTILL, decltype(sumz)::value>(st, z, v, lo + i * VEC, o.inv_ts, zs);
        }
      }
      if (tid == 0)  // the last slice's columns past the last full vector
        for (int64_t j = tail_lo; j < hi; ++j) {
          float z1[1], v1[1] = {0.0f}, t1;
          z1[0] = zval(to_float(x[j - lo]), t1);
          if (kDenseTeacher<DISTILL>) v1[0] = to_float(u[j - lo]) * o.inv_tt;
          accumulate<DISTILL, decltype(sumz)::value>(st, z1, v1, j, o.inv_ts, zs);
        }
      return st;
    };
    RowStats<float> st = o.smoothing != 0.0f ? pass1(std::true_type{}) : pass1(std::false_type{});
    if (owns_label) {
      float tl;
      st.zy = zhat<CAP>(to_float(label_raw), o, tl);
    }
    if (RAW) st.b *= zs, st.sum *= zs;  // to z_hat units
    st = block_merge<DISTILL>(st, scratch, parity, o.inv_ts);
    all = st;  // thread 0's is the CTA's record
#if __CUDA_ARCH__ >= 900
    if (csize > 1) {
      if (tid == 0) {
        hl::dev::mbar_expect_tx(&mail_full[parity], uint32_t(csize * kRecordBytes<DISTILL>));
        post_to_cluster<kRecordBytes<DISTILL> / 16>(st, &mail[parity][0], &mail_full[parity], rank, csize);
      }
      // Warp 0 merges the cluster's records as a tree: every CTA the same records in the same
      // order (deterministic).
      if (tid < 32) {
        hl::dev::mbar_wait(&mail_full[parity], uint32_t(it >> 1) & 1);
        all = tid < csize ? mail[parity][tid] : empty_stats<float>();
        all = warp_tree_merge<DISTILL>(all, csize, o.inv_ts);
      }
    }
#endif
    } else {
      __syncthreads();  // every thread has read the previous row's `row`
      if (tid < 32) all = gathered_stats<DISTILL>(p, r);
    }
    // Row finish. Dense JSD and a sparse teacher: sums over the slice (JSD's middle pass) or the k
    // ids, taken once the row's lse is known; thread 0 gets the row's DistillRow (kMiddle: writes
    // JSD's sums).
    DistillRow<float> dx{};
    if (JSD && PHASE == kFinish) {
      if (tid == 0) dx = dense_row(gathered_middle(p, r));
    } else if ((JSD || SPARSE) && PHASE != kStats) {
      if (tid == 0) lse_sh[0] = student_lse(all, o), lse_sh[1] = JSD ? teacher_lse(all) : 0.0f;
      __syncthreads();
      const float lse_s = lse_sh[0], lse_t = lse_sh[1], its = o.inv_ts, b = o.jsd_beta;
      DivSums<float> part{0.0f, 0.0f, 0.0f, 0.0f};
      const auto add_cols = [&](const float (&zz)[VEC], const float (&vv)[VEC], int n) {
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          if (k < n) part = add(part, div_elem(kDistillJsd, b, zz[k] * its - lse_s, vv[k] - lse_t, FastMath{}));
      };
      if (SPARSE && tid < o.topk && tk_col[tid] != kPadding)
        part = div_elem(o.divergence, b, tk_z[tid] * its - lse_s, tk_lq[tid]);
      if (JSD) {  // the slice from shared memory (kept) or again from global memory; the teacher again
        for_packs(Idx(0), Idx(nvec), [&](Idx, const V &xr, const V &tr) {
          unpack(xr, z, t);
          unpack_teacher(tr, v);
          add_cols(z, v, VEC);
        });
        if (!GRAD)  // BULK: the middle pass was the row's last over its chunks
          for (int c = 0; c < nchunks; ++c) release(c);
        if (tid == 0)
          for (int64_t j = tail_lo; j < hi; ++j) {
            float z1[VEC] = {}, v1[VEC] = {}, t1;
            z1[0] = zval(to_float(x[j - lo]), t1);
            v1[0] = to_float(u[j - lo]) * o.inv_tt;
            add_cols(z1, v1, 1);
          }
      }
      part = block_sum(part, dsum_part);
#if __CUDA_ARCH__ >= 900
      if (JSD && csize > 1 && tid == 0) {  // the cluster's sums, added in rank order by every CTA
        hl::dev::mbar_expect_tx(&jmail_full[parity], uint32_t(csize * sizeof part));
        post_to_cluster<1>(part, &jmail[parity][0], &jmail_full[parity], rank, csize);
        hl::dev::mbar_wait(&jmail_full[parity], uint32_t(it >> 1) & 1);
        part = jmail[parity][0];
        for (int c = 1; c < csize; ++c) part = add(part, jmail[parity][c]);
      }
#endif
      const MidSums<float> mid{part.loss, part.pa};
      if (tid == 0 && PHASE == kMiddle) write_middle(p, r, mid);
      if (tid == 0) dx = JSD ? dense_row(mid) : sparse_row(o, part);
    }
    // kStats: a sparse teacher's logits at its ids in this shard after the record.
    if (SPARSE && PHASE == kStats && rank == 0 && tid < o.topk) *topk_logit(p.block, p, r, tid) = tk_z[tid];
    if (tid == 0) {
      if (PHASE == kStats) {
        if (rank == 0) write_record<DISTILL>(p, r, all);
      } else {
      hl::dev::wait_for_previous_grid();  // the prep kernel's kd and counters (launch_rows: early)
      if (PHASE != kMiddle) row = finish_row(all, in, o, p.prep->kd, JSD || SPARSE ? &dx : nullptr);
      next_sh = nxt;
      if (takes_rows) taken = atomicAdd(next_counter, 1u);  // stored after the barrier: no wait here
      }
    }
    // A sparse teacher's ids in this slice, accumulating: their old gradient, before pass 2 writes.
    if (SPARSE && GRAD && p.accumulate && tid < o.topk && tk_col[tid] >= 0) {
      const int64_t at = r * p.grad_stride + lo + tk_col[tid];
      tk_old[tid] = p.grad_f32 ? static_cast<const float *>(p.grad)[at] : to_float(static_cast<const T *>(p.grad)[at]);
    }
    if (PHASE != kStats) __syncthreads();
    // The row's outputs, after the barrier: stores before it would hold every warp back.
    if (tid == 0 && takes_rows) after = 2 * step + taken;
    if ((PHASE == kWhole || PHASE == kFinish) && tid == 0 && rank == 0) {
      if (p.records) store_floats<kRecFields>(p.records + r * kRecStride, row.rec);
      if (p.tok_loss) p.tok_loss[r] = row.token_loss;
      if (p.tok_logp) p.tok_logp[r] = row.logp;
      if (p.tok_entropy) p.tok_entropy[r] = row.entropy;
      if (p.tok_lse) p.tok_lse[r] = row.lse;
      if (p.tok_argmax) p.tok_argmax[r] = row.argmax;
    }
    if (GRAD) {  // the gradient epilogue
      RowResult<float> rr = row;  // coefficients in registers for the loop
      if (RAW) rr.cpz *= zs;      // on the raw logit
      const float lse2 = rr.lse * kLog2e, s2 = zs * kLog2e;
      // The row's form of a gradient element (GradForm); with kSigned and kPure, |cp| rides in
      // the exponent's constant c2 (log2 of 0 is -inf: e = 0).
      const bool lean = RAW && rr.cpz == 0.0f;
      const float c2 = lean ? lse2 - log2f(fabsf(rr.cp)) : lse2;
      const float sg = rr.cp > 0.0f ? 1.0f : rr.cp < 0.0f ? -1.0f : 0.0f;
      const int form = !lean ? kGeneric : sg >= 0.0f && rr.cc == 0.0f ? kPure : kSigned;
      const GradConsts gc{s2, lse2, c2, sg};
      // The label's term, at column col of a pack.
      const auto add_label = [&](float (&g)[VEC], const float (&tt)[VEC], int col) {
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          if (k == col) g[k] += CAP ? rr.cy * fmaf(-tt[k], tt[k], 1.0f) : rr.cy;
      };
      // The pack holding the label (-1: none in this slice's packs) and its column there.
      const int64_t lrel = label - lo;
      const Idx lpack = lrel >= 0 && lrel < nvec * VEC ? Idx(lrel / VEC) : Idx(-1);
      const int lk = int(lrel % VEC);
      const auto write = [&](auto *gp) {
        using G = typename std::remove_pointer<decltype(gp)>::type;
        G *grow = gp + r * p.grad_stride + lo;
        const bool galigned = aligned && reinterpret_cast<uintptr_t>(grow) % 16 == 0;
        // fast: aligned stores that do not accumulate; form_c: the row's GradForm.
        const auto columns = [&](auto fast, auto form_c) {
          for (int c = 0; c < nchunks; ++c) {
            if (BULK && PHASE == kFinish) hl::dev::mbar_wait(&full[c], phase);
            const Idx end = Idx(min(nvec, (c + 1) * chunk));
            for_packs(Idx(c * chunk), end, [&](Idx i, const V &raw, const V &traw) {
              unpack(raw, z, t);
              if (kDenseTeacher<DISTILL>) unpack_teacher(traw, v);
              float g[VEC];
              grad_pack<decltype(form_c)::value, DISTILL, CAP>(rr, o, gc, z, t, v, VEC, g);
              if (i == lpack) add_label(g, t, lk);
              store_grad<G, VEC, decltype(fast)::value>(grow + i * VEC, g, galigned, p.accumulate);
            });
            release(c);
          }
        };
        // (without RAW, form is kGeneric: the other two instantiate nothing new)
        if (!galigned || p.accumulate) columns(std::false_type{}, Form<kGeneric>{});
        else if (form == kPure) columns(std::true_type{}, Form<RAW ? kPure : kGeneric>{});
        else if (form == kSigned) columns(std::true_type{}, Form<RAW ? kSigned : kGeneric>{});
        else columns(std::true_type{}, Form<kGeneric>{});
        if (tid == 0)
          for (int64_t j = tail_lo; j < hi; ++j) {
            float z1[VEC] = {}, t1[VEC] = {}, v1[VEC] = {}, g1[VEC];
            z1[0] = zval(to_float(x[j - lo]), t1[0]);
            if (kDenseTeacher<DISTILL>) v1[0] = to_float(u[j - lo]) * o.inv_tt;
            grad_pack<kGeneric, DISTILL, CAP>(rr, o, gc, z1, t1, v1, 1, g1);
            if (j == label) add_label(g1, t1, 0);
            G *gj = grow + (j - lo);
            *gj = from_float<G>(p.accumulate ? to_float(*gj) + g1[0] : g1[0]);
          }
        if (SPARSE) {  // the ids in this slice: their whole element from the gathered logit, stored once
          __syncthreads();  // after pass 2's stores there
          const int col = tid < o.topk ? tk_col[tid] : kElsewhere;
          if (col >= 0) {
            const float zk = tk_z[tid], pk = ex2(fmaf(zk, gc.s2, -gc.lse2));
            float g = grad_elem<DISTILL>(rr, o, zk, 0.0f, pk, FastMath{}) +
                      topk_correction(rr, o, zk, tk_lq[tid]);
            if (lo + col == label) g += rr.cy;
            if (CAP) g *= 1.0f - (zk / o.cap) * (zk / o.cap);
            grow[col] = from_float<G>(p.accumulate ? tk_old[tid] + g : g);
          }
        }
      };
      if (p.grad_f32) write(static_cast<float *>(p.grad));
      else write(static_cast<T *>(p.grad));
    }
    r = PHASE != kStats ? next_sh : r + step;  // next_sh changes after the next row's first barrier
  }
#if __CUDA_ARCH__ >= 900
  if (csize > 1) cluster.sync();  // no CTA leaves while its records may still be on the way
#endif
}

// Dense JSD's statistics step is forward KL's (the same record); its middle step has no gradient
// and no other divergence has one (null).
template <class T, int PHASE, bool GRAD, bool CAP>
const void *pick_distill(int distill) {
  using K = const void *;
  if constexpr (PHASE == kMiddle) {
    if constexpr (GRAD) return nullptr;
    else return distill == kDistillJsd ? K(row_kernel<T, false, CAP, kDistillJsd, kMiddle, false>) : nullptr;
  } else {
    switch (distill) {
      case kDistillFwd: return K(row_kernel<T, GRAD, CAP, kDistillFwd, PHASE, false>);
      case kDistillRev: return K(row_kernel<T, GRAD, CAP, kDistillRev, PHASE, false>);
      case kDistillJsd: return K(row_kernel<T, GRAD, CAP, PHASE == kStats ? kDistillFwd : kDistillJsd, PHASE, false>);
      case kDistillSparse: return K(row_kernel<T, GRAD, CAP, kDistillSparse, PHASE, false>);
      default: return K(row_kernel<T, GRAD, CAP, kDistillNone, PHASE, false>);
    }
  }
}

// The statistics step has no gradient; without one, finish has no use for the soft-cap's
// chain factor (its records already hold z_hat).
template <class T>
const void *pick_row_kernel(int phase, bool grad, bool cap, int distill) {
  if (phase == kMiddle)
    return cap ? pick_distill<T, kMiddle, false, true>(distill) : pick_distill<T, kMiddle, false, false>(distill);
  if (phase == kStats)
    return cap ? pick_distill<T, kStats, false, true>(distill) : pick_distill<T, kStats, false, false>(distill);
  if (phase == kFinish) {
    if (!grad) return pick_distill<T, kFinish, false, false>(distill);
    return cap ? pick_distill<T, kFinish, true, true>(distill) : pick_distill<T, kFinish, true, false>(distill);
  }
  if (grad) return cap ? pick_distill<T, kWhole, true, true>(distill) : pick_distill<T, kWhole, true, false>(distill);
  return cap ? pick_distill<T, kWhole, false, true>(distill) : pick_distill<T, kWhole, false, false>(distill);
}

// The bulk-copy whole-row kernel of a dense teacher's divergence (nullptr for the others).
template <class T, bool GRAD, bool CAP>
const void *pick_bulk_distill(int distill) {
  using K = const void *;
  switch (distill) {
    case kDistillFwd: return K(row_kernel<T, GRAD, CAP, kDistillFwd, kWhole, true>);
    case kDistillRev: return K(row_kernel<T, GRAD, CAP, kDistillRev, kWhole, true>);
    case kDistillJsd: return K(row_kernel<T, GRAD, CAP, kDistillJsd, kWhole, true>);
    default: return nullptr;
  }
}

// The bulk-copy variant of a phase's kernel (nullptr where it does not apply: a sparse teacher,
// distillation in the split's steps, and a finish without a gradient, which reads no logits).
template <class T>
const void *pick_bulk_kernel(int phase, bool grad, bool cap, int distill) {
  using K = const void *;
  if (distill != kDistillNone) {
    if (phase != kWhole) return nullptr;
    if (grad) return cap ? pick_bulk_distill<T, true, true>(distill) : pick_bulk_distill<T, true, false>(distill);
    return cap ? pick_bulk_distill<T, false, true>(distill) : pick_bulk_distill<T, false, false>(distill);
  }
  if (phase == kStats)
    return cap ? K(row_kernel<T, false, true, kDistillNone, kStats, true>)
               : K(row_kernel<T, false, false, kDistillNone, kStats, true>);
  if (phase == kFinish) {
    if (!grad) return nullptr;
    return cap ? K(row_kernel<T, true, true, kDistillNone, kFinish, true>)
               : K(row_kernel<T, true, false, kDistillNone, kFinish, true>);
  }
  if (grad) return cap ? K(row_kernel<T, true, true, kDistillNone, kWhole, true>)
                       : K(row_kernel<T, true, false, kDistillNone, kWhole, true>);
  return cap ? K(row_kernel<T, false, true, kDistillNone, kWhole, true>)
             : K(row_kernel<T, false, false, kDistillNone, kWhole, true>);
}

}  // namespace hl::loss::dev
