// The functions of kvserve's CPU kernels extension (the `_into` forms write the caller's buffer: C++ only, for
// the decoder stack): declared once here, defined in paged_decode.cpp,
// paged_decode_quant.cpp, quant_matmul.cpp,
// kquant_matmul.cpp, fused_ops.cpp, gated_delta.cpp and decoder_stack.cpp (the attention files share
// attend_blocks*.h and decode_splits.h), bound to Python in bindings.cpp. Python reaches them only through
// kvserve/kernels/ops.py (the gated delta rule through kvserve/kernels/gated_delta.py), which checks devices
// and dtypes before a call (a CUDA tensor here would be read as host memory).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

// paged_decode.cpp: decode attention over paged fp32 / fp16 / bf16 K/V blocks, read in place.
// One query token per row (decodes, verify queries, prefill tokens alike), each attended alone; `sinks`
// (fp32 [H] or empty): a per-head logit added to each row's softmax denominator.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor row_table, torch::Tensor row_low, torch::Tensor row_pos, double scale,
                           int64_t split_blocks, torch::Tensor sinks);
void paged_decode_into(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& tables, const torch::Tensor& row_table, const torch::Tensor& row_low,
                       const torch::Tensor& row_pos, double scale, int64_t split_blocks, const torch::Tensor& sinks,
                       float* out);
// paged_decode_quant.cpp: the same over quantized K/V (int8 rows, int4 row groups, int4 per channel over a block) and fp16 open blocks.
torch::Tensor paged_decode_quant(torch::Tensor q, torch::Tensor k_data, torch::Tensor k_params, int64_t k_kind,
                                 torch::Tensor v_data, torch::Tensor v_params, int64_t v_kind, int64_t group,
                                 torch::Tensor open_k, torch::Tensor open_v, torch::Tensor open_slot,
                                 torch::Tensor own_k, torch::Tensor own_v, torch::Tensor row_own,
                                 torch::Tensor tables, torch::Tensor row_table, torch::Tensor row_low,
                                 torch::Tensor row_pos, double scale, int64_t split_blocks, torch::Tensor sinks);

// quant_matmul.cpp: x @ W^T for 4- or 8-bit group-quantized W, and the instruction set it runs on.
torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor packed, int64_t bits, int64_t N, int64_t isa,
                           torch::Tensor table, int64_t runs, int64_t zero);
void quant_matmul_into(const torch::Tensor& x, const torch::Tensor& packed, int64_t bits, int64_t N, int64_t isa,
                       const torch::Tensor& table, float* y, int64_t runs, int64_t zero);
std::string quant_matmul_isa();
// kquant_matmul.cpp: the same for W held as GGUF Q4_K / Q5_K / Q6_K super-blocks, one or several parts each
// into its columns of `out`.
void kquant_matmul_(torch::Tensor x, const std::vector<torch::Tensor>& packed, const std::vector<int64_t>& kinds,
                    const std::vector<int64_t>& outputs, torch::Tensor out, const std::vector<int64_t>& columns,
                    int64_t isa);
// kquant_repack.cpp: a GGUF file's K-quant super-blocks uint8 [rows, supers, file bytes] -> kquant_matmul_'s layout.
torch::Tensor kquant_repack(torch::Tensor blocks, int64_t kind);

// fused_ops.cpp: the per-layer ops of a decoder, one pass over their rows each.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void rms_norm_into(const torch::Tensor& x, const torch::Tensor& weight, double eps, float* out);
torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight, double eps);
void add_rms_norm_into_(const torch::Tensor& residual, const torch::Tensor& delta, const torch::Tensor& weight,
                        double eps, float* out);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);
torch::Tensor gated_activation(torch::Tensor x, int64_t activation);
void gated_activation_into(const torch::Tensor& x, int64_t activation, float* out);
void store_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor k, torch::Tensor v);

// gated_delta.cpp: the gated delta rule token by token for a batch of sequences (each its rows of q, k, v,
// g, beta), each sequence's state read from a slot of read_states (-1: zeros) and written to a slot of
// write_states, with snapshots (sequence, rows, slot) of the state after that many of its rows.
void gated_delta_rule_(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                       torch::Tensor out, torch::Tensor read_states, torch::Tensor write_states,
                       torch::Tensor row_starts, torch::Tensor read_slots, torch::Tensor write_slots,
                       torch::Tensor snapshots, bool normalize_qk, double scale, int64_t isa);
std::string gated_delta_isa();

// decoder_stack.cpp: a Llama-family decoder's layers in one call (the kernels above, in the layers' order);
// its classes are bound here.
void bind_decoder_stack(pybind11::module& m);
