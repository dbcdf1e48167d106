// y = x W^T with W held as 4-bit or 8-bit codes in groups of 32 inputs: w = a * q + b per (row, group),
// q unsigned, a and b fp16. Every GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 block is such a group (exactly:
// Q4_0 is a = d, b = -8d; Q4_1 a = d, b = m; Q8_0 a = d, b = -128d), and so is an int4 / int8 group
// quantized here from fp32 weights.
//
// Activations are quantized to int8 per (row, group of 32), scale dx = max|x| / 127, as llama.cpp does
// for its quantized matmuls (Q8_0 / Q8_1 activations): the products of a group are then exact integer
// dot products, y = sum over groups of a * dx * sum(q * xq) + b * dx * sum(xq) = dx * sum(w * xq).
// The offset term uses the quantized sum, so that b (which is -128d for Q8_0) cancels exactly instead
// of multiplying the rounding of x by 128.
//
// Where every group's offset is -zero * a for one integer `zero` (Q4_0: 8, Q5_0: 16, Q8_0: 128, MXFP4's
// shifted levels: 12), the offset is folded into the integer dot product instead: each group's sum starts
// at -zero * sum(xq) (Problem::zero_sums), so y = sum over groups of a * dx * sum((q - zero) * xq), exact in
// int32 up to the one fp32 multiply-add per group. That is one multiply-add fewer per (row, group) on the
// pipes the dot products use (on Zen 4, vpdpbusd and FMAs share them: a prefill's matmul 1.07-1.10x
// faster), and no large product to cancel against the offset's.
//
// Packed layout (kvserve/kernels/packing.py packs it; it is the same for every instruction set):
// output rows in tiles of 16, and for each (tile, group) one block of
//   4-bit: 4 vectors of 64 bytes; vector j, byte 4r + i: low nibble = q[r][4j + i], high = q[r][16 + 4j + i]
//   8-bit: 8 vectors of 64 bytes; vector j, byte 4r + i = q[r][4j + i]
// (r: row in the tile, indices within the group), then a[16] and b[16] as fp16 (b left out where a zero point
// stands for it: a Q4_0 block's 18 bytes per 32 weights, as the file has it). 4-bit codes may index a
// table of 16 unsigned values below 128 (`table`): w = a * table[q] + b, for a format whose 16 levels are not
// evenly spaced (MXFP4's E2M1 values, doubled and shifted by 12: 0..24) held at 4 bits exactly. So one 64-byte load
// holds four consecutive inputs of each of 16 rows: a dot-product instruction that sums 4 u8 x s8
// products per 32-bit lane (AVX512-VNNI's vpdpbusd) gives 16 rows' partial dot products with no
// horizontal reduction, and one weight load serves several activation rows.
//
// This header holds how one tile of 16 outputs is computed on each instruction set (portable C++,
// AVX512-VNNI, AVX2); quant_matmul.cpp chooses the set and the tiles and holds the op's checks.
#pragma once

#include "quant_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvserve_quant_tiles {

using namespace kvserve_quant;

constexpr int64_t kTile = 16;   // output rows per tile
constexpr int64_t kMaxRows = 8; // activation rows sharing one pass over a weight tile

// A (tile, group) block's bytes: codes, 16 fp16 scales, and 16 fp16 offsets unless a zero point stands for them.
inline int64_t block_bytes(int64_t bits, bool offsets = true) {
  return bits * kTile * kGroup / 8 + (offsets ? 2 : 1) * kTile * 2;
}

struct Problem {
  const uint8_t* packed;
  const int8_t* xq;
  const float* dx;
  const float* sx;
  float* y;
  int64_t M, K, N, groups, bits, block;
  const uint8_t* table;  // 16 values a 4-bit code stands for, or nullptr: the code itself
  const int32_t* zero_sums;  // [M, groups]: -zero * sum(xq) where the offsets are -zero * a, or nullptr: b * sx
};

// ---- portable C++ --------------------------------------------------------------------------------

inline void tile_portable(const Problem& p, int64_t t, int64_t m0, int64_t rows) {
  float acc[kMaxRows][kTile] = {};
  for (int64_t g = 0; g < p.groups; ++g) {
    const uint8_t* blk = p.packed + (t * p.groups + g) * p.block;
    const uint16_t* ab = reinterpret_cast<const uint16_t*>(blk + p.bits * kTile * kGroup / 8);
    for (int64_t r = 0; r < kTile; ++r) {
      int32_t q[kGroup];
      if (p.bits == 4) {
        for (int64_t j = 0; j < 4; ++j) {
          for (int64_t i = 0; i < 4; ++i) {
            const uint8_t byte = blk[64 * j + 4 * r + i];
            q[4 * j + i] = p.table ? p.table[byte & 0x0F] : byte & 0x0F;
            q[16 + 4 * j + i] = p.table ? p.table[byte >> 4] : byte >> 4;
          }
        }
      } else {
        for (int64_t j = 0; j < 8; ++j) {
          for (int64_t i = 0; i < 4; ++i) q[4 * j + i] = blk[64 * j + 4 * r + i];
        }
      }
      const float a = half_to_float(ab[r]);
      for (int64_t m = 0; m < rows; ++m) {
        const int8_t* xg = p.xq + (m0 + m) * p.K + g * kGroup;
        const int64_t s = (m0 + m) * p.groups + g;
        int32_t dot = p.zero_sums ? p.zero_sums[s] : 0;
        for (int64_t i = 0; i < kGroup; ++i) dot += q[i] * xg[i];
        acc[m][r] += p.zero_sums ? a * p.dx[s] * static_cast<float>(dot)
                                 : a * p.dx[s] * static_cast<float>(dot) + half_to_float(ab[kTile + r]) * p.sx[s];
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kTile, p.N - t * kTile);
  for (int64_t m = 0; m < rows; ++m) std::memcpy(p.y + (m0 + m) * p.N + t * kTile, acc[m], valid * sizeof(float));
}

#if defined(__x86_64__)

// ---- AVX512-VNNI -----------------------------------------------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")

// NT tiles `ts` at once, each tile's arithmetic the same as alone (its bits never depend on the others).
// Why several: a tile is one run of bytes, and a decode step's few rows read each byte once, so the matmul
// runs at the rate memory streams to the cores; four runs read side by side streamed 5-30% faster than one
// (bench/matmul_runs.py; Zen 4, README 2026-11-29). The K-quant kernel gains nothing from it: its blocks'
// parameters, read before their codes, already make a second run, and more runs than that were slower.
template <int BITS, int ROWS, bool TABLE, int NT = 1>
void tile_vnni(const Problem& p, const int64_t* ts, int64_t m0) {
  __m512 acc[NT][ROWS];
  for (int u = 0; u < NT; ++u) {
    for (int m = 0; m < ROWS; ++m) acc[u][m] = _mm512_setzero_ps();
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // The table in every 128-bit lane: vpshufb looks a code up within its own lane.
  const __m512i lut = TABLE ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.table)))
                            : low4;
  const int8_t* xrow[ROWS];
  for (int m = 0; m < ROWS; ++m) xrow[m] = p.xq + (m0 + m) * p.K;
  const uint8_t* blk[NT];
  for (int u = 0; u < NT; ++u) blk[u] = p.packed + ts[u] * p.groups * p.block;
  const auto broadcast = [&](int m, int64_t at) {
    int32_t x4;
    std::memcpy(&x4, xrow[m] + at, 4);
    return _mm512_set1_epi32(x4);
  };
  const int32_t* zero_sums = p.zero_sums;
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512i dot[NT][ROWS];
    for (int m = 0; m < ROWS; ++m) {
      const __m512i start = zero_sums ? _mm512_set1_epi32(zero_sums[(m0 + m) * p.groups + g]) : _mm512_setzero_si512();
      for (int u = 0; u < NT; ++u) dot[u][m] = start;
    }
    if constexpr (BITS == 4) {
      for (int j = 0; j < 4; ++j) {
        for (int u = 0; u < NT; ++u) {
          const __m512i v = _mm512_loadu_si512(blk[u] + 64 * j);
          __m512i lo = _mm512_and_si512(v, low4);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          if constexpr (TABLE) {
            lo = _mm512_shuffle_epi8(lut, lo);
            hi = _mm512_shuffle_epi8(lut, hi);
          }
          for (int m = 0; m < ROWS; ++m) {
            dot[u][m] = _mm512_dpbusd_epi32(dot[u][m], lo, broadcast(m, g * kGroup + 4 * j));
            dot[u][m] = _mm512_dpbusd_epi32(dot[u][m], hi, broadcast(m, g * kGroup + 16 + 4 * j));
          }
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        for (int u = 0; u < NT; ++u) {
          const __m512i v = _mm512_loadu_si512(blk[u] + 64 * j);
          for (int m = 0; m < ROWS; ++m) {
            dot[u][m] = _mm512_dpbusd_epi32(dot[u][m], v, broadcast(m, g * kGroup + 4 * j));
          }
        }
      }
    }
    for (int u = 0; u < NT; ++u) {
      const uint8_t* ab = blk[u] + BITS * kTile * kGroup / 8;
      const __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab)));
      for (int m = 0; m < ROWS; ++m) {
        const int64_t s = (m0 + m) * p.groups + g;
        const __m512 unit = _mm512_mul_ps(a, _mm512_set1_ps(p.dx[s]));
        acc[u][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[u][m]), unit, acc[u][m]);
      }
      if (!zero_sums) {
        const __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + 32)));
        for (int m = 0; m < ROWS; ++m) {
          acc[u][m] = _mm512_fmadd_ps(b, _mm512_set1_ps(p.sx[(m0 + m) * p.groups + g]), acc[u][m]);
        }
      }
      blk[u] += p.block;
    }
  }
  for (int u = 0; u < NT; ++u) {
    const int64_t valid = std::min<int64_t>(kTile, p.N - ts[u] * kTile);
    const __mmask16 mask = valid == kTile ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    for (int m = 0; m < ROWS; ++m) _mm512_mask_storeu_ps(p.y + (m0 + m) * p.N + ts[u] * kTile, mask, acc[u][m]);
  }
}

template <int BITS, bool TABLE = false>
void tile_vnni_rows(const Problem& p, int64_t t, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: return tile_vnni<BITS, 1, TABLE>(p, &t, m0);
    case 2: return tile_vnni<BITS, 2, TABLE>(p, &t, m0);
    case 3: return tile_vnni<BITS, 3, TABLE>(p, &t, m0);
    case 4: return tile_vnni<BITS, 4, TABLE>(p, &t, m0);
    case 5: return tile_vnni<BITS, 5, TABLE>(p, &t, m0);
    case 6: return tile_vnni<BITS, 6, TABLE>(p, &t, m0);
    case 7: return tile_vnni<BITS, 7, TABLE>(p, &t, m0);
    default: return tile_vnni<BITS, 8, TABLE>(p, &t, m0);
  }
}

#pragma GCC pop_options

// ---- AVX2 (no VNNI): vpmaddubsw + vpmaddwd in place of vpdpbusd, two halves of 8 rows --------------

#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma")

// u8 x s8, 4 products summed per 32-bit lane. Exact for 4-bit codes: a pair sums to at most
// 2 * 15 * 127, far from vpmaddubsw's 16-bit saturation.
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

// NT tiles `ts` at once, as tile_vnni (each tile's arithmetic the same as alone).
template <int BITS, int ROWS, bool TABLE, int NT = 1>
void tile_avx2(const Problem& p, const int64_t* ts, int64_t m0) {
  __m256 acc[NT][ROWS][2];
  for (int u = 0; u < NT; ++u) {
    for (int m = 0; m < ROWS; ++m) acc[u][m][0] = acc[u][m][1] = _mm256_setzero_ps();
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i lut = TABLE ? _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.table)))
                            : low4;
  const int8_t* xrow[ROWS];
  for (int m = 0; m < ROWS; ++m) xrow[m] = p.xq + (m0 + m) * p.K;
  const uint8_t* blk[NT];
  for (int u = 0; u < NT; ++u) blk[u] = p.packed + ts[u] * p.groups * p.block;
  const int32_t* zero_sums = p.zero_sums;
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256i dot[NT][ROWS][2];
    for (int m = 0; m < ROWS; ++m) {
      const __m256i start = zero_sums ? _mm256_set1_epi32(zero_sums[(m0 + m) * p.groups + g]) : _mm256_setzero_si256();
      for (int u = 0; u < NT; ++u) dot[u][m][0] = dot[u][m][1] = start;
    }
    // 8-bit codes go through as two nibbles (q = lo + 16 hi): vpmaddubsw would saturate on 255 * 127 pairs.
    constexpr int kVectors = BITS == 4 ? 4 : 8;
    for (int j = 0; j < kVectors; ++j) {
      for (int u = 0; u < NT; ++u) {
        for (int half = 0; half < 2; ++half) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[u] + 64 * j + 32 * half));
          __m256i lo = _mm256_and_si256(v, low4);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          if constexpr (TABLE) {  // values below 128: a pair sums to at most 2 * 127 * 127, within vpmaddubsw
            lo = _mm256_shuffle_epi8(lut, lo);
            hi = _mm256_shuffle_epi8(lut, hi);
          }
          for (int m = 0; m < ROWS; ++m) {
            __m256i& d = dot[u][m][half];
            if constexpr (BITS == 4) {
              int32_t x_lo, x_hi;
              std::memcpy(&x_lo, xrow[m] + g * kGroup + 4 * j, 4);
              std::memcpy(&x_hi, xrow[m] + g * kGroup + 16 + 4 * j, 4);
              d = dot4(dot4(d, lo, _mm256_set1_epi32(x_lo)), hi, _mm256_set1_epi32(x_hi));
            } else {
              int32_t x4;
              std::memcpy(&x4, xrow[m] + g * kGroup + 4 * j, 4);
              const __m256i xs = _mm256_set1_epi32(x4);
              const __m256i low_sum = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xs), _mm256_set1_epi16(1));
              const __m256i high_sum = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xs), _mm256_set1_epi16(16));
              d = _mm256_add_epi32(d, _mm256_add_epi32(low_sum, high_sum));
            }
          }
        }
      }
    }
    for (int u = 0; u < NT; ++u) {
      const uint8_t* ab = blk[u] + BITS * kTile * kGroup / 8;
      for (int half = 0; half < 2; ++half) {
        const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ab + 16 * half)));
        for (int m = 0; m < ROWS; ++m) {
          const int64_t s = (m0 + m) * p.groups + g;
          __m256& c = acc[u][m][half];
          c = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[u][m][half]), _mm256_mul_ps(a, _mm256_set1_ps(p.dx[s])), c);
        }
        if (!zero_sums) {
          const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ab + 32 + 16 * half)));
          for (int m = 0; m < ROWS; ++m) {
            __m256& c = acc[u][m][half];
            c = _mm256_fmadd_ps(b, _mm256_set1_ps(p.sx[(m0 + m) * p.groups + g]), c);
          }
        }
      }
      blk[u] += p.block;
    }
  }
  for (int u = 0; u < NT; ++u) {
    const int64_t valid = std::min<int64_t>(kTile, p.N - ts[u] * kTile);
    for (int m = 0; m < ROWS; ++m) {
      float* out = p.y + (m0 + m) * p.N + ts[u] * kTile;
      if (valid == kTile) {
        _mm256_storeu_ps(out, acc[u][m][0]);
        _mm256_storeu_ps(out + 8, acc[u][m][1]);
      } else {
        alignas(32) float tmp[kTile];
        _mm256_store_ps(tmp, acc[u][m][0]);
        _mm256_store_ps(tmp + 8, acc[u][m][1]);
        std::memcpy(out, tmp, valid * sizeof(float));
      }
    }
  }
}

template <int BITS, bool TABLE = false>
void tile_avx2_rows(const Problem& p, int64_t t, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: return tile_avx2<BITS, 1, TABLE>(p, &t, m0);
    case 2: return tile_avx2<BITS, 2, TABLE>(p, &t, m0);
    case 3: return tile_avx2<BITS, 3, TABLE>(p, &t, m0);
    default: return tile_avx2<BITS, 4, TABLE>(p, &t, m0);
  }
}

#pragma GCC pop_options

#endif  // __x86_64__

}  // namespace kvserve_quant_tiles
