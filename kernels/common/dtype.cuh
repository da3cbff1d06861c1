// Device-side dtype plumbing: the C++ type behind each hl_dtype_t, fp32 conversions, 16-byte
// vector packs, and a dispatcher that turns a run-time dtype into a template argument.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "headloss.h"

namespace hl::dev {

template <class T> struct TypeTag { using type = T; };

// Calls f(TypeTag<T>{}) for the float dtype dt; false if dt is not a float dtype.
template <class F>
bool dispatch_float(hl_dtype_t dt, F &&f) {
  switch (dt) {
    case HL_DTYPE_F32: f(TypeTag<float>{}); return true;
    case HL_DTYPE_F16: f(TypeTag<__half>{}); return true;
    case HL_DTYPE_BF16: f(TypeTag<__nv_bfloat16>{}); return true;
    default: return false;
  }
}

// The dtype code of T (one of the three float types).
template <class T>
constexpr hl_dtype_t kDtypeOf = std::is_same_v<T, float> ? HL_DTYPE_F32 : std::is_same_v<T, __half> ? HL_DTYPE_F16 : HL_DTYPE_BF16;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// N floats rounded to T, two at a time for the 16-bit types (one conversion instruction a pair).
template <class T, int N>
__device__ __forceinline__ void from_floats(const float *f, T *out) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(f[k], f[k + 1]);
      out[k] = h.x, out[k + 1] = h.y;
    }
  } else if constexpr (std::is_same_v<T, __half> && N % 2 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      const __half2 h = __floats2half2_rn(f[k], f[k + 1]);
      out[k] = h.x, out[k + 1] = h.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = from_float<T>(f[k]);
  }
}

// v rounded to T and back: where a casting mode rounds an intermediate.
template <class T> __device__ __forceinline__ float round_to(float v) { return to_float(from_float<T>(v)); }

// Reads element i of a float array whose dtype is known only at run time.
__device__ __forceinline__ float load_as_float(const void *p, hl_dtype_t dt, int64_t i) {
  switch (dt) {
    case HL_DTYPE_F16: return __half2float(static_cast<const __half *>(p)[i]);
    case HL_DTYPE_BF16: return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
    default: return static_cast<const float *>(p)[i];
  }
}

// Writes element i of a float array whose dtype is known only at run time.
__device__ __forceinline__ void store_from_float(void *p, hl_dtype_t dt, int64_t i, float v) {
  switch (dt) {
    case HL_DTYPE_F16: static_cast<__half *>(p)[i] = __float2half_rn(v); break;
    case HL_DTYPE_BF16: static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float *>(p)[i] = v; break;
  }
}

// N elements of T moved as one access (16 bytes when N * sizeof(T) == 16).
template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// The N elements of a pack as floats. bf16 by moving bits (one instruction an element; the
// generic conversion spends two on every odd element: a byte permute, then a shift).
template <class T, int N>
__device__ __forceinline__ void to_floats(const Pack<T, N> &p, float (&f)[N]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
    uint32_t w[N / 2];
    memcpy(w, p.v, sizeof(w));
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      f[2 * k] = __uint_as_float(w[k] << 16);
      f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = to_float(p.v[k]);
  }
}

// Two floats rounded to T, as one pack.
template <class T>
__device__ __forceinline__ Pack<T, 2> pack_pair(float a, float b) {
  Pack<T, 2> p;
  p.v[0] = from_float<T>(a);
  p.v[1] = from_float<T>(b);
  return p;
}

template <class T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T *p) {
  return *reinterpret_cast<const Pack<T, N> *>(p);
}
template <class T, int N>
__device__ __forceinline__ void store_pack(T *p, const Pack<T, N> &v) {
  if constexpr (sizeof(v) == 16) {
    // Through a uint4: a pack assembled from converted pairs is otherwise stored as four 4-byte
    // stores (seen in the loss kernel's SASS: 4x the L2 sectors).
    uint4 u;
    memcpy(&u, &v, 16);
    *reinterpret_cast<uint4 *>(p) = u;
  } else {
    *reinterpret_cast<Pack<T, N> *>(p) = v;
  }
}

// store_pack to global memory, a 16-byte pack as one instruction. Even through store_pack's uint4,
// the compiler split some packs assembled from converted elements into 2- and 4-byte stores (the
// RMSNorm backward's clusters: a row's first pack). The asm also moves the compiler's schedule.
template <class T, int N>
__device__ __forceinline__ void store_pack_global(T *p, const Pack<T, N> &v) {
  if constexpr (sizeof(v) == 16) {
    uint4 u;
    memcpy(&u, &v, 16);
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(u.x), "r"(u.y), "r"(u.z), "r"(u.w)
                 : "memory");
  } else {
    store_pack(p, v);
  }
}

}  // namespace hl::dev
