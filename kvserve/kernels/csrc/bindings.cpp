// The Python module of kvserve's CPU kernels (one extension, one build per CPU; kvserve/kernels/__init__.py).
#include "decoder_stack.h"
#include "kernels.h"

#include <torch/python.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over paged fp32 / fp16 / bf16 K/V, read in place");
  m.def("paged_decode_quant", &paged_decode_quant, "decode attention over paged int8 / int4 K/V and fp16 open blocks");
  m.def("quant_matmul", &quant_matmul, "x @ W^T for 4- or 8-bit group-quantized W, int8 activations");
  m.def("kquant_matmul_", &kquant_matmul_, "out[:, col:col+N] = x @ W^T for each part W of GGUF K-quant super-blocks");
  m.def("kquant_repack", &kquant_repack, "GGUF K-quant super-blocks -> the layout kquant_matmul_ reads");
  m.def("quant_matmul_isa", &quant_matmul_isa, "the instruction set quant_matmul runs on this CPU");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += delta; RMSNorm of the result");
  m.def("rope_", &rope_, "rotate-half RoPE in place on the first heads of each row");
  m.def("gated_activation", &gated_activation, "act(gate) * up");
  m.def("gated_delta_rule_", &gated_delta_rule_, "the gated delta rule token by token over state slots");
  m.def("gated_delta_isa", &gated_delta_isa, "the instruction set gated_delta_rule_ runs on this build");
  m.def("store_kv_", &store_kv_, "new tokens' K and V into float cache rows");
  pybind11::class_<StackLinear>(m, "StackLinear")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                          int64_t, at::Tensor, at::Tensor, int64_t, int64_t>());
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<std::vector<StackLinear>, std::vector<at::Tensor>, int64_t, int64_t, int64_t, double,
                          int64_t>())
      .def("num_layers", &DecoderStack::num_layers)
      .def("forward_", &DecoderStack::forward_)
      .def("set_timing", &DecoderStack::set_timing)
      .def("take_op_times", &DecoderStack::take_op_times);
}
