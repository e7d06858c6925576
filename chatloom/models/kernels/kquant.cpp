// y = x @ W^T (+ bias) for GGUF weights whose scales change every 16 weights along K (Q6_K),
// or whose fused parts come in different block formats (a Q4_K_M file's Q4_K query and Q6_K
// value projections in one QKV layer). Codes stay 8-bit in memory; each panel of 16 output
// features is expanded to float32 in a per-thread scratch right before its tiles run.
//
//   codes  [P, K, 16] int8: codes[p, k, j] is feature 16 p + j's code at depth k;
//   scales [P, K / 16, 2, 16] float32: d, then m, for the panel's 16 features per group of 16.
//
// A weight is fma(code, d, m): gguf's dequantizers compute d * code (exact in float32, the
// factors having few significant bits) and then add m (-dmin * min for Q4_K / Q5_K, zero
// for Q6_K), one rounding, as the single fma does. Each output is then one FMA chain over k
// in increasing order, as in gemm.cpp's packed_linear, so the results are bit-identical to
// dequantizing with gguf and running the float32 kernel, whatever the batch.
//
// grouped_int8_linear is the int8-activation path for the same weights: each row of x is
// quantized to int8 per group of 16 (d_x = max|x| / 127), a group's dot product with the
// codes is summed exactly in integers (the code's sign moved onto the activation, as in
// int8_gemm.cpp's 8-bit path), then d_x d_w sum(q c) + m_w d_x sum(q). Codes come in
// int8_gemm.cpp's 8-bit layout [P, K / 4, 64]: byte 32 h + 4 j + i is feature 8 h + j at
// depth 4 g + i.
#include "kernels.h"
#include "panel_tile.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using chatloom_kernels::kPanel;
using chatloom_kernels::kTileRows;
using chatloom_kernels::for_each_row_tile;
using chatloom_kernels::with_tile_rows;
constexpr int64_t kGroup = 16;  // weights per scale along K
constexpr int64_t kRowBlock = 96;

void expand_panel(const int8_t* codes, const float* scales, int64_t k_dim, float* dst) {
  for (int64_t g = 0; g < k_dim / kGroup; ++g) {
    const float* s = scales + g * 2 * kPanel;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 d0 = _mm256_loadu_ps(s), d1 = _mm256_loadu_ps(s + 8);
    const __m256 m0 = _mm256_loadu_ps(s + 16), m1 = _mm256_loadu_ps(s + 24);
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * kPanel));
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
      _mm256_storeu_ps(dst + k * kPanel, _mm256_fmadd_ps(lo, d0, m0));
      _mm256_storeu_ps(dst + k * kPanel + 8, _mm256_fmadd_ps(hi, d1, m1));
    }
#else
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k)
      for (int64_t j = 0; j < kPanel; ++j)
        dst[k * kPanel + j] = std::fma((float)codes[k * kPanel + j], s[j], s[kPanel + j]);
#endif
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// R rows x 16 features: one FMA chain per output over k, as gemm.cpp's tile.
template <int R>
void tile(const float* x, int64_t k_dim, const float* panel, const float* bias, float* out, int64_t ldo,
          int64_t ncols) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel), w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * k_dim + k);
      lo[r] = _mm256_fmadd_ps(a, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, w1, hi[r]);
    }
  }
  chatloom_kernels::store_tile<R>(lo, hi, bias, out, ldo, ncols);
}
#else
template <int R>
void tile(const float* x, int64_t k_dim, const float* panel, const float* bias, float* out, int64_t ldo,
          int64_t ncols) {
  float acc[R][kPanel] = {};
  for (int64_t k = 0; k < k_dim; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kPanel; ++j) acc[r][j] = std::fma(x[r * k_dim + k], panel[k * kPanel + j], acc[r][j]);
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < ncols; ++j) out[r * ldo + j] = acc[r][j] + (bias ? bias[j] : 0.f);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Up to 6 rows straight from the codes, each weight row expanded in registers: with so few
// rows a step is bound by reading weights, and the scratch panel's store and reload would
// cost more than the FMAs. Same weights, same FMA order as `tile`, so the same bits.
template <int R>
void tile_codes(const float* x, int64_t k_dim, const int8_t* codes, const float* scales, const float* bias,
                float* out, int64_t ldo, int64_t ncols) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < k_dim / kGroup; ++g) {
    const float* s = scales + g * 2 * kPanel;
    const __m256 d0 = _mm256_loadu_ps(s), d1 = _mm256_loadu_ps(s + 8);
    const __m256 m0 = _mm256_loadu_ps(s + 16), m1 = _mm256_loadu_ps(s + 24);
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * kPanel));
      const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d0, m0);
      const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), d1, m1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(x + r * k_dim + k);
        lo[r] = _mm256_fmadd_ps(a, w0, lo[r]);
        hi[r] = _mm256_fmadd_ps(a, w1, hi[r]);
      }
    }
  }
  chatloom_kernels::store_tile<R>(lo, hi, bias, out, ldo, ncols);
}

void rows_from_codes(const float* x, int64_t k_dim, const int8_t* codes, const float* scales, const float* bias,
                     float* out, int64_t ldo, int64_t ncols, int64_t m0, int64_t m1) {
  for_each_row_tile(m0, m1, [&](int64_t m, int64_t tile_rows) {
    const float* xs = x + m * k_dim;
    float* os = out + m * ldo;
    with_tile_rows(tile_rows, [&](auto r) {
      tile_codes<decltype(r)::value>(xs, k_dim, codes, scales, bias, os, ldo, ncols);
    });
  });
}
#endif

void rows(const float* x, int64_t k_dim, const float* panel, const float* bias, float* out, int64_t ldo,
          int64_t ncols, int64_t m0, int64_t m1) {
  for_each_row_tile(m0, m1, [&](int64_t m, int64_t tile_rows) {
    const float* xs = x + m * k_dim;
    float* os = out + m * ldo;
    with_tile_rows(tile_rows, [&](auto r) {
      tile<decltype(r)::value>(xs, k_dim, panel, bias, os, ldo, ncols);
    });
  });
}

#if defined(__AVX2__) && defined(__FMA__)
// One row of K floats -> int8 q [K] and, per group of 16, d and d * sum(q).
void quantize_row16(const float* x, int64_t k_dim, int8_t* q, float* d_out, float* s_out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < k_dim / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    const __m256 v0 = _mm256_loadu_ps(xg), v1 = _mm256_loadu_ps(xg + 8);
    const __m256 amax = _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float d = _mm_cvtss_f32(m4) / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int i = 0; i < kGroup; ++i) {
      const int v = (int)std::nearbyint(xg[i] * id);
      q[g * kGroup + i] = (int8_t)v;
      sum += v;
    }
    d_out[g] = d;
    s_out[g] = d * (float)sum;
  }
}

// R rows x 16 features of one panel.
template <int R>
void int8_tile(const int8_t* q, const float* dx, const float* sx, int64_t k_dim, const uint8_t* codes,
               const float* scales, const float* bias, float* out, int64_t ldo, int64_t ncols) {
  const int64_t ng = k_dim / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc_l[R], acc_h[R];
  for (int r = 0; r < R; ++r) acc_l[r] = acc_h[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256i s_l[R], s_h[R];
    for (int r = 0; r < R; ++r) s_l[r] = s_h[r] = _mm256_setzero_si256();
    for (int dg = 0; dg < 4; ++dg) {  // 4 depths per step
      const uint8_t* c = codes + (g * 4 + dg) * 64;
      const __m256i wl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
      const __m256i wh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32));
      const __m256i al = _mm256_abs_epi8(wl), ah = _mm256_abs_epi8(wh);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(q + r * k_dim + g * kGroup + dg * 4));
        s_l[r] = _mm256_add_epi32(s_l[r], _mm256_madd_epi16(_mm256_maddubs_epi16(al, _mm256_sign_epi8(xv, wl)), ones));
        s_h[r] = _mm256_add_epi32(s_h[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ah, _mm256_sign_epi8(xv, wh)), ones));
      }
    }
    const float* s = scales + g * 2 * kPanel;
    const __m256 dl = _mm256_loadu_ps(s), dh = _mm256_loadu_ps(s + 8);
    const __m256 ml = _mm256_loadu_ps(s + 16), mh = _mm256_loadu_ps(s + 24);
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_set1_ps(dx[r * ng + g]), sm = _mm256_set1_ps(sx[r * ng + g]);
      acc_l[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_l[r]), _mm256_mul_ps(dl, d), acc_l[r]);
      acc_h[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_h[r]), _mm256_mul_ps(dh, d), acc_h[r]);
      acc_l[r] = _mm256_fmadd_ps(ml, sm, acc_l[r]);
      acc_h[r] = _mm256_fmadd_ps(mh, sm, acc_h[r]);
    }
  }
  chatloom_kernels::store_tile<R>(acc_l, acc_h, bias, out, ldo, ncols);
}
#endif

}  // namespace

torch::Tensor grouped_int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t out_features,
                                  c10::optional<torch::Tensor> bias) {
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.dim() == 3 && codes.size(2) == 64 && codes.is_contiguous(),
              "codes must be contiguous int8 [P, K / 4, 64]");
  const int64_t panels = codes.size(0), k_dim = codes.size(1) * 4, ng = k_dim / kGroup;
  TORCH_CHECK(k_dim % kGroup == 0, "K must be a multiple of 16");
  TORCH_CHECK(x.size(1) == k_dim, "inner dimensions differ: ", x.size(1), " vs ", k_dim);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() &&
              scales.sizes() == torch::IntArrayRef({panels, ng, 2, kPanel}), "scales shape");
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features does not match the packed panels");
  torch::Tensor bias_keep;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_keep = bias->contiguous();
    TORCH_CHECK(bias_keep.scalar_type() == torch::kFloat32 && bias_keep.numel() == out_features, "bias shape");
    bp = bias_keep.data_ptr<float>();
  }
  x = x.contiguous();
  const int64_t m_dim = x.size(0);
  auto out = torch::empty({m_dim, out_features}, x.options());
  // Uninitialized: every row is quantized into them before any tile reads them (a zero-fill would
  // run on one thread while the others wait).
  std::unique_ptr<int8_t[]> q(new int8_t[m_dim * k_dim]);
  std::unique_ptr<float[]> dx(new float[m_dim * ng]), sx(new float[m_dim * ng]);
  const float* xp = x.data_ptr<float>();
  chatloom_kernels::parallel_for(0, m_dim, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row16(xp + m * k_dim, k_dim, q.get() + m * k_dim, dx.get() + m * ng, sx.get() + m * ng);
  });
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < m_dim; m0 += kRowBlock) {
    const int64_t m1 = std::min(m_dim, m0 + kRowBlock);
    const int64_t grain = std::max<int64_t>(1, 200000 / (2 * (m1 - m0) * k_dim * kPanel));
    chatloom_kernels::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col = p * kPanel, ncols = std::min(kPanel, out_features - col);
        const uint8_t* c = cp + p * k_dim * kPanel;
        const float* s = sp + p * ng * 2 * kPanel;
        const float* b = bp ? bp + col : nullptr;
        for (int64_t m = m0; m < m1; m += 2) {
          const int8_t* qm = q.get() + m * k_dim;
          const float *dm = dx.get() + m * ng, *sm = sx.get() + m * ng;
          float* o = op + m * out_features + col;
          if (m1 - m >= 2) int8_tile<2>(qm, dm, sm, k_dim, c, s, b, o, out_features, ncols);
          else int8_tile<1>(qm, dm, sm, k_dim, c, s, b, o, out_features, ncols);
        }
      }
    });
  }
  return out;
#else
  TORCH_CHECK(false, "grouped_int8_linear needs AVX2 and FMA");
#endif
}

torch::Tensor grouped_quantized_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                       int64_t out_features, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.dim() == 3 && codes.size(2) == kPanel &&
                  codes.is_contiguous(), "codes must be contiguous int8 [P, K, 16]");
  const int64_t panels = codes.size(0), k_dim = codes.size(1);
  TORCH_CHECK(k_dim % kGroup == 0, "K must be a multiple of 16");
  TORCH_CHECK(x.size(1) == k_dim, "inner dimensions differ: ", x.size(1), " vs ", k_dim);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() &&
              scales.sizes() == torch::IntArrayRef({panels, k_dim / kGroup, 2, kPanel}), "scales shape");
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features does not match the packed panels");
  torch::Tensor bias_keep;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_keep = bias->contiguous();
    TORCH_CHECK(bias_keep.scalar_type() == torch::kFloat32 && bias_keep.numel() == out_features, "bias shape");
    bp = bias_keep.data_ptr<float>();
  }
  x = x.contiguous();
  const int64_t m_dim = x.size(0);
  auto out = torch::empty({m_dim, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
#if defined(__AVX2__) && defined(__FMA__)
  const bool few_rows = m_dim <= 12;  // up to two tiles: expanding weight rows twice beats the scratch
#else
  const bool few_rows = false;
#endif
  for (int64_t m0 = 0; m0 < m_dim; m0 += kRowBlock) {
    const int64_t m1 = std::min(m_dim, m0 + kRowBlock);
    const int64_t grain = std::max<int64_t>(1, 200000 / (2 * (m1 - m0) * k_dim * kPanel));
    chatloom_kernels::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(few_rows ? 0 : k_dim * kPanel);
      for (int64_t p = begin; p < end; ++p) {
#if defined(__AVX2__) && defined(__FMA__)
        if (few_rows) {
          const int64_t col = p * kPanel;
          rows_from_codes(xp, k_dim, cp + p * k_dim * kPanel, sp + p * (k_dim / kGroup) * 2 * kPanel,
                          bp ? bp + col : nullptr, op + col, out_features, std::min(kPanel, out_features - col),
                          m0, m1);
          continue;
        }
#endif
        expand_panel(cp + p * k_dim * kPanel, sp + p * (k_dim / kGroup) * 2 * kPanel, k_dim, scratch.data());
        const int64_t col = p * kPanel;
        rows(xp, k_dim, scratch.data(), bp ? bp + col : nullptr, op + col, out_features,
             std::min(kPanel, out_features - col), m0, m1);
      }
    });
  }
  return out;
}
