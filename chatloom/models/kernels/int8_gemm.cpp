// y = x @ W^T (+ bias) for GGUF block-quantized weights (Q4_1; Q4_0 as Q4_1 with m = -8 d;
// Q8_0) with integer multiply-adds, the way llama.cpp runs quantized models on CPUs.
//
// Each row of x is quantized per block of 32 along K to int8 with its own scale
// (d = max|x| / 127, q = round(x / d)). Within a block, a weight is d_w * c + m_w with an
// integer code c, so a block's dot product is
//     d_x d_w * sum(q c) + m_w * (d_x * sum(q)),
// and sum(q c) is exact in integers: vpmaddubsw multiplies 32 code/int8 pairs per
// instruction, four times what float32 FMAs do per cycle. Rows are quantized and
// accumulated independently, block by block in a fixed order, so a row's result does
// not depend on which other rows share the batch.
//
// Weights live in panels of 16 output features; scales are [P, K / 32, 2, 16]: d, then m.
// For depth group g (k = 4g .. 4g + 3):
//   4-bit codes [P, K / 4, 32] uint8: byte 4 j + i holds feature j's code at k = 4g + i in
//     its low nibble and feature j + 8's in its high nibble;
//   8-bit codes [P, K / 4, 64] int8: byte 32 h + 4 j + i holds feature 8 h + j's at 4g + i.
#include "kernels.h"
#include "panel_tile.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using chatloom_kernels::kPanel;
constexpr int64_t kBlock = 32;
constexpr int64_t kTileRows = 3;  // rows per tile for 4-bit codes
constexpr int64_t kRowBlock = 96;

#if defined(__AVX2__) && defined(__FMA__)

// Quantizes one row of K floats: q [K] int8, and per block d and d * sum(q).
void quantize_row(const float* x, int64_t k_dim, int8_t* q, float* d_out, float* s_out) {
  for (int64_t b = 0; b < k_dim / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float d = _mm_cvtss_f32(m4) / 127.f;
    const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
    __m256i qi[4];
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      sum = _mm256_add_epi32(sum, qi[i]);
    }
    // int32 -> int8, restoring element order after the lane-wise packs.
    const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]), p23 = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), p);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    d_out[b] = d;
    s_out[b] = d * (float)_mm_cvtsi128_si32(s4);
  }
}

// R rows x 16 features of one panel. Q4 codes are unsigned (0..15): vpmaddubsw takes them
// as is, and a block's int16 sums cannot overflow (each lane adds two products of at most
// 15 * 127, a block adds eight lanes). Q8 codes are signed: the code's sign moves onto the
// activation (vpsignb) so vpmaddubsw sees |code|, and each group is widened to int32 at once.
template <int R, bool Q8>
void tile(const int8_t* q, const float* dx, const float* sx, int64_t k_dim, const uint8_t* codes,
          const float* scales, const float* bias, float* out, int64_t ldo, int64_t ncols) {
  const int64_t nb = k_dim / kBlock;
  constexpr int64_t group_bytes = Q8 ? 64 : 32;  // 16 features x 4 depths
  __m256 a0l = _mm256_setzero_ps(), a0h = a0l, a1l = a0l, a1h = a0l, a2l = a0l, a2h = a0l;
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s0l = _mm256_setzero_si256(), s0h = s0l, s1l = s0l, s1h = s0l, s2l = s0l, s2h = s0l;
    const uint8_t* cb = codes + b * 8 * group_bytes;
#pragma GCC unroll 2
    for (int g = 0; g < 8; ++g) {
      const int8_t* xg = q + b * kBlock + g * 4;
      if constexpr (Q8) {
        const __m256i wl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + g * 64));
        const __m256i wh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + g * 64 + 32));
        const __m256i al = _mm256_abs_epi8(wl), ah = _mm256_abs_epi8(wh);
#define CHATLOOM_DOT(r)                                                                                 \
  if constexpr (R > r) {                                                                                \
    const __m256i xv = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xg + r * k_dim));           \
    s##r##l = _mm256_add_epi32(s##r##l, _mm256_madd_epi16(_mm256_maddubs_epi16(al, _mm256_sign_epi8(xv, wl)), ones)); \
    s##r##h = _mm256_add_epi32(s##r##h, _mm256_madd_epi16(_mm256_maddubs_epi16(ah, _mm256_sign_epi8(xv, wh)), ones)); \
  }
        CHATLOOM_DOT(0) CHATLOOM_DOT(1) CHATLOOM_DOT(2)
#undef CHATLOOM_DOT
      } else {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + g * 32));
        const __m256i wl = _mm256_and_si256(raw, low4);
        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
#define CHATLOOM_DOT(r)                                                                       \
  if constexpr (R > r) {                                                                      \
    const __m256i xv = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xg + r * k_dim)); \
    s##r##l = _mm256_add_epi16(s##r##l, _mm256_maddubs_epi16(wl, xv));                        \
    s##r##h = _mm256_add_epi16(s##r##h, _mm256_maddubs_epi16(wh, xv));                        \
  }
        CHATLOOM_DOT(0) CHATLOOM_DOT(1) CHATLOOM_DOT(2)
#undef CHATLOOM_DOT
      }
    }
    const float* s = scales + b * 2 * kPanel;
    const __m256 dl = _mm256_loadu_ps(s), dh = _mm256_loadu_ps(s + 8);
    [[maybe_unused]] const __m256 ml = _mm256_loadu_ps(s + 16), mh = _mm256_loadu_ps(s + 24);
    // Q4's int16 sums widen here; Q8's are int32 already, and Q8 has no m term.
#define CHATLOOM_SCALE(r)                                                                             \
  if constexpr (R > r) {                                                                              \
    const __m256 d = _mm256_set1_ps(dx[r * nb + b]);                                                  \
    const __m256i il = Q8 ? s##r##l : _mm256_madd_epi16(s##r##l, ones);                               \
    const __m256i ih = Q8 ? s##r##h : _mm256_madd_epi16(s##r##h, ones);                               \
    a##r##l = _mm256_fmadd_ps(_mm256_cvtepi32_ps(il), _mm256_mul_ps(dl, d), a##r##l);                 \
    a##r##h = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih), _mm256_mul_ps(dh, d), a##r##h);                 \
    if constexpr (!Q8) {                                                                              \
      const __m256 sm = _mm256_set1_ps(sx[r * nb + b]);                                               \
      a##r##l = _mm256_fmadd_ps(ml, sm, a##r##l);                                                     \
      a##r##h = _mm256_fmadd_ps(mh, sm, a##r##h);                                                     \
    }                                                                                                 \
  }
    CHATLOOM_SCALE(0) CHATLOOM_SCALE(1) CHATLOOM_SCALE(2)
#undef CHATLOOM_SCALE
  }
  const __m256 lo[3] = {a0l, a1l, a2l}, hi[3] = {a0h, a1h, a2h};
  chatloom_kernels::store_tile<R>(lo, hi, bias, out, ldo, ncols);
}

#endif

}  // namespace

bool int8_linear_supported() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t out_features,
                          c10::optional<torch::Tensor> bias) {
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  const bool q8 = codes.dim() == 3 && codes.size(2) == 64;
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() &&
                  ((codes.size(2) == 32 && codes.scalar_type() == torch::kUInt8) ||
                   (q8 && codes.scalar_type() == torch::kInt8)),
              "codes must be contiguous uint8 [P, K / 4, 32] (4-bit) or int8 [P, K / 4, 64] (8-bit)");
  const int64_t panels = codes.size(0), k_dim = codes.size(1) * 4, nb = k_dim / kBlock;
  TORCH_CHECK(k_dim % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(x.size(1) == k_dim, "inner dimensions differ: ", x.size(1), " vs ", k_dim);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() &&
              scales.sizes() == torch::IntArrayRef({panels, nb, 2, kPanel}), "scales shape");
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
  std::vector<int8_t> q(m_dim * k_dim);
  std::vector<float> dx(m_dim * nb), sx(m_dim * nb);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m_dim, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(xp + m * k_dim, k_dim, q.data() + m * k_dim, dx.data() + m * nb, sx.data() + m * nb);
  });
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t panel_bytes = k_dim * (q8 ? 16 : 8);
  // Rows [m, m + r) against panel p, with R = r as a template argument.
  auto rows = [&](auto kind, int64_t r, int64_t m, int64_t p) {
    constexpr bool Q8 = decltype(kind)::value;
    const int64_t col = p * kPanel, ncols = std::min(kPanel, out_features - col);
    const int8_t* qm = q.data() + m * k_dim;
    const float *dm = dx.data() + m * nb, *sm = sx.data() + m * nb, *b = bp ? bp + col : nullptr;
    const uint8_t* c = cp + p * panel_bytes;
    const float* s = sp + p * nb * 2 * kPanel;
    float* o = op + m * out_features + col;
    if (r == 3) tile<3, Q8>(qm, dm, sm, k_dim, c, s, b, o, out_features, ncols);
    else if (r == 2) tile<2, Q8>(qm, dm, sm, k_dim, c, s, b, o, out_features, ncols);
    else tile<1, Q8>(qm, dm, sm, k_dim, c, s, b, o, out_features, ncols);
  };
  // Three rows per tile for 4-bit codes; two for 8-bit, whose dot products need more registers.
  const int64_t tile_rows = q8 ? 2 : kTileRows;
  for (int64_t m0 = 0; m0 < m_dim; m0 += kRowBlock) {
    const int64_t m1 = std::min(m_dim, m0 + kRowBlock);
    const int64_t grain = std::max<int64_t>(1, 200000 / (2 * (m1 - m0) * k_dim * kPanel));
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        for (int64_t m = m0; m < m1; m += tile_rows) {
          const int64_t r = std::min(tile_rows, m1 - m);
          if (q8) rows(std::true_type{}, r, m, p);
          else rows(std::false_type{}, r, m, p);
        }
    });
  }
  return out;
#else
  TORCH_CHECK(false, "int8_linear needs AVX2 and FMA");
#endif
}
