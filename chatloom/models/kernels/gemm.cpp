// y = x @ W^T (+ bias) for float32, with W packed once at load time into panels of 16
// output features: packed[p, k, j] = W[16 p + j, k] (rows past the end are zero).
//
// Why not BLAS: MKL runs the shapes of a decode step (a few to a few dozen rows against
// a 576..3072-wide weight) at a fraction of this CPU's FMA peak, and repacks W on every
// call. Here a tile of up to 6 input rows x 16 outputs lives in 12 AVX registers while
// the panel streams through once; each output is one FMA chain over k in a fixed order,
// so a row's result does not depend on which other rows share the batch.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>

namespace {

constexpr int64_t kPanel = 16;  // output features per panel
constexpr int64_t kTileRows = 6;
constexpr int64_t kRowBlock = 96;  // input rows kept hot in cache while all panels pass

#if defined(__AVX2__) && defined(__FMA__)

// Accumulators are named variables, not arrays: GCC keeps them in registers then.
#define CHATLOOM_ROW(r)                                                   \
  if constexpr (R > r) {                                                  \
    const __m256 a = _mm256_broadcast_ss(x + r * k_dim + k);              \
    lo##r = _mm256_fmadd_ps(a, w0, lo##r);                                \
    hi##r = _mm256_fmadd_ps(a, w1, hi##r);                                \
  }

template <int R>
inline void tile(const float* x, int64_t k_dim, const float* panel, const float* bias,
                 float* out, int64_t ldo, int64_t ncols) {
  __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0;
  __m256 lo3 = lo0, hi3 = lo0, lo4 = lo0, hi4 = lo0, lo5 = lo0, hi5 = lo0;
  for (int64_t k = 0; k < k_dim; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    CHATLOOM_ROW(0) CHATLOOM_ROW(1) CHATLOOM_ROW(2) CHATLOOM_ROW(3) CHATLOOM_ROW(4) CHATLOOM_ROW(5)
  }
  const __m256 los[6] = {lo0, lo1, lo2, lo3, lo4, lo5}, his[6] = {hi0, hi1, hi2, hi3, hi4, hi5};
  alignas(32) float bb[kPanel] = {0};
  if (bias != nullptr) std::copy(bias, bias + ncols, bb);
  const __m256 b0 = _mm256_load_ps(bb), b1 = _mm256_load_ps(bb + 8);
  alignas(32) float buf[kPanel];
  for (int r = 0; r < R; ++r) {
    const __m256 a = _mm256_add_ps(los[r], b0), b = _mm256_add_ps(his[r], b1);
    float* o = out + r * ldo;
    if (ncols == kPanel) {
      _mm256_storeu_ps(o, a);
      _mm256_storeu_ps(o + 8, b);
    } else {
      _mm256_store_ps(buf, a);
      _mm256_store_ps(buf + 8, b);
      std::copy(buf, buf + ncols, o);
    }
  }
}
#undef CHATLOOM_ROW

#else  // portable fallback: the same loop order, left to the compiler's vectorizer

template <int R>
inline void tile(const float* x, int64_t k_dim, const float* panel, const float* bias,
                 float* out, int64_t ldo, int64_t ncols) {
  float acc[R][kPanel] = {};
  for (int64_t k = 0; k < k_dim; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kPanel; ++j) acc[r][j] += x[r * k_dim + k] * panel[k * kPanel + j];
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < ncols; ++j) out[r * ldo + j] = acc[r][j] + (bias ? bias[j] : 0.f);
}

#endif

// All tiles of one panel for rows [m0, m1).
inline void panel_rows(const float* x, int64_t k_dim, const float* panel, const float* bias,
                       float* out, int64_t ldo, int64_t ncols, int64_t m0, int64_t m1) {
  int64_t m = m0;
  for (; m + kTileRows <= m1; m += kTileRows)
    tile<6>(x + m * k_dim, k_dim, panel, bias, out + m * ldo, ldo, ncols);
  const float* xs = x + m * k_dim;
  float* os = out + m * ldo;
  switch (m1 - m) {
    case 5: tile<5>(xs, k_dim, panel, bias, os, ldo, ncols); break;
    case 4: tile<4>(xs, k_dim, panel, bias, os, ldo, ncols); break;
    case 3: tile<3>(xs, k_dim, panel, bias, os, ldo, ncols); break;
    case 2: tile<2>(xs, k_dim, panel, bias, os, ldo, ncols); break;
    case 1: tile<1>(xs, k_dim, panel, bias, os, ldo, ncols); break;
    default: break;
  }
}

}  // namespace

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && packed.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanel, "x [M, K], packed [P, K, 16]");
  TORCH_CHECK(packed.is_contiguous(), "packed weight must be contiguous");
  TORCH_CHECK(x.size(1) == packed.size(1), "inner dimensions differ: ", x.size(1), " vs ", packed.size(1));
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kPanel && out_features <= packed.size(0) * kPanel,
              "out_features does not match the packed panels");
  x = x.contiguous();
  const float* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == torch::kFloat32 && bias_c.numel() == out_features, "bias shape");
    b = bias_c.data_ptr<float>();
  }
  const int64_t m_dim = x.size(0), k_dim = x.size(1), panels = packed.size(0);
  auto out = torch::empty({m_dim, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < m_dim; m0 += kRowBlock) {
    const int64_t m1 = std::min(m_dim, m0 + kRowBlock);
    // Enough panels per thread that a chunk is worth waking a thread for.
    const int64_t flops_per_panel = 2 * (m1 - m0) * k_dim * kPanel;
    const int64_t grain = std::max<int64_t>(1, 200000 / flops_per_panel);
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col = p * kPanel;
        panel_rows(xp, k_dim, wp + p * k_dim * kPanel, b ? b + col : nullptr, op + col, out_features,
                   std::min(kPanel, out_features - col), m0, m1);
      }
    });
  }
  return out;
}
