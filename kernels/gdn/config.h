// Every tuning choice of gdn_bwd_dqkwg's CUDA kernels, and its environment switch, host-only (plain
// C++17: the launchers take their choices from here, and tests/c/test_config.cpp prints and checks
// them without a GPU). The reasons, with the measurements, are in docs/gdn.md, "Tuning choices".
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "hl/gdn/facts.h"

namespace hl::gdn {

// HEADLOSS_GDN_KERNEL=portable forces the portable kernel (tests, A/B); =sm90 makes a call the Hopper
// kernel does not take fail instead (tests: which kernel ran). Read on every call, so that tests can
// switch kernels.
enum class Forced { kNone, kPortable, kSm90 };
inline Forced forced_kernel() {
  const char *e = std::getenv("HEADLOSS_GDN_KERNEL");
  if (e && std::strcmp(e, "portable") == 0) return Forced::kPortable;
  if (e && std::strcmp(e, "sm90") == 0) return Forced::kSm90;
  return Forced::kNone;
}

// The portable kernel: CTAs of kThreads (two an SM), V in kVC-column stages through kStages buffers
// (two loads in flight during compute).
constexpr int kThreads = 256;
constexpr int kStages = 3;
constexpr int kVC = 32;
// Its K slices of one item form a cluster where the device runs the sm_90 code.
inline int portable_split(int k_slices, bool clusters) { return k_slices > 1 && clusters ? k_slices : 1; }
// Elements a copy of its 16-bit tensors: the widest of 8, 4, 2, 1 that divides K and V, for
// pointers aligned to `align` bytes (the most of 16, 8, 4, 2 they all are).
inline int portable_copy(int64_t K, int64_t V, int align) {
  int w = 8;
  while (w > 1 && (K % w || V % w || 2 * w > align)) w /= 2;
  return w;
}

// Elements a hand copy (a load: fp32 states) for rows of n elements: 4, 2 or 1, as n allows.
inline int elements_a_copy(int64_t n) { return n % 4 == 0 ? 4 : n % 2 == 0 ? 2 : 1; }
// Folded K (or V) not a multiple of 8: the most a head's box starts before its index 0, (h K) % 8 over
// heads h (multiples of gcd(K, 8)).
inline int64_t shift_max(int64_t K) {
  int64_t g = 8;
  while (K % g) g /= 2;
  return 8 - g;
}

// The Hopper kernel's shape for H q/k heads and HV value heads of K and V, fp32 states (s32) or
// 16-bit, states [V][K] (vf) or [K][V].
struct Sm90Shape {
  // K (V) not a multiple of 8: q, k (do, v, dv) through folded maps where H K (HV V) is a multiple of
  // 8 and (K) folded boxes fit two CTAs, else copied by hand, qw (vw) elements a copy.
  bool hand_qk, hand_v, fold_k, fold_v;
  int qw, vw;
  bool hand_states;  // 16-bit states whose rows TMA cannot map, copied by hand, hw elements a copy
  int hw;
  int sw;            // elements a state copy of the producer warps (fp32 states)
  bool stage_async, stage_regs;  // a stage's hand copies arrive after cp.async, after register stores
  int64_t Kc, Vc;    // indices the CTAs cover: K (V) and, folded, the shift of a head's boxes
  int KH;            // K rows a CTA: 64 or 128
  int nsplit;        // CTAs an item (a cluster over K)
  int VCN;           // 64-wide V stages a pass
  int odd;           // 0; 1: K or V not a multiple of 8; 2: pieces under 4 bytes (kernels of their own)
};
inline Sm90Shape sm90_shape(int64_t H, int64_t HV, int64_t K, int64_t V, bool s32, bool vf) {
  Sm90Shape s{};
  s.hand_qk = K % 8 && ((H * K) % 8 || K + shift_max(K) > kMaxDim);
  s.hand_v = V % 8 && (HV * V) % 8;
  s.fold_k = K % 8 && !s.hand_qk, s.fold_v = V % 8 && !s.hand_v;
  s.qw = s.hand_qk ? elements_a_copy(K) : 0;
  s.vw = s.hand_v ? elements_a_copy(V) : 0;
  s.hand_states = !s32 && (vf ? K : V) % 8 != 0;
  s.hw = s.hand_states ? elements_a_copy(vf ? K : V) : 0;
  s.sw = elements_a_copy(vf ? K : V);
  s.stage_async = (s.hand_v && s.vw > 1) || (s.hand_states && s.hw > 1);
  s.stage_regs = (s.hand_v && s.vw == 1) || (s.hand_states && s.hw == 1);
  s.Kc = K + (s.fold_k ? shift_max(K) : 0), s.Vc = V + (s.fold_v ? shift_max(V) : 0);
  s.KH = s.Kc <= 64 ? 64 : 128;
  s.nsplit = int((s.Kc + s.KH - 1) / s.KH);
  s.VCN = int((s.Vc + 63) / 64);
  const bool narrow = (s.hand_qk && s.qw == 1) || (s.hand_v && s.vw == 1) || (s32 && s.sw < 4);
  s.odd = narrow ? 2 : K % 8 || V % 8 ? 1 : 0;
  return s;
}

inline std::string describe(const Sm90Shape &s) {
  const auto how = [](bool hand, bool fold, int w) {
    return hand ? "by hand (" + std::to_string(w) + " elements a copy)" : fold ? std::string("folded maps") : std::string("maps");
  };
  std::string d = "KH " + std::to_string(s.KH) + ", " + std::to_string(s.nsplit) + " CTA" + (s.nsplit > 1 ? "s" : "") +
                  " an item, " + std::to_string(s.VCN) + " V stages, ODD " + std::to_string(s.odd) + "; q, k " +
                  how(s.hand_qk, s.fold_k, s.qw) + "; do, v, dv " + how(s.hand_v, s.fold_v, s.vw);
  if (s.hand_states) d += "; states by hand (" + std::to_string(s.hw) + " elements a copy)";
  return d;
}

}  // namespace hl::gdn
