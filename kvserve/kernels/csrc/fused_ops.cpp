// The small per-layer operations of a decoder, each one pass over its rows instead of a chain of torch
// ops: at batch 1 a decode step ran ~1,700 dispatched ops, and torch's rms_norm alone was ten of them
// (27 us a call against a few here). All fp32, rows of the last dimension contiguous.
#include "kernels.h"

#include <ATen/Dispatch.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace {

// Rows per parallel task: small steps (decode) run inline, without waking a second thread.
int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, name,
              ": fp32 [rows, width] with contiguous rows");
}

inline void normalize_row(const float* src, const float* weight, float* dst, int64_t width, float eps) {
  double squares = 0.0;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < width; ++i) squares += static_cast<double>(src[i]) * src[i];
  const float inverse = static_cast<float>(1.0 / std::sqrt(squares / width + eps));
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) dst[i] = src[i] * inverse * weight[i];
}

}  // namespace

// x [T, H] -> out [T, H] (contiguous) = x / rms(x) * weight.
void rms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, float* out) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.numel() == width && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "rms_norm: contiguous fp32 weight of the row width");
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize_row(xp + r * stride, wp, out + r * width, width, static_cast<float>(eps));
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  rms_norm_into(x, weight.contiguous(), eps, out.data_ptr<float>());
  return out;
}

// residual += delta (in place), then out [T, H] (contiguous) = rms_norm(residual): a decoder's residual add
// and the next norm.
void add_rms_norm_into_(const at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                        double eps, float* out) {
  check_rows(residual, "add_rms_norm_");
  check_rows(delta, "add_rms_norm_");
  const int64_t rows = residual.size(0), width = residual.size(1);
  TORCH_CHECK(delta.size(0) == rows && delta.size(1) == width && weight.numel() == width && weight.is_contiguous(),
              "add_rms_norm_: shapes differ");
  float* rp = residual.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t rstride = residual.stride(0), dstride = delta.stride(0);
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = rp + r * rstride;
      const float* add = dp + r * dstride;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) row[i] += add[i];
      normalize_row(row, wp, out + r * width, width, static_cast<float>(eps));
    }
  });
}

at::Tensor add_rms_norm_(at::Tensor residual, at::Tensor delta, at::Tensor weight, double eps) {
  check_rows(residual, "add_rms_norm_");
  auto out = at::empty({residual.size(0), residual.size(1)}, residual.options());
  add_rms_norm_into_(residual, delta, weight.contiguous(), eps, out.data_ptr<float>());
  return out;
}

// In place on the first `heads` heads of each row of x [T, >= heads * D] (Q and K side by side in a fused
// QKV output): rotate-half RoPE, x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, with cos / sin [T, D]
// (each half repeated, as Hugging Face builds them).
void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t head_dim) {
  check_rows(x, "rope_");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t rows = x.size(0), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && heads * head_dim <= x.size(1), "rope_: ", heads, " heads of ", head_dim,
              " do not fit rows of ", x.size(1));
  TORCH_CHECK(cos.numel() == rows * head_dim && sin.numel() == rows * head_dim, "rope_: cos/sin must be [T, head_dim]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, grain_rows(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * head_dim;
      const float* s = sp + r * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + r * stride + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float first = v[i], second = v[i + half];
          v[i] = first * c[i] - second * s[i];
          v[i + half] = second * c[i + half] + first * s[i + half];
        }
      }
    }
  });
}

// x [T, 2I] (gate, then up) -> out [T, I] (contiguous) = act(gate) * up; act: 0 = SiLU (Llama), 1 = GELU,
// tanh form (Gemma).
void gated_activation_into(const at::Tensor& x, int64_t activation, float* out) {
  check_rows(x, "gated_activation");
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  TORCH_CHECK(x.size(1) == 2 * width, "gated_activation: an even width");
  TORCH_CHECK(activation == 0 || activation == 1, "gated_activation: 0 (SiLU) or 1 (GELU tanh)");
  const float* xp = x.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * stride;
      const float* up = gate + width;
      float* o = out + r * width;
      if (activation == 0) {
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
      } else {
        constexpr float kSqrt2OverPi = 0.7978845608028654f;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
          const float g = gate[i];
          o[i] = 0.5f * g * (1.f + std::tanh(kSqrt2OverPi * (g + 0.044715f * g * g * g))) * up[i];
        }
      }
    }
  });
}

at::Tensor gated_activation(at::Tensor x, int64_t activation) {
  check_rows(x, "gated_activation");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  gated_activation_into(x, activation, out.data_ptr<float>());
  return out;
}

// New tokens' K and V [T, KVH, D] fp32 (rows of a fused QKV output: any strides but the last) into flat
// cache rows k_cache / v_cache [rows, D] (fp32, fp16 or bf16) at slots [T * KVH] (token-major): the
// cast and the scatter of both in one pass, where torch took a cast, a reshape and an index_copy_ each.
void store_kv_(at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, at::Tensor k, at::Tensor v) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 3 && v.dim() == 3 &&
                  k.stride(2) == 1 && v.stride(2) == 1, "store_kv_: fp32 [T, KVH, D] K and V, rows contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "store_kv_: contiguous caches of one dtype");
  slots = slots.contiguous();
  const int64_t T = k.size(0), heads = k.size(1), D = k.size(2);
  TORCH_CHECK(slots.numel() == T * heads && k_cache.size(-1) == D && v.sizes() == k.sizes(), "store_kv_: shapes differ");
  const int64_t rows = k_cache.numel() / D;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < T * heads; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < rows, "store_kv_: slot out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "store_kv_", [&] {
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    at::parallel_for(0, T * heads, grain_rows(2 * D), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / heads, h = i % heads;
        const float* ks = kp + t * k.stride(0) + h * k.stride(1);
        const float* vs = vp + t * v.stride(0) + h * v.stride(1);
        scalar_t* kd = kc + sp[i] * D;
        scalar_t* vd = vc + sp[i] * D;
        for (int64_t e = 0; e < D; ++e) {
          kd[e] = static_cast<scalar_t>(ks[e]);
          vd[e] = static_cast<scalar_t>(vs[e]);
        }
      }
    });
  });
}
