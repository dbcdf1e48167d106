// A GGUF file's K-quant super-blocks (Q4_K, Q5_K, Q6_K; ggml-quants.c's block_q4_K / q5_K / q6_K) ->
// the packed layout kquant_matmul.cpp reads (described there), every code, scale, min, d and dmin kept
// exactly. The same bytes as kvserve/kernels/kquant_packing.py's torch reference, in one pass over the
// file's bytes: the reference's chain of whole-matrix torch ops took most of a 1B-class file's load.
#include "kernels.h"
#include "kquant_layout.h"

#include <ATen/Parallel.h>

#include <cstring>

namespace {

using namespace kvserve_kquant;

// The 256 codes of one super-block, in input order (kquant_packing.kquant_fields).
void decode_codes(int64_t kind, const uint8_t* b, uint8_t q[kSuper]) {
  if (kind == kQ6K) {  // ql[128], qh[64]: per 128-input half, ql[l], ql[l+32]'s low then high nibbles
    const uint8_t *ql = b, *qh = b + 128;
    for (int half = 0; half < 2; ++half) {
      for (int l = 0; l < 32; ++l) {
        const uint8_t a = ql[64 * half + l], c = ql[64 * half + 32 + l], h = qh[32 * half + l];
        uint8_t* out = q + 128 * half + l;
        out[0] = (a & 0x0F) | ((h & 3) << 4);
        out[32] = (c & 0x0F) | (((h >> 2) & 3) << 4);
        out[64] = (a >> 4) | (((h >> 4) & 3) << 4);
        out[96] = (c >> 4) | (((h >> 6) & 3) << 4);
      }
    }
    return;
  }
  const uint8_t* qs = b + (kind == kQ4K ? 16 : 48);  // 4 chunks of 32 bytes: sub-blocks 2c (low), 2c+1 (high)
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      q[64 * c + l] = qs[32 * c + l] & 0x0F;
      q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
  }
  if (kind == kQ5K) {  // bit g of qh[l]: bit 4 of input l of sub-block g
    const uint8_t* qh = b + 16;
    for (int g = 0; g < 8; ++g) {
      for (int l = 0; l < 32; ++l) q[32 * g + l] |= ((qh[l] >> g) & 1) << 4;
    }
  }
}

// Row r's part of one packed (tile, super-block) block from its file super-block `b`.
void repack_row(int64_t kind, const uint8_t* b, int64_t r, uint8_t* block) {
  uint8_t q[kSuper];
  decode_codes(kind, b, q);
  for (int g = 0; g < 8; ++g) {
    const uint8_t* qg = q + 32 * g;
    uint8_t *low = block + group_at(kind, g), *high = low + 256;
    for (int j = 0; j < 4; ++j) {
      for (int i = 0; i < 4; ++i) {
        low[64 * j + 4 * r + i] = (qg[4 * j + i] & 0x0F) | ((qg[16 + 4 * j + i] & 0x0F) << 4);
      }
    }
    for (int i = 0; i < 4 && kind == kQ5K; ++i) {
      uint8_t bits = 0;
      for (int k = 0; k < 8; ++k) bits |= ((qg[4 * k + i] >> 4) & 1) << k;
      high[4 * r + i] = bits;
    }
    for (int h = 0; h < 2 && kind == kQ6K; ++h) {
      for (int i = 0; i < 4; ++i) {
        uint8_t pairs = 0;
        for (int j = 0; j < 4; ++j) pairs |= ((qg[16 * h + 4 * j + i] >> 4) & 3) << (2 * j);
        high[64 * h + 4 * r + i] = pairs;
      }
    }
  }
  if (kind == kQ6K) {  // d[16] fp16 first; each 16-input sub-block's sc[16 rows] int8 ahead of its pair's codes
    std::memcpy(block + 2 * r, b + 208, 2);
    for (int sub = 0; sub < 16; ++sub) block[scales_at(kind, sub) + r] = b[192 + sub];
    return;
  }
  std::memcpy(block + 2 * r, b, 2);       // d
  std::memcpy(block + 32 + 2 * r, b + 2, 2);  // dmin
  const uint8_t* s = b + 4;  // 12 bytes: 8 six-bit scales and 8 six-bit mins
  for (int j = 0; j < 4; ++j) {
    block[scales_at(kind, j) + r] = s[j] & 63;
    block[scales_at(kind, 4 + j) + r] = (s[8 + j] & 0x0F) | ((s[j] >> 6) << 4);
    block[mins_at(kind, j) + r] = s[4 + j] & 63;
    block[mins_at(kind, 4 + j) + r] = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4);
  }
}

}  // namespace

at::Tensor kquant_repack(at::Tensor blocks, int64_t kind) {
  TORCH_CHECK(kind == kQ4K || kind == kQ5K || kind == kQ6K, "kquant_repack: unknown kind ", kind);
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 3 && blocks.is_contiguous() &&
                  blocks.size(2) == file_block_bytes(kind),
              "kquant_repack: blocks must be contiguous uint8 [rows, supers, ", file_block_bytes(kind), "]");
  const int64_t rows = blocks.size(0), supers = blocks.size(1), tiles = (rows + kTile - 1) / kTile;
  const int64_t out_bytes = block_bytes(kind), in_bytes = file_block_bytes(kind);
  // Zeros: a last tile's padding rows have codes and scales of 0 (as the reference pads them).
  at::Tensor packed = at::zeros({tiles, supers, out_bytes}, at::kByte);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles * supers, 16, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t tile = index / supers, super = index % supers;
      for (int64_t r = 0; r < kTile && tile * kTile + r < rows; ++r) {
        repack_row(kind, src + ((tile * kTile + r) * supers + super) * in_bytes, r, dst + index * out_bytes);
      }
    }
  });
  return packed;
}
