// Decode attention that reads the paged K/V blocks (fp32, fp16 or bf16) where they lie.
//
// One query token per request. Work items are (request, KV head, split): a
// split is a run of the request's blocks, so one long request still keeps
// every thread busy. Each item keeps, for the G query heads sharing its KV
// head, a running max, sum and weighted V sum (online softmax, rescaled once
// per block); the splits of a request are merged at the end. Nothing is
// gathered or copied: each K/V row is read once per (request, KV head).
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
  std::vector<float> k_buffer(std::is_same_v<scalar_t, float> ? 0 : BS * D);
  std::vector<float> v_buffer(k_buffer.size());
  // A (block, KV head) is one contiguous run of BS * D elements, but consecutive blocks of a request lie
  // apart (other heads, other requests): the hardware prefetcher stops at each run's end, so the next
  // block's K and V are asked for while this one is computed (one 4,096-token layer: 0.46 -> 0.37 ms).
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  for (int64_t idx = lo; idx < hi; ++idx) {
    const int64_t base = (blocks[idx] * KVH + h) * BS;
    if (idx + 1 < hi) {
      const int64_t next = (blocks[idx + 1] * KVH + h) * BS * D;
      for (int64_t e = 0; e < BS * D; e += kLine) {
        __builtin_prefetch(kp + next + e, 0, 3);
        __builtin_prefetch(vp + next + e, 0, 3);
      }
    }
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
  at::parallel_for(0, B * KVH * S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (KVH * S), h = (item / S) % KVH, s = item % S;
      const int64_t first = offsets[b], count = offsets[b + 1] - first;
      const int64_t lo = first + count * s / S, hi = first + count * (s + 1) / S;
      const float* qh = qp + (b * H + h * G) * D;
      float *m = &part_max[item * G], *l = &part_sum[item * G], *acc = &part_acc[item * G * D];
      // head_dim as a constant where it is common: the dot products unroll fully.
      if (D == 64) {
        attend_blocks<scalar_t, 64>(qh, G, D, kp, vp, blocks, valid, lo, hi, KVH, h, BS, fscale, m, l, acc);
      } else if (D == 128) {
        attend_blocks<scalar_t, 128>(qh, G, D, kp, vp, blocks, valid, lo, hi, KVH, h, BS, fscale, m, l, acc);
      } else {
        attend_blocks<scalar_t, 0>(qh, G, D, kp, vp, blocks, valid, lo, hi, KVH, h, BS, fscale, m, l, acc);
      }
    }
  });
  });

  auto out = torch::empty({B, H * D}, q.options());
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over paged fp32 K/V, read in place");
}
