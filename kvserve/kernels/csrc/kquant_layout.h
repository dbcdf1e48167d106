// The packed K-quant layout's sizes, shared by the matmul that reads it (kquant_matmul.cpp, which describes
// the layout) and the repack that writes it from a GGUF file's super-blocks (kquant_repack.cpp).
#pragma once

#include <cstdint>

namespace kvserve_kquant {

constexpr int64_t kTile = 16;      // output rows per tile
constexpr int64_t kSuper = 256;    // inputs per super-block
constexpr int64_t kSubGroups = 8;  // activation groups per super-block
constexpr int64_t kLowBytes = kSubGroups * 4 * 64;
enum Kind : int64_t { kQ4K = 0, kQ5K = 1, kQ6K = 2 };

constexpr int64_t high_bytes(int64_t kind) { return kind == kQ4K ? 0 : kind == kQ5K ? 512 : 1024; }
// One group's low nibbles (256 bytes) and then its high bits: a group is read as one run of bytes (the
// high bits kept apart from the nibbles made a second stream that halved Q5_K / Q6_K's speed).
constexpr int64_t group_bytes(int64_t kind) { return 256 + high_bytes(kind) / kSubGroups; }
constexpr int64_t param_bytes(int64_t kind) { return kind == kQ6K ? 32 + 256 : 32 + 32 + 128 + 128; }
constexpr int64_t block_bytes(int64_t kind) { return kLowBytes + high_bytes(kind) + param_bytes(kind); }
// Bytes of one super-block in the file (ggml-quants.c's block_q4_K, block_q5_K, block_q6_K).
constexpr int64_t file_block_bytes(int64_t kind) { return kind == kQ4K ? 144 : kind == kQ5K ? 176 : 210; }

}  // namespace kvserve_kquant
