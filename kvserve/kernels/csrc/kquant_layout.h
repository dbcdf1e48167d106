// The packed K-quant layout's sizes and offsets, shared by the matmul that reads it (kquant_matmul.cpp, which
// describes the layout) and the repack that writes it from a GGUF file's super-blocks (kquant_repack.cpp).
#pragma once

#include <cstdint>

namespace kvserve_kquant {

constexpr int64_t kTile = 16;      // output rows per tile
constexpr int64_t kSuper = 256;    // inputs per super-block
constexpr int64_t kSubGroups = 8;  // activation groups per super-block
enum Kind : int64_t { kQ4K = 0, kQ5K = 1, kQ6K = 2 };

constexpr int64_t high_bytes(int64_t kind) { return kind == kQ4K ? 0 : kind == kQ5K ? 512 : 1024; }
// One group's low nibbles (256 bytes) and then its high bits: a group is read as one run of bytes (the
// high bits kept apart from the nibbles made a second stream that halved Q5_K / Q6_K's speed).
constexpr int64_t group_bytes(int64_t kind) { return 256 + high_bytes(kind) / kSubGroups; }
// The block's d (and dmin) for its 16 rows, fp16, first.
constexpr int64_t header_bytes(int64_t kind) { return kind == kQ6K ? 32 : 64; }
// Groups go in pairs, each pair its 64 bytes of scales (and mins) and then its two groups' codes: a block is
// read front to back, as one run. With the scales of all 8 groups after the codes (a second run that a
// decode row read ahead of the codes' stream), a decode row's Q6_K matmul streamed at 0.47-0.54x the read
// probe in the host's fast state; this order reads 1.32-1.49x as fast (Q4_K 1.06-1.18x; the AVX2 path
// 1.40-1.56x: it reads each block's scales twice), the same bits: README 2026-11-29 (fifth). A pair is a whole
// number of cache lines, so Q4_K / Q5_K's codes stay 64-byte aligned.
constexpr int64_t pair_bytes(int64_t kind) { return 64 + 2 * group_bytes(kind); }
constexpr int64_t block_bytes(int64_t kind) { return header_bytes(kind) + 4 * pair_bytes(kind); }
// Where pair `pair`'s 64 bytes of parameters start, and where group g's codes do.
constexpr int64_t pair_params_at(int64_t kind, int64_t pair) { return header_bytes(kind) + pair * pair_bytes(kind); }
constexpr int64_t group_at(int64_t kind, int64_t g) {
  return pair_params_at(kind, g / 2) + 64 + (g % 2) * group_bytes(kind);
}
// Q4_K / Q5_K: sub-block j's 16 scales (uint8) and 16 mins (the pair's mins follow its scales, so the mins of
// sub-blocks 2i and 2i + 1 are 32 bytes in a row). Q6_K: 16-input sub-block h's 16 scales (int8), those of
// 2i and 2i + 1 (one group's) 32 bytes in a row.
constexpr int64_t scales_at(int64_t kind, int64_t sub) {
  return kind == kQ6K ? pair_params_at(kind, sub / 4) + 16 * (sub % 4) : pair_params_at(kind, sub / 2) + 16 * (sub % 2);
}
constexpr int64_t mins_at(int64_t kind, int64_t sub) { return pair_params_at(kind, sub / 2) + 32 + 16 * (sub % 2); }
// Bytes of one super-block in the file (ggml-quants.c's block_q4_K, block_q5_K, block_q6_K).
constexpr int64_t file_block_bytes(int64_t kind) { return kind == kQ4K ? 144 : kind == kQ5K ? 176 : 210; }

static_assert(block_bytes(kQ4K) == 2368 && block_bytes(kQ5K) == 2880 && block_bytes(kQ6K) == 3360,
              "16 rows' codes and parameters, nothing else");

}  // namespace kvserve_kquant
