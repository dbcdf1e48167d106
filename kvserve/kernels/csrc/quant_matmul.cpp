// y = x W^T for W held as 4-bit or 8-bit codes in groups of 32 inputs (the math, the packed layout and each
// instruction set's tile: quant_matmul_tiles.h): the choice of instruction set and of the tiles each thread
// takes, and the op's checks. Instruction sets are chosen at run time (quant_common.h), so a test can run
// each path on a machine that has them all.
#include "kernels.h"
#include "quant_common.h"
#include "quant_matmul_tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace kvserve_quant;
using namespace kvserve_quant_tiles;

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
// were slower than 1 on SmolLM2's shapes, 2 faster on all). AVX2 (16 registers) up to 3 rows: at 4, two
// tiles' sums and accumulators spill, and SmolLM2's shapes ran 5-9% slower than one tile (1B's 20-40% faster).
constexpr int64_t kLoneRowRuns = 4, kBatchRuns = 2;

int64_t max_side_by_side_rows(Isa isa) { return isa == kAvx512Vnni ? 4 : isa == kAvx2 ? 3 : 0; }

// The kernel's choice of `runs`. AVX2 keeps one tile at a time: on the only machine measured (a Zen 4 running
// the AVX2 code, README 2026-11-29), four tiles for a lone row, though 0.98-1.12x per matmul alone, made
// SmolLM2's decode step 1.7-2.7% slower in the engine (two 0.9%; the 1B Q4_0 step 1.5% faster, three rows
// 2.9%). `runs` given still reads them side by side there, for bench/matmul_runs.py on an AVX2-only machine.
int64_t default_runs(Isa isa, int64_t M) {
  if (isa != kAvx512Vnni) return 1;
  return M == 1 ? kLoneRowRuns : kBatchRuns;
}

#if defined(__x86_64__)
// RUNS tiles `ts` for all ROWS rows of x on `isa` (AVX512-VNNI or AVX2).
template <int ROWS, int RUNS>
void tiles_side_by_side(Isa isa, const Problem& p, const int64_t* ts) {
  if (isa == kAvx512Vnni) {
    if (p.table) return tile_vnni<4, ROWS, true, RUNS>(p, ts, 0);
    return p.bits == 4 ? tile_vnni<4, ROWS, false, RUNS>(p, ts, 0) : tile_vnni<8, ROWS, false, RUNS>(p, ts, 0);
  }
  if (p.table) return tile_avx2<4, ROWS, true, RUNS>(p, ts, 0);
  return p.bits == 4 ? tile_avx2<4, ROWS, false, RUNS>(p, ts, 0) : tile_avx2<8, ROWS, false, RUNS>(p, ts, 0);
}

// The tiles [begin, end) for all ROWS rows of x, RUNS at a time, the RUNS spread over the range (span
// apart); returns where the tiles left over begin.
template <int ROWS, int RUNS>
int64_t side_by_side(Isa isa, const Problem& p, int64_t begin, int64_t end) {
  const int64_t span = (end - begin) / RUNS;
  for (int64_t i = 0; i < span; ++i) {
    int64_t ts[RUNS];
    for (int u = 0; u < RUNS; ++u) ts[u] = begin + u * span + i;
    tiles_side_by_side<ROWS, RUNS>(isa, p, ts);
  }
  return begin + RUNS * span;
}

// `runs` tiles at a time, 4 taken as 2 for more than one row.
int64_t side_by_side(Isa isa, const Problem& p, int64_t begin, int64_t end, int64_t runs) {
  if (p.M == 1 && runs == 4) return side_by_side<1, 4>(isa, p, begin, end);
  if (runs < 2 || p.M < 1) return begin;
  switch (p.M) {
    case 1: return side_by_side<1, 2>(isa, p, begin, end);
    case 2: return side_by_side<2, 2>(isa, p, begin, end);
    case 3: return side_by_side<3, 2>(isa, p, begin, end);
    case 4: return side_by_side<4, 2>(isa, p, begin, end);
    default: return begin;  // no rows (a step that samples none): nothing to read
  }
}
#endif

// Tiles [begin, end) for all M rows of x. A decode batch of up to max_side_by_side_rows rows
// takes its tiles `runs` at a time (tile_vnni says why); rows otherwise share each pass over a tile
// (per_pass at a time). Either way a tile's arithmetic is the same.
void run_tiles(Isa isa, const Problem& p, int64_t begin, int64_t end, int64_t per_pass, int64_t runs) {
#if defined(__x86_64__)
  if (p.M <= max_side_by_side_rows(isa)) begin = side_by_side(isa, p, begin, end, runs);
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
// batch of up to 4 rows (AVX2: 3) reads side by side: 1, 2 or 4 for a lone row, 1 or 2 (4 taken as 2) for more;
// 0 = the kernel's choice (default_runs; bench/matmul_runs.py compares them). zero: 0..255 where every
// group's offset is -zero * its scale (Q4_0's 8, Q8_0's 128: folded into the integer dot products,
// quant_matmul_tiles.h) and the blocks leave the offsets out, -1 where they hold and the kernel reads them.
void quant_matmul_into(const at::Tensor& input, const at::Tensor& packed, int64_t bits, int64_t N, int64_t isa,
                       const at::Tensor& table, float* y, int64_t runs, int64_t zero) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.dim() == 2, "quant_matmul: x must be 2-D fp32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(),
              "quant_matmul: packed weights must be contiguous uint8 [tiles, groups, bytes]");
  TORCH_CHECK(bits == 4 || bits == 8, "quant_matmul: 4 or 8 bits");
  TORCH_CHECK(runs == 0 || runs == 1 || runs == 2 || runs == 4, "quant_matmul: runs must be 0, 1, 2 or 4");
  TORCH_CHECK(zero >= -1 && zero <= 255, "quant_matmul: zero is -1 (none) or 0..255");
  const bool tabled = table.numel() > 0;
  TORCH_CHECK(!tabled || (bits == 4 && table.scalar_type() == at::kByte && table.numel() == 16 &&
                          table.is_contiguous() && table.is_cpu()),
              "quant_matmul: a code table is 16 uint8 values, for 4-bit codes");
  for (int64_t i = 0; tabled && i < 16; ++i) {
    TORCH_CHECK(table.data_ptr<uint8_t>()[i] < 128, "quant_matmul: a code table's values are below 128");
  }
  const at::Tensor x = input.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t groups = K / kGroup, tiles = packed.size(0);
  const int64_t block = block_bytes(bits, zero < 0);
  TORCH_CHECK(K % kGroup == 0 && packed.size(1) == groups && packed.size(2) == block &&
                  tiles * kTile >= N && (tiles - 1) * kTile < N,
              "quant_matmul: packed weights do not match x's ", K, " inputs and ", N, " outputs (", block,
              "-byte blocks ", zero < 0 ? "with" : "without", " offsets)");
  const Isa chosen = chosen_isa(isa);
  // The quantized activations live in a workspace kept by the calling thread (a decode step makes ~120
  // of these calls: no allocator round trip for them).
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> scales;
  thread_local std::vector<int32_t> zero_sums;
  xq.resize(M * K);
  scales.resize(2 * M * groups);
  float* dx = scales.data();
  float* sx = dx + M * groups;
  int32_t* zs = nullptr;
  if (zero >= 0) {
    zero_sums.resize(M * groups);
    zs = zero_sums.data();
  }
  quantize_rows(x.data_ptr<float>(), M, K, xq.data(), dx, sx, zs, static_cast<int32_t>(zero));
  const Problem p{packed.data_ptr<uint8_t>(), xq.data(), dx, sx, y, M, K, N, groups, bits, block,
                  tabled ? table.data_ptr<uint8_t>() : nullptr, zs};
  const int64_t per_pass = rows_per_pass(chosen);
  // Work items are tiles of 16 outputs; each walks every row of x (the tile's weights stay in L1).
  const int64_t read_together = runs != 0 ? runs : default_runs(chosen, M);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    run_tiles(chosen, p, begin, end, per_pass, read_together);
  });
}

// The same into a new [M, N].
at::Tensor quant_matmul(at::Tensor x, at::Tensor packed, int64_t bits, int64_t N, int64_t isa,
                        at::Tensor table, int64_t runs, int64_t zero) {
  TORCH_CHECK(x.dim() == 2, "quant_matmul: x must be 2-D fp32");
  auto y = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  quant_matmul_into(x, packed, bits, N, isa, table, y.data_ptr<float>(), runs, zero);
  return y;
}
