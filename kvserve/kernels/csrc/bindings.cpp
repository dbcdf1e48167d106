// The Python module of kvserve's CPU kernels (one extension, one build per CPU; kvserve/kernels/__init__.py).
#include <torch/extension.h>

#include <string>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_ids,
                           torch::Tensor seq_offsets, torch::Tensor key_valid, double scale, int64_t num_splits);
torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor packed, int64_t bits, int64_t N, int64_t isa);
std::string quant_matmul_isa();
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight, double eps);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);
torch::Tensor gated_activation(torch::Tensor x, int64_t activation);
void store_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor k, torch::Tensor v);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over paged fp32 / fp16 / bf16 K/V, read in place");
  m.def("quant_matmul", &quant_matmul, "x @ W^T for 4- or 8-bit group-quantized W, int8 activations");
  m.def("quant_matmul_isa", &quant_matmul_isa, "the instruction set quant_matmul runs on this CPU");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += delta; RMSNorm of the result");
  m.def("rope_", &rope_, "rotate-half RoPE in place on the first heads of each row");
  m.def("gated_activation", &gated_activation, "act(gate) * up");
  m.def("store_kv_", &store_kv_, "new tokens' K and V into float cache rows");
}
