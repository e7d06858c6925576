// y = x @ W^T (+ bias) with W kept in bfloat16: half the bytes of float32 for a decode step
// that is bound by reading weights, and on CPUs with AVX-512 BF16 one vdpbf16ps multiplies
// 32 pairs per instruction (twice the lanes of a float32 FMA).
//
// Each row of x is rounded to bfloat16 (nearest even), then every output is a float32 sum of
// exact bf16 x bf16 products. Panels of 16 output features, depth in pairs:
//   packed [P, K / 2, 32] bfloat16: element 2 j + t of pair-row kk is W[16 p + j, 2 kk + t].
// Paths: "avx512_bf16" (vdpbf16ps) where the CPU has it, and "scalar" (portable C++, the same
// products in float32, summed in a slightly different order, so within float32 rounding of
// the hardware path rather than bit-identical). Chosen by the `isa` argument, else
// CHATLOOM_KERNEL_ISA, else the best available.
#include "kernels.h"
#include "panel_tile.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using chatloom_kernels::kPanel;
constexpr int64_t kRowBlock = 96;

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's .to(torch.bfloat16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

inline float from_bf16(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rows [m0, m1) of x as bf16 pairs (one uint32 per two depths).
void round_rows(const float* x, int64_t k_dim, int64_t m0, int64_t m1, uint32_t* out) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t kk = 0; kk < k_dim / 2; ++kk)
      out[(m - m0) * (k_dim / 2) + kk] =
          (uint32_t)to_bf16(x[m * k_dim + 2 * kk]) | ((uint32_t)to_bf16(x[m * k_dim + 2 * kk + 1]) << 16);
}

template <int R>
void tile_scalar(const uint32_t* xq, int64_t pairs, const uint16_t* panel, const float* bias, float* out,
                 int64_t ldo, int64_t ncols) {
  float acc[R][kPanel] = {};
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const uint16_t* w = panel + kk * 2 * kPanel;
    for (int r = 0; r < R; ++r) {
      const uint32_t xp = xq[r * pairs + kk];
      const float x0 = from_bf16((uint16_t)(xp & 0xFFFF)), x1 = from_bf16((uint16_t)(xp >> 16));
      // Explicit fused steps (bf16 x bf16 products are exact in float32): -ffast-math may not
      // reorder them, so a row's sums are the same whatever the tile's height.
      for (int j = 0; j < kPanel; ++j)
        acc[r][j] = std::fma(from_bf16(w[2 * j + 1]), x1, std::fma(from_bf16(w[2 * j]), x0, acc[r][j]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < ncols; ++j) out[r * ldo + j] = acc[r][j] + (bias ? bias[j] : 0.f);
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define CHATLOOM_HAVE_BF16_PATH 1
template <int R>
__attribute__((target("avx512f,avx512bf16"))) void tile_bf16(const uint32_t* xq, int64_t pairs,
                                                             const uint16_t* panel, const float* bias,
                                                             float* out, int64_t ldo, int64_t ncols) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + kk * 2 * kPanel);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_set1_epi32((int)xq[r * pairs + kk]));
  }
  const __mmask16 keep = (__mmask16)((1u << ncols) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo, keep, _mm512_add_ps(acc[r], bv));
}
#endif

bool has_bf16_path() {
#ifdef CHATLOOM_HAVE_BF16_PATH
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// true: the AVX-512 BF16 path; false: scalar.
bool resolve(const std::string& requested) {
  std::string name = requested;
  if (name.empty() || name == "auto") {
    const char* env = std::getenv("CHATLOOM_KERNEL_ISA");
    // The environment names a path of any kernel; only the bf16 kernel's own names apply here.
    name = env && (std::string(env) == "avx512_bf16" || std::string(env) == "scalar") ? env : "auto";
  }
  if (name == "auto") return has_bf16_path();
  if (name == "scalar") return false;
  TORCH_CHECK(name == "avx512_bf16", "unknown instruction set '", name,
              "' for the bf16 matmul: use auto, avx512_bf16 or scalar");
  TORCH_CHECK(has_bf16_path(), "the bf16 matmul's avx512_bf16 path is not available on this CPU or build");
  return true;
}

template <int R>
void run_tile(bool hw, const uint32_t* xq, int64_t pairs, const uint16_t* panel, const float* bias, float* out,
              int64_t ldo, int64_t ncols) {
#ifdef CHATLOOM_HAVE_BF16_PATH
  if (hw) return tile_bf16<R>(xq, pairs, panel, bias, out, ldo, ncols);
#endif
  tile_scalar<R>(xq, pairs, panel, bias, out, ldo, ncols);
}

}  // namespace

std::vector<std::string> bf16_linear_isas() {
  std::vector<std::string> out;
  if (has_bf16_path()) out.emplace_back("avx512_bf16");
  out.emplace_back("scalar");
  return out;
}

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                          c10::optional<torch::Tensor> bias, const std::string& isa) {
  const bool hw = resolve(isa);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.dim() == 3 && packed.size(2) == 2 * kPanel &&
                  packed.is_contiguous(), "packed must be contiguous bfloat16 [P, K / 2, 32]");
  const int64_t panels = packed.size(0), pairs = packed.size(1), k_dim = 2 * pairs;
  TORCH_CHECK(x.size(1) == k_dim, "inner dimensions differ: ", x.size(1), " vs ", k_dim);
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
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* op = out.data_ptr<float>();
  std::vector<uint32_t> xq(std::min(m_dim, kRowBlock) * pairs);
  for (int64_t m0 = 0; m0 < m_dim; m0 += kRowBlock) {
    const int64_t m1 = std::min(m_dim, m0 + kRowBlock);
    round_rows(xp, k_dim, m0, m1, xq.data());
    const int64_t grain = std::max<int64_t>(1, 200000 / (2 * (m1 - m0) * k_dim * kPanel));
    chatloom_kernels::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col = p * kPanel, ncols = std::min(kPanel, out_features - col);
        const uint16_t* panel = wp + p * pairs * 2 * kPanel;
        const float* b = bp ? bp + col : nullptr;
        chatloom_kernels::for_each_row_tile(m0, m1, [&](int64_t m, int64_t tile_rows) {
          const uint32_t* xm = xq.data() + (m - m0) * pairs;
          float* o = op + m * out_features + col;
          chatloom_kernels::with_tile_rows(tile_rows, [&](auto r) {
            run_tile<decltype(r)::value>(hw, xm, pairs, panel, b, o, out_features, ncols);
          });
        });
      }
    });
  }
  return out;
}
