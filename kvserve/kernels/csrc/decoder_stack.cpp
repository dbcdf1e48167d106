// The decoder stack's two classes (decoder_stack.h says what the stack is and does).
#include "decoder_stack.h"

#include "kernels.h"

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

StackLinear::StackLinear(std::vector<at::Tensor> packed_, std::vector<int64_t> kinds_,
                         std::vector<int64_t> columns_, std::vector<int64_t> outputs_, int64_t bits_,
                         at::Tensor table_, at::Tensor bias_, int64_t out_features_, int64_t zero_)
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

void StackLinear::apply(const at::Tensor& x, const at::Tensor& out) const {
  if (kinds[0] < 0) {
    quant_matmul_into(x, packed[0], bits, out_features, -1, table, out.data_ptr<float>(), 0, zero);
  } else {
    kquant_matmul_(x, packed, kinds, outputs, out, columns, -1);
  }
  if (bias.numel() > 0) add_rows_(out.data_ptr<float>(), bias.data_ptr<float>(), out.size(0), out_features, 0);
}

// Where a step's time goes inside the stack, op by op (bench/step_profile.py's "in place" split; each op's
// threads have joined when it returns, so a lap is that op's whole time). Off unless asked for: a branch
// per op; on, one clock read per op (tens of nanoseconds against the microseconds an op takes).

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

DecoderStack::DecoderStack(std::vector<StackLinear> linears_, std::vector<at::Tensor> norms_, int64_t heads_,
                           int64_t kv_heads_, int64_t head_dim_, double eps_, int64_t activation_)
    : linears(std::move(linears_)), norms(std::move(norms_)), heads(heads_), kv_heads(kv_heads_),
      head_dim(head_dim_), activation(activation_), eps(eps_), no_sinks(at::empty({0}, at::kFloat)) {
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

void DecoderStack::set_timing(bool on) {
  timing = on;
  op_seconds.fill(0.0);
}

std::vector<double> DecoderStack::take_op_times() {
  std::vector<double> taken(op_seconds.begin(), op_seconds.end());
  op_seconds.fill(0.0);
  return taken;
}

void DecoderStack::forward_(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_caches,
                            std::vector<at::Tensor> v_caches, at::Tensor slots, at::Tensor tables,
                            at::Tensor row_table, at::Tensor row_low, at::Tensor row_pos, double scale,
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
  const at::Tensor normed = at::empty({T, hidden}, options), qkv = at::empty({T, q_size + 2 * kv_size}, options),
                   attended = at::empty({T, q_size}, options), projected = at::empty({T, hidden}, options),
                   gate_up = at::empty({T, 2 * intermediate}, options),
                   activated = at::empty({T, intermediate}, options);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, heads, head_dim});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads, head_dim});
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
