// How fast can a kernel shaped like the loss bulk kernel copy memory? A device-to-device copy of
// 2.1 GB (8192 x 128256 bf16) in several shapes, timed side by side:
//   ldg          grid-stride 16-byte loads then stores (what torch's copy_ does)
//   ring S C     the loss kernel's pipeline without math or merges: persistent CTAs (C per SM)
//                walk rows of 64 KB through a ring of S 16 KB slots filled by bulk copies;
//                every thread reads its packs from shared memory and stores them (STG.128);
//                a slot is refilled, chunk g + S, once all warps have read it
//   tma S C      the same ring, stores by bulk copies from shared memory (one thread does all)
//   ringtma S C  threads read and write the slot back in place, then one bulk store (the shape
//                a kernel with math and TMA stores would have)
// Build: nvcc -std=c++17 -O3 -arch=sm_90a -Ikernels bench/experiments/copy_ceiling.cu -o /tmp/cc
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/bulk_copy.cuh"

using namespace hl::dev;

constexpr int kThreads = 256, kChunk = 16 * 1024, kPacks = kChunk / 16, kRowChunks = 4;
constexpr int kMaxSlots = 16;

#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e = (x);                                                              \
    if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } \
  } while (0)

// Cache hints: 0 none; 1 .cs (streaming) loads and stores; 2 L2 evict_first policy both ways;
// 3 L2::256B prefetch on loads, evict_first stores.
__device__ __forceinline__ uint64_t evict_first() {
  uint64_t p;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
template <int HINT>
__device__ __forceinline__ uint4 ld16(const uint4 *p, uint64_t pol) {
  uint4 v;
  if (HINT == 0) v = *p;
  else if (HINT == 1) v = __ldcs(p);
  else if (HINT == 2)
    asm volatile("ld.global.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  else
    asm volatile("ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
template <int HINT>
__device__ __forceinline__ void st16(uint4 *p, uint4 v, uint64_t pol) {
  if (HINT == 0) *p = v;
  else if (HINT == 1) __stcs(p, v);
  else
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;" ::"l"(p), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol) : "memory");
}

template <int HINT>
__global__ void __launch_bounds__(kThreads) ldg_copy(const uint4 *src, uint4 *dst, int64_t n) {
  const uint64_t pol = evict_first();
  const int64_t stride = int64_t(gridDim.x) * kThreads * 4;
  for (int64_t i = int64_t(blockIdx.x) * kThreads * 4 + threadIdx.x; i < n; i += stride) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (i + k * kThreads < n) v[k] = ld16<HINT>(src + i + k * kThreads, pol);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (i + k * kThreads < n) st16<HINT>(dst + i + k * kThreads, v[k], pol);
  }
}

// Bulk load with an L2 evict_first hint.
__device__ __forceinline__ void bulk_load_ef(void *dst, const void *src, uint32_t bytes, uint64_t *bar, uint64_t pol) {
  mbar_expect_tx(bar, bytes);
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(pol) : "memory");
}

__device__ __forceinline__ void bulk_store(void *dst, const void *src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// MODE 0: threads store (STG); 1: thread 0 alone, bulk stores; 2: threads write back, bulk store.
template <int MODE, int HINT = 0>
__global__ void __launch_bounds__(kThreads) ring_copy(const char *src, char *dst, int64_t rows,
                                                      int slots) {
  extern __shared__ uint4 buf[];
  __shared__ uint64_t full[kMaxSlots], empty[kMaxSlots];
  const int tid = threadIdx.x;
  const uint64_t pol = evict_first();
  const auto load = [&](void *d, const void *sp, uint64_t *bar) {
    if (HINT) bulk_load_ef(d, sp, kChunk, bar, pol);
    else bulk_load(d, sp, kChunk, bar);
  };
  const int64_t first = blockIdx.x, step = gridDim.x;
  const int64_t nrows = rows > first ? (rows - first + step - 1) / step : 0;
  const int64_t G = nrows * kRowChunks;  // this CTA's chunks
  const auto gaddr = [&](int64_t g) {   // byte offset of this CTA's chunk g
    return ((first + (g / kRowChunks) * step) * kRowChunks + g % kRowChunks) * int64_t(kChunk);
  };
  if (tid == 0) {
    for (int s = 0; s < slots; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], MODE == 0 ? kThreads / 32 : 1);
    for (int g = 0; g < slots && g < G; ++g) load(buf + g * kPacks, src + gaddr(g), &full[g]);
  }
  __syncthreads();
  if (MODE == 1) {
    if (tid != 0) return;
    for (int64_t g = 0; g < G; ++g) {
      const int s = int(g % slots);
      mbar_wait(&full[s], uint32_t(g / slots) & 1);
      bulk_store(dst + gaddr(g), buf + s * kPacks, kChunk);
      bulk_wait_read<1>();  // store g - 1 has read its slot: refill it
      if (g >= 1 && g - 1 + slots < G) {
        const int sp = int((g - 1) % slots);
        load(buf + sp * kPacks, src + gaddr(g - 1 + slots), &full[sp]);
      }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    const int s = int(g % slots);
    const uint32_t par = uint32_t(g / slots) & 1;
    mbar_wait(&full[s], par);
    uint4 *b = buf + s * kPacks;
    if (MODE == 0) {
      uint4 *d = reinterpret_cast<uint4 *>(dst + gaddr(g));
#pragma unroll
      for (int k = 0; k < kPacks / kThreads; ++k) st16<HINT>(d + tid + k * kThreads, b[tid + k * kThreads], pol);
      __syncwarp();
      if (tid % 32 == 0) mbar_arrive(&empty[s]);
      if (tid == 0 && g + slots < G) {
        mbar_wait(&empty[s], par);
        load(b, src + gaddr(g + slots), &full[s]);
      }
    } else {  // MODE 2
#pragma unroll
      for (int k = 0; k < kPacks / kThreads; ++k) {
        uint4 v = b[tid + k * kThreads];
        v.x ^= 1u;  // stands for the math
        b[tid + k * kThreads] = v;
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();
      if (tid == 0) {
        bulk_store(dst + gaddr(g), b, kChunk);
        bulk_wait_read<1>();
        if (g >= 1 && g - 1 + slots < G) {
          const int sp = int((g - 1) % slots);
          load(buf + sp * kPacks, src + gaddr(g - 1 + slots), &full[sp]);
        }
      }
    }
  }
  if (MODE == 2 && tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Two passes over each 64 KB row, as the loss kernel makes them, memory only: pass 1 reads the
// row, a serial section (thread 0 spins `delay` cycles, as merges and finish_row do) separates it
// from pass 2, which writes the row out. REGS = false: the row stays in its ring slots until pass
// 2 has read them (the loss kernel today: slots = 4, one row). REGS = true: pass 1 moves each
// thread's packs into registers (16 a thread) and frees its slot at once, so the ring prefetches
// the next rows while this one is finished and written.
template <bool REGS>
__global__ void __launch_bounds__(kThreads, REGS ? 2 : 3) two_pass(const char *src, char *dst, int64_t rows,
                                                                   int slots, int delay) {
  extern __shared__ uint4 buf[];
  __shared__ uint64_t full[kMaxSlots], empty[kMaxSlots];
  __shared__ uint32_t sink;
  const int tid = threadIdx.x;
  const int64_t first = blockIdx.x, step = gridDim.x;
  const int64_t nrows = rows > first ? (rows - first + step - 1) / step : 0;
  const int64_t G = nrows * kRowChunks;
  const auto gaddr = [&](int64_t g) {
    return ((first + (g / kRowChunks) * step) * kRowChunks + g % kRowChunks) * int64_t(kChunk);
  };
  if (tid == 0) {
    for (int s = 0; s < slots; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], kThreads / 32);
    for (int g = 0; g < slots && g < G; ++g) bulk_load(buf + g * kPacks, src + gaddr(g), kChunk, &full[g]);
  }
  __syncthreads();
  const auto release = [&](int64_t g) {
    const int s = int(g % slots);
    __syncwarp();
    if (tid % 32 == 0) mbar_arrive(&empty[s]);
    if (tid == 0 && g + slots < G) {
      mbar_wait(&empty[s], uint32_t(g / slots) & 1);
      bulk_load(buf + s * kPacks, src + gaddr(g + slots), kChunk, &full[s]);
    }
  };
  constexpr int P = kPacks / kThreads;  // packs a thread per chunk
  for (int64_t it = 0; it < nrows; ++it) {
    const int64_t g0 = it * kRowChunks;
    uint4 v[kRowChunks * P];
    uint32_t acc = 0;
#pragma unroll
    for (int c = 0; c < kRowChunks; ++c) {
      const int64_t g = g0 + c;
      mbar_wait(&full[g % slots], uint32_t(g / slots) & 1);
      const uint4 *b = buf + (g % slots) * kPacks;
#pragma unroll
      for (int k = 0; k < P; ++k) {
        v[c * P + k] = b[tid + k * kThreads];
        acc ^= v[c * P + k].x;
      }
      if (REGS) release(g);
    }
    // the serial section: a block reduction, then thread 0 alone
    acc = __reduce_xor_sync(0xffffffffu, acc);
    if (tid % 32 == 0) atomicXor(&sink, acc);
    __syncthreads();
    if (tid == 0) {
      const long long t0 = clock64();
      while (clock64() - t0 < delay) {}
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kRowChunks; ++c) {
      const int64_t g = g0 + c;
      uint4 *d = reinterpret_cast<uint4 *>(dst + gaddr(g));
      const uint4 *b = buf + (g % slots) * kPacks;
#pragma unroll
      for (int k = 0; k < P; ++k) d[tid + k * kThreads] = REGS ? v[c * P + k] : b[tid + k * kThreads];
      if (!REGS) release(g);
    }
  }
}

int main(int argc, char **argv) {
  const int64_t bytes = int64_t(8192) * 128256 * 2 / (kChunk * kRowChunks) * (kChunk * kRowChunks);
  const int64_t rows = bytes / (kChunk * kRowChunks);
  char *src, *dst;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMemset(src, 1, bytes));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  const auto time = [&](auto launch) {
    std::vector<float> t;
    for (int i = 0; i < 25; ++i) {
      CK(cudaEventRecord(a));
      launch();
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float ms;
      CK(cudaEventElapsedTime(&ms, a, b));
      if (i >= 5) t.push_back(ms);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const float base = time([&] { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); });
  const auto show = [&](const char *label, float ms) {
    printf("%-40s %.3f ms  %6.0f GB/s  %5.1f%%\n", label, ms, 2.0 * bytes / ms / 1e6, 100.0 * base / ms);
  };
  show("cudaMemcpy", base);
  // Every byte copied? (ringtma flips one bit a pack by design.) Samples three places.
  const auto verify = [&](const char *name, bool flip) {
    std::vector<unsigned char> h(bytes / 1024);
    for (int64_t off : {int64_t(0), bytes / 2 - 4096, bytes - int64_t(h.size())}) {
      CK(cudaMemcpy(h.data(), dst + off, h.size(), cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < h.size(); ++i)
        if (h[i] != (flip && (off + i) % 16 == 0 ? 0 : 1)) { printf("%s: byte %lld wrong\n", name, (long long)(off + i)); break; }
    }
    CK(cudaMemset(dst, 0, bytes));
  };
  for (int per : {4, 8})
    for (int h = 0; h < 4; ++h) {
      const int g = sms * per;
      const uint4 *s4 = (const uint4 *)src;
      uint4 *d4 = (uint4 *)dst;
      const int64_t n = bytes / 16;
      const float ms = h == 0 ? time([&] { ldg_copy<0><<<g, kThreads>>>(s4, d4, n); })
                     : h == 1 ? time([&] { ldg_copy<1><<<g, kThreads>>>(s4, d4, n); })
                     : h == 2 ? time([&] { ldg_copy<2><<<g, kThreads>>>(s4, d4, n); })
                              : time([&] { ldg_copy<3><<<g, kThreads>>>(s4, d4, n); });
      char label[64];
      snprintf(label, sizeof label, "ldg hint=%d blocks/SM=%d", h, per);
      show(label, ms);
    }
  for (int regs = 0; regs < 2; ++regs) {
    const void *k = regs ? (const void *)two_pass<true> : (const void *)two_pass<false>;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    for (int delay : {0, 2000, 5000})
      for (int slots : {4, 6, 8, 12}) {
        const int per = regs ? (slots <= 6 ? 2 : 1) : 3;
        if (!regs && slots != 4) continue;
        const size_t smem = size_t(slots) * kChunk;
        int fit = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, k, kThreads, smem));
        const float ms = regs ? time([&] { two_pass<true><<<sms * per, kThreads, smem>>>(src, dst, rows, slots, delay); })
                              : time([&] { two_pass<false><<<sms * per, kThreads, smem>>>(src, dst, rows, slots, delay); });
        verify("two_pass", false);
        char label[80];
        snprintf(label, sizeof label, "2pass %s S=%d C=%d(fit %d) delay=%d", regs ? "regs" : "smem", slots, per, fit, delay);
        show(label, ms);
      }
  }
  if (argc > 1) return 0;  // the two-pass shapes alone
  for (int h = 1; h < 3; ++h) {
    const void *k = h == 1 ? (const void *)ring_copy<0, 1> : (const void *)ring_copy<0, 2>;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    for (int slots : {4, 6})
      for (int per : {2, 3}) {
        if (slots == 6 && per == 3) continue;
        const size_t smem = size_t(slots) * kChunk;
        const float ms = h == 1 ? time([&] { ring_copy<0, 1><<<sms * per, kThreads, smem>>>(src, dst, rows, slots); })
                                : time([&] { ring_copy<0, 2><<<sms * per, kThreads, smem>>>(src, dst, rows, slots); });
        char label[64];
        snprintf(label, sizeof label, "ring hint=%d S=%d C=%d", h, slots, per);
        show(label, ms);
      }
  }
  const void *kernels[3] = {(const void *)ring_copy<0>, (const void *)ring_copy<1>, (const void *)ring_copy<2>};
  const char *names[3] = {"ring", "tma", "ringtma"};
  for (int m = 0; m < 3; ++m) {
    CK(cudaFuncSetAttribute(kernels[m], cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    for (int slots : {4, 6, 12}) {
      for (int per_sm : {1, 2, 3}) {
        const size_t smem = size_t(slots) * kChunk;
        int fit = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernels[m], kThreads, smem));
        if (fit < per_sm) continue;
        const int grid = sms * per_sm;
        float ms;
        if (m == 0) ms = time([&] { ring_copy<0><<<grid, kThreads, smem>>>(src, dst, rows, slots); });
        else if (m == 1) ms = time([&] { ring_copy<1><<<grid, kThreads, smem>>>(src, dst, rows, slots); });
        else ms = time([&] { ring_copy<2><<<grid, kThreads, smem>>>(src, dst, rows, slots); });
        verify(names[m], m == 2);
        char label[64];
        snprintf(label, sizeof label, "%s S=%d C=%d", names[m], slots, per_sm);
        show(label, ms);
      }
    }
  }
  return 0;
}
