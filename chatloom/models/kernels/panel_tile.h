// What the matmul kernels (gemm.cpp, int8_gemm.cpp, bf16_gemm.cpp, kquant.cpp) share: outputs come in
// panels of 16 features, a tile of rows x 16 accumulates in pairs of AVX registers, and the float
// kernels' tiles take their row count as a template argument.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <omp.h>
#include "work_pool.h"
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

namespace chatloom_kernels {

constexpr int64_t kPanel = 16;  // output features per panel
constexpr int64_t kTileRows = 6;  // rows per tile of the float32 and bf16 kernels

// Block scales of quantized panels, float32 or float16 (see to_float_kernel_layout in
// packed_linear.py: float16 only where every value is exactly one, so widening loses nothing).
// Arithmetic is in elements, as on a pointer.
struct ScalePtr {
  const void* p;
  bool half;
  ScalePtr operator+(int64_t n) const {
    return {half ? static_cast<const void*>(static_cast<const uint16_t*>(p) + n)
                 : static_cast<const void*>(static_cast<const float*>(p) + n), half};
  }
  float at(int64_t i) const {
    return half ? c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(p)[i])
                : static_cast<const float*>(p)[i];
  }
};

// 4-bit codes: each 8 depths of a panel are 16 uint32 words, word j holding feature j's codes at
// depths 8g..8g+7, depth 8g+t in bits 4t..4t+3 (to_float_kernel_layout).
inline int nibble_at(const uint8_t* codes, int64_t k, int64_t j) {
  uint32_t word;
  std::memcpy(&word, codes + (k >> 3) * 64 + 4 * j, sizeof(word));
  return (word >> (4 * (k & 7))) & 15;
}

// Calls tile(std::integral_constant<int, R>{}) with R = rows (1 to kTileRows): each row count is its
// own instantiation of a tile kernel, so a run of rows is dispatched on its length once.
template <typename Tile>
inline void with_tile_rows(int64_t rows, Tile&& tile) {
  switch (rows) {
    case 6: tile(std::integral_constant<int, 6>{}); break;
    case 5: tile(std::integral_constant<int, 5>{}); break;
    case 4: tile(std::integral_constant<int, 4>{}); break;
    case 3: tile(std::integral_constant<int, 3>{}); break;
    case 2: tile(std::integral_constant<int, 2>{}); break;
    default: tile(std::integral_constant<int, 1>{}); break;
  }
}

// Calls tile(m, rows) for the tiles of rows [m0, m1): as few as hold at most max_rows rows each, their
// sizes within one of each other. 32 rows go as 6 + 6 + 5 + 5 + 5 + 5, not 6 + 6 + 6 + 6 + 6 + 2,
// whose last tile has too few multiply-add chains to hide their latency: a 20- to 32-row matmul ran
// 2-10% faster in float32, 1-4% in the int8 VNNI tiles. A row's outputs do not depend on which tile
// holds it, so the bits do not change.
template <typename Tile>
inline void for_each_row_tile(int64_t m0, int64_t m1, Tile&& tile, int64_t max_rows = kTileRows) {
  const int64_t tiles = (m1 - m0 + max_rows - 1) / max_rows;
  for (int64_t i = 0, m = m0; i < tiles; ++i) {
    const int64_t rows = (m1 - m + (tiles - i) - 1) / (tiles - i);
    tile(m, rows);
    m += rows;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Adds the bias (when given) and writes R rows of a tile: features 0-7 of row r are in
// lo[r], 8-15 in hi[r]; only `ncols` (< 16 at the last panel) are stored.
template <int R, int N>
inline void store_tile(const __m256 (&lo)[N], const __m256 (&hi)[N], const float* bias, float* out,
                       int64_t ldo, int64_t ncols) {
  static_assert(R <= N, "more rows than accumulators");
  alignas(32) float bb[kPanel] = {0};
  if (bias != nullptr) std::copy(bias, bias + ncols, bb);
  const __m256 b0 = _mm256_load_ps(bb), b1 = _mm256_load_ps(bb + 8);
  alignas(32) float buf[kPanel];
  for (int r = 0; r < R; ++r) {
    const __m256 a = _mm256_add_ps(lo[r], b0), b = _mm256_add_ps(hi[r], b1);
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
#endif

#if defined(__GNUC__) && defined(__x86_64__)
// The AVX-512 kernels' target, whatever -march says; they run only where the CPU has it.
#define CHATLOOM_WIDE __attribute__((target("avx512f,avx512bw,avx512vl")))

// Sixteen of a panel's block scales from element i, as float32.
CHATLOOM_WIDE inline __m512 load_scales16(ScalePtr s, int64_t i) {
  if (s.half) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(s.p) + i)));
  return _mm512_loadu_ps(static_cast<const float*>(s.p) + i);
}

// dequantize_panel in AVX-512, for the wide path's scratch panels (and the greedy head's exact
// recompute): the same w = fma(code, d, m) per weight (so the same bits), 16 features per instruction. 4-bit codes are looked up as tile_panels16
// does (vpermps on the low nibble, then a shift), where the AVX2 loop unpacks and converts two halves:
// at 32 rows the expansion was a fifth of the matmuls' time.
template <bool Q4>
CHATLOOM_WIDE inline void dequantize_panel16(const uint8_t* codes, ScalePtr scales, int64_t k_dim, float* dst) {
  const __m512 nibble_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t kb = 0; kb < k_dim / 32; ++kb) {
    const ScalePtr s = scales + kb * 2 * kPanel;
    const __m512 d = load_scales16(s, 0), m = load_scales16(s, kPanel);
    if constexpr (Q4) {
      for (int64_t k8 = kb * 32; k8 < (kb + 1) * 32; k8 += 8) {
        __m512i v = _mm512_loadu_si512(codes + k8 * 8);
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          _mm512_storeu_ps(dst + (k8 + t) * kPanel, _mm512_fmadd_ps(_mm512_permutexvar_ps(v, nibble_values), d, m));
          v = _mm512_srli_epi32(v, 4);
        }
      }
    } else {
#pragma GCC unroll 4
      for (int64_t k = kb * 32; k < (kb + 1) * 32; ++k) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * kPanel));
        _mm512_storeu_ps(dst + k * kPanel, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d, m));
      }
    }
  }
}

#endif

}  // namespace chatloom_kernels
