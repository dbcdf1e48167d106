// The K-quant matmul's problem (packed weights, the activations of kquant_activations.h, the output) and its
// portable tile: the layout (kquant_matmul.cpp's header) read code by code, the same sums as the vector
// tiles (kquant_tiles_x86.h) in the same order.
#pragma once

#include "kquant_activations.h"
#include "kquant_layout.h"
#include "quant_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kvserve_kquant {

using namespace kvserve_quant;

constexpr int64_t kMaxRows = 8;  // activation rows sharing one pass over a weight tile

struct Problem {
  const uint8_t* packed;
  KQuantActivations x;
  float* y;
  int64_t K, N, ldy, supers;
  // Row m's scale of activation block b of super-block s; its sums per 32 and per 16 inputs of super-block
  // s (a pair of them, sub-blocks j and j + 1, read as one int32 for vpdpwssd).
  float dx(int64_t m, int64_t s, int64_t b) const { return x.dx[(m * supers + s) * kBlocksPerSuper + b]; }
  const int16_t* s32(int64_t m, int64_t s) const { return x.s32 + (m * supers + s) * 8; }
  const int16_t* s16(int64_t m, int64_t s) const { return x.s16 + (m * supers + s) * 16; }
};

inline int32_t pair_of(const int16_t* sums) {
  int32_t both;
  std::memcpy(&both, sums, 4);
  return both;
}

// ---- portable C++ --------------------------------------------------------------------------------

// Row r's 32 codes of group g of a (tile, super-block) block.
inline void group_codes(int64_t kind, const uint8_t* blk, int64_t g, int64_t r, int32_t q[32]) {
  for (int64_t j = 0; j < 4; ++j) {
    for (int64_t i = 0; i < 4; ++i) {
      const uint8_t byte = blk[group_at(kind, g) + 64 * j + 4 * r + i];
      q[4 * j + i] = byte & 0x0F;
      q[16 + 4 * j + i] = byte >> 4;
    }
  }
  const uint8_t* high = blk + group_at(kind, g) + 256;
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

inline void tile_portable(int64_t kind, const Problem& p, int64_t t, int64_t m0, int64_t rows) {
  float acc[kMaxRows][kTile] = {};
  for (int64_t s = 0; s < p.supers; ++s) {
    const uint8_t* blk = p.packed + (t * p.supers + s) * block_bytes(kind);
    const uint16_t* halves = reinterpret_cast<const uint16_t*>(blk);  // d[16], then (not Q6_K) dmin[16]
    for (int64_t r = 0; r < kTile; ++r) {
      int32_t q[kSubGroups][32];
      for (int64_t g = 0; g < kSubGroups; ++g) group_codes(kind, blk, g, r, q[g]);
      const float d = half_to_float(halves[r]);
      for (int64_t m = 0; m < rows; ++m) {
        const int8_t* xs = p.x.xq + (m0 + m) * p.K + s * kSuper;
        for (int64_t b = 0; b < kBlocksPerSuper; ++b) {
          int32_t scaled = 0, offsets = 0;  // sum_j sc[j] * dot_j, and the mins' (Q6_K: the offset's) sum
          const float dx = p.dx(m0 + m, s, b);
          if (kind == kQ6K) {
            for (int64_t h = b * kActivationBlock / 16; h < (b + 1) * kActivationBlock / 16; ++h) {
              int32_t dot = 0;
              for (int64_t i = 0; i < 16; ++i) dot += q[h / 2][16 * (h % 2) + i] * xs[16 * h + i];
              const int32_t sc = static_cast<int8_t>(blk[scales_at(kind, h) + r]);
              scaled += sc * dot;
              offsets += sc * p.s16(m0 + m, s)[h];
            }
            acc[m][r] += static_cast<float>(scaled - 32 * offsets) * (d * dx);
          } else {
            for (int64_t g = b * kActivationBlock / 32; g < (b + 1) * kActivationBlock / 32; ++g) {
              int32_t dot = 0;
              for (int64_t i = 0; i < 32; ++i) dot += q[g][i] * xs[32 * g + i];
              scaled += dot * static_cast<int32_t>(blk[scales_at(kind, g) + r]);
              offsets += static_cast<int32_t>(blk[mins_at(kind, g) + r]) * p.s32(m0 + m, s)[g];
            }
            const float dmin = half_to_float(halves[kTile + r]);
            acc[m][r] += static_cast<float>(scaled) * (d * dx);
            acc[m][r] -= static_cast<float>(offsets) * (dmin * dx);
          }
        }
      }
    }
  }
  const int64_t valid = std::min<int64_t>(kTile, p.N - t * kTile);
  for (int64_t m = 0; m < rows; ++m) std::memcpy(p.y + (m0 + m) * p.ldy + t * kTile, acc[m], valid * sizeof(float));
}


}  // namespace kvserve_kquant
