// y[:, col : col + N] = x W^T with W held as GGUF K-quant super-blocks of 256 inputs, every code, scale and
// min exactly the file's (Q4_K, Q5_K, Q6_K; ggml-quants.c's block_q4_K / block_q5_K / block_q6_K):
//   Q4_K, Q5_K: w = d * sc[j] * q - dmin * mn[j] for sub-block j of 32 inputs, q 4 or 5 bits, sc and mn 6 bits
//   Q6_K:       w = d * sc[j] * (q - 32) for sub-block j of 16 inputs, q 6 bits, sc a signed byte
// with d and dmin fp16 per super-block. Activations are int8 with one scale dx per (row, block of 128
// inputs) (kquant_activations.h; llama.cpp's Q8_K has one per 256), so a block is summed in integers:
//   Q4_K, Q5_K: y += (d * dx) * sum_j sc[j] * dot_j - (dmin * dx) * sum_j mn[j] * xsum_j
//   Q6_K:       y += (d * dx) * (sum_j sc[j] * dot_j - 32 * sum_j sc[j] * xsum_j)
// over the block's sub-blocks j: dot_j their exact integer dot products, xsum_j their activation codes'
// sums (under 2^28 in all: int32 holds every sum). Each float is one product d * dx or dmin * dx, and a
// row's blocks are summed in order: no product chain is left for -ffast-math to reassociate differently in
// the 1-row and 8-row kernels, and a row's result never depends on the rows beside it.
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
#include "kquant_tiles.h"
#include "kquant_tiles_x86.h"

#include <torch/extension.h>

#include <vector>

namespace {

using namespace kvserve_kquant;

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
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> dx;
  thread_local std::vector<int16_t> sums;
  xq.resize(M * K);
  dx.resize(M * K / kActivationBlock);
  sums.resize(M * K / 32 + M * K / 16);
  const SuperActivations activations{xq.data(), dx.data(), sums.data(), sums.data() + M * K / 32};
  quantize_rows_per_super(x.data_ptr<float>(), M, K, activations);
  const Problem p{packed.data_ptr<uint8_t>(), activations, out.data_ptr<float>() + col, K, N, out.stride(0), supers};
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
