// A Llama-family decoder's layers run as one call per step: the same kernels, in the same order, on the same
// tensors as the Python layers call them one by one (kvserve/model/llama.py), so the same bits; what goes is
// the Python between them. At the embedded model's size a batch-1 decode step spent ~2 ms of ~8 in the
// layers' Python (module calls, argument checks, views): ~66 us a layer for ~11 kernel calls.
//
// Per layer: h = rms_norm(x); qkv = h W_qkv^T (+ b); RoPE on Q and K; K, V stored into the float cache rows
// `slots`; paged decode attention of every row over its blocks; h = add_rms_norm_(x, attn W_o^T);
// x += down(act(gate(h)) * up(h)). The weights are held as the layers hold them: 4- or 8-bit group codes
// (quant_matmul) or GGUF K-quant super-blocks (kquant_matmul_), one or several row blocks of one output.
//
// This header declares the stack's two classes (bindings.cpp binds them); decoder_stack.cpp defines them.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <vector>

// One projection's weights: `packed[i]` fills output columns columns[i] .. columns[i] + outputs[i]; kinds[i]
// is -1 for group codes of `bits` (through `table` when it is not empty; `zero`: their offsets' zero point
// or -1, as quant_matmul_into takes it), else a K-quant kind number.
struct StackLinear {
  std::vector<at::Tensor> packed;
  std::vector<int64_t> kinds, columns, outputs;
  int64_t bits;
  at::Tensor table;  // uint8 [16] or empty
  at::Tensor bias;   // fp32 [N] or empty
  int64_t out_features;
  int64_t zero;

  StackLinear(std::vector<at::Tensor> packed_, std::vector<int64_t> kinds_, std::vector<int64_t> columns_,
              std::vector<int64_t> outputs_, int64_t bits_, at::Tensor table_, at::Tensor bias_,
              int64_t out_features_, int64_t zero_);

  // out [M, out_features] (contiguous) = x [M, K] W^T (+ bias): what the layer's method (GroupQuantized /
  // KQuant) computes.
  void apply(const at::Tensor& x, const at::Tensor& out) const;
};

// Where a step's time goes inside the stack, op by op (bench/step_profile.py's "in place" split).
enum StackOp { kSmallOps, kQkv, kAttention, kOProj, kGateUp, kDown, kNumStackOps };  // decoder_stack.py's STACK_OPS

// The layers' weights and shapes, built once from a converted model (kvserve/model/decoder_stack.py).
struct DecoderStack {
  std::vector<StackLinear> linears;  // per layer: qkv, o, gate_up, down
  std::vector<at::Tensor> norms;  // per layer: input, post-attention
  int64_t heads, kv_heads, head_dim, activation;
  double eps;
  at::Tensor no_sinks;  // fp32 [0]
  bool timing = false;
  mutable std::array<double, kNumStackOps> op_seconds{};  // since the last take_op_times, while timing

  DecoderStack(std::vector<StackLinear> linears_, std::vector<at::Tensor> norms_, int64_t heads_,
               int64_t kv_heads_, int64_t head_dim_, double eps_, int64_t activation_);

  int64_t num_layers() const { return static_cast<int64_t>(norms.size()) / 2; }
  void set_timing(bool on);
  // Seconds per op (StackOp order) since the timing began or was last taken; the count restarts.
  std::vector<double> take_op_times();

  // x [T, hidden] (the residual stream, updated in place) through every layer; cos, sin [T, head_dim];
  // per layer its float K and V caches [blocks, KVH, block_size, D]; slots [T * KVH] the rows the new
  // tokens are stored at; tables .. row_pos what each row attends over (ops.RowTables). Each intermediate
  // lives in one buffer that every layer reuses (the layers' own forward allocates each anew: ~10 tensors
  // and as many views a layer, dispatched one by one).
  void forward_(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_caches,
                std::vector<at::Tensor> v_caches, at::Tensor slots, at::Tensor tables, at::Tensor row_table,
                at::Tensor row_low, at::Tensor row_pos, double scale, int64_t split_blocks) const;
};
