// What the matmul kernels (gemm.cpp, int8_gemm.cpp, bf16_gemm.cpp, kquant.cpp) share: outputs come in
// panels of 16 features, a tile of rows x 16 accumulates in pairs of AVX registers, and the float
// kernels' tiles take their row count as a template argument.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#if defined(__AVX2__) && defined(__FMA__)
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

// fn(begin, end) over [0, n) in chunks of `chunk` items, each chunk going to whichever intra-op thread
// is free next. at::parallel_for splits the range evenly in advance, so a thread that the OS takes
// away for a moment (on two cores, the event loop streaming a token) holds up the whole call; here
// the other threads take its remaining chunks. Serial inside a parallel region, as at::parallel_for.
template <typename F>
inline void parallel_for_dynamic(int64_t n, int64_t chunk, const F& fn) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int threads = omp_in_parallel() ? 1 : (int)std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t c = 0; c < chunks; ++c) fn(c * chunk, std::min(n, (c + 1) * chunk));
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

}  // namespace chatloom_kernels
