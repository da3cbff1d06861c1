// gdn_bwd_dqkwg on Hopper (sm_90a): TMA loads, warpgroup MMAs, a persistent grid.
//
// Work: each CTA (for K > 128, each cluster of two CTAs, one per 128-wide half of K) walks
// (chunk, q/k head) items; an item is one pass per value head of the q/k head (GVA: G = HV / H
// passes, any G), in the order of one ItemScheduler that every role walks. Warp 12 is the
// producer: with TMA it loads the item's q, k tiles into one of two buffers (item parity, so the
// next item's never waits for this item's epilogue), then per pass the value head's gate (into
// one of two buffers, pass parity) and its V in 64-wide stages (do, v, dv tiles of 64 x 64 and
// the CTA's KH x 64 of h and dh, or 64 x KH with state_v_first) through a ring of slots (2 at
// KH = 128, 3 at KH = 64); an item's first stage carries where it lies, so no consumer searches
// cu_seqlens.
// Three consumer warpgroups share every stage (64-row wgmma, operands in shared memory):
//   WG0: ds[:, 0:32] = do v^T and dq = do h^T;   WG1: ds[:, 32:64] and dk = v dh^T;
//   WG2: dw = dv h^T, and sum(h * dh) from shared memory while its wgmma runs.
// Epilogue per pass: ds gated and rounded to the input dtype (shared memory), dq += ds k and
// dk += ds^T q by mma.sync on the wgmma accumulators (same register layout), dg from the final dq
// and dk; dq, dk (after the last pass), dw leave through each warp's staging tile as whole
// 128-byte lines (1.13-1.3x over 4-byte stores straight from the accumulators, whose scattered
// half sectors held the kernel at 75%). GVA sums dq, dk over the passes in the same accumulators
// (see row_factors), so K = 128 runs 128 columns a CTA at any G. In a cluster, rank 1 sends its
// dg partial to rank 0 (st.async into a mailbox two passes deep), which adds it in a fixed order:
// deterministic, no atomics, no workspace.
// K or V not a multiple of 8 (ODD = 1): a tensor map's strides must be multiples of 16 bytes, so q, k
// are mapped "folded" as [tokens][H * K] (row stride H K, a multiple of 8 elements), likewise do, v,
// dv as [tokens][HV * V]. A TMA tile load faults (illegal instruction) when its box starts off 16 bytes
// in the innermost dimension (H100: every block with hq K % 8 != 0 did), so a head's boxes start at the
// 16-byte boundary below it: column hq K + k0 - d_k, d_k = (hq K) % 8 (the same in every row), and tile
// column j holds K index kb + j, kb = k0 - d_k (V: hv V + 64 s - d_v, V index 64 s - d_v + j). The
// CTAs of a cluster cover K + max d_k (at most K + 7), the stages V + max d_v; tile columns outside
// [0, K) hold the neighbouring heads' data: q, k's are zeroed in the buffer by the consumers
// (zero_foreign), do, v, dv's in the slot by the producer warpgroup (the sums over V). States follow
// the same origins (TMA rows below 0 or past the end zero-filled; those TMA cannot map copied by the
// producer warpgroup, hand_states, zeros outside the state). dq, dk rows then start 16-byte aligned,
// dw rows (hv K - d_k) in general not: stored in the widest pieces their alignment allows. Where H K
// (HV V) is not a multiple of 8 either, no map takes q, k (do, v, dv), nor q, k where the shifted boxes
// would pass two CTAs (K + d_k > 256): the producer warpgroup copies them unshifted (hand_box; 2-byte
// pieces of odd K or V through registers, cp.async has no 2-byte form: the ODD = 2 kernels, with fp32
// states in rows of other than a multiple of 4 floats).
#include <cuda.h>

#include <atomic>
#include <initializer_list>
#include <type_traits>

#include "common/bulk_copy.cuh"
#include "common/cp_async.cuh"
#include "common/cuda_util.h"
#include "common/dtype.cuh"
#include "common/sm90/wgmma.cuh"
#include "common/tensor_map.h"
#include "gdn/dqkwg_sm90.h"
#include "gdn/mma.cuh"
#include "hl/gdn/facts.h"

namespace hl::gdn::dev {
using namespace hl::dev;  // the common device helpers (kernels/common)

namespace {

constexpr int kConsumers = 384;               // three warpgroups
constexpr int kThreads90 = kConsumers + 128;  // and the producer's (one warp of it works)
constexpr int kRowTile = kTile * 64 * 2;      // bytes of a 64 x 64 16-bit tile
constexpr int kStageBytes = 16 * 64 * 2;      // a warp's 16 x 64 block of an output
enum NamedBarrier { kBarDs = 1, kBarEpi = 2, kBarWg2 = 3 };

struct Sm90Params {  // CUtensorMap members keep it 64-byte aligned
  CUtensorMap m_do, m_v, m_dv, m_h, m_dh, m_q, m_k;
  void *dq, *dk, *dw;
  float *dg;
  const float *g, *g_gamma;
  const float *h32, *dh32;  // fp32 states (read by the producer warpgroup, rounded into the slots)
  ChunkTable chunks;
  int64_t items;  // chunks * H
  int H, HV, G, K, V, VCN, nsplit;  // G = HV / H value heads a q/k head
  float scale;
  bool gated, log2, dg_on, dw_on, reverse_cumsum;
  // ODD kernels only (after the fields the others read, whose code stays as it was):
  const void *h16, *dh16;      // 16-bit states the producer warpgroup copies (hand)
  int fk_x, fk_y, fv_x, fv_y;  // q, k (fk) and do, v, dv (fv): column c of head h at (c + h fx, h fy):
                               // folded (fx = K or V, fy = 0) or not (0, 1)
  int hw;                      // hand: elements a copy (4, 2 or 1)
  bool hand, vpad;             // states by hand; folded V (its last stage's columns past V zeroed)
  // q, k (H K not a multiple of 8) and do, v, dv (HV V) that not even a folded map takes, copied by the
  // producer warpgroup: elements a copy (4, 2 or 1)
  const void *q16, *k16, *do16, *v16, *dv16;
  int qw, vw;
  int sw;  // fp32 states: floats a load (4, 2 or 1: the rows' V, VF: K)
  bool hand_qk, hand_v;
  // each producer thread's arrivals on a stage's full barrier: once its cp.async copies land (async),
  // once after its stores through registers (regs)
  bool stage_async, stage_regs;
};

// Where item (chunk, q/k head) lies; its value heads are hq G .. hq G + G - 1.
struct ItemPos {
  int64_t tok0;  // first token (flattened over B * T)
  int n, hq;     // valid rows; q/k head
  int64_t cid;   // chunk

  ItemPos() = default;
  __device__ ItemPos(const Sm90Params &P, int64_t item) : hq(int(item % P.H)), cid(item / P.H) {
    locate_chunk(P.chunks, cid, &tok0, &n);
  }
};

// Shared memory of one CTA for KH (64 or 128) columns of K. Offsets in bytes from a 1024-byte
// aligned base (TMA's 128-byte swizzle repeats every 1024 bytes). Two q, k buffers by item
// parity; the per-pass buffers (gates, row sums, partials, mailbox) two deep by pass parity.
template <int KH>
struct Layout {
  static constexpr int kSlots = KH == 64 ? 3 : 2;             // ring of V stages
  static constexpr int kHTile = KH * 128;                     // KH x 64 16-bit elements
  static constexpr int kSlot = 3 * kRowTile + 2 * kHTile;     // do, v, dv, h, dh
  static constexpr int kQK = 2 * kTile * KH * 2;              // q then k, KH / 64 boxes each
  static constexpr int kQ = kSlots * kSlot, kDs = kQ + 2 * kQK;
  static constexpr int kGam = kDs + kRowTile;                 // [2][64] gates
  static constexpr int kRed = kGam + 2 * 64 * 4;              // [2][2][64] row sums of dq q, dk k
  static constexpr int kPart = kRed + 2 * 2 * 64 * 4;         // [2][8] per-warp sum(h dh), sum(dk k)
  static constexpr int kMail = kPart + 2 * 8 * 4;             // [2][64] rank 1's dg partials
  static constexpr int kPos = kMail + 2 * 64 * 4;             // [kSlots] where a slot's item lies
  static constexpr int kStage = kPos + kSlots * 32;           // [12] a consumer warp's 16 x 64 outputs
  static constexpr int kBars = kStage + 12 * kStageBytes;     // full, empty [kSlots]; qk_full, qk_empty,
  static constexpr int kBytes = kBars + (3 * kSlots + 10) * 8; //  gam_empty, mail_full, mail_free [2]; land [kSlots]
  static constexpr size_t kSmem = size_t(kBytes) + 1024;      // room to align the base
};

// The K index of tile column (state row) 0 of q/k head hq in the CTA whose columns start at k0: k0,
// or (ODD, folded K) k0 - d_k, the box shifted back to the 16-byte boundary, d_k = (hq K) % 8.
template <int ODD>
__device__ __forceinline__ int k_origin(const Sm90Params &P, int k0, int hq) {
  return k0 - (ODD ? hq * P.fk_x % 8 : 0);
}

// What every role of a CTA knows: its shared memory and its part of the work.
template <int KH>
struct Cta {
  using L = Layout<KH>;
  unsigned char *sm;
  uint64_t *full, *empty, *qk_full, *qk_empty, *gam_empty, *mail_full, *mail_free;
  uint64_t *land;  // ODD, folded V: a slot's do, v, dv landed, before their columns past V are zeroed
  float *gam, *red, *part, *mail;
  ItemPos *pos;
  uint32_t rank;          // which KH-wide part of K (0 without a cluster)
  int k0, nk;             // this CTA's columns of K: [k0, k0 + nk)
  int64_t first, stride;  // items first, first + stride, ...

  __device__ Cta(const Sm90Params &P, unsigned char *base) : sm(base) {
    uint64_t *bars = reinterpret_cast<uint64_t *>(sm + L::kBars);
    full = bars, empty = full + L::kSlots, qk_full = empty + L::kSlots, qk_empty = qk_full + 2;
    gam_empty = qk_empty + 2, mail_full = gam_empty + 2, mail_free = mail_full + 2, land = mail_free + 2;
    gam = reinterpret_cast<float *>(sm + L::kGam), red = reinterpret_cast<float *>(sm + L::kRed);
    part = reinterpret_cast<float *>(sm + L::kPart), mail = reinterpret_cast<float *>(sm + L::kMail);
    pos = reinterpret_cast<ItemPos *>(sm + L::kPos);
    rank = P.nsplit > 1 ? blockIdx.x % 2 : 0;
    k0 = int(rank) * KH, nk = min(KH, P.K - k0);
    first = blockIdx.x / P.nsplit, stride = gridDim.x / P.nsplit;
  }
  template <class T> __device__ T *at(int off) const { return reinterpret_cast<T *>(sm + off); }
  template <class T> __device__ T *q(int b) const { return at<T>(L::kQ + b * L::kQK); }  // buffer b
  template <class T> __device__ T *k(int b) const { return at<T>(L::kQ + b * L::kQK + L::kQK / 2); }
};

// The order of a CTA's work: items first, first + stride, ... below P.items, P.G passes an item (a
// value head each), P.VCN stages a pass (64 columns of V). The producer and each consumer warpgroup
// walk it with a scheduler of their own, so they agree on every item, pass and stage (as the
// barriers between them need) by construction. It counts what the roles' buffers turn on: items i
// (the q, k buffer i & 1), passes (gates, row sums, partials, mailbox: pass & 1) and stages st (the
// ring's slot, and how often it was used before).
template <int KH>
struct ItemScheduler {
  const Sm90Params &P;
  const Cta<KH> &c;
  uint32_t pass = 0, st = 0;  // passes and stages before the current ones
  int64_t i = 0, item;        // items before the current one; the current one

  __device__ ItemScheduler(const Sm90Params &P, const Cta<KH> &c) : P(P), c(c), item(c.first) {}
  __device__ bool more() const { return item < P.items; }
  __device__ void next_item() { item += c.stride, ++i; }
  __device__ void next_pass() { ++pass; }
  __device__ void next_stage() { ++st; }
  __device__ uint32_t slot() const { return st % Layout<KH>::kSlots; }
  __device__ uint32_t slot_uses() const { return st / Layout<KH>::kSlots; }
};

// The byte offset of 16-bit element c (< 64) of row r in a tile of 128-byte rows in TMA's 128-byte
// swizzle (16-byte chunk c / 8 of row r at chunk (c / 8) ^ (r % 8)): 2 Swizzled::off(r, c) without its
// term for boxes side by side, which the producer's copy loops paid 16-48 instructions a kernel for.
__device__ __forceinline__ int swizzled_byte(int r, int c) {
  return r * 128 + ((((c >> 3) ^ r) & 7) << 4) + (c & 7) * 2;
}

// fp32 states: a stage's KH x 64 (state_v_first: 64 x KH) of h and dh read W floats a thread at a
// time (16 bytes where the rows allow; coalesced) by the producer warpgroup's 128 threads, rounded
// and stored where TMA's 128-byte swizzle would put them, 16 loads in flight a thread (96 registers;
// the loads are latency-bound: 8 in flight ran at 54% of the floor, 16 at 64%). Rows of the tile are
// K rows (V rows with VF); rows past K or V and columns past V or K are zeros. Tile row (VF: column)
// r is K index k0 + r, tile column (VF: row) c V index 64 s + c; ODD: V index vb + c (k0 and vb
// shifted to the boxes' 16-byte boundaries, kb and 64 s - d_v in produce), indices below 0 zeros too.
// W (4, 2 or 1; ODD only below 4) divides the rows (V, VF: K) and the shifts: a unit lies wholly in or out.
template <class T, int VF, int KH, int ODD = 0, int W = 4>
__device__ __forceinline__ void convert_states(const Sm90Params &P, unsigned char *h_tile, int64_t state, int s,
                                               int k0, int t, int vb = 0) {
  constexpr int kRow = 64 / W, kUnits = 2 * KH * kRow, kBatch = 16;  // units a tile row; h's then dh's
  static_assert(kUnits % (128 * kBatch) == 0, "whole batches");
  using F = std::conditional_t<W == 4, float4, std::conditional_t<W == 2, float2, float>>;
  const int64_t base = state * P.K * P.V;
#pragma unroll 1
  for (int u0 = 0; u0 < kUnits; u0 += 128 * kBatch) {
    F x[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int u = u0 + b * 128 + t, r = (u / kRow) % KH, p = u % kRow;
      const float *src = u < KH * kRow ? P.h32 : P.dh32;
      // the unit's row and first column in the [K, V] (VF: [V, K]) state
      const int row = VF ? (ODD ? vb : 64 * s) + r % 64 : k0 + r;
      const int col = VF ? k0 + 64 * (r / 64) + W * p : (ODD ? vb : 64 * s) + W * p;
      const bool ok = (VF ? row < P.V && col < P.K : row < P.K && col < P.V) && (!ODD || (row >= 0 && col >= 0));
      x[b] = ok ? __ldg(reinterpret_cast<const F *>(src + base + int64_t(row) * (VF ? P.K : P.V) + col)) : F{};
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int u = u0 + b * 128 + t, r = (u / kRow) % KH, p = u % kRow;
      unsigned char *dst =
          h_tile + (u < KH * kRow ? 0 : KH * 128) + swizzled_byte(r, W * p);
      const float *e = reinterpret_cast<const float *>(&x[b]);
      if constexpr (W == 1) {
        *reinterpret_cast<T *>(dst) = from_float<T>(e[0]);
      } else {
        uint32_t w[W / 2];
#pragma unroll
        for (int k = 0; k < W / 2; ++k) {
          const Pack<T, 2> pk = pack_pair<T>(e[2 * k], e[2 * k + 1]);
          memcpy(&w[k], &pk, 4);
        }
        if constexpr (W == 4) *reinterpret_cast<uint2 *>(dst) = make_uint2(w[0], w[1]);
        else *reinterpret_cast<uint32_t *>(dst) = w[0];
      }
    }
  }
  fence_proxy_async();  // the wgmma reads them (async proxy)
}

// ODD, 2-byte pieces: element u of a stage's h then dh, KH x 64 (VF: 64 x KH, rows of V) as
// convert_states lays them out, tile row (VF: column) r at K index kb + r, tile column (VF: row) c at
// V index vb + c: its offset in the state (src) and in the slot's tiles (dst); whether it lies inside
// the state (else a zero is copied in: kb < 0, past K, vb < 0, past V).
template <int KH, int VF>
__device__ __forceinline__ bool state_unit(const Sm90Params &P, int u, int vb, int kb, int64_t &src, int &dst) {
  const int r = u / 64 % KH, p = u % 64;
  // the element's row and column in the [K, V] (VF: [V, K]) state
  const int row = VF ? vb + r % 64 : kb + r, col = (VF ? kb + 64 * (r / 64) : vb) + p;
  src = int64_t(row) * (VF ? P.K : P.V) + col;
  dst = (u < KH * 64 ? 0 : KH * 128) + swizzled_byte(r, p);
  return row >= 0 && col >= 0 && (VF ? row < P.V && col < P.K : row < P.K && col < P.V);
}

// ODD: 2-byte pieces (odd rows: cp.async has no 2-byte form) copied through registers by the producer
// warpgroup's 128 threads (t), 16 loads in flight a thread: unit u (t, t + 128, ...) of kUnits is read
// from src (a zero where unit(u, src, off) says it lies outside the tensor) and stored at dst + off.
// The offsets are worked out twice rather than held: 16 of them would spill the producer's 56 registers.
template <int kUnits, class Unit>
__device__ __forceinline__ void copy_via_registers(unsigned char *dst, int t, Unit unit) {
  constexpr int kBatch = 16;
  static_assert(kUnits % (128 * kBatch) == 0, "whole batches");
#pragma unroll 1
  for (int u0 = 0; u0 < kUnits; u0 += 128 * kBatch) {
    unsigned short x[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const unsigned short *src;
      int off;
      x[b] = unit(u0 + b * 128 + t, src, off) ? __ldg(src) : 0;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const unsigned short *src;
      int off;
      unit(u0 + b * 128 + t, src, off);
      *reinterpret_cast<unsigned short *>(dst + off) = x[b];
    }
  }
}

// ODD: a 64 x 64 box of a row-major 16-bit tensor (src: the box's element (0, 0), row stride ld) cp.async'd
// where TMA's 128-byte swizzle would put it (dst), W (4 or 2) elements a copy, by the producer warpgroup's
// 128 threads (t): box rows in [rlo, rhi) and columns in [clo, chi) copied (W divides the bounds: a copy lies
// wholly in or out), zeros elsewhere (safe: any readable address, given for those). A thread's rows are
// r0 + 8 o + kStep u (kStep = 8 or 4 divides 8): its swizzled offsets and source addresses step by constants,
// set up once, ~8 instructions a copy (recomputed per row they took ~15-20, and the producer warpgroup was the
// limit where everything is copied by hand: bench/notes/gdn.md "GDN v18"). The copies wait on memory, not on their
// issue: each asks L2 for the 256 bytes around it (4.6-6% off the 15-head rows on the H100, "GDN v21").
template <int W>
__device__ __forceinline__ void copy_box(unsigned char *dst, const unsigned short *src, int64_t ld, int rlo, int rhi,
                                         int clo, int chi, const unsigned short *safe, int t) {
  constexpr int kRow = 64 / W, kStep = 128 / kRow;  // copies a row; rows a step
  const int r0 = t / kRow, col = W * (t % kRow), sw = ((col >> 3) ^ r0) & 7;  // r0 < kStep: row r0 + 8 o's swizzle
  const bool col_in = col >= clo && col < chi;
  const unsigned short *s = src + r0 * ld + col;
  unsigned char *d = dst + r0 * 128 + (col & 7) * 2;
#pragma unroll 2
  for (int o = 0; o < 64; o += 8, s += 8 * ld, d += 8 * 128) {
#pragma unroll
    for (int u = 0; u < 8; u += kStep) {  // row r0 + o + u: chunk (col / 8) ^ (r0 + u) = sw ^ u
      const int r = r0 + o + u;
      const bool in = col_in && r >= rlo && r < rhi;
      cp_async_bytes<2 * W, true>(d + u * 128 + ((sw ^ u) << 4), in ? s + u * ld : safe, in);
    }
  }
}

// ODD, hand tiles: a 64 x 64 box of a row-major 16-bit [tokens][ld] tensor (src: the box's first element)
// copied where TMA's 128-byte swizzle would put it (dst), rows < n and columns < nc, zeros elsewhere, W
// elements a copy (W divides nc and the offsets; cp.async for 4 and 2, through registers for 1), by the
// producer warpgroup's 128 threads (t).
template <int W>
__device__ __forceinline__ void hand_box(unsigned char *dst, const unsigned short *src, int64_t ld, int n, int nc,
                                         int t) {
  if constexpr (W == 1) {
    copy_via_registers<64 * 64>(dst, t, [&](int u, const unsigned short *&s, int &o) {
      const int r = u / 64, p = u % 64;
      s = src + r * ld + p, o = swizzled_byte(r, p);
      return r < n && p < nc;
    });
  } else {
    copy_box<W>(dst, src, ld, 0, n, 0, nc, src, t);
  }
}

// Odd K or V: 2-byte pieces, out of line (inlined at both call sites it grows the kernel by ~900
// instructions; the ODD kernels' size is what costs, bench/notes/gdn.md "GDN v14").
[[maybe_unused]] __device__ __noinline__ void hand_box_2byte(unsigned char *dst, const unsigned short *src, int64_t ld,
                                                             int n, int nc, int t) {
  hand_box<1>(dst, src, ld, n, nc, t);
}

// w elements a copy; 1 only in the NARROW (ODD = 2) kernels. (Unused in the sm_80 pass, which compiles
// the kernel to nothing.)
template <bool NARROW>
[[maybe_unused]] __device__ __forceinline__ void hand_tile(unsigned char *dst, const void *src, int64_t off,
                                                           int64_t ld, int n, int nc, int w, int t) {
  const unsigned short *s = static_cast<const unsigned short *>(src) + off;
  if (w == 4) hand_box<4>(dst, s, ld, n, nc, t);
  else if (!NARROW || w == 2) hand_box<2>(dst, s, ld, n, nc, t);
  else hand_box_2byte(dst, s, ld, n, nc, t);
}

// ODD: 16-bit states whose rows TMA cannot take (V, or K with VF, not a multiple of 8): a stage's h
// and dh copied by the producer warpgroup's 128 threads (t) where TMA would put them, P.hw bytes a
// copy (the caller arrives on the stage's full barrier). 8 or 4 bytes: cp.async (zero-filled past V),
// landing through cp.async.mbarrier.arrive.noinc: no registers held, so the whole stage is in flight
// at once (up to 32 copies a thread at KH = 128) while the producer keeps its 56 registers and the
// consumers their 152 (the fp32 loader needs 96 for its 16 loads in flight, which cost the consumers
// 16 and made them spill); the consumers fence the proxies before their wgmma. 2 bytes (odd K or V;
// cp.async has no 2-byte form): through registers, 16 loads in flight a thread (every unit stored:
// skipping those past K spilled 484 bytes).
template <class T, int KH, int VF>
__device__ __forceinline__ void hand_states(const Sm90Params &P, unsigned char *h_tile, int64_t state, int vb, int kb,
                                            int t) {
  using U = unsigned short;
  const U *h = static_cast<const U *>(P.h16) + state * P.K * P.V, *dh = static_cast<const U *>(P.dh16) + state * P.K * P.V;
  auto copy = [&](auto w) {  // w: elements a copy, 4 or 2
    constexpr int W = decltype(w)::value;
    const int nrows = VF ? P.V : P.K, ncols = VF ? P.K : P.V;
#pragma unroll 1
    for (int j = 0; j < KH / 64; ++j) {  // tile rows 64 j.. (VF: K columns 64 j..), as state_unit
      const int row0 = VF ? vb : kb + 64 * j, col0 = VF ? kb + 64 * j : vb;  // the box's origin in the state
      const int64_t o = int64_t(row0) * ncols + col0;
      unsigned char *d = h_tile + 64 * j * 128;
      copy_box<W>(d, h + o, ncols, -row0, nrows - row0, -col0, ncols - col0, h, t);
      copy_box<W>(d + KH * 128, dh + o, ncols, -row0, nrows - row0, -col0, ncols - col0, dh, t);
    }
  };
  if (P.hw == 4) return copy(std::integral_constant<int, 4>());
  if (P.hw == 2) return copy(std::integral_constant<int, 2>());
  constexpr int kUnits = 2 * KH * 64;
  copy_via_registers<kUnits>(h_tile, t, [&](int u, const U *&src, int &dst) {
    int64_t off;
    const bool in = state_unit<KH, VF>(P, u, vb, kb, off, dst);
    src = (u < kUnits / 2 ? h : dh) + off;
    return in;
  });
}

// ODD, folded V: a stage's tile columns j hold V index vb + j (vb = 64 s - d_v); those outside
// [lo, hi) = [-vb, V - vb) of do, v (and dv: `tiles` 64 x 64 tiles at b) hold the previous value
// head's (stage 0 when d_v > 0) or the next one's (past V; zeros past the last head). They meet in the
// sums over V (ds = do v^T, dq, dk, dw), where even zeros on the other side would let a non-finite
// neighbour through: zeroed here, by warps 13-15 (t: 0..95) once the tiles have landed. (Unused in
// the sm_80 pass, which compiles the kernel to nothing.)
[[maybe_unused]] __device__ __forceinline__ void zero_pad(unsigned char *b, int tiles, int lo, int hi, int t) {
  // Per row, only the 16-byte chunks [0, c_lo) (columns below lo) and [c_hi, 8) (from hi), through
  // typed 16-byte accesses (a memcpy here compiled to 16 byte loads and 16 byte stores a chunk).
  const int c_lo = (max(lo, 0) + 7) / 8, c_hi = max(c_lo, min(max(hi, 0) / 8, 8));
  for (int u = t; u < tiles * 64; u += 96) {  // (tile, row)
    const int r = u % 64;
    unsigned char *row = b + u / 64 * kRowTile + r * 128;
    const auto clear = [&](int ch) {
      uint4 *p = reinterpret_cast<uint4 *>(row + ((ch ^ (r & 7)) << 4));
      const auto mask = [&](int e) {  // elements e, e + 1 of the row: kept inside [lo, hi)
        return (e >= lo && e < hi ? 0xffffu : 0u) | (e + 1 >= lo && e + 1 < hi ? 0xffff0000u : 0u);
      };
      uint4 w = *p;
      w.x &= mask(8 * ch), w.y &= mask(8 * ch + 2), w.z &= mask(8 * ch + 4), w.w &= mask(8 * ch + 6);
      *p = w;
    };
    for (int ch = 0; ch < c_lo; ++ch) clear(ch);
    for (int ch = c_hi; ch < 8; ++ch) clear(ch);
  }
  fence_proxy_async();  // the wgmma reads them (async proxy)
}

// The producer warpgroup (pw: its warp, 0..3). Warp 12 (pw 0) loads with TMA. Per item: q, k into
// buffer i % 2 (once item i - 2's epilogues are over); per pass p (value head): its gates into
// buffer p % 2 (once pass p - 2's dg is finished), then its V stages through the ring. Every lane
// of warp 12 arrives on a stage's full barrier, after its gate writes: the consumers read the gates
// once the pass's first stage has landed. With fp32 states (S32) all four warps also convert h and
// dh into the slot and arrive. (No L2 prefetch of the next pass's states: a bulk prefetch a pass
// ahead cost 13% there, 1.104 -> 0.957 ms without it; bench/notes/gdn.md "GDN v10".)
// ODD: all four warps walk the stages and arrive once a warp (5 arrivals with lane 0's expect_tx);
// with hand states or hand do, v, dv each thread also copies its part (and arrives once its cp.async
// copies land, once after its stores through registers: P.stage_async, stage_regs); hand q, k are the
// warpgroup's too, each thread's copies landing on qk_full (128 arrivals); with folded V the last
// stage's do, v, dv land on the slot's land barrier instead, and warps 13-15 zero their columns past V.
template <class T, int KH, int VF, int S32, int ODD>
__device__ __forceinline__ void produce(const Sm90Params &P, const Cta<KH> &c, int pw) {
  using L = Layout<KH>;
  const int lane = threadIdx.x % 32;
  const bool lead = pw == 0;
  uint32_t land_par = 0;  // ODD: bit j, the parity of slot j's land barrier's next phase
  for (ItemScheduler<KH> w(P, c); w.more(); w.next_item()) {
    const ItemPos it(P, w.item);
    const int tok0 = int(it.tok0), qb = int(w.i & 1);
    const int kb = k_origin<ODD>(P, c.k0, it.hq);
    if constexpr (ODD) {
      if (P.hand_qk) {  // the whole warpgroup copies q, k; each thread's copies land on qk_full
        if (w.i >= 2) mbar_wait(&c.qk_empty[qb], uint32_t((w.i >> 1) - 1) & 1);
#pragma unroll 1
        for (int x = 0; x < KH / 32; ++x) {  // q's boxes, then k's (64 columns of K each)
          const int c0 = c.k0 + 64 * (x % (KH / 64));
          hand_tile<ODD == 2>(c.template at<unsigned char>(L::kQ + qb * L::kQK) + x * kRowTile, x < KH / 64 ? P.q16 : P.k16,
                    (it.tok0 * P.H + it.hq) * P.K + c0, int64_t(P.H) * P.K, it.n, P.K - c0, P.qw, 32 * pw + lane);
        }
        if (ODD == 2 && P.qw == 1) mbar_arrive(&c.qk_full[qb]);  // stored through registers
        else cp_async_arrive_noinc(&c.qk_full[qb]);
      }
    }
    if (lead && !(ODD && P.hand_qk)) {
      if (w.i >= 2) mbar_wait(&c.qk_empty[qb], uint32_t((w.i >> 1) - 1) & 1);
      if (lane == 0) {
        mbar_expect_tx(&c.qk_full[qb], L::kQK);
        for (int b = 0; b < KH / 64; ++b) {
          const int x = (ODD ? kb : c.k0) + 64 * b + (ODD ? it.hq * P.fk_x : 0), y = ODD ? it.hq * P.fk_y : it.hq;
          tma_load_3d(c.template q<T>(qb) + b * kRowTile / 2, &P.m_q, x, y, tok0, &c.qk_full[qb]);
          tma_load_3d(c.template k<T>(qb) + b * kRowTile / 2, &P.m_k, x, y, tok0, &c.qk_full[qb]);
        }
      }
    }
    for (int g = 0; g < P.G; ++g, w.next_pass()) {
      const int hv = it.hq * P.G + g, hrow = int(it.cid * P.HV + hv), gb = int(w.pass & 1);
      if (lead) {
        if (w.pass >= 2) mbar_wait(&c.gam_empty[gb], ((w.pass >> 1) - 1) & 1);
        for (int r = lane; r < kTile; r += 32) {
          float gv = 0.f;
          if (P.gated && r < it.n) gv = P.g ? P.g[(it.tok0 + r) * P.HV + hv] : P.g_gamma[hv] * float(r + 1);
          c.gam[gb * 64 + r] = gv;
        }
      }
      for (int s = 0; s < P.VCN; ++s, w.next_stage()) {
        const uint32_t slot = w.slot();
        if (w.st >= L::kSlots) mbar_wait(&c.empty[slot], (w.slot_uses() - 1) & 1);
        unsigned char *b = c.sm + slot * L::kSlot, *h = b + 3 * kRowTile, *dh = h + L::kHTile;
        uint64_t *bar = &c.full[slot];
        const int vb = 64 * s - (ODD ? hv * P.fv_x % 8 : 0);  // tile column 0's V index (ODD: shifted)
        const bool pad = ODD && P.vpad && (vb < 0 || vb + 64 > P.V);  // (ODD) folded V: columns outside V
        const bool tma_states = !S32 && !(ODD && P.hand);
        if (lead && lane == 0) {
          if (g == 0 && s == 0) c.pos[slot] = it;  // the consumers need not locate the item (varlen: a search)
          const uint32_t vbytes = ODD && P.hand_v ? 0 : (P.dw_on ? 3 : 2) * kRowTile;
          uint64_t *vbar = pad ? &c.land[slot] : bar;
          if (pad) mbar_expect_tx(vbar, vbytes);
          mbar_expect_tx(bar, (pad ? 0 : vbytes) + (tma_states ? 2 * L::kHTile : 0));
          const int x = (ODD ? vb : 64 * s) + (ODD ? hv * P.fv_x : 0), y = ODD ? hv * P.fv_y : hv;
          if (!(ODD && P.hand_v)) {
            tma_load_3d(b, &P.m_do, x, y, tok0, vbar);
            tma_load_3d(b + kRowTile, &P.m_v, x, y, tok0, vbar);
            if (P.dw_on) tma_load_3d(b + 2 * kRowTile, &P.m_dv, x, y, tok0, vbar);
          }
          if (tma_states) {
            if (VF) {  // [V, K] states: KH / 64 boxes of 64 rows of V by 64 columns of K
              for (int k = 0; k < KH / 64; ++k) {
                tma_load_3d(h + k * kRowTile, &P.m_h, (ODD ? kb : c.k0) + 64 * k, ODD ? vb : 64 * s, hrow, bar);
                tma_load_3d(dh + k * kRowTile, &P.m_dh, (ODD ? kb : c.k0) + 64 * k, ODD ? vb : 64 * s, hrow, bar);
              }
            } else {  // (ODD: rows kb < 0 out of bounds, zero-filled)
              tma_load_3d(h, &P.m_h, ODD ? vb : 64 * s, ODD ? kb : c.k0, hrow, bar);
              tma_load_3d(dh, &P.m_dh, ODD ? vb : 64 * s, ODD ? kb : c.k0, hrow, bar);
            }
          }
        }
        if constexpr (ODD) {
          if (P.hand_v) {  // do, v, dv of value head hv, V columns [64 s, 64 s + 64)
#pragma unroll 1
            for (int x = 0; x < (P.dw_on ? 3 : 2); ++x)
              hand_tile<ODD == 2>(b + x * kRowTile, x == 0 ? P.do16 : x == 1 ? P.v16 : P.dv16, (it.tok0 * P.HV + hv) * P.V + vb,
                        int64_t(P.HV) * P.V, it.n, P.V - vb, P.vw, 32 * pw + lane);
          }
          if (S32) {
            const int t = 32 * pw + lane;
            if (ODD == 1 || P.sw == 4) convert_states<T, VF, KH, 1, 4>(P, h, hrow, s, kb, t, vb);
            else if (P.sw == 2) convert_states<T, VF, KH, 1, 2>(P, h, hrow, s, kb, t, vb);
            else convert_states<T, VF, KH, 1, 1>(P, h, hrow, s, kb, t, vb);
          } else if (P.hand) {
            hand_states<T, KH, VF>(P, h, hrow, vb, kb, 32 * pw + lane);
          }
          if (P.stage_async) cp_async_arrive_noinc(bar);
          if (P.stage_regs) mbar_arrive(bar);
          if (pad) {
            if (pw > 0) {
              mbar_wait(&c.land[slot], (land_par >> slot) & 1);
              zero_pad(b, P.dw_on ? 3 : 2, -vb, P.V - vb, 32 * (pw - 1) + lane);
            }
            land_par ^= 1u << slot;
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(bar);
        } else if (S32) {
          convert_states<T, VF, KH>(P, h, hrow, s, c.k0, 32 * pw + lane);
          mbar_arrive(bar);
        } else if (lane != 0) {
          mbar_arrive(bar);
        }
        __syncwarp();
      }
    }
  }
}

// Warp 8 after pass p's epilogue: dg of its value head (rows lane and lane + 32) from the row
// sums, the cluster's partials added in rank order, the optional reverse cumsum; then the pass's
// gate buffer is released, and after the item's last pass its q, k buffer.
template <int KH>
__device__ __forceinline__ void finish_dg(const Sm90Params &P, const Cta<KH> &c, const ItemPos &it, int hv,
                                          uint32_t pass, bool last, int64_t i) {
  const int lane = threadIdx.x % 32, par = int(pass & 1);
  if (P.dg_on) {
    const float *red = c.red + par * 128, *part = c.part + par * 8;
    const float dgl = (part[0] + part[1] + part[2] + part[3]) * gexp(c.gam[par * 64 + it.n - 1], P.log2) +
                      part[4] + part[5] + part[6] + part[7];
    float x[2];
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int t = lane + 32 * h2;
      x[h2] = t < it.n ? red[t] - red[64 + t] + (t == it.n - 1 ? dgl : 0.f) : 0.f;
    }
    if (P.nsplit > 1) {  // rank 1's partials into rank 0's mailbox `par`, two passes deep
      const uint32_t use = pass >> 1;
      float *box = c.mail + par * 64;
      if (c.rank == 1) {
        if (use > 0) mbar_wait_cluster(&c.mail_free[par], (use - 1) & 1);
        st_async_peer(&box[lane], x[0], &c.mail_full[par], 0);
        st_async_peer(&box[lane + 32], x[1], &c.mail_full[par], 0);
      } else {
        if (lane == 0) mbar_expect_tx(&c.mail_full[par], 64 * 4);
        mbar_wait(&c.mail_full[par], use & 1);
        x[0] += box[lane];
        x[1] += box[lane + 32];
        __syncwarp();
        if (lane == 0) mbar_arrive_peer(&c.mail_free[par], 1);
      }
    }
    if (c.rank == 0) {
      if (P.reverse_cumsum) {  // suffix sums over the 64 rows, in a fixed order
#pragma unroll
        for (int o = 1; o < 32; o *= 2) {
          const float a = __shfl_down_sync(0xffffffffu, x[0], o), b = __shfl_down_sync(0xffffffffu, x[1], o);
          if (lane + o < 32) x[0] += a, x[1] += b;
        }
        x[0] += __shfl_sync(0xffffffffu, x[1], 0);  // rows 32..63
      }
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int t = lane + 32 * h2;
        if (t < it.n) P.dg[(it.tok0 + t) * P.HV + hv] = x[h2];
      }
    }
  }
  __syncwarp();
  if (lane == 0) {
    mbar_arrive(&c.gam_empty[par]);
    if (last) mbar_arrive(&c.qk_empty[i & 1]);
  }
}

// rs[h] += sum over this thread's columns of acc (rows m0 + lane/4 + 8h) times the same elements
// of a swizzled 64 x KH tile, two columns at a time.
template <class T, int KH>
__device__ __forceinline__ void row_dots(float (&rs)[2], const float (&acc)[KH / 8][4], const T *tile, int m0,
                                         int lane) {
#pragma unroll
  for (int j = 0; j < KH / 8; ++j)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const Pack<T, 2> x = load_pack<T, 2>(tile + Swizzled::off(m0 + lane / 4 + 8 * h2, 8 * j + 2 * (lane % 4)));
      rs[h2] += acc[j][2 * h2] * to_float(x.v[0]) + acc[j][2 * h2 + 1] * to_float(x.v[1]);
    }
}

// ODD, folded K: a q, k tile's columns outside [lo, hi) hold the neighbouring heads' elements; zeroed
// (by the 256 threads of warpgroups 0 and 1, once an item), the products ds k and ds^T q are exact
// zeros there (the states' rows outside [0, K) are zeros too), and row_dots needs no mask.
// hi < lo: none of the CTA's columns is the head's (rank 1 of a cluster where K + d_k <= KH), all zeroed.
template <class T, int KH>
__device__ __forceinline__ void zero_foreign(T *q, T *k, int lo, int hi, int t) {
  hi = max(hi, lo);
  const int nf = lo + KH - hi, r = t / 4;  // foreign columns a row; 4 threads a row
  for (int j = t % 4; j < nf; j += 4) {
    const int off = Swizzled::off(r, j < lo ? j : hi + j - lo);
    q[off] = k[off] = T(0.f);
  }
  fence_proxy_async();  // before TMA refills the buffer
}

// pack_pair as the 32-bit register stmatrix takes.
template <class T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  const Pack<T, 2> pk = pack_pair<T>(a, b);
  uint32_t u;
  memcpy(&u, &pk, 4);
  return u;
}

// A warp's 16 x KH accumulator block (times mul) to rows m0.. of a row-major output (ld elements a
// row; rows < nr, columns < nc, a multiple of 8), 64 columns at a time through the warp's 2 KB of
// shared memory (stmatrix; 16-byte chunks swizzled by row), then 16-byte stores, 8 lanes a row:
// whole 128-byte lines, where the accumulator layout alone gives 4-byte stores, 16 bytes a line.
// ODD: out is the output column of tile column 0 (K index kb = k0 - d_k, the shifted box's), columns
// [lo, nc) are stored (below lo: the previous head's, from nc: the next head's). Folded, dq, dk rows
// start 16-byte aligned (hq K - d_k is a multiple of 8 elements, and so is ld), dw rows with one value
// head a q/k head; otherwise (dw with GVA; q, k by hand: ld = H K not a multiple of 8) rows start 4- or
// 8-byte aligned for even K. The 16-byte pieces wholly inside [lo, nc) are stored in the widest stores
// their address allows, the partial ones at both ends element by element (one small loop: the ODD
// kernels' size is what costs, bench/notes/gdn.md).
template <class T, int KH, int ODD>
__device__ __forceinline__ void store_rows(T *out, int64_t ld, int nr, int lo, int nc, const float (&acc)[KH / 8][4],
                                           float mul, int m0, T *stage, int lane) {
#pragma unroll
  for (int h = 0; h < KH / 64; ++h) {
#pragma unroll
    for (int j = 8 * h; j < 8 * h + 8; j += 2) {
      const uint32_t r[4] = {pack2<T>(acc[j][0] * mul, acc[j][1] * mul), pack2<T>(acc[j][2] * mul, acc[j][3] * mul),
                             pack2<T>(acc[j + 1][0] * mul, acc[j + 1][1] * mul),
                             pack2<T>(acc[j + 1][2] * mul, acc[j + 1][3] * mul)};
      const int mat = lane / 8, row = (mat & 1) * 8 + lane % 8, chunk = j % 8 + (mat >> 1);
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                       smem_addr(stage + row * 64 + 8 * (chunk ^ (row & 7)))),
                   "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                   : "memory");
    }
    __syncwarp();
    if constexpr (ODD) {
#pragma unroll 1
      for (int p = 0; p < 4; ++p) {
        const int row = 4 * p + lane / 8, chunk = lane % 8, col = 64 * h + 8 * chunk;
        const uint4 x = *reinterpret_cast<const uint4 *>(stage + row * 64 + 8 * (chunk ^ (row & 7)));
        T *o = out + (m0 + row) * ld + col;
        if (m0 + row >= nr || col + 8 <= lo || col >= nc) continue;
        const int al = int(reinterpret_cast<uintptr_t>(o) % 16);  // the chunk's alignment (bytes)
        if (col >= lo && col + 8 <= nc && al % 4 == 0) {  // whole: the widest stores its address allows
          // (as asm: plain uint4 / uint2 stores here compiled to four 4-byte ones, in every ODD kernel)
          if (al == 0) {
            Pack<T, 8> pk;
            memcpy(&pk, &x, 16);
            store_pack_global<T, 8>(o, pk);
          } else if (al % 8 == 0) {
            asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(o), "r"(x.x), "r"(x.y) : "memory");
            asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(o + 4), "r"(x.z), "r"(x.w) : "memory");
          } else {
            uint32_t *w = reinterpret_cast<uint32_t *>(o);
            w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
          }
        } else {  // the partial chunks at both ends (and odd-aligned rows) element by element
          T e[8];
          memcpy(e, &x, 16);
#pragma unroll
          for (int k = 0; k < 8; ++k)
            if (col + k >= lo && col + k < nc) o[k] = e[k];
        }
      }
    } else {
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const int row = 4 * p + lane / 8, chunk = lane % 8, col = 64 * h + 8 * chunk;
        const uint4 x = *reinterpret_cast<const uint4 *>(stage + row * 64 + 8 * (chunk ^ (row & 7)));
        if (m0 + row < nr && col < nc) *reinterpret_cast<uint4 *>(out + (m0 + row) * ld + col) = x;
      }
    }
    __syncwarp();
  }
}

// The per-row factor of a pass's dq (ROLE 0: E(g_r) scale) or dk (ROLE 1: E(g_l - g_r), 0 past
// n) for rows m0 + lane / 4 (+ 8). With GVA the accumulators carry the sum over the passes so far:
// before a pass's wgmma they are divided by its factor, after it multiplied by it (sum / f + this
// pass's product, times f), so no second set of 64 registers holds the sum. Hence |f| >= 2^-64
// with GVA: a factor under that adds its pass's (then negligible) product times 2^-64 instead.
template <int ROLE>
__device__ __forceinline__ void row_factors(float (&f)[2], const Sm90Params &P, const float *gam, int n, int m0,
                                            int lane) {
  constexpr float kTiny = 5.421010862e-20f;  // 2^-64
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    const int r = m0 + lane / 4 + 8 * h2;
    float x = ROLE == 0 ? gexp(gam[r], P.log2) * P.scale : r < n ? gexp(gam[n - 1] - gam[r], P.log2) : 0.f;
    if (P.G > 1 && fabsf(x) < kTiny) x = x < 0.f ? -kTiny : kTiny;
    f[h2] = x;
  }
}

template <int NB>
__device__ __forceinline__ void scale_rows(float (&acc)[NB][4], const float (&f)[2]) {
#pragma unroll
  for (int j = 0; j < NB; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] *= f[e / 2];
}

// A consumer warpgroup. ROLE 0: ds[:, 0:32] and dq; 1: ds[:, 32:64] and dk; 2: dw and sum(h dh).
// Per item, one pass per value head (GVA: G of them, dq and dk summed over them in acc).
template <class T, int KH, int VF, int ROLE, int ODD>
__device__ __forceinline__ void consume(const Sm90Params &P, const Cta<KH> &c) {
  using L = Layout<KH>;
  constexpr bool kDs = ROLE < 2;
  const int tid = threadIdx.x, warp = tid / 32, m0 = 16 * (warp % 4);
  const bool mma = ROLE < 2 || P.dw_on;
  for (ItemScheduler<KH> w(P, c); w.more(); w.next_item()) {
    ItemPos it;
    float acc[KH / 8][4];
    float rs_prev[2] = {0.f, 0.f};  // ROLE 0 / 1: this thread's row sums of acc q (acc k) after the last pass
    for (int g = 0; g < P.G; ++g, w.next_pass()) {
      const int par = int(w.pass & 1);
      const float *gam = c.gam + par * 64;
      float ds[kDs ? 4 : 1][4], f[2];
      zero(ds);
      if (ROLE == 2 || g == 0) zero(acc);
      float hdh = 0.f;
      for (int s = 0; s < P.VCN; ++s, w.next_stage()) {
        const uint32_t slot = w.slot();
        mbar_wait(&c.full[slot], w.slot_uses() & 1);
        if constexpr (ODD) {
          if (P.hand || P.hand_v) fence_proxy_async();  // copied by hand (generic proxy), read by the wgmma
        }
        if (g == 0 && s == 0) it = c.pos[slot];
        if (kDs && s == 0) {  // the gates landed with this stage
          row_factors<ROLE>(f, P, gam, it.n, m0, tid % 32);
          if (g > 0) {
            const float inv[2] = {1.f / f[0], 1.f / f[1]};
            scale_rows(acc, inv);
          }
        }
        const T *b = c.template at<T>(slot * L::kSlot);
        const T *do_t = b, *v_t = b + kRowTile / 2, *dv_t = b + kRowTile, *h_t = b + 3 * kRowTile / 2;
        const T *dh_t = h_t + L::kHTile / 2;
        auto sum_hdh = [&] {  // sum(h * dh) while the wgmma runs: the same swizzle in both tiles
          if constexpr (ROLE != 2) return;
          if (!P.dg_on) return;
          for (int e = tid - 2 * 128; e < KH * 8; e += 128) {
            const Pack<T, 8> x = load_pack<T, 8>(h_t + 8 * e), y = load_pack<T, 8>(dh_t + 8 * e);
#pragma unroll
            for (int k = 0; k < 8; ++k) hdh += to_float(x.v[k]) * to_float(y.v[k]);
          }
          fence_proxy_async();  // before TMA refills the slot
        };
        if (mma) {
          const uint64_t da = wgmma_desc(ROLE == 0 ? do_t : ROLE == 1 ? v_t : dv_t);
          const T *bt = ROLE == 1 ? dh_t : h_t;
          const uint64_t db = VF ? wgmma_desc_n_major(bt) : wgmma_desc(bt);
          const uint64_t dsa = wgmma_desc(do_t), dsb = wgmma_desc(v_t + 32 * 64 * ROLE);
          constexpr int kStepB = VF ? 128 : 2;  // 16 rows of V: 2048 bytes (N-major) or 32 bytes (K-major)
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            if constexpr (kDs) Wgmma<T, 32>::run(ds, dsa + 2 * kk, dsb + 2 * kk);
            Wgmma<T, KH, VF>::run(acc, da + 2 * kk, db + kStepB * kk);
          }
          wgmma_commit();
          sum_hdh();
          wgmma_wait<0>();
          wgmma_pin(acc);
          wgmma_pin(ds);
        } else {
          sum_hdh();
        }
        __syncwarp();
        if (tid % 32 == 0) mbar_arrive(&c.empty[slot]);
      }

      // Epilogue. The lane is re-read here so that the compiler cannot hoist the many addresses
      // derived from it out of the item loop (they would be spilled, and spills miss L1).
      const int lane = lane_id(), n = it.n, hv = it.hq * P.G + g;
      // this CTA's tile columns [klo, khi) are the K indices kb + j in [0, K)
      const int kb = k_origin<ODD>(P, c.k0, it.hq), klo = ODD ? max(0, -kb) : 0;
      const int khi = ODD ? min(KH, P.K - kb) : c.nk;
      T *stage = c.template at<T>(L::kStage + warp * kStageBytes);
      float *red = c.red + par * 128, *part = c.part + par * 8;
      if constexpr (kDs) {
        const int qb = int(w.i & 1);
        mbar_wait(&c.qk_full[qb], uint32_t(w.i >> 1) & 1);
        T *ds_s = c.template at<T>(L::kDs);
        T *q_s = c.template q<T>(qb), *k_s = c.template k<T>(qb);
        if constexpr (ODD) {
          if (g == 0 && P.fk_x) zero_foreign<T, KH>(q_s, k_s, klo, khi, tid);  // read after kBarDs
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const int r = m0 + lane / 4 + 8 * h2, col = 32 * ROLE + 8 * j + 2 * (lane % 4);
            float x[2];
#pragma unroll
            for (int e = 0; e < 2; ++e)  // a select, never a multiply by a mask: E(g_t - g_s) overflows
              x[e] = col + e <= r && r < n ? ds[j][2 * h2 + e] * gexp(gam[r] - gam[col + e], P.log2) * P.scale : 0.f;
            store_pack<T, 2>(ds_s + Swizzled::off(r, col), pack_pair<T>(x[0], x[1]));
          }
        named_barrier(kBarDs, 256);
        scale_rows(acc, f);
        float dglk[2] = {-rs_prev[0], -rs_prev[1]};  // WG1: sum(dk_inter * k) of this pass, part of dg's last row
        if (ROLE == 1 && P.dg_on) row_dots<T, KH>(dglk, acc, k_s, m0, lane);
        if (ROLE == 0)
          warp_mma<T, false, true, KH / 8, Swizzled, Swizzled>(acc, ds_s, k_s, m0, 0, lane);
        else
          warp_mma<T, true, true, KH / 8, Swizzled, Swizzled>(acc, ds_s, q_s, m0, 0, lane);
        if (P.dg_on) {  // row sums of this pass's dq q (WG0) or dk k (WG1): those of acc, less the last pass's
          float rs[2] = {0.f, 0.f};
          row_dots<T, KH>(rs, acc, ROLE == 0 ? q_s : k_s, m0, lane);
          float d[2] = {rs[0] - rs_prev[0], rs[1] - rs_prev[1]};
          rs_prev[0] = rs[0], rs_prev[1] = rs[1];
#pragma unroll
          for (int o = 1; o < 4; o *= 2) {
            d[0] += __shfl_xor_sync(0xffffffffu, d[0], o);
            d[1] += __shfl_xor_sync(0xffffffffu, d[1], o);
          }
          if (lane % 4 == 0) {
            red[ROLE * 64 + m0 + lane / 4] = d[0];
            red[ROLE * 64 + m0 + lane / 4 + 8] = d[1];
          }
          if (ROLE == 1) {
            float x = dglk[0] + dglk[1];
#pragma unroll
            for (int o = 1; o < 32; o *= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
            if (lane == 0) part[4 + warp % 4] = x;
          }
        }
        if (g == P.G - 1) {
          T *out = static_cast<T *>(ROLE == 0 ? P.dq : P.dk) + (it.tok0 * P.H + it.hq) * P.K + kb;
          store_rows<T, KH, ODD>(out, int64_t(P.H) * P.K, n, klo, khi, acc, 1.f, m0, stage, lane);
        }
      } else {
        if (P.dw_on)
          store_rows<T, KH, ODD>(static_cast<T *>(P.dw) + (it.tok0 * P.HV + hv) * P.K + kb, int64_t(P.HV) * P.K, n,
                                 klo, khi, acc, -1.f, m0, stage, lane);
#pragma unroll
        for (int o = 1; o < 32; o *= 2) hdh += __shfl_xor_sync(0xffffffffu, hdh, o);
        if (lane == 0) part[warp % 4] = hdh;
      }
      named_barrier(kBarEpi, kConsumers);
      if constexpr (!kDs) {
        if (warp == 8) finish_dg(P, c, it, hv, w.pass, g == P.G - 1, w.i);
        named_barrier(kBarWg2, 128);  // warps 9-11 wait for warp 8 (their wgmma is one warpgroup's)
      }
    }  // value heads
  }
}

template <class T, int KH, int VF, int S32, int ODD>
__global__ void __launch_bounds__(kThreads90, 1) dqkwg_sm90_kernel(const __grid_constant__ Sm90Params P) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  const Cta<KH> c(P, smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024));
  const int warp = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0);  // provably warp-uniform roles
  if (threadIdx.x == 0) {
    // full: warp 12's lanes (lane 0's with the TMA bytes); with fp32 states, every producer thread
    // once it has converted its part, and lane 0 of warp 12 once more with the bytes; ODD: lane 0
    // with the bytes and each producer warp once (and each producer thread once or twice for the
    // hand copies)
    for (int s = 0; s < Layout<KH>::kSlots; ++s) {
      mbar_init(&c.full[s], ODD ? 5 + 128 * (int(P.stage_async) + int(P.stage_regs)) : S32 ? 129 : 32);
      mbar_init(&c.empty[s], kConsumers / 32);
      if (ODD) mbar_init(&c.land[s], 1);
    }
    for (int s = 0; s < 2; ++s) {
      mbar_init(&c.qk_full[s], ODD && P.hand_qk ? 128 : 1), mbar_init(&c.qk_empty[s], 1);
      mbar_init(&c.gam_empty[s], 1);
      mbar_init(&c.mail_full[s], 1), mbar_init(&c.mail_free[s], 1);
    }
  }
  __syncthreads();
  if (P.nsplit > 1) cluster_barrier();  // the peer's barriers are ready before any message
  // 128 registers a thread at launch; the producer's warpgroup gives most of its share to the
  // consumers, whose accumulators need it (the register file is split in four: 56 + 3 x 152 words
  // per sub-partition a thread; with fp32 states the producer keeps 96 for its loads in flight,
  // 96 + 3 x 136).
  constexpr int kProducerRegs = S32 ? 96 : 56, kConsumerRegs = (512 - kProducerRegs) / 3 / 8 * 8;  // multiples of 8
  if (warp >= kConsumers / 32) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    if (S32 || ODD || warp == kConsumers / 32) produce<T, KH, VF, S32, ODD>(P, c, warp - kConsumers / 32);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
    if (warp < 4) consume<T, KH, VF, 0, ODD>(P, c);
    else if (warp < 8) consume<T, KH, VF, 1, ODD>(P, c);
    else consume<T, KH, VF, 2, ODD>(P, c);
  }
  if (P.nsplit > 1) cluster_barrier();  // no CTA leaves while its peer may still signal it
#endif
}

}  // namespace

// The host side: launches and the choice of kernel (dqkwg.cu asks sm90_takes).
namespace {

constexpr const char *kFn = "gdn_bwd_dqkwg";

template <class T, int KH, int VF, int S32, int ODD>
hl_status_t launch_sm90(const Sm90Params &p, hl_stream_t stream) {
  auto kernel = dqkwg_sm90_kernel<T, KH, VF, S32, ODD>;
  constexpr size_t smem = Layout<KH>::kSmem;
  // Once per device and shape: the shared-memory limit, and how many CTAs (or clusters of two)
  // are resident; 0 if the kernel cannot run.
  static std::atomic<int> cache[2][hl::dev::kMaxDevices];
  const int units = hl::dev::per_device(cache[p.nsplit - 1], [&](int) {
    int n = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) == cudaSuccess) {
      cudaLaunchAttribute probe_attr;
      const cudaLaunchConfig_t probe = hl::dev::cluster_launch(p.nsplit, kThreads90, smem, p.nsplit, nullptr, probe_attr);
      if (p.nsplit == 1) n = hl::dev::blocks_per_sm(kernel, kThreads90, smem) * hl::dev::sm_count();
      else if (cudaOccupancyMaxActiveClusters(&n, kernel, &probe) != cudaSuccess) n = 0;
    }
    if (n < 1) (void)cudaGetLastError(), n = 0;
    return n;
  });
  if (units < 1) return fail(HL_STATUS_CUDA_ERROR, "the sm_90a kernel cannot be resident");
  cudaLaunchAttribute attr;
  const int64_t grid = std::min<int64_t>(units, p.items) * p.nsplit;
  const cudaLaunchConfig_t cfg =
      hl::dev::cluster_launch(grid, kThreads90, smem, p.nsplit, static_cast<cudaStream_t>(stream), attr);
  HL_CUDA_TRY(cudaLaunchKernelEx(&cfg, kernel, p));
  HL_CUDA_TRY_LAUNCH();
  return HL_STATUS_SUCCESS;
}

template <class T, int KH>
hl_status_t launch_sm90(const Sm90Params &p, bool vf, bool s32, int odd, hl_stream_t stream) {
  const auto by_odd = [&](auto vf_, auto s32_) {
    constexpr int VF = decltype(vf_)::value, S32 = decltype(s32_)::value;
    if (odd == 2) return launch_sm90<T, KH, VF, S32, 2>(p, stream);
    if (odd == 1) return launch_sm90<T, KH, VF, S32, 1>(p, stream);
    return launch_sm90<T, KH, VF, S32, 0>(p, stream);
  };
  using Zero = std::integral_constant<int, 0>;
  using One = std::integral_constant<int, 1>;
  if (s32) return vf ? by_odd(One(), One()) : by_odd(Zero(), One());
  return vf ? by_odd(One(), Zero()) : by_odd(Zero(), Zero());
}

template <class T>
hl_status_t launch_sm90(const Sm90Params &p, int KH, bool vf, bool s32, int odd, hl_stream_t stream) {
  return KH == 64 ? launch_sm90<T, 64>(p, vf, s32, odd, stream) : launch_sm90<T, 128>(p, vf, s32, odd, stream);
}

}  // namespace

// Every K, V (up to 256), state dtype and layout: K or V not a multiple of 8 runs the ODD kernels (folded
// maps where their row strides, H K and HV V, are multiples of 8 elements and folded K boxes fit two
// 128-wide CTAs, else q, k or do, v, dv copied by hand). What it needs: 16-byte aligned tensors, int32
// TMA coordinates and a 9.0 device.
bool sm90_takes(const hl_gdn_bwd_dqkwg_args_t &a, int64_t chunks) {
#if HL_SM90A
  if (forced_kernel() == Forced::kPortable) return false;
  if (a.B * a.T >= INT32_MAX || chunks * a.HV >= INT32_MAX) return false;  // TMA coordinates are int32
  for (const void *p : std::initializer_list<const void *>{a.q, a.k, a.v, a.do_, a.h, a.dh, a.dq, a.dk})
    if (!aligned16(p)) return false;
  if (a.dw && !(aligned16(a.dv) && aligned16(a.dw))) return false;
  return hl::dev::device_is_sm90() && hl::dev::tensor_maps_available();
#else
  (void)a, (void)chunks;
  return false;
#endif
}

hl_status_t cuda_dqkwg_sm90(const hl_gdn_bwd_dqkwg_args_t &a, const ChunkTable &table, int64_t chunks,
                            hl_stream_t stream) {
  Sm90Params p{};
  const uint64_t H = uint64_t(a.H), HV = uint64_t(a.HV), K = uint64_t(a.K), V = uint64_t(a.V);
  const uint64_t tokens = uint64_t(a.B * a.T);
  const bool vf = a.flags & HL_GDN_STATE_V_FIRST, s32 = a.h_dtype == HL_DTYPE_F32;
  // How each tensor travels, the CTAs' shape and the kernel variant (config.h).
  const Sm90Shape sh = sm90_shape(a.H, a.HV, a.K, a.V, s32, vf);
  // [tokens][heads][width] in 64 x 64 boxes: (width, heads, tokens), or folded (K or V not a multiple
  // of 8) as (heads width, 1, tokens), a head's box at column h width.
  const auto head_map = [&](CUtensorMap *m, const void *x, uint64_t width, uint64_t heads, bool fold) {
    const uint64_t row = heads * width * 2;
    return fold ? encode_map(kFn, m, a.dtype, x, heads * width, 1, tokens, row, row, 64, 1, 64)
                : encode_map(kFn, m, a.dtype, x, width, heads, tokens, width * 2, row, 64, 1, 64);
  };
  if (sh.hand_v) {
    p.hand_v = true, p.do16 = a.do_, p.v16 = a.v, p.dv16 = a.dv, p.vw = sh.vw;
  } else {
    HL_TRY(head_map(&p.m_do, a.do_, V, HV, sh.fold_v));
    HL_TRY(head_map(&p.m_v, a.v, V, HV, sh.fold_v));
    if (a.dw) HL_TRY(head_map(&p.m_dv, a.dv, V, HV, sh.fold_v));
  }
  if (sh.hand_qk) {
    p.hand_qk = true, p.q16 = a.q, p.k16 = a.k, p.qw = sh.qw;
  } else {
    HL_TRY(head_map(&p.m_q, a.q, K, H, sh.fold_k));
    HL_TRY(head_map(&p.m_k, a.k, K, H, sh.fold_k));
  }
  p.fk_x = sh.fold_k ? int(K) : 0, p.fk_y = sh.fold_k ? 0 : 1, p.fv_x = sh.fold_v ? int(V) : 0, p.fv_y = sh.fold_v ? 0 : 1;
  p.vpad = sh.fold_v;
  const uint64_t states = uint64_t(chunks) * HV;
  if (s32) {  // read by the producer warpgroup, not TMA
    p.h32 = static_cast<const float *>(a.h), p.dh32 = static_cast<const float *>(a.dh);
  } else if (sh.hand_states) {  // (odd) copied by the producer warpgroup, as wide as the rows allow
    p.hand = true, p.h16 = a.h, p.dh16 = a.dh, p.hw = sh.hw;
  } else if (vf) {  // [V, K] per state: 64 x 64 boxes
    HL_TRY(encode_map(kFn, &p.m_h, a.dtype, a.h, K, V, states, K * 2, K * V * 2, 64, 64, 1));
    HL_TRY(encode_map(kFn, &p.m_dh, a.dtype, a.dh, K, V, states, K * 2, K * V * 2, 64, 64, 1));
  } else {
    HL_TRY(encode_map(kFn, &p.m_h, a.dtype, a.h, V, K, states, V * 2, K * V * 2, 64, uint32_t(sh.KH), 1));
    HL_TRY(encode_map(kFn, &p.m_dh, a.dtype, a.dh, V, K, states, V * 2, K * V * 2, 64, uint32_t(sh.KH), 1));
  }
  // arrivals on a stage's full barrier a producer thread: after its cp.async copies, after its stores
  p.sw = sh.sw;
  p.stage_async = sh.stage_async, p.stage_regs = sh.stage_regs;
  p.dq = a.dq, p.dk = a.dk, p.dw = a.dw, p.dg = a.dg, p.g = a.g, p.g_gamma = a.g_gamma;
  p.chunks = table;
  p.items = chunks * a.H;
  p.H = int(a.H), p.HV = int(a.HV), p.G = int(a.HV / a.H), p.K = int(a.K), p.V = int(a.V);
  p.VCN = sh.VCN;
  p.nsplit = sh.nsplit;
  p.scale = a.scale;
  p.gated = a.gate != HL_GDN_GATE_NONE, p.log2 = is_log2(a.gate), p.dg_on = has_dg(a.gate);
  p.dw_on = a.dw != nullptr, p.reverse_cumsum = a.reverse_cumsum != 0;
  if (a.dtype == HL_DTYPE_BF16) return launch_sm90<__nv_bfloat16>(p, sh.KH, vf, s32, sh.odd, stream);
  return launch_sm90<__half>(p, sh.KH, vf, s32, sh.odd, stream);
}

}  // namespace hl::gdn::dev
