// The per-block arithmetic of paged attention (paged_decode.cpp, paged_decode_quant.cpp): one work item
// walks a run of one request's blocks for one KV head, keeping for its G query heads a running max, sum
// and weighted V sum (online softmax, rescaled once per block; the AVX-512 paths once per run).
// This file: the constants, the portable loops and the 16-bit widening; attend_blocks_avx512.h the AVX-512
// paths; decode_splits.h the dispatch.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvserve_attention {

// Built with -ffast-math (vectorized expf from libmvec), which assumes finite values: masked scores and
// empty maxima use this finite sentinel instead of -inf; exp(kEmpty - anything finite) is 0.
constexpr float kEmpty = -1e30f;
constexpr int64_t kMaxBlock = 256;  // block_size bound for the per-block score buffer
constexpr int64_t kMaxGroup = 64;   // query heads per KV head
constexpr int64_t kMaxHeadDim = 512;  // head_dim bound for the quantized path's per-channel parameters

template <int64_t N>
inline float dot_fixed(const float* a, const float* b) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < N; ++i) sum += a[i] * b[i];
  return sum;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// One work item: query heads qh[0..G) (each D wide) over blocks [lo, hi) of one request and KV head.
// Per block: every K row is read once for all G heads, the block's scores get one max and one
// vectorized exp per head, and every V row is read once for all G heads.
// A block of a 16-bit cache is widened to fp32 once (into `buffer`); an fp32 block is used where it lies.
// Decode attention over a long context is bound by memory bandwidth, so a 16-bit cache (half the bytes)
// pays only if widening is cheap: fp16 with the CPU's conversion instructions (a scalar c10::Half
// conversion made the fp16 kernel 2.4x slower than fp32), bf16 as a 16-bit shift the compiler vectorizes.
template <typename T>  // any other dtype the dispatch instantiates (double): plain conversion
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void widen(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;  // bf16 is fp32's top half
}

template <typename scalar_t>
inline const float* as_float(const scalar_t* src, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else {
    widen(src, buffer, n);
    return buffer;
  }
}

template <typename scalar_t, int64_t FixedD>
void attend_blocks(const float* qh, int64_t G, int64_t D, const scalar_t* kp, const scalar_t* vp,
                   const int64_t* blocks, const bool* valid, int64_t lo, int64_t hi, int64_t KVH, int64_t h,
                   int64_t BS, float scale, float* m, float* l, float* acc) {
  float scores[kMaxGroup * kMaxBlock];
  // Called once per block: the widening buffers are kept per thread, not allocated per call.
  thread_local std::vector<float> k_buffer, v_buffer;
  if (!std::is_same_v<scalar_t, float> && static_cast<int64_t>(k_buffer.size()) < BS * D) {
    k_buffer.resize(BS * D);
    v_buffer.resize(BS * D);
  }
  for (int64_t idx = lo; idx < hi; ++idx) {
    const int64_t base = (blocks[idx] * KVH + h) * BS;
    const bool* row_valid = valid + idx * BS;
    const float* k_block = as_float(kp + base * D, k_buffer.data(), BS * D);
    for (int64_t r = 0; r < BS; ++r) {
      const float* krow = k_block + r * D;
      for (int64_t g = 0; g < G; ++g) {
        const float score = FixedD ? dot_fixed<FixedD>(qh + g * D, krow) : dot(qh + g * D, krow, D);
        scores[g * BS + r] = row_valid[r] ? score * scale : kEmpty;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores + g * BS;
      float block_max = kEmpty;
      for (int64_t r = 0; r < BS; ++r) block_max = std::max(block_max, sg[r]);
      if (block_max <= kEmpty) continue;  // no visible row in this block
      const float new_max = std::max(m[g], block_max);
      const float correction = std::exp(m[g] - new_max);
      float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t r = 0; r < BS; ++r) {
        sg[r] = std::exp(sg[r] - new_max);  // masked rows: exp(kEmpty - max) = 0
        block_sum += sg[r];
      }
      l[g] = l[g] * correction + block_sum;
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) ag[i] *= correction;
      m[g] = new_max;
    }
    const float* v_block = as_float(vp + base * D, v_buffer.data(), BS * D);
    for (int64_t r = 0; r < BS; ++r) {
      if (!row_valid[r]) continue;
      const float* vrow = v_block + r * D;
      for (int64_t g = 0; g < G; ++g) {
        if (m[g] > kEmpty) axpy(scores[g * BS + r], vrow, acc + g * D, FixedD ? FixedD : D);
      }
    }
  }
}

}  // namespace kvserve_attention
