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
// Three instruction paths, chosen at run time (int8_linear's `isa` argument, else the
// CHATLOOM_KERNEL_ISA environment variable, else the best this CPU has): AVX-512 VNNI
// (vpdpbusd: 64 code/int8 products summed into int32 per instruction), AVX2 (vpmaddubsw)
// and portable scalar C++. The integer sums are exact on every path and the float steps are
// the same operations in the same order, so all three give the same bits.
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
#include <cstdlib>
#include <memory>
#include <string>
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

// -- portable scalar path: the same arithmetic as the SIMD paths, one value at a time ------------

void quantize_row_scalar(const float* x, int64_t k_dim, int8_t* q, float* d_out, float* s_out) {
  for (int64_t b = 0; b < k_dim / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int32_t v = (int32_t)std::nearbyint(xb[i] * id);
      sum += v;
      q[b * kBlock + i] = (int8_t)std::min(127, std::max(-128, v));
    }
    d_out[b] = d;
    s_out[b] = d * (float)sum;
  }
}

template <int R, bool Q8>
void tile_scalar(const int8_t* q, const float* dx, const float* sx, int64_t k_dim, const uint8_t* codes,
                 const float* scales, const float* bias, float* out, int64_t ldo, int64_t ncols) {
  const int64_t nb = k_dim / kBlock;
  constexpr int64_t group_bytes = Q8 ? 64 : 32;
  float acc[R][kPanel] = {};
  for (int64_t b = 0; b < nb; ++b) {
    int32_t isum[R][kPanel] = {};
    const uint8_t* cb = codes + b * 8 * group_bytes;
    for (int g = 0; g < 8; ++g)
      for (int j = 0; j < kPanel; ++j)
        for (int i = 0; i < 4; ++i) {
          int32_t c;
          if constexpr (Q8) c = (int8_t)cb[g * 64 + 32 * (j / 8) + 4 * (j % 8) + i];
          else c = j < 8 ? (cb[g * 32 + 4 * j + i] & 15) : (cb[g * 32 + 4 * (j - 8) + i] >> 4);
          for (int r = 0; r < R; ++r) isum[r][j] += c * (int32_t)q[r * k_dim + b * kBlock + g * 4 + i];
        }
    const float* s = scales + b * 2 * kPanel;
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kPanel; ++j) {
        acc[r][j] = std::fma((float)isum[r][j], s[j] * dx[r * nb + b], acc[r][j]);
        if constexpr (!Q8) acc[r][j] = std::fma(s[kPanel + j], sx[r * nb + b], acc[r][j]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < ncols; ++j) out[r * ldo + j] = acc[r][j] + (bias ? bias[j] : 0.f);
}

// -- AVX-512 VNNI: one vpdpbusd per row and group of 4 depths covers all 16 features ------------
// Compiled for these instructions whatever -march says, and only called where the CPU has them.
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define CHATLOOM_HAVE_VNNI_PATH 1
#define CHATLOOM_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

template <int R, bool Q8>
CHATLOOM_VNNI void tile_vnni(const int8_t* q, const float* dx, const float* sx, int64_t k_dim,
                             const uint8_t* codes, const float* scales, const float* bias, float* out,
                             int64_t ldo, int64_t ncols) {
  const int64_t nb = k_dim / kBlock;
  constexpr int64_t group_bytes = Q8 ? 64 : 32;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    const uint8_t* cb = codes + b * 8 * group_bytes;
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const int8_t* xg = q + b * kBlock + g * 4;
      __m512i w;  // dword j: feature j's codes at the group's 4 depths
      __mmask64 neg = 0;
      if constexpr (Q8) {
        const __m512i raw = _mm512_loadu_si512(cb + g * 64);
        neg = _mm512_movepi8_mask(raw);
        w = _mm512_abs_epi8(raw);  // |code| as unsigned (-128 -> 128); its sign moves onto x
      } else {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + g * 32));
        w = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), low4);
      }
      for (int r = 0; r < R; ++r) {
        __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xg + r * k_dim));
        if constexpr (Q8) xv = _mm512_mask_sub_epi8(xv, neg, zero, xv);
        isum[r] = _mm512_dpbusd_epi32(isum[r], w, xv);
      }
    }
    const float* s = scales + b * 2 * kPanel;
    const __m512 dw = _mm512_loadu_ps(s);
    [[maybe_unused]] const __m512 mw = _mm512_loadu_ps(s + kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(dx[r * nb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, d), acc[r]);
      if constexpr (!Q8) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * nb + b]), acc[r]);
    }
  }
  const __mmask16 keep = (__mmask16)((1u << ncols) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo, keep, _mm512_add_ps(acc[r], bv));
}

// R rows x NP panels of 4-bit codes at once, for many rows (prefill, big batches): each panel's
// nibbles are unpacked once for R rows (tile_vnni unpacks them once per 3), and the R x NP
// dot products give the multiply-add units independent chains. Every (row, panel) pair runs
// the same integer sums and the same float steps in the same order as tile_vnni, so the bits
// are the same.
constexpr int kVnniRows = 6, kVnniPanels = 2;
constexpr int64_t kVnniMinRows = 12;

template <int R, int NP>
CHATLOOM_VNNI void tile_vnni_q4x(const int8_t* q, const float* dx, const float* sx, int64_t k_dim,
                                 const uint8_t* codes, int64_t panel_bytes, const float* scales,
                                 int64_t scale_stride, const float* bias, float* out, int64_t ldo,
                                 int64_t out_features, int64_t col0) {
  const int64_t nb = k_dim / kBlock;
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i isum[R][NP];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p) isum[r][p] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      __m512i w[NP];
      for (int p = 0; p < NP; ++p) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + p * panel_bytes + (b * 8 + g) * 32));
        w[p] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), low4);
      }
      const int8_t* xg = q + b * kBlock + g * 4;
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xg + r * k_dim));
        for (int p = 0; p < NP; ++p) isum[r][p] = _mm512_dpbusd_epi32(isum[r][p], w[p], xv);
      }
    }
    for (int p = 0; p < NP; ++p) {
      const float* s = scales + p * scale_stride + b * 2 * kPanel;
      const __m512 dw = _mm512_loadu_ps(s), mw = _mm512_loadu_ps(s + kPanel);
      for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_set1_ps(dx[r * nb + b]);
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][p]), _mm512_mul_ps(dw, d), acc[r][p]);
        acc[r][p] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * nb + b]), acc[r][p]);
      }
    }
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t col = col0 + p * kPanel;
    const __mmask16 keep = (__mmask16)((1u << std::min<int64_t>(kPanel, out_features - col)) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo + col, keep, _mm512_add_ps(acc[r][p], bv));
  }
}

// The same tiles for 8-bit codes. vpdpbusd multiplies unsigned by signed bytes; tile_vnni moves
// each code's sign onto the activation, two instructions per row and group. Here the codes are
// shifted into unsigned range instead (c + 128, one xor per panel and group) and the shift is
// taken back once per block from the integer sum: sum((c + 128) q) - 128 sum(q) = sum(c q),
// exactly. `qsum` holds each row's per-block sum of q.
template <int R, int NP>
CHATLOOM_VNNI void tile_vnni_q8x(const int8_t* q, const float* dx, const int32_t* qsum, int64_t k_dim,
                                 const uint8_t* codes, int64_t panel_bytes, const float* scales,
                                 int64_t scale_stride, const float* bias, float* out, int64_t ldo,
                                 int64_t out_features, int64_t col0) {
  const int64_t nb = k_dim / kBlock;
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  const __m512i bias128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    __m512i isum[R][NP];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p) isum[r][p] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      __m512i w[NP];
      for (int p = 0; p < NP; ++p)
        w[p] = _mm512_xor_si512(_mm512_loadu_si512(codes + p * panel_bytes + (b * 8 + g) * 64), bias128);
      const int8_t* xg = q + b * kBlock + g * 4;
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xg + r * k_dim));
        for (int p = 0; p < NP; ++p) isum[r][p] = _mm512_dpbusd_epi32(isum[r][p], w[p], xv);
      }
    }
    for (int p = 0; p < NP; ++p) {
      const __m512 dw = _mm512_loadu_ps(scales + p * scale_stride + b * 2 * kPanel);
      for (int r = 0; r < R; ++r) {
        const __m512i exact = _mm512_sub_epi32(isum[r][p], _mm512_set1_epi32(128 * qsum[r * nb + b]));
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nb + b])),
                                    acc[r][p]);
      }
    }
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t col = col0 + p * kPanel;
    const __mmask16 keep = (__mmask16)((1u << std::min<int64_t>(kPanel, out_features - col)) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo + col, keep, _mm512_add_ps(acc[r][p], bv));
  }
}
#endif

// -- choosing the path --------------------------------------------------------------------------

enum class Isa { kScalar, kAvx2, kAvx512Vnni };

bool cpu_has(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2:
#if defined(__AVX2__) && defined(__FMA__)
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
      return false;
#endif
    case Isa::kAvx512Vnni:
#ifdef CHATLOOM_HAVE_VNNI_PATH
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
      return false;
#endif
  }
  return false;
}

const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512Vnni ? "avx512_vnni" : isa == Isa::kAvx2 ? "avx2" : "scalar";
}

Isa parse_isa(const std::string& name) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512Vnni}) {
    if (name == isa_name(isa)) {
      TORCH_CHECK(cpu_has(isa), "the int8 matmul's ", name, " path is not available on this CPU or build");
      return isa;
    }
  }
  TORCH_CHECK(false, "unknown instruction set '", name, "' for the int8 matmul: use auto, avx512_vnni, avx2 or scalar");
  return Isa::kScalar;
}

Isa best_isa() {
  return cpu_has(Isa::kAvx512Vnni) ? Isa::kAvx512Vnni : cpu_has(Isa::kAvx2) ? Isa::kAvx2 : Isa::kScalar;
}

// "auto": CHATLOOM_KERNEL_ISA if set (read once), else the best path.
Isa resolve_isa(const std::string& requested) {
  if (!requested.empty() && requested != "auto") return parse_isa(requested);
  static const Isa chosen = [] {
    // The environment names a path of any kernel; only this kernel's own names apply here.
    const char* env = std::getenv("CHATLOOM_KERNEL_ISA");
    const std::string name = env ? env : "";
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512Vnni})
      if (name == isa_name(isa)) return parse_isa(name);
    return best_isa();
  }();
  return chosen;
}

}  // namespace

std::vector<std::string> int8_linear_isas() {
  std::vector<std::string> out;
  for (Isa isa : {Isa::kAvx512Vnni, Isa::kAvx2, Isa::kScalar})
    if (cpu_has(isa)) out.push_back(isa_name(isa));
  return out;
}

std::string int8_linear_isa(const std::string& requested) { return isa_name(resolve_isa(requested)); }

bool int8_linear_supported() {
  // The scalar path always runs, but only a SIMD path makes int8 activations worth their rounding.
  return cpu_has(Isa::kAvx2) || cpu_has(Isa::kAvx512Vnni);
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t out_features,
                          c10::optional<torch::Tensor> bias, const std::string& isa_request) {
  const Isa isa = resolve_isa(isa_request);
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
  // Uninitialized: every row is quantized into them before any tile reads them. A zero-fill would
  // run on one thread while the others wait.
  std::unique_ptr<int8_t[]> q(new int8_t[m_dim * k_dim]);
  std::unique_ptr<float[]> dx(new float[m_dim * nb]), sx(new float[m_dim * nb]);
  const float* xp = x.data_ptr<float>();
#ifdef CHATLOOM_HAVE_VNNI_PATH
  const bool vnni_tiles = isa == Isa::kAvx512Vnni && m_dim >= kVnniMinRows;
#else
  const bool vnni_tiles = false;
#endif
  // For tile_vnni_q8x: each row's block sums of its stored q, taken while the row is in cache (on
  // the thread that quantized it, not afterwards on one thread while the others wait).
  std::unique_ptr<int32_t[]> qsum(vnni_tiles && q8 ? new int32_t[m_dim * nb] : nullptr);
  chatloom_kernels::parallel_for(0, m_dim, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
#if defined(__AVX2__) && defined(__FMA__)
      if (isa != Isa::kScalar)
        quantize_row(xp + m * k_dim, k_dim, q.get() + m * k_dim, dx.get() + m * nb, sx.get() + m * nb);
      else
#endif
        quantize_row_scalar(xp + m * k_dim, k_dim, q.get() + m * k_dim, dx.get() + m * nb, sx.get() + m * nb);
      if (qsum)
        for (int64_t b = m * nb; b < (m + 1) * nb; ++b) {
          int32_t t = 0;
          for (int64_t k = 0; k < kBlock; ++k) t += q[b * kBlock + k];
          qsum[b] = t;
        }
    }
  });
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t panel_bytes = k_dim * (q8 ? 16 : 8);
  // Rows [m, m + r) against panel p, with R = r as a template argument.
  auto rows = [&](auto kind, int64_t r, int64_t m, int64_t p) {
    constexpr bool Q8 = decltype(kind)::value;
    const int64_t col = p * kPanel, ncols = std::min(kPanel, out_features - col);
    const int8_t* qm = q.get() + m * k_dim;
    const float *dm = dx.get() + m * nb, *sm = sx.get() + m * nb, *b = bp ? bp + col : nullptr;
    const uint8_t* c = cp + p * panel_bytes;
    const float* s = sp + p * nb * 2 * kPanel;
    float* o = op + m * out_features + col;
#define CHATLOOM_TILES(fn)                                                   \
  if (r == 3) fn<3, Q8>(qm, dm, sm, k_dim, c, s, b, o, out_features, ncols);      \
  else if (r == 2) fn<2, Q8>(qm, dm, sm, k_dim, c, s, b, o, out_features, ncols); \
  else fn<1, Q8>(qm, dm, sm, k_dim, c, s, b, o, out_features, ncols);
    switch (isa) {
#ifdef CHATLOOM_HAVE_VNNI_PATH
      case Isa::kAvx512Vnni: CHATLOOM_TILES(tile_vnni) break;
#endif
#if defined(__AVX2__) && defined(__FMA__)
      case Isa::kAvx2: CHATLOOM_TILES(tile) break;
#endif
      default: CHATLOOM_TILES(tile_scalar) break;
    }
#undef CHATLOOM_TILES
  };
#ifdef CHATLOOM_HAVE_VNNI_PATH
  // From about 12 rows, tiles of rows x pairs of panels; below that they lose: a step's matrices in turn
  // (their weights coming from memory, not cache) at 1 row took 3.2 against 2.3 ms, at 8 rows 5.6
  // against 5.2, while at 16 rows 7.0 against 9.1 and at 32 rows 11.3 against 14.6.
  if (vnni_tiles) {
    const int64_t scale_stride = nb * 2 * kPanel, pairs = (panels + kVnniPanels - 1) / kVnniPanels;
    for (int64_t m0 = 0; m0 < m_dim; m0 += kRowBlock) {
      const int64_t m1 = std::min(m_dim, m0 + kRowBlock);
      const int64_t grain = std::max<int64_t>(1, 200000 / (2 * (m1 - m0) * k_dim * kPanel * kVnniPanels));
      chatloom_kernels::parallel_for(0, pairs, grain, [&](int64_t begin, int64_t end) {
        for (int64_t pp = begin; pp < end; ++pp) {
          const int64_t p = pp * kVnniPanels, np = std::min<int64_t>(kVnniPanels, panels - p);
          const uint8_t* c = cp + p * panel_bytes;
          const float* s = sp + p * scale_stride;
          chatloom_kernels::for_each_row_tile(m0, m1, [&](int64_t m, int64_t r) {
            const int8_t* qm = q.get() + m * k_dim;
            const float *dm = dx.get() + m * nb, *sm = sx.get() + m * nb;
            float* o = op + m * out_features;
            auto run = [&](auto rows, auto pans) {
              constexpr int R = decltype(rows)::value, NP = decltype(pans)::value;
              if (q8)
                tile_vnni_q8x<R, NP>(qm, dm, qsum.get() + m * nb, k_dim, c, panel_bytes, s, scale_stride, bp, o,
                                     out_features, out_features, p * kPanel);
              else
                tile_vnni_q4x<R, NP>(qm, dm, sm, k_dim, c, panel_bytes, s, scale_stride, bp, o, out_features,
                                     out_features, p * kPanel);
            };
            auto with_rows = [&](auto pans) {
              switch (r) {
                case 6: run(std::integral_constant<int, (kVnniRows >= 6 ? 6 : 1)>{}, pans); break;
                case 5: run(std::integral_constant<int, (kVnniRows >= 5 ? 5 : 1)>{}, pans); break;
                case 4: run(std::integral_constant<int, (kVnniRows >= 4 ? 4 : 1)>{}, pans); break;
                case 3: run(std::integral_constant<int, 3>{}, pans); break;
                case 2: run(std::integral_constant<int, 2>{}, pans); break;
                default: run(std::integral_constant<int, 1>{}, pans); break;
              }
            };
            switch (np) {
              case 3: with_rows(std::integral_constant<int, (kVnniPanels >= 3 ? 3 : 1)>{}); break;
              case 2: with_rows(std::integral_constant<int, (kVnniPanels >= 2 ? 2 : 1)>{}); break;
              default: with_rows(std::integral_constant<int, 1>{}); break;
            }
          }, kVnniRows);
        }
      });
    }
    return out;
  }
#endif
  // Three rows per tile for 4-bit codes; two for 8-bit, whose dot products need more registers.
  const int64_t tile_rows = q8 ? 2 : kTileRows;
  for (int64_t m0 = 0; m0 < m_dim; m0 += kRowBlock) {
    const int64_t m1 = std::min(m_dim, m0 + kRowBlock);
    const int64_t grain = std::max<int64_t>(1, 200000 / (2 * (m1 - m0) * k_dim * kPanel));
    chatloom_kernels::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        for (int64_t m = m0; m < m1; m += tile_rows) {
          const int64_t r = std::min(tile_rows, m1 - m);
          if (q8) rows(std::true_type{}, r, m, p);
          else rows(std::false_type{}, r, m, p);
        }
    });
  }
  return out;
}
