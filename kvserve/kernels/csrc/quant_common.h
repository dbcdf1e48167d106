// What the quantized matmuls share (quant_matmul.cpp: 32-input groups; kquant_matmul.cpp: GGUF K-quant
// super-blocks): the int8 activations both multiply, fp16 widening for the portable paths, and the choice of
// instruction set made at run time (one binary: AVX512-VNNI, AVX2, portable C++).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvserve_quant {

constexpr int64_t kGroup = 32;  // inputs per activation group (one int8 scale each)

// fp16 -> fp32 without F16C (the portable paths).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// x [M, K] fp32 -> xq [M, K] int8, dx [M, K/32] (scale) and sx [M, K/32] (dx * sum of the group's codes),
// scale dx = max|x| / 127 per (row, group of 32), as llama.cpp quantizes activations for its quantized
// matmuls; with `zero_sums`, -zero * (the sum of the group's codes) per (row, group) as int32 instead of sx
// (the folded offset of weights whose offsets are -zero * scale: quant_matmul_tiles.h; such weights' tiles
// never read sx). Each group depends on its own 32 inputs alone.
inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx,
                          int32_t* zero_sums = nullptr, int32_t zero = 0) {
  const int64_t groups = K / kGroup;
  at::parallel_for(0, M * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const float* src = x + item * kGroup;  // rows are contiguous: item = m * groups + g
      float amax = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(src[i]));
      const float scale = amax / 127.f;
      const float inverse = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      int8_t* dst = xq + item * kGroup;
      for (int64_t i = 0; i < kGroup; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(src[i] * inverse));
        dst[i] = static_cast<int8_t>(q);
        sum += q;
      }
      dx[item] = scale;
      if (zero_sums != nullptr) {
        zero_sums[item] = -zero * sum;
      } else {
        sx[item] = scale * static_cast<float>(sum);
      }
    }
  });
}

enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2 };

inline Isa best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return kAvx512Vnni;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return kAvx2;
  }
#endif
  return kPortable;
}

// The instruction set a call runs on: `asked` < 0 the best this CPU has, else at most that (tests force
// each path on a machine that has them all).
inline Isa chosen_isa(int64_t asked) {
  return asked < 0 ? best_isa() : static_cast<Isa>(std::min<int64_t>(asked, best_isa()));
}

}  // namespace kvserve_quant
