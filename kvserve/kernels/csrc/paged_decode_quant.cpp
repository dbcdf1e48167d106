// Decode attention over quantized K/V blocks (kvserve/kv/quant.py's codecs), read in place.
//
// Runs of up to kChunk blocks of a quantized cache are widened into two per-thread fp32 buffers (K and V of
// one KV head: 8 blocks x BS x D, 32 KiB each at BS 16, D 64, in L2) and attended by the fp32 path
// (attend_blocks.h) in one call: decode attention is bound by what it reads from memory, and the quantized
// bytes are what is read. Open blocks (still being filled, kept in fp16 beside the pool:
// kv/open_blocks.py) end a run and are attended where they lie, as an fp16 cache.
#include "kernels.h"
#include "decode_splits.h"

using namespace kvserve_attention;

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

QuantSide quant_side(const at::Tensor& data, const at::Tensor& params, int64_t kind, int64_t group) {
  TORCH_CHECK(data.is_contiguous() && params.is_contiguous() && params.scalar_type() == at::kHalf,
              "paged_decode_quant: contiguous data and fp16 parameters");
  TORCH_CHECK(kind == kInt8Row || kind == kInt4Row || kind == kInt4Channel, "paged_decode_quant: unknown kind");
  return QuantSide{reinterpret_cast<const uint8_t*>(data.data_ptr()), params.data_ptr<c10::Half>(), kind,
                   data.size(3) * data.element_size(), params.size(3), group};
}

}  // namespace

// As paged_decode, over quantized K and V (`*_kind`: 1 int8 per row, 2 int4 groups of `group` channels per
// row, 3 int4 per channel over the block) with open blocks: open_slot [num_blocks] (int64: the block's slot
// in open_k / open_v [slots, KVH, BS, D] fp16, -1 for a block read from the pool; empty: none). row_own [B]
// (int64, or empty): row b reads its own block (the one holding its position) from own_k / own_v [n, KVH, BS,
// D] fp16 at index row_own[b] (-1: as above) -- the block as it was open when the row's token was written,
// where the same step's write then filled and encoded it (a verify's rows before the block's last one).
at::Tensor paged_decode_quant(at::Tensor q, at::Tensor k_data, at::Tensor k_params, int64_t k_kind,
                              at::Tensor v_data, at::Tensor v_params, int64_t v_kind, int64_t group,
                              at::Tensor open_k, at::Tensor open_v, at::Tensor open_slot,
                              at::Tensor own_k, at::Tensor own_v, at::Tensor row_own,
                              at::Tensor tables, at::Tensor row_table, at::Tensor row_low,
                              at::Tensor row_pos, double scale, int64_t split_blocks, at::Tensor sinks) {
  const DecodeRows rows = decode_rows("paged_decode_quant", q, tables, row_table, row_low, row_pos, k_data.size(1),
                                      k_data.size(2), scale, split_blocks, sinks);
  const int64_t KVH = rows.KVH, BS = rows.BS, D = rows.D;
  TORCH_CHECK(D <= kMaxHeadDim && D % 2 == 0 && group > 0 && D % group == 0, "paged_decode_quant: shapes disagree");
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
  const bool has_own = row_own.numel() > 0;
  const int64_t* own_of = nullptr;
  const c10::Half *sk = nullptr, *sv = nullptr;
  if (has_own) {
    TORCH_CHECK(row_own.scalar_type() == at::kLong && row_own.is_contiguous() && row_own.numel() == rows.B &&
                    own_k.scalar_type() == at::kHalf && own_v.scalar_type() == at::kHalf && own_k.is_contiguous() &&
                    own_v.is_contiguous() && own_k.dim() == 4 && own_k.sizes() == own_v.sizes() &&
                    own_k.size(1) == KVH && own_k.size(2) == BS && own_k.size(3) == D,
                "paged_decode_quant: own blocks are fp16 [n, KVH, BS, D], row_own int64 [B]");
    own_of = row_own.data_ptr<int64_t>();
    for (int64_t b = 0; b < rows.B; ++b) {
      TORCH_CHECK(own_of[b] < own_k.size(0), "paged_decode_quant: row ", b, "'s own block is out of range");
    }
    sk = own_k.data_ptr<c10::Half>();
    sv = own_v.data_ptr<c10::Half>();
  }
  static const int64_t kIota[kChunk] = {0, 1, 2, 3, 4, 5, 6, 7};

  return attend_splits(rows, [&](SplitPartials& partials, int64_t item, int64_t b, const int64_t* blocks,
                                 const bool* valid, int64_t lo, int64_t hi, int64_t, bool) {
    thread_local std::vector<float> k_buffer, v_buffer;
    if (static_cast<int64_t>(k_buffer.size()) < kChunk * BS * D) {
      k_buffer.resize(kChunk * BS * D);
      v_buffer.resize(kChunk * BS * D);
    }
    // Row b's own block where it reads it from own_k / own_v (-1 never matches a block it reads).
    const int64_t own = has_own ? own_of[b] : -1;
    const int64_t own_block = own >= 0 ? rows.blocks[rows.table[b] + rows.pos[b] / BS] : -1;
    for (int64_t idx = lo; idx < hi;) {
      if (blocks[idx] == own_block) {  // as an open block is read: alone, fp16
        for (int64_t h = 0; h < KVH; ++h) {
          partials.attend<c10::Half>(rows, item, b, h, sk, sv, &own, valid + idx * BS, 0, 1, KVH, h);
        }
        ++idx;
        continue;
      }
      const int64_t slot = has_open ? slot_of[blocks[idx]] : -1;
      if (slot >= 0) {  // an open block, attended in place (fp16)
        for (int64_t h = 0; h < KVH; ++h) {
          partials.attend<c10::Half>(rows, item, b, h, ok, ov, &slot, valid + idx * BS, 0, 1, KVH, h);
        }
        ++idx;
        continue;
      }
      int64_t run = 1;  // blocks of the pool in a row, up to kChunk
      while (run < kChunk && idx + run < hi && !(has_open && slot_of[blocks[idx + run]] >= 0) &&
             blocks[idx + run] != own_block) {
        ++run;
      }
      for (int64_t h = 0; h < KVH; ++h) {
        for (int64_t c = 0; c < run; ++c) {
          widen_block(ks, blocks[idx + c], KVH, h, BS, D, k_buffer.data() + c * BS * D);
          widen_block(vs, blocks[idx + c], KVH, h, BS, D, v_buffer.data() + c * BS * D);
        }
        // Block by block: the float kernel rescales once per run it is given (attend_blocks_avx512.h), and
        // these runs end wherever an open block or the row's own block falls, which is not fixed by the row's
        // block count alone; one block at a time keeps a row's bits independent of where they end.
        for (int64_t c = 0; c < run; ++c) {
          partials.attend<float>(rows, item, b, h, k_buffer.data(), v_buffer.data(), kIota, valid + idx * BS, c,
                                 c + 1, 1, 0);
        }
      }
      idx += run;
    }
  });
}
