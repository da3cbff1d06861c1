// Host-side element access for the CPU reference backend: every float dtype read as double and
// written with one rounding (round-to-nearest-even), so the backend is dtype-agnostic; integer
// data read exactly.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "headloss.h"

namespace hl::cpu {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    float f = std::ldexp(float(man), -24);
    return sign ? -f : f;
  }
  uint32_t u = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112u) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to infinity (>= 65520)
  if (a < 0x38800000u) {                                   // subnormal or zero in fp16
    float af;
    std::memcpy(&af, &a, 4);
    return uint16_t(sign | uint16_t(std::nearbyint(af * 16777216.0f)));  // units of 2^-24, RNE
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);  // round mantissa to 10 bits, nearest even
  return uint16_t(sign | ((r - 0x38000000u) >> 13));
}

inline double load(const void *p, hl_dtype_t dt, int64_t i) {
  switch (dt) {
    case HL_DTYPE_F32: return static_cast<const float *>(p)[i];
    case HL_DTYPE_F16: return f16_to_float(static_cast<const uint16_t *>(p)[i]);
    case HL_DTYPE_BF16: return bf16_to_float(static_cast<const uint16_t *>(p)[i]);
    default: return NAN;
  }
}

// An integer datum (I32 or I64: labels, ids, cu_seqlens) exactly: never through a double, which
// rounds values past 2^53.
inline int64_t load_int(const void *p, hl_dtype_t dt, int64_t i) {
  return dt == HL_DTYPE_I64 ? static_cast<const int64_t *>(p)[i] : static_cast<const int32_t *>(p)[i];
}

inline void store(void *p, hl_dtype_t dt, int64_t i, double v) {
  switch (dt) {
    case HL_DTYPE_F32: static_cast<float *>(p)[i] = float(v); break;
    case HL_DTYPE_F16: static_cast<uint16_t *>(p)[i] = float_to_f16(float(v)); break;
    case HL_DTYPE_BF16: static_cast<uint16_t *>(p)[i] = float_to_bf16(float(v)); break;
    default: break;
  }
}

// v rounded to dtype dt (identity for F32 apart from the fp32 rounding).
inline double round_to(hl_dtype_t dt, double v) {
  switch (dt) {
    case HL_DTYPE_F16: return f16_to_float(float_to_f16(float(v)));
    case HL_DTYPE_BF16: return bf16_to_float(float_to_bf16(float(v)));
    default: return double(float(v));
  }
}

}  // namespace hl::cpu
