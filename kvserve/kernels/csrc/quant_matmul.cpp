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
// Packed layout (kvserve/model/quantized_linear.py packs it; it is the same for every instruction set):
// output rows in tiles of 16, and for each (tile, group) one block of
//   4-bit: 4 vectors of 64 bytes; vector j, byte 4r + i: low nibble = q[r][4j + i], high = q[r][16 + 4j + i]
//   8-bit: 8 vectors of 64 bytes; vector j, byte 4r + i = q[r][4j + i]
// (r: row in the tile, indices within the group), then a[16] and b[16] as fp16. 4-bit codes may index a
// table of 16 unsigned values below 128 (`table`): w = a * table[q] + b, for a format whose 16 levels are not
// evenly spaced (MXFP4's E2M1 values, doubled and shifted by 12: 0..24) held at 4 bits exactly. So one 64-byte load
// holds four consecutive inputs of each of 16 rows: a dot-product instruction that sums 4 u8 x s8
// products per 32-bit lane (AVX512-VNNI's vpdpbusd) gives 16 rows' partial dot products with no
// horizontal reduction, and one weight load serves several activation rows.
//
// Instruction sets are chosen at run time (quant_common.h), so a test can run each path on a machine that
// has them all.
#include "kernels.h"
#include "quant_common.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using namespace kvserve_quant;

constexpr int64_t kTile = 16;   // output rows per tile
constexpr int64_t kMaxRows = 8; // activation rows sharing one pass over a weight tile

inline int64_t block_bytes(int64_t bits) { return bits * kTile * kGroup / 8 + 2 * kTile * 2; }

struct Problem {
  const uint8_t* packed;
  const int8_t* xq;
  const float* dx;
  const float* sx;
  float* y;
  int64_t M, K, N, groups, bits, block;
  const uint8_t* table;  // 16 values a 4-bit code stands for, or nullptr: the code itself
};

// ---- portable C++ --------------------------------------------------------------------------------

void tile_portable(const Problem& p, int64_t t, int64_t m0, int64_t rows) {
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
      const float a = half_to_float(ab[r]), b = half_to_float(ab[kTile + r]);
      for (int64_t m = 0; m < rows; ++m) {
        const int8_t* xg = p.xq + (m0 + m) * p.K + g * kGroup;
        int32_t dot = 0;
        for (int64_t i = 0; i < kGroup; ++i) dot += q[i] * xg[i];
        const int64_t s = (m0 + m) * p.groups + g;
        acc[m][r] += a * p.dx[s] * static_cast<float>(dot) + b * p.sx[s];
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
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512i dot[NT][ROWS];
    for (int u = 0; u < NT; ++u) {
      for (int m = 0; m < ROWS; ++m) dot[u][m] = _mm512_setzero_si512();
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
      const __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + 32)));
      for (int m = 0; m < ROWS; ++m) {
        const int64_t s = (m0 + m) * p.groups + g;
        const __m512 unit = _mm512_mul_ps(a, _mm512_set1_ps(p.dx[s]));
        acc[u][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[u][m]), unit, acc[u][m]);
        acc[u][m] = _mm512_fmadd_ps(b, _mm512_set1_ps(p.sx[s]), acc[u][m]);
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

template <int BITS, int ROWS, bool TABLE>
void tile_avx2(const Problem& p, int64_t t, int64_t m0) {
  __m256 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i lut = TABLE ? _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.table)))
                            : low4;
  const int8_t* xrow[ROWS];
  for (int m = 0; m < ROWS; ++m) xrow[m] = p.xq + (m0 + m) * p.K;
  const uint8_t* blk = p.packed + t * p.groups * p.block;
  for (int64_t g = 0; g < p.groups; ++g, blk += p.block) {
    __m256i dot[ROWS][2];
    for (int m = 0; m < ROWS; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
    // 8-bit codes go through as two nibbles (q = lo + 16 hi): vpmaddubsw would saturate on 255 * 127 pairs.
    constexpr int kVectors = BITS == 4 ? 4 : 8;
    for (int j = 0; j < kVectors; ++j) {
      for (int half = 0; half < 2; ++half) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
        __m256i lo = _mm256_and_si256(v, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if constexpr (TABLE) {  // values below 128: a pair sums to at most 2 * 127 * 127, within vpmaddubsw
          lo = _mm256_shuffle_epi8(lut, lo);
          hi = _mm256_shuffle_epi8(lut, hi);
        }
        for (int m = 0; m < ROWS; ++m) {
          if constexpr (BITS == 4) {
            int32_t x_lo, x_hi;
            std::memcpy(&x_lo, xrow[m] + g * kGroup + 4 * j, 4);
            std::memcpy(&x_hi, xrow[m] + g * kGroup + 16 + 4 * j, 4);
            dot[m][half] = dot4(dot4(dot[m][half], lo, _mm256_set1_epi32(x_lo)), hi, _mm256_set1_epi32(x_hi));
          } else {
            int32_t x4;
            std::memcpy(&x4, xrow[m] + g * kGroup + 4 * j, 4);
            const __m256i xs = _mm256_set1_epi32(x4);
            const __m256i low_sum = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xs), _mm256_set1_epi16(1));
            const __m256i high_sum = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xs), _mm256_set1_epi16(16));
            dot[m][half] = _mm256_add_epi32(dot[m][half], _mm256_add_epi32(low_sum, high_sum));
          }
        }
      }
    }
    const uint8_t* ab = blk + BITS * kTile * kGroup / 8;
    for (int half = 0; half < 2; ++half) {
      const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ab + 16 * half)));
      const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ab + 32 + 16 * half)));
      for (int m = 0; m < ROWS; ++m) {
        const int64_t s = (m0 + m) * p.groups + g;
        acc[m][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][half]), _mm256_mul_ps(a, _mm256_set1_ps(p.dx[s])),
                                       acc[m][half]);
        acc[m][half] = _mm256_fmadd_ps(b, _mm256_set1_ps(p.sx[s]), acc[m][half]);
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kTile, p.N - t * kTile);
  for (int m = 0; m < ROWS; ++m) {
    float* out = p.y + (m0 + m) * p.N + t * kTile;
    if (valid == kTile) {
      _mm256_storeu_ps(out, acc[m][0]);
      _mm256_storeu_ps(out + 8, acc[m][1]);
    } else {
      alignas(32) float tmp[kTile];
      _mm256_store_ps(tmp, acc[m][0]);
      _mm256_store_ps(tmp + 8, acc[m][1]);
      std::memcpy(out, tmp, valid * sizeof(float));
    }
  }
}

template <int BITS, bool TABLE = false>
void tile_avx2_rows(const Problem& p, int64_t t, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: return tile_avx2<BITS, 1, TABLE>(p, t, m0);
    case 2: return tile_avx2<BITS, 2, TABLE>(p, t, m0);
    case 3: return tile_avx2<BITS, 3, TABLE>(p, t, m0);
    default: return tile_avx2<BITS, 4, TABLE>(p, t, m0);
  }
}

#pragma GCC pop_options

#endif  // __x86_64__

// Rows of x one pass over a weight tile serves, per instruction set (register budget).
int64_t rows_per_pass(Isa isa) { return isa == kAvx512Vnni ? 8 : isa == kAvx2 ? 4 : kMaxRows; }

void run_tile(Isa isa, const Problem& p, int64_t t, int64_t m0, int64_t rows) {
#if defined(__x86_64__)
  if (isa == kAvx512Vnni) {
    if (p.table) return tile_vnni_rows<4, true>(p, t, m0, rows);
    return p.bits == 4 ? tile_vnni_rows<4>(p, t, m0, rows) : tile_vnni_rows<8>(p, t, m0, rows);
  }
  if (isa == kAvx2) {
    if (p.table) return tile_avx2_rows<4, true>(p, t, m0, rows);
    return p.bits == 4 ? tile_avx2_rows<4>(p, t, m0, rows) : tile_avx2_rows<8>(p, t, m0, rows);
  }
#endif
  tile_portable(p, t, m0, rows);
}

// Tiles read side by side (bench/matmul_runs.py): a lone row 4 (faster than 1 on every shape measured, than 2
// on most); two to four rows at most 2 (their registers: 4 rows x 2 tiles of sums and accumulators; 4 tiles
// were slower than 1 on SmolLM2's shapes, 2 faster on all).
constexpr int64_t kLoneRowRuns = 4;
constexpr int64_t kMaxSideBySideRows = 4, kBatchRuns = 2;

#if defined(__x86_64__)
// The tiles [begin, end) for all ROWS rows of x, RUNS at a time, the RUNS spread over the range (span
// apart); returns where the tiles left over begin.
template <int ROWS, int RUNS>
int64_t side_by_side(const Problem& p, int64_t begin, int64_t end) {
  const int64_t span = (end - begin) / RUNS;
  for (int64_t i = 0; i < span; ++i) {
    int64_t ts[RUNS];
    for (int u = 0; u < RUNS; ++u) ts[u] = begin + u * span + i;
    if (p.table) tile_vnni<4, ROWS, true, RUNS>(p, ts, 0);
    else if (p.bits == 4) tile_vnni<4, ROWS, false, RUNS>(p, ts, 0);
    else tile_vnni<8, ROWS, false, RUNS>(p, ts, 0);
  }
  return begin + RUNS * span;
}

// `runs` tiles at a time, 4 taken as 2 for more than one row.
int64_t side_by_side(const Problem& p, int64_t begin, int64_t end, int64_t runs) {
  if (p.M == 1 && runs == 4) return side_by_side<1, 4>(p, begin, end);
  if (runs < 2 || p.M < 1) return begin;
  switch (p.M) {
    case 1: return side_by_side<1, 2>(p, begin, end);
    case 2: return side_by_side<2, 2>(p, begin, end);
    case 3: return side_by_side<3, 2>(p, begin, end);
    case 4: return side_by_side<4, 2>(p, begin, end);
    default: return begin;  // no rows (a step that samples none): nothing to read
  }
}
#endif

// Tiles [begin, end) for all M rows of x. On AVX512-VNNI a decode batch of up to kMaxSideBySideRows rows
// takes its tiles `runs` at a time (tile_vnni says why); rows otherwise share each pass over a tile
// (per_pass at a time). Either way a tile's arithmetic is the same.
void run_tiles(Isa isa, const Problem& p, int64_t begin, int64_t end, int64_t per_pass, int64_t runs) {
#if defined(__x86_64__)
  if (isa == kAvx512Vnni && p.M <= kMaxSideBySideRows) begin = side_by_side(p, begin, end, runs);
#endif
  for (int64_t t = begin; t < end; ++t) {
    for (int64_t m0 = 0; m0 < p.M; m0 += per_pass) run_tile(isa, p, t, m0, std::min(per_pass, p.M - m0));
  }
}

}  // namespace

// The instruction set quant_matmul uses here: "avx512_vnni", "avx2" or "portable".
std::string quant_matmul_isa() {
  switch (best_isa()) {
    case kAvx512Vnni: return "avx512_vnni";
    case kAvx2: return "avx2";
    default: return "portable";
  }
}

// x [M, K] fp32 (K a multiple of 32), packed [tiles, K / 32, block bytes] uint8 -> y [M, N] fp32 (contiguous,
// the caller's: the decoder stack reuses its buffers).
// isa: -1 = the best this CPU has; 0 / 1 / 2 force portable / AVX2 / AVX512-VNNI (tests). table: uint8 [16],
// the values 4-bit codes stand for (each below 128), or empty: the codes themselves. runs: the tiles a decode
// batch of up to 4 rows reads side by side: 1, 2 or 4 for a lone row, 1 or 2 (4 taken as 2) for more;
// 0 = the kernel's choice (kLoneRowRuns, kBatchRuns; bench/matmul_runs.py compares them).
void quant_matmul_into(const torch::Tensor& input, const torch::Tensor& packed, int64_t bits, int64_t N, int64_t isa,
                       const torch::Tensor& table, float* y, int64_t runs) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.dim() == 2, "quant_matmul: x must be 2-D fp32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(),
              "quant_matmul: packed weights must be contiguous uint8 [tiles, groups, bytes]");
  TORCH_CHECK(bits == 4 || bits == 8, "quant_matmul: 4 or 8 bits");
  TORCH_CHECK(runs == 0 || runs == 1 || runs == 2 || runs == 4, "quant_matmul: runs must be 0, 1, 2 or 4");
  const bool tabled = table.numel() > 0;
  TORCH_CHECK(!tabled || (bits == 4 && table.scalar_type() == at::kByte && table.numel() == 16 &&
                          table.is_contiguous() && table.is_cpu()),
              "quant_matmul: a code table is 16 uint8 values, for 4-bit codes");
  for (int64_t i = 0; tabled && i < 16; ++i) {
    TORCH_CHECK(table.data_ptr<uint8_t>()[i] < 128, "quant_matmul: a code table's values are below 128");
  }
  const torch::Tensor x = input.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t groups = K / kGroup, tiles = packed.size(0);
  TORCH_CHECK(K % kGroup == 0 && packed.size(1) == groups && packed.size(2) == block_bytes(bits) &&
                  tiles * kTile >= N && (tiles - 1) * kTile < N,
              "quant_matmul: packed weights do not match x's ", K, " inputs and ", N, " outputs");
  const Isa chosen = chosen_isa(isa);
  // The quantized activations live in a workspace kept by the calling thread (a decode step makes ~120
  // of these calls: no allocator round trip for them).
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> scales;
  xq.resize(M * K);
  scales.resize(2 * M * groups);
  float* dx = scales.data();
  float* sx = dx + M * groups;
  quantize_rows(x.data_ptr<float>(), M, K, xq.data(), dx, sx);
  const Problem p{packed.data_ptr<uint8_t>(), xq.data(), dx, sx, y, M, K, N, groups, bits,
                  block_bytes(bits), tabled ? table.data_ptr<uint8_t>() : nullptr};
  const int64_t per_pass = rows_per_pass(chosen);
  // Work items are tiles of 16 outputs; each walks every row of x (the tile's weights stay in L1).
  const int64_t read_together = runs != 0 ? runs : M == 1 ? kLoneRowRuns : kBatchRuns;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    run_tiles(chosen, p, begin, end, per_pass, read_together);
  });
}

// The same into a new [M, N].
torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor packed, int64_t bits, int64_t N, int64_t isa,
                           torch::Tensor table, int64_t runs) {
  TORCH_CHECK(x.dim() == 2, "quant_matmul: x must be 2-D fp32");
  auto y = torch::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  quant_matmul_into(x, packed, bits, N, isa, table, y.data_ptr<float>(), runs);
  return y;
}
