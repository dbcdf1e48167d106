// The K-quant matmul's vector tiles (kquant_matmul.cpp describes the layout and the sums): AVX512-VNNI
// (vpdpbusd, vpdpwssd) and AVX2 (vpmaddubsw + vpmaddwd), each templated on the K-quant kind and on the x rows
// that share one pass over a weight tile.
#pragma once

#include "kquant_tiles.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace kvserve_kquant {

inline __m128i load16(const uint8_t* at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at)); }

// ---- AVX512-VNNI -----------------------------------------------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")

// Bits `from`..`from + width - 1` of every byte moved to bit 4 (16-bit shifts: what crosses a byte
// boundary is masked off).
inline __m512i high_bits_512(__m512i v, int from, __m512i mask) {
  const __m512i moved = from <= 4 ? _mm512_sll_epi16(v, _mm_cvtsi32_si128(4 - from))
                                  : _mm512_srl_epi16(v, _mm_cvtsi32_si128(from - 4));
  return _mm512_and_si512(moved, mask);
}

// Sub-blocks j and j + 1's bytes for the tile's 16 rows (32 bytes from `at`) -> lane r: the int16 pair
// (v[j][r], v[j + 1][r]), what vpdpwssd multiplies with a pair of activation sums.
template <bool SIGNED>
inline __m512i row_pairs_512(const uint8_t* at) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                         6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  return _mm512_permutexvar_epi16(order, SIGNED ? _mm512_cvtepi8_epi16(bytes) : _mm512_cvtepu8_epi16(bytes));
}

template <int KIND, int ROWS>
void tile_vnni(const Problem& p, int64_t t, int64_t m0) {
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i bit4 = _mm512_set1_epi8(0x10), bits45 = _mm512_set1_epi8(0x30);
  for (int64_t s = 0; s < p.supers; ++s) {
    const uint8_t* blk = p.packed + (t * p.supers + s) * block_bytes(KIND);
    const int8_t* xs[ROWS];
    for (int m = 0; m < ROWS; ++m) xs[m] = p.x.xq + (m0 + m) * p.K + s * kSuper;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    // Unrolled, so that the layout's offsets (kquant_layout.h) fold to constants: warm 2048x8192 matrices, 1 to
    // 512 rows, 1.04-1.18x the same loops left to the compiler (one process, the two builds).
#pragma GCC unroll 2
    for (int b = 0; b < kBlocksPerSuper; ++b) {  // one activation scale each
      __m512i scaled[ROWS], offsets[ROWS];  // sum_j sc[j] * dot_j; the mins' (Q6_K: the offset's) sum
      for (int m = 0; m < ROWS; ++m) scaled[m] = offsets[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int64_t g = b * kActivationBlock / 32; g < (b + 1) * kActivationBlock / 32; ++g) {
        __m512i dot[ROWS][2];
        for (int m = 0; m < ROWS; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
        const uint8_t* low = blk + group_at(KIND, g);
        __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
        if constexpr (KIND != kQ4K) h0 = _mm512_loadu_si512(low + 256);
        if constexpr (KIND == kQ6K) h1 = _mm512_loadu_si512(low + 320);
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(low + 64 * j);
          __m512i lo = _mm512_and_si512(v, low4);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          if constexpr (KIND == kQ5K) {
            lo = _mm512_or_si512(lo, high_bits_512(h0, j, bit4));
            hi = _mm512_or_si512(hi, high_bits_512(h0, 4 + j, bit4));
          } else if constexpr (KIND == kQ6K) {
            lo = _mm512_or_si512(lo, high_bits_512(h0, 2 * j, bits45));
            hi = _mm512_or_si512(hi, high_bits_512(h1, 2 * j, bits45));
          }
          // Q6_K keeps its two 16-input halves apart (a scale each); the others sum them at once.
          constexpr int kHalf = KIND == kQ6K ? 1 : 0;
          for (int m = 0; m < ROWS; ++m) {
            int32_t x_lo, x_hi;
            std::memcpy(&x_lo, xs[m] + kGroup * g + 4 * j, 4);
            std::memcpy(&x_hi, xs[m] + kGroup * g + 16 + 4 * j, 4);
            dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], lo, _mm512_set1_epi32(x_lo));
            dot[m][kHalf] = _mm512_dpbusd_epi32(dot[m][kHalf], hi, _mm512_set1_epi32(x_hi));
          }
        }
        if constexpr (KIND == kQ6K) {
          const __m512i sc0 = _mm512_cvtepi8_epi32(load16(blk + scales_at(KIND, 2 * g)));
          const __m512i sc1 = _mm512_cvtepi8_epi32(load16(blk + scales_at(KIND, 2 * g + 1)));
          for (int m = 0; m < ROWS; ++m) {
            scaled[m] = _mm512_add_epi32(scaled[m], _mm512_add_epi32(_mm512_mullo_epi32(sc0, dot[m][0]),
                                                                     _mm512_mullo_epi32(sc1, dot[m][1])));
          }
        } else {
          const __m512i sc = _mm512_cvtepu8_epi32(load16(blk + scales_at(KIND, g)));
          for (int m = 0; m < ROWS; ++m) scaled[m] = _mm512_add_epi32(scaled[m], _mm512_mullo_epi32(dot[m][0], sc));
        }
      }
      // The offsets, two sub-blocks per vpdpwssd: Q6_K's sc[h] * sum_16, Q4_K / Q5_K's mn[j] * sum_32.
      constexpr int kPairs = KIND == kQ6K ? kActivationBlock / 32 : kActivationBlock / 64;
      for (int pair = b * kPairs; pair < (b + 1) * kPairs; ++pair) {
        const __m512i weights = KIND == kQ6K ? row_pairs_512<true>(blk + scales_at(KIND, 2 * pair))
                                             : row_pairs_512<false>(blk + mins_at(KIND, 2 * pair));
        for (int m = 0; m < ROWS; ++m) {
          const int16_t* sums = KIND == kQ6K ? p.s16(m0 + m, s) : p.s32(m0 + m, s);
          offsets[m] = _mm512_dpwssd_epi32(offsets[m], weights, _mm512_set1_epi32(pair_of(sums + 2 * pair)));
        }
      }
      for (int m = 0; m < ROWS; ++m) {
        const __m512 dx = _mm512_set1_ps(p.dx(m0 + m, s, b));
        if constexpr (KIND == kQ6K) {
          const __m512i total = _mm512_sub_epi32(scaled[m], _mm512_slli_epi32(offsets[m], 5));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, dx), acc[m]);
        } else {
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(scaled[m]), _mm512_mul_ps(d, dx), acc[m]);
          acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(offsets[m]), _mm512_mul_ps(dmin, dx), acc[m]);
        }
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kTile, p.N - t * kTile);
  const __mmask16 mask = valid == kTile ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  for (int m = 0; m < ROWS; ++m) _mm512_mask_storeu_ps(p.y + (m0 + m) * p.ldy + t * kTile, mask, acc[m]);
}

template <int KIND>
void tile_vnni_rows(const Problem& p, int64_t t, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: return tile_vnni<KIND, 1>(p, t, m0);
    case 2: return tile_vnni<KIND, 2>(p, t, m0);
    case 3: return tile_vnni<KIND, 3>(p, t, m0);
    default: return tile_vnni<KIND, 4>(p, t, m0);
  }
}

#pragma GCC pop_options

// ---- AVX2 (no VNNI): vpmaddubsw + vpmaddwd in place of vpdpbusd, two halves of 8 rows --------------

#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma")

// u8 x s8, 4 products summed per 32-bit lane. Exact for codes below 64: a pair sums to at most
// 2 * 63 * 127, far from vpmaddubsw's 16-bit saturation.
inline __m256i dot4_avx2(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

inline __m256i high_bits_256(__m256i v, int from, __m256i mask) {
  const __m256i moved = from <= 4 ? _mm256_sll_epi16(v, _mm_cvtsi32_si128(4 - from))
                                  : _mm256_srl_epi16(v, _mm_cvtsi32_si128(from - 4));
  return _mm256_and_si256(moved, mask);
}

// The AVX2 form of row_pairs_512 for the 8 rows of half `half` of the tile: lane r holds the int16 pair
// (v[j][8 half + r], v[j + 1][8 half + r]), for vpmaddwd.
template <bool SIGNED>
inline __m256i row_pairs_256(const uint8_t* at, int half) {
  const auto widen = [&](const uint8_t* from) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(from + 8 * half));
    return SIGNED ? _mm_cvtepi8_epi16(bytes) : _mm_cvtepu8_epi16(bytes);
  };
  const __m128i first = widen(at), second = widen(at + 16);
  return _mm256_set_m128i(_mm_unpackhi_epi16(first, second), _mm_unpacklo_epi16(first, second));
}

template <int KIND, int ROWS>
void tile_avx2(const Problem& p, int64_t t, int64_t m0) {
  __m256 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i bit4 = _mm256_set1_epi8(0x10), bits45 = _mm256_set1_epi8(0x30);
  for (int64_t s = 0; s < p.supers; ++s) {
    const uint8_t* blk = p.packed + (t * p.supers + s) * block_bytes(KIND);
    const int8_t* xs[ROWS];
    for (int m = 0; m < ROWS; ++m) xs[m] = p.x.xq + (m0 + m) * p.K + s * kSuper;
    for (int b = 0; b < kBlocksPerSuper; ++b) {  // one activation scale each
      for (int half = 0; half < 2; ++half) {  // rows 8 * half .. 8 * half + 7 of the tile
        __m256i scaled[ROWS], offsets[ROWS];
        for (int m = 0; m < ROWS; ++m) scaled[m] = offsets[m] = _mm256_setzero_si256();
        const auto load = [&](const uint8_t* at) {
          return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * half));
        };
        for (int64_t g = b * kActivationBlock / 32; g < (b + 1) * kActivationBlock / 32; ++g) {
          const uint8_t* low = blk + group_at(KIND, g);
          __m256i dot[ROWS][2];
          for (int m = 0; m < ROWS; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
          const __m256i h0 = KIND == kQ4K ? low4 : load(low + 256);
          const __m256i h1 = KIND == kQ6K ? load(low + 320) : low4;
          for (int j = 0; j < 4; ++j) {
            const __m256i v = load(low + 64 * j);
            __m256i lo = _mm256_and_si256(v, low4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if constexpr (KIND == kQ5K) {
              lo = _mm256_or_si256(lo, high_bits_256(h0, j, bit4));
              hi = _mm256_or_si256(hi, high_bits_256(h0, 4 + j, bit4));
            } else if constexpr (KIND == kQ6K) {
              lo = _mm256_or_si256(lo, high_bits_256(h0, 2 * j, bits45));
              hi = _mm256_or_si256(hi, high_bits_256(h1, 2 * j, bits45));
            }
            constexpr int kHalf = KIND == kQ6K ? 1 : 0;
            for (int m = 0; m < ROWS; ++m) {
              int32_t x_lo, x_hi;
              std::memcpy(&x_lo, xs[m] + kGroup * g + 4 * j, 4);
              std::memcpy(&x_hi, xs[m] + kGroup * g + 16 + 4 * j, 4);
              dot[m][0] = dot4_avx2(dot[m][0], lo, _mm256_set1_epi32(x_lo));
              dot[m][kHalf] = dot4_avx2(dot[m][kHalf], hi, _mm256_set1_epi32(x_hi));
            }
          }
          const auto scales = [&](int64_t at) {  // 8 bytes of this half's rows, widened to int32
            const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + at + 8 * half));
            return KIND == kQ6K ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
          };
          if constexpr (KIND == kQ6K) {
            const __m256i sc0 = scales(scales_at(KIND, 2 * g)), sc1 = scales(scales_at(KIND, 2 * g + 1));
            for (int m = 0; m < ROWS; ++m) {
              scaled[m] = _mm256_add_epi32(scaled[m], _mm256_add_epi32(_mm256_mullo_epi32(sc0, dot[m][0]),
                                                                       _mm256_mullo_epi32(sc1, dot[m][1])));
            }
          } else {
            const __m256i sc = scales(scales_at(KIND, g));
            for (int m = 0; m < ROWS; ++m) scaled[m] = _mm256_add_epi32(scaled[m], _mm256_mullo_epi32(dot[m][0], sc));
          }
        }
        constexpr int kPairs = KIND == kQ6K ? kActivationBlock / 32 : kActivationBlock / 64;
        for (int pair = b * kPairs; pair < (b + 1) * kPairs; ++pair) {
          const __m256i weights = KIND == kQ6K ? row_pairs_256<true>(blk + scales_at(KIND, 2 * pair), half)
                                               : row_pairs_256<false>(blk + mins_at(KIND, 2 * pair), half);
          for (int m = 0; m < ROWS; ++m) {
            const int16_t* sums = KIND == kQ6K ? p.s16(m0 + m, s) : p.s32(m0 + m, s);
            offsets[m] = _mm256_add_epi32(offsets[m],
                                          _mm256_madd_epi16(weights, _mm256_set1_epi32(pair_of(sums + 2 * pair))));
          }
        }
        const __m256 d = _mm256_cvtph_ps(load16(blk + 16 * half));
        for (int m = 0; m < ROWS; ++m) {
          const __m256 dx = _mm256_set1_ps(p.dx(m0 + m, s, b));
          if constexpr (KIND == kQ6K) {
            const __m256i total = _mm256_sub_epi32(scaled[m], _mm256_slli_epi32(offsets[m], 5));
            acc[m][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, dx), acc[m][half]);
          } else {
            const __m256 dmin = _mm256_cvtph_ps(load16(blk + 32 + 16 * half));
            acc[m][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(scaled[m]), _mm256_mul_ps(d, dx), acc[m][half]);
            acc[m][half] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(offsets[m]), _mm256_mul_ps(dmin, dx), acc[m][half]);
          }
        }
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kTile, p.N - t * kTile);
  alignas(32) float tmp[kTile];
  for (int m = 0; m < ROWS; ++m) {
    _mm256_store_ps(tmp, acc[m][0]);
    _mm256_store_ps(tmp + 8, acc[m][1]);
    std::memcpy(p.y + (m0 + m) * p.ldy + t * kTile, tmp, valid * sizeof(float));
  }
}

template <int KIND>
void tile_avx2_rows(const Problem& p, int64_t t, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: return tile_avx2<KIND, 1>(p, t, m0);
    case 2: return tile_avx2<KIND, 2>(p, t, m0);
    case 3: return tile_avx2<KIND, 3>(p, t, m0);
    default: return tile_avx2<KIND, 4>(p, t, m0);
  }
}

#pragma GCC pop_options

}  // namespace kvserve_kquant

#endif  // __x86_64__
