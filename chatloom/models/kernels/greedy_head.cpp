// The exact head's argmax without every exact logit: a greedy step needs the best token only.
//
// For a batch of more than a few rows the exact head (a [vocab, hidden] quantized matmul in
// float32) is a sixth of a decode step. Here every logit is first estimated with int8 activations
// (int8_linear: about twice as fast), and a rigorous bound on each estimate's error says which
// tokens could still be the exact argmax; only those are recomputed exactly, with the exact
// kernel's arithmetic (w = fma(code, d, m), then one FMA chain over k from zero, plus a zero
// bias), so the result is the exact head's argmax bit for bit, the first maximum on ties.
//
// The bound, for row x and token j with weight row w_j (every w_jk exact in float32):
//   exact logit l_j   = sum_k x_k w_jk, computed with error <= K 2^-24 sum_k |x_k w_jk|;
//   estimate    a_j   = sum_k q_k w_jk (q: x rounded per block of 32 to d_b * int8, |x_k - q_k| <=
//                       d_b / 2 + tiny), its float steps adding error <= (K / 32 + 2) 2^-24 sum |q w|;
//   so |a_j - l_j| <= ||x - q|| ||w_j|| + 1e-4 (||x|| + ||x - q||) ||w_j||   (Cauchy-Schwarz),
// bounded above by B ||w_j|| with B from the row alone. The best estimate's token j* is recomputed
// exactly first: its exact logit l* is at most the exact maximum, so the exact argmax (and every
// token tied with it) has a_j + B ||w_j|| >= l*: those are the candidates, recomputed exactly a
// panel of 16 features at a time. On the peers' offline workload a row then had 13 candidates on
// average where a threshold of max_j (a_j - B ||w_j||) let 100 through.
//
// Two paths, the same arithmetic (so the same candidates and bits): AVX-512 where the CPU has it,
// else plain loops; `isa` ("auto", "avx512", "scalar"; else CHATLOOM_KERNEL_ISA) picks one.
#include "kernels.h"
#include "panel_tile.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using chatloom_kernels::nibble_at;
using chatloom_kernels::ScalePtr;
constexpr int64_t kPanelWidth = chatloom_kernels::kPanel, kBlock = 32;
// Past this many candidates a row is recomputed whole (a bound that loose means a flat row).
constexpr int64_t kMaxCandidates = 4096;

bool finite_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7f800000u) != 0x7f800000u;
}

// Feature j's weight at depth k, as the exact kernel expands it (quantized_linear's layout).
struct ExactHead {
  const uint8_t* codes;
  ScalePtr scales;
  bool q4;
  int64_t k_dim;

  float weight(int64_t j, int64_t k) const {
    const int64_t p = j / kPanelWidth, lane = j % kPanelWidth;
    const float code = q4 ? (float)nibble_at(codes + p * k_dim * 8, k, lane)
                          : (float)reinterpret_cast<const int8_t*>(codes)[(p * k_dim + k) * kPanelWidth + lane];
    const ScalePtr s = scales + (p * (k_dim / kBlock) + k / kBlock) * 2 * kPanelWidth;
    return std::fma(code, s.at(lane), s.at(kPanelWidth + lane));
  }
};

// The exact logits of a whole panel's 16 features for one row: lane j is feature 16 p + j, its
// weights expanded as the exact kernel expands them (dequantize_panel16, into `panel` [K, 16]), then
// one FMA chain over k from zero and the zero bias added, as its tiles run them. A candidate's panel is
// computed whole: 16 lanes cost what one does.
CHATLOOM_WIDE void exact_panel16(const ExactHead& head, const float* x, int64_t p, float* panel, float* out) {
  const int64_t k_dim = head.k_dim;
  const ScalePtr scales = head.scales + p * (k_dim / kBlock) * 2 * kPanelWidth;
  if (head.q4) chatloom_kernels::dequantize_panel16<true>(head.codes + p * k_dim * 8, scales, k_dim, panel);
  else chatloom_kernels::dequantize_panel16<false>(head.codes + p * k_dim * kPanelWidth, scales, k_dim, panel);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k)
    acc = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), _mm512_loadu_ps(panel + k * kPanelWidth), acc);
  _mm512_storeu_ps(out, _mm512_add_ps(acc, _mm512_setzero_ps()));
}

// The same arithmetic a lane at a time, for CPUs without AVX-512 (and forced in the tests).
void exact_panel16_scalar(const ExactHead& head, const float* x, int64_t p, float* out) {
  for (int64_t lane = 0; lane < kPanelWidth; ++lane) {
    float acc = 0.f;
    for (int64_t k = 0; k < head.k_dim; ++k) acc = std::fma(x[k], head.weight(p * kPanelWidth + lane, k), acc);
    out[lane] = acc + 0.f;
  }
}

// One row's scan of the estimates a (n of them): the first index of the largest estimate, and the
// largest |a| and norm * b (for the slack), or false where an estimate is not finite.
__attribute__((target("avx512f"))) bool scan_estimates(const float* a, const float* norms, float b, int64_t n,
                                                      int64_t& best, float& a_max, float& nb_max) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), amax = _mm512_setzero_ps(), nbm = amax;
  const __m512 bv = _mm512_set1_ps(b);
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  __mmask16 bad = 0;
  for (int64_t j = 0; j < n; j += kPanelWidth) {
    const __mmask16 keep = n - j >= kPanelWidth ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
    const __m512 av = _mm512_maskz_loadu_ps(keep, a + j), nb = _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, norms + j), bv);
    bad |= _mm512_mask_cmpeq_epi32_mask(keep, _mm512_and_si512(_mm512_castps_si512(av), exponent), exponent);
    top = _mm512_mask_max_ps(top, keep, top, av);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(av));
    nbm = _mm512_max_ps(nbm, nb);
  }
  if (bad != 0) return false;
  a_max = _mm512_reduce_max_ps(amax), nb_max = _mm512_reduce_max_ps(nbm);
  const float best_value = _mm512_reduce_max_ps(top);
  best = std::find(a, a + n, best_value) - a;
  return true;
}

bool scan_estimates_scalar(const float* a, const float* norms, float b, int64_t n, int64_t& best, float& a_max,
                           float& nb_max) {
  best = 0, a_max = 0.f, nb_max = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    if (!finite_bits(a[j])) return false;
    if (a[j] > a[best]) best = j;
    a_max = std::max(a_max, std::fabs(a[j]));
    nb_max = std::max(nb_max, norms[j] * b);
  }
  return true;
}

// The features whose upper bound a + norm * b (one rounding) reaches the threshold, in ascending order.
__attribute__((target("avx512f"))) void upper_bounds_reaching(const float* a, const float* norms, float b, int64_t n,
                                                             float threshold, std::vector<int64_t>& out) {
  const __m512 bv = _mm512_set1_ps(b), th = _mm512_set1_ps(threshold);
  for (int64_t j = 0; j < n; j += kPanelWidth) {
    const __mmask16 keep = n - j >= kPanelWidth ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
    const __m512 hi = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(keep, norms + j), bv, _mm512_maskz_loadu_ps(keep, a + j));
    for (uint32_t m = _mm512_mask_cmp_ps_mask(keep, hi, th, _CMP_GE_OQ); m != 0; m &= m - 1)
      out.push_back(j + __builtin_ctz(m));
  }
}

void upper_bounds_reaching_scalar(const float* a, const float* norms, float b, int64_t n, float threshold,
                                  std::vector<int64_t>& out) {
  for (int64_t j = 0; j < n; ++j)
    if (std::fma(norms[j], b, a[j]) >= threshold) out.push_back(j);
}

// B for one row (see the top of the file), or -1 where the row is not all finite.
double row_bound(const float* x, int64_t k_dim) {
  double e2 = 0, x2 = 0;
  for (int64_t b = 0; b < k_dim / kBlock; ++b) {
    double amax = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const float v = x[b * kBlock + i];
      if (!finite_bits(v)) return -1;
      amax = std::max(amax, std::fabs((double)v));
    }
    const double half_step = amax / 127 * (0.5 + 1e-6);
    for (int64_t i = 0; i < kBlock; ++i) {
      const double v = std::fabs((double)x[b * kBlock + i]);
      const double e = half_step + v * 1e-6;  // rounding to d_b * int8, and float slop in the scaling
      e2 += e * e;
      x2 += v * v;
    }
  }
  const double e = std::sqrt(e2), n = std::sqrt(x2);
  return (e + 1e-4 * (n + e)) * 1.01;
}

}  // namespace

// "auto": CHATLOOM_KERNEL_ISA if it names a path ("avx2" and "scalar" mean the plain loops),
// else AVX-512 where the CPU has it.
static bool greedy_wide(const std::string& requested) {
  const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl");
  auto parse = [&](const std::string& name) {
    if (name == "scalar" || name == "avx2") return false;
    TORCH_CHECK(name == "avx512", "unknown instruction set '", name, "' for the greedy head: use auto, avx512 or scalar");
    TORCH_CHECK(has, "the greedy head's avx512 path is not available on this CPU");
    return true;
  };
  if (!requested.empty() && requested != "auto") return parse(requested);
  static const bool chosen = [&] {
    const char* env = std::getenv("CHATLOOM_KERNEL_ISA");
    const std::string name = env ? env : "";
    return name == "avx512" || name == "avx2" || name == "scalar" ? parse(name) : has;
  }();
  return chosen;
}

std::tuple<torch::Tensor, torch::Tensor> greedy_head_argmax(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t out_features,
                                 torch::Tensor codes8, torch::Tensor scales8, torch::Tensor norms,
                                 const std::string& isa) {
  const bool wide = greedy_wide(isa);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [T, K]");
  x = x.contiguous();
  const int64_t rows = x.size(0), k_dim = x.size(1);
  TORCH_CHECK(k_dim % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.size(1) == k_dim &&
                  (codes.size(2) == 8 || codes.size(2) == kPanelWidth),
              "codes must be the exact head's panels [P, K, 8 or 16]");
  TORCH_CHECK(scales.is_contiguous() && (scales.scalar_type() == torch::kFloat32 || scales.scalar_type() == torch::kFloat16),
              "scales must be float32 or float16");
  TORCH_CHECK(norms.scalar_type() == torch::kFloat32 && norms.is_contiguous() && norms.numel() == out_features,
              "norms must be float32 [vocab]");
  const ExactHead head{reinterpret_cast<const uint8_t*>(codes.data_ptr()),
                       ScalePtr{scales.data_ptr(), scales.scalar_type() == torch::kFloat16}, codes.size(2) == 8, k_dim};
  const torch::Tensor approx = int8_linear(x, codes8, scales8, out_features, c10::nullopt, "auto");
  auto argmax = torch::empty({rows}, x.options().dtype(torch::kInt64));
  auto picked = torch::empty({rows}, x.options());
  const float *xp = x.data_ptr<float>(), *ap = approx.data_ptr<float>(), *np = norms.data_ptr<float>();
  int64_t* best = argmax.data_ptr<int64_t>();
  float* best_value = picked.data_ptr<float>();
  std::vector<int64_t> whole;  // rows to recompute in full
  std::vector<char> needs_whole(rows, 0);
  chatloom_kernels::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> cand;
    alignas(64) float lanes[kPanelWidth];
    std::vector<float> panel(wide ? k_dim * kPanelWidth : 0);
    int64_t lanes_panel = -1;
    const float* xr = nullptr;
    const auto exact = [&](int64_t j) {  // feature j's exact logit, its panel computed once
      if (j / kPanelWidth != lanes_panel) {
        lanes_panel = j / kPanelWidth;
        if (wide) exact_panel16(head, xr, lanes_panel, panel.data(), lanes);
        else exact_panel16_scalar(head, xr, lanes_panel, lanes);
      }
      return lanes[j % kPanelWidth];
    };
    for (int64_t r = begin; r < end; ++r) {
      xr = xp + r * k_dim;
      lanes_panel = -1;
      const float* a = ap + r * out_features;
      const double bound = row_bound(xr, k_dim);
      if (bound < 0) {
        needs_whole[r] = 1;
        continue;
      }
      const float b = (float)bound;
      int64_t top;
      float amax, nb_max;
      if (!(wide ? scan_estimates(a, np, b, out_features, top, amax, nb_max)
                 : scan_estimates_scalar(a, np, b, out_features, top, amax, nb_max))) {
        needs_whole[r] = 1;
        continue;
      }
      // l*: an exact logit, so at most the exact maximum. The float steps of a + norm b (within an
      // ulp or two of max(|a|, norm b)) are covered by the slack, which can only add candidates.
      const float l_star = exact(top);
      if (!finite_bits(l_star)) {
        needs_whole[r] = 1;
        continue;
      }
      const float threshold = l_star - 1e-6f * (amax + nb_max) - 1e-30f;
      cand.clear();
      if (wide) upper_bounds_reaching(a, np, b, out_features, threshold, cand);
      else upper_bounds_reaching_scalar(a, np, b, out_features, threshold, cand);
      if ((int64_t)cand.size() > kMaxCandidates) {
        needs_whole[r] = 1;
        continue;
      }
      int64_t pick = -1;
      float pick_value = 0.f;
      for (const int64_t j : cand) {  // candidates ascend, so ">" keeps the first maximum
        const float v = exact(j);
        if (pick < 0 || v > pick_value) pick = j, pick_value = v;
      }
      best[r] = pick;
      best_value[r] = pick_value;
    }
  });
  for (int64_t r = 0; r < rows; ++r)
    if (needs_whole[r]) whole.push_back(r);
  if (!whole.empty()) {  // the exact head on those rows, and torch's argmax (NaN ranks first)
    auto idx = torch::tensor(whole, torch::kInt64);
    auto logits = quantized_linear(x.index_select(0, idx), codes, scales, out_features, c10::nullopt, "auto");
    auto picks = logits.argmax(1);
    argmax.index_copy_(0, idx, picks);
    picked.index_copy_(0, idx, logits.gather(1, picks.unsqueeze(1)).squeeze(1));
  }
  return {argmax, picked};
}
