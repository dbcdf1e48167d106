// y[:, col : col + N] = x W^T with W held as GGUF K-quant super-blocks of 256 inputs, every code, scale and
// min exactly the file's (Q4_K, Q5_K, Q6_K; ggml-quants.c's block_q4_K / block_q5_K / block_q6_K):
//   Q4_K, Q5_K: w = d * sc[j] * q - dmin * mn[j] for sub-block j of 32 inputs, q 4 or 5 bits, sc and mn 6 bits
//   Q6_K:       w = d * sc[j] * (q - 32) for sub-block j of 16 inputs, q 6 bits, sc a signed byte
// with d and dmin fp16 per super-block. Activations are int8 per (row, group of 32) as in quant_matmul.cpp
// (quant_common.h): each 32-input group is an exact integer dot product, times its sub-block scale in
// integers too (Q6_K: each 16-input half by its own), then one fp32 product with d * dx. No float product
// chain is left for -ffast-math to reassociate differently in the 1-row and 8-row kernels (d * sc * dx was:
// a row's bits depended on its batch); a row's groups are summed in order, so a row's result never
// depends on the rows beside it.
//
// Packed layout (kquant_repack.cpp repacks the file's blocks into it at load, kvserve/kernels/kquant_packing.py
// is its reference; sizes in kquant_layout.h; the same for every instruction set): output rows in tiles of
// 16, and for each (tile, super-block) one block of 8 groups of 32 inputs, each group (group_bytes) its
//   low nibbles: 4 vectors of 64 bytes; vector j, byte 4r + i: low nibble = the low 4 bits of
//     q[r][32g + 4j + i], high nibble those of q[r][32g + 16 + 4j + i] (quant_matmul.cpp's 4-bit tile)
//   then its high bits: Q5_K 64 bytes, byte 4r + i, bit k = bit 4 of q[r][32g + 4k + i]; Q6_K 2 x 64 bytes,
//     half h, byte 4r + i, bits 2j..2j+1 = bits 4-5 of q[r][32g + 16h + 4j + i]
// and after the 8 groups the parameters, row r of the tile at index r: Q4_K / Q5_K d[16], dmin[16] fp16,
//   sc[8][16], mn[8][16] uint8; Q6_K d[16] fp16, sc[16][16] int8.
// One 64-byte load holds four inputs of 16 rows (vpdpbusd sums them per row); it serves several x rows.
#include "kernels.h"
#include "kquant_layout.h"
#include "quant_common.h"

#include <torch/extension.h>

#include <numeric>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using namespace kvserve_quant;

using namespace kvserve_kquant;

constexpr int64_t kMaxRows = 8;  // activation rows sharing one pass over a weight tile

struct Problem {
  const uint8_t* packed;
  const int8_t* xq;
  const float *dx, *sx;
  const int32_t* xs16;  // sum of xq per 16 inputs (Q6_K's offset of 32)
  float* y;
  int64_t K, N, ldy, supers, groups;
};

// ---- portable C++ --------------------------------------------------------------------------------

// Row r's 32 codes of group g of a (tile, super-block) block.
void group_codes(int64_t kind, const uint8_t* blk, int64_t g, int64_t r, int32_t q[32]) {
  for (int64_t j = 0; j < 4; ++j) {
    for (int64_t i = 0; i < 4; ++i) {
      const uint8_t byte = blk[group_bytes(kind) * g + 64 * j + 4 * r + i];
      q[4 * j + i] = byte & 0x0F;
      q[16 + 4 * j + i] = byte >> 4;
    }
  }
  const uint8_t* high = blk + group_bytes(kind) * g + 256;
  for (int64_t i = 0; i < 4; ++i) {
    if (kind == kQ5K) {
      const uint8_t bits = high[4 * r + i];
      for (int64_t k = 0; k < 8; ++k) q[4 * k + i] |= ((bits >> k) & 1) << 4;
    } else if (kind == kQ6K) {
      for (int64_t h = 0; h < 2; ++h) {
        const uint8_t bits = high[64 * h + 4 * r + i];
        for (int64_t j = 0; j < 4; ++j) q[16 * h + 4 * j + i] |= ((bits >> (2 * j)) & 3) << 4;
      }
    }
  }
}

void tile_portable(int64_t kind, const Problem& p, int64_t t, int64_t m0, int64_t rows) {
  float acc[kMaxRows][kTile] = {};
  for (int64_t s = 0; s < p.supers; ++s) {
    const uint8_t* blk = p.packed + (t * p.supers + s) * block_bytes(kind);
    const uint8_t* params = blk + kLowBytes + high_bytes(kind);
    const uint16_t* halves = reinterpret_cast<const uint16_t*>(params);
    for (int64_t r = 0; r < kTile; ++r) {
      const float d = half_to_float(halves[r]);
      const float dmin = kind == kQ6K ? 0.f : half_to_float(halves[kTile + r]);
      for (int64_t g = 0; g < kSubGroups; ++g) {
        int32_t q[32];
        group_codes(kind, blk, g, r, q);
        const int64_t group = s * kSubGroups + g;
        for (int64_t m = 0; m < rows; ++m) {
          const int8_t* xg = p.xq + (m0 + m) * p.K + group * kGroup;
          const int64_t at = (m0 + m) * p.groups + group;
          if (kind == kQ6K) {
            int32_t total = 0;
            for (int64_t h = 0; h < 2; ++h) {
              int32_t dot = 0;
              for (int64_t i = 0; i < 16; ++i) dot += q[16 * h + i] * xg[16 * h + i];
              const int32_t sc = static_cast<int8_t>(params[32 + (2 * g + h) * kTile + r]);
              total += sc * (dot - 32 * p.xs16[2 * at + h]);
            }
            acc[m][r] += static_cast<float>(total) * (d * p.dx[at]);
          } else {
            int32_t dot = 0;
            for (int64_t i = 0; i < 32; ++i) dot += q[i] * xg[i];
            const int32_t scaled = dot * static_cast<int32_t>(params[64 + g * kTile + r]);
            const float min = dmin * static_cast<float>(params[192 + g * kTile + r]);  // exact
            acc[m][r] += static_cast<float>(scaled) * (d * p.dx[at]);
            acc[m][r] -= min * p.sx[at];
          }
        }
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kTile, p.N - t * kTile);
  for (int64_t m = 0; m < rows; ++m) std::memcpy(p.y + (m0 + m) * p.ldy + t * kTile, acc[m], valid * sizeof(float));
}

#if defined(__x86_64__)

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

template <int KIND, int ROWS>
void tile_vnni(const Problem& p, int64_t t, int64_t m0) {
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i bit4 = _mm512_set1_epi8(0x10), bits45 = _mm512_set1_epi8(0x30);
  const int8_t* xrow[ROWS];
  for (int m = 0; m < ROWS; ++m) xrow[m] = p.xq + (m0 + m) * p.K;
  for (int64_t s = 0; s < p.supers; ++s) {
    const uint8_t* blk = p.packed + (t * p.supers + s) * block_bytes(KIND);
    const uint8_t* params = blk + kLowBytes + high_bytes(KIND);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 32)));
    for (int64_t g = 0; g < kSubGroups; ++g) {
      const int64_t group = s * kSubGroups + g;
      __m512i dot[ROWS][2];
      for (int m = 0; m < ROWS; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
      const uint8_t* low = blk + group_bytes(KIND) * g;
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
          std::memcpy(&x_lo, xrow[m] + group * kGroup + 4 * j, 4);
          std::memcpy(&x_hi, xrow[m] + group * kGroup + 16 + 4 * j, 4);
          dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], lo, _mm512_set1_epi32(x_lo));
          dot[m][kHalf] = _mm512_dpbusd_epi32(dot[m][kHalf], hi, _mm512_set1_epi32(x_hi));
        }
      }
      if constexpr (KIND == kQ6K) {
        const __m512i sc0 = _mm512_cvtepi8_epi32(load16(params + 32 + 32 * g));
        const __m512i sc1 = _mm512_cvtepi8_epi32(load16(params + 48 + 32 * g));
        for (int m = 0; m < ROWS; ++m) {
          const int64_t at = (m0 + m) * p.groups + group;
          const __m512i a = _mm512_sub_epi32(dot[m][0], _mm512_set1_epi32(32 * p.xs16[2 * at]));
          const __m512i b = _mm512_sub_epi32(dot[m][1], _mm512_set1_epi32(32 * p.xs16[2 * at + 1]));
          const __m512i total = _mm512_add_epi32(_mm512_mullo_epi32(sc0, a), _mm512_mullo_epi32(sc1, b));
          const __m512 unit = _mm512_mul_ps(d, _mm512_set1_ps(p.dx[at]));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), unit, acc[m]);
        }
      } else {
        const __m512i sc = _mm512_cvtepu8_epi32(load16(params + 64 + 16 * g));
        const __m512 min = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(load16(params + 192 + 16 * g))));
        for (int m = 0; m < ROWS; ++m) {
          const int64_t at = (m0 + m) * p.groups + group;
          const __m512 scaled = _mm512_cvtepi32_ps(_mm512_mullo_epi32(dot[m][0], sc));
          acc[m] = _mm512_fmadd_ps(scaled, _mm512_mul_ps(d, _mm512_set1_ps(p.dx[at])), acc[m]);
          acc[m] = _mm512_fnmadd_ps(min, _mm512_set1_ps(p.sx[at]), acc[m]);
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
    case 4: return tile_vnni<KIND, 4>(p, t, m0);
    case 5: return tile_vnni<KIND, 5>(p, t, m0);
    case 6: return tile_vnni<KIND, 6>(p, t, m0);
    case 7: return tile_vnni<KIND, 7>(p, t, m0);
    default: return tile_vnni<KIND, 8>(p, t, m0);
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

inline __m256i load8_u8_epi32(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

template <int KIND, int ROWS>
void tile_avx2(const Problem& p, int64_t t, int64_t m0) {
  __m256 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i bit4 = _mm256_set1_epi8(0x10), bits45 = _mm256_set1_epi8(0x30);
  for (int64_t s = 0; s < p.supers; ++s) {
    const uint8_t* blk = p.packed + (t * p.supers + s) * block_bytes(KIND);
    const uint8_t* params = blk + kLowBytes + high_bytes(KIND);
    for (int64_t g = 0; g < kSubGroups; ++g) {
      const int64_t group = s * kSubGroups + g;
      const uint8_t* low = blk + group_bytes(KIND) * g;
      for (int half = 0; half < 2; ++half) {  // rows 8 * half .. 8 * half + 7 of the tile
        __m256i dot[ROWS][2];
        for (int m = 0; m < ROWS; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
        const auto load = [&](const uint8_t* at) {
          return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * half));
        };
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
            const int8_t* xg = p.xq + (m0 + m) * p.K + group * kGroup;
            int32_t x_lo, x_hi;
            std::memcpy(&x_lo, xg + 4 * j, 4);
            std::memcpy(&x_hi, xg + 16 + 4 * j, 4);
            dot[m][0] = dot4_avx2(dot[m][0], lo, _mm256_set1_epi32(x_lo));
            dot[m][kHalf] = dot4_avx2(dot[m][kHalf], hi, _mm256_set1_epi32(x_hi));
          }
        }
        const __m256 d = _mm256_cvtph_ps(load16(params + 16 * half));
        if constexpr (KIND == kQ6K) {
          const auto scales = [&](int64_t at) {
            return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(params + at + 8 * half)));
          };
          const __m256i sc0 = scales(32 + 32 * g), sc1 = scales(48 + 32 * g);
          for (int m = 0; m < ROWS; ++m) {
            const int64_t at = (m0 + m) * p.groups + group;
            const __m256i a = _mm256_sub_epi32(dot[m][0], _mm256_set1_epi32(32 * p.xs16[2 * at]));
            const __m256i b = _mm256_sub_epi32(dot[m][1], _mm256_set1_epi32(32 * p.xs16[2 * at + 1]));
            const __m256i total = _mm256_add_epi32(_mm256_mullo_epi32(sc0, a), _mm256_mullo_epi32(sc1, b));
            acc[m][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(p.dx[at])),
                                           acc[m][half]);
          }
        } else {
          const __m256 dmin = _mm256_cvtph_ps(load16(params + 32 + 16 * half));
          const __m256i sc = load8_u8_epi32(params + 64 + 16 * g + 8 * half);
          const __m256 min = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(load8_u8_epi32(params + 192 + 16 * g + 8 * half)));
          for (int m = 0; m < ROWS; ++m) {
            const int64_t at = (m0 + m) * p.groups + group;
            const __m256 scaled = _mm256_cvtepi32_ps(_mm256_mullo_epi32(dot[m][0], sc));
            acc[m][half] = _mm256_fmadd_ps(scaled, _mm256_mul_ps(d, _mm256_set1_ps(p.dx[at])), acc[m][half]);
            acc[m][half] = _mm256_fnmadd_ps(min, _mm256_set1_ps(p.sx[at]), acc[m][half]);
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

#endif  // __x86_64__

int64_t rows_per_pass(Isa isa) { return isa == kAvx512Vnni ? 8 : isa == kAvx2 ? 4 : kMaxRows; }

template <int KIND>
void run_tile(Isa isa, const Problem& p, int64_t t, int64_t m0, int64_t rows) {
#if defined(__x86_64__)
  if (isa == kAvx512Vnni) return tile_vnni_rows<KIND>(p, t, m0, rows);
  if (isa == kAvx2) return tile_avx2_rows<KIND>(p, t, m0, rows);
#endif
  tile_portable(KIND, p, t, m0, rows);
}

}  // namespace

// out[:, col : col + N] = x @ W^T: x [M, K] fp32 (K a multiple of 256), packed [tiles, K / 256, block bytes]
// uint8 of `kind` (0 Q4_K, 1 Q5_K, 2 Q6_K), out [M, >= col + N] fp32 with contiguous rows (a fused
// projection's parts, each of its own type, write their columns of one output).
// isa: -1 = the best this CPU has; 0 / 1 / 2 force portable / AVX2 / AVX512-VNNI (tests).
void kquant_matmul_(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t N, torch::Tensor out, int64_t col,
                    int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "kquant_matmul: x must be 2-D fp32");
  TORCH_CHECK(kind >= kQ4K && kind <= kQ6K, "kquant_matmul: kind must be 0 (Q4_K), 1 (Q5_K) or 2 (Q6_K)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(),
              "kquant_matmul: packed weights must be contiguous uint8 [tiles, super-blocks, bytes]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t supers = K / kSuper, tiles = packed.size(0);
  TORCH_CHECK(K % kSuper == 0 && packed.size(1) == supers && packed.size(2) == block_bytes(kind) &&
                  tiles * kTile >= N && (tiles - 1) * kTile < N,
              "kquant_matmul: packed weights do not match x's ", K, " inputs and ", N, " outputs");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == M && out.stride(1) == 1 &&
                  col >= 0 && col + N <= out.size(1),
              "kquant_matmul: out must be fp32 [", M, ", >= ", col + N, "] with contiguous rows");
  const Isa chosen = chosen_isa(isa);
  const int64_t groups = K / kGroup;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> scales;
  thread_local std::vector<int32_t> sums;
  xq.resize(M * K);
  scales.resize(2 * M * groups);
  sums.resize(kind == kQ6K ? M * K / 16 : 0);
  float* dx = scales.data();
  float* sx = dx + M * groups;
  quantize_rows(x.data_ptr<float>(), M, K, xq.data(), dx, sx);
  for (size_t h = 0; h < sums.size(); ++h) sums[h] = std::accumulate(&xq[16 * h], &xq[16 * h + 16], int32_t{0});
  const Problem p{packed.data_ptr<uint8_t>(), xq.data(), dx, sx, sums.data(), out.data_ptr<float>() + col,
                  K, N, out.stride(0), supers, groups};
  const int64_t per_pass = rows_per_pass(chosen);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t m0 = 0; m0 < M; m0 += per_pass) {
        const int64_t rows = std::min(per_pass, M - m0);
        if (kind == kQ4K) run_tile<kQ4K>(chosen, p, t, m0, rows);
        else if (kind == kQ5K) run_tile<kQ5K>(chosen, p, t, m0, rows);
        else run_tile<kQ6K>(chosen, p, t, m0, rows);
      }
    }
  });
}
