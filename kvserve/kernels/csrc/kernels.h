// The functions of kvserve's CPU kernels extension (the `_into` forms write the caller's buffer: C++ only, for
// the decoder stack): declared once here, defined in paged_decode.cpp,
// paged_decode_quant.cpp, quant_matmul.cpp,
// kquant_matmul.cpp, fused_ops.cpp, gated_delta.cpp and decoder_stack.cpp (the attention files share
// attend_blocks*.h and decode_splits.h), bound to Python in bindings.cpp. Python reaches them only through
// kvserve/kernels/ops.py (the gated delta rule through kvserve/kernels/gated_delta.py), which checks devices
// and dtypes before a call (a CUDA tensor here would be read as host memory).
#pragma once

// Only ATen's tensor (and the factories the kernels call): torch/extension.h, with pybind11 and the C++
// frontend, took ~25 s of the compiler per file against ~5 (the first start's compile, 2026-11-30); only
// bindings.cpp reaches pybind11, through torch/python.h (its tensor casters, not the C++ frontend).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <string>
#include <vector>

// paged_decode.cpp: decode attention over paged fp32 / fp16 / bf16 K/V blocks, read in place.
// One query token per row (decodes, verify queries, prefill tokens alike), each attended alone; `sinks`
// (fp32 [H] or empty): a per-head logit added to each row's softmax denominator.
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                        at::Tensor row_table, at::Tensor row_low, at::Tensor row_pos, double scale,
                        int64_t split_blocks, at::Tensor sinks);
void paged_decode_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& row_table, const at::Tensor& row_low,
                       const at::Tensor& row_pos, double scale, int64_t split_blocks, const at::Tensor& sinks,
                       float* out);
// paged_decode_quant.cpp: the same over quantized K/V (int8 rows, int4 row groups, int4 per channel over a block) and fp16 open blocks.
at::Tensor paged_decode_quant(at::Tensor q, at::Tensor k_data, at::Tensor k_params, int64_t k_kind,
                              at::Tensor v_data, at::Tensor v_params, int64_t v_kind, int64_t group,
                              at::Tensor open_k, at::Tensor open_v, at::Tensor open_slot,
                              at::Tensor own_k, at::Tensor own_v, at::Tensor row_own,
                              at::Tensor tables, at::Tensor row_table, at::Tensor row_low,
                              at::Tensor row_pos, double scale, int64_t split_blocks, at::Tensor sinks);

// quant_matmul.cpp: x @ W^T for 4- or 8-bit group-quantized W, and the instruction set it runs on.
at::Tensor quant_matmul(at::Tensor x, at::Tensor packed, int64_t bits, int64_t N, int64_t isa,
                        at::Tensor table, int64_t runs, int64_t zero);
void quant_matmul_into(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t N, int64_t isa,
                       const at::Tensor& table, float* y, int64_t runs, int64_t zero);
std::string quant_matmul_isa();
// kquant_matmul.cpp: the same for W held as GGUF Q4_K / Q5_K / Q6_K super-blocks, one or several parts each
// into its columns of `out`.
void kquant_matmul_(at::Tensor x, const std::vector<at::Tensor>& packed, const std::vector<int64_t>& kinds,
                    const std::vector<int64_t>& outputs, at::Tensor out, const std::vector<int64_t>& columns,
                    int64_t isa);
// kquant_repack.cpp: a GGUF file's K-quant super-blocks uint8 [rows, supers, file bytes] -> kquant_matmul_'s layout.
at::Tensor kquant_repack(at::Tensor blocks, int64_t kind);

// fused_ops.cpp: the per-layer ops of a decoder, one pass over their rows each.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void rms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, float* out);
at::Tensor add_rms_norm_(at::Tensor residual, at::Tensor delta, at::Tensor weight, double eps);
void add_rms_norm_into_(const at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                        double eps, float* out);
void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t head_dim);
at::Tensor gated_activation(at::Tensor x, int64_t activation);
void gated_activation_into(const at::Tensor& x, int64_t activation, float* out);
void store_kv_(at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, at::Tensor k, at::Tensor v);

// gated_delta.cpp: the gated delta rule token by token for a batch of sequences (each its rows of q, k, v,
// g, beta), each sequence's state read from a slot of read_states (-1: zeros) and written to a slot of
// write_states, with snapshots (sequence, rows, slot) of the state after that many of its rows.
void gated_delta_rule_(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                       at::Tensor out, at::Tensor read_states, at::Tensor write_states,
                       at::Tensor row_starts, at::Tensor read_slots, at::Tensor write_slots,
                       at::Tensor snapshots, bool normalize_qk, double scale, int64_t isa);
std::string gated_delta_isa();

// decoder_stack.cpp (decoder_stack.h): a Llama-family decoder's layers in one call (the kernels above, in the
// layers' order).
