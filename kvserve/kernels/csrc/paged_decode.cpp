// Decode attention that reads the paged K/V blocks (fp32, fp16 or bf16) where they lie.
//
// One query token per request. Work items are (request, split): a split is a
// run of the request's blocks, walked block by block for every KV head, so
// one long request still keeps every thread busy. For each KV head an item
// keeps, for the G query heads sharing it, a running max, sum and weighted V
// sum (online softmax, rescaled once per block); the splits of a request are
// merged at the end. Nothing is gathered or copied: each K/V row is read once
// per (request, KV head). Threads: at::parallel_for (OpenMP; kernels/build.py).
#include "kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// Built with -ffast-math (vectorized expf from libmvec), which assumes finite values: masked scores and
// empty maxima use this finite sentinel instead of -inf; exp(kEmpty - anything finite) is 0.
constexpr float kEmpty = -1e30f;
constexpr int64_t kMaxBlock = 256;  // block_size bound for the per-block score buffer
constexpr int64_t kMaxGroup = 64;   // query heads per KV head
constexpr int64_t kMaxHeadDim = 512;  // head_dim bound for the quantized path's per-channel parameters
constexpr int64_t kPrefetchBlocks = 1;

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

#if defined(__AVX512F__)
// The AVX-512 path for head_dim a multiple of 16 and blocks of whole 16-row tiles (every common shape).
// The scalar-loop kernel above reached ~2 MACs per cycle: each score was a dot product ending in a
// horizontal reduction, and each V row's update went through memory. Here a tile's 16 scores come out of
// one transposing reduction tree, the G heads' accumulators stay in registers over a block, and a 16-bit
// block is widened as it is loaded.
namespace avx512 {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is fp32's top half
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// e^x for x <= 0 (scores less their running max; the masked sentinel gives 0): n = round(x / ln 2),
// r = x - n ln 2 in two parts (|r| <= 0.35), e^r by its degree-7 Taylor polynomial (error < 1e-8
// relative), scaled by 2^n. Relative error ~1 ulp, where the 2^(x log2 e) shortcut loses digits.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // e^-104 underflows to 0 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 16 vectors -> one vector whose lane i is the sum of v[i]'s lanes: a transposing add tree
// (15 adds, 30 shuffles for 16 dot products, against ~8 dependent operations per product reduced alone),
// in two halves so that a caller can reduce four rows at a time.
inline __m512 sum_quad(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then that lane's sums of a, b, c, d
  const __m512d ab = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)));
  const __m512d cd = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d)));
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
}

inline __m512 sum_lanes(__m512 y0, __m512 y1, __m512 y2, __m512 y3) {  // four sum_quad results -> 16 sums
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y2, y3, 0x88), _mm512_shuffle_f32x4(y2, y3, 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

inline __m512 sum_each(const __m512* v) {
  return sum_lanes(sum_quad(v[0], v[1], v[2], v[3]), sum_quad(v[4], v[5], v[6], v[7]),
                   sum_quad(v[8], v[9], v[10], v[11]), sum_quad(v[12], v[13], v[14], v[15]));
}

inline __mmask16 visible_rows(const bool* valid) {
  __mmask16 mask = 0;
  for (int r = 0; r < 16; ++r) mask |= static_cast<__mmask16>(valid[r] ? 1 : 0) << r;
  return mask;
}

// Each 16-row tile's visible rows of one block (`valid`: its BS flags); false when none is visible.
inline bool visible_tiles(const bool* valid, int64_t tiles, __mmask16* visible) {
  bool any_visible = false;
  for (int64_t t = 0; t < tiles; ++t) {
    visible[t] = visible_rows(valid + t * 16);
    any_visible |= visible[t] != 0;
  }
  return any_visible;
}

// As attend_blocks, for D = 16 * NC and BS a multiple of 16.
template <typename scalar_t, int NC>
void attend_blocks(const float* qh, int64_t G, const scalar_t* kp, const scalar_t* vp, const int64_t* blocks,
                   const bool* valid, int64_t lo, int64_t hi, int64_t KVH, int64_t h, int64_t BS, float scale,
                   float* m, float* l, float* acc) {
  constexpr int64_t D = 16 * NC;
  const int64_t tiles = BS / 16;
  alignas(64) float probs[kMaxBlock];
  __mmask16 visible[kMaxBlock / 16];
  for (int64_t idx = lo; idx < hi; ++idx) {
    const int64_t base = (blocks[idx] * KVH + h) * BS * D;
    const scalar_t* kb = kp + base;
    const scalar_t* vb = vp + base;
    if (!visible_tiles(valid + idx * BS, tiles, visible)) continue;
    for (int64_t g = 0; g < G; ++g) {
      __m512 q[NC];
      for (int c = 0; c < NC; ++c) q[c] = _mm512_mul_ps(_mm512_loadu_ps(qh + g * D + 16 * c), _mm512_set1_ps(scale));
      __m512 tile_max = _mm512_set1_ps(kEmpty);
      for (int64_t t = 0; t < tiles; ++t) {
        __m512 dots[16];
        for (int r = 0; r < 16; ++r) {
          const scalar_t* row = kb + (t * 16 + r) * D;
          __m512 d = _mm512_mul_ps(q[0], load16(row));
          for (int c = 1; c < NC; ++c) d = _mm512_fmadd_ps(q[c], load16(row + 16 * c), d);
          dots[r] = d;
        }
        // Hidden rows (possibly never written: any bits at all) become the sentinel.
        const __m512 s = _mm512_mask_blend_ps(visible[t], _mm512_set1_ps(kEmpty), sum_each(dots));
        _mm512_store_ps(probs + t * 16, s);
        tile_max = _mm512_max_ps(tile_max, s);
      }
      const float new_max = std::max(m[g], _mm512_reduce_max_ps(tile_max));
      const float correction = std::exp(m[g] - new_max);
      __m512 sums = _mm512_setzero_ps();
      for (int64_t t = 0; t < tiles; ++t) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(probs + t * 16), _mm512_set1_ps(new_max)));
        _mm512_store_ps(probs + t * 16, p);
        sums = _mm512_add_ps(sums, p);
      }
      l[g] = l[g] * correction + _mm512_reduce_add_ps(sums);
      m[g] = new_max;
      float* ag = acc + g * D;
      __m512 a[NC];
      for (int c = 0; c < NC; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(ag + 16 * c), _mm512_set1_ps(correction));
      for (int64_t t = 0; t < tiles; ++t) {
        const bool all_visible = visible[t] == 0xFFFF;
        for (int r = 0; r < 16; ++r) {
          // A hidden row's weight is 0, but its V may be NaN (never written): skip it, do not multiply.
          if (!all_visible && !((visible[t] >> r) & 1)) continue;
          const __m512 p = _mm512_set1_ps(probs[t * 16 + r]);
          const scalar_t* row = vb + (t * 16 + r) * D;
          for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(p, load16(row + 16 * c), a[c]);
        }
      }
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(ag + 16 * c, a[c]);
    }
  }
}

// The same for a group size G known at compile time with G * NC <= 16: every K and V row is loaded
// (and widened) once for all G heads instead of once per head, the heads' queries and accumulators
// staying in registers (G * NC each). Zen 4 issues one 512-bit load per cycle, so the per-head path
// was bound by its loads.
template <typename scalar_t, int NC, int G>
void attend_blocks_grouped(const float* qh, const scalar_t* kp, const scalar_t* vp, const int64_t* blocks,
                           const bool* valid, int64_t lo, int64_t hi, int64_t KVH, int64_t h, int64_t BS,
                           float scale, float* m, float* l, float* acc) {
  constexpr int64_t D = 16 * NC;
  const int64_t tiles = BS / 16;
  alignas(64) float probs[G][kMaxBlock];
  __mmask16 visible[kMaxBlock / 16];
  __m512 q[G][NC];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NC; ++c) q[g][c] = _mm512_mul_ps(_mm512_loadu_ps(qh + g * D + 16 * c), _mm512_set1_ps(scale));
  }
  for (int64_t idx = lo; idx < hi; ++idx) {
    const int64_t base = (blocks[idx] * KVH + h) * BS * D;
    const scalar_t* kb = kp + base;
    const scalar_t* vb = vp + base;
    if (!visible_tiles(valid + idx * BS, tiles, visible)) continue;
    float block_max[G];
    for (int g = 0; g < G; ++g) block_max[g] = kEmpty;
    for (int64_t t = 0; t < tiles; ++t) {
      __m512 quads[G][4];
      for (int quad = 0; quad < 4; ++quad) {
        __m512 dots[G][4];
        for (int r = 0; r < 4; ++r) {
          const scalar_t* row = kb + (t * 16 + quad * 4 + r) * D;
          for (int c = 0; c < NC; ++c) {
            const __m512 k = load16(row + 16 * c);
            for (int g = 0; g < G; ++g) dots[g][r] = c ? _mm512_fmadd_ps(q[g][c], k, dots[g][r]) : _mm512_mul_ps(q[g][c], k);
          }
        }
        for (int g = 0; g < G; ++g) quads[g][quad] = sum_quad(dots[g][0], dots[g][1], dots[g][2], dots[g][3]);
      }
      for (int g = 0; g < G; ++g) {
        // Hidden rows (possibly never written: any bits at all) become the sentinel.
        const __m512 s = _mm512_mask_blend_ps(visible[t], _mm512_set1_ps(kEmpty),
                                              sum_lanes(quads[g][0], quads[g][1], quads[g][2], quads[g][3]));
        _mm512_store_ps(probs[g] + t * 16, s);
        block_max[g] = std::max(block_max[g], _mm512_reduce_max_ps(s));
      }
    }
    __m512 a[G][NC];
    for (int g = 0; g < G; ++g) {
      const float new_max = std::max(m[g], block_max[g]);
      const float correction = std::exp(m[g] - new_max);
      __m512 sums = _mm512_setzero_ps();
      for (int64_t t = 0; t < tiles; ++t) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(probs[g] + t * 16), _mm512_set1_ps(new_max)));
        _mm512_store_ps(probs[g] + t * 16, p);
        sums = _mm512_add_ps(sums, p);
      }
      l[g] = l[g] * correction + _mm512_reduce_add_ps(sums);
      m[g] = new_max;
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * c), _mm512_set1_ps(correction));
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const bool all_visible = visible[t] == 0xFFFF;
      for (int r = 0; r < 16; ++r) {
        // A hidden row's weight is 0, but its V may be NaN (never written): skip it, do not multiply.
        if (!all_visible && !((visible[t] >> r) & 1)) continue;
        const scalar_t* row = vb + (t * 16 + r) * D;
        for (int c = 0; c < NC; ++c) {
          const __m512 v = load16(row + 16 * c);
          for (int g = 0; g < G; ++g) a[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(probs[g][t * 16 + r]), v, a[g][c]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
    }
  }
}

}  // namespace avx512
#endif

// One work item on the fastest path built for its shape.
template <typename scalar_t>
void attend_item(const float* qh, int64_t G, int64_t D, const scalar_t* kp, const scalar_t* vp,
                 const int64_t* blocks, const bool* valid, int64_t lo, int64_t hi, int64_t KVH, int64_t h,
                 int64_t BS, float scale, float* m, float* l, float* acc) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::Half> ||
                std::is_same_v<scalar_t, c10::BFloat16>) {
    if (BS % 16 == 0) {
#define KVSERVE_GROUPED(NC_, G_) \
  if (D == 16 * NC_ && G == G_) \
    return avx512::attend_blocks_grouped<scalar_t, NC_, G_>(qh, kp, vp, blocks, valid, lo, hi, KVH, h, BS, scale, m, l, acc);
      KVSERVE_GROUPED(4, 1) KVSERVE_GROUPED(4, 2) KVSERVE_GROUPED(4, 3) KVSERVE_GROUPED(4, 4)
      KVSERVE_GROUPED(2, 1) KVSERVE_GROUPED(2, 2) KVSERVE_GROUPED(2, 4) KVSERVE_GROUPED(2, 8)
      KVSERVE_GROUPED(8, 1) KVSERVE_GROUPED(8, 2)
#undef KVSERVE_GROUPED
      if (D == 256) {
        return avx512::attend_blocks<scalar_t, 16>(qh, G, kp, vp, blocks, valid, lo, hi, KVH, h, BS, scale, m, l, acc);
      }
      if (D == 64) {
        return avx512::attend_blocks<scalar_t, 4>(qh, G, kp, vp, blocks, valid, lo, hi, KVH, h, BS, scale, m, l, acc);
      }
      if (D == 128) {
        return avx512::attend_blocks<scalar_t, 8>(qh, G, kp, vp, blocks, valid, lo, hi, KVH, h, BS, scale, m, l, acc);
      }
      if (D == 32) {
        return avx512::attend_blocks<scalar_t, 2>(qh, G, kp, vp, blocks, valid, lo, hi, KVH, h, BS, scale, m, l, acc);
      }
    }
  }
#endif
  // head_dim as a constant where it is common: the dot products unroll fully.
  if (D == 64) {
    attend_blocks<scalar_t, 64>(qh, G, D, kp, vp, blocks, valid, lo, hi, KVH, h, BS, scale, m, l, acc);
  } else if (D == 128) {
    attend_blocks<scalar_t, 128>(qh, G, D, kp, vp, blocks, valid, lo, hi, KVH, h, BS, scale, m, l, acc);
  } else {
    attend_blocks<scalar_t, 0>(qh, G, D, kp, vp, blocks, valid, lo, hi, KVH, h, BS, scale, m, l, acc);
  }
}

// The splits of each (request, KV head) merged into one output row per query head: [B, H * D].
torch::Tensor merge_splits(int64_t B, int64_t H, int64_t KVH, int64_t S, int64_t G, int64_t D,
                           const std::vector<float>& part_max, const std::vector<float>& part_sum,
                           const std::vector<float>& part_acc, const torch::TensorOptions& options) {
  auto out = torch::empty({B, H * D}, options);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / KVH, h = bh % KVH;
      for (int64_t g = 0; g < G; ++g) {
        float global_max = kEmpty;
        for (int64_t s = 0; s < S; ++s) global_max = std::max(global_max, part_max[(bh * S + s) * G + g]);
        float* o = op + (b * H + h * G + g) * D;
        std::fill(o, o + D, 0.f);
        float total = 0.f;
        for (int64_t s = 0; s < S; ++s) {
          const int64_t p = (bh * S + s) * G + g;
          if (part_max[p] <= kEmpty) continue;
          const float w = std::exp(part_max[p] - global_max);
          total += part_sum[p] * w;
          axpy(w, &part_acc[p * D], o, D);
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t i = 0; i < D; ++i) o[i] *= inv;
      }
    }
  });
  return out;
}

}  // namespace

// q [B, H, D] fp32; k_cache, v_cache [num_blocks, KVH, block_size, D] (fp32 / fp16 / bf16, contiguous);
// block_ids [NB] (int64, request by request); seq_offsets [B + 1] (int64: request b's
// blocks are block_ids[seq_offsets[b] : seq_offsets[b + 1]]); key_valid [NB, block_size]
// (bool: rows the query may see). Returns [B, H * D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_ids,
                           torch::Tensor seq_offsets, torch::Tensor key_valid, double scale, int64_t num_splits) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode: fp32 queries only");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode: K and V caches of one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: contiguous cache");
  q = q.contiguous();
  block_ids = block_ids.contiguous();
  seq_offsets = seq_offsets.contiguous();
  key_valid = key_valid.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "paged_decode: shapes disagree");
  const int64_t G = H / KVH;
  TORCH_CHECK(G <= kMaxGroup && BS <= kMaxBlock, "paged_decode: group or block size too large");
  const int64_t S = std::max<int64_t>(num_splits, 1);

  // Partials per (request, KV head, split): max and sum per query head, and the weighted V sums.
  std::vector<float> part_max(B * KVH * S * G, kEmpty), part_sum(B * KVH * S * G, 0.f);
  std::vector<float> part_acc(B * KVH * S * G * D, 0.f);

  const float* qp = q.data_ptr<float>();
  const int64_t* blocks = block_ids.data_ptr<int64_t>();
  const int64_t* offsets = seq_offsets.data_ptr<int64_t>();
  const bool* valid = key_valid.data_ptr<bool>();
  const float fscale = static_cast<float>(scale);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "paged_decode", [&] {
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  at::parallel_for(0, B * S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / S, s = item % S;
      const int64_t first = offsets[b], count = offsets[b + 1] - first;
      const int64_t lo = first + count * s / S, hi = first + count * (s + 1) / S;
      // A block's KV heads lie side by side: each block is read for every head before the next one, so
      // memory is read in runs of KVH * BS * D elements, where one head at a time would stride through it
      // KVH times; the next block is asked for while this one is computed (its place is known only from
      // the table, so the hardware prefetcher cannot guess it). One 4,096-token layer, fp16, blocks in
      // order: 0.27 -> 0.15 ms.
      constexpr int64_t kLine = 64 / sizeof(scalar_t);
      const int64_t block_elems = KVH * BS * D;
      for (int64_t idx = lo; idx < hi; ++idx) {
        // Only blocks that do not follow the one before: the hardware prefetcher streams through
        // consecutive blocks by itself, and prefetching them too made that case slower (0.15 -> 0.22 ms).
        // A few blocks ahead: one block's compute is shorter than a memory round trip.
        const int64_t ahead = idx + kPrefetchBlocks;
        if (ahead < hi && blocks[ahead] != blocks[ahead - 1] + 1) {
          const scalar_t* next_k = kp + blocks[ahead] * block_elems;
          const scalar_t* next_v = vp + blocks[ahead] * block_elems;
          for (int64_t e = 0; e < block_elems; e += kLine) {
            __builtin_prefetch(next_k + e, 0, 3);
            __builtin_prefetch(next_v + e, 0, 3);
          }
        }
        for (int64_t h = 0; h < KVH; ++h) {
          const int64_t part = (b * KVH + h) * S + s;
          attend_item<scalar_t>(qp + (b * H + h * G) * D, G, D, kp, vp, blocks, valid, idx, idx + 1, KVH, h, BS,
                                fscale, &part_max[part * G], &part_sum[part * G], &part_acc[part * G * D]);
        }
      }
    }
  });
  });

  return merge_splits(B, H, KVH, S, G, D, part_max, part_sum, part_acc, q.options());
}

// ---- Quantized caches (kvserve/kv/quant.py's codecs), read in place ----
//
// Runs of up to kChunk blocks of a quantized cache are widened into two per-thread fp32 buffers (K and V of
// one KV head: 8 blocks x BS x D, 32 KiB each at BS 16, D 64, in L2) and attended by the fp32 path above in
// one call: decode attention is bound by what it reads from memory, and the quantized bytes are what is read.
// Open blocks (still being filled, kept in fp16 beside the pool: kv/open_blocks.py) end a run and are
// attended where they lie, as an fp16 cache.
namespace {

enum QuantKind : int64_t { kInt8Row = 1, kInt4Row = 2, kInt4Channel = 3 };
constexpr int64_t kChunk = 8;

struct QuantSide {
  const uint8_t* data;       // [num_blocks, KVH, BS, data_width] bytes
  const c10::Half* params;   // [num_blocks, KVH, BS, param_width]
  int64_t kind, data_width, param_width, group;
};

inline float half_to_float(c10::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

inline void halves_to_floats(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

// out[i] = nibble_i * scale[i] + low[i] for the 2 * nbytes nibbles of src (even i: the low nibble).
inline void widen_nibbles(const uint8_t* src, int64_t nbytes, const float* scale, const float* low, float* out) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (; j + 16 <= nbytes; j += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
    const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));
    const int64_t i = 2 * j;
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(f0, _mm512_loadu_ps(scale + i), _mm512_loadu_ps(low + i)));
    _mm512_storeu_ps(out + i + 16, _mm512_fmadd_ps(f1, _mm512_loadu_ps(scale + i + 16), _mm512_loadu_ps(low + i + 16)));
  }
#elif defined(__AVX2__)
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (; j + 16 <= nbytes; j += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m128i parts[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};
    for (int half = 0; half < 2; ++half) {
      for (int quarter = 0; quarter < 2; ++quarter) {
        const __m128i bytes = quarter ? _mm_srli_si128(parts[half], 8) : parts[half];
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
        const int64_t i = 2 * j + 16 * half + 8 * quarter;
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(f, _mm256_loadu_ps(scale + i), _mm256_loadu_ps(low + i)));
      }
    }
  }
#endif
  for (; j < nbytes; ++j) {
    out[2 * j] = static_cast<float>(src[j] & 0x0F) * scale[2 * j] + low[2 * j];
    out[2 * j + 1] = static_cast<float>(src[j] >> 4) * scale[2 * j + 1] + low[2 * j + 1];
  }
}

// One int4 group of 16 channels (8 bytes) with one scale and minimum.
inline void widen_group16(const uint8_t* src, float scale, float low, float* out) {
#if defined(__AVX512F__)
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
  _mm512_storeu_ps(out, _mm512_fmadd_ps(f, _mm512_set1_ps(scale), _mm512_set1_ps(low)));
#else
  for (int j = 0; j < 8; ++j) {
    out[2 * j] = static_cast<float>(src[j] & 0x0F) * scale + low;
    out[2 * j + 1] = static_cast<float>(src[j] >> 4) * scale + low;
  }
#endif
}

// The rows of (block, KV head h) of one side, decoded into out [BS, D].
void widen_block(const QuantSide& side, int64_t block, int64_t KVH, int64_t h, int64_t BS, int64_t D, float* out) {
  const int64_t bh = block * KVH + h;
  const uint8_t* data = side.data + bh * BS * side.data_width;
  const c10::Half* params = side.params + bh * BS * side.param_width;
  if (side.kind == kInt4Channel) {  // one scale and minimum per channel for the whole block
    alignas(64) float scale[kMaxHeadDim], low[kMaxHeadDim];
    halves_to_floats(params, scale, D);
    halves_to_floats(params + D, low, D);
    for (int64_t r = 0; r < BS; ++r) widen_nibbles(data + r * side.data_width, D / 2, scale, low, out + r * D);
    return;
  }
  for (int64_t r = 0; r < BS; ++r) {
    const c10::Half* p = params + r * side.param_width;
    const uint8_t* row = data + r * side.data_width;
    float* o = out + r * D;
    if (side.kind == kInt8Row) {
      const float s = half_to_float(p[0]);
      const int8_t* q = reinterpret_cast<const int8_t*>(row);
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) o[i] = static_cast<float>(q[i]) * s;
    } else if (side.group == 16) {  // kInt4Row in groups of 16 channels (every head_dim a multiple of 16)
      for (int64_t g = 0; g < D / 16; ++g) widen_group16(row + 8 * g, half_to_float(p[2 * g]), half_to_float(p[2 * g + 1]), o + 16 * g);
    } else {  // kInt4Row, one group per row
      const float s = half_to_float(p[0]), m = half_to_float(p[1]);
      for (int64_t j = 0; j < D / 2; ++j) {
        o[2 * j] = static_cast<float>(row[j] & 0x0F) * s + m;
        o[2 * j + 1] = static_cast<float>(row[j] >> 4) * s + m;
      }
    }
  }
}

QuantSide quant_side(const torch::Tensor& data, const torch::Tensor& params, int64_t kind, int64_t group) {
  TORCH_CHECK(data.is_contiguous() && params.is_contiguous() && params.scalar_type() == at::kHalf,
              "paged_decode_quant: contiguous data and fp16 parameters");
  TORCH_CHECK(kind == kInt8Row || kind == kInt4Row || kind == kInt4Channel, "paged_decode_quant: unknown kind");
  return QuantSide{reinterpret_cast<const uint8_t*>(data.data_ptr()), params.data_ptr<c10::Half>(), kind,
                   data.size(3) * data.element_size(), params.size(3), group};
}

}  // namespace

// As paged_decode, over quantized K and V (`*_kind`: 1 int8 per row, 2 int4 groups of `group` channels per
// row, 3 int4 per channel over the block) with open blocks: open_slot [num_blocks] (int64: the block's slot
// in open_k / open_v [slots, KVH, BS, D] fp16, -1 for a block read from the pool; empty: none).
torch::Tensor paged_decode_quant(torch::Tensor q, torch::Tensor k_data, torch::Tensor k_params, int64_t k_kind,
                                 torch::Tensor v_data, torch::Tensor v_params, int64_t v_kind, int64_t group,
                                 torch::Tensor open_k, torch::Tensor open_v, torch::Tensor open_slot,
                                 torch::Tensor block_ids, torch::Tensor seq_offsets, torch::Tensor key_valid,
                                 double scale, int64_t num_splits) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode_quant: fp32 queries only");
  q = q.contiguous();
  block_ids = block_ids.contiguous();
  seq_offsets = seq_offsets.contiguous();
  key_valid = key_valid.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_data.size(1), BS = k_data.size(2);
  TORCH_CHECK(H % KVH == 0 && D <= kMaxHeadDim && D % 2 == 0 && group > 0 && D % group == 0,
              "paged_decode_quant: shapes disagree");
  const int64_t G = H / KVH;
  TORCH_CHECK(G <= kMaxGroup && BS <= kMaxBlock, "paged_decode_quant: group or block size too large");
  const QuantSide ks = quant_side(k_data, k_params, k_kind, group), vs = quant_side(v_data, v_params, v_kind, group);
  TORCH_CHECK(k_kind != kInt4Channel || ks.param_width * BS >= 2 * D, "paged_decode_quant: channel parameters");
  const bool has_open = open_slot.numel() > 0;
  const int64_t* slot_of = nullptr;
  const c10::Half *ok = nullptr, *ov = nullptr;
  if (has_open) {
    TORCH_CHECK(open_slot.scalar_type() == at::kLong && open_slot.is_contiguous() && open_k.is_contiguous() &&
                    open_v.is_contiguous() && open_k.scalar_type() == at::kHalf && open_v.scalar_type() == at::kHalf,
                "paged_decode_quant: open blocks are fp16 [slots, KVH, BS, D], slots int64");
    slot_of = open_slot.data_ptr<int64_t>();
    ok = open_k.data_ptr<c10::Half>();
    ov = open_v.data_ptr<c10::Half>();
  }
  const int64_t S = std::max<int64_t>(num_splits, 1);
  std::vector<float> part_max(B * KVH * S * G, kEmpty), part_sum(B * KVH * S * G, 0.f);
  std::vector<float> part_acc(B * KVH * S * G * D, 0.f);
  const float* qp = q.data_ptr<float>();
  const int64_t* blocks = block_ids.data_ptr<int64_t>();
  const int64_t* offsets = seq_offsets.data_ptr<int64_t>();
  const bool* valid = key_valid.data_ptr<bool>();
  const float fscale = static_cast<float>(scale);
  static const int64_t kIota[kChunk] = {0, 1, 2, 3, 4, 5, 6, 7};

  at::parallel_for(0, B * S, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> k_buffer, v_buffer;
    if (static_cast<int64_t>(k_buffer.size()) < kChunk * BS * D) {
      k_buffer.resize(kChunk * BS * D);
      v_buffer.resize(kChunk * BS * D);
    }
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / S, s = item % S;
      const int64_t first = offsets[b], count = offsets[b + 1] - first;
      const int64_t lo = first + count * s / S, hi = first + count * (s + 1) / S;
      for (int64_t idx = lo; idx < hi;) {
        const int64_t slot = has_open ? slot_of[blocks[idx]] : -1;
        if (slot >= 0) {  // an open block, attended in place (fp16)
          for (int64_t h = 0; h < KVH; ++h) {
            const int64_t part = (b * KVH + h) * S + s;
            attend_item<c10::Half>(qp + (b * H + h * G) * D, G, D, ok, ov, &slot, valid + idx * BS, 0, 1, KVH, h, BS,
                                   fscale, &part_max[part * G], &part_sum[part * G], &part_acc[part * G * D]);
          }
          ++idx;
          continue;
        }
        int64_t run = 1;  // blocks of the pool in a row, up to kChunk
        while (run < kChunk && idx + run < hi && !(has_open && slot_of[blocks[idx + run]] >= 0)) ++run;
        for (int64_t h = 0; h < KVH; ++h) {
          for (int64_t c = 0; c < run; ++c) {
            widen_block(ks, blocks[idx + c], KVH, h, BS, D, k_buffer.data() + c * BS * D);
            widen_block(vs, blocks[idx + c], KVH, h, BS, D, v_buffer.data() + c * BS * D);
          }
          const int64_t part = (b * KVH + h) * S + s;
          attend_item<float>(qp + (b * H + h * G) * D, G, D, k_buffer.data(), v_buffer.data(), kIota,
                             valid + idx * BS, 0, run, 1, 0, BS, fscale, &part_max[part * G], &part_sum[part * G],
                             &part_acc[part * G * D]);
        }
        idx += run;
      }
    }
  });
  return merge_splits(B, H, KVH, S, G, D, part_max, part_sum, part_acc, q.options());
}
