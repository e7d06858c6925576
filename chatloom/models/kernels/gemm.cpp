// y = x @ W^T (+ bias) for float32, with W packed once at load time into panels of 16
// output features: packed[p, k, j] = W[16 p + j, k] (rows past the end are zero).
//
// Why not BLAS: MKL runs the shapes of a decode step (a few to a few dozen rows against
// a 576..3072-wide weight) at a fraction of this CPU's FMA peak, and repacks W on every
// call. Here a tile of up to 6 input rows x 16 outputs lives in 12 AVX registers while
// the panel streams through once; each output is one FMA chain over k in a fixed order,
// so a row's result does not depend on which other rows share the batch.
//
// On CPUs with AVX-512 the same tiles run with one 16-lane register per row instead of two
// 8-lane halves: each lane does exactly the AVX2 path's operations in the same order, so the
// results are bit-identical (exact mode's outputs do not change), with half the instructions.
// The `isa` argument ("auto", "avx512", "avx2"), else CHATLOOM_KERNEL_ISA, picks the path.
#include "kernels.h"
#include "panel_tile.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

using chatloom_kernels::kPanel;
using chatloom_kernels::kTileRows;
using chatloom_kernels::nibble_at;
using chatloom_kernels::ScalePtr;
using chatloom_kernels::for_each_row_tile;
using chatloom_kernels::with_tile_rows;
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
  chatloom_kernels::store_tile<R>(los, his, bias, out, ldo, ncols);
}

// Eight of a panel's block scales from element i, as float32.
inline __m256 load_scales8(ScalePtr s, int64_t i) {
  if (s.half) {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(s.p) + i)));
#else
    alignas(32) float f[8];
    for (int j = 0; j < 8; ++j) f[j] = s.at(i + j);
    return _mm256_load_ps(f);
#endif
  }
  return _mm256_loadu_ps(static_cast<const float*>(s.p) + i);
}

// A GGUF block-quantized panel's 16 weights at row k: the same arithmetic as gguf's
// dequantizer (d * code + m with the product exact), so every path sees identical values.
template <bool Q4>
inline void dequantize_row(const uint8_t* codes, int64_t k, __m256 d0, __m256 d1, __m256 m0, __m256 m1,
                           __m256& w0, __m256& w1) {
  __m256 lo, hi;
  if constexpr (Q4) {
    const __m256i* words = reinterpret_cast<const __m256i*>(codes + (k >> 3) * 64);
    const __m128i shift = _mm_cvtsi32_si128(4 * static_cast<int>(k & 7));
    const __m256i low4 = _mm256_set1_epi32(15);
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(_mm256_loadu_si256(words), shift), low4));
    hi = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(_mm256_loadu_si256(words + 1), shift), low4));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * kPanel));
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  }
  w0 = _mm256_fmadd_ps(lo, d0, m0);
  w1 = _mm256_fmadd_ps(hi, d1, m1);
}

// Up to 6 rows against a quantized panel, expanding each weight row in registers: with so
// few rows a decode step is bound by reading weights, and a float32 scratch round trip
// would cost more than the FMAs. Same FMA order as `tile`, so the same results.
template <int R, bool Q4>
inline void tile_quantized(const float* x, int64_t k_dim, const uint8_t* codes, ScalePtr scales,
                           const float* bias, float* out, int64_t ldo, int64_t ncols) {
  __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0;
  __m256 lo3 = lo0, hi3 = lo0, lo4 = lo0, hi4 = lo0, lo5 = lo0, hi5 = lo0;
  for (int64_t kb = 0; kb < k_dim / 32; ++kb) {
    const ScalePtr s = scales + kb * 2 * kPanel;
    const __m256 d0 = load_scales8(s, 0), d1 = load_scales8(s, 8);
    const __m256 m0 = load_scales8(s, 16), m1 = load_scales8(s, 24);
    for (int64_t k = kb * 32; k < (kb + 1) * 32; ++k) {
      __m256 w0, w1;
      dequantize_row<Q4>(codes, k, d0, d1, m0, m1, w0, w1);
      CHATLOOM_ROW(0) CHATLOOM_ROW(1) CHATLOOM_ROW(2) CHATLOOM_ROW(3) CHATLOOM_ROW(4) CHATLOOM_ROW(5)
    }
  }
  const __m256 los[6] = {lo0, lo1, lo2, lo3, lo4, lo5}, his[6] = {hi0, hi1, hi2, hi3, hi4, hi5};
  chatloom_kernels::store_tile<R>(los, his, bias, out, ldo, ncols);
}

// One input row (a decode step's shape) against NP panels at once. With a single row, each
// panel's outputs are one FMA chain per register, so the core would wait on the FMA's latency
// at every k; NP panels give NP independent chains. Every output's sum still runs over k in
// the same order as tile_quantized<1>, so the results are the same bits.
template <int NP, bool Q4>
inline void row_quantized(const float* x, int64_t k_dim, const uint8_t* codes, int64_t code_stride,
                          ScalePtr scales, int64_t scale_stride, __m256 (&lo)[NP], __m256 (&hi)[NP]) {
  for (int i = 0; i < NP; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < k_dim / 32; ++kb) {
    __m256 d0[NP], d1[NP], m0[NP], m1[NP];
    for (int i = 0; i < NP; ++i) {
      const ScalePtr s = scales + i * scale_stride + kb * 2 * kPanel;
      d0[i] = load_scales8(s, 0), d1[i] = load_scales8(s, 8);
      m0[i] = load_scales8(s, 16), m1[i] = load_scales8(s, 24);
    }
    for (int64_t k = kb * 32; k < (kb + 1) * 32; ++k) {
      const __m256 a = _mm256_broadcast_ss(x + k);
#pragma GCC unroll 8
      for (int i = 0; i < NP; ++i) {
        __m256 w0, w1;
        dequantize_row<Q4>(codes + i * code_stride, k, d0[i], d1[i], m0[i], m1[i], w0, w1);
        lo[i] = _mm256_fmadd_ps(a, w0, lo[i]);
        hi[i] = _mm256_fmadd_ps(a, w1, hi[i]);
      }
    }
  }
}

// -- the AVX-512 tiles: lanes 0-7 are the AVX2 path's lo, 8-15 its hi, operation for operation --
#define CHATLOOM_HAVE_WIDE_PATH 1

// Keeps a loaded weight vector in a register. Left to itself GCC folds the load into every FMA that
// uses it (vfmadd231ps with a memory operand) for tiles of up to 4 rows, so each weight row is loaded
// once per row: on Zen 4 such a tile ran at 57% of the FMA peak in cache, against 92-100% with one
// load per weight row (the same FMAs in the same order, so the same bits).
CHATLOOM_WIDE inline void in_register(__m512& v) { __asm__("" : "+v"(v)); }

template <int R>
CHATLOOM_WIDE inline void store_tile16(const __m512 (&acc)[R], const float* bias, float* out, int64_t ldo,
                                       int64_t ncols) {
  const __mmask16 keep = (__mmask16)((1u << ncols) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo, keep, _mm512_add_ps(acc[r], bv));
}

template <int R>
CHATLOOM_WIDE void tile16(const float* x, int64_t k_dim, const float* panel, const float* bias, float* out,
                          int64_t ldo, int64_t ncols) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    __m512 w = _mm512_loadu_ps(panel + k * kPanel);
    in_register(w);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k_dim + k]), w, acc[r]);
  }
  store_tile16<R>(acc, bias, out, ldo, ncols);
}

// Two panels at once (the first always full: only the last panel of a layer is partial). A
// tile of 6 rows against one panel is 6 FMA chains, fewer than the core needs in flight to
// hide the FMA's latency; two panels make 12. Each output's chain is tile16's, so the same bits.
template <int R>
CHATLOOM_WIDE void tile16x2(const float* x, int64_t k_dim, const float* pa, const float* pb, const float* bias,
                            float* out, int64_t ldo, int64_t ncols_b) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    __m512 wa = _mm512_loadu_ps(pa + k * kPanel), wb = _mm512_loadu_ps(pb + k * kPanel);
    in_register(wa);
    in_register(wb);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k_dim + k]);
      a0[r] = _mm512_fmadd_ps(xv, wa, a0[r]);
      a1[r] = _mm512_fmadd_ps(xv, wb, a1[r]);
    }
  }
  store_tile16<R>(a0, bias, out, ldo, kPanel);
  store_tile16<R>(a1, bias ? bias + kPanel : nullptr, out + kPanel, ldo, ncols_b);
}

using chatloom_kernels::dequantize_panel16;
using chatloom_kernels::load_scales16;

// How far ahead (bytes, in each panel's code stream) the tiles prefetch: 6 lines of 4-bit codes, 12 of
// 8-bit ones (the same depths ahead), and each panel's scales as far ahead in depth. At batch 1 a
// task's 4 panels are 8 short streams (a panel's codes are 4.6 KB at K = 576) that the hardware
// prefetcher picks up late; fetching ahead made a decode step's matmul phases 3-7% faster
// (DecodeStack.profile(), 12 alternated rounds; 512 and 1024 bytes gained less).
constexpr int64_t kCodePrefetch4 = 384, kCodePrefetch8 = 768;

// R rows (a small batch, or one sequence's proposed tokens being verified) against NP panels
// at once. One panel at a time gives a tile of R < 6 rows only R FMA chains, so the core
// waits on the FMA's latency at every k; NP panels give R x NP chains, and each weight row
// is still expanded once for all R rows. Every output is one FMA chain over k in the order of
// tile<R> and of the AVX2 row kernel (lanes 0-7 their lo, 8-15 their hi), so the results are
// the same bits on every path; R = 1 is a single row's kernel.
//
// 4-bit codes: one 64-byte load holds a panel's codes for 8 depths (lane j: feature j, 4 bits a
// depth). vpermps reads only the low 4 bits of each index lane, so looking the lanes up in a table
// of 0..15 gives depth t's codes as floats, and a shift by 4 moves to the next depth: two vector
// operations per 16 codes, where unpacking bytes took four.
template <int R, int NP, bool Q4>
CHATLOOM_WIDE void tile_panels16(const float* x, int64_t k_dim, const uint8_t* codes, int64_t code_stride,
                                 ScalePtr scales, int64_t scale_stride, const float* bias, float* out,
                                 int64_t ldo, int64_t out_features, int64_t col0) {
  __m512 acc[NP][R];
#pragma GCC unroll 4
  for (int i = 0; i < NP; ++i)
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  const __m512 nibble_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t kb = 0; kb < k_dim / 32; ++kb) {
    __m512 d[NP], m[NP];
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i) {
      const ScalePtr s = scales + i * scale_stride + kb * 2 * kPanel;
      d[i] = load_scales16(s, 0), m[i] = load_scales16(s, kPanel);
    }
    // A block of 32 depths is 256 (4-bit) or 512 (8-bit) code bytes and 64 (float16) or 128 scale bytes.
    constexpr int64_t scale_ahead = Q4 ? kCodePrefetch4 / 4 : kCodePrefetch8 / 8;
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i) {
      const ScalePtr s = scales + i * scale_stride + kb * 2 * kPanel;
      _mm_prefetch(static_cast<const char*>(s.p) + scale_ahead * (s.half ? 1 : 2), _MM_HINT_T0);
    }
    if constexpr (Q4) {
      for (int64_t k8 = kb * 32; k8 < (kb + 1) * 32; k8 += 8) {
#pragma GCC unroll 4
        for (int i = 0; i < NP; ++i)
          _mm_prefetch(reinterpret_cast<const char*>(codes + i * code_stride + k8 * 8) + kCodePrefetch4, _MM_HINT_T0);
        __m512i v[NP];
#pragma GCC unroll 4
        for (int i = 0; i < NP; ++i) v[i] = _mm512_loadu_si512(codes + i * code_stride + k8 * 8);
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          __m512 w[NP];
#pragma GCC unroll 4
          for (int i = 0; i < NP; ++i) {
            w[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v[i], nibble_values), d[i], m[i]);
            v[i] = _mm512_srli_epi32(v[i], 4);
          }
#pragma GCC unroll 6
          for (int r = 0; r < R; ++r) {
            const __m512 a = _mm512_set1_ps(x[r * k_dim + k8 + t]);
#pragma GCC unroll 4
            for (int i = 0; i < NP; ++i) acc[i][r] = _mm512_fmadd_ps(a, w[i], acc[i][r]);
          }
        }
      }
    } else {
      for (int64_t k = kb * 32; k < (kb + 1) * 32; ++k) {
        if (k % 4 == 0) {  // one 64-byte line holds 4 depths of a panel's 8-bit codes
#pragma GCC unroll 4
          for (int i = 0; i < NP; ++i)
            _mm_prefetch(reinterpret_cast<const char*>(codes + i * code_stride + k * kPanel) + kCodePrefetch8, _MM_HINT_T0);
        }
        __m512 w[NP];
#pragma GCC unroll 4
        for (int i = 0; i < NP; ++i) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * code_stride + k * kPanel));
          w[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d[i], m[i]);
        }
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
          const __m512 a = _mm512_set1_ps(x[r * k_dim + k]);
#pragma GCC unroll 4
          for (int i = 0; i < NP; ++i) acc[i][r] = _mm512_fmadd_ps(a, w[i], acc[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < NP; ++i) {
    const int64_t col = col0 + i * kPanel;
    store_tile16<R>(acc[i], bias ? bias + col : nullptr, out + col, ldo, std::min(kPanel, out_features - col));
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

// All tiles of one panel for rows [m0, m1); `wide`: the AVX-512 tiles.
inline void panel_rows(const float* x, int64_t k_dim, const float* panel, const float* bias,
                       float* out, int64_t ldo, int64_t ncols, int64_t m0, int64_t m1, bool wide = false) {
#ifdef CHATLOOM_HAVE_WIDE_PATH
  if (wide) {
    for_each_row_tile(m0, m1, [&](int64_t m, int64_t tile_rows) {
      const float* xs = x + m * k_dim;
      float* os = out + m * ldo;
      with_tile_rows(tile_rows, [&](auto r) {
        tile16<decltype(r)::value>(xs, k_dim, panel, bias, os, ldo, ncols);
      });
    });
    return;
  }
#endif
  for_each_row_tile(m0, m1, [&](int64_t m, int64_t tile_rows) {
    const float* xs = x + m * k_dim;
    float* os = out + m * ldo;
    with_tile_rows(tile_rows, [&](auto r) {
      tile<decltype(r)::value>(xs, k_dim, panel, bias, os, ldo, ncols);
    });
  });
}

#ifdef CHATLOOM_HAVE_WIDE_PATH
// All tiles of two neighbouring panels (pb null: pa alone) for rows [m0, m1), AVX-512 only.
inline void panel_pair_rows(const float* x, int64_t k_dim, const float* pa, const float* pb, const float* bias,
                            float* out, int64_t ldo, int64_t ncols_b, int64_t m0, int64_t m1) {
  if (pb == nullptr) return panel_rows(x, k_dim, pa, bias, out, ldo, ncols_b, m0, m1, true);
  for_each_row_tile(m0, m1, [&](int64_t m, int64_t tile_rows) {
    const float* xs = x + m * k_dim;
    float* os = out + m * ldo;
    with_tile_rows(tile_rows, [&](auto r) {
      tile16x2<decltype(r)::value>(xs, k_dim, pa, pb, bias, os, ldo, ncols_b);
    });
  });
}
#endif

// "avx512" (true) or "avx2" (false): the argument, else CHATLOOM_KERNEL_ISA, else the best there is.
bool has_wide_path() {
#ifdef CHATLOOM_HAVE_WIDE_PATH
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

bool use_wide(const std::string& requested) {
  auto parse = [](const std::string& name) {
    if (name == "avx2") return false;
    TORCH_CHECK(name == "avx512", "unknown instruction set '", name, "' for the float32 matmul: use auto, avx512 or avx2");
    TORCH_CHECK(has_wide_path(), "the float32 matmul's avx512 path is not available on this CPU or build");
    return true;
  };
  if (!requested.empty() && requested != "auto") return parse(requested);
  static const bool chosen = [&] {
    // The environment names a path of any kernel; only this kernel's own names apply here.
    const char* env = std::getenv("CHATLOOM_KERNEL_ISA");
    const std::string name = env ? env : "";
    return name == "avx2" || name == "avx512" ? parse(name) : has_wide_path();
  }();
  return chosen;
}

// Quantized panels, for GGUF's Q4_1 and Q8_0 weights (blocks of 32 along K): the
// weights stay 4 or 8 bits in memory, so a decode step that is bound by reading weights
// reads 6x (Q4_1) or 4x (Q8_0) fewer bytes. Each panel is expanded to float32 in a
// per-thread scratch right before its tiles run, with the same arithmetic as gguf's
// dequantizer (w = d * code + m, the product exact in float32), so results are
// bit-identical to the float32 packed path on the dequantized weights.
//   4-bit codes [P, K, 8] uint8: 8 depths of a panel in 16 uint32 words (see nibble_at).
//   8-bit codes [P, K, 16] int8.
//   scales [P, K / 32, 2, 16] float32 or float16: d for the panel's 16 rows, then m (zero for Q8_0).
constexpr int64_t kQuantBlock = 32;

template <bool Q4>
void dequantize_panel(const uint8_t* codes, ScalePtr scales, int64_t k_dim, float* dst) {
  for (int64_t kb = 0; kb < k_dim / kQuantBlock; ++kb) {
    const ScalePtr s = scales + kb * 2 * kPanel;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 d0 = load_scales8(s, 0), d1 = load_scales8(s, 8);
    const __m256 m0 = load_scales8(s, 16), m1 = load_scales8(s, 24);
    for (int64_t k = kb * kQuantBlock; k < (kb + 1) * kQuantBlock; ++k) {
      __m256 w0, w1;
      dequantize_row<Q4>(codes, k, d0, d1, m0, m1, w0, w1);
      _mm256_storeu_ps(dst + k * kPanel, w0);
      _mm256_storeu_ps(dst + k * kPanel + 8, w1);
    }
#else
    for (int64_t k = kb * kQuantBlock; k < (kb + 1) * kQuantBlock; ++k)
      for (int64_t j = 0; j < kPanel; ++j) {
        float code;
        if constexpr (Q4) {
          code = (float)nibble_at(codes, k, j);
        } else {
          code = (float)reinterpret_cast<const int8_t*>(codes)[k * kPanel + j];
        }
        dst[k * kPanel + j] = std::fma(code, s.at(j), s.at(kPanel + j));
      }
#endif
  }
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr int kRowPanels = 4;  // panels a single row runs at once: that many independent FMA chains

// Stores NP panels' outputs for one row (the last panel may hold fewer than 16 features).
template <int NP, bool Q4>
void row_group(const float* x, int64_t k_dim, const uint8_t* codes, int64_t code_stride, ScalePtr scales,
               int64_t scale_stride, const float* bias, float* out, int64_t out_features, int64_t col0) {
  __m256 lo[NP], hi[NP];
  row_quantized<NP, Q4>(x, k_dim, codes, code_stride, scales, scale_stride, lo, hi);
  for (int i = 0; i < NP; ++i) {
    const int64_t col = col0 + i * kPanel;
    const __m256 l[1] = {lo[i]}, h[1] = {hi[i]};
    chatloom_kernels::store_tile<1>(l, h, bias ? bias + col : nullptr, out + col, out_features,
                                    std::min(kPanel, out_features - col));
  }
}

template <bool Q4>
void row_group_any(int64_t np, const float* x, int64_t k_dim, const uint8_t* codes, int64_t code_stride,
                   ScalePtr scales, int64_t scale_stride, const float* bias, float* out, int64_t out_features,
                   int64_t col0) {
  switch (np) {
    case 4: row_group<4, Q4>(x, k_dim, codes, code_stride, scales, scale_stride, bias, out, out_features, col0); return;
    case 3: row_group<3, Q4>(x, k_dim, codes, code_stride, scales, scale_stride, bias, out, out_features, col0); return;
    case 2: row_group<2, Q4>(x, k_dim, codes, code_stride, scales, scale_stride, bias, out, out_features, col0); return;
    default: row_group<1, Q4>(x, k_dim, codes, code_stride, scales, scale_stride, bias, out, out_features, col0); return;
  }
}

// x [1, K] against every quantized panel with the AVX2 row kernel, kRowPanels panels per task
// (see row_quantized).
torch::Tensor single_row_quantized(const torch::Tensor& x, const uint8_t* codes, ScalePtr scales,
                                   int64_t code_bytes, int64_t panels, int64_t out_features, const float* bias,
                                   bool q4) {
  const int64_t k_dim = x.size(1);
  auto out = torch::empty({1, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t code_stride = k_dim * code_bytes, scale_stride = (k_dim / kQuantBlock) * 2 * kPanel;
  const int64_t groups = (panels + kRowPanels - 1) / kRowPanels;
  const int64_t grain = std::max<int64_t>(1, 200000 / (2 * k_dim * kPanel * kRowPanels));
  chatloom_kernels::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * kRowPanels, np = std::min<int64_t>(kRowPanels, panels - p0);
      const uint8_t* c = codes + p0 * code_stride;
      const ScalePtr s = scales + p0 * scale_stride;
      if (q4) row_group_any<true>(np, xp, k_dim, c, code_stride, s, scale_stride, bias, op, out_features, p0 * kPanel);
      else row_group_any<false>(np, xp, k_dim, c, code_stride, s, scale_stride, bias, op, out_features, p0 * kPanel);
    }
  });
  return out;
}

#ifdef CHATLOOM_HAVE_WIDE_PATH
// Panels per call for a tile of R rows: enough chains to cover the FMA latency (R x NP >= 8)
// while the accumulators, expanded weights and scales stay within the 32 vector registers: up to 4
// rows take 4 panels (16 chains, 31 registers), 5-6 rows 3 (measured 10-14% and 4-7% faster than 2).
constexpr int panels_for_rows(int64_t rows) { return rows <= 4 ? 4 : 3; }

template <int R, bool Q4>
CHATLOOM_WIDE void tile_rows16(int64_t np, const float* x, int64_t k_dim, const uint8_t* codes, int64_t code_stride,
                               ScalePtr scales, int64_t scale_stride, const float* bias, float* out, int64_t ldo,
                               int64_t out_features, int64_t col0) {
  constexpr int kMax = panels_for_rows(R);
  for (int64_t i = 0; i < np;) {
    const int64_t n = std::min<int64_t>(kMax, np - i);
    const uint8_t* c = codes + i * code_stride;
    const ScalePtr s = scales + i * scale_stride;
    const int64_t col = col0 + i * kPanel;
    switch (n) {
      case 4: tile_panels16<R, (kMax >= 4 ? 4 : 1), Q4>(x, k_dim, c, code_stride, s, scale_stride, bias, out, ldo, out_features, col); break;
      case 3: tile_panels16<R, (kMax >= 3 ? 3 : 1), Q4>(x, k_dim, c, code_stride, s, scale_stride, bias, out, ldo, out_features, col); break;
      case 2: tile_panels16<R, 2, Q4>(x, k_dim, c, code_stride, s, scale_stride, bias, out, ldo, out_features, col); break;
      default: tile_panels16<R, 1, Q4>(x, k_dim, c, code_stride, s, scale_stride, bias, out, ldo, out_features, col); break;
    }
    i += n;
  }
}

// Rows x [M, K] (M up to two tiles of 6 rows) against the kRowPanels quantized panels of group g, on
// AVX-512: each tile of rows runs against as many of them at once as fit.
CHATLOOM_WIDE void quantized_group16(const float* xp, int64_t m_dim, int64_t k_dim, const uint8_t* codes,
                                     int64_t code_bytes, ScalePtr scales, int64_t panels, int64_t out_features,
                                     const float* bias, bool q4, float* op, int64_t g) {
  const int64_t code_stride = k_dim * code_bytes, scale_stride = (k_dim / kQuantBlock) * 2 * kPanel;
  const int64_t p0 = g * kRowPanels, np = std::min<int64_t>(kRowPanels, panels - p0);
  const uint8_t* c = codes + p0 * code_stride;
  const ScalePtr s = scales + p0 * scale_stride;
  for_each_row_tile(0, m_dim, [&](int64_t m, int64_t tile_rows) {
    const float* xm = xp + m * k_dim;
    float* om = op + m * out_features;
    with_tile_rows(tile_rows, [&](auto r) {
      constexpr int R = decltype(r)::value;
      if (q4) tile_rows16<R, true>(np, xm, k_dim, c, code_stride, s, scale_stride, bias, om, out_features, out_features, p0 * kPanel);
      else tile_rows16<R, false>(np, xm, k_dim, c, code_stride, s, scale_stride, bias, om, out_features, out_features, p0 * kPanel);
    });
  });
}

// x [M, K] (M up to two tiles of 6 rows) on AVX-512 against every quantized panel, kRowPanels panels per
// task (quantized_group16).
torch::Tensor few_rows_quantized16(const torch::Tensor& x, const uint8_t* codes, ScalePtr scales,
                                   int64_t code_bytes, int64_t panels, int64_t out_features, const float* bias,
                                   bool q4) {
  const int64_t m_dim = x.size(0), k_dim = x.size(1);
  auto out = torch::empty({m_dim, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t code_stride = k_dim * code_bytes, scale_stride = (k_dim / kQuantBlock) * 2 * kPanel;
  const int64_t groups = (panels + kRowPanels - 1) / kRowPanels;
  const int64_t grain = std::max<int64_t>(1, 200000 / (2 * m_dim * k_dim * kPanel * kRowPanels));
  chatloom_kernels::parallel_for_dynamic(groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      quantized_group16(xp, m_dim, k_dim, codes, code_bytes, scales, panels, out_features, bias, q4, op, g);
  });
  return out;
}
#endif
#endif

// Runs `work(p, m0, m1, x, out, scratch)` for every (row block, item) pair, items split
// across threads: it writes rows [m0, m1) of item p's output columns (an item is
// `panels_per_item` panels of 16; `panels` counts items). `scratch` holds one item's float32
// panels per thread when `needs_scratch`, uninitialized: the work expands panels into it before
// reading them (zero-filling it, up to 196 KB a call, took 1-2% of a 16- or 32-row matmul).
template <typename PanelWork>
torch::Tensor run_panels(torch::Tensor x, int64_t panels, int64_t out_features, bool needs_scratch,
                         PanelWork work, int64_t panels_per_item = 1) {
  const int64_t m_dim = x.size(0), k_dim = x.size(1);
  auto out = torch::empty({m_dim, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < m_dim; m0 += kRowBlock) {
    const int64_t m1 = std::min(m_dim, m0 + kRowBlock);
    // Enough panels per thread that a chunk is worth waking a thread for.
    const int64_t flops_per_item = 2 * (m1 - m0) * k_dim * kPanel * panels_per_item;
    const int64_t grain = std::max<int64_t>(1, 200000 / flops_per_item);
    chatloom_kernels::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      std::unique_ptr<float[]> scratch(needs_scratch ? new float[k_dim * kPanel * panels_per_item] : nullptr);
      for (int64_t p = begin; p < end; ++p) work(p, m0, m1, xp, op, scratch.get());
    });
  }
  return out;
}

const float* checked_bias(const c10::optional<torch::Tensor>& bias, int64_t out_features, torch::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->contiguous();
  TORCH_CHECK(keep.scalar_type() == torch::kFloat32 && keep.numel() == out_features, "bias shape");
  return keep.data_ptr<float>();
}

void check_input(const torch::Tensor& x, int64_t k_dim, int64_t panels, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x.size(1) == k_dim, "inner dimensions differ: ", x.size(1), " vs ", k_dim);
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features does not match the packed panels");
}

}  // namespace

void float_panel_pair_rows(const float* x, int64_t k_dim, const float* pa, const float* pb, const float* bias,
                           float* out, int64_t ldo, int64_t ncols_b, int64_t m0, int64_t m1) {
#ifdef CHATLOOM_HAVE_WIDE_PATH
  if (use_wide("auto")) return panel_pair_rows(x, k_dim, pa, pb, bias, out, ldo, ncols_b, m0, m1);
#endif
  panel_rows(x, k_dim, pa, bias, out, ldo, pb ? kPanel : ncols_b, m0, m1);
  if (pb) panel_rows(x, k_dim, pb, bias ? bias + kPanel : nullptr, out + kPanel, ldo, ncols_b, m0, m1);
}

std::vector<std::string> float_linear_isas() {
  std::vector<std::string> out;
  if (has_wide_path()) out.emplace_back("avx512");
#if defined(__AVX2__) && defined(__FMA__)
  out.emplace_back("avx2");
#endif
  return out;
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                            c10::optional<torch::Tensor> bias, const std::string& isa) {
  const bool wide = use_wide(isa);
  TORCH_CHECK(packed.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed must be contiguous [P, K, 16]");
  check_input(x, packed.size(1), packed.size(0), out_features);
  torch::Tensor keep;
  const float* b = checked_bias(bias, out_features, keep);
  const float* wp = packed.data_ptr<float>();
  const int64_t k_dim = packed.size(1);
#ifdef CHATLOOM_HAVE_WIDE_PATH
  if (wide) {  // panels in pairs (see tile16x2)
    const int64_t panels = packed.size(0);
    return run_panels(x.contiguous(), (panels + 1) / 2, out_features, false,
                      [&](int64_t g, int64_t m0, int64_t m1, const float* xp, float* op, float*) {
                        const int64_t p = 2 * g, col = p * kPanel;
                        const float* pb = p + 1 < panels ? wp + (p + 1) * k_dim * kPanel : nullptr;
                        const int64_t ncols_b = std::min(kPanel, out_features - col - (pb ? kPanel : 0));
                        panel_pair_rows(xp, k_dim, wp + p * k_dim * kPanel, pb, b ? b + col : nullptr, op + col,
                                        out_features, ncols_b, m0, m1);
                      }, 2);
  }
#endif
  return run_panels(x.contiguous(), packed.size(0), out_features, false,
                    [&](int64_t p, int64_t m0, int64_t m1, const float* xp, float* op, float*) {
                      const int64_t col = p * kPanel;
                      panel_rows(xp, k_dim, wp + p * k_dim * kPanel, b ? b + col : nullptr, op + col, out_features,
                                 std::min(kPanel, out_features - col), m0, m1);
                    });
}

torch::Tensor quantized_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t out_features,
                               c10::optional<torch::Tensor> bias, const std::string& isa) {
  const bool wide = use_wide(isa);
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && (codes.size(2) == 8 || codes.size(2) == kPanel),
              "codes must be contiguous [P, K, 8] (Q4_1) or [P, K, 16] (Q8_0)");
  const bool q4 = codes.size(2) == 8;
  TORCH_CHECK(codes.scalar_type() == (q4 ? torch::kUInt8 : torch::kInt8), "codes dtype");
  const int64_t panels = codes.size(0), k_dim = codes.size(1);
  TORCH_CHECK(k_dim % kQuantBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK((scales.scalar_type() == torch::kFloat32 || scales.scalar_type() == torch::kFloat16) &&
              scales.is_contiguous() && scales.sizes() == torch::IntArrayRef({panels, k_dim / kQuantBlock, 2, kPanel}),
              "scales must be contiguous float32 or float16 [P, K / 32, 2, 16]");
  check_input(x, k_dim, panels, out_features);
  torch::Tensor keep;
  const float* b = checked_bias(bias, out_features, keep);
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const ScalePtr sp{scales.data_ptr(), scales.scalar_type() == torch::kFloat16};
  const int64_t code_bytes = codes.size(2);
  // No rows, no work (the few-rows path sizes its thread grain by the row count).
  if (x.size(0) == 0) return torch::empty({0, out_features}, x.options());
  // Up to two tiles of rows, expanding each weight row in registers (twice at most) beats
  // the scratch panel's store and reload.
#if defined(__AVX2__) && defined(__FMA__)
  const bool few_rows = x.size(0) <= 2 * kTileRows;
#else
  const bool few_rows = false;
#endif
#ifdef CHATLOOM_HAVE_WIDE_PATH
  // One row of 4-bit codes takes the AVX2 row kernel only when asked for by name. Both cores we run on
  // are faster with the AVX-512 kernel now: Intel 4.3 against 4.8 ms for a SmolLM2 step's 121 matrices,
  // AMD Zen 4 (512-bit instructions as two 256-bit halves) 2.1 against 3.1 ms. Same bits either way.
  // Otherwise up to 12 rows run every row tile against several panels at once.
  const bool avx2_row = x.size(0) == 1 && q4 && isa == "avx2";
  if (wide && few_rows && !avx2_row)
    return few_rows_quantized16(x.contiguous(), cp, sp, code_bytes, panels, out_features, b, q4);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (x.size(0) == 1)
    return single_row_quantized(x.contiguous(), cp, sp, code_bytes, panels, out_features, b, q4);
#endif
#ifdef CHATLOOM_HAVE_WIDE_PATH
  if (wide) {  // many rows: panels in pairs, each expanded once into the scratch (see tile16x2)
    const int64_t scale_stride = (k_dim / kQuantBlock) * 2 * kPanel;
    return run_panels(x.contiguous(), (panels + 1) / 2, out_features, true,
                      [&](int64_t g, int64_t m0, int64_t m1, const float* xp, float* op, float* scratch) {
      const int64_t p = 2 * g, col = p * kPanel;
      const bool pair = p + 1 < panels;
      for (int64_t i = 0; i < (pair ? 2 : 1); ++i) {
        const uint8_t* c = cp + (p + i) * k_dim * code_bytes;
        const ScalePtr s = sp + (p + i) * scale_stride;
        if (q4) dequantize_panel16<true>(c, s, k_dim, scratch + i * k_dim * kPanel);
        else dequantize_panel16<false>(c, s, k_dim, scratch + i * k_dim * kPanel);
      }
      const int64_t ncols_b = std::min(kPanel, out_features - col - (pair ? kPanel : 0));
      panel_pair_rows(xp, k_dim, scratch, pair ? scratch + k_dim * kPanel : nullptr, b ? b + col : nullptr, op + col,
                      out_features, ncols_b, m0, m1);
    }, 2);
  }
#endif
  return run_panels(x.contiguous(), panels, out_features, !few_rows,
                    [&](int64_t p, int64_t m0, int64_t m1, const float* xp, float* op, float* scratch) {
    const uint8_t* c = cp + p * k_dim * code_bytes;
    const ScalePtr s = sp + p * (k_dim / kQuantBlock) * 2 * kPanel;
    const int64_t col = p * kPanel, ncols = std::min(kPanel, out_features - col);
    const float* bp = b ? b + col : nullptr;
#if defined(__AVX2__) && defined(__FMA__)
    if (few_rows) {
      for_each_row_tile(m0, m1, [&](int64_t m, int64_t tile_rows) {
        const float* xm = xp + m * k_dim;
        float* om = op + m * out_features + col;
        with_tile_rows(tile_rows, [&](auto r) {
          constexpr int R = decltype(r)::value;
          if (q4) tile_quantized<R, true>(xm, k_dim, c, s, bp, om, out_features, ncols);
          else tile_quantized<R, false>(xm, k_dim, c, s, bp, om, out_features, ncols);
        });
      });
      return;
    }
#endif
    if (q4) dequantize_panel<true>(c, s, k_dim, scratch);
    else dequantize_panel<false>(c, s, k_dim, scratch);
    panel_rows(xp, k_dim, scratch, bp, op + col, out_features, ncols, m0, m1);
  });
}

// -- the few-row quantized matmul as tasks, for callers that split the work themselves --
QuantizedPanels quantized_panels(const torch::Tensor& codes, const torch::Tensor& scales,
                                 const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && (codes.size(2) == 8 || codes.size(2) == kPanel),
              "codes must be contiguous [P, K, 8] (4-bit) or [P, K, 16] (8-bit)");
  QuantizedPanels w;
  w.q4 = codes.size(2) == 8;
  TORCH_CHECK(codes.scalar_type() == (w.q4 ? torch::kUInt8 : torch::kInt8), "codes dtype");
  w.panels = codes.size(0);
  w.k_dim = codes.size(1);
  TORCH_CHECK(w.k_dim % kQuantBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK((scales.scalar_type() == torch::kFloat32 || scales.scalar_type() == torch::kFloat16) &&
              scales.is_contiguous() && scales.sizes() == torch::IntArrayRef({w.panels, w.k_dim / kQuantBlock, 2, kPanel}),
              "scales must be contiguous float32 or float16 [P, K / 32, 2, 16]");
  TORCH_CHECK(out_features > (w.panels - 1) * kPanel && out_features <= w.panels * kPanel,
              "out_features does not match the packed panels");
  w.codes = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  w.scales = scales.data_ptr();
  w.half_scales = scales.scalar_type() == torch::kFloat16;
  w.out_features = out_features;
  w.bias = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == out_features,
                "bias shape");
    w.bias = bias->data_ptr<float>();
  }
  return w;
}

bool quantized_tasks_supported() {
#ifdef CHATLOOM_HAVE_WIDE_PATH
  return use_wide("auto");
#else
  return false;
#endif
}

int64_t quantized_tasks(const QuantizedPanels& w) {
  static_assert(kRowPanels * kPanel == kTaskFeatures, "a task is kRowPanels panels");
  return (w.panels + kRowPanels - 1) / kRowPanels;
}

void run_quantized_task(const QuantizedPanels& w, const float* x, int64_t m_dim, float* out, int64_t task,
                        int64_t x_version) {
  if (w.kq_offsets != nullptr) return run_kquant_task(w, x, m_dim, out, task, x_version);
#ifdef CHATLOOM_HAVE_WIDE_PATH
  quantized_group16(x, m_dim, w.k_dim, w.codes, w.q4 ? 8 : kPanel, ScalePtr{w.scales, w.half_scales}, w.panels,
                    w.out_features, w.bias, w.q4, out, task);
#else
  TORCH_CHECK(false, "the quantized matmul's task path needs AVX-512");
#endif
}
