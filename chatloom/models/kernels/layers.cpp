// The small per-layer ops of a decoder, fused, for float32 [T, hidden] activations.
//
// In a decode step these tensors are a few dozen rows: PyTorch runs each of the six or
// so elementwise passes of an RMSNorm (or a SiLU on a strided half of gate_up) as its
// own parallel loop, and thread wake-ups cost more than the arithmetic. One pass per
// row, rows split across threads only when there are enough of them, is several times
// faster and gives every row the same result whatever the batch.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <cmath>

namespace {

// Rows per thread chunk: below this much work, one thread does it all.
int64_t grain_for(int64_t values_per_row) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, values_per_row));
}

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / (float)n + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

}  // namespace

__attribute__((noinline)) void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t h,
                                             float eps) {
  for (int64_t t = 0; t < rows; ++t) norm_row(x + t * h, w, out + t * h, h, eps);
}

__attribute__((noinline)) void add_rms_norm_rows(const float* x, float* residual, const float* w, float* out,
                                                 int64_t rows, int64_t h, float eps) {
  for (int64_t t = 0; t < rows; ++t) {
    float* r = residual + t * h;
    const float* xi = x + t * h;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) r[i] += xi[i];
    norm_row(r, w, out + t * h, h, eps);
  }
}

__attribute__((noinline)) void silu_and_mul_rows(const float* gate_up, float* out, int64_t rows, int64_t inter) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* g = gate_up + t * 2 * inter;
    const float* u = g + inter;
    float* o = out + t * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}

__attribute__((noinline)) void rotary_heads(const float* src, float* dst, int64_t heads, int64_t d, const float* c,
                                            const float* s, bool interleaved) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* x = src + h * d;
    float* y = dst + h * d;
    if (interleaved) {
      for (int64_t i = 0; i < half; ++i) {
        const float a = x[2 * i], b = x[2 * i + 1];
        y[2 * i] = a * c[i] - b * s[i];
        y[2 * i + 1] = b * c[i] + a * s[i];
      }
    } else {
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        y[i] = a * c[i] - b * s[i];
        y[i + half] = b * c[i] + a * s[i];
      }
    }
  }
}

namespace {

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1),
              "x must be contiguous [T, H] and weight [H]");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight);
  auto out = torch::empty_like(x);
  const int64_t h = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  chatloom_kernels::parallel_for(0, x.size(0), grain_for(h), [&](int64_t b, int64_t e) {
    rms_norm_rows(xp + b * h, wp, op + b * h, e - b, h, (float)eps);
  });
  return out;
}

// residual += x; returns rms_norm(residual). The residual stream is updated in place.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(residual, weight);
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == torch::kFloat32, "x and residual differ");
  x = x.contiguous();
  auto out = torch::empty_like(residual);
  const int64_t h = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *rp = residual.data_ptr<float>(), *op = out.data_ptr<float>();
  chatloom_kernels::parallel_for(0, x.size(0), grain_for(h), [&](int64_t b, int64_t e) {
    add_rms_norm_rows(xp + b * h, rp + b * h, wp, op + b * h, e - b, h, (float)eps);
  });
  return out;
}

// gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kFloat32 && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "gate_up must be float32 [T, 2I]");
  gate_up = gate_up.contiguous();
  const int64_t t_dim = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({t_dim, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  chatloom_kernels::parallel_for(0, t_dim, grain_for(inter), [&](int64_t b, int64_t e) {
    silu_and_mul_rows(gp + b * 2 * inter, op + b * inter, e - b, inter);
  });
  return out;
}

// Rotates q [T, Hq, D] and k [T, Hk, D] (views into the fused qkv output are fine) at
// `positions`, writing contiguous q_out [T, Hq, D] and k_out [T, Hk, D].
// cos/sin: [max_position, D/2]. `interleaved` pairs (2i, 2i+1) instead of (i, i + D/2).
std::vector<torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor positions,
                                  torch::Tensor cos, torch::Tensor sin, bool interleaved) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous(), "int64 positions");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "contiguous tables");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
              q.stride(1) == q.size(2) && k.stride(1) == k.size(2), "q, k must be [T, H, D] with rows of heads");
  const int64_t t_dim = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2), half = d / 2;
  TORCH_CHECK(k.size(0) == t_dim && k.size(2) == d && positions.numel() == t_dim && cos.size(1) == half,
              "shapes differ");
  auto q_out = torch::empty({t_dim, hq, d}, q.options());
  auto k_out = torch::empty({t_dim, hk, d}, k.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < t_dim; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of range");
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  auto rotate = [&](const float* src, int64_t src_stride, float* dst, int64_t heads, int64_t t) {
    rotary_heads(src + t * src_stride, dst + t * heads * d, heads, d, cp + pos[t] * half, sp + pos[t] * half,
                 interleaved);
  };
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  float *qo = q_out.data_ptr<float>(), *ko = k_out.data_ptr<float>();
  chatloom_kernels::parallel_for(0, t_dim, grain_for((hq + hk) * d), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      rotate(qp, q.stride(0), qo, hq, t);
      rotate(kp, k.stride(0), ko, hk, t);
    }
  });
  return {q_out, k_out};
}
