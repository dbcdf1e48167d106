// A Llama-family decoder's layers run as one call per step: the same kernels, in the same order, on the same
// tensors as the Python layers call them one by one (kvserve/model/llama.py), so the same bits; what goes is
// the Python between them. At the embedded model's size a batch-1 decode step spent ~2 ms of ~8 in the
// layers' Python (module calls, argument checks, views): ~66 us a layer for ~11 kernel calls.
//
// Per layer: h = rms_norm(x); qkv = h W_qkv^T (+ b); RoPE on Q and K; K, V stored into the float cache rows
// `slots`; paged decode attention of every row over its blocks; h = add_rms_norm_(x, attn W_o^T);
// x += down(act(gate(h)) * up(h)). The weights are held as the layers hold them: 4- or 8-bit group codes
// (quant_matmul) or GGUF K-quant super-blocks (kquant_matmul_), one or several row blocks of one output.
#include "kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <vector>

// y [rows, width] += a's rows (a_stride elements apart; 0: one row added to every row): the same float
// additions torch's add_ makes, without a dispatched op. Rows per task as fused_ops.cpp's: a decode's few
// rows inline, a prefill chunk's on every thread.
static void add_rows_(float* y, const float* a, int64_t rows, int64_t width, int64_t a_stride) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) y[r * width + i] += a[r * a_stride + i];
    }
  });
}

// One projection's weights: `packed[i]` fills output columns columns[i] .. columns[i] + outputs[i]; kinds[i]
// is -1 for group codes of `bits` (through `table` when it is not empty; `zero`: their offsets' zero point
// or -1, as quant_matmul_into takes it), else a K-quant kind number.
struct StackLinear {
  std::vector<torch::Tensor> packed;
  std::vector<int64_t> kinds, columns, outputs;
  int64_t bits;
  torch::Tensor table;  // uint8 [16] or empty
  torch::Tensor bias;   // fp32 [N] or empty
  int64_t out_features;
  int64_t zero;

  StackLinear(std::vector<torch::Tensor> packed_, std::vector<int64_t> kinds_, std::vector<int64_t> columns_,
              std::vector<int64_t> outputs_, int64_t bits_, torch::Tensor table_, torch::Tensor bias_,
              int64_t out_features_, int64_t zero_)
      : packed(std::move(packed_)), kinds(std::move(kinds_)), columns(std::move(columns_)),
        outputs(std::move(outputs_)), bits(bits_), table(std::move(table_)), bias(std::move(bias_)),
        out_features(out_features_), zero(zero_) {
    const size_t parts = packed.size();
    TORCH_CHECK(parts > 0 && kinds.size() == parts && columns.size() == parts && outputs.size() == parts,
                "StackLinear: one kind, column and output count per packed part");
    TORCH_CHECK(parts == 1 || kinds[0] >= 0, "StackLinear: several parts are K-quant matrices only");
    TORCH_CHECK(bias.numel() == 0 || (bias.numel() == out_features && bias.is_contiguous() &&
                                      bias.scalar_type() == at::kFloat),
                "StackLinear: a bias is contiguous fp32 [out_features]");
  }

  // out [M, out_features] (contiguous) = x [M, K] W^T (+ bias): what the layer's method (GroupQuantized /
  // KQuant) computes.
  void apply(const torch::Tensor& x, const torch::Tensor& out) const {
    if (kinds[0] < 0) {
      quant_matmul_into(x, packed[0], bits, out_features, -1, table, out.data_ptr<float>(), 0, zero);
    } else {
      kquant_matmul_(x, packed, kinds, outputs, out, columns, -1);
    }
    if (bias.numel() > 0) add_rows_(out.data_ptr<float>(), bias.data_ptr<float>(), out.size(0), out_features, 0);
  }
};

// Where a step's time goes inside the stack, op by op (bench/step_profile.py's "in place" split; each op's
// threads have joined when it returns, so a lap is that op's whole time). Off unless asked for: a branch
// per op; on, one clock read per op (tens of nanoseconds against the microseconds an op takes).
enum StackOp { kSmallOps, kQkv, kAttention, kOProj, kGateUp, kDown, kNumStackOps };  // decoder_stack.py's STACK_OPS

struct OpClock {
  std::array<double, kNumStackOps>* seconds;  // null: not timing
  std::chrono::steady_clock::time_point last;

  explicit OpClock(std::array<double, kNumStackOps>* seconds_) : seconds(seconds_) {
    if (seconds != nullptr) last = std::chrono::steady_clock::now();
  }
  // The time since the last lap goes to `op`.
  void lap(StackOp op) {
    if (seconds == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    (*seconds)[op] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

// The layers' weights and shapes, built once from a converted model (kvserve/model/decoder_stack.py).
struct DecoderStack {
  std::vector<StackLinear> linears;  // per layer: qkv, o, gate_up, down
  std::vector<torch::Tensor> norms;  // per layer: input, post-attention
  int64_t heads, kv_heads, head_dim, activation;
  double eps;
  torch::Tensor no_sinks = torch::empty({0}, torch::kFloat);
  bool timing = false;
  mutable std::array<double, kNumStackOps> op_seconds{};  // since the last take_op_times, while timing

  DecoderStack(std::vector<StackLinear> linears_, std::vector<torch::Tensor> norms_, int64_t heads_,
               int64_t kv_heads_, int64_t head_dim_, double eps_, int64_t activation_)
      : linears(std::move(linears_)), norms(std::move(norms_)), heads(heads_), kv_heads(kv_heads_),
        head_dim(head_dim_), activation(activation_), eps(eps_) {
    TORCH_CHECK(linears.size() == 2 * norms.size() && !norms.empty(),
                "DecoderStack: four projections and two norms per layer");
    for (size_t i = 0; i < linears.size(); ++i) {
      TORCH_CHECK(linears[i].out_features == linears[i % 4].out_features,
                  "DecoderStack: every layer's projections have the first layer's shapes");
    }
    for (const auto& norm : norms) {
      TORCH_CHECK(norm.is_contiguous() && norm.scalar_type() == at::kFloat, "DecoderStack: contiguous fp32 norms");
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(norms.size()) / 2; }

  void set_timing(bool on) {
    timing = on;
    op_seconds.fill(0.0);
  }
  // Seconds per op (StackOp order) since the timing began or was last taken; the count restarts.
  std::vector<double> take_op_times() {
    std::vector<double> taken(op_seconds.begin(), op_seconds.end());
    op_seconds.fill(0.0);
    return taken;
  }

  // x [T, hidden] (the residual stream, updated in place) through every layer; cos, sin [T, head_dim];
  // per layer its float K and V caches [blocks, KVH, block_size, D]; slots [T * KVH] the rows the new
  // tokens are stored at; tables .. row_pos what each row attends over (ops.RowTables). Each intermediate
  // lives in one buffer that every layer reuses (the layers' own forward allocates each anew: ~10 tensors
  // and as many views a layer, dispatched one by one).
  void forward_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> k_caches,
                std::vector<torch::Tensor> v_caches, torch::Tensor slots, torch::Tensor tables,
                torch::Tensor row_table, torch::Tensor row_low, torch::Tensor row_pos, double scale,
                int64_t split_blocks) const {
    const int64_t layers = num_layers();
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers && static_cast<int64_t>(v_caches.size()) == layers,
                "DecoderStack: one K and one V cache per layer");
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
                "DecoderStack: x is contiguous fp32 [T, hidden]");
    const int64_t T = x.size(0), hidden = x.size(1), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    const int64_t intermediate = linears[2].out_features / 2;
    TORCH_CHECK(linears[0].out_features == q_size + 2 * kv_size && linears[1].out_features == hidden &&
                    linears[3].out_features == hidden, "DecoderStack: projections do not match the heads and x");
    const auto options = x.options();
    const torch::Tensor normed = torch::empty({T, hidden}, options), qkv = torch::empty({T, q_size + 2 * kv_size}, options),
                        attended = torch::empty({T, q_size}, options), projected = torch::empty({T, hidden}, options),
                        gate_up = torch::empty({T, 2 * intermediate}, options),
                        activated = torch::empty({T, intermediate}, options);
    const torch::Tensor q = qkv.narrow(1, 0, q_size).view({T, heads, head_dim});
    const torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, kv_heads, head_dim});
    const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads, head_dim});
    OpClock clock(timing ? &op_seconds : nullptr);
    for (int64_t l = 0; l < layers; ++l) {
      const StackLinear* w = &linears[4 * l];
      rms_norm_into(x, norms[2 * l], eps, normed.data_ptr<float>());
      clock.lap(kSmallOps);
      w[0].apply(normed, qkv);
      clock.lap(kQkv);
      rope_(qkv, cos, sin, heads + kv_heads, head_dim);
      store_kv_(k_caches[l], v_caches[l], slots, k, v);
      clock.lap(kSmallOps);
      paged_decode_into(q, k_caches[l], v_caches[l], tables, row_table, row_low, row_pos, scale, split_blocks,
                        no_sinks, attended.data_ptr<float>());
      clock.lap(kAttention);
      w[1].apply(attended, projected);
      clock.lap(kOProj);
      add_rms_norm_into_(x, projected, norms[2 * l + 1], eps, normed.data_ptr<float>());
      clock.lap(kSmallOps);
      w[2].apply(normed, gate_up);
      clock.lap(kGateUp);
      gated_activation_into(gate_up, activation, activated.data_ptr<float>());
      clock.lap(kSmallOps);
      w[3].apply(activated, projected);  // the down projection into the O projection's buffer
      clock.lap(kDown);
      add_rows_(x.data_ptr<float>(), projected.data_ptr<float>(), T, hidden, hidden);
      clock.lap(kSmallOps);
    }
  }
};

void bind_decoder_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<StackLinear>(m, "StackLinear")
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                    int64_t, torch::Tensor, torch::Tensor, int64_t, int64_t>());
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<StackLinear>, std::vector<torch::Tensor>, int64_t, int64_t, int64_t, double,
                    int64_t>())
      .def("num_layers", &DecoderStack::num_layers)
      .def("forward_", &DecoderStack::forward_)
      .def("set_timing", &DecoderStack::set_timing)
      .def("take_op_times", &DecoderStack::take_op_times);
}
