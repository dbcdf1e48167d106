// Decode attention that reads the paged K/V blocks (fp32, fp16 or bf16) where they lie.
//
// One query token per row (a decode, a verify's query, a prefill chunk's token). Work items are (row,
// split) (decode_splits.h). For each KV head an
// item keeps, for the G query heads sharing it, a running max, sum and weighted V sum (online softmax,
// rescaled once per block, or once per run of blocks on the AVX-512 paths; attend_blocks.h); the
// splits of a request are merged at the end. Nothing is
// gathered or copied: each K/V row is read once per (request, KV head).
#include "kernels.h"
#include "decode_splits.h"

#include <ATen/Dispatch.h>

namespace kvserve_attention {

DecodeRows decode_rows(const char* op, at::Tensor q, at::Tensor tables, at::Tensor row_table,
                       at::Tensor row_low, at::Tensor row_pos, int64_t KVH, int64_t BS, double scale,
                       int64_t split_blocks, at::Tensor sinks) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3, op, ": fp32 queries [B, H, D] only");
  DecodeRows rows;
  rows.q = q.contiguous();
  rows.tables = tables.contiguous();
  rows.row_table = row_table.contiguous();
  rows.row_low = row_low.contiguous();
  rows.row_pos = row_pos.contiguous();
  rows.B = q.size(0);
  rows.H = q.size(1);
  rows.D = q.size(2);
  rows.KVH = KVH;
  rows.BS = BS;
  TORCH_CHECK(KVH > 0 && rows.H % KVH == 0, op, ": query heads are not a multiple of the KV heads");
  rows.G = rows.H / KVH;
  TORCH_CHECK(rows.G <= kMaxGroup && BS > 0 && BS <= kMaxBlock, op, ": group or block size out of range");
  TORCH_CHECK(rows.row_table.numel() == rows.B && rows.row_low.numel() == rows.B && rows.row_pos.numel() == rows.B,
              op, ": row_table, row_low and row_pos must be [B]");
  rows.qp = rows.q.data_ptr<float>();
  if (sinks.numel() > 0) {
    TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.numel() == rows.H, op, ": sinks are fp32 [H]");
    rows.sinks = sinks.contiguous();
    rows.sink = rows.sinks.data_ptr<float>();
  }
  rows.blocks = rows.tables.data_ptr<int64_t>();
  rows.table = rows.row_table.data_ptr<int64_t>();
  rows.low = rows.row_low.data_ptr<int64_t>();
  rows.pos = rows.row_pos.data_ptr<int64_t>();
  rows.scale = static_cast<float>(scale);
  rows.split_blocks = split_blocks;
  rows.split_start.assign(rows.B + 1, 0);
  const int64_t num_entries = rows.tables.numel();
  for (int64_t b = 0; b < rows.B; ++b) {
    TORCH_CHECK(rows.low[b] >= 0 && rows.low[b] <= rows.pos[b] && rows.table[b] >= 0 &&
                    rows.table[b] + rows.pos[b] / BS < num_entries, op, ": row ", b, " reads outside its table");
    rows.split_start[b + 1] = rows.split_start[b] + rows.num_splits(b);
  }
  return rows;
}

void SplitPartials::merge(const DecodeRows& rows, int64_t row_begin, int64_t row_end, int64_t first_item,
                          float* out) const {
  const int64_t H = rows.H;
  // A few (row, KV head) merges (a decode of one or two requests) run on this thread: waking the other
  // costs more than they do.
  constexpr int64_t kMergeGrain = 8;
  at::parallel_for(row_begin * KVH, row_end * KVH, kMergeGrain, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / KVH, h = bh % KVH;
      const int64_t lo = rows.split_start[b] - first_item, hi = rows.split_start[b + 1] - first_item;
      for (int64_t g = 0; g < G; ++g) {
        float global_max = kEmpty;
        for (int64_t s = lo; s < hi; ++s) global_max = std::max(global_max, max[(s * KVH + h) * G + g]);
        float* o = out + (b * H + h * G + g) * D;
        std::fill(o, o + D, 0.f);
        float total = 0.f;
        for (int64_t s = lo; s < hi; ++s) {
          const int64_t p = (s * KVH + h) * G + g;
          if (max[p] <= kEmpty) continue;
          const float w = std::exp(max[p] - global_max);
          total += sum[p] * w;
          axpy(w, &acc[p * D], o, D);
        }
        if (rows.sink != nullptr) {
          // The head's sink logit joins the denominator once per row (after the splits, so once only), on the
          // common max of the keys and the sink.
          const float s = rows.sink[h * G + g], top = std::max(global_max, s);
          const float w = std::exp(global_max - top);
          for (int64_t i = 0; i < D; ++i) o[i] *= w;
          total = total * w + std::exp(s - top);
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t i = 0; i < D; ++i) o[i] *= inv;
      }
    }
  });
}

}  // namespace kvserve_attention

using namespace kvserve_attention;

namespace {

// Asks for `elems` values from `at` into L2 (prefetcht1), a cache line at a time.
template <typename scalar_t>
inline void prefetch_to_l2(const scalar_t* at, int64_t elems) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  for (int64_t e = 0; e < elems; e += kLine) __builtin_prefetch(at + e, 0, 2);
}

}  // namespace

// q [B, H, D] fp32 (one query token per row); k_cache, v_cache [num_blocks, KVH, block_size, D] (fp32 / fp16 /
// bf16, contiguous); tables (int64: the block tables of the rows' requests, one after another); row_table,
// row_low, row_pos [B] (int64: where row b's table starts in `tables`, its first and last visible key
// positions); split_blocks: blocks per split (<= 0: one split per row); sinks: fp32 [H], each head's learned
// sink logit in its softmax denominator (gpt-oss), or empty. Into out [B, H * D] (contiguous, the caller's:
// the decoder stack reuses its buffers).
void paged_decode_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& row_table, const at::Tensor& row_low,
                       const at::Tensor& row_pos, double scale, int64_t split_blocks, const at::Tensor& sinks,
                       float* out) {
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode: K and V caches of one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: contiguous cache");
  const DecodeRows rows = decode_rows("paged_decode", q, tables, row_table, row_low, row_pos, k_cache.size(1),
                                      k_cache.size(2), scale, split_blocks, sinks);
  TORCH_CHECK(k_cache.size(3) == rows.D, "paged_decode: shapes disagree");
  const int64_t KVH = rows.KVH, block_elems = KVH * rows.BS * rows.D;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "paged_decode", [&] {
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  const int64_t head_elems = rows.BS * rows.D;  // one KV head's rows of a block
  // Whether those rows are asked for ahead (the comment below says when).
  const bool short_stretches = KVH > 1 && head_elems * static_cast<int64_t>(sizeof(scalar_t)) < 4096;
  attend_splits_into(rows, out, [&](SplitPartials& partials, int64_t item, int64_t b, const int64_t* blocks,
                                const bool* valid, int64_t lo, int64_t hi, int64_t count, bool lead) {
    // The run (a few blocks: decode_splits.h's kTileBlocks) for each KV head in turn. A head's K (and V)
    // rows of a block, 2 KB at 16 x 64 fp16, lie a whole block from its rows of the next block: short
    // stretches that the hardware prefetcher meets cold one after another. So before each head, the tile's
    // lead row asks for that head's rows of the next run (at a split's first run, of this one too), which
    // come in while the heads before it compute; the tile's other rows find them. A decode's K/V is cold
    // (the step's weights stream through the caches between layers): against asking only for the blocks
    // that do not follow the one before, a 1B-shaped layer at 512 tokens 1.36-1.56x, its blocks scattered
    // 1.20-1.39x; in the engine's step attention 1.10x (1B Q4_0) and 1.21x (SmolLM2); warm 0.80-0.91x.
    // Stretches of a 4 KiB page or more (head_dim 128 in fp16), and one KV head's consecutive blocks (one
    // stretch), the hardware streams well by itself: asking for them too made a 32 / 8 x 128 shape 0.93-0.96x
    // and Gemma 3's (4 / 1 x 256) 0.80x, so there only a jump in the table is asked for.
    const int64_t ahead_from = lo == 0 ? lo : hi, ahead_to = std::min(count, hi + (hi - lo));
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t idx = ahead_from; lead && idx < ahead_to; ++idx) {
        if (!short_stretches && idx > 0 && blocks[idx] == blocks[idx - 1] + 1) continue;
        prefetch_to_l2(kp + blocks[idx] * block_elems + h * head_elems, head_elems);
        prefetch_to_l2(vp + blocks[idx] * block_elems + h * head_elems, head_elems);
      }
      partials.attend<scalar_t>(rows, item, b, h, kp, vp, blocks, valid, lo, hi, KVH, h);
    }
  });
  });
}

// The same into a new [B, H * D].
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                        at::Tensor row_table, at::Tensor row_low, at::Tensor row_pos, double scale,
                        int64_t split_blocks, at::Tensor sinks) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3, "paged_decode: fp32 queries [B, H, D] only");
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  paged_decode_into(q, k_cache, v_cache, tables, row_table, row_low, row_pos, scale, split_blocks, sinks,
                    out.data_ptr<float>());
  return out;
}
