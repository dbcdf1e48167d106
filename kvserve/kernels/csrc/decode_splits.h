// What the two paged attention entry points (paged_decode.cpp over float blocks, paged_decode_quant.cpp
// over quantized ones) share: the dispatch of one work item to the fastest path for its shape, and the
// split of each request's blocks into runs whose partial softmax states are merged at the end.
//
// Work items are (row, split): a split is a run of `split_blocks` of the row's blocks, walked block by
// block for every KV head, so one long row still keeps every thread busy; the splits of a row are merged
// in order at the end. A row's splits depend on its own block count only, never on the batch, so a row
// gives the same bits alone, in a batch, as a decode or as a prefill token (DESIGN §3 Determinism).
// Threads: at::parallel_for (OpenMP; kernels/build.py).
#pragma once

#include "attend_blocks.h"
#include "attend_blocks_avx512.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

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

// One call's query rows and the blocks each reads (checked and made contiguous by `decode_rows`; the
// tensors are kept so that the pointers stay valid). A row is one query token: a decode, one of a verify's
// k + 1 queries, or one token of a prefill chunk; each is attended alone, the same way wherever it runs.
// Row b at position pos[b] sees the keys at positions low[b] .. pos[b] (low: its window's first key, else
// 0), block j of them being tables[table[b] + j]: the rows of one request share its block table.
constexpr int64_t kSplitMultiple = 4;  // a row's splits come in multiples of this (DecodeRows::step)

struct DecodeRows {
  at::Tensor q, tables, row_table, row_low, row_pos, sinks;
  const float* qp;
  const float* sink = nullptr;  // [H] learned sink logits (gpt-oss), or none: one more term in each denominator
  const int64_t *table, *low, *pos, *blocks;
  int64_t B, H, KVH, G, D, BS;
  int64_t split_blocks;    // the most blocks per split (DecodeRows::step); <= 0: one split per row
  std::vector<int64_t> split_start;  // [B + 1]: row b's splits are items split_start[b] .. split_start[b + 1]
  float scale;

  int64_t first_block(int64_t b) const { return low[b] / BS; }
  int64_t num_blocks(int64_t b) const { return pos[b] / BS - low[b] / BS + 1; }
  // Row b's blocks per split: at most split_blocks, in a multiple of kSplitMultiple splits of even length
  // where it has that many blocks, so that a short row's splits share the threads evenly (33 blocks in
  // splits of 16 ran 16 + 16 on one thread and 1 on the other: 9 + 9 | 9 + 6 now). Its own block count
  // alone decides it, never the batch or the machine.
  int64_t step(int64_t b) const {
    const int64_t count = num_blocks(b);
    if (split_blocks <= 0) return count;
    int64_t splits = (count + split_blocks - 1) / split_blocks;
    splits = std::min(count, (splits + kSplitMultiple - 1) / kSplitMultiple * kSplitMultiple);
    return (count + splits - 1) / splits;
  }
  int64_t num_splits(int64_t b) const { return (num_blocks(b) + step(b) - 1) / step(b); }
};

// The shared prologue: checks q [B, H, D] fp32 against KVH KV heads of BS-row blocks and lays out each
// row's splits.
DecodeRows decode_rows(const char* op, at::Tensor q, at::Tensor tables, at::Tensor row_table,
                       at::Tensor row_low, at::Tensor row_pos, int64_t KVH, int64_t BS, double scale,
                       int64_t split_blocks, at::Tensor sinks);

// Partial softmax states of up to `capacity` split items, each for every (KV head, query head): max, sum
// and weighted V sum. Reused for the items of one batch of rows after another (bounded memory: a prefill
// chunk is thousands of rows). They live in a buffer the calling thread keeps between calls, never
// cleared: `reset` sets an item's state before it is attended, and only reset items are merged. Zeroing
// a new one each call (~300 KB for a 32-row decode of SmolLM2 at 300 tokens) was 9% of the call's time.
// The buffer keeps the largest size asked for: at most kMaxItems items' states, unless one tile's
// splits need more (17 MB at 32 query heads of 128). One SplitPartials at a time per thread (each paged
// attention call makes one).
struct SplitPartials {
  SplitPartials(const DecodeRows& rows, int64_t capacity) : KVH(rows.KVH), G(rows.G), D(rows.D) {
    thread_local std::vector<float> storage;
    const size_t states = static_cast<size_t>(capacity * KVH * G);
    if (storage.size() < states * (2 + D)) storage.resize(states * (2 + D));
    max = storage.data();
    sum = max + states;
    acc = sum + states;
  }

  void reset(int64_t item) {
    const int64_t p = item * KVH * G;
    std::fill(&max[p], &max[p] + KVH * G, kEmpty);
    std::fill(&sum[p], &sum[p] + KVH * G, 0.f);
    std::fill(&acc[p * D], &acc[p * D] + KVH * G * D, 0.f);
  }

  // Item `item` (a split of row b), KV head h, over blocks [lo, hi) of the `blocks` / `valid` it is given.
  template <typename scalar_t>
  void attend(const DecodeRows& rows, int64_t item, int64_t b, int64_t h, const scalar_t* kp, const scalar_t* vp,
              const int64_t* blocks, const bool* valid, int64_t lo, int64_t hi, int64_t kv_heads, int64_t head) {
    const int64_t p = (item * KVH + h) * G;
    attend_item<scalar_t>(rows.qp + (b * rows.H + h * G) * D, G, D, kp, vp, blocks, valid, lo, hi, kv_heads, head,
                          rows.BS, rows.scale, &max[p], &sum[p], &acc[p * D]);
  }

  // The splits of rows [row_begin, row_end) (items from `first_item`), merged in split order into their
  // output rows of out [B, H * D].
  void merge(const DecodeRows& rows, int64_t row_begin, int64_t row_end, int64_t first_item, float* out) const;

  int64_t KVH, G, D;
  float* max;  // [capacity, KVH, G]
  float* sum;  // [capacity, KVH, G]
  float* acc;  // [capacity, KVH, G, D]
};

constexpr int64_t kMaxItems = 1024;  // split items whose partials are held at once
// Rows of one request (one table, one first block: consecutive tokens of a prefill chunk or a verify) are
// attended in tiles: the tile's rows take each run of kTileBlocks blocks in turn while it is in cache,
// instead of each row streaming the request's whole K/V from L3 alone. A row's operations and their order
// are the same as alone (its blocks in order, each block's arithmetic unchanged): only the interleaving
// with its tile's other rows changes, so its bits do not. One 4,096-token chunk: see bench/decode_attention.py.
constexpr int64_t kTileRows = 16;
constexpr int64_t kTileBlocks = 4;

// Attention of every row: fn(partials, item, b, blocks, valid, lo, hi, n, lead) attends blocks [lo, hi) of
// split `item` of row b (blocks[0 .. n), valid [n, BS]: the keys the row sees) into `partials`, on
// at::parallel_for's threads; `lead`: b is the first row of its tile (the one that asks for the next run's
// blocks ahead: the tile's other rows read them right after it). The splits are merged row by row into out
// [B, H * D] (contiguous). Which thread runs a split, and which rows run beside it, never changes a row's
// result: its splits are fixed by its own position, each walked block by block in order, and merged in order.
template <typename Fn>
void attend_splits_into(const DecodeRows& rows, float* out, Fn fn) {
  // Tiles: runs of up to kTileRows consecutive rows reading one table from one first block.
  std::vector<int64_t> tile_start{0};
  for (int64_t b = 1; b < rows.B; ++b) {
    if (b - tile_start.back() == kTileRows || rows.table[b] != rows.table[b - 1] ||
        rows.first_block(b) != rows.first_block(b - 1)) {
      tile_start.push_back(b);
    }
  }
  const int64_t num_tiles = static_cast<int64_t>(tile_start.size());
  tile_start.push_back(rows.B);
  auto splits_of = [&](int64_t b) { return rows.split_start[b + 1] - rows.split_start[b]; };
  std::vector<int64_t> tile_splits(num_tiles, 0);  // the most splits of a row of the tile
  int64_t widest = 0;  // one tile's splits always fit, however many
  for (int64_t t = 0; t < num_tiles; ++t) {
    for (int64_t b = tile_start[t]; b < tile_start[t + 1]; ++b) tile_splits[t] = std::max(tile_splits[t], splits_of(b));
    widest = std::max(widest, rows.split_start[tile_start[t + 1]] - rows.split_start[tile_start[t]]);
  }
  const int64_t total = rows.split_start[rows.B];
  SplitPartials partials(rows, std::max(std::min(total, kMaxItems), widest));
  const int64_t BS = rows.BS;
  std::vector<std::pair<int64_t, int64_t>> work;  // (tile, split)
  for (int64_t tile_begin = 0; tile_begin < num_tiles;) {
    int64_t tile_end = tile_begin + 1;  // tiles whose rows' splits fit the partials (at least one tile)
    const int64_t first = rows.split_start[tile_start[tile_begin]];
    while (tile_end < num_tiles && rows.split_start[tile_start[tile_end + 1]] - first <= kMaxItems) ++tile_end;
    work.clear();
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      for (int64_t s = 0; s < tile_splits[t]; ++s) work.emplace_back(t, s);
    }
    at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<uint8_t> valid;  // bool flags, as the attend functions read them, row by row
      int64_t count[kTileRows], stride = 0;
      for (int64_t w = begin; w < end; ++w) {
        const auto [t, s] = work[w];
        const int64_t b0 = tile_start[t], b1 = tile_start[t + 1];
        int64_t widest_run = 0;
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t step = rows.step(b);
          count[b - b0] = s < splits_of(b) ? std::min(rows.num_blocks(b), s * step + step) - s * step : 0;
          widest_run = std::max(widest_run, count[b - b0]);
        }
        stride = widest_run * BS;
        valid.resize((b1 - b0) * stride);
        for (int64_t b = b0; b < b1; ++b) {
          if (count[b - b0] == 0) continue;
          const int64_t step = rows.step(b);
          const int64_t key0 = (rows.first_block(b) + s * step) * BS;  // position of the split's first key
          uint8_t* flags = valid.data() + (b - b0) * stride;
          for (int64_t i = 0; i < count[b - b0] * BS; ++i) flags[i] = key0 + i >= rows.low[b] && key0 + i <= rows.pos[b];
          partials.reset(rows.split_start[b] + s - first);
        }
        for (int64_t lo = 0; lo < widest_run; lo += kTileBlocks) {
          for (int64_t b = b0; b < b1; ++b) {
            const int64_t hi = std::min(count[b - b0], lo + kTileBlocks);
            if (lo >= hi) continue;
            const int64_t step = rows.step(b);
            fn(partials, rows.split_start[b] + s - first, b, rows.blocks + rows.table[b] + rows.first_block(b) + s * step,
               reinterpret_cast<const bool*>(valid.data() + (b - b0) * stride), lo, hi, count[b - b0], b == b0);
          }
        }
      }
    });
    partials.merge(rows, tile_start[tile_begin], tile_start[tile_end], first, out);
    tile_begin = tile_end;
  }
}

// The same into a new [B, H * D].
template <typename Fn>
at::Tensor attend_splits(const DecodeRows& rows, Fn fn) {
  auto out = at::empty({rows.B, rows.H * rows.D}, rows.q.options());
  attend_splits_into(rows, out.data_ptr<float>(), fn);
  return out;
}

}  // namespace kvserve_attention
