// The int8 activations the K-quant matmul (kquant_matmul.cpp) multiplies: one scale per row and block of
// kActivationBlock inputs, so a block's sub-block products are summed in integers and turned into a float
// once, where a scale per 32 inputs (quant_common.h's quantize_rows, the group-code matmul's) made every
// sub-block a float multiply-add and a min term: the prefill matmuls ran at ~60% of vpdpbusd's rate on
// those float operations. llama.cpp takes one scale per 256 (its Q8_K); 128 is kept here because Gemma 3
// 270M's activations have outliers that 256 pays for (bench/weights_accuracy.py --model gemma3 --windows 4
// --window 512, the file dequantized as reference: KL 7.45e-3 per 32, 7.79e-3 per 128, 1.09e-2 per 256;
// 512-row matmuls over per 32: 1.08-1.22x per 128, 1.10-1.23x per 256, per 64 no faster).
// The codes' sums per 32 and per 16 inputs go with them (the mins' and Q6_K's offset terms, int16 pairs for
// vpdpwssd / vpmaddwd).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kvserve_kquant {

constexpr int64_t kActivationBlock = 128;  // inputs per activation scale: 64, 128 or 256
constexpr int64_t kBlocksPerSuper = 256 / kActivationBlock;
static_assert(kActivationBlock % 64 == 0 && 256 % kActivationBlock == 0, "Q4_K's mins go in pairs of 32 inputs");

struct KQuantActivations {
  int8_t* xq;    // [M, K] codes
  float* dx;     // [M, K / kActivationBlock] scale = max|x| / 127 over the block
  int16_t* s32;  // [M, K / 32] sum of the codes per 32 inputs (at most 32 * 127: int16 holds it)
  int16_t* s16;  // [M, K / 16] sum per 16 inputs
};

// x [M, K] fp32, K a multiple of 256. Each (row, block) depends on its own inputs alone.
inline void quantize_rows_per_block(const float* x, int64_t M, int64_t K, const KQuantActivations& a) {
  constexpr int64_t kInputs = kActivationBlock;
  at::parallel_for(0, M * K / kInputs, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const float* src = x + item * kInputs;  // rows are contiguous: item = m * blocks + b
      float amax = 0.f;
      for (int64_t i = 0; i < kInputs; ++i) amax = std::max(amax, std::fabs(src[i]));
      const float inverse = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* dst = a.xq + item * kInputs;
      for (int64_t i = 0; i < kInputs; ++i) dst[i] = static_cast<int8_t>(std::nearbyint(src[i] * inverse));
      a.dx[item] = amax / 127.f;
      for (int64_t h = 0; h < kInputs / 16; ++h) {
        int32_t sum = 0;
        for (int64_t i = 0; i < 16; ++i) sum += dst[16 * h + i];
        a.s16[item * (kInputs / 16) + h] = static_cast<int16_t>(sum);
      }
      for (int64_t g = 0; g < kInputs / 32; ++g) {
        const int16_t* halves = a.s16 + item * (kInputs / 16) + 2 * g;
        a.s32[item * (kInputs / 32) + g] = static_cast<int16_t>(halves[0] + halves[1]);
      }
    }
  });
}

}  // namespace kvserve_kquant
