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
// 16, and for each (tile, super-block) one block (row r of the tile at index r of every parameter array):
//   first d[16] fp16, and for Q4_K / Q5_K dmin[16] fp16;
//   then 4 pairs of groups of 32 inputs, each pair its parameters, 64 bytes: Q4_K / Q5_K sc[2][16],
//   mn[2][16] uint8 (the pair's two sub-blocks of 32), Q6_K sc[4][16] int8 (its four sub-blocks of 16);
//   and then its two groups (group_bytes each), every group its
//     low nibbles: 4 vectors of 64 bytes; vector j, byte 4r + i: low nibble = the low 4 bits of
//       q[r][32g + 4j + i], high nibble those of q[r][32g + 16 + 4j + i] (quant_matmul.cpp's 4-bit tile)
//     then its high bits: Q5_K 64 bytes, byte 4r + i, bit k = bit 4 of q[r][32g + 4k + i]; Q6_K 2 x 64 bytes,
//       half h, byte 4r + i, bits 2j..2j+1 = bits 4-5 of q[r][32g + 16h + 4j + i].
//   Offsets: kquant_layout.h (which says why this order).
// One 64-byte load holds four inputs of 16 rows (vpdpbusd sums them per row); it serves several x rows.
#include "kernels.h"
#include "kquant_tiles.h"
#include "kquant_tiles_x86.h"

#include <vector>

namespace {

using namespace kvserve_kquant;

// Four rows a pass on AVX512-VNNI too: at eight, a tile's sums and accumulators (5 vectors a row) spill, and
// the passes over a tile read it from L1/L2, not memory. Warm 2048x8192 matrices, 8 to 512 rows, four against
// eight a pass: Q4_K 1.07-1.12x, Q5_K 1.00-1.14x, Q6_K 1.10-1.26x (the same bits: a row's result is its own).
int64_t rows_per_pass(Isa isa) { return isa == kAvx512Vnni || isa == kAvx2 ? 4 : kMaxRows; }

template <int KIND>
void run_tile(Isa isa, const Problem& p, int64_t t, int64_t m0, int64_t rows) {
#if defined(__x86_64__)
  if (isa == kAvx512Vnni) return tile_vnni_rows<KIND>(p, t, m0, rows);
  if (isa == kAvx2) return tile_avx2_rows<KIND>(p, t, m0, rows);
#endif
  tile_portable(KIND, p, t, m0, rows);
}

}  // namespace

// out[:, columns[i] : columns[i] + outputs[i]] = x @ W_i^T for each part i: x [M, K] fp32 (K a multiple of
// 256), packed[i] [tiles, K / 256, block bytes] uint8 of kinds[i] (0 Q4_K, 1 Q5_K, 2 Q6_K), out [M, >= every
// part's last column] fp32 with contiguous rows. A fused projection's parts (each of its own type: a Q4_K_M
// file's Q6_K V rows) share one quantization of x and one parallel region, each thread taking the same share
// of every part's tiles (a part per region cost a fork and join each and quantized x again).
// isa: -1 = the best this CPU has; 0 / 1 / 2 force portable / AVX2 / AVX512-VNNI (tests).
void kquant_matmul_(at::Tensor x, const std::vector<at::Tensor>& packed, const std::vector<int64_t>& kinds,
                    const std::vector<int64_t>& outputs, at::Tensor out, const std::vector<int64_t>& columns,
                    int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "kquant_matmul: x must be 2-D fp32");
  const size_t parts = packed.size();
  TORCH_CHECK(parts > 0 && kinds.size() == parts && outputs.size() == parts && columns.size() == parts,
              "kquant_matmul: one kind, output count and column per packed part");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), supers = K / kSuper;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == M && out.stride(1) == 1,
              "kquant_matmul: out must be fp32 [", M, ", columns] with contiguous rows");
  for (size_t i = 0; i < parts; ++i) {
    const int64_t kind = kinds[i], N = outputs[i], col = columns[i], tiles = packed[i].size(0);
    TORCH_CHECK(kind >= kQ4K && kind <= kQ6K, "kquant_matmul: kind must be 0 (Q4_K), 1 (Q5_K) or 2 (Q6_K)");
    TORCH_CHECK(packed[i].scalar_type() == at::kByte && packed[i].dim() == 3 && packed[i].is_contiguous(),
                "kquant_matmul: packed weights must be contiguous uint8 [tiles, super-blocks, bytes]");
    TORCH_CHECK(K % kSuper == 0 && packed[i].size(1) == supers && packed[i].size(2) == block_bytes(kind) &&
                    tiles * kTile >= N && (tiles - 1) * kTile < N,
                "kquant_matmul: packed weights do not match x's ", K, " inputs and ", N, " outputs");
    TORCH_CHECK(col >= 0 && col + N <= out.size(1),
                "kquant_matmul: out must be fp32 [", M, ", >= ", col + N, "] with contiguous rows");
  }
  const Isa chosen = chosen_isa(isa);
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> dx;
  thread_local std::vector<int16_t> sums;
  xq.resize(M * K);
  dx.resize(M * K / kActivationBlock);
  sums.resize(M * K / 32 + M * K / 16);
  const KQuantActivations activations{xq.data(), dx.data(), sums.data(), sums.data() + M * K / 32};
  quantize_rows_per_block(x.data_ptr<float>(), M, K, activations);
  // Kept, as the buffers above (a step makes ~64 of these calls). The workers read it through `problem`: a
  // thread_local named inside the lambda would be each worker's own, empty one.
  thread_local std::vector<Problem> problems;
  problems.clear();
  int64_t most = 0;  // the range split among the threads: each part's tiles are mapped onto it
  for (size_t i = 0; i < parts; ++i) {
    problems.push_back(Problem{packed[i].data_ptr<uint8_t>(), activations, out.data_ptr<float>() + columns[i], K,
                               outputs[i], out.stride(0), supers});
    most = std::max(most, packed[i].size(0));
  }
  const Problem* problem = problems.data();
  const int64_t per_pass = rows_per_pass(chosen);
  at::parallel_for(0, most, 1, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < parts; ++i) {
      const int64_t tiles = packed[i].size(0);  // this thread's share: the same fraction of every part
      for (int64_t t = tiles * begin / most; t < tiles * end / most; ++t) {
        for (int64_t m0 = 0; m0 < M; m0 += per_pass) {
          const int64_t rows = std::min(per_pass, M - m0);
          if (kinds[i] == kQ4K) run_tile<kQ4K>(chosen, problem[i], t, m0, rows);
          else if (kinds[i] == kQ5K) run_tile<kQ5K>(chosen, problem[i], t, m0, rows);
          else run_tile<kQ6K>(chosen, problem[i], t, m0, rows);
        }
      }
    }
  });
}
