// What the two paged attention entry points (paged_decode.cpp over float blocks, paged_decode_quant.cpp
// over quantized ones) share: the dispatch of one work item to the fastest path for its shape, and the
// split of each request's blocks into runs whose partial softmax states are merged at the end.
//
// Work items are (request, split): a split is a run of the request's blocks, walked block by block for
// every KV head, so one long request still keeps every thread busy. The splits of a request are merged
// at the end. Threads: at::parallel_for (OpenMP; kernels/build.py).
#pragma once

#include "attend_blocks.h"
#include "attend_blocks_avx512.h"

#include <ATen/Parallel.h>

namespace kvserve_attention {

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

// One call's queries and the blocks each reads (checked and made contiguous by `decode_rows`; the tensors
// are kept so that the pointers stay valid).
struct DecodeRows {
  torch::Tensor q, block_ids, seq_offsets, key_valid;
  const float* qp;
  const int64_t* blocks;   // request by request
  const int64_t* offsets;  // [B + 1]: request b's blocks are blocks[offsets[b] : offsets[b + 1]]
  const bool* valid;       // [NB, BS]: rows each query may see
  int64_t B, H, KVH, G, D, BS, S;
  float scale;
};

// The shared prologue: checks q [B, H, D] fp32 against KVH KV heads of BS-row blocks, `num_splits` runs
// per request.
DecodeRows decode_rows(const char* op, torch::Tensor q, torch::Tensor block_ids, torch::Tensor seq_offsets,
                       torch::Tensor key_valid, int64_t KVH, int64_t BS, double scale, int64_t num_splits);

// Partial softmax states per (request, KV head, split): max and sum per query head, weighted V sums.
struct SplitPartials {
  explicit SplitPartials(const DecodeRows& rows)
      : S(rows.S), G(rows.G), D(rows.D),
        max(rows.B * rows.KVH * rows.S * rows.G, kEmpty),
        sum(rows.B * rows.KVH * rows.S * rows.G, 0.f),
        acc(rows.B * rows.KVH * rows.S * rows.G * rows.D, 0.f) {}

  int64_t part(const DecodeRows& rows, int64_t b, int64_t h, int64_t s) const { return (b * rows.KVH + h) * S + s; }

  // Work item (b, h, s) of `rows` over blocks [lo, hi) of the `blocks` / `valid` it is given.
  template <typename scalar_t>
  void attend(const DecodeRows& rows, int64_t b, int64_t h, int64_t s, const scalar_t* kp, const scalar_t* vp,
              const int64_t* blocks, const bool* valid, int64_t lo, int64_t hi, int64_t kv_heads, int64_t head) {
    const int64_t p = part(rows, b, h, s);
    attend_item<scalar_t>(rows.qp + (b * rows.H + h * G) * D, G, D, kp, vp, blocks, valid, lo, hi, kv_heads, head,
                          rows.BS, rows.scale, &max[p * G], &sum[p * G], &acc[p * G * D]);
  }

  // The splits of each (request, KV head) merged into one output row per query head: [B, H * D].
  torch::Tensor merge(const DecodeRows& rows) const;

  int64_t S, G, D;
  std::vector<float> max, sum, acc;
};

// fn(b, s, lo, hi) for every (request, split) on at::parallel_for's threads; split s of request b covers
// blocks [lo, hi) of `rows.blocks`.
template <typename Fn>
void for_each_split(const DecodeRows& rows, Fn fn) {
  at::parallel_for(0, rows.B * rows.S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / rows.S, s = item % rows.S;
      const int64_t first = rows.offsets[b], count = rows.offsets[b + 1] - first;
      fn(b, s, first + count * s / rows.S, first + count * (s + 1) / rows.S);
    }
  });
}

}  // namespace kvserve_attention
